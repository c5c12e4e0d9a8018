//! The queries every backend answers the same way: which sessions a `ListSessions` request
//! asks for and how its pages follow each other, and the `ClaimSession` long-poll around a
//! backend's single claim attempt.

use std::time::Duration;

use agentlog_proto::v1::SessionStatus;
use agentlog_proto::v1::{Lease, ListSessionsRequest, ListSessionsResponse, SessionInfo};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::clock::now_unix_ms;
use crate::error::StoreError;
use crate::session::SessionMeta;

/// Sessions per page, at most.
const MAX_PAGE: usize = 1000;
/// Sessions per page when the request does not say.
const DEFAULT_PAGE: usize = 100;
/// Sessions a `query` looks at per call (per status, on the local backend), at most: its
/// page ends where it stopped, with a token to go on from there.
pub const QUERY_SCAN: usize = 10_000;

/// A checked `ListSessions` request (the caller's scope is applied beside it).
#[derive(Debug, Clone, PartialEq)]
pub struct ListQuery {
    pub page_size: usize,
    /// `updated_unix_ms` and session id of the last session of the previous page.
    pub after: Option<(i64, String)>,
    /// `Unspecified`: any status.
    pub status: SessionStatus,
    /// Lower-cased; matched in the session id and the first user message. Empty: any.
    pub text: String,
}

impl ListQuery {
    pub fn parse(req: &ListSessionsRequest) -> Result<ListQuery, StoreError> {
        let page_size = match req.page_size as usize {
            0 => DEFAULT_PAGE,
            n => n.min(MAX_PAGE),
        };
        let status = SessionStatus::try_from(req.status).map_err(|_| {
            StoreError::InvalidArgument(format!("status: {} is not a SessionStatus", req.status))
        })?;
        Ok(ListQuery {
            page_size,
            after: parse_page_token(&req.page_token)?,
            status,
            text: req.query.to_lowercase(),
        })
    }

    /// Whether the session belongs on this page or a later one (scope aside).
    pub fn admits(&self, session_id: &str, meta: &SessionMeta) -> bool {
        self.admits_but_text(session_id, meta) && self.matches_text(session_id, meta)
    }

    /// [`ListQuery::admits`] but for the text, which the state may not hold yet.
    pub fn admits_but_text(&self, session_id: &str, meta: &SessionMeta) -> bool {
        meta.last_seq > 0
            && !meta.is_deleted()
            && (self.status == SessionStatus::Unspecified || meta.status() == self.status)
            && self.after.as_ref().is_none_or(|(t, last)| {
                listed_before(
                    &(*t, last.clone()),
                    &(meta.updated_unix_ms, session_id.to_string()),
                )
            })
    }

    /// Whether the query's text is in the session's id or first user message.
    pub fn matches_text(&self, session_id: &str, meta: &SessionMeta) -> bool {
        self.text.is_empty()
            || session_id.to_lowercase().contains(&self.text)
            || meta.first_user_text.to_lowercase().contains(&self.text)
    }

    /// The page from `sorted` (most recently updated first, then by id, as `ListSessions`
    /// orders; at least one more than a page if there is a next page).
    pub fn page(&self, sorted: Vec<(i64, String, SessionInfo)>) -> ListSessionsResponse {
        self.page_through(sorted, None)
    }

    /// [`ListQuery::page`] of a query that looked only as far as `looked_to` (its budget
    /// ran out there): a short page then ends with a token that goes on from there.
    pub fn page_through(
        &self,
        mut sorted: Vec<(i64, String, SessionInfo)>,
        looked_to: Option<(i64, String)>,
    ) -> ListSessionsResponse {
        let more = sorted.len() > self.page_size;
        sorted.truncate(self.page_size);
        let next_page_token = match (more, sorted.last(), looked_to) {
            (true, Some((t, id, _)), _) => format!("{t}/{id}"),
            (false, _, Some((t, id))) => format!("{t}/{id}"),
            _ => String::new(),
        };
        ListSessionsResponse {
            sessions: sorted.into_iter().map(|(_, _, info)| info).collect(),
            next_page_token,
        }
    }
}

/// Whether `a` comes before `b` in `ListSessions`' order: most recently updated first,
/// then by id.
pub fn listed_before(a: &(i64, String), b: &(i64, String)) -> bool {
    a.0 > b.0 || (a.0 == b.0 && a.1 < b.1)
}

/// `updated_unix_ms/session_id` of the last session of the previous page.
fn parse_page_token(token: &str) -> Result<Option<(i64, String)>, StoreError> {
    if token.is_empty() {
        return Ok(None);
    }
    let bad = || {
        StoreError::InvalidArgument(
            "page_token: not a token from a previous ListSessions response".into(),
        )
    };
    let (t, id) = token.split_once('/').ok_or_else(bad)?;
    Ok(Some((t.parse().map_err(|_| bad())?, id.to_string())))
}

/// What one claim attempt found.
pub enum ClaimAttempt {
    Granted(Lease),
    /// No claimable session now; the earliest time a runnable session becomes claimable (a
    /// live lease runs out, a `model_retry` falls due), if any.
    Nothing {
        next_expiry_unix_ms: Option<i64>,
    },
}

