//! `SearchSessions` over PostgreSQL's own full-text search: `agentlog_search` (schema
//! version 9) holds each event's searchable text and its words as a `tsvector` under a GIN
//! index, written by the append's own statement ([`super::batch`]), so an event is found
//! from its commit on, on every replica, and never before. A query's words become a
//! `tsquery` (every word, `word:*` for a prefix, a phrase as its words); the candidates come
//! newest first and each is checked against its text by the shared rules
//! ([`crate::search`]), which also decides phrases (the `tsvector` keeps no positions).
//!
//! **Forgetting a deleted session:** a candidate is taken only if its session's row is
//! live, in the query itself, so nothing of a session is found from the commit of its
//! tombstone on; its rows are deleted first in its erasure ([`super::deletion`]), by the
//! deleting replica or, if that one stopped, by any replica's sweep, and PostgreSQL's
//! vacuum then reclaims them as it does the events.
//!
//! **Catching up:** nothing to catch up after a crash (the rows commit with the events).
//! Sessions written before version 9 are listed in `agentlog_search_backfill`; every replica
//! runs [`backfill`], which writes one such session's rows and removes its entry in one
//! transaction (`SKIP LOCKED`: replicas share the work), until none is left.

use std::time::Duration;

use agentlog_proto::v1::{Event, SearchSessionsResponse};
use prost::Message;
use tokio_util::sync::CancellationToken;

use super::connection::{timed, Connector, Timed};
use super::replica::Replica;
use super::rows::{line_cte, SearchRows};
use crate::backend::SearchOp;
use crate::scope::Scope;
use crate::search::{self, Clause};
use crate::StoreError;

/// Candidates newest first after the page token's place, within the scope, of live
/// sessions. Run with bitmap scans allowed (the pool's connections plan without them, see
/// `Connector::new`): a GIN index is read only through one.
const CANDIDATES: &str = "SELECT s.session_id, s.seq, s.ts_unix_ms, s.kind, s.body \
     FROM agentlog_search s \
     JOIN agentlog_sessions x ON x.session_id = s.session_id AND x.deleted_unix_ms = 0 \
     WHERE s.words @@ $1::text::tsquery \
     AND ($2 OR EXISTS (SELECT 1 FROM unnest($3::text[]) p \
     WHERE starts_with(s.session_id, p))) \
     AND ($4::bigint IS NULL OR (s.ts_unix_ms, s.session_id, s.seq) < ($4, $5::text, $6)) \
     ORDER BY s.ts_unix_ms DESC, s.session_id DESC, s.seq DESC \
     LIMIT $7";

/// Writes [`SearchRows`] (`$1`–`$6`: sessions, seqs, times, kinds, bodies, words): the
/// backfill's, and an import's for the events it stages (`super::import`), in their own
/// transactions. The append's and the fork's rows are written by their own statements.
pub(super) const INSERT_ROWS: &str =
    "INSERT INTO agentlog_search (session_id, seq, ts_unix_ms, kind, body, words) \
     SELECT x.session_id, x.seq, x.ts_unix_ms, x.kind, x.body, x.words::tsvector \
     FROM unnest($1::text[], $2::bigint[], $3::bigint[], $4::text[], $5::text[], \
     $6::text[]) AS x(session_id, seq, ts_unix_ms, kind, body, words) \
     ON CONFLICT (session_id, seq) DO NOTHING";

/// Where a page ends: the newest-first order's key of the last candidate looked at.
type Cursor = (i64, String, i64);

fn parse_token(token: &str) -> Result<Option<Cursor>, StoreError> {
    if token.is_empty() {
        return Ok(None);
    }
    let bad = || {
        StoreError::InvalidArgument(
            "page_token: not a token from a previous SearchSessions response".into(),
        )
    };
    let mut parts = token.strip_prefix('p').ok_or_else(bad)?.splitn(3, '.');
    let ts = parts.next().and_then(|t| t.parse().ok()).ok_or_else(bad)?;
    let seq = parts.next().and_then(|t| t.parse().ok()).ok_or_else(bad)?;
    let session = parts.next().ok_or_else(bad)?.to_string();
    Ok(Some((ts, session, seq)))
}

/// The query as a `tsquery`: every clause's words, joined by `&`.
fn tsquery(query: &search::Query) -> String {
    let mut terms: Vec<String> = Vec::new();
    for clause in &query.clauses {
        // A word is letters and digits: nothing in it needs quoting beyond the quotes.
        match clause {
            Clause::Word(w) => terms.push(format!("'{w}'")),
            Clause::Prefix(p) => terms.push(format!("'{p}':*")),
            Clause::Phrase(words) => terms.extend(words.iter().map(|w| format!("'{w}'"))),
        }
    }
    terms.join(" & ")
}

