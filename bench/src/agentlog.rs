//! The system under test: the real `event-store` binary, driven over gRPC.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::{AppendRequest, SubscribeRequest};
use anyhow::Context;
use testkit::Store;

pub use crate::appenders::user_event;

/// Appends `events` 300-byte events to `session_id`, 1000 per request.
pub async fn fill_session(url: &str, session_id: &str, events: usize) -> anyhow::Result<()> {
    let mut client = EventStoreClient::connect(url.to_string()).await?;
    let mut left = events;
    while left > 0 {
        let n = left.min(1000);
        client
            .append(AppendRequest {
                session_id: session_id.to_string(),
                events: (0..n).map(|_| user_event(crate::event_text())).collect(),
                ..Default::default()
            })
            .await
            .context("append a batch of 1000")?;
        left -= n;
    }
    Ok(())
}

/// Reads a whole session with a non-follow Subscribe, each event decoded; returns events
/// per second. Connected as the product's programs connect (`agentlog_client`: its HTTP/2
/// windows and frame size).
pub async fn catch_up(url: &str, session_id: &str, expected: usize) -> anyhow::Result<f64> {
    let connection = agentlog_client::StoreConnection {
        url: url.to_string(),
        ..Default::default()
    };
    let mut client = EventStoreClient::new(connection.endpoint()?.connect().await?);
    let start = Instant::now();
    let mut stream = client
        .subscribe(SubscribeRequest {
            session_id: session_id.to_string(),
            from_seq: 1,
            follow: false,
        })
        .await?
        .into_inner();
    let mut n = 0usize;
    while let Some(event) = stream.message().await? {
        n += 1;
        anyhow::ensure!(event.seq as usize == n, "event {n} has seq {}", event.seq);
    }
    let secs = start.elapsed().as_secs_f64();
    anyhow::ensure!(
        n == expected,
        "catch-up read {n} events, expected {expected}"
    );
    Ok(n as f64 / secs)
}

/// Live fan-out to `followers` Subscribe(follow) streams on a fresh session (see
/// `fanout`); event k is seq k + 1.
pub async fn fan_out(
    url: &str,
    session_id: &str,
    followers: usize,
    events: usize,
    interval: Duration,
) -> anyhow::Result<Vec<f64>> {
    // At most 100 streams share one HTTP/2 connection.
    let mut channels = Vec::new();
    for _ in 0..followers.div_ceil(100) {
        channels.push(
            tonic::transport::Endpoint::from_shared(url.to_string())?
                .connect()
                .await?,
        );
    }
    let writer = EventStoreClient::connect(url.to_string()).await?;
    let spawn_follower = |f: usize, ctx: crate::fanout::FollowerContext| {
        let mut client = EventStoreClient::new(channels[f / 100].clone());
        let session_id = session_id.to_string();
        tokio::spawn(async move {
            let mut stream = client
                .subscribe(SubscribeRequest {
                    session_id,
                    from_seq: 1,
                    follow: true,
                })
                .await?
                .into_inner();
            let mut received = Vec::with_capacity(ctx.events);
            while let Some(event) = stream.message().await? {
                let at = Instant::now();
                if event.seq == 1 {
                    let _ = ctx.ready.send(()).await;
                    continue;
                }
                received.push((event.seq - 1, at));
                if received.len() == ctx.events {
                    break;
                }
            }
            anyhow::Ok(received)
        })
    };
    let append = |_k: u64| {
        let mut writer = writer.clone();
        let session_id = session_id.to_string();
        async move {
            writer
                .append(AppendRequest {
                    session_id,
                    events: vec![user_event(crate::event_text())],
                    ..Default::default()
                })
                .await?;
            anyhow::Ok(())
        }
    };
    crate::fanout::measure(followers, events, interval, spawn_follower, append).await
}

