//! Followers at scale: what an idle `Subscribe(follow)` stream costs the store, and whether
//! an append still reaches its follower as fast with many of them open.
//!
//! On a fresh store: N sessions of one event each. One follower on the first, and events
//! appended to it one per interval: the latency alone (sent → received). The store's
//! RSS; then a follower on each of the other sessions (100 streams per HTTP/2 connection),
//! every one live (it has its session's first event); the RSS again, and the difference per
//! follower (their connections included). Then events appended one per interval to sessions
//! spread over all N, each timed to its follower: the latency among N. Latency here runs
//! from the append's sending (its commit included), never negative, so that the two compare
//! as a ratio.

use std::time::{Duration, Instant};

use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::{AppendRequest, SubscribeRequest};
use anyhow::Context;
use testkit::Store;
use tokio::sync::mpsc;
use tonic::transport::Channel;

use crate::agentlog::{rss, user_event};
use crate::stats::signed_ms;

/// Follow streams per HTTP/2 connection.
const STREAMS_PER_CONNECTION: usize = 100;

pub struct FollowersResult {
    pub followers: usize,
    /// Between two timed appends.
    pub interval: Duration,
    /// The store's RSS before any follower, and with all of them open.
    pub rss_before: u64,
    pub rss_after: u64,
    /// Delivery latencies (ms) with one follower, and with `followers` open.
    pub alone_ms: Vec<f64>,
    pub among_ms: Vec<f64>,
}

fn session(i: usize) -> String {
    format!("follow-{i:06}")
}

/// Follows session `i` from seq 1: tells `ready` once it has the session's first event,
/// then reports every later one (session, seq, when it arrived) on `arrived`.
fn follow(
    channel: Channel,
    i: usize,
    ready: mpsc::Sender<()>,
    arrived: mpsc::UnboundedSender<(usize, u64, Instant)>,
) -> tokio::task::JoinHandle<anyhow::Result<()>> {
    tokio::spawn(async move {
        let mut stream = EventStoreClient::new(channel)
            .subscribe(SubscribeRequest {
                session_id: session(i),
                from_seq: 1,
                follow: true,
            })
            .await?
            .into_inner();
        while let Some(event) = stream.message().await? {
            let at = Instant::now();
            if event.seq == 1 {
                let _ = ready.send(()).await;
            } else if arrived.send((i, event.seq, at)).is_err() {
                break;
            }
        }
        anyhow::Ok(())
    })
}

/// Appends one event to each of `targets` in turn, one per `interval`, and times each from
/// its sending to its follower's receipt.
async fn deliveries(
    writer: &mut EventStoreClient<Channel>,
    arrived: &mut mpsc::UnboundedReceiver<(usize, u64, Instant)>,
    targets: impl Iterator<Item = usize>,
    interval: Duration,
) -> anyhow::Result<Vec<f64>> {
    let mut latencies = Vec::new();
    let mut tick = tokio::time::interval(interval);
    for i in targets {
        tick.tick().await;
        let sent = Instant::now();
        let response = writer
            .append(AppendRequest {
                session_id: session(i),
                events: vec![user_event(crate::event_text())],
                ..Default::default()
            })
            .await?
            .into_inner();
        let seq = response.last_seq;
        loop {
            let (from, got, at) = tokio::time::timeout(Duration::from_secs(60), arrived.recv())
                .await
                .context("a follower did not get its event within 60 s")?
                .context("the followers stopped")?;
            if from == i && got == seq {
                latencies.push(signed_ms(sent, at));
                break;
            }
        }
    }
    Ok(latencies)
}

pub async fn measure(
    data_dir: &std::path::Path,
    followers: usize,
    events: usize,
    interval: Duration,
) -> anyhow::Result<FollowersResult> {
    let store = Store::start_in(data_dir)?;
    let url = store.url();
    crate::agentlog::fill_sessions(&url, followers, 1, session).await?;
    let mut writer = EventStoreClient::connect(url.clone()).await?;
    let mut channels = Vec::new();
    for _ in 0..followers.div_ceil(STREAMS_PER_CONNECTION) {
        channels.push(
            tonic::transport::Endpoint::from_shared(url.clone())?
                .connect()
                .await?,
        );
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (rss_before, _) = rss(store.pid())?;

    let (arrived_tx, mut arrived) = mpsc::unbounded_channel();
    let (ready_tx, mut ready) = mpsc::channel(followers.max(1));
    let mut tasks = vec![follow(
        channels[0].clone(),
        0,
        ready_tx.clone(),
        arrived_tx.clone(),
    )];
    ready.recv().await.context("the first follower failed")?;
    let alone_ms = deliveries(
        &mut writer,
        &mut arrived,
        std::iter::repeat_n(0, events),
        interval,
    )
    .await?;

    for i in 1..followers {
        tasks.push(follow(
            channels[i / STREAMS_PER_CONNECTION].clone(),
            i,
            ready_tx.clone(),
            arrived_tx.clone(),
        ));
    }
    drop(ready_tx);
    for _ in 1..followers {
        tokio::time::timeout(Duration::from_secs(120), ready.recv())
            .await
            .context("the followers were not all live within 120 s")?
            .context("a follower failed before it was live")?;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (rss_after, _) = rss(store.pid())?;
    // Spread over the sessions: a stride coprime with most counts.
    let among_ms = deliveries(
        &mut writer,
        &mut arrived,
        (0..events).map(|k| (k * 7919 + 1) % followers),
        interval,
    )
    .await?;
    for task in tasks {
        task.abort();
    }
    Ok(FollowersResult {
        followers,
        interval,
        rss_before,
        rss_after,
        alone_ms,
        among_ms,
    })
}
