//! The outage drill (bench/RESULTS.md, "Outage drill"): the model provider fails every call
//! with Anthropic's 529 `overloaded_error`, without `retry-after` (as the service often
//! sends it), for a minute, while 200 sessions start at once, and answers again after.
//! This build and the last release (`deploy/previous-release`) go through it in the same
//! run, one after the other, each deployed alike (its own store on the local backend, 2
//! runners × 50 slots) before a model stand-in of its own. Each session's turn is short: a
//! reply asking for one `bash` call, the call, a final reply. Per build:
//!
//! - how the sessions ended: their final reply, `run_error` or `run_paused`;
//! - the calls the failing provider received while it failed (the stand-in's journal);
//! - the runner slots held meanwhile, sampled every second: the runners'
//!   `agentlog_runner_sessions_held`, and the store's live leases on sessions whose next
//!   call is due later (waiting in a slot), and due later than `--park-after` (a slot the
//!   runner should have let go);
//! - the time from the recovery until every session was done, against one session's own
//!   time (one session alone on the healthy model, same deployment, just before the
//!   outage; the median of a few) and against the same number of sessions started at once
//!   on the healthy model (the burst, just before the outage), and the part of it spent
//!   before the model's first reply (the circuit's next probe).
//!
//! `bash bench/run --outage` builds both and runs it (about 4 minutes); `--help` for the
//! knobs; `--quick` runs it small, to check its path still runs.
#![forbid(unsafe_code)]

#[path = "../../scrape.rs"]
mod scrape;

mod deployment;
mod report;
mod sessions;
mod standin;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::{Parser, ValueEnum};
use serde_json::json;
use testkit::previous::Build;

use deployment::{Deployment, Shape};
use sessions::Outcome;
use standin::{Call, Standin};

/// The model the runners are given; the stand-in fails and heals it by this name.
const MODEL: &str = "claude-drill";

#[derive(Parser)]
#[command(
    about = "A provider that fails for a minute and comes back: this build against the last release"
)]
struct Args {
    /// Sessions started at once while the model fails.
    #[arg(long, default_value_t = 200)]
    sessions: usize,
    /// How long the model fails, in seconds (from just before the sessions start).
    #[arg(long, default_value_t = 60)]
    outage_secs: u64,
    /// Runners per build.
    #[arg(long, default_value_t = 2)]
    runners: usize,
    /// Each runner's `--max-sessions`.
    #[arg(long, default_value_t = 50)]
    max_sessions: usize,
    /// This build's runners' `--park-after`, in seconds (their default).
    #[arg(long, default_value_t = 10)]
    park_after_secs: u64,
    /// Sessions run alone, one after another, before the outage (their median is one
    /// session's own time).
    #[arg(long, default_value_t = 5)]
    alone: usize,
    /// How long after the recovery the drill waits for every session to be idle or to wait
    /// for a person, in seconds.
    #[arg(long, default_value_t = 600)]
    bound_secs: u64,
    /// One more argument for this build's runners (repeatable), e.g.
    /// `--runner-arg=--circuit-failures=1000` to see the drill without the circuit.
    #[arg(long = "runner-arg", allow_hyphen_values = true)]
    runner_args: Vec<String>,
    /// Which builds go through the drill, in this order.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "this,previous"
    )]
    builds: Vec<Which>,
    /// The drill small (20 sessions, a 5 s outage, 2 runners × 5 slots, `--park-after 2s`,
    /// this build's circuit left out by `--circuit-failures` above the sessions, 2 sessions
    /// alone), to check its path still runs; its figures mean nothing.
    #[arg(long)]
    quick: bool,
    /// Where the stores, workspaces and logs go (a fresh directory under it, removed after a
    /// drill that ran through).
    #[arg(long, default_value = "target/bench-data/outage")]
    dir: PathBuf,
    /// The command that ran this, for the report.
    #[arg(long, default_value = "")]
    command: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Which {
    /// This tree's binaries (next to this program).
    This,
    /// The last release's (`eval "$(deploy/previous-release)"` first).
    Previous,
}

