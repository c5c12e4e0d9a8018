//! The reconnecting follower behind `tail`, `send` and the web view's event streams.
//!
//! Promise: the callback sees the session's events exactly once each, in seq order, with no
//! gap — across store restarts and cut connections. It keeps `next`, the seq after the last
//! event it handed over; every (re)subscription asks for `from_seq = next`, and anything
//! else the stream yields (an overlap, a gap) is dropped or answered with a fresh
//! subscription from `next`. The store's own promise (a seq once seen always means the same
//! event) makes that enough.

use std::future::Future;

use agentlog_proto::v1::{Event, SubscribeRequest};
use anyhow::Result;
use tokio_stream::StreamExt;

use crate::store::{self, Backoff};

/// What the callback wants next.
#[derive(Debug, PartialEq, Eq)]
pub enum Flow {
    Continue,
    Stop,
}

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
    mut on_event: F,
) -> Result<()>
where
    F: FnMut(Event) -> Fut,
    Fut: Future<Output = Result<Flow>>,
{
    let mut next = from_seq.max(1);
    let mut backoff = Backoff::new();
    let mut outage = false;
    loop {
        let channel = match store::endpoint(addr)?.connect().await {
            Ok(channel) => channel,
            Err(_) => {
                if !outage {
                    eprintln!(
                        "agentlog: lost the event store at {}; reconnecting from seq {next}",
                        store::normalize(addr)
                    );
                    outage = true;
                }
                backoff.wait().await;
                continue;
            }
        };
        let mut client = store::client(channel);
        let request = SubscribeRequest {
            session_id: session.to_string(),
            from_seq: next,
            follow: true,
        };
        let mut stream = match client.subscribe(request).await {
            Ok(response) => response.into_inner(),
            Err(status) if store::is_transient(&status) => {
                backoff.wait().await;
                continue;
            }
            Err(status) => return Err(store::explain(addr, "Subscribe", status)),
        };
        if outage {
            eprintln!("agentlog: reconnected; following from seq {next}");
            outage = false;
        }
        loop {
            match stream.next().await {
                Some(Ok(event)) if event.seq < next => {} // already handed over
                Some(Ok(event)) if event.seq > next => {
                    // Never skip: subscribe again from the first seq not yet seen.
                    eprintln!(
                        "agentlog: the stream jumped from seq {next} to {}; resubscribing",
                        event.seq
                    );
                    break;
                }
                Some(Ok(event)) => {
                    next = event.seq + 1;
                    backoff.reset();
                    if on_event(event).await? == Flow::Stop {
                        return Ok(());
                    }
                }
                Some(Err(status)) if !store::is_transient(&status) => {
                    return Err(store::explain(addr, "Subscribe", status));
                }
                Some(Err(_)) | None => {
                    eprintln!(
                        "agentlog: the stream from {} ended; reconnecting from seq {next}",
                        store::normalize(addr)
                    );
                    outage = true;
                    break;
                }
            }
        }
        backoff.wait().await;
    }
}
