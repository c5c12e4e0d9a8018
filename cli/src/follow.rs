//! The reconnecting follower behind `tail`, `send` and the web view's event streams:
//! `agentlog_client::follow` with the outages it rides out reported on stderr.

use std::future::Future;

use agentlog_client::follow::{self as client_follow, FollowError, Note, Refusals};
use agentlog_proto::v1::Event;
use anyhow::Result;

pub use agentlog_client::follow::Flow;

use crate::store;

/// Follows `session` from `from_seq` until `on_event` says stop (or forever). Connection
/// problems are retried with backoff and reported on stderr; a request the store refuses
/// (a bad session id) is an error.
pub async fn follow(
    addr: &str,
    session: &str,
    from_seq: u64,
    mut on_event: impl FnMut(&Event) -> Result<Flow>,
) -> Result<()> {
    follow_async(addr, session, from_seq, |event| {
        std::future::ready(on_event(&event))
    })
    .await
}

/// [`follow`] with a callback that may wait (e.g. for room in a reader's buffer): the
/// next event is asked of the store only once the callback's future is done.
pub async fn follow_async<F, Fut>(
    addr: &str,
    session: &str,
    from_seq: u64,
    on_event: F,
) -> Result<()>
where
    F: FnMut(Event) -> Fut,
    Fut: Future<Output = Result<Flow>>,
{
    let client = store::client(store::endpoint(addr)?.connect_lazy());
    let url = store::normalize(addr);
    let note = |note: Note<'_>| match note {
        Note::Unreachable { next, .. } => {
            eprintln!("agentlog: lost the event store at {url}; reconnecting from seq {next}")
        }
        Note::Ended { next, .. } => {
            eprintln!("agentlog: the stream from {url} ended; reconnecting from seq {next}")
        }
        Note::Gap { next, seq } => {
            eprintln!("agentlog: the stream jumped from seq {next} to {seq}; resubscribing")
        }
        Note::Resumed { next } => eprintln!("agentlog: reconnected; following from seq {next}"),
    };
    match client_follow::follow(&client, session, from_seq, Refusals::End, note, on_event).await {
        Ok(()) => Ok(()),
        Err(FollowError::Refused(status)) => Err(store::explain(addr, "Subscribe", status)),
        Err(FollowError::Callback(e)) => Err(e),
    }
}
