//! The load generator shared by every append figure: N clients, each sending its next
//! append as soon as the previous one is acknowledged (closed loop), or no sooner than its
//! share of a given rate (paced), for a fixed window after a warm-up. Throughput counts the
//! appends acknowledged inside the window; latency is each one's send → acknowledgement.

use std::future::Future;
use std::time::{Duration, Instant};

use crate::stats::percentile_f64;

/// One client of one system: `append` writes one 300-byte event and returns once the
/// system says it is durable.
pub trait Appender: Send + 'static {
    fn append(&mut self) -> impl Future<Output = anyhow::Result<()>> + Send;
}

/// One run of one load point.
#[derive(Debug, Clone, Copy)]
pub struct LoadRun {
    /// Acknowledged appends per second, all clients together.
    pub rate: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
}

/// How long one run warms up and then measures.
#[derive(Debug, Clone, Copy)]
pub struct Window {
    pub warmup: Duration,
    pub measure: Duration,
}

/// Runs every appender concurrently for `window` and reports the measured part.
pub async fn closed_loop<A: Appender>(
    appenders: Vec<A>,
    window: Window,
) -> anyhow::Result<LoadRun> {
    run(appenders, window, None).await
}

/// The same, each of the N clients sending at most `rate / N` appends a second, in evenly
/// spaced slots staggered across the clients; a client whose append outlasts its slot
/// sends the next at once and does not make up for the slots it missed, so the rate
/// reported says whether the system kept up.
pub async fn paced<A: Appender>(
    appenders: Vec<A>,
    window: Window,
    rate: f64,
) -> anyhow::Result<LoadRun> {
    let interval = Duration::from_secs_f64(appenders.len() as f64 / rate);
    run(appenders, window, Some(interval)).await
}

async fn run<A: Appender>(
    appenders: Vec<A>,
    window: Window,
    interval: Option<Duration>,
) -> anyhow::Result<LoadRun> {
    let start = Instant::now();
    let measure_from = start + window.warmup;
    let end = measure_from + window.measure;
    let clients = appenders.len() as u32;
    let mut tasks = Vec::with_capacity(appenders.len());
    for (i, mut appender) in appenders.into_iter().enumerate() {
        let mut slot = interval.map(|every| start + every * i as u32 / clients);
        tasks.push(tokio::spawn(async move {
            let mut latencies_ms = Vec::new();
            loop {
                if let (Some(at), Some(every)) = (slot, interval) {
                    tokio::time::sleep_until(at.into()).await;
                    slot = Some((at + every).max(Instant::now()));
                }
                let sent = Instant::now();
                if sent >= end {
                    break;
                }
                appender.append().await?;
                let acked = Instant::now();
                if sent >= measure_from && acked <= end {
                    latencies_ms.push((acked - sent).as_secs_f64() * 1e3);
                }
            }
            anyhow::Ok(latencies_ms)
        }));
    }
    let mut all = Vec::new();
    for task in tasks {
        all.extend(task.await??);
    }
    anyhow::ensure!(
        !all.is_empty(),
        "no append completed inside the {:?} window",
        window.measure
    );
    Ok(LoadRun {
        rate: all.len() as f64 / window.measure.as_secs_f64(),
        p50_ms: percentile_f64(&all, 0.5),
        p99_ms: percentile_f64(&all, 0.99),
    })
}
