//! How the store's costs grow with the number of sessions it holds, most of them idle
//! (bench/RESULTS.md, "Scale with sessions"), on both backends, each figure at several
//! session counts in one run so that the ratios largest ÷ smallest come from one machine
//! at one time:
//!
//! - seeding: N idle sessions on a fresh store, each a ~100-byte user message (distinct
//!   texts; ten of them hold the word "needle") answered by a final assistant message
//!   under a lease, as a runner leaves a finished turn: `Append` of the user message on an
//!   `AppendStream`, `AcquireLease`, the assistant message on the stream under that epoch,
//!   `ReleaseLease`; many seeders at once, each on its own connection and stream;
//! - per call, the median (min, max) of up to `--calls` calls, the figures taking turns
//!   call by call: `ListSessions` first page of 50, the same with the idle status, the
//!   second page (the first page's token), a query matching ten sessions (with what its
//!   first page held), `GetSession` of a random session, `ClaimSession` with wait 0 (none
//!   is claimable: each must answer no lease);
//! - the store's RSS after seeding and after a quiet spell, and bytes per idle session
//!   between the smallest and each larger count;
//! - restart: `kill -9`, then a new store process on the same data (directory, or
//!   database: PostgreSQL stays up), timed until it logs its address and until a
//!   `GetSession` answers; the local store's own recovery log line is reported beside it.
//!   Then once more, with nothing written in between: the local index (sled) reads back at
//!   open what it wrote since its previous open, so the first restart after seeding pays for
//!   the seeding's index writes and the second shows a restart on its own.
//!
//! Build in release first (`cargo build --release -p event-store -p bench`), then
//! `target/release/agentlog-bench-scale` (`--help` for the knobs). Prints Markdown.

#[path = "../agentlog.rs"]
#[allow(dead_code)]
mod agentlog;
#[path = "../appenders.rs"]
#[allow(dead_code)]
mod appenders;
#[path = "../fanout.rs"]
#[allow(dead_code)]
mod fanout;
#[path = "../load.rs"]
#[allow(dead_code)]
mod load;
#[path = "../profile.rs"]
#[allow(dead_code)]
mod profile;
#[path = "../scrape.rs"]
mod scrape;
#[path = "../stats.rs"]
#[allow(dead_code)]
mod stats;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::{
    content_block, event, AcquireLeaseRequest, AppendRequest, AssistantMessage,
    ClaimSessionRequest, ContentBlock, Event, GetSessionRequest, ListSessionsRequest,
    ReleaseLeaseRequest, SessionStatus, TextBlock,
};
use anyhow::Context;
use clap::Parser;
use testkit::pg::Postgres;
use testkit::{Backing, Store};
use tonic::transport::Channel;

use agentlog::rss;
use appenders::{user_event, AgentlogStreamAppender};
use scrape::{free_port, metric};
use stats::{fmt_num, fmt_ratio, Runs};

#[derive(Parser)]
struct Args {
    /// Session counts of the local backend, each on a fresh store.
    #[arg(long, value_delimiter = ',', default_value = "1000,100000,1000000")]
    sessions: Vec<usize>,
    /// Session counts of the PostgreSQL backend (`--pg-sessions` with none: skip it).
    #[arg(long, value_delimiter = ',', num_args = 0.., default_value = "1000,100000")]
    pg_sessions: Vec<usize>,
    /// Calls per figure at most (the median is reported).
    #[arg(long, default_value_t = 200)]
    calls: usize,
    /// Seconds one figure may take at one count: past it, no more calls once it has 5.
    #[arg(long, default_value_t = 30.0)]
    figure_secs: f64,
    /// Sessions seeded at once (each seeder on its own connection and AppendStream).
    #[arg(long, default_value_t = 256)]
    seeders: usize,
    /// Seconds of quiet after seeding before the second RSS reading.
    #[arg(long, default_value_t = 10)]
    quiet_secs: u64,
    /// Where the local stores keep their data.
    #[arg(long, default_value = "target/bench-scale")]
    dir: PathBuf,
    /// Keep the local stores' data directories after measuring them (for a look at what
    /// they hold, or more restarts by hand).
    #[arg(long)]
    keep: bool,
    /// The event-store binary (default: the one next to this program).
    #[arg(long)]
    store_binary: Option<PathBuf>,
}

