//! Sessions that move (bench/RESULTS.md, "Export and import"), at several sizes of store,
//! each figure against a baseline measured in the same run:
//!
//! - export: `agentlog export --all -o FILE` of a local store of N events (sessions of
//!   `--per-session` events, 300-byte texts), events/s, against a `Subscribe` catch-up of
//!   the same sessions (from seq 1, one after another, over one connection) on the same
//!   store just before;
//! - import: `agentlog import FILE` into a fresh local store, events/s, against appends at
//!   64 clients (`AppendStream`, one session each, one event a request) on another fresh
//!   store just before;
//! - the peak RSS of the CLI (GNU time's maximum resident set) and of the store (its
//!   `VmHWM`) for each, from the smallest size to the largest, each store's beside its
//!   baseline: the exporting store (started afresh) after the catch-up alone, and for the
//!   importing store the store the same events were appended to;
//! - with `--pg`: the migration of the largest store to PostgreSQL (a private server on
//!   this machine): export, import into a PostgreSQL-backed store, and the check that ends
//!   the README's procedure (sessions, events and a digest over every event, both sides),
//!   each timed.
//!
//! Build in release first (`cargo build --release -p event-store -p agentlog-cli -p bench`),
//! then `target/release/agentlog-bench-transfer` (`--help` for the knobs).

#[path = "../stats.rs"]
#[allow(dead_code)]
mod stats;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::{AppendRequest, Event, SubscribeRequest, UserMessage};
use anyhow::{bail, Context, Result};
use clap::Parser;
use testkit::{Backing, Store};
use tokio_stream::StreamExt;

use stats::{fmt_num, fmt_ratio};

#[derive(Parser)]
struct Args {
    /// Events in the store, one figure each.
    #[arg(long, value_delimiter = ',', default_value = "10000,100000,1000000")]
    sizes: Vec<usize>,
    /// Events per session.
    #[arg(long, default_value_t = 10_000)]
    per_session: usize,
    /// Clients of the AppendStream baseline.
    #[arg(long, default_value_t = 64)]
    clients: usize,
    /// Appends each client of the baseline makes.
    #[arg(long, default_value_t = 1000)]
    appends_per_client: usize,
    /// Where the stores and the export files go.
    #[arg(long, default_value = "target/bench-transfer")]
    dir: PathBuf,
    /// Also migrate the largest store to PostgreSQL.
    #[arg(long)]
    pg: bool,
}

fn event(id: String, text: &str) -> Event {
    Event {
        event_id: id,
        kind: Some(agentlog_proto::v1::event::Kind::UserMessage(UserMessage {
            text: text.to_string(),
        })),
        ..Event::default()
    }
}

fn start(dir: &Path) -> Result<Store> {
    std::fs::create_dir_all(dir)?;
    Store::start_backed(
        &testkit::bin_path("event-store"),
        Backing::Dir(dir.to_path_buf()),
        "127.0.0.1:0",
        &[],
    )
}

/// The store's peak resident set since it started, in MiB.
fn peak_mib(store: &Store) -> Result<f64> {
    let status = std::fs::read_to_string(format!("/proc/{}/status", store.pid()))?;
    let kib: f64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .context("VmHWM")?;
    Ok(kib / 1024.0)
}

