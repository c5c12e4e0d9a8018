//! What a replay costs (bench/RESULTS.md, "Replay"): a session of `calls` tool calls is
//! recorded on one scripted model (a model stand-in that answers at once), then replayed on
//! a second scripted model that asks for the same calls, so that every call of the replay
//! is served from the recording. In the same run, against the same store and runner:
//!
//! - the replay's time to idle against the recording's (every call run for real: bash in
//!   the sandbox, its checkpoint, `tool_started` and `tool_result` durable);
//! - the runner's CPU per call (its process's user + system time over the phase, from
//!   `/proc/<pid>/stat`), served against real;
//! - the store's requests per call (`agentlog_store_read_requests`,
//!   `agentlog_store_append_requests` from its `/metrics`), served against real.
//!
//! Build first (`cargo build --release -p event-store -p runner -p agentlog-cli -p bench`),
//! then `target/release/agentlog-bench-replay` (`--help` for the knobs); `--quick` runs a
//! small session once, to check the path still runs.

#[path = "../scrape.rs"]
mod scrape;

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::{
    event::Kind, AppendRequest, Event, GetSessionRequest, SessionStatus, UserMessage,
};
use anyhow::{bail, Context};
use clap::Parser;
use testkit::{bin_path, Store};
use tonic::transport::Channel;

use scrape::{free_port, metric};

#[derive(Parser)]
struct Args {
    /// Tool calls in the recorded session.
    #[arg(long, default_value_t = 200)]
    calls: usize,
    /// Recordings and replays measured (the medians are reported).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// One small run, to check that the path still runs.
    #[arg(long)]
    quick: bool,
    /// Where the data and workspaces go (a fresh directory under it).
    #[arg(long, default_value = "target/bench-data/replay")]
    dir: String,
}

/// What one phase (a recording or a replay) cost.
#[derive(Debug, Clone, Copy, Default)]
struct Phase {
    wall_ms: f64,
    cpu_ms: f64,
    reads: f64,
    appends: f64,
}

fn script(path: &Path, calls: usize, text: &str) -> anyhow::Result<String> {
    let mut lines = String::new();
    for i in 0..calls {
        let reply = serde_json::json!({"tool_uses": [{"name": "bash", "input": {"command": format!("echo {i} >> log.txt")}}]});
        lines.push_str(&reply.to_string());
        lines.push('\n');
    }
    lines.push_str(&serde_json::json!({ "text": text }).to_string());
    lines.push('\n');
    std::fs::write(path, lines)?;
    Ok(format!("scripted:{}", path.display()))
}

