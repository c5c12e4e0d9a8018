//! What deleting sessions costs the live system, in one run per figure (bench/RESULTS.md,
//! "Deletion, retention and reclamation"):
//!
//! - local log: appends at N clients (`AppendStream`, one session each) while the store
//!   reclaims the space of deleted sessions out of about 1 GiB of segments (half of every
//!   segment dead), against the same load on the same store just before the deletions:
//!   throughput and p99 ratios. The load runs for exactly the pass (read from the store's
//!   metrics), so every measured append competed with it;
//! - the pass's speed (segment bytes read per second, and the bytes it wrote) against a
//!   plain copy of the same segment files on the same disk (copy, then fdatasync);
//! - PostgreSQL: appends at N clients through a store replica whose retention pass deletes
//!   100,000 idle sessions (their events too), against the same load on that replica just
//!   before: p99 ratio.
//!
//! Build in release first (`cargo build --release -p event-store -p bench`), then
//! `target/release/agentlog-bench-lifecycle` (`--help` for the knobs).

#[path = "../appenders.rs"]
#[allow(dead_code)]
mod appenders;
#[path = "../load.rs"]
#[allow(dead_code)]
mod load;
#[path = "../scrape.rs"]
mod scrape;
#[path = "../stats.rs"]
#[allow(dead_code)]
mod stats;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::{AppendRequest, DeleteSessionRequest};
use clap::Parser;
use testkit::pg::Postgres;
use testkit::{Backing, Store};

use appenders::{user_event, AgentlogStreamAppender};
use load::Appender;
use scrape::{free_port, metric};
use stats::{fmt_num, fmt_ratio, percentile_f64};

#[derive(Parser)]
struct Args {
    /// Clients appending during the measurements.
    #[arg(long, default_value_t = 64)]
    clients: usize,
    /// MiB of segments the local store holds before the deletions (half of it deleted).
    #[arg(long, default_value_t = 1024)]
    local_mib: u64,
    /// Sessions the PostgreSQL retention pass deletes.
    #[arg(long, default_value_t = 100_000)]
    pg_sessions: usize,
    /// Seconds of the baseline measurement (after one of warm-up).
    #[arg(long, default_value_t = 8)]
    secs: u64,
    /// Runs of the local figure (each on a newly filled store).
    #[arg(long, default_value_t = 2)]
    runs: usize,
    /// Only the local log's figures, or only PostgreSQL's.
    #[arg(long)]
    only: Option<Part>,
    /// Where the stores keep their data (same disk as the copy).
    #[arg(long, default_value = "target/bench-lifecycle")]
    dir: PathBuf,
    /// The event-store binary (default: the one next to this program).
    #[arg(long)]
    store_binary: Option<PathBuf>,
    /// The local store's `--reclaim-share` (the share of a core a pass takes at most).
    #[arg(long)]
    reclaim_share: Option<f64>,
    /// Record the local store with `perf record -g` during each load into this directory
    /// (`alone-N.data`, `during-N.data`).
    #[arg(long)]
    perf_out: Option<PathBuf>,
}

/// `perf record` of one process, stopped (and its file written) when dropped.
struct Perf(Option<std::process::Child>);

impl Perf {
    fn record(out: Option<&Path>, name: &str, pid: u32) -> anyhow::Result<Perf> {
        let Some(out) = out else {
            return Ok(Perf(None));
        };
        std::fs::create_dir_all(out)?;
        let child = std::process::Command::new("perf")
            .args(["record", "-F", "499", "-g", "-p", &pid.to_string(), "-o"])
            .arg(out.join(format!("{name}.data")))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()?;
        Ok(Perf(Some(child)))
    }
}

impl Drop for Perf {
    fn drop(&mut self) {
        if let Some(child) = &mut self.0 {
            testkit::signal(child.id(), testkit::Signal::SIGINT);
            let _ = child.wait();
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Part {
    Local,
    Postgres,
}

/// One measured load: appends per second, p50 and p99 in milliseconds.
#[derive(Debug, Clone, Copy)]
struct Measured {
    rate: f64,
    p50: f64,
    p99: f64,
    appends: usize,
    secs: f64,
}

/// One client's appends: when each was sent and acknowledged.
type Timed = anyhow::Result<Vec<(Instant, Instant)>>;

/// Closed-loop clients appending until `stop`, each append timed.
struct Load {
    stop: Arc<AtomicBool>,
    tasks: Vec<tokio::task::JoinHandle<Timed>>,
}

impl Load {
    async fn start(url: &str, prefix: &str, clients: usize) -> anyhow::Result<Load> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut tasks = Vec::new();
        for c in 0..clients {
            let mut appender =
                AgentlogStreamAppender::connect(url, format!("{prefix}-{c:03}")).await?;
            let stop = stop.clone();
            tasks.push(tokio::spawn(async move {
                let mut times = Vec::new();
                while !stop.load(Ordering::Relaxed) {
                    let sent = Instant::now();
                    appender.append().await?;
                    times.push((sent, Instant::now()));
                }
                Ok(times)
            }));
        }
        Ok(Load { stop, tasks })
    }

    /// Stops the clients and measures the appends sent and acknowledged in `from..to`.
    async fn finish(self, from: Instant, to: Instant) -> anyhow::Result<Measured> {
        self.stop.store(true, Ordering::Relaxed);
        let mut latencies = Vec::new();
        for task in self.tasks {
            for (sent, acked) in task.await?? {
                if sent >= from && acked <= to {
                    latencies.push((acked - sent).as_secs_f64() * 1e3);
                }
            }
        }
        let secs = (to - from).as_secs_f64();
        Ok(Measured {
            rate: latencies.len() as f64 / secs,
            p50: percentile_f64(&latencies, 0.5),
            p99: percentile_f64(&latencies, 0.99),
            appends: latencies.len(),
            secs,
        })
    }
}

fn segment_files(log: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(log)?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "seg"))
        .collect();
    files.sort();
    Ok(files)
}