/// The figures timed per call, in the order they take turns.
const FIGURES: [&str; 6] = [
    "ListSessions first page (50)",
    "ListSessions status idle, first page",
    "ListSessions second page",
    "ListSessions query matching 10",
    "GetSession (random)",
    "ClaimSession wait 0, none claimable",
];
const PAGE: u32 = 50;
/// The word ten sessions' first messages hold.
const NEEDLE: &str = "needle";

fn session_id(i: usize) -> String {
    format!("idle-{i:07}")
}

/// Session `i`'s first user message: about 100 bytes, distinct; "needle" in ten of them.
fn first_text(i: usize, sessions: usize) -> String {
    let needle = if i % (sessions / 10).max(1) == 7 {
        " (needle)"
    } else {
        ""
    };
    let mut text = format!("#{i:07}{needle}: please look at the failing parser test and fix it; ");
    while text.len() < 100 {
        text.push('.');
    }
    text
}

/// The final answer that leaves a session idle.
fn assistant_event() -> Event {
    Event {
        kind: Some(event::Kind::AssistantMessage(AssistantMessage {
            content: vec![ContentBlock {
                block: Some(content_block::Block::Text(TextBlock {
                    text: "Fixed: the parser test passes now.".into(),
                })),
            }],
            stop_reason: "end_turn".into(),
            ..Default::default()
        })),
        ..Default::default()
    }
}

/// Seeds `sessions` idle sessions (see the module head) with `seeders` at once; returns
/// the seconds it took.
async fn seed(url: &str, sessions: usize, seeders: usize) -> anyhow::Result<f64> {
    let next = Arc::new(AtomicUsize::new(0));
    let started = Instant::now();
    let mut tasks = Vec::new();
    for _ in 0..seeders.min(sessions) {
        let mut stream = AgentlogStreamAppender::connect(url, String::new()).await?;
        let mut client = EventStoreClient::connect(url.to_string()).await?;
        let next = next.clone();
        tasks.push(tokio::spawn(async move {
            loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= sessions {
                    return anyhow::Ok(());
                }
                let id = session_id(i);
                stream
                    .send(AppendRequest {
                        session_id: id.clone(),
                        events: vec![user_event(first_text(i, sessions))],
                        ..Default::default()
                    })
                    .await?;
                let lease = client
                    .acquire_lease(AcquireLeaseRequest {
                        session_id: id.clone(),
                        owner: "seeder".into(),
                        ttl_ms: 120_000,
                    })
                    .await?
                    .into_inner();
                stream
                    .send(AppendRequest {
                        session_id: id.clone(),
                        events: vec![assistant_event()],
                        lease_epoch: Some(lease.epoch),
                        ..Default::default()
                    })
                    .await?;
                client
                    .release_lease(ReleaseLeaseRequest {
                        session_id: id,
                        owner: "seeder".into(),
                        epoch: lease.epoch,
                    })
                    .await?;
            }
        }));
    }
    for task in tasks {
        task.await??;
    }
    Ok(started.elapsed().as_secs_f64())
}

/// What the query's first page held, over all its calls.
#[derive(Default)]
struct QueryPage {
    sessions: Vec<usize>,
    next_token: bool,
}

