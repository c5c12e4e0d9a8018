//! Live fan-out, the same way for every system: followers subscribe to one stream; a
//! writer appends event 0 and waits until every follower has it (all subscriptions are
//! live), then appends events 1..=N one per interval. Each delivery's latency is received
//! − acknowledged; it can be slightly negative where a system publishes and acknowledges
//! at the same moment.

use std::collections::HashMap;
use std::future::Future;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::stats::signed_ms;

/// What a follower task returns: (event number, when it arrived) for events 1..=N.
pub type Received = Vec<(u64, Instant)>;

/// A follower's side of the protocol: report readiness on first seeing event 0, then
/// record events 1..=`events` and return.
pub struct FollowerContext {
    pub ready: mpsc::Sender<()>,
    pub events: usize,
}

/// Runs one fan-out measurement and returns every delivery's latency in ms.
pub async fn measure<S, A, AF>(
    followers: usize,
    events: usize,
    interval: Duration,
    mut spawn_follower: S,
    mut append: A,
) -> anyhow::Result<Vec<f64>>
where
    S: FnMut(usize, FollowerContext) -> JoinHandle<anyhow::Result<Received>>,
    A: FnMut(u64) -> AF,
    AF: Future<Output = anyhow::Result<()>>,
{
    let (ready_tx, mut ready_rx) = mpsc::channel(followers.max(1));
    let tasks: Vec<_> = (0..followers)
        .map(|f| {
            spawn_follower(
                f,
                FollowerContext {
                    ready: ready_tx.clone(),
                    events,
                },
            )
        })
        .collect();
    drop(ready_tx);
    append(0).await?;
    for _ in 0..followers {
        tokio::time::timeout(Duration::from_secs(60), ready_rx.recv())
            .await
            .context("the followers did not all subscribe within 60 s")?
            .context("a follower failed before it subscribed")?;
    }
    let mut acked = HashMap::with_capacity(events);
    let mut tick = tokio::time::interval(interval);
    for k in 1..=events as u64 {
        tick.tick().await;
        append(k).await?;
        acked.insert(k, Instant::now());
    }
    let mut latencies = Vec::with_capacity(followers * events);
    for task in tasks {
        let received = tokio::time::timeout(Duration::from_secs(60), task)
            .await
            .context("a follower did not receive every event within 60 s")???;
        anyhow::ensure!(
            received.len() == events,
            "a follower received {} of {events} events",
            received.len()
        );
        for (k, at) in received {
            let ack = acked.get(&k).context("received an event nobody appended")?;
            latencies.push(signed_ms(*ack, at));
        }
    }
    Ok(latencies)
}