/// One loopback gRPC round trip that touches no disk: the p50 in ms of `Health/Check`
/// calls to the store, one after the other for `secs`, on one HTTP/2 connection as the
/// append figures' clients have.
pub async fn round_trip_ms(url: &str, secs: Duration) -> anyhow::Result<f64> {
    use tonic_health::pb::{health_client::HealthClient, HealthCheckRequest};
    let mut client = HealthClient::new(
        tonic::transport::Endpoint::from_shared(url.to_string())?
            .connect()
            .await?,
    );
    let mut latencies = Vec::new();
    let end = Instant::now() + secs;
    while Instant::now() < end {
        let sent = Instant::now();
        client.check(HealthCheckRequest::default()).await?;
        latencies.push(sent.elapsed().as_secs_f64() * 1e3);
    }
    Ok(crate::stats::percentile_f64(&latencies, 0.5))
}

/// The footprint of many sessions.
#[derive(Debug, Clone)]
pub struct Footprint {
    pub events: usize,
    pub fill_secs: f64,
    /// CPU seconds the store spent during the fill.
    pub fill_cpu_secs: f64,
    pub rss_bytes: u64,
    pub peak_rss_bytes: u64,
    pub log_bytes: u64,
    pub index_bytes: u64,
    pub restart_secs: f64,
    pub rss_after_restart_bytes: u64,
}

/// Fills a fresh store with `sessions` × `per_session` events (one append of
/// `per_session` events per session, 64 writers), then measures RSS and bytes on disk, and
/// the same after a restart (recovery of the log into the index).
pub async fn footprint(
    data_dir: &Path,
    sessions: usize,
    per_session: usize,
) -> anyhow::Result<Footprint> {
    let store = Store::start_in(data_dir)?;
    let url = store.url();
    let cpu_before = crate::profile::cpu_secs(store.pid());
    let start = Instant::now();
    fill_sessions(&url, sessions, per_session, |s| format!("mem-{s:06}")).await?;
    let fill_secs = start.elapsed().as_secs_f64();
    let fill_cpu_secs = crate::profile::cpu_secs(store.pid()) - cpu_before;
    // Let the index settle (sled flushes in the background) before reading RSS.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let (rss_bytes, peak_rss_bytes) = rss(store.pid())?;
    let mut store = store;
    store.terminate()?;
    let log_bytes = dir_bytes(&data_dir.join("log"))?;
    let index_bytes = dir_bytes(data_dir)? - log_bytes;
    let start = Instant::now();
    let restarted = Store::start_in(data_dir)?;
    let restart_secs = start.elapsed().as_secs_f64();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (rss_after_restart_bytes, _) = rss(restarted.pid())?;
    drop(restarted);
    Ok(Footprint {
        events: sessions * per_session,
        fill_secs,
        fill_cpu_secs,
        rss_bytes,
        peak_rss_bytes,
        log_bytes,
        index_bytes,
        restart_secs,
        rss_after_restart_bytes,
    })
}

/// Appends `per_session` 300-byte events, in one append, to each of `sessions` sessions
/// named by `name`, 64 writers at once.
pub async fn fill_sessions(
    url: &str,
    sessions: usize,
    per_session: usize,
    name: fn(usize) -> String,
) -> anyhow::Result<()> {
    let next = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for _ in 0..64.min(sessions) {
        let mut client = EventStoreClient::connect(url.to_string()).await?;
        let next = next.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                let s = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if s >= sessions {
                    break;
                }
                client
                    .append(AppendRequest {
                        session_id: name(s),
                        events: (0..per_session)
                            .map(|_| user_event(crate::event_text()))
                            .collect(),
                        ..Default::default()
                    })
                    .await?;
            }
            anyhow::Ok(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    Ok(())
}

/// (VmRSS, VmHWM) of a process, in bytes.
pub fn rss(pid: u32) -> anyhow::Result<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let field = |name: &str| -> u64 {
        status
            .lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|kb| kb.parse::<u64>().ok())
            .map(|kb| kb * 1024)
            .unwrap_or(0)
    };
    Ok((field("VmRSS:"), field("VmHWM:")))
}

/// Bytes of every file under `dir` (allocated blocks, as `du` counts them).
pub fn dir_bytes(dir: &Path) -> anyhow::Result<u64> {
    use std::os::unix::fs::MetadataExt;
    let mut total = 0;
    if !dir.exists() {
        return Ok(0);
    }
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let meta = entry.metadata()?;
        if meta.is_dir() {
            total += dir_bytes(&entry.path())?;
        } else {
            total += meta.blocks() * 512;
        }
    }
    Ok(total)
}
