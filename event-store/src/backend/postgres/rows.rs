//! How a session lies in the tables, as every statement reads and writes it: its state's
//! columns ([`Columns`], derived from its [`SessionMeta`], the one source of truth in the
//! row) and the rows its seqs are read from, down a fork's line of bases ([`line_cte`]).
//!
//! Promises:
//! - The columns beside `meta` are copies of it, for the queries that filter and order
//!   sessions, written in the same statement as `meta`; a state read back is `meta` alone
//!   ([`decode_meta`]), its first user text cut to the title (the whole text is in
//!   `first_user_text`, see [`super::schema`]).
//! - A session's seqs are read in one statement down its line, so a read is one snapshot
//!   of it: a fork's prefix materialized meanwhile (see [`super::deletion`]) is seen whole
//!   or not at all.

use prost::Message;

use crate::session::SessionMeta;
use crate::StoreError;

/// Events read per query by a subscription.
pub(super) const READ_BATCH: i64 = 500;
/// The rows a session's seqs are read from, `line(sid, hi)`: the session's own rows (`$1`),
/// then, for a fork sharing its parent's prefix, its base's rows with seq `<= base_seq`, and
/// so on down the line of bases (the `hi` of each is the least `base_seq` above it). A
/// session's own rows all have seqs above its `base_seq` (a fork's prefix is either its
/// base's or, once materialized, its own with no base), so the line's rows never overlap.
/// Read in one statement, it is one snapshot: a materialization (see [`super::deletion`]) is seen
/// whole or not at all.
macro_rules! line_cte {
    () => {
        "WITH RECURSIVE line(sid, hi) AS (\
         SELECT $1::text COLLATE \"C\", 9223372036854775807::bigint \
         UNION ALL SELECT s.base_session, least(l.hi, s.base_seq) \
         FROM line l JOIN agentlog_sessions s ON s.session_id = l.sid \
         WHERE s.base_session <> '') "
    };
}
pub(super) use line_cte;

/// The session state's columns, derived from its [`SessionMeta`].
pub(super) struct Columns {
    /// The state, its first user text cut to the title: the whole text is in
    /// `first_user_text`, written once (see `schema`), so that a long first message is not
    /// written again, into TOAST, by every append.
    pub(super) meta: Vec<u8>,
    pub(super) last_seq: i64,
    pub(super) updated: i64,
    pub(super) status: i32,
    /// When a claim may take the session ([`SessionMeta::claimable_from`]): its live
    /// lease's end, or a `model_retry`'s due time, whichever is later (0: at once). The
    /// column keeps its first name, `lease_expires_unix_ms`: the claims of every release
    /// read it as "not before", so release 0.1.0's replicas keep a parked session too
    /// (until they write its state again).
    pub(super) lease_expires: i64,
    pub(super) first_user_text: String,
    /// Whether the session is a fork (it may share a prefix with a base: dedup looks there
    /// too, see [`super::batch`]).
    pub(super) fork: bool,
    /// `PinSession` (schema version 8).
    pub(super) pinned: bool,
}

impl Columns {
    pub(super) fn of(meta: &SessionMeta) -> Columns {
        let title_len = meta.title_len();
        let meta_bytes = if title_len < meta.first_user_text.len() {
            let mut short = meta.clone();
            short.first_user_text.truncate(title_len);
            short.encode_to_vec()
        } else {
            meta.encode_to_vec()
        };
        Columns {
            meta: meta_bytes,
            last_seq: meta.last_seq as i64,
            updated: meta.updated_unix_ms,
            status: meta.status,
            lease_expires: meta.claimable_from(),
            first_user_text: meta.first_user_text.clone(),
            fork: meta.forked_from.is_some(),
            pinned: meta.pinned,
        }
    }
}

pub(super) fn decode_meta(bytes: Vec<u8>) -> Result<SessionMeta, StoreError> {
    SessionMeta::decode(bytes.as_slice())
        .map_err(|e| StoreError::Internal(format!("a session row does not decode: {e}")))
}

/// Events' searchable text as the rows of `agentlog_search` (see [`super::schema`]): one
/// array per column, for an insert over `unnest`. Only the kinds with searchable text
/// ([`crate::search::text`]) get a row.
#[derive(Default)]
pub(super) struct SearchRows {
    pub sessions: Vec<String>,
    pub seqs: Vec<i64>,
    pub times: Vec<i64>,
    pub kinds: Vec<&'static str>,
    /// The text, for the snippet and the check of each candidate (PostgreSQL's text holds
    /// no NUL: each is a space here).
    pub bodies: Vec<String>,
    /// The text's distinct words as a `tsvector` literal.
    pub words: Vec<String>,
}

/// The words of one event a `tsvector` holds at most, in bytes: PostgreSQL refuses one of
/// 1 MB or more, and an event of 1 MiB could hold that many distinct words. Words past it
/// (in sorted order) are not found on this backend.
const MAX_TSVECTOR_WORD_BYTES: usize = 256 << 10;

impl SearchRows {
    pub(super) fn add(&mut self, session_id: &str, event: &agentlog_proto::v1::Event) {
        let Some(searchable) = crate::search::text::searchable(event) else {
            return;
        };
        let words: std::collections::BTreeSet<String> =
            crate::search::text::words(&searchable.text)
                .map(|w| w.text)
                .collect();
        let mut literal = String::new();
        for word in words {
            if literal.len() + word.len() + 3 > MAX_TSVECTOR_WORD_BYTES {
                break;
            }
            // A word is letters and digits: nothing in it needs escaping.
            literal.push('\'');
            literal.push_str(&word);
            literal.push_str("' ");
        }
        self.sessions.push(session_id.to_string());
        self.seqs.push(event.seq as i64);
        self.times.push(event.ts_unix_ms);
        self.kinds.push(searchable.kind);
        self.bodies.push(searchable.text.replace('\0', " "));
        self.words.push(literal);
    }

    /// The six arrays as statement parameters, in the order of the column list
    /// `(session_id, seq, ts_unix_ms, kind, body, words)`.
    pub(super) fn params(&self) -> [&(dyn tokio_postgres::types::ToSql + Sync); 6] {
        [
            &self.sessions,
            &self.seqs,
            &self.times,
            &self.kinds,
            &self.bodies,
            &self.words,
        ]
    }
}
