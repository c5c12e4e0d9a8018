//! The PostgreSQL backend beside raw PostgreSQL, on one private PostgreSQL 15 server, in
//! the same run: N closed-loop clients, each appending one 300-byte event per call to its
//! own session and waiting for the acknowledgement.
//!
//! - raw: one INSERT per event (autocommit, `synchronous_commit=on`) on the client's own
//!   connection, the floor any layer over PostgreSQL pays;
//! - agentlog over PostgreSQL (`event-store --database-url`), one store replica and two
//!   on the same database (clients split between them), each through unary `Append` and
//!   through one `AppendStream` per client (`--paths`);
//! - with `--compare-store-binary`, another build of the store (one replica, its own
//!   database on the same server), e.g. the previous commit, for a before/after in one run.
//!
//! Runs interleave the targets so that they see the same moments of a noisy machine; every
//! figure is the median of the runs. Beside throughput it reports the CPU time spent per
//! acknowledged append by the store process(es), by PostgreSQL (every server process) and
//! by this load generator (over warm-up and measurement, divided by the appends of both,
//! estimated from the measured rate). With `--statements`, PostgreSQL's time per statement
//! (pg_stat_statements). With `--list-sessions N`, N more sessions are created in each
//! store's database and `ListSessions` is timed on them. Prints Markdown tables (for
//! bench/RESULTS.md). Build the store in release first: `cargo build --release -p
//! event-store`, then `cargo run --release -p bench --bin agentlog-bench-pg --
//! --store-binary target/release/event-store`.

#[path = "../appenders.rs"]
mod appenders;
#[path = "../load.rs"]
#[allow(dead_code)]
mod load;
#[path = "../stats.rs"]
#[allow(dead_code)]
mod stats;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::{AppendRequest, ListSessionsRequest, SessionStatus};
use clap::Parser;
use testkit::pg::Postgres;
use testkit::{bin_path, Backing, Store};
use tokio_postgres::{Client, NoTls, Statement};

use appenders::{user_event, AgentlogAppender, AgentlogStreamAppender};
use load::{closed_loop, Appender, Window};
use stats::Runs;

/// Bytes of text in each appended event (as in the main suite).
const EVENT_BYTES: usize = 300;
/// `ListSessions` calls timed per store and query.
const LIST_CALLS: usize = 20;

#[derive(Parser)]
struct Args {
    /// Client counts to measure.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64")]
    clients: Vec<usize>,
    /// Runs per point (the median is reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Seconds measured per run (after one second of warm-up).
    #[arg(long, default_value_t = 5)]
    secs: u64,
    /// The gRPC paths the stores are driven through.
    #[arg(long, value_delimiter = ',', default_value = "unary,stream")]
    paths: Vec<AppendPath>,
    /// Leave out the two-replica targets.
    #[arg(long)]
    one_replica: bool,
    /// The store's `--notify` mode (`listen` or `poll`).
    #[arg(long, default_value = "listen")]
    notify: String,
    /// The event-store binary (default: the one next to this program).
    #[arg(long)]
    store_binary: Option<std::path::PathBuf>,
    /// Another event-store binary measured beside it (one replica).
    #[arg(long)]
    compare_store_binary: Option<std::path::PathBuf>,
    /// Report PostgreSQL's time per statement (pg_stat_statements) over the append runs.
    #[arg(long)]
    statements: bool,
    /// Create this many more sessions in each store's database after the append runs and
    /// time `ListSessions` over them.
    #[arg(long, default_value_t = 0)]
    list_sessions: usize,
}

/// How a client sends its appends to a store.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug, clap::ValueEnum)]
enum AppendPath {
    /// One unary `Append` call per append.
    Unary,
    /// One `AppendStream` per client, one request per append.
    Stream,
}

/// Which store (or stores) a target drives.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Stores {
    One,
    Two,
    Compared,
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Target {
    Raw,
    Store(Stores, AppendPath),
}

