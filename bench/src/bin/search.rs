//! What SearchSessions costs and how it answers (bench/RESULTS.md, "Search"), on each
//! backend, every ratio against a baseline measured in the same run:
//!
//! - appends at N clients (`AppendStream`, SYNC, one session each, ~300-byte texts of words)
//!   on a store with its index against the same load on a store started with
//!   `--no-search-index`, the two alternating run by run;
//! - freshness under that load: a probe appends a word of its own every 200 ms on average
//!   (at exponential intervals, so that its words land at every phase of the indexer's
//!   commit cycle) and searches for each until it is found (acknowledgement → first search
//!   that finds it);
//! - queries at `--events` events (p50, p99; pages of 20): a rare word, a common word, two
//!   words, a phrase, a prefix;
//! - index bytes per log byte (local: `search/` against `log/`; PostgreSQL:
//!   `agentlog_search` against `agentlog_events`, indexes included);
//! - the local index rebuilt from scratch: a start after `search/` was removed, against a
//!   start with the index in place.
//!
//! Build in release first (`cargo build --release -p event-store -p bench`), then
//! `target/release/agentlog-bench-search` (`--help` for the knobs).

#[path = "../appenders.rs"]
#[allow(dead_code)]
mod appenders;
#[path = "../load.rs"]
#[allow(dead_code)]
mod load;
#[path = "../profile.rs"]
#[allow(dead_code)]
mod profile;
#[path = "../stats.rs"]
#[allow(dead_code)]
mod stats;

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::{AppendRequest, SearchSessionsRequest};
use clap::Parser;
use testkit::pg::Postgres;
use testkit::{Backing, Store};

use appenders::{user_event, AgentlogStreamAppender};
use stats::{fmt_num, fmt_ratio, percentile_f64};

#[derive(Parser)]
struct Args {
    /// Clients appending during the append figures.
    #[arg(long, default_value_t = 64)]
    clients: usize,
    /// Seconds each append measurement lasts (after one of warm-up).
    #[arg(long, default_value_t = 8)]
    secs: u64,
    /// Runs of each append figure (with, then without the index, alternating).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Events the queried store holds.
    #[arg(long, default_value_t = 1_000_000)]
    events: usize,
    /// Queries of each kind timed.
    #[arg(long, default_value_t = 200)]
    queries: usize,
    /// Only the local log's figures, or only PostgreSQL's.
    #[arg(long)]
    only: Option<Part>,
    #[arg(long, default_value = "target/bench-search")]
    dir: PathBuf,
    /// The event-store binary (default: the one next to this program).
    #[arg(long)]
    store_binary: Option<PathBuf>,
    /// Instead of the figures above: the local index's commit period swept over these
    /// spans (e.g. `200ms,400ms,600ms`), each under the append load with the probe, in a
    /// rotating order, `--runs` times; what each costs an append and how fresh it keeps
    /// the index.
    #[arg(long, value_delimiter = ',')]
    commit_periods: Vec<String>,
}

#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Part {
    Local,
    Postgres,
}

/// The words texts are made of: `VOCABULARY` of them, the first ones far more frequent (a
/// word's chance falls with its rank, as in prose).
const VOCABULARY: usize = 20_000;

fn word(rank: usize) -> String {
    // Letters only, distinct per rank: "w" and the rank in base 26.
    let mut n = rank;
    let mut s = String::from("w");
    loop {
        s.push((b'a' + (n % 26) as u8) as char);
        n /= 26;
        if n == 0 {
            return s;
        }
    }
}

/// A text of about 300 bytes of words.
fn text(rng: &mut fastrand::Rng) -> String {
    let mut s = String::with_capacity(320);
    while s.len() < 300 {
        // Skewed towards the first ranks: rank = VOCABULARY^u for a uniform u.
        let rank = (VOCABULARY as f64).powf(rng.f64()) as usize - 1;
        if !s.is_empty() {
            s.push(' ');
        }
        s.push_str(&word(rank.min(VOCABULARY - 1)));
    }
    s
}

/// A store to measure: its process and, for PostgreSQL, the server behind it.
struct Running {
    store: Store,
    pg: Option<Postgres>,
}