/// Waits until `session` is idle and let go; counts its own `GetSession` calls in `polls`
/// (they are the bench's reads, not the runner's).
async fn idle_after(
    client: &mut EventStoreClient<Channel>,
    session: &str,
    limit: Duration,
    polls: &AtomicU64,
) -> anyhow::Result<()> {
    let deadline = Instant::now() + limit;
    loop {
        polls.fetch_add(1, Ordering::SeqCst);
        let info = client
            .get_session(GetSessionRequest {
                session_id: session.to_string(),
            })
            .await
            .map(|r| r.into_inner());
        if let Ok(info) = info {
            if info.status() == SessionStatus::Idle && info.lease.is_none() {
                return Ok(());
            }
        }
        if Instant::now() > deadline {
            bail!("{session} is not idle within {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

struct Meters<'a> {
    runner: u32,
    metrics: &'a str,
    /// The bench's own reads so far.
    polls: &'a AtomicU64,
}

impl Meters<'_> {
    async fn read(&self) -> anyhow::Result<Phase> {
        Ok(Phase {
            wall_ms: 0.0,
            cpu_ms: testkit::cpu_ms(self.runner)?,
            reads: metric(self.metrics, "agentlog_store_read_requests_total").await?
                - self.polls.load(Ordering::SeqCst) as f64,
            appends: metric(self.metrics, "agentlog_store_append_requests_total").await?,
        })
    }

    /// Runs `phase` and returns what it cost.
    async fn measure(
        &self,
        phase: impl std::future::Future<Output = anyhow::Result<()>>,
    ) -> anyhow::Result<Phase> {
        let before = self.read().await?;
        let started = Instant::now();
        phase.await?;
        let wall_ms = started.elapsed().as_secs_f64() * 1000.0;
        let after = self.read().await?;
        Ok(Phase {
            wall_ms,
            cpu_ms: after.cpu_ms - before.cpu_ms,
            reads: after.reads - before.reads,
            appends: after.appends - before.appends,
        })
    }
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(|a, b| a.total_cmp(b));
    values[values.len() / 2]
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let (calls, runs) = if args.quick {
        (5, 1)
    } else {
        (args.calls, args.runs)
    };
    let dir = Path::new(&args.dir).join(format!("run-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let recorded = script(&dir.join("recorded.jsonl"), calls, "recorded")?;
    let replayed = script(&dir.join("replayed.jsonl"), calls, "replayed")?;
    let metrics = format!("127.0.0.1:{}", free_port()?);
    let store = Store::start_with(&["--metrics-listen", &metrics])?;
    let client = store.client().await?;
    let mut runner: Child = Command::new(bin_path("runner"))
        .args(["--event-store", &store.url(), "--runner-id", "bench-replay"])
        .arg("--workspace-root")
        .arg(dir.join("workspaces"))
        .args(["--model", &recorded, "--model", &replayed])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .context("start the runner")?;
    let polls = AtomicU64::new(0);
    let meters = Meters {
        runner: runner.id(),
        metrics: &metrics,
        polls: &polls,
    };
    let limit = Duration::from_secs(600);
    let mut recordings = Vec::new();
    let mut replays = Vec::new();
    for run in 0..runs {
        let session = format!("recorded-{run}");
        let record = async {
            client
                .clone()
                .append(AppendRequest {
                    session_id: session.clone(),
                    events: vec![Event {
                        kind: Some(Kind::UserMessage(UserMessage {
                            text: "append a line per call".into(),
                        })),
                        ..Event::default()
                    }],
                    ..AppendRequest::default()
                })
                .await?;
            idle_after(&mut client.clone(), &session, limit, &polls).await
        };
        recordings.push(meters.measure(record).await?);
        let replay = async {
            let out = Command::new(bin_path("agentlog"))
                .args([
                    "--addr",
                    &store.url(),
                    "replay",
                    &session,
                    "--model",
                    &replayed,
                ])
                .stdin(Stdio::null())
                .output()?;
            if !out.status.success() {
                bail!("agentlog replay: {}", String::from_utf8_lossy(&out.stderr));
            }
            let id = String::from_utf8(out.stdout)?.trim().to_string();
            // Its own reads of the recording, and its fork.
            idle_after(&mut client.clone(), &id, limit, &polls).await
        };
        replays.push(meters.measure(replay).await?);
    }
    let _ = runner.kill();
    let _ = runner.wait();
    let _ = std::fs::remove_dir_all(&dir);
    let per_call = |phases: &[Phase], pick: fn(&Phase) -> f64| {
        median(phases.iter().map(|p| pick(p) / calls as f64).collect())
    };
    let wall = |phases: &[Phase]| median(phases.iter().map(|p| p.wall_ms).collect());
    let (rec_wall, rep_wall) = (wall(&recordings), wall(&replays));
    let (rec_cpu, rep_cpu) = (
        per_call(&recordings, |p| p.cpu_ms),
        per_call(&replays, |p| p.cpu_ms),
    );
    println!("replay of a {calls}-call session (bash), scripted models that answer at once, median of {runs}:");
    println!(
        "  time to idle: recording {rec_wall:.0} ms, replay {rep_wall:.0} ms ({:.2}x)",
        rep_wall / rec_wall
    );
    println!(
        "  runner CPU per call: real {rec_cpu:.2} ms, served {rep_cpu:.2} ms ({:.2}x)",
        rep_cpu / rec_cpu
    );
    println!(
        "  store reads per call: real {:.3}, served {:.3}; appends per call: real {:.2}, served {:.2}",
        per_call(&recordings, |p| p.reads),
        per_call(&replays, |p| p.reads),
        per_call(&recordings, |p| p.appends),
        per_call(&replays, |p| p.appends),
    );
    Ok(())
}