impl Target {
    fn label(self) -> String {
        let Target::Store(stores, path) = self else {
            return "raw PostgreSQL, INSERT per event".into();
        };
        let path = match path {
            AppendPath::Unary => "Append",
            AppendPath::Stream => "AppendStream",
        };
        match stores {
            Stores::One => format!("agentlog over PostgreSQL, {path}, 1 store replica"),
            Stores::Two => format!("agentlog over PostgreSQL, {path}, 2 store replicas"),
            Stores::Compared => format!("the compared build, {path}, 1 store replica"),
        }
    }

    /// A prefix that keeps each target's sessions apart.
    fn key(self) -> String {
        match self {
            Target::Raw => "raw".into(),
            Target::Store(stores, path) => format!("s{}{}", stores as u8, path as u8),
        }
    }
}

/// CPU seconds (user + system) a process has used, with its reaped children when
/// `children`.
fn cpu_seconds(pid: u32, children: bool) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // The fields after the command name (which may hold spaces) in parentheses.
    let Some((_, rest)) = stat.rsplit_once(')') else {
        return 0.0;
    };
    let fields: Vec<f64> = rest
        .split_whitespace()
        .map(|f| f.parse().unwrap_or(0.0))
        .collect();
    // utime, stime, cutime, cstime are fields 14-17 of the line, 12-15 after the name.
    let ticks = fields[11]
        + fields[12]
        + if children {
            fields[13] + fields[14]
        } else {
            0.0
        };
    // /proc counts in USER_HZ clock ticks, 100 per second in Linux's ABI.
    ticks / 100.0
}

/// CPU seconds used by the PostgreSQL server: the postmaster, the backends that exited
/// (reaped, so counted as its children) and those still running.
fn postgres_cpu_seconds(postmaster: u32) -> f64 {
    let mut total = cpu_seconds(postmaster, true);
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return total;
    };
    for entry in dir.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<u32>().ok())
        else {
            continue;
        };
        let parent = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                s.rsplit_once(')')
                    .and_then(|(_, rest)| rest.split_whitespace().nth(1)?.parse::<u32>().ok())
            });
        if parent == Some(postmaster) {
            total += cpu_seconds(pid, false);
        }
    }
    total
}

/// CPU microseconds per append, by whom.
#[derive(Default, Clone, Copy)]
struct CpuPerAppend {
    store: f64,
    postgres: f64,
    load: f64,
}

fn event_text() -> String {
    let phrase = "Please look at the failing test in the parser module and fix it. ";
    phrase.repeat(EVENT_BYTES / phrase.len() + 1)[..EVENT_BYTES].to_string()
}

struct RawAppender {
    client: Client,
    insert: Statement,
    session: String,
    seq: i64,
    body: String,
}

impl Appender for RawAppender {
    async fn append(&mut self) -> anyhow::Result<()> {
        self.seq += 1;
        self.client
            .execute(&self.insert, &[&self.session, &self.seq, &self.body])
            .await?;
        Ok(())
    }
}

/// A store client on either path.
enum StoreAppender {
    Unary(AgentlogAppender),
    Stream(AgentlogStreamAppender),
}

impl Appender for StoreAppender {
    async fn append(&mut self) -> anyhow::Result<()> {
        match self {
            StoreAppender::Unary(a) => a.append().await,
            StoreAppender::Stream(a) => a.append().await,
        }
    }
}