/// What one drill is, for both builds alike.
#[derive(Debug, Clone)]
pub struct Plan {
    pub sessions: usize,
    pub outage: Duration,
    pub shape: Shape,
    pub alone: usize,
    pub bound: Duration,
    pub quick: bool,
}

impl Plan {
    fn of(args: &Args) -> Plan {
        let mut plan = Plan {
            sessions: args.sessions,
            outage: Duration::from_secs(args.outage_secs),
            shape: Shape {
                runners: args.runners,
                max_sessions: args.max_sessions,
                model: format!("anthropic:{MODEL}"),
                park_after: Duration::from_secs(args.park_after_secs),
                this_runner_args: args.runner_args.clone(),
            },
            alone: args.alone,
            bound: Duration::from_secs(args.bound_secs),
            quick: args.quick,
        };
        if args.quick {
            plan.sessions = 20;
            plan.outage = Duration::from_secs(5);
            plan.shape.max_sessions = 5;
            plan.shape.park_after = Duration::from_secs(2);
            plan.alone = 2;
            plan.bound = Duration::from_secs(60);
            plan.shape
                .this_runner_args
                .extend(["--circuit-failures".into(), "1000".into()]);
        }
        plan
    }
}

/// What one build's drill measured.
pub struct Drill {
    pub build: Build,
    /// Sessions alone on the healthy model: from the user turn to the final reply.
    pub alone: Vec<Duration>,
    /// As many sessions as the drill's, started at once on the healthy model: from the
    /// first user turn to the last final reply.
    pub burst: Duration,
    pub failed_at_unix_ms: i64,
    pub healed_at_unix_ms: i64,
    /// Whether every session was idle or waiting for a person within the bound.
    pub settled: bool,
    pub settled_at_unix_ms: i64,
    /// The stand-in's journal: every call of the model, alone and in the drill.
    pub calls: Vec<Call>,
    pub samples: Vec<Sample>,
    pub outcomes: Vec<Outcome>,
    /// Sessions let go until their next call was due (this build's runners).
    pub parked: f64,
    /// The drill's own time, from the deployment's start to its stop.
    pub wall: Duration,
}