/// Fills the store with `events` events in sessions of `per_session`, a thousand to an
/// append, four appends in flight.
async fn fill(url: &str, events: usize, per_session: usize) -> Result<usize> {
    let text = "x".repeat(300);
    let sessions = events.div_ceil(per_session);
    let mut tasks = Vec::new();
    for worker in 0..4 {
        let url = url.to_string();
        let text = text.clone();
        tasks.push(tokio::spawn(async move {
            let mut client = EventStoreClient::connect(url)
                .await?
                .max_decoding_message_size(16 << 20);
            for s in (worker..sessions).step_by(4) {
                let n = per_session.min(events - s * per_session);
                for start in (0..n).step_by(1000) {
                    let batch = (start..(start + 1000).min(n))
                        .map(|i| event(format!("e{i}"), &text))
                        .collect();
                    client
                        .append(AppendRequest {
                            session_id: format!("t-{s:06}"),
                            events: batch,
                            ..Default::default()
                        })
                        .await?;
                }
            }
            anyhow::Ok(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    Ok(sessions)
}

/// Reads every session from seq 1, one after another; events/s.
async fn catch_up(url: &str, sessions: usize) -> Result<(usize, f64)> {
    let mut client = EventStoreClient::connect(url.to_string())
        .await?
        .max_decoding_message_size(16 << 20);
    let started = Instant::now();
    let mut read = 0;
    for s in 0..sessions {
        let mut stream = client
            .subscribe(SubscribeRequest {
                session_id: format!("t-{s:06}"),
                from_seq: 1,
                follow: false,
            })
            .await?
            .into_inner();
        while let Some(event) = stream.next().await {
            event?;
            read += 1;
        }
    }
    Ok((read, read as f64 / started.elapsed().as_secs_f64()))
}

/// Appends at `clients` clients, one session each, one event a request on one
/// AppendStream per client; events/s.
async fn append_stream(url: &str, clients: usize, per_client: usize) -> Result<f64> {
    let text = "x".repeat(300);
    let mut tasks = Vec::new();
    let started = Instant::now();
    for c in 0..clients {
        let url = url.to_string();
        let text = text.clone();
        tasks.push(tokio::spawn(async move {
            let mut client = EventStoreClient::connect(url).await?;
            let (tx, rx) = tokio::sync::mpsc::channel(1);
            let mut answers = client
                .append_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await?
                .into_inner();
            for i in 0..per_client {
                tx.send(AppendRequest {
                    session_id: format!("as-{c}"),
                    events: vec![event(format!("e{i}"), &text)],
                    ..Default::default()
                })
                .await?;
                answers.message().await?.context("an answer")?;
            }
            anyhow::Ok(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    Ok((clients * per_client) as f64 / started.elapsed().as_secs_f64())
}

/// Runs the `agentlog` CLI under GNU time (its standard output thrown away): its wall time
/// and peak RSS (MiB).
fn cli(url: &str, args: &[&str]) -> Result<(Duration, f64)> {
    let started = Instant::now();
    let out = Command::new("/usr/bin/time")
        .args(["-f", "%M"])
        .arg(testkit::bin_path("agentlog"))
        .args(["--addr", url])
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .context("run /usr/bin/time agentlog")?
        .wait_with_output()?;
    let elapsed = started.elapsed();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        bail!("agentlog {args:?} failed: {stderr}");
    }
    let kib: f64 = stderr
        .lines()
        .last()
        .and_then(|l| l.trim().parse().ok())
        .context("GNU time's %M")?;
    Ok((elapsed, kib / 1024.0))
}

/// The check that ends the migration procedure: sessions, events and a digest over every
/// event (the SHA-256 of the export's end lines, which carry each session's event count,
/// last seq and the SHA-256 of its event lines), read from an export of each side.
fn totals(url: &str, file: &Path) -> Result<(usize, u64, String)> {
    cli(url, &["export", "--all", "-o", &file.display().to_string()])?;
    let text = std::fs::read_to_string(file)?;
    let mut sessions = 0;
    let mut events = 0u64;
    let mut digest = ring::digest::Context::new(&ring::digest::SHA256);
    for line in text.lines() {
        if line.starts_with("{\"end\":") {
            let value: serde_json::Value = serde_json::from_str(line)?;
            sessions += 1;
            events += value["end"]["events"]
                .as_str()
                .and_then(|n| n.parse::<u64>().ok())
                .context("events")?;
            digest.update(line.as_bytes());
            digest.update(b"\n");
        }
    }
    let hex: String = digest
        .finish()
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    Ok((sessions, events, hex))
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    std::fs::create_dir_all(&args.dir)?;
    let dir = args.dir.canonicalize()?;
    println!(
        "| events | Subscribe catch-up ev/s | export ev/s (stdout; -o FILE) | export ÷ catch-up (stdout; FILE) | AppendStream ×{} ev/s | import ev/s | import ÷ AppendStream | CLI peak RSS export / import | store peak RSS: export (after the catch-up alone) / import (a store the same events were appended to) |",
        args.clients
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    let mut largest: Option<(PathBuf, PathBuf, usize)> = None;
    for &size in &args.sizes {
        let run = dir.join(format!("n{size}"));
        let _ = std::fs::remove_dir_all(&run);
        let source_dir = run.join("source");
        let mut source = start(&source_dir)?;
        let sessions = fill(&source.url(), size, args.per_session).await?;
        // The same events appended: what holding them costs a store (the import's baseline).
        let filled_store = peak_mib(&source)?;
        // A store started afresh: its peak is what reading costs.
        source.terminate()?;
        let source = start(&source_dir)?;
        let (read, sub_eps) = catch_up(&source.url(), sessions).await?;
        let caught_up_store = peak_mib(&source)?;
        anyhow::ensure!(read == size, "caught up {read} of {size}");
        // To standard output (thrown away), then to a file (written aside, fsync'd, renamed).
        let (piped_time, _) = cli(&source.url(), &["export", "--all"])?;
        let piped_eps = size as f64 / piped_time.as_secs_f64();
        let file = run.join("export.jsonl");
        let (export_time, export_cli) = cli(
            &source.url(),
            &["export", "--all", "-o", &file.display().to_string()],
        )?;
        let export_eps = size as f64 / export_time.as_secs_f64();
        let export_store = peak_mib(&source)?;
        drop(source);

        let baseline = start(&run.join("baseline"))?;
        let as_eps = append_stream(&baseline.url(), args.clients, args.appends_per_client).await?;
        drop(baseline);
        let target = start(&run.join("target"))?;
        let (import_time, import_cli) =
            cli(&target.url(), &["import", &file.display().to_string()])?;
        let import_eps = size as f64 / import_time.as_secs_f64();
        let import_store = peak_mib(&target)?;
        drop(target);
        println!(
            "| {} | {} | {}; {} | {}; {} | {} | {} | {} | {:.1} / {:.1} MiB | {:.1} (catch-up {:.1}) / {:.1} (appended {:.1}) MiB |",
            fmt_num(size as f64),
            fmt_num(sub_eps),
            fmt_num(piped_eps),
            fmt_num(export_eps),
            fmt_ratio(piped_eps / sub_eps),
            fmt_ratio(export_eps / sub_eps),
            fmt_num(as_eps),
            fmt_num(import_eps),
            fmt_ratio(import_eps / as_eps),
            export_cli,
            import_cli,
            export_store,
            caught_up_store,
            import_store,
            filled_store,
        );
        largest = Some((source_dir, file, size));
    }
    if let (true, Some((source_dir, _, size))) = (args.pg, largest) {
        let pg = testkit::pg::Postgres::start()?;
        let url = pg.create_database()?;
        let source = start(&source_dir)?;
        let target = Store::start_backed(
            &testkit::bin_path("event-store"),
            Backing::Database(url, None),
            "127.0.0.1:0",
            &[],
        )?;
        let file = dir.join("migrate.jsonl");
        let started = Instant::now();
        cli(
            &source.url(),
            &["export", "--all", "-o", &file.display().to_string()],
        )?;
        let exported = started.elapsed();
        let started = Instant::now();
        cli(&target.url(), &["import", &file.display().to_string()])?;
        let imported = started.elapsed();
        let started = Instant::now();
        let local = totals(&source.url(), &dir.join("check-local.jsonl"))?;
        let postgres = totals(&target.url(), &dir.join("check-pg.jsonl"))?;
        let checked = started.elapsed();
        println!(
            "\nMigration of {} events to PostgreSQL: export {:.1} s, import {:.1} s, check {:.1} s; local {:?}, PostgreSQL {:?}: {}",
            fmt_num(size as f64),
            exported.as_secs_f64(),
            imported.as_secs_f64(),
            checked.as_secs_f64(),
            local,
            postgres,
            if local == postgres { "the same" } else { "DIFFERENT" }
        );
        anyhow::ensure!(local == postgres, "the migration's check failed");
    }
    Ok(())
}