async fn connect(url: &str) -> anyhow::Result<Client> {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

/// Creates `n` sessions of one event each through the store at `url`, 64 at a time.
async fn create_sessions(url: &str, prefix: &str, n: usize) -> anyhow::Result<()> {
    let mut tasks = Vec::new();
    for worker in 0..64.min(n) {
        let url = url.to_string();
        let prefix = prefix.to_string();
        tasks.push(tokio::spawn(async move {
            let mut client = EventStoreClient::connect(url).await?;
            for i in (worker..n).step_by(64) {
                client
                    .append(AppendRequest {
                        session_id: format!("{prefix}-{i:07}"),
                        events: vec![user_event(event_text())],
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

/// The `ListSessions` requests timed: the first page, the page after it, a status filter,
/// and a text query that matches no session (every session is looked at).
fn list_requests() -> Vec<(&'static str, ListSessionsRequest)> {
    vec![
        ("first page of 100", ListSessionsRequest::default()),
        (
            "runnable sessions, first page",
            ListSessionsRequest {
                status: SessionStatus::Runnable as i32,
                ..Default::default()
            },
        ),
        (
            "a text query matching none",
            ListSessionsRequest {
                query: "no session says this".into(),
                ..Default::default()
            },
        ),
    ]
}

/// Milliseconds per `ListSessions` call (median of [`LIST_CALLS`]) for each of
/// [`list_requests`], and for the second page; the stores take turns call by call.
async fn time_list_sessions(
    stores: &[(String, String)],
) -> anyhow::Result<BTreeMap<(String, &'static str), Runs>> {
    let mut clients = Vec::new();
    for (_, url) in stores {
        clients.push(EventStoreClient::connect(url.clone()).await?);
    }
    let mut times: BTreeMap<(String, &'static str), Runs> = BTreeMap::new();
    for _ in 0..LIST_CALLS {
        for ((label, _), client) in stores.iter().zip(clients.iter_mut()) {
            for (name, request) in list_requests() {
                let started = Instant::now();
                let page = client.list_sessions(request).await?.into_inner();
                times
                    .entry((label.clone(), name))
                    .or_default()
                    .push(started.elapsed().as_secs_f64() * 1e3);
                if name == "first page of 100" {
                    let started = Instant::now();
                    client
                        .list_sessions(ListSessionsRequest {
                            page_token: page.next_page_token,
                            ..Default::default()
                        })
                        .await?;
                    times
                        .entry((label.clone(), "second page of 100"))
                        .or_default()
                        .push(started.elapsed().as_secs_f64() * 1e3);
                }
            }
        }
    }
    Ok(times)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let settings: &[&str] = if args.statements {
        &[
            "shared_preload_libraries=pg_stat_statements",
            "pg_stat_statements.track_planning=on",
        ]
    } else {
        &[]
    };
    let pg = tokio::task::block_in_place(|| Postgres::start_with(settings))?;
    let raw_url = tokio::task::block_in_place(|| pg.create_database())?;
    let store_url = tokio::task::block_in_place(|| pg.create_database())?;
    let compared_url = tokio::task::block_in_place(|| pg.create_database())?;
    let postmaster: u32 = std::fs::read_to_string(pg.data.join("postmaster.pid"))?
        .lines()
        .next()
        .unwrap_or_default()
        .trim()
        .parse()?;
    let raw = connect(&raw_url).await?;
    raw.batch_execute(
        "CREATE TABLE events (session text NOT NULL, seq bigint NOT NULL, \
         body text NOT NULL, PRIMARY KEY (session, seq))",
    )
    .await?;
    let binary = args
        .store_binary
        .clone()
        .unwrap_or_else(|| bin_path("event-store"));
    let start = |binary: &std::path::Path, url: &str| {
        Store::start_backed(
            binary,
            Backing::Database(url.to_string(), None),
            "127.0.0.1:0",
            &["--database-pool-size", "64", "--notify", &args.notify],
        )
    };
    let replicas = [start(&binary, &store_url)?, start(&binary, &store_url)?];
    let compared = match &args.compare_store_binary {
        Some(other) => Some(start(other, &compared_url)?),
        None => None,
    };
    let mut targets = vec![Target::Raw];
    for &path in &args.paths {
        targets.push(Target::Store(Stores::One, path));
        if !args.one_replica {
            targets.push(Target::Store(Stores::Two, path));
        }
        if compared.is_some() {
            targets.push(Target::Store(Stores::Compared, path));
        }
    }
    if args.statements {
        raw.batch_execute("CREATE EXTENSION pg_stat_statements; SELECT pg_stat_statements_reset()")
            .await?;
    }
    let window = Window {
        warmup: Duration::from_secs(1),
        measure: Duration::from_secs(args.secs),
    };
    let body = serde_json::json!({"type": "user_message", "text": event_text()}).to_string();
    let mut results: BTreeMap<(usize, Target), Runs> = Default::default();
    let mut cpu: BTreeMap<(usize, Target), Vec<CpuPerAppend>> = Default::default();
    // Appends acknowledged per database (estimated from the rates), for `--statements`.
    let mut appends_in: BTreeMap<String, f64> = Default::default();
    for &clients in &args.clients {
        for run in 0..args.runs {
            for &target in &targets {
                let stores: Vec<u32> = match target {
                    Target::Raw => Vec::new(),
                    Target::Store(Stores::One, _) => vec![replicas[0].pid()],
                    Target::Store(Stores::Two, _) => replicas.iter().map(Store::pid).collect(),
                    Target::Store(Stores::Compared, _) => compared.iter().map(Store::pid).collect(),
                };
                let store_cpu = || stores.iter().map(|&p| cpu_seconds(p, false)).sum::<f64>();
                let before = (
                    store_cpu(),
                    postgres_cpu_seconds(postmaster),
                    cpu_seconds(std::process::id(), false),
                );
                let session = |c: usize| format!("{}-{clients}-{run}-{c}", target.key());
                let result = match target {
                    Target::Raw => {
                        let mut appenders = Vec::new();
                        for c in 0..clients {
                            let client = connect(&raw_url).await?;
                            let insert = client
                                .prepare(
                                    "INSERT INTO events (session, seq, body) VALUES ($1, $2, $3)",
                                )
                                .await?;
                            appenders.push(RawAppender {
                                client,
                                insert,
                                session: session(c),
                                seq: 0,
                                body: body.clone(),
                            });
                        }
                        closed_loop(appenders, window).await?
                    }
                    Target::Store(stores, path) => {
                        let mut appenders = Vec::new();
                        for c in 0..clients {
                            let url = match (stores, &compared) {
                                (Stores::Two, _) => replicas[c % 2].url(),
                                (Stores::Compared, Some(compared)) => compared.url(),
                                _ => replicas[0].url(),
                            };
                            appenders.push(match path {
                                AppendPath::Unary => StoreAppender::Unary(
                                    AgentlogAppender::connect(&url, session(c)).await?,
                                ),
                                AppendPath::Stream => StoreAppender::Stream(
                                    AgentlogStreamAppender::connect(&url, session(c)).await?,
                                ),
                            });
                        }
                        closed_loop(appenders, window).await?
                    }
                };
                let appends = result.rate * (window.warmup + window.measure).as_secs_f64();
                let database = match target {
                    Target::Raw => &raw_url,
                    Target::Store(Stores::Compared, _) => &compared_url,
                    Target::Store(_, _) => &store_url,
                };
                *appends_in.entry(database.clone()).or_default() += appends;
                let per_append = |used: f64| used * 1e6 / appends;
                let used = CpuPerAppend {
                    store: per_append(store_cpu() - before.0),
                    postgres: per_append(postgres_cpu_seconds(postmaster) - before.1),
                    load: per_append(cpu_seconds(std::process::id(), false) - before.2),
                };
                eprintln!(
                    "{clients} clients, run {run}: {}: {:.0}/s p50 {:.2} ms p99 {:.2} ms; \
                     CPU per append: store {:.0} us, PostgreSQL {:.0} us, load {:.0} us",
                    target.label(),
                    result.rate,
                    result.p50_ms,
                    result.p99_ms,
                    used.store,
                    used.postgres,
                    used.load,
                );
                cpu.entry((clients, target)).or_default().push(used);
                results
                    .entry((clients, target))
                    .or_default()
                    .push(result.rate);
            }
        }
    }
    println!(
        "| clients | system | appends/s (median, min–max) | vs raw | \
         CPU µs per append: store / PostgreSQL / load generator (median) |"
    );
    println!("|---:|---|---:|---:|---|");
    for &clients in &args.clients {
        let raw = results
            .get(&(clients, Target::Raw))
            .map_or(f64::NAN, Runs::median);
        for &target in &targets {
            let Some(runs) = results.get(&(clients, target)) else {
                continue;
            };
            let used = cpu.get(&(clients, target)).cloned().unwrap_or_default();
            let median = |pick: fn(&CpuPerAppend) -> f64| {
                let mut values: Vec<f64> = used.iter().map(pick).collect();
                values.sort_by(f64::total_cmp);
                values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
            };
            println!(
                "| {clients} | {} | {:.0} ({:.0}–{:.0}) | {:.2} | {:.0} / {:.0} / {:.0} |",
                target.label(),
                runs.median(),
                runs.min(),
                runs.max(),
                runs.median() / raw,
                median(|c| c.store),
                median(|c| c.postgres),
                median(|c| c.load),
            );
        }
    }
    if args.statements {
        print_statements(&raw, &pg, &appends_in, &raw_url, &store_url, &compared_url).await?;
    }
    if args.list_sessions > 0 {
        let mut stores = vec![("this build".to_string(), replicas[0].url())];
        if let Some(compared) = &compared {
            stores.push(("the compared build".to_string(), compared.url()));
        }
        for (label, url) in &stores {
            let started = Instant::now();
            create_sessions(url, "list", args.list_sessions).await?;
            eprintln!(
                "{label}: created {} sessions in {:.1} s",
                args.list_sessions,
                started.elapsed().as_secs_f64()
            );
        }
        let times = time_list_sessions(&stores).await?;
        println!();
        println!(
            "| ListSessions over {} sessions and more | store | ms per call (median of {LIST_CALLS}, min–max) |",
            args.list_sessions
        );
        println!("|---|---|---:|");
        for ((label, name), runs) in &times {
            println!(
                "| {name} | {label} | {:.2} ({:.2}–{:.2}) |",
                runs.median(),
                runs.min(),
                runs.max()
            );
        }
    }
    Ok(())
}

/// PostgreSQL's time per statement over the append runs, per database, with the time per
/// acknowledged append.
async fn print_statements(
    client: &Client,
    pg: &Postgres,
    appends_in: &BTreeMap<String, f64>,
    raw_url: &str,
    store_url: &str,
    compared_url: &str,
) -> anyhow::Result<()> {
    let rows = client
        .query(
            "SELECT d.datname::text, s.calls, s.rows, s.plans, \
             s.total_exec_time, s.total_plan_time, \
             left(regexp_replace(s.query, '\\s+', ' ', 'g'), 90) \
             FROM pg_stat_statements s JOIN pg_database d ON d.oid = s.dbid \
             ORDER BY s.total_exec_time + s.total_plan_time DESC LIMIT 24",
            &[],
        )
        .await?;
    println!();
    println!(
        "| database | statement | calls | rows/call | plans | exec µs/call | plan µs/call | \
         exec+plan µs per append |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|");
    for row in rows {
        let database: String = row.get(0);
        let calls: i64 = row.get(1);
        let rows: i64 = row.get(2);
        let plans: i64 = row.get(3);
        let exec_ms: f64 = row.get(4);
        let plan_ms: f64 = row.get(5);
        let query: String = row.get(6);
        let (label, appends) = [
            ("raw", raw_url),
            ("this build", store_url),
            ("compared", compared_url),
        ]
        .into_iter()
        .find(|(_, url)| *url == pg.url(&database))
        .map_or((database.as_str(), f64::NAN), |(label, url)| {
            (label, appends_in.get(url).copied().unwrap_or(f64::NAN))
        });
        let per_call = |ms: f64| ms * 1e3 / calls.max(1) as f64;
        println!(
            "| {label} | `{}` | {calls} | {:.1} | {plans} | {:.0} | {:.0} | {:.1} |",
            query.replace('|', "\\|"),
            rows as f64 / calls.max(1) as f64,
            per_call(exec_ms),
            per_call(plan_ms),
            (exec_ms + plan_ms) * 1e3 / appends,
        );
    }
    Ok(())
}