/// The slots held at one moment.
#[derive(Debug, Clone, Copy)]
pub struct Sample {
    pub at_unix_ms: i64,
    /// The runners' `agentlog_runner_sessions_held`, summed.
    pub held: Option<f64>,
    /// The store's live leases on sessions waiting for their next call (this build).
    pub held_waiting: Option<sessions::Waiting>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let plan = Plan::of(&args);
    let dir = args.dir.join(format!("run-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let script = dir.join("script.jsonl");
    std::fs::write(&script, script_lines())?;
    let mut report = report::Report::begin(&plan, &args.command);
    for which in &args.builds {
        let build = match which {
            Which::This => Build::This,
            Which::Previous => Build::Previous,
        };
        let build_dir = dir.join(format!("{which:?}").to_lowercase());
        std::fs::create_dir_all(&build_dir)?;
        eprintln!(
            "[outage] {build}: {} sessions, the model failing for {:?}",
            plan.sessions, plan.outage
        );
        let drill = drill(build, &plan, &script, &build_dir)
            .await
            .with_context(|| format!("{build}'s drill (its logs: {})", build_dir.display()))?;
        report.add(drill);
    }
    report.finish();
    print!("{}", report.render()?);
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// The stand-in's script, one reply a line by the assistant turns before it: a reply that
/// asks for one cheap tool call, then the final reply.
fn script_lines() -> String {
    let calls = json!({"text": "Checking the workspace.", "tool_uses": [{"name": "bash", "input": {"command": "echo ok"}}]});
    let done = json!({"text": "Done: the workspace is fine."});
    format!("{calls}\n{done}\n")
}

/// One build through the drill, on a deployment and a stand-in of its own.
async fn drill(build: Build, plan: &Plan, script: &Path, dir: &Path) -> anyhow::Result<Drill> {
    let started = Instant::now();
    let standin = Standin::start(script, &dir.join("standin.log")).await?;
    let deployment = Deployment::start(build, &plan.shape, &standin.base_url(), dir).await?;
    let client = deployment.store.client().await?;

    let mut alone = Vec::new();
    for i in 0..plan.alone {
        let time =
            sessions::run_alone(&client, &format!("alone-{i}"), Duration::from_secs(60)).await?;
        alone.push(time);
    }

    let burst: Vec<String> = (0..plan.sessions)
        .map(|i| format!("burst-{i:04}"))
        .collect();
    sessions::start_all(&client, &burst).await?;
    if !sessions::settle(&client, &burst, Instant::now() + plan.bound).await? {
        anyhow::bail!(
            "the burst on the healthy model did not settle within {:?}",
            plan.bound
        );
    }
    let burst = sessions::span(&client, &burst).await?;
    eprintln!(
        "[outage] {build}: {} sessions at once on the healthy model: {burst:?}",
        plan.sessions
    );

    let ids: Vec<String> = (0..plan.sessions)
        .map(|i| format!("drill-{i:04}"))
        .collect();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let sampling = sample_every_second(build, plan, &deployment, &client, stopped);
    let scenario = async {
        // The model fails before the first session asks it anything.
        standin.fail(MODEL, json!({"overloaded": {}})).await?;
        let failed = Instant::now();
        let failed_at_unix_ms = now_ms();
        sessions::start_all(&client, &ids).await?;
        eprintln!("[outage] {build}: {} sessions started", ids.len());
        tokio::time::sleep_until((failed + plan.outage).into()).await;
        standin.heal(MODEL).await?;
        let healed_at_unix_ms = now_ms();
        eprintln!("[outage] {build}: the model answers again");
        let settled = sessions::settle(&client, &ids, Instant::now() + plan.bound).await?;
        let settled_at_unix_ms = now_ms();
        let _ = stop.send(());
        anyhow::Ok((
            failed_at_unix_ms,
            healed_at_unix_ms,
            settled,
            settled_at_unix_ms,
        ))
    };
    let (samples, scenario) = tokio::join!(sampling, scenario);
    let (failed_at_unix_ms, healed_at_unix_ms, settled, settled_at_unix_ms) = scenario?;
    if !settled {
        eprintln!(
            "[outage] {build}: some sessions were still at work {:?} after the recovery",
            plan.bound
        );
    }
    let outcomes = sessions::outcomes(&client, &ids).await?;
    let calls = standin.calls(MODEL).await?;
    let parked = deployment.sessions_parked().await.unwrap_or(0.0);
    drop(deployment);
    drop(standin);
    Ok(Drill {
        build,
        alone,
        burst,
        failed_at_unix_ms,
        healed_at_unix_ms,
        settled,
        settled_at_unix_ms,
        calls,
        samples,
        outcomes,
        parked,
        wall: started.elapsed(),
    })
}

/// Samples the slots held every second until `stopped`.
async fn sample_every_second(
    build: Build,
    plan: &Plan,
    deployment: &Deployment,
    client: &sessions::Client,
    mut stopped: tokio::sync::oneshot::Receiver<()>,
) -> Vec<Sample> {
    let mut samples = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = &mut stopped => return samples,
            _ = tick.tick() => {}
        }
        let at_unix_ms = now_ms();
        let held = deployment.sessions_held().await.ok();
        let held_waiting = match build {
            Build::This => sessions::held_waiting(client, at_unix_ms, plan.shape.park_after)
                .await
                .ok(),
            Build::Previous => None,
        };
        samples.push(Sample {
            at_unix_ms,
            held,
            held_waiting,
        });
    }
}

/// This machine's clock, as the store's and the stand-in's times are (unix ms).
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}
