//! The PostgreSQL backend beside raw PostgreSQL, on one private PostgreSQL 15 server, in
//! the same run: N closed-loop clients, each appending one 300-byte event per call to its
//! own session and waiting for the acknowledgement.
//!
//! - raw: one INSERT per event (autocommit, `synchronous_commit=on`) on the client's own
//!   connection, the floor any layer over PostgreSQL pays;
//! - agentlog over PostgreSQL, one store replica (`event-store --database-url`), over gRPC;
//! - the same with two store replicas on the same database, clients split between them.
//!
//! Runs interleave the three so that they see the same moments of a noisy machine; every
//! figure is the median of the runs. Prints a Markdown table (for bench/RESULTS.md).
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
use integration_tests::pg::Postgres;
use integration_tests::{bin_path, Backing, Store};
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
}

impl Target {
    fn label(self) -> &'static str {
        match self {
            Target::Raw => "raw PostgreSQL, INSERT per event",
            Target::OneReplica => "agentlog over PostgreSQL, 1 store replica",
            Target::TwoReplicas => "agentlog over PostgreSQL, 2 store replicas",
        }
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let pg = tokio::task::block_in_place(Postgres::start)?;
    let raw_url = tokio::task::block_in_place(|| pg.create_database())?;
    let store_url = tokio::task::block_in_place(|| pg.create_database())?;
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
    let start = || {
        Store::start_backed(
            &binary,
            Backing::Database(store_url.clone(), None),
            "127.0.0.1:0",
            &["--database-pool-size", "64", "--notify", &args.notify],
        )
    };
    let replicas = [start()?, start()?];
    let window = Window {
        warmup: Duration::from_secs(1),
        measure: Duration::from_secs(args.secs),
    };
    let body = serde_json::json!({"type": "user_message", "text": event_text()}).to_string();
    let mut results: std::collections::BTreeMap<(usize, Target), Runs> = Default::default();
    for &clients in &args.clients {
        for run in 0..args.runs {
            for target in [Target::Raw, Target::OneReplica, Target::TwoReplicas] {
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
                    Target::OneReplica | Target::TwoReplicas => {
                        let mut appenders = Vec::new();
                        for c in 0..clients {
                            let replica = match target {
                                Target::TwoReplicas => &replicas[c % 2],
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
                eprintln!(
                    "{clients} clients, run {run}: {}: {:.0}/s p50 {:.2} ms p99 {:.2} ms",
                    target.label(),
                    result.rate,
                    result.p50_ms,
                    result.p99_ms
                );
                results
                    .entry((clients, target))
                    .or_default()
                    .push(result.rate);
            }
        }
    }
    println!("| clients | system | appends/s (median, min–max) | vs raw |");
    println!("|---:|---|---:|---:|");
    for &clients in &args.clients {
        let raw = results
            .get(&(clients, Target::Raw))
            .map_or(f64::NAN, Runs::median);
        for target in [Target::Raw, Target::OneReplica, Target::TwoReplicas] {
            let Some(runs) = results.get(&(clients, target)) else {
                continue;
            };
            println!(
                "| {clients} | {} | {:.0} ({:.0}–{:.0}) | {:.2} |",
                target.label(),
                runs.median(),
                runs.min(),
                runs.max(),
                runs.median() / raw
            );
        }
    }
    Ok(())
}