/// Starts a store on fresh data: with its index or without (`indexed`), the index
/// committing at its default period or every `commit_every`.
fn start(
    binary: &Path,
    part: Part,
    dir: &Path,
    indexed: bool,
    commit_every: Option<&str>,
) -> anyhow::Result<Running> {
    let mut extra = vec![];
    if !indexed {
        extra.push("--no-search-index");
    }
    if let Some(every) = commit_every {
        extra.extend(["--search-commit-every", every]);
    }
    match part {
        Part::Local => {
            let _ = std::fs::remove_dir_all(dir);
            std::fs::create_dir_all(dir)?;
            let store = Store::start_backed(
                binary,
                Backing::Dir(dir.to_path_buf()),
                "127.0.0.1:0",
                &extra,
            )?;
            Ok(Running { store, pg: None })
        }
        Part::Postgres => {
            let pg = Postgres::start()?;
            let url = pg.create_database()?;
            extra.extend(["--database-pool-size", "64"]);
            let store =
                Store::start_backed(binary, Backing::Database(url, None), "127.0.0.1:0", &extra)?;
            Ok(Running {
                store,
                pg: Some(pg),
            })
        }
    }
}

/// What a run of appends measured.
struct Measured {
    appends_per_s: f64,
    p99_ms: f64,
    /// CPU µs an append of the store (and of PostgreSQL, on that backend).
    cpu_us: f64,
    /// ms from a probe's acknowledgement to the first search that found it.
    fresh: Vec<f64>,
}

impl Running {
    /// CPU seconds used so far by the store, and by PostgreSQL's server and backends.
    fn cpu_secs(&self) -> f64 {
        let pg = self
            .pg
            .as_ref()
            .and_then(|pg| pg.pid())
            .map_or(0.0, |root| {
                profile::tree_cpu_secs(root, &profile::with_children(root)[1..])
            });
        profile::cpu_secs(self.store.pid()) + pg
    }
}

/// A run's freshness p50 and p99 (ms) as table cells; "–" without probes.
fn freshness_cells(fresh: &[f64]) -> (String, String) {
    if fresh.is_empty() {
        return ("–".to_string(), "–".to_string());
    }
    (
        format!("{:.0}", percentile_f64(fresh, 0.5)),
        format!("{:.0}", percentile_f64(fresh, 0.99)),
    )
}

/// The probe's mean interval between two appends of a word of its own.
const PROBE_EVERY: Duration = Duration::from_millis(200);

/// Appends/s, p99 and CPU of `clients` closed-loop AppendStream clients, and (`probe`) the
/// freshness of a probe's words meanwhile.
async fn load(
    running: &Running,
    clients: usize,
    secs: u64,
    probe: bool,
) -> anyhow::Result<Measured> {
    let url = &running.store.url();
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for c in 0..clients {
        let mut appender = AgentlogStreamAppender::connect(url, format!("load-{c:03}")).await?;
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(c as u64);
            let mut times = Vec::new();
            while !stop.load(Ordering::Relaxed) {
                let request = AppendRequest {
                    session_id: format!("load-{c:03}"),
                    events: vec![user_event(text(&mut rng))],
                    ..Default::default()
                };
                let sent = Instant::now();
                appender.send(request).await?;
                times.push((sent, Instant::now()));
            }
            anyhow::Ok(times)
        }));
    }
    let from = Instant::now() + Duration::from_secs(1);
    let to = from + Duration::from_secs(secs);
    let prober = probe.then(|| {
        let url = url.to_string();
        tokio::spawn(async move {
            let client = EventStoreClient::connect(url).await?;
            let mut finds = tokio::task::JoinSet::new();
            let mut n = 0u64;
            let mut rng = fastrand::Rng::with_seed(99);
            while Instant::now() < to {
                // Probes at exponential intervals (a Poisson stream), each searched for by a
                // task of its own: their moments owe nothing to the indexer's commits, so
                // they land at every phase of its cycle, as events do. (A pause after each
                // find, which comes just after a commit, would land every probe at one.)
                let pause = -PROBE_EVERY.as_secs_f64() * (1.0 - rng.f64()).ln();
                tokio::time::sleep(Duration::from_secs_f64(pause)).await;
                n += 1;
                let word = format!("probe{n}x");
                let mut client = client.clone();
                client
                    .append(AppendRequest {
                        session_id: "probe".into(),
                        events: vec![user_event(format!("the probe word {word}"))],
                        ..Default::default()
                    })
                    .await?;
                let acked = Instant::now();
                finds.spawn(async move {
                    loop {
                        let found = client
                            .search_sessions(SearchSessionsRequest {
                                query: word.clone(),
                                page_size: 1,
                                page_token: String::new(),
                            })
                            .await?
                            .into_inner();
                        if !found.hits.is_empty() {
                            return anyhow::Ok(acked.elapsed().as_secs_f64() * 1e3);
                        }
                        anyhow::ensure!(
                            acked.elapsed() < Duration::from_secs(30),
                            "{word} never found"
                        );
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                });
            }
            let mut fresh = Vec::new();
            while let Some(found) = finds.join_next().await {
                fresh.push(found??);
            }
            anyhow::Ok(fresh)
        })
    });
    tokio::time::sleep_until(from.into()).await;
    let cpu_from = running.cpu_secs();
    tokio::time::sleep_until(to.into()).await;
    let cpu = running.cpu_secs() - cpu_from;
    stop.store(true, Ordering::Relaxed);
    let mut latencies = Vec::new();
    for task in tasks {
        for (sent, acked) in task.await?? {
            if sent >= from && acked <= to {
                latencies.push((acked - sent).as_secs_f64() * 1e3);
            }
        }
    }
    let fresh = match prober {
        Some(p) => p.await??,
        None => Vec::new(),
    };
    Ok(Measured {
        appends_per_s: latencies.len() as f64 / secs as f64,
        p99_ms: percentile_f64(&latencies, 0.99),
        cpu_us: cpu * 1e6 / latencies.len().max(1) as f64,
        fresh,
    })
}

