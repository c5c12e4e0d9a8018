//! `SearchSessions`, the part both backends share: what of an event is searchable and what a
//! word is ([`text`]), what a query means ([`query`]), and how a hit is shown
//! ([`snippet`]). The backends keep an index of the words (the local one: a tantivy index
//! fed from the log, `backend::local::search`; PostgreSQL: its own full-text search,
//! `backend::postgres::search`) and ask it for candidates, newest first; every candidate is
//! then checked here against the event's own text ([`hit`]) before it is shown, so an index
//! that is behind, or a word match that is not the phrase, never shows a wrong hit.

pub mod query;
pub mod snippet;
pub mod text;

use agentlog_proto::v1::SearchHit;

pub use query::{parse, Clause, Query, QueryError};

/// Hits in one page when the request leaves `page_size` at 0.
pub const DEFAULT_PAGE_SIZE: usize = 20;
/// Hits in one page at most.
pub const MAX_PAGE_SIZE: usize = 100;
/// Candidates one call looks at, at most, before it answers with what it found and a token
/// to go on from: a query whose words are common but whose phrase is rare costs a bounded
/// amount per page.
pub const MAX_CANDIDATES_PER_PAGE: usize = 5_000;

/// An event found by an index, as a hit: where it is, its kind and searchable text.
pub struct Candidate<'a> {
    pub session_id: &'a str,
    pub seq: u64,
    pub ts_unix_ms: i64,
    pub kind: &'a str,
    pub text: &'a str,
}

/// The hit for a candidate, if its text matches `query`: with its snippet.
pub fn hit(query: &Query, candidate: Candidate) -> Option<SearchHit> {
    let words = text::words(candidate.text).collect::<Vec<_>>();
    let at = query.first_match(&words)?;
    Some(SearchHit {
        session_id: candidate.session_id.to_string(),
        seq: candidate.seq,
        kind: candidate.kind.to_string(),
        snippet: snippet::around(candidate.text, &words, at),
        ts_unix_ms: candidate.ts_unix_ms,
    })
}

/// How many candidates to ask the index for, to fill `wanted` more hits at the `round`th
/// ask of one page: a few more than that (a candidate may still fail the check), twice as
/// many at each further ask (a phrase of common words fails most of them, and each ask
/// costs the index a walk of every match).
pub fn batch_for(wanted: usize, round: u32) -> usize {
    ((wanted + 1).max(32) << round.min(7)).min(MAX_CANDIDATES_PER_PAGE)
}
