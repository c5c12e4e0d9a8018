//! The reconnecting follower: a session's events handed over exactly once each, in seq
//! order, with no gap, across store restarts and cut connections.
//!
//! Promise: the follower keeps `next`, the seq after the last event it handed over; every
//! (re)subscription asks for `from_seq = next`, and anything else a stream yields (an
//! overlap, a gap) is dropped or answered with a fresh subscription from `next`. The
//! store's own promise (a seq once seen always means the same event) makes that enough.
//! The next event is asked of the store only once the callback's future is done, so a slow
//! consumer holds the stream back instead of buffering it. A session that was deleted
//! (reason `SESSION_DELETED`, on the subscription or in its stream) ends the follow with
//! [`FollowError::Refused`] whatever [`Refusals`] says: it is gone for good, and nothing
//! will ever follow.

use std::future::Future;

use agentlog_proto::v1::{Event, SubscribeRequest};
use tokio_stream::StreamExt;

use crate::refusal::is_session_deleted;
use crate::retry::{is_transient, Backoff};
use crate::StoreClient;

/// What the callback wants next.
#[derive(Debug, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Stop,
}

/// What a refusal that is not transient (a bad session id, a denied caller, a limit) does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusals {
    /// Ends the follow with [`FollowError::Refused`] (a person reads the message).
    End,
    /// Is retried with backoff like an outage (a runner following the session it holds:
    /// the lease, not the follower, decides when to stop), except a deleted session's.
    Retry,
}

/// Something the follower went through, for the caller to report.
#[derive(Debug)]
pub enum Note<'a> {
    /// The store could not be reached, or refused the subscription; retrying from `next`.
    Unreachable {
        next: u64,
        status: &'a tonic::Status,
    },
    /// The stream ended or failed; resubscribing from `next`.
    Ended {
        next: u64,
        status: Option<&'a tonic::Status>,
    },
    /// The stream skipped from `next` to `seq`; resubscribing from `next`.
    Gap { next: u64, seq: u64 },
    /// Subscribed again after an outage; following from `next`.
    Resumed { next: u64 },
}

#[derive(Debug, thiserror::Error)]
pub enum FollowError<E> {
    /// The store refused the subscription (with [`Refusals::End`], or because the session
    /// was deleted).
    #[error("the event store refused the subscription: {}", .0.message())]
    Refused(tonic::Status),
    /// The callback failed.
    #[error(transparent)]
    Callback(E),
}

/// Whether `status` ends the follow rather than being retried.
fn ends(status: &tonic::Status, refusals: Refusals) -> bool {
    is_session_deleted(status) || (!is_transient(status) && refusals == Refusals::End)
}

/// Follows `session_id` from `from_seq` until `on_event` says stop (or forever), waiting
/// [`Backoff::STORE`] between attempts after any failure; `note` hears of every outage.
pub async fn follow<F, Fut, E>(
    client: &StoreClient,
    session_id: &str,
    from_seq: u64,
    refusals: Refusals,
    mut note: impl FnMut(Note<'_>),
    mut on_event: F,
) -> Result<(), FollowError<E>>
where
    F: FnMut(Event) -> Fut,
    Fut: Future<Output = Result<Flow, E>>,
{
    let mut next = from_seq.max(1);
    let mut failures = 0u32;
    let mut outage = false;
    loop {
        let subscribed = client
            .clone()
            .subscribe(SubscribeRequest {
                session_id: session_id.to_string(),
                from_seq: next,
                follow: true,
            })
            .await;
        match subscribed {
            Ok(response) => {
                if outage {
                    note(Note::Resumed { next });
                    outage = false;
                }
                let mut stream = response.into_inner();
                loop {
                    match stream.next().await {
                        Some(Ok(event)) if event.seq < next => {} // already handed over
                        Some(Ok(event)) if event.seq > next => {
                            // Never skip: subscribe again from the first seq not yet seen.
                            note(Note::Gap {
                                next,
                                seq: event.seq,
                            });
                            break;
                        }
                        Some(Ok(event)) => {
                            next = event.seq + 1;
                            failures = 0;
                            let flow = on_event(event).await.map_err(FollowError::Callback)?;
                            if flow == Flow::Stop {
                                return Ok(());
                            }
                        }
                        Some(Err(status)) if ends(&status, refusals) => {
                            return Err(FollowError::Refused(status));
                        }
                        Some(Err(status)) => {
                            note(Note::Ended {
                                next,
                                status: Some(&status),
                            });
                            outage = true;
                            break;
                        }
                        None => {
                            note(Note::Ended { next, status: None });
                            outage = true;
                            break;
                        }
                    }
                }
            }
            Err(status) if ends(&status, refusals) => {
                return Err(FollowError::Refused(status));
            }
            Err(status) => {
                if !outage {
                    note(Note::Unreachable {
                        next,
                        status: &status,
                    });
                    outage = true;
                }
            }
        }
        failures += 1;
        tokio::time::sleep(Backoff::STORE.delay(failures, None)).await;
    }
}

#[cfg(test)]
mod tests {
    use agentlog_proto::reason::Reason;
    use tonic::Status;

    use super::*;

    #[test]
    fn a_deleted_session_ends_the_follow_whatever_the_refusals_say() {
        let deleted = Reason::SessionDeleted.status("deleted");
        assert!(ends(&deleted, Refusals::Retry) && ends(&deleted, Refusals::End));
        let not_found = Reason::SessionNotFound.status("none");
        assert!(!ends(&not_found, Refusals::Retry) && ends(&not_found, Refusals::End));
        let outage = Status::unavailable("down");
        assert!(!ends(&outage, Refusals::Retry) && !ends(&outage, Refusals::End));
    }
}
