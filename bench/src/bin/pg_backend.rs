//! The PostgreSQL backend beside raw PostgreSQL, on one private PostgreSQL 15 server, in
//! the same run: N closed-loop clients, each appending one 300-byte event per call to its
//! own session and waiting for the acknowledgement.
//!
//! - raw: one INSERT per event (autocommit, `synchronous_commit=on`) on the client's own
//!   connection, the floor any layer over PostgreSQL pays;
//! - agentlog over PostgreSQL, one store replica (`event-store --database-url`), over gRPC;
//! - the same with two store replicas on the same database, clients split between them;
//! - with `--compare-store-binary`, another build of the store (one replica, its own
//!   database on the same server), e.g. the previous commit, for a before/after in one run.
//!
//! Runs interleave the targets so that they see the same moments of a noisy machine; every
//! figure is the median of the runs. Beside throughput it reports the CPU time spent per
//! acknowledged append by the store process(es), by PostgreSQL (every server process) and
//! by this load generator (over warm-up and measurement, divided by the appends of both,
//! estimated from the measured rate). Prints a Markdown table (for bench/RESULTS.md).
//! Build the store in release first: `cargo build --release -p event-store`, then
//! `cargo run -p bench --bin agentlog-bench-pg -- --store-binary target/release/event-store`.

#[path = "../load.rs"]
mod load;
#[path = "../stats.rs"]
#[allow(dead_code)]
mod stats;

use std::time::Duration;

use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::{event, AppendRequest, Event, UserMessage};
use clap::Parser;
use testkit::pg::Postgres;
use testkit::{bin_path, Backing, Store};
use tokio_postgres::{Client, NoTls, Statement};
use tonic::transport::Channel;

use load::{closed_loop, Appender, Window};
use stats::Runs;

/// Bytes of text in each appended event (as in the main suite).
const EVENT_BYTES: usize = 300;

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
    /// The store's `--notify` mode (`listen` or `poll`).
    #[arg(long, default_value = "listen")]
    notify: String,
    /// The event-store binary (default: the one next to this program).
    #[arg(long)]
    store_binary: Option<std::path::PathBuf>,
    /// Another event-store binary measured beside it (one replica).
    #[arg(long)]
    compare_store_binary: Option<std::path::PathBuf>,
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

struct StoreAppender {
    client: EventStoreClient<Channel>,
    request: AppendRequest,
}

impl Appender for StoreAppender {
    async fn append(&mut self) -> anyhow::Result<()> {
        self.client.append(self.request.clone()).await?;
        Ok(())
    }
}

async fn connect(url: &str) -> anyhow::Result<Client> {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
enum Target {
    Raw,
    OneReplica,
    TwoReplicas,
    Compared,
}

impl Target {
    fn label(self) -> &'static str {
        match self {
            Target::Raw => "raw PostgreSQL, INSERT per event",
            Target::OneReplica => "agentlog over PostgreSQL, 1 store replica",
            Target::TwoReplicas => "agentlog over PostgreSQL, 2 store replicas",
            Target::Compared => "the compared build (--compare-store-binary), 1 store replica",
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let pg = tokio::task::block_in_place(Postgres::start)?;
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
    let mut targets = vec![Target::Raw, Target::OneReplica, Target::TwoReplicas];
    if compared.is_some() {
        targets.push(Target::Compared);
    }
    let window = Window {
        warmup: Duration::from_secs(1),
        measure: Duration::from_secs(args.secs),
    };
    let body = serde_json::json!({"type": "user_message", "text": event_text()}).to_string();
    let mut results: std::collections::BTreeMap<(usize, Target), Runs> = Default::default();
    let mut cpu: std::collections::BTreeMap<(usize, Target), Vec<CpuPerAppend>> =
        Default::default();
    for &clients in &args.clients {
        for run in 0..args.runs {
            for &target in &targets {
                let stores: Vec<u32> = match target {
                    Target::Raw => Vec::new(),
                    Target::OneReplica => vec![replicas[0].pid()],
                    Target::TwoReplicas => replicas.iter().map(Store::pid).collect(),
                    Target::Compared => compared.iter().map(Store::pid).collect(),
                };
                let store_cpu = || stores.iter().map(|&p| cpu_seconds(p, false)).sum::<f64>();
                let before = (
                    store_cpu(),
                    postgres_cpu_seconds(postmaster),
                    cpu_seconds(std::process::id(), false),
                );
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
                                session: format!("raw-{clients}-{run}-{c}"),
                                seq: 0,
                                body: body.clone(),
                            });
                        }
                        closed_loop(appenders, window).await?
                    }
                    Target::OneReplica | Target::TwoReplicas | Target::Compared => {
                        let mut appenders = Vec::new();
                        for c in 0..clients {
                            let replica = match (target, &compared) {
                                (Target::TwoReplicas, _) => &replicas[c % 2],
                                (Target::Compared, Some(compared)) => compared,
                                _ => &replicas[0],
                            };
                            appenders.push(StoreAppender {
                                client: EventStoreClient::connect(replica.url()).await?,
                                request: AppendRequest {
                                    session_id: format!("s{}-{clients}-{run}-{c}", target as u8),
                                    events: vec![Event {
                                        kind: Some(event::Kind::UserMessage(UserMessage {
                                            text: event_text(),
                                        })),
                                        ..Event::default()
                                    }],
                                    ..AppendRequest::default()
                                },
                            });
                        }
                        closed_loop(appenders, window).await?
                    }
                };
                let appends = result.rate * (window.warmup + window.measure).as_secs_f64();
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
    Ok(())
}