/// The `ClaimSession` long-poll: runs `attempt` until it grants a lease, `wait` passes or
/// `cancel` fires (`None`). It tries again whenever `changes` says a session may have
/// become claimable, when the earliest live lease the last attempt reported expires, and
/// every `poll` if given (for changes that send no signal here).
pub async fn long_poll_claim<F, Fut>(
    wait: Duration,
    cancel: &CancellationToken,
    mut changes: watch::Receiver<u64>,
    poll: Option<Duration>,
    mut attempt: F,
) -> Result<Option<Lease>, StoreError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<ClaimAttempt, StoreError>>,
{
    let deadline = Instant::now() + wait;
    loop {
        changes.borrow_and_update();
        let retry_at = match attempt().await? {
            ClaimAttempt::Granted(lease) => return Ok(Some(lease)),
            ClaimAttempt::Nothing {
                next_expiry_unix_ms,
            } => next_expiry_unix_ms,
        };
        let mut wake = deadline;
        if let Some(poll) = poll {
            wake = wake.min(Instant::now() + poll);
        }
        if let Some(at) = retry_at {
            let in_ms = (at - now_unix_ms()).max(0) as u64 + 1;
            wake = wake.min(Instant::now() + Duration::from_millis(in_ms));
        }
        tokio::select! {
            _ = cancel.cancelled() => return Ok(None),
            _ = changes.changed() => {}
            _ = tokio::time::sleep_until(wake) => {}
        }
        if Instant::now() >= deadline {
            return Ok(None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentlog_proto::v1::{event, Event, UserMessage};

    fn session(text: &str, updated: i64) -> SessionMeta {
        let mut meta = SessionMeta::default();
        meta.apply_event(&Event {
            seq: 1,
            ts_unix_ms: updated,
            kind: Some(event::Kind::UserMessage(UserMessage { text: text.into() })),
            ..Event::default()
        });
        meta
    }

    fn query(req: ListSessionsRequest) -> ListQuery {
        ListQuery::parse(&req).expect("valid")
    }

    #[test]
    fn a_request_is_checked_and_defaults_apply() {
        let q = query(ListSessionsRequest::default());
        assert_eq!((q.page_size, q.after.clone()), (DEFAULT_PAGE, None));
        let big = query(ListSessionsRequest {
            page_size: 50_000,
            page_token: "17/acme:1".into(),
            query: "Fix".into(),
            ..ListSessionsRequest::default()
        });
        assert_eq!(big.page_size, MAX_PAGE);
        assert_eq!(big.after, Some((17, "acme:1".into())));
        assert_eq!(big.text, "fix");
        for token in ["17", "x/acme:1"] {
            let bad = ListSessionsRequest {
                page_token: token.into(),
                ..ListSessionsRequest::default()
            };
            assert!(matches!(
                ListQuery::parse(&bad),
                Err(StoreError::InvalidArgument(_))
            ));
        }
        let bad_status = ListSessionsRequest {
            status: 99,
            ..ListSessionsRequest::default()
        };
        assert!(ListQuery::parse(&bad_status).is_err());
    }

    #[test]
    fn sessions_match_by_status_text_and_page_position() {
        let meta = session("Fix the build", 100);
        assert!(query(ListSessionsRequest::default()).admits("a", &meta));
        assert!(!query(ListSessionsRequest::default()).admits("a", &SessionMeta::default()));
        let text = |q: &str| {
            query(ListSessionsRequest {
                query: q.into(),
                ..ListSessionsRequest::default()
            })
        };
        assert!(text("BUILD").admits("a", &meta));
        assert!(text("acme").admits("ACME:1", &meta));
        assert!(!text("deploy").admits("a", &meta));
        let idle = query(ListSessionsRequest {
            status: SessionStatus::Idle as i32,
            ..ListSessionsRequest::default()
        });
        assert!(!idle.admits("a", &meta), "a new session is runnable");
        let after = |token: &str| {
            query(ListSessionsRequest {
                page_token: token.into(),
                ..ListSessionsRequest::default()
            })
        };
        assert!(after("101/a").admits("a", &meta), "older comes after");
        assert!(after("100/a").admits("b", &meta), "same time: by id");
        assert!(!after("100/b").admits("a", &meta));
        assert!(!after("99/a").admits("z", &meta));
    }

    #[test]
    fn a_full_page_names_where_the_next_one_starts() {
        let q = query(ListSessionsRequest {
            page_size: 2,
            ..ListSessionsRequest::default()
        });
        let row = |t: i64, id: &str| (t, id.to_string(), SessionInfo::default());
        let page = q.page(vec![row(9, "a"), row(8, "b"), row(7, "c")]);
        assert_eq!(page.sessions.len(), 2);
        assert_eq!(page.next_page_token, "8/b");
        let last = q.page(vec![row(9, "a"), row(8, "b")]);
        assert_eq!(last.next_page_token, "");
    }
}