/// Fills the store with `events` events in 1,000 sessions, 100 events an append, then waits
/// until the last is found.
async fn fill(url: &str, events: usize) -> anyhow::Result<f64> {
    let started = Instant::now();
    let writers = 16;
    let mut tasks = Vec::new();
    for w in 0..writers {
        let url = url.to_string();
        tasks.push(tokio::spawn(async move {
            let mut client = EventStoreClient::connect(url).await?;
            let mut rng = fastrand::Rng::with_seed(1000 + w as u64);
            let mut i = w;
            while i * 100 < events {
                let count = 100.min(events - i * 100);
                client
                    .append(AppendRequest {
                        session_id: format!("filled-{:04}", i % 1000),
                        events: (0..count).map(|_| user_event(text(&mut rng))).collect(),
                        ..Default::default()
                    })
                    .await?;
                i += writers;
            }
            anyhow::Ok(())
        }));
    }
    for task in tasks {
        task.await??;
    }
    let mut client = EventStoreClient::connect(url.to_string()).await?;
    client
        .append(AppendRequest {
            session_id: "filled-last".into(),
            events: vec![user_event("the lastfilledword".into())],
            ..Default::default()
        })
        .await?;
    while client
        .search_sessions(SearchSessionsRequest {
            query: "lastfilledword".into(),
            page_size: 1,
            page_token: String::new(),
        })
        .await?
        .into_inner()
        .hits
        .is_empty()
    {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(started.elapsed().as_secs_f64())
}

/// Makes one query of a kind.
type MakeQuery = Box<dyn FnMut(&mut fastrand::Rng) -> String>;

/// p50 and p99 (ms) of `n` queries made by `make`, one after another.
async fn time_queries(
    url: &str,
    n: usize,
    mut make: impl FnMut(&mut fastrand::Rng) -> String,
) -> anyhow::Result<(f64, f64, f64)> {
    let mut client = EventStoreClient::connect(url.to_string()).await?;
    let mut rng = fastrand::Rng::with_seed(7);
    let mut times = Vec::with_capacity(n);
    let mut hits = 0usize;
    for _ in 0..n {
        let query = make(&mut rng);
        let sent = Instant::now();
        let page = client
            .search_sessions(SearchSessionsRequest {
                query,
                page_size: 20,
                page_token: String::new(),
            })
            .await?
            .into_inner();
        times.push(sent.elapsed().as_secs_f64() * 1e3);
        hits += page.hits.len();
    }
    Ok((
        percentile_f64(&times, 0.5),
        percentile_f64(&times, 0.99),
        hits as f64 / n as f64,
    ))
}

fn dir_bytes(dir: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            match e.metadata() {
                Ok(m) if m.is_dir() => stack.push(e.path()),
                Ok(m) => total += m.len(),
                Err(_) => {}
            }
        }
    }
    total
}