impl Replica {
    pub(super) async fn search(
        &self,
        op: SearchOp,
        scope: &Scope,
    ) -> Result<SearchSessionsResponse, StoreError> {
        if !self.search {
            return Err(StoreError::Unavailable(
                "this store runs without its search index (--no-search-index)".into(),
            ));
        }
        let mut cursor = parse_token(&op.page_token)?;
        let all = scope.is_everything();
        let prefixes: Vec<String> = scope
            .prefix_list()
            .map(<[String]>::to_vec)
            .unwrap_or_default();
        let tsquery = tsquery(&op.query);
        let mut client = self.client().await?;
        let mut hits = Vec::new();
        let mut looked = 0;
        let mut round = 0;
        loop {
            let wanted = search::batch_for(op.page_size - hits.len(), round);
            round += 1;
            let (ts, session, seq) = match &cursor {
                Some((ts, session, seq)) => (Some(*ts), session.clone(), *seq),
                None => (None, String::new(), 0),
            };
            let limit = wanted as i64;
            let rows = timed("search", async {
                let tx = client.transaction().await?;
                tx.batch_execute("SET LOCAL enable_bitmapscan = on").await?;
                let rows = tx
                    .query(
                        CANDIDATES,
                        &[&tsquery, &all, &prefixes, &ts, &session, &seq, &limit],
                    )
                    .await?;
                tx.commit().await?;
                Ok::<_, tokio_postgres::Error>(rows)
            })
            .await
            .map_err(|e| self.timed_error(e))?;
            let mut exhausted = rows.len() < wanted;
            for (i, row) in rows.iter().enumerate() {
                let session_id: String = row.get(0);
                let seq: i64 = row.get(1);
                let ts_unix_ms: i64 = row.get(2);
                let kind: String = row.get(3);
                let body: String = row.get(4);
                looked += 1;
                let hit = search::hit(
                    &op.query,
                    search::Candidate {
                        session_id: &session_id,
                        seq: seq as u64,
                        ts_unix_ms,
                        kind: &kind,
                        text: &body,
                    },
                );
                cursor = Some((ts_unix_ms, session_id, seq));
                if let Some(hit) = hit {
                    hits.push(hit);
                    if hits.len() == op.page_size {
                        // More only if candidates are left after this one.
                        exhausted &= i + 1 == rows.len();
                        break;
                    }
                }
            }
            let full = hits.len() == op.page_size;
            if full || exhausted || looked >= search::MAX_CANDIDATES_PER_PAGE {
                let more = !exhausted;
                return Ok(SearchSessionsResponse {
                    hits,
                    next_page_token: match (more, &cursor) {
                        (true, Some((ts, session, seq))) => format!("p{ts}.{seq}.{session}"),
                        _ => String::new(),
                    },
                });
            }
        }
    }
}

/// How often a replica looks for sessions left to backfill.
const BACKFILL_EVERY: Duration = Duration::from_secs(30);
/// Events read per statement while backfilling a session.
const BACKFILL_BATCH: i64 = 1000;

/// Writes the search rows of the sessions written before schema version 9, one session a
/// transaction, until none is left (see the module head); then looks again now and then
/// (a replica of an earlier version may still write sessions during a rolling update, and
/// the migration listed only the sessions it found).
pub(super) async fn backfill(connector: std::sync::Arc<Connector>, stop: CancellationToken) {
    loop {
        match backfill_one(&connector).await {
            Ok(true) => continue,
            Ok(false) => {}
            Err(e) => {
                tracing::warn!(error = %e, "backfilling the search rows failed; trying again")
            }
        }
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tokio::time::sleep(BACKFILL_EVERY) => {}
        }
    }
}

/// A backfill step's error, as the task logs it.
fn failed(e: Timed) -> String {
    match e {
        Timed::Db(e) => e.to_string(),
        Timed::Elapsed => "the database did not answer".to_string(),
    }
}

/// Backfills one session; whether there was one.
async fn backfill_one(connector: &Connector) -> Result<bool, String> {
    let mut client = connector.pool.get().await.map_err(|e| e.to_string())?;
    let tx = timed("search_backfill", client.transaction())
        .await
        .map_err(failed)?;
    let Some(row) = timed(
        "search_backfill",
        tx.query_opt(
            "SELECT session_id FROM agentlog_search_backfill LIMIT 1 FOR UPDATE SKIP LOCKED",
            &[],
        ),
    )
    .await
    .map_err(failed)?
    else {
        return Ok(false);
    };
    let session_id: String = row.get(0);
    // A deleted session gets no rows: its erasure, which follows its tombstone, would only
    // delete them again. (Deleted between this look and the commit, its rows are deleted
    // by that erasure, which waits for this transaction's lock on the backfill entry.)
    let live = timed(
        "search_backfill",
        tx.query_opt(
            "SELECT 1 FROM agentlog_sessions WHERE session_id = $1 AND deleted_unix_ms = 0",
            &[&session_id],
        ),
    )
    .await
    .map_err(failed)?
    .is_some();
    if live {
        write_rows(&tx, &session_id).await?;
    }
    timed(
        "search_backfill",
        tx.execute(
            "DELETE FROM agentlog_search_backfill WHERE session_id = $1",
            &[&session_id],
        ),
    )
    .await
    .map_err(failed)?;
    timed("search_backfill", tx.commit())
        .await
        .map_err(failed)?;
    Ok(true)
}

/// Writes the search rows of a session's whole line (a fork's shared prefix included),
/// [`BACKFILL_BATCH`] events at a time.
async fn write_rows(tx: &tokio_postgres::Transaction<'_>, session_id: &str) -> Result<(), String> {
    let mut from = 1i64;
    loop {
        let rows = timed(
            "search_backfill",
            tx.query(
                concat!(
                    line_cte!(),
                    "SELECT e.seq, e.body FROM line l CROSS JOIN LATERAL (\
                     SELECT seq, body FROM agentlog_events WHERE session_id = l.sid \
                     AND seq >= $2 AND seq <= l.hi ORDER BY seq LIMIT $3) e \
                     ORDER BY e.seq LIMIT $3"
                ),
                &[&session_id, &from, &BACKFILL_BATCH],
            ),
        )
        .await
        .map_err(failed)?;
        let mut searched = SearchRows::default();
        for row in &rows {
            let seq: i64 = row.get(0);
            from = seq + 1;
            let body: &[u8] = row.get(1);
            let event = Event::decode(body).map_err(|e| format!("{session_id}/{seq}: {e}"))?;
            searched.add(session_id, &event);
        }
        timed(
            "search_backfill",
            tx.execute(INSERT_ROWS, &searched.params()),
        )
        .await
        .map_err(failed)?;
        if (rows.len() as i64) < BACKFILL_BATCH {
            return Ok(());
        }
    }
}
