//! `agentlog-bench`: what a durable append costs, next to what the disk allows.
//!
//! Measured in one run, on the same filesystem:
//! 1. the disk's raw rate of `write(300 B) + fdatasync`, one record per sync and batched;
//! 2. SYNC appends of one 300-byte event through the real `event-store` binary over gRPC,
//!    from 1 client and from many concurrent clients (one session each).
//!
//! Every figure is the median of several runs, with min and max. Nothing here asserts a
//! speed: `--quick` only checks that the whole path still runs.
#![forbid(unsafe_code)]

use std::fs::OpenOptions;
use std::io::Write;
use std::path::Path;
use std::time::{Duration, Instant};

use agentlog_proto::v1::{event, AppendRequest, Event, UserMessage};
use anyhow::Context;
use clap::Parser;
use integration_tests::Store;

#[derive(Parser)]
#[command(about = "Durable append throughput against the raw fdatasync rate of the same disk")]
struct Args {
    /// Tiny runs that only check the benchmark still works.
    #[arg(long)]
    quick: bool,
    /// Runs per figure (the median is reported).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Concurrent clients for the many-clients figure(s).
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    clients: Vec<usize>,
    /// Where to put the data (on the disk you want to measure).
    #[arg(long, default_value = "target/bench-data")]
    dir: std::path::PathBuf,
}

const RECORD_BYTES: usize = 300;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    std::fs::create_dir_all(&args.dir)?;
    let runs = if args.quick { 1 } else { args.runs };
    let secs = if args.quick { 0.2 } else { 2.0 };

    println!("| figure | median | min | max |");
    println!("|---|---|---|---|");
    let raw = raw_fdatasync(&args.dir, 1, runs, secs)?;
    row("raw write+fdatasync, 1 record/sync (syncs/s)", &raw);
    for batch in [8, 64, 256] {
        let r = raw_fdatasync(&args.dir, batch, runs, secs)?;
        row(
            &format!("raw write+fdatasync, {batch} records/sync (records/s)"),
            &r,
        );
    }

    let data = tempfile::tempdir_in(&args.dir)?;
    let store = Store::start_in(data.path())?;
    let rt = tokio::runtime::Runtime::new()?;
    for &clients in &args.clients {
        let mut rates = Vec::new();
        for run in 0..runs {
            rates.push(rt.block_on(appends(&store, clients, run, secs))?);
        }
        row(
            &format!("durable Append via gRPC, {clients} clients (appends/s)"),
            &rates,
        );
        if clients == 1 {
            let median_raw = median(&raw);
            let median_store = median(&rates);
            println!(
                "| 1 client: append latency / raw fdatasync latency | {:.2}x | | |",
                median_raw / median_store
            );
        }
    }
    Ok(())
}

fn row(name: &str, values: &[f64]) {
    let min = values.iter().cloned().fold(f64::INFINITY, f64::min);
    let max = values.iter().cloned().fold(0.0, f64::max);
    println!("| {name} | {:.0} | {min:.0} | {max:.0} |", median(values));
}

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Records per second made durable by `write(batch × 300 B) + fdatasync` in a loop.
fn raw_fdatasync(dir: &Path, batch: usize, runs: usize, secs: f64) -> anyhow::Result<Vec<f64>> {
    let mut rates = Vec::new();
    for _ in 0..runs {
        let path = dir.join("raw-fdatasync.bin");
        let mut file = OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(true)
            .open(&path)
            .context("open the raw fdatasync file")?;
        let buf = vec![b'x'; RECORD_BYTES * batch];
        let start = Instant::now();
        let mut records = 0u64;
        while start.elapsed().as_secs_f64() < secs {
            file.write_all(&buf)?;
            file.sync_data()?;
            records += batch as u64;
        }
        rates.push(records as f64 / start.elapsed().as_secs_f64());
        std::fs::remove_file(&path)?;
    }
    Ok(rates)
}

/// SYNC appends per second from `clients` concurrent clients, one session each.
async fn appends(store: &Store, clients: usize, run: usize, secs: f64) -> anyhow::Result<f64> {
    let deadline = Instant::now() + Duration::from_secs_f64(secs);
    let start = Instant::now();
    let mut tasks = Vec::new();
    for c in 0..clients {
        let mut client = store.client().await?;
        let session_id = format!("bench-{clients}-{run}-{c}");
        tasks.push(tokio::spawn(async move {
            let mut n = 0u64;
            while Instant::now() < deadline {
                let event = Event {
                    kind: Some(event::Kind::UserMessage(UserMessage {
                        text: "x".repeat(RECORD_BYTES),
                    })),
                    ..Default::default()
                };
                client
                    .append(AppendRequest {
                        session_id: session_id.clone(),
                        events: vec![event],
                        ..Default::default()
                    })
                    .await?;
                n += 1;
            }
            Ok::<u64, tonic::Status>(n)
        }));
    }
    let mut total = 0;
    for task in tasks {
        total += task.await??;
    }
    Ok(total as f64 / start.elapsed().as_secs_f64())
}