fn bytes_of(files: &[PathBuf]) -> u64 {
    files
        .iter()
        .filter_map(|f| std::fs::metadata(f).ok())
        .map(|m| m.len())
        .sum()
}

/// A plain copy of `files` into `to` on the same disk, each fdatasync'd, and the directory:
/// bytes per second.
fn plain_copy(files: &[PathBuf], to: &Path) -> anyhow::Result<f64> {
    std::fs::create_dir_all(to)?;
    let started = Instant::now();
    let mut bytes = 0;
    for file in files {
        let target = to.join(file.file_name().unwrap_or_default());
        bytes += std::fs::copy(file, &target)?;
        std::fs::File::open(&target)?.sync_data()?;
    }
    std::fs::File::open(to)?.sync_all()?;
    let rate = bytes as f64 / started.elapsed().as_secs_f64();
    std::fs::remove_dir_all(to)?;
    Ok(rate)
}

/// Fills a local store with `mib` MiB in 256 KiB appends, half to sessions that will be
/// deleted, interleaved so that every segment is half dead.
async fn fill(url: &str, mib: u64) -> anyhow::Result<()> {
    const WRITERS: usize = 16;
    let appends = (mib * 4) as usize;
    let text = "d".repeat(64 << 10);
    let mut tasks = Vec::new();
    for w in 0..WRITERS {
        let url = url.to_string();
        let text = text.clone();
        tasks.push(tokio::spawn(async move {
            let mut client = EventStoreClient::connect(url).await?;
            for i in (w..appends).step_by(WRITERS) {
                let session = if (i / WRITERS).is_multiple_of(2) {
                    format!("doomed-{w:02}")
                } else {
                    format!("kept-{w:02}")
                };
                let events = (0..4).map(|_| user_event(text.clone())).collect();
                client
                    .append(AppendRequest {
                        session_id: session,
                        events,
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

struct LocalRun {
    before: Measured,
    after: Measured,
    during: Measured,
    /// Seconds the passes took, all together.
    pass_secs: f64,
    segment_bytes_read: u64,
    reclaimed: f64,
    copy_rate: f64,
}

async fn local_run(args: &Args, binary: &Path, run: usize) -> anyhow::Result<LocalRun> {
    let dir = args.dir.join(format!("local-{run}"));
    let _ = std::fs::remove_dir_all(&dir);
    let metrics_addr = format!("127.0.0.1:{}", free_port()?);
    let share = args.reclaim_share.map(|s| s.to_string());
    let mut flags = vec!["--metrics-listen", &metrics_addr];
    if let Some(share) = &share {
        flags.extend(["--reclaim-share", share]);
    }
    let store = Store::start_backed(
        binary,
        Backing::Dir(dir.join("data")),
        "127.0.0.1:0",
        &flags,
    )?;
    let url = store.url();
    eprintln!("local run {run}: filling {} MiB", args.local_mib);
    fill(&url, args.local_mib).await?;
    let log = dir.join("data/log");
    let files = segment_files(&log)?;
    let segment_bytes_read = bytes_of(&files);
    let copy_rate = plain_copy(&files, &dir.join("copy"))?;

    eprintln!("local run {run}: the load alone");
    let perf_out = args.perf_out.as_deref();
    let load = Load::start(&url, "before", args.clients).await?;
    let from = Instant::now() + Duration::from_secs(1);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let perf = Perf::record(perf_out, &format!("alone-{run}"), store.pid())?;
    tokio::time::sleep(Duration::from_secs(args.secs)).await;
    drop(perf);
    let before = load.finish(from, Instant::now()).await?;

    eprintln!("local run {run}: the load during the reclamation");
    let seconds_before = metric(&metrics_addr, "agentlog_store_reclaim_seconds_total").await?;
    let reclaimed_before = metric(&metrics_addr, "agentlog_store_reclaimed_bytes_total").await?;
    let load = Load::start(&url, "during", args.clients).await?;
    let mut client = EventStoreClient::connect(url.clone()).await?;
    let perf = Perf::record(perf_out, &format!("during-{run}"), store.pid())?;
    let from = Instant::now();
    for w in 0..16 {
        client
            .delete_session(DeleteSessionRequest {
                session_id: format!("doomed-{w:02}"),
            })
            .await?;
    }
    // A pass starts at once (half of every segment is dead), another may follow for the
    // sessions deleted while it ran; the load runs until the dead half is given back.
    let deadline = Instant::now() + Duration::from_secs(600);
    let dead_half = segment_bytes_read as f64 * 0.45;
    loop {
        let reclaimed =
            metric(&metrics_addr, "agentlog_store_reclaimed_bytes_total").await? - reclaimed_before;
        let dead = metric(&metrics_addr, "agentlog_store_reclaim_dead_bytes").await?;
        if reclaimed >= dead_half && dead == 0.0 {
            break;
        }
        anyhow::ensure!(Instant::now() < deadline, "the reclamation never ended");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let to = Instant::now();
    drop(perf);
    let during = load.finish(from, to).await?;

    // The load alone once more, after the pass, so that a machine whose speed drifts (other
    // work on it) weighs on both sides alike.
    eprintln!("local run {run}: the load alone again");
    let load = Load::start(&url, "after", args.clients).await?;
    let from_after = Instant::now() + Duration::from_secs(1);
    tokio::time::sleep(Duration::from_secs(1 + args.secs)).await;
    let after = load.finish(from_after, Instant::now()).await?;
    let pass_secs =
        metric(&metrics_addr, "agentlog_store_reclaim_seconds_total").await? - seconds_before;
    let reclaimed =
        metric(&metrics_addr, "agentlog_store_reclaimed_bytes_total").await? - reclaimed_before;
    drop(store);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(LocalRun {
        before,
        after,
        during,
        pass_secs,
        segment_bytes_read,
        reclaimed,
        copy_rate,
    })
}

struct PgRun {
    before: Measured,
    after: Measured,
    during: Measured,
    pass_secs: f64,
    deleted: f64,
}

async fn pg_run(args: &Args, binary: &Path) -> anyhow::Result<PgRun> {
    let pg = tokio::task::block_in_place(Postgres::start)?;
    let url = tokio::task::block_in_place(|| pg.create_database())?;
    let backing = Backing::Database(url.clone(), None);
    let pool = ["--database-pool-size", "64"];
    let filler = Store::start_backed(binary, backing.clone(), "127.0.0.1:0", &pool)?;
    eprintln!("postgres: creating {} sessions", args.pg_sessions);
    let created = Instant::now();
    let mut tasks = Vec::new();
    for w in 0..64usize {
        let url = filler.url();
        let n = args.pg_sessions;
        tasks.push(tokio::spawn(async move {
            let mut client = EventStoreClient::connect(url).await?;
            for i in (w..n).step_by(64) {
                let events = (0..3)
                    .map(|_| user_event("an idle session".into()))
                    .collect();
                client
                    .append(AppendRequest {
                        session_id: format!("idle-{i:07}"),
                        events,
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
    drop(filler);
    // Every one of them idle for longer than the span when the replica below starts.
    let idle = Duration::from_secs(20);
    tokio::time::sleep(
        (created + idle + Duration::from_secs(1)).saturating_duration_since(Instant::now()),
    )
    .await;

    // A replica whose first retention pass starts 15 s after it does.
    let metrics_addr = format!("127.0.0.1:{}", free_port()?);
    let store = Store::start_backed(
        binary,
        backing,
        "127.0.0.1:0",
        &[
            pool[0],
            pool[1],
            "--retain-idle",
            "20s",
            "--retention-interval",
            "15s",
            "--metrics-listen",
            &metrics_addr,
        ],
    )?;
    let started = Instant::now();
    let url = store.url();
    let deleted = || metric(&metrics_addr, "agentlog_store_sessions_deleted_total");
    eprintln!("postgres: the load alone");
    let load = Load::start(&url, "live", args.clients).await?;
    let from = Instant::now() + Duration::from_secs(1);
    let to = from + Duration::from_secs(args.secs.min(10));
    tokio::time::sleep_until(to.into()).await;
    anyhow::ensure!(
        deleted().await? == 0.0 && started.elapsed() < Duration::from_secs(14),
        "the retention pass began before the baseline ended"
    );
    let before = load.finish(from, to).await?;

    eprintln!("postgres: the load during the retention pass");
    let load = Load::start(&url, "live", args.clients).await?;
    let deadline = Instant::now() + Duration::from_secs(600);
    while deleted().await? == 0.0 {
        anyhow::ensure!(Instant::now() < deadline, "retention never began");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let from = Instant::now();
    while deleted().await? < args.pg_sessions as f64 {
        anyhow::ensure!(Instant::now() < deadline, "retention never finished");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let to = Instant::now();
    let during = load.finish(from, to).await?;
    eprintln!("postgres: the load alone again");
    let load = Load::start(&url, "live", args.clients).await?;
    let from_after = Instant::now() + Duration::from_secs(1);
    tokio::time::sleep(Duration::from_secs(1 + args.secs.min(10))).await;
    let after = load.finish(from_after, Instant::now()).await?;
    Ok(PgRun {
        before,
        after,
        during,
        pass_secs: (to - from).as_secs_f64(),
        deleted: deleted().await?,
    })
}

fn row(label: &str, m: &Measured) -> String {
    format!(
        "| {label} | {} | {} | {} | {} appends in {:.1} s |",
        fmt_num(m.rate),
        fmt_num(m.p50),
        fmt_num(m.p99),
        m.appends,
        m.secs
    )
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let binary = args
        .store_binary
        .clone()
        .unwrap_or_else(|| testkit::bin_path("event-store"));
    std::fs::create_dir_all(&args.dir)?;
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("load average before: {}", load.trim());
    if args.only != Some(Part::Postgres) {
        println!(
            "\n### Local log: {} clients appending (AppendStream, SYNC, 300 B) while a pass \
             reclaims half of {} MiB of segments\n",
            args.clients, args.local_mib
        );
        println!("| run | load | appends/s | p50 ms | p99 ms | measured |");
        println!("|---|---|---:|---:|---:|---|");
        let mut summary = Vec::new();
        for run in 0..args.runs {
            let r = local_run(&args, &binary, run).await?;
            println!("{}", row(&format!("{run} | alone, before"), &r.before));
            println!("{}", row(&format!("{run} | during the pass"), &r.during));
            println!("{}", row(&format!("{run} | alone, after"), &r.after));
            summary.push(r);
        }
        println!("\nAlone: the mean of before and after.");
        println!("\n| run | appends/s during ÷ alone | p99 during ÷ alone | passes took | segments read | reclaimed | rewrite MB/s (segment bytes read) | plain copy MB/s | rewrite ÷ copy |");
        println!("|---|---:|---:|---:|---:|---:|---:|---:|---:|");
        for (run, r) in summary.iter().enumerate() {
            let rewrite = r.segment_bytes_read as f64 / r.pass_secs;
            let alone_rate = (r.before.rate + r.after.rate) / 2.0;
            let alone_p99 = (r.before.p99 + r.after.p99) / 2.0;
            println!(
                "| {run} | {} | {} | {:.1} s | {} MiB | {} MiB | {} | {} | {} |",
                fmt_ratio(r.during.rate / alone_rate),
                fmt_ratio(r.during.p99 / alone_p99),
                r.pass_secs,
                fmt_num(r.segment_bytes_read as f64 / 1048576.0),
                fmt_num(r.reclaimed / 1048576.0),
                fmt_num(rewrite / 1e6),
                fmt_num(r.copy_rate / 1e6),
                fmt_ratio(rewrite / r.copy_rate),
            );
        }
    }
    if args.only != Some(Part::Local) {
        println!(
            "\n### PostgreSQL: {} clients appending (AppendStream, SYNC, 300 B) through the \
             replica whose retention pass deletes {} idle sessions\n",
            args.clients, args.pg_sessions
        );
        let r = pg_run(&args, &binary).await?;
        println!("| load | appends/s | p50 ms | p99 ms | measured |");
        println!("|---|---:|---:|---:|---|");
        println!("{}", row("alone, before", &r.before));
        println!("{}", row("during the retention pass", &r.during));
        println!("{}", row("alone, after", &r.after));
        let alone_p99 = (r.before.p99 + r.after.p99) / 2.0;
        let alone_rate = (r.before.rate + r.after.rate) / 2.0;
        println!(
            "\nAlone: the mean of before and after. p99 during ÷ alone: {}; appends/s during \
             ÷ alone: {}; the pass deleted {} sessions in {:.1} s ({} per second)",
            fmt_ratio(r.during.p99 / alone_p99),
            fmt_ratio(r.during.rate / alone_rate),
            fmt_num(r.deleted),
            r.pass_secs,
            fmt_num(r.deleted / r.pass_secs)
        );
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("\nload average after: {}", load.trim());
    Ok(())
}

/// The 300-byte text of every measured append (as in the main suite).
fn event_text() -> String {
    let phrase = "Please look at the failing test in the parser module and fix it. ";
    phrase.repeat(300 / phrase.len() + 1)[..300].to_string()
}