async fn part(args: &Args, binary: &Path, part: Part) -> anyhow::Result<()> {
    let name = match part {
        Part::Local => "local log",
        Part::Postgres => "PostgreSQL",
    };
    let dir = args.dir.join(match part {
        Part::Local => "local",
        Part::Postgres => "pg",
    });
    println!(
        "\n### {name}: {} clients appending (AppendStream, SYNC, ~300 B of words), with the index and without\n",
        args.clients
    );
    let cpu_of = match part {
        Part::Local => "store CPU µs an append",
        Part::Postgres => "store + PostgreSQL CPU µs an append",
    };
    println!("| run | index | appends/s | p99 ms | {cpu_of} | freshness p50 ms | freshness p99 ms | probes |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    let (mut with, mut without) = (stats::Runs::default(), stats::Runs::default());
    let (mut cpu_with, mut cpu_without) = (stats::Runs::default(), stats::Runs::default());
    let mut fresh_all = Vec::new();
    for run in 0..args.runs {
        for indexed in [run % 2 == 0, run % 2 != 0] {
            let running = tokio::task::block_in_place(|| start(binary, part, &dir, indexed, None))?;
            let Measured {
                appends_per_s: rate,
                p99_ms: p99,
                cpu_us,
                fresh,
            } = load(&running, args.clients, args.secs, indexed).await?;
            drop(running);
            let (f50, f99) = freshness_cells(&fresh);
            println!(
                "| {run} | {} | {} | {:.1} | {cpu_us:.1} | {f50} | {f99} | {} |",
                if indexed { "on" } else { "off" },
                fmt_num(rate),
                p99,
                fresh.len()
            );
            if indexed {
                with.push(rate);
                cpu_with.push(cpu_us);
                fresh_all.extend(fresh);
            } else {
                without.push(rate);
                cpu_without.push(cpu_us);
            }
        }
    }
    println!(
        "\nappends/s with the index ÷ without (medians): **{}**; {cpu_of} with ÷ without: {}; freshness over every run: p50 {:.0} ms, p99 {:.0} ms, max {:.0} ms ({} probes)",
        fmt_ratio(with.median() / without.median()),
        fmt_ratio(cpu_with.median() / cpu_without.median()),
        percentile_f64(&fresh_all, 0.5),
        percentile_f64(&fresh_all, 0.99),
        fresh_all.iter().cloned().fold(0.0, f64::max),
        fresh_all.len()
    );

    // What indexing an event cost under that load.
    let index_cpu_us = cpu_with.median() - cpu_without.median();
    println!(
        "\n### {name}: queries at {} events (pages of 20, one query at a time)\n",
        fmt_num(args.events as f64)
    );
    let running = tokio::task::block_in_place(|| start(binary, part, &dir, true, None))?;
    let url = running.store.url();
    let filled = fill(&url, args.events).await?;
    println!("filled and indexed in {filled:.1} s\n");
    println!("| query | p50 ms | p99 ms | hits a page |");
    println!("|---|---:|---:|---:|");
    let kinds: [(&str, MakeQuery); 5] = [
        (
            "a rare word (rank 10,000–20,000)",
            Box::new(|r| word(r.usize(10_000..VOCABULARY))),
        ),
        (
            "a common word (rank 0–10)",
            Box::new(|r| word(r.usize(0..10))),
        ),
        (
            "two words (ranks 0–100)",
            Box::new(|r| format!("{} {}", word(r.usize(0..100)), word(r.usize(0..100)))),
        ),
        (
            "a phrase of two words (ranks 0–20)",
            Box::new(|r| format!("\"{} {}\"", word(r.usize(0..20)), word(r.usize(0..20)))),
        ),
        (
            "a prefix (`wa*`…`wz*`)",
            Box::new(|r| format!("w{}*", (b'a' + r.u8(0..26)) as char)),
        ),
    ];
    for (kind, make) in kinds {
        let (p50, p99, hits) = time_queries(&url, args.queries, make).await?;
        println!("| {kind} | {p50:.1} | {p99:.1} | {hits:.1} |");
    }

    match (running.store.backing.clone(), part) {
        (Backing::Dir(d), Part::Local) => {
            let (log, index) = (dir_bytes(&d.join("log")), dir_bytes(&d.join("search")));
            println!(
                "\nindex bytes per log byte: {} MiB of `search/` ÷ {} MiB of `log/` = **{:.2}**",
                fmt_num(index as f64 / 1048576.0),
                fmt_num(log as f64 / 1048576.0),
                index as f64 / log as f64
            );
            let mut store = running.store;
            let _ = store.terminate();
            let warm = Instant::now();
            let mut again =
                Store::start_backed(binary, Backing::Dir(d.clone()), "127.0.0.1:0", &[])?;
            let warm = warm.elapsed().as_secs_f64();
            let warm_cpu = profile::cpu_secs(again.pid());
            let _ = again.terminate();
            std::fs::remove_dir_all(d.join("search"))?;
            let cold = Instant::now();
            let mut rebuilt =
                Store::start_backed(binary, Backing::Dir(d.clone()), "127.0.0.1:0", &[])?;
            let cold = cold.elapsed().as_secs_f64();
            let rebuild_cpu_us =
                (profile::cpu_secs(rebuilt.pid()) - warm_cpu) * 1e6 / args.events as f64;
            let _ = rebuilt.terminate();
            println!(
                "\nthe index rebuilt from scratch: a start without `search/` took {cold:.1} s ({} events/s, {rebuild_cpu_us:.1} µs of CPU an event) against {warm:.2} s with it in place",
                fmt_num(args.events as f64 / cold)
            );
            println!(
                "\nindexing an event under the append load (store CPU an append with the index − without, medians): {index_cpu_us:.1} µs = **{}** the rebuild's (tantivy's cost in bulk)",
                fmt_ratio(index_cpu_us / rebuild_cpu_us)
            );
        }
        (Backing::Database(url, _), Part::Postgres) => {
            let pg = running.pg.as_ref().expect("the server");
            let db = url.rsplit('/').next().unwrap_or_default();
            let sizes = tokio::task::block_in_place(|| {
                pg.psql(
                    db,
                    "SELECT pg_total_relation_size('agentlog_search') || ' ' || \
                     pg_total_relation_size('agentlog_events')",
                )
            })?;
            let mut parts = sizes
                .split_whitespace()
                .map(|s| s.parse::<f64>().unwrap_or(0.0));
            let (search, events) = (parts.next().unwrap_or(0.0), parts.next().unwrap_or(1.0));
            println!(
                "\nsearch bytes per event byte: {} MiB of `agentlog_search` ÷ {} MiB of `agentlog_events` (indexes and TOAST included) = **{:.2}**",
                fmt_num(search / 1048576.0),
                fmt_num(events / 1048576.0),
                search / events
            );
        }
        _ => {}
    }
    Ok(())
}

/// The fixed text of the shared appenders (unused here: every append draws its words).
fn event_text() -> String {
    text(&mut fastrand::Rng::with_seed(0))
}

/// The local index's commit periods of `--commit-periods`, each run `--runs` times under
/// the append load with the probe (the order rotating run by run, so that no period always
/// follows another); medians of appends/s and CPU an append, each against the first
/// period's, and freshness over every run.
async fn sweep(args: &Args, binary: &Path) -> anyhow::Result<()> {
    let periods = &args.commit_periods;
    let dir = args.dir.join("sweep");
    println!(
        "\n### local log: the index's commit period, {} clients appending (AppendStream, SYNC, ~300 B of words)\n",
        args.clients
    );
    println!("| run | commit every | appends/s | p99 ms | store CPU µs an append | freshness p50 ms | freshness p99 ms | probes |");
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    let mut rates = vec![stats::Runs::default(); periods.len()];
    let mut cpus = vec![stats::Runs::default(); periods.len()];
    let mut fresh_all = vec![Vec::new(); periods.len()];
    for run in 0..args.runs {
        for k in 0..periods.len() {
            let i = (k + run) % periods.len();
            let running = tokio::task::block_in_place(|| {
                start(binary, Part::Local, &dir, true, Some(&periods[i]))
            })?;
            let measured = load(&running, args.clients, args.secs, true).await?;
            drop(running);
            let (f50, f99) = freshness_cells(&measured.fresh);
            println!(
                "| {run} | {} | {} | {:.1} | {:.1} | {f50} | {f99} | {} |",
                periods[i],
                fmt_num(measured.appends_per_s),
                measured.p99_ms,
                measured.cpu_us,
                measured.fresh.len()
            );
            rates[i].push(measured.appends_per_s);
            cpus[i].push(measured.cpu_us);
            fresh_all[i].extend(measured.fresh);
        }
    }
    println!("\n| commit every | appends/s (median) | ÷ {0} | CPU µs an append (median) | ÷ {0} | freshness p50 / p99 / max ms |", periods[0]);
    println!("|---|---:|---:|---:|---:|---|");
    for (i, period) in periods.iter().enumerate() {
        let fresh = &fresh_all[i];
        println!(
            "| {period} | {} | {} | {:.1} | {} | {:.0} / {:.0} / {:.0} |",
            fmt_num(rates[i].median()),
            fmt_ratio(rates[i].median() / rates[0].median()),
            cpus[i].median(),
            fmt_ratio(cpus[i].median() / cpus[0].median()),
            percentile_f64(fresh, 0.5),
            percentile_f64(fresh, 0.99),
            fresh.iter().cloned().fold(0.0, f64::max),
        );
    }
    Ok(())
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
    if !args.commit_periods.is_empty() {
        sweep(&args, &binary).await?;
    } else if args.only != Some(Part::Postgres) {
        part(&args, &binary, Part::Local).await?;
    }
    if args.commit_periods.is_empty() && args.only != Some(Part::Local) {
        part(&args, &binary, Part::Postgres).await?;
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("\nload average after: {}", load.trim());
    Ok(())
}