/// Times every figure of [`FIGURES`], taking turns call by call.
async fn time_calls(
    client: &mut EventStoreClient<Channel>,
    sessions: usize,
    args: &Args,
) -> anyhow::Result<(BTreeMap<&'static str, Runs>, QueryPage)> {
    let mut times: BTreeMap<&'static str, Runs> = BTreeMap::new();
    let mut spent = [0.0f64; FIGURES.len()];
    let mut query = QueryPage::default();
    let wanted = |f: usize, times: &BTreeMap<&str, Runs>, spent: &[f64]| {
        let n = times.get(FIGURES[f]).map_or(0, |r| r.0.len());
        // No second page below one full page.
        (f != 2 || sessions > PAGE as usize)
            && n < args.calls
            && (n < 5 || spent[f] < args.figure_secs)
    };
    let list = |status: SessionStatus, token: String, query: &str| ListSessionsRequest {
        page_size: PAGE,
        page_token: token,
        query: query.into(),
        status: status as i32,
    };
    while (0..FIGURES.len()).any(|f| wanted(f, &times, &spent)) {
        let mut token = String::new();
        for (f, figure) in FIGURES.iter().enumerate() {
            // The second page needs the first one's token.
            if !(wanted(f, &times, &spent) || f == 0 && wanted(2, &times, &spent)) {
                continue;
            }
            let started = Instant::now();
            match f {
                0 => {
                    let page = client
                        .list_sessions(list(SessionStatus::Unspecified, String::new(), ""))
                        .await?
                        .into_inner();
                    anyhow::ensure!(
                        page.sessions.len() == (PAGE as usize).min(sessions),
                        "the first page held {} sessions",
                        page.sessions.len()
                    );
                    token = page.next_page_token;
                }
                1 => {
                    let page = client
                        .list_sessions(list(SessionStatus::Idle, String::new(), ""))
                        .await?
                        .into_inner();
                    anyhow::ensure!(
                        page.sessions.len() == (PAGE as usize).min(sessions),
                        "the first page of idle sessions held {} (were they seeded idle?)",
                        page.sessions.len()
                    );
                }
                2 => {
                    anyhow::ensure!(!token.is_empty(), "the first page gave no next token");
                    client
                        .list_sessions(list(SessionStatus::Unspecified, token.clone(), ""))
                        .await?;
                }
                3 => {
                    let page = client
                        .list_sessions(list(SessionStatus::Unspecified, String::new(), NEEDLE))
                        .await?
                        .into_inner();
                    query.sessions.push(page.sessions.len());
                    query.next_token |= !page.next_page_token.is_empty();
                }
                4 => {
                    client
                        .get_session(GetSessionRequest {
                            session_id: session_id(fastrand::usize(..sessions)),
                        })
                        .await?;
                }
                _ => {
                    let claimed = client
                        .claim_session(ClaimSessionRequest {
                            owner: "bench".into(),
                            ttl_ms: 30_000,
                            wait_ms: 0,
                        })
                        .await?
                        .into_inner();
                    anyhow::ensure!(
                        claimed.lease.is_none(),
                        "ClaimSession handed out {:?}: a seeded session was runnable",
                        claimed.lease
                    );
                }
            }
            let secs = started.elapsed().as_secs_f64();
            if wanted(f, &times, &spent) {
                spent[f] += secs;
                times.entry(figure).or_default().push(secs * 1e3);
            }
        }
    }
    Ok((times, query))
}

/// An event-store process started for a restart: its log lines kept.
struct Restarted {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Drop for Restarted {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// What a restart took.
struct Restart {
    to_listen_secs: f64,
    to_serving_secs: f64,
    /// The local store's `elapsed_ms` of "opened the index" (sled's open).
    index_open_ms: Option<f64>,
    /// The local store's `elapsed_ms` of "recovered the index from the log".
    recovery_ms: Option<f64>,
    rss_bytes: u64,
}

/// Starts `binary` on the data `store` used (after it was killed), with its arguments,
/// and times it until a `GetSession` of `probe` answers.
async fn restart(binary: &Path, store: &Store, probe: &str) -> anyhow::Result<Restart> {
    let mut command = Command::new(binary);
    command.args(["--listen", "127.0.0.1:0"]);
    // Its metrics on a port of its own: the killed store's may still be taken.
    let mut extra = store.extra.clone();
    if let Some(i) = extra.iter().position(|a| a == "--metrics-listen") {
        extra[i + 1] = format!("127.0.0.1:{}", free_port()?);
    }
    match &store.backing {
        Backing::Dir(dir) => command.arg("--data-dir").arg(dir),
        Backing::Database(url, _) => command.args(["--database-url", url.as_str()]),
    };
    let started = Instant::now();
    let mut child = command
        .args(&extra)
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("spawn {}", binary.display()))?;
    let lines = Arc::new(Mutex::new(Vec::new()));
    let stderr = child.stderr.take().context("piped stderr")?;
    let restarted = Restarted {
        child,
        lines: lines.clone(),
    };
    let addr = tokio::task::block_in_place(|| {
        testkit::wait_for_listen_line(stderr, "event-store", Some(lines))
    })?;
    let to_listen_secs = started.elapsed().as_secs_f64();
    let deadline = Instant::now() + Duration::from_secs(600);
    loop {
        let answered = async {
            let mut client = EventStoreClient::connect(format!("http://{addr}")).await?;
            client
                .get_session(GetSessionRequest {
                    session_id: probe.into(),
                })
                .await?;
            anyhow::Ok(())
        };
        if answered.await.is_ok() {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the restarted store never served"
        );
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let to_serving_secs = started.elapsed().as_secs_f64();
    let logged_ms = |message: &str| -> Option<f64> {
        restarted
            .lines
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|l| l.contains(message))
            .and_then(|l| l.split("elapsed_ms=").nth(1))
            .and_then(|v| v.split_whitespace().next()?.parse().ok())
    };
    let index_open_ms = logged_ms("opened the index");
    let recovery_ms = logged_ms("recovered the index from the log");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (rss_bytes, _) = rss(restarted.child.id())?;
    Ok(Restart {
        to_listen_secs,
        to_serving_secs,
        index_open_ms,
        recovery_ms,
        rss_bytes,
    })
}

/// Everything measured at one session count.
struct Point {
    sessions: usize,
    seed_secs: f64,
    seed_cpu_secs: f64,
    times: BTreeMap<&'static str, Runs>,
    query: QueryPage,
    rss_seeded: u64,
    rss_quiet: u64,
    /// `agentlog_store_session_cache_bytes` after the quiet spell.
    session_cache: u64,
    /// The first restart, right after seeding.
    restart: Restart,
    /// A second `kill -9` and restart, with nothing written in between.
    restart_again: Restart,
}

async fn measure(
    args: &Args,
    binary: &Path,
    backing: Backing,
    extra: &[&str],
    sessions: usize,
    label: &str,
) -> anyhow::Result<Point> {
    let metrics_addr = format!("127.0.0.1:{}", free_port()?);
    let extra: Vec<&str> = extra
        .iter()
        .copied()
        .chain(["--metrics-listen", &metrics_addr])
        .collect();
    let mut store = Store::start_backed(binary, backing, "127.0.0.1:0", &extra)?;
    let url = store.url();
    eprintln!("{label}: seeding {sessions} idle sessions");
    let cpu_before = profile::cpu_secs(store.pid());
    let seed_secs = seed(&url, sessions, args.seeders).await?;
    let seed_cpu_secs = profile::cpu_secs(store.pid()) - cpu_before;
    eprintln!(
        "{label}: seeded in {seed_secs:.1} s ({:.0} sessions/s)",
        sessions as f64 / seed_secs
    );
    let (rss_seeded, _) = rss(store.pid())?;
    tokio::time::sleep(Duration::from_secs(args.quiet_secs)).await;
    let (rss_quiet, _) = rss(store.pid())?;
    let session_cache = metric(&metrics_addr, "agentlog_store_session_cache_bytes").await? as u64;
    eprintln!("{label}: timing the calls");
    let mut client = EventStoreClient::connect(url).await?;
    let (times, query) = time_calls(&mut client, sessions, args).await?;
    drop(client);
    eprintln!("{label}: kill -9 and restart");
    store.kill9();
    let restart_after_seeding = restart(binary, &store, &session_id(sessions / 2)).await?;
    eprintln!("{label}: kill -9 and restart again");
    let restart_again = restart(binary, &store, &session_id(sessions / 3)).await?;
    Ok(Point {
        sessions,
        seed_secs,
        seed_cpu_secs,
        times,
        query,
        rss_seeded,
        rss_quiet,
        session_cache,
        restart: restart_after_seeding,
        restart_again,
    })
}

fn ms(runs: Option<&Runs>) -> String {
    match runs {
        Some(r) if !r.is_empty() => format!(
            "{} ({}–{}; n={})",
            fmt_num(r.median()),
            fmt_num(r.min()),
            fmt_num(r.max()),
            r.0.len()
        ),
        _ => "–".into(),
    }
}

fn mib(bytes: u64) -> String {
    format!("{} MiB", fmt_num(bytes as f64 / 1048576.0))
}

/// The table of one backend: a row per figure, a column per count, and largest ÷
/// smallest.
fn print_table(title: &str, points: &[Point], goals: &BTreeMap<&str, &str>) {
    let (Some(first), Some(last)) = (points.first(), points.last()) else {
        return;
    };
    println!("\n### {title}\n");
    let counts: Vec<String> = points.iter().map(|p| fmt_num(p.sessions as f64)).collect();
    println!(
        "| figure | {} | largest ÷ smallest | goal |",
        counts.join(" | ")
    );
    println!("|---|{}---:|---|", "---:|".repeat(points.len()));
    let row = |name: &str, cells: Vec<String>, ratio: f64| {
        println!(
            "| {name} | {} | {} | {} |",
            cells.join(" | "),
            fmt_ratio(ratio),
            goals.get(name).copied().unwrap_or("")
        );
    };
    row(
        "seeding, sessions/s (4 calls each)",
        points
            .iter()
            .map(|p| {
                format!(
                    "{} ({:.1} s)",
                    fmt_num(p.sessions as f64 / p.seed_secs),
                    p.seed_secs
                )
            })
            .collect(),
        (last.sessions as f64 / last.seed_secs) / (first.sessions as f64 / first.seed_secs),
    );
    row(
        "store CPU per seeded session, µs",
        points
            .iter()
            .map(|p| fmt_num(p.seed_cpu_secs * 1e6 / p.sessions as f64))
            .collect(),
        (last.seed_cpu_secs / last.sessions as f64) / (first.seed_cpu_secs / first.sessions as f64),
    );
    for figure in FIGURES {
        let median = |p: &Point| p.times.get(figure).map_or(f64::NAN, Runs::median);
        row(
            &format!("{figure}, ms"),
            points.iter().map(|p| ms(p.times.get(figure))).collect(),
            median(last) / median(first),
        );
    }
    let held = |p: &Point| {
        let (lo, hi) = (
            p.query.sessions.iter().min().copied().unwrap_or(0),
            p.query.sessions.iter().max().copied().unwrap_or(0),
        );
        let range = if lo == hi {
            lo.to_string()
        } else {
            format!("{lo}–{hi}")
        };
        let token = if p.query.next_token { "a" } else { "no" };
        format!("{range}, {token} next token")
    };
    println!(
        "| the query's first page held | {} | | |",
        points.iter().map(held).collect::<Vec<_>>().join(" | ")
    );
    row(
        "store RSS after seeding",
        points.iter().map(|p| mib(p.rss_seeded)).collect(),
        last.rss_seeded as f64 / first.rss_seeded as f64,
    );
    row(
        "store RSS after the quiet spell",
        points.iter().map(|p| mib(p.rss_quiet)).collect(),
        last.rss_quiet as f64 / first.rss_quiet as f64,
    );
    let per_session = |name: &str, rss: fn(&Point) -> u64| {
        println!(
            "| bytes per idle session {name}, (RSS − RSS at {}) ÷ (N − {}) | – | {} | | {} |",
            fmt_num(first.sessions as f64),
            fmt_num(first.sessions as f64),
            points[1..]
                .iter()
                .map(|p| fmt_num(
                    (rss(p) as f64 - rss(first) as f64) / (p.sessions - first.sessions) as f64
                ))
                .collect::<Vec<_>>()
                .join(" | "),
            goals.get("bytes").copied().unwrap_or("")
        );
    };
    per_session("after the quiet spell", |p| p.rss_quiet);
    row(
        "of which the session cache (`agentlog_store_session_cache_bytes`, bounded by `--session-cache`)",
        points.iter().map(|p| mib(p.session_cache)).collect(),
        last.session_cache as f64 / first.session_cache.max(1) as f64,
    );
    per_session("after the quiet spell, outside the session cache", |p| {
        p.rss_quiet.saturating_sub(p.session_cache)
    });
    // The local store's own log lines: sled's open, then the log's replay into the index.
    let logged_row = |name: &str, logged: &dyn Fn(&Point) -> Option<f64>| {
        if points.iter().any(|p| logged(p).is_some()) {
            let ms = |p: &Point| logged(p).unwrap_or(f64::NAN);
            row(
                name,
                points.iter().map(|p| fmt_num(ms(p))).collect(),
                ms(last) / ms(first),
            );
        }
    };
    let restart_parts = |restart: fn(&Point) -> &Restart| {
        logged_row(
            "of which opening the index (sled; its log line), ms",
            &|p| restart(p).index_open_ms,
        );
        logged_row(
            "of which the log's replay into the index (its log line), ms",
            &|p| restart(p).recovery_ms,
        );
    };
    row(
        "restart: kill -9 → address logged, s",
        points
            .iter()
            .map(|p| format!("{:.3}", p.restart.to_listen_secs))
            .collect(),
        last.restart.to_listen_secs / first.restart.to_listen_secs,
    );
    row(
        "restart: kill -9 → GetSession answers, s",
        points
            .iter()
            .map(|p| format!("{:.3}", p.restart.to_serving_secs))
            .collect(),
        last.restart.to_serving_secs / first.restart.to_serving_secs,
    );
    restart_parts(|p| &p.restart);
    row(
        "restart again, nothing written since: kill -9 → GetSession answers, s",
        points
            .iter()
            .map(|p| format!("{:.3}", p.restart_again.to_serving_secs))
            .collect(),
        last.restart_again.to_serving_secs / first.restart_again.to_serving_secs,
    );
    restart_parts(|p| &p.restart_again);
    row(
        "store RSS after the restart",
        points.iter().map(|p| mib(p.restart.rss_bytes)).collect(),
        last.restart.rss_bytes as f64 / first.restart.rss_bytes as f64,
    );
    per_session("after the restart", |p| p.restart.rss_bytes);
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .trim()
        .to_string()
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let binary = args
        .store_binary
        .clone()
        .unwrap_or_else(|| testkit::bin_path("event-store"));
    std::fs::create_dir_all(&args.dir)?;
    let load_before = loadavg();
    let goals: BTreeMap<&str, &str> = [
        ("ListSessions first page (50), ms", "≤ 2×"),
        ("ListSessions status idle, first page, ms", "≤ 2×"),
        ("ClaimSession wait 0, none claimable, ms", "flat"),
        ("restart: kill -9 → GetSession answers, s", "≤ 2×"),
        (
            "restart again, nothing written since: kill -9 → GetSession answers, s",
            "≤ 2×",
        ),
    ]
    .into_iter()
    .collect();

    let mut local = Vec::new();
    for &n in &args.sessions {
        let dir = args.dir.join(format!("local-{n}"));
        let _ = std::fs::remove_dir_all(&dir);
        let backing = Backing::Dir(dir.clone());
        local.push(measure(&args, &binary, backing, &[], n, &format!("local {n}")).await?);
        if !args.keep {
            let _ = std::fs::remove_dir_all(&dir);
        }
    }
    let mut postgres = Vec::new();
    if !args.pg_sessions.is_empty() {
        let pg = Arc::new(tokio::task::block_in_place(Postgres::start)?);
        for &n in &args.pg_sessions {
            let url = tokio::task::block_in_place(|| pg.create_database())?;
            let backing = Backing::Database(url, Some(pg.clone()));
            let extra = ["--database-pool-size", "64"];
            postgres
                .push(measure(&args, &binary, backing, &extra, n, &format!("postgres {n}")).await?);
        }
    }

    println!(
        "Idle sessions, each a ~100-byte user message and a final assistant \
         message written under a lease (`Append` on an `AppendStream`, `AcquireLease`, the \
         answer on the stream, `ReleaseLease`), {} seeders at once; per call figure the \
         median (min–max; n calls, at most {} or {} s), the figures taking turns call by \
         call; RSS read {} s after seeding. Load average before: {load_before}; after: {}.",
        args.seeders,
        args.calls,
        args.figure_secs,
        args.quiet_secs,
        loadavg()
    );
    let mut local_goals = goals.clone();
    local_goals.insert("bytes", "≤ 200 B");
    print_table("Local backend", &local, &local_goals);
    print_table(
        "PostgreSQL backend (one store replica; PostgreSQL stays up through its restart)",
        &postgres,
        &goals,
    );
    Ok(())
}

/// The text `appenders` puts in its default request (unused here: every request is built
/// above).
fn event_text() -> String {
    String::new()
}
