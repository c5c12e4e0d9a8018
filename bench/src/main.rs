//! `agentlog-bench`: what a durable append, a catch-up, a live follower and a resume cost
//! through the real `event-store` binary, next to what the disk allows and to the stores
//! users would otherwise pick, all measured in one run on one disk (`bench/RESULTS.md`).
//!
//! `bash bench/run` builds the release binaries, installs and starts the baselines and
//! writes `bench/RESULTS.md` (keeping its hand-run sections); `--quick` only checks that
//! every path still runs (CI). Every figure is the median of several runs with min and
//! max; nothing here asserts a speed.
#![forbid(unsafe_code)]

mod ab;
mod agentlog;
mod appenders;
mod baselines;
mod disk;
mod fanout;
mod followers;
mod fork;
mod load;
mod profile;
mod report;
mod resume;
mod stats;

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use testkit::{Backing, Store};

use crate::appenders::{AgentlogAppender, AgentlogStreamAppender};
use crate::baselines::{etcd::Etcd, postgres::Postgres, redis::Redis};
use crate::load::{closed_loop, Appender, LoadRun, Window};
use crate::report::Report;
use crate::stats::Runs;

#[derive(Parser)]
#[command(
    about = "agentlog's benchmark suite: durable appends, subscriptions, resume and \
                   footprint against the raw disk and PostgreSQL, Redis and etcd"
)]
struct Args {
    /// Tiny runs that only check every path still works: no baselines but the naive one,
    /// no fsync-skipped store, under a minute.
    #[arg(long)]
    quick: bool,
    /// Runs per figure (the median is reported).
    #[arg(long, default_value_t = 5)]
    runs: usize,
    /// Measured seconds per load point and run (after a warm-up of a fifth of it).
    #[arg(long, default_value_t = 1.5)]
    secs: f64,
    /// Concurrent clients for the append figures.
    #[arg(long, value_delimiter = ',', default_value = "1,16,64,256")]
    clients: Vec<usize>,
    /// Where every store keeps its data (on the disk you want to measure).
    #[arg(long, default_value = "target/bench-data")]
    dir: PathBuf,
    /// Write the markdown report here (else it is printed).
    #[arg(long)]
    out: Option<PathBuf>,
    /// An `event-store` built with `--features unsafe-skip-fsync`, for the ceiling of the
    /// gRPC path (never the default build).
    #[arg(long)]
    nofsync_store: Option<PathBuf>,
    /// Skip PostgreSQL, Redis and etcd (the naive JSONL baseline always runs).
    #[arg(long)]
    no_baselines: bool,
    /// Skip the `perf` profile.
    #[arg(long)]
    no_profile: bool,
    /// Idle Subscribe(follow) streams, one per session, for the followers-at-scale figure.
    #[arg(long, default_value_t = 10_000)]
    idle_followers: usize,
    /// Sessions (of 100 events) for the memory and disk figure.
    #[arg(long, default_value_t = 10_000)]
    footprint_sessions: usize,
    /// Events in the session read by the catch-up figure.
    #[arg(long, default_value_t = 100_000)]
    catch_up_events: usize,
    /// Run only the resume figure (section 5), e.g. after a change to the runner.
    #[arg(long)]
    only_resume: bool,
    /// Run only the catch-up figure (section 4), agentlog against PostgreSQL (unless
    /// `--no-baselines`), e.g. after a change to the read path.
    #[arg(long)]
    only_catch_up: bool,
    /// Run only the fork figures (section 7): checkpoint, restore and ForkSession.
    #[arg(long)]
    only_fork: bool,
    /// Run only the followers-at-scale figure (section 4's idle followers), e.g. after a
    /// change to the live fan-out.
    #[arg(long)]
    only_followers: bool,
    /// Files in the workspace of the checkpoint figures.
    #[arg(long, default_value_t = 10_000)]
    fork_files: usize,
    /// Bytes of those files in all.
    #[arg(long, default_value_t = 200 << 20)]
    fork_bytes: u64,
    /// Events in the session ForkSession copies.
    #[arg(long, default_value_t = 100_000)]
    fork_events: usize,
    /// Session sizes (events) of the resume figure.
    #[arg(long, value_delimiter = ',', default_value = "10,1000,10000,100000")]
    resume_sizes: Vec<usize>,
    /// Only the limits, appends, the profile and catch-up: skip the fan-out, resume and
    /// footprint figures (to compare a change of the write path quickly).
    #[arg(long)]
    skip_slow: bool,
    /// Only the same-run A/B of the write path: this build's store against the
    /// `event-store` binary given here (`bash bench/run --against REV` builds REV's), in
    /// turns, `--rounds` times; with a `perf` profile of each unless `--no-profile`.
    #[arg(long, conflicts_with = "against_durable_floor")]
    against_store: Option<PathBuf>,
    /// Only the same A/B with the durable floor (`agentlog-bench-floor --durable`) as its
    /// base: what the store's own work costs over a bare group commit on this transport and
    /// disk, with a profile of each (`bash bench/run --against-floor`).
    #[arg(long)]
    against_durable_floor: bool,
    /// What `--against-store` was built from, for the report.
    #[arg(long, default_value = "the other build")]
    against_label: String,
    /// Rounds of the A/B (each measures every point on both builds).
    #[arg(long, default_value_t = 9)]
    rounds: usize,
    /// The command that ran this, for the report.
    #[arg(long, default_value = "")]
    command: String,
}

/// Every text payload is this long.
pub const EVENT_BYTES: usize = 300;

/// A 300-byte text, like a short user turn.
pub fn event_text() -> String {
    let phrase = "Please look at the failing test in the parser module and fix it. ";
    phrase.repeat(EVENT_BYTES / phrase.len() + 1)[..EVENT_BYTES].to_string()
}

/// The same event as the JSON line a baseline stores.
pub fn event_json() -> String {
    serde_json::json!({"type": "user_message", "text": event_text()}).to_string()
}

/// Sizes of everything, full or quick.
struct Plan {
    runs: usize,
    window: Window,
    raw_secs: Duration,
    clients: Vec<usize>,
    catch_up_events: usize,
    followers: Vec<usize>,
    fan_out_events: usize,
    fan_out_interval: Duration,
    /// Idle followers, and events timed alone and among them.
    idle_followers: (usize, usize),
    resume_sizes: Vec<usize>,
    footprint: (usize, usize),
    fork: fork::ForkPlan,
}

impl Plan {
    fn from(args: &Args) -> Plan {
        if args.quick {
            return Plan {
                runs: 1,
                window: Window {
                    warmup: Duration::from_millis(50),
                    measure: Duration::from_millis(250),
                },
                raw_secs: Duration::from_millis(200),
                clients: vec![1, 4],
                catch_up_events: 2_000,
                followers: vec![1, 10],
                fan_out_events: 5,
                fan_out_interval: Duration::from_millis(10),
                idle_followers: (100, 5),
                resume_sizes: vec![10, 1_000],
                footprint: (100, 10),
                fork: fork::ForkPlan {
                    files: 300,
                    bytes: 3 << 20,
                    changed: 10,
                    events: 2_000,
                    runs: 1,
                },
            };
        }
        Plan {
            runs: args.runs.max(1),
            window: Window {
                warmup: Duration::from_secs_f64(args.secs / 5.0),
                measure: Duration::from_secs_f64(args.secs),
            },
            raw_secs: Duration::from_millis(750),
            clients: args.clients.clone(),
            catch_up_events: args.catch_up_events,
            followers: vec![1, 100, 1_000],
            fan_out_events: 50,
            fan_out_interval: Duration::from_millis(20),
            idle_followers: (args.idle_followers, 100),
            resume_sizes: args.resume_sizes.clone(),
            footprint: (args.footprint_sessions, 100),
            fork: fork::ForkPlan {
                files: args.fork_files,
                bytes: args.fork_bytes,
                changed: 10,
                events: args.fork_events,
                runs: args.runs.max(1),
            },
        }
    }
}

/// The systems an append load point can run against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Target {
    /// agentlog, one session per client.
    Agentlog,
    /// agentlog, every client on one session.
    AgentlogOneSession,
    /// agentlog through `AppendStream`, one session per client.
    AgentlogStream,
    /// agentlog with fsync skipped, one session per client.
    Ceiling,
    /// agentlog with fsync skipped, every client on one session.
    CeilingOneSession,
    /// agentlog with fsync skipped, through `AppendStream`, one session per client.
    CeilingStream,
    /// The gRPC floor (`agentlog-bench-floor`): unary `Append` answered from memory.
    Floor,
    /// The gRPC floor through `AppendStream`.
    FloorStream,
    /// The durable floor (`agentlog-bench-floor --durable`) through `AppendStream`: each
    /// append written and fdatasync'd in groups by one thread before its answer, nothing else.
    DurableFloorStream,
    Naive,
    Postgres,
    Redis,
    Etcd,
}

impl Target {
    /// Every system, in the order the tables list them.
    pub const ALL: [Target; 13] = [
        Target::Agentlog,
        Target::AgentlogOneSession,
        Target::AgentlogStream,
        Target::Ceiling,
        Target::CeilingOneSession,
        Target::CeilingStream,
        Target::Floor,
        Target::FloorStream,
        Target::DurableFloorStream,
        Target::Naive,
        Target::Postgres,
        Target::Redis,
        Target::Etcd,
    ];

    pub fn label(self) -> &'static str {
        match self {
            Target::Agentlog => "agentlog, one session per client",
            Target::AgentlogOneSession => "agentlog, all clients on one session",
            Target::AgentlogStream => "agentlog AppendStream, one session per client",
            Target::Ceiling => "agentlog, fsync skipped (ceiling), one session per client",
            Target::CeilingOneSession => "agentlog, fsync skipped (ceiling), one session",
            Target::CeilingStream => {
                "agentlog AppendStream, fsync skipped (ceiling), one session per client"
            }
            Target::Floor => "the gRPC floor: Append answered from memory, nothing stored",
            Target::FloorStream => {
                "the gRPC floor: AppendStream answered from memory, nothing stored"
            }
            Target::DurableFloorStream => {
                "the durable floor: AppendStream written and fdatasync'd in groups, nothing else"
            }
            Target::Naive => "naive JSONL + fsync per event (one process)",
            Target::Postgres => "PostgreSQL 15, INSERT per event, synchronous_commit=on",
            Target::Redis => "Redis Streams XADD, appendfsync always",
            Target::Etcd => "etcd Put, single node",
        }
    }
}

/// Every running system of one suite run.
struct Systems {
    store: Store,
    ceiling: Option<Store>,
    /// `agentlog-bench-floor`: the store's transport, answering appends from memory.
    floor: Option<Store>,
    /// `agentlog-bench-floor --durable`: the transport and a group-committed fdatasync.
    durable_floor: Option<Store>,
    postgres: Option<Postgres>,
    redis: Option<Redis>,
    etcd: Option<Etcd>,
    naive_dir: PathBuf,
}

enum AnyAppender {
    Agentlog(AgentlogAppender),
    AgentlogStream(AgentlogStreamAppender),
    Naive(disk::NaiveJsonl),
    Postgres(baselines::postgres::PgAppender),
    Redis(baselines::redis::RedisAppender),
    Etcd(baselines::etcd::EtcdAppender),
}

impl Appender for AnyAppender {
    async fn append(&mut self) -> anyhow::Result<()> {
        match self {
            AnyAppender::Agentlog(a) => a.append().await,
            AnyAppender::AgentlogStream(a) => a.append().await,
            AnyAppender::Naive(a) => a.append().await,
            AnyAppender::Postgres(a) => a.append().await,
            AnyAppender::Redis(a) => a.append().await,
            AnyAppender::Etcd(a) => a.append().await,
        }
    }
}

impl Systems {
    /// The server process of `target`, if it runs as one.
    fn pid(&self, target: Target) -> Option<u32> {
        match target {
            Target::Agentlog | Target::AgentlogOneSession | Target::AgentlogStream => {
                Some(self.store.pid())
            }
            Target::Ceiling | Target::CeilingOneSession | Target::CeilingStream => {
                self.ceiling.as_ref().map(Store::pid)
            }
            Target::Floor | Target::FloorStream => self.floor.as_ref().map(Store::pid),
            Target::DurableFloorStream => self.durable_floor.as_ref().map(Store::pid),
            Target::Naive => None,
            Target::Postgres => self.postgres.as_ref().map(Postgres::pid),
            Target::Redis => self.redis.as_ref().map(Redis::pid),
            Target::Etcd => self.etcd.as_ref().map(Etcd::pid),
        }
    }

    /// The clients of one load point, or None where the target is not running (or, for
    /// the naive baseline, is one process by definition).
    async fn appenders(
        &self,
        target: Target,
        clients: usize,
        run: usize,
    ) -> anyhow::Result<Option<Vec<AnyAppender>>> {
        let mut out = Vec::with_capacity(clients);
        for c in 0..clients {
            let session = format!("load-{clients}-{run}-{c}");
            let shared = format!("load-{clients}-{run}-shared");
            let appender = match target {
                Target::Agentlog => AnyAppender::Agentlog(
                    AgentlogAppender::connect(&self.store.url(), session).await?,
                ),
                Target::AgentlogOneSession => AnyAppender::Agentlog(
                    AgentlogAppender::connect(&self.store.url(), shared).await?,
                ),
                Target::AgentlogStream => AnyAppender::AgentlogStream(
                    AgentlogStreamAppender::connect(&self.store.url(), format!("{session}-s"))
                        .await?,
                ),
                Target::Ceiling | Target::CeilingOneSession => {
                    let Some(ceiling) = &self.ceiling else {
                        return Ok(None);
                    };
                    let session = if target == Target::Ceiling {
                        session
                    } else {
                        shared
                    };
                    AnyAppender::Agentlog(AgentlogAppender::connect(&ceiling.url(), session).await?)
                }
                Target::CeilingStream => {
                    let Some(ceiling) = &self.ceiling else {
                        return Ok(None);
                    };
                    AnyAppender::AgentlogStream(
                        AgentlogStreamAppender::connect(&ceiling.url(), format!("{session}-s"))
                            .await?,
                    )
                }
                Target::Floor | Target::FloorStream => {
                    let Some(floor) = &self.floor else {
                        return Ok(None);
                    };
                    if target == Target::Floor {
                        AnyAppender::Agentlog(
                            AgentlogAppender::connect(&floor.url(), session).await?,
                        )
                    } else {
                        AnyAppender::AgentlogStream(
                            AgentlogStreamAppender::connect(&floor.url(), session).await?,
                        )
                    }
                }
                Target::DurableFloorStream => {
                    let Some(floor) = &self.durable_floor else {
                        return Ok(None);
                    };
                    AnyAppender::AgentlogStream(
                        AgentlogStreamAppender::connect(&floor.url(), session).await?,
                    )
                }
                Target::Naive => {
                    if clients != 1 {
                        return Ok(None);
                    }
                    AnyAppender::Naive(disk::NaiveJsonl::create(&self.naive_dir, &session)?)
                }
                Target::Postgres => match &self.postgres {
                    Some(pg) => AnyAppender::Postgres(pg.appender(session).await?),
                    None => return Ok(None),
                },
                Target::Redis => match &self.redis {
                    Some(redis) => AnyAppender::Redis(redis.appender(session).await?),
                    None => return Ok(None),
                },
                Target::Etcd => match &self.etcd {
                    Some(etcd) => AnyAppender::Etcd(etcd.appender(session).await?),
                    None => return Ok(None),
                },
            };
            out.push(appender);
        }
        Ok(Some(out))
    }
}

/// Results of the append matrix: (target, clients) → one `LoadRun` per run.
pub type LoadResults = HashMap<(Target, usize), Vec<LoadRun>>;

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // A real deployment's followers come from many callers; the bench's 1,000 all come
    // from this one process, over its default per-caller limit of 1,000 streams. Set
    // before any thread or child process exists.
    std::env::set_var("AGENTLOG_MAX_SUBSCRIPTIONS_PER_CALLER", "100000");
    let plan = Plan::from(&args);
    std::fs::create_dir_all(&args.dir)?;
    let dir = std::fs::canonicalize(&args.dir)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut report = Report::new(&args, &dir);
    let outcome = rt.block_on(run_suite(&args, &plan, &dir, &mut report));
    if let Err(e) = &outcome {
        report.note(format!("The run stopped early: {e:#}"));
    }
    report.finish();
    let text = report.render();
    match &args.out {
        Some(path) => {
            let kept = std::fs::read_to_string(path)
                .map(|previous| report::hand_run_sections(&previous))
                .unwrap_or_default();
            let text = if kept.is_empty() {
                text
            } else {
                format!("{}\n\n{kept}", text.trim_end())
            };
            std::fs::write(path, &text).with_context(|| format!("write {}", path.display()))?;
            eprintln!("wrote {}", path.display());
        }
        None => println!("{text}"),
    }
    outcome
}

fn progress(what: &str) {
    eprintln!("[bench] {what}");
}

async fn run_suite(
    args: &Args,
    plan: &Plan,
    dir: &Path,
    report: &mut Report,
) -> anyhow::Result<()> {
    if let Some(base) = &args.against_store {
        let base = Store::start_binary(base, &fresh_dir(dir, "ab-base")?)
            .with_context(|| format!("start {}", base.display()))?;
        return ab_section(args, plan, &base, &args.against_label, dir, report).await;
    }
    if args.against_durable_floor {
        let base = Store::start_backed(
            &testkit::bin_path("agentlog-bench-floor"),
            Backing::Dir(fresh_dir(dir, "ab-durable-floor")?),
            "127.0.0.1:0",
            &["--durable"],
        )
        .context("start the durable floor")?;
        let label = "the durable floor (`agentlog-bench-floor --durable`)";
        return ab_section(args, plan, &base, label, dir, report).await;
    }
    if args.only_resume {
        return resume_section(plan, dir, report).await;
    }
    if args.only_catch_up {
        return only_catch_up(args, plan, dir, report).await;
    }
    if args.only_fork {
        return fork_section(plan, dir, report).await;
    }
    if args.only_followers {
        return followers_section(plan, dir, report).await;
    }
    // 1. The limits of the disk, first.
    progress("raw write + fdatasync");
    let back_to_back = |layout, batch| disk::RawCase {
        layout,
        batch,
        idle: Duration::ZERO,
    };
    let mut cases = Vec::new();
    for layout in [disk::RawFile::Preallocated, disk::RawFile::Appending] {
        cases.extend([1, 8, 64, 256].map(|batch| back_to_back(layout, batch)));
    }
    cases.push(disk::RawCase {
        idle: disk::ROUND_TRIP_IDLE,
        ..back_to_back(disk::RawFile::Preallocated, 1)
    });
    let mut raw: Vec<(disk::RawCase, Runs, Runs)> = Vec::new();
    for case in cases {
        let mut rates = Runs::default();
        let mut sync_ms = Runs::default();
        for _ in 0..plan.runs {
            let run =
                tokio::task::block_in_place(|| disk::raw_fdatasync(dir, case, plan.raw_secs))?;
            rates.push(run.records_per_s);
            sync_ms.push(run.sync_ms);
        }
        raw.push((case, rates, sync_ms));
    }
    report.raw = raw;

    // Start everything the append figures compare.
    progress("starting the stores");
    let systems = start_systems(args, dir, report, true).await?;

    // 2 and 3. Appends: each run goes round every system, so that all of them see the
    // same moments of a noisy machine.
    let targets = Target::ALL;
    let mut loads: LoadResults = HashMap::new();
    let mut failed = std::collections::HashSet::new();
    for &clients in &plan.clients {
        progress(&format!("appends, {clients} clients"));
        for run in 0..plan.runs {
            for target in targets {
                if failed.contains(&target) {
                    continue;
                }
                // A system that fails is reported and left out; the others go on.
                let result = async {
                    let Some(appenders) = systems.appenders(target, clients, run).await? else {
                        return anyhow::Ok(None);
                    };
                    Ok(Some(closed_loop(appenders, plan.window).await?))
                }
                .await;
                match result {
                    Ok(Some(result)) => loads.entry((target, clients)).or_default().push(result),
                    Ok(None) => {}
                    Err(e) => {
                        report.note(format!(
                            "{} failed at {clients} clients and was left out from there on: {e:#}",
                            target.label()
                        ));
                        failed.insert(target);
                    }
                }
            }
        }
    }
    report.loads = loads;
    // What the 1-client latency goal adds to the raw fdatasync: one loopback round trip.
    for _ in 0..plan.runs {
        let p50 = agentlog::round_trip_ms(&systems.store.url(), plan.raw_secs).await?;
        report.round_trip_ms.push(p50);
    }

    // Where the time goes at 64 clients (or the largest count measured), over longer loads.
    let clients = if plan.clients.contains(&64) {
        64
    } else {
        plan.clients.iter().copied().max().unwrap_or(1)
    };
    let window = if args.quick {
        plan.window
    } else {
        Window {
            warmup: plan.window.warmup,
            measure: plan.window.measure.max(Duration::from_secs(3)),
        }
    };
    if !args.quick && !args.no_profile {
        progress("profile");
        match profile_appends(&systems, clients, window, dir).await {
            Ok(p) => report.profile = Some(p),
            Err(e) => report.note(format!("No profile: {e:#}")),
        }
    }
    // CPU per append with every system at one rate: a little below the slower of the store
    // and Redis (the store's alone without the baselines).
    if !args.no_profile {
        let slower = [Target::AgentlogStream, Target::Redis]
            .into_iter()
            .filter_map(|target| report.rate(target, clients).map(|runs| runs.median()))
            .reduce(f64::min);
        if let Some(slower) = slower {
            let rate = (SAME_RATE_SHARE * slower).round();
            progress(&format!("one rate for all: {rate} appends/s"));
            match same_rate(&systems, clients, rate, window).await {
                Ok(rows) => {
                    report.same_rate = Some(report::SameRate {
                        clients,
                        rate,
                        rows,
                    })
                }
                Err(e) => report.note(format!("No figure at one rate: {e:#}")),
            }
        }
    }

    // 4. Subscribe: catch-up and live fan-out.
    catch_up_section(&systems, plan, report).await?;
    if args.skip_slow {
        report.note("Fan-out, resume and footprint were skipped (`--skip-slow`).".into());
        return Ok(());
    }

    progress("fan-out");
    let url = systems.store.url();
    let mut fan_out: Vec<(&'static str, usize, Vec<Vec<f64>>)> = Vec::new();
    for &followers in &plan.followers {
        let mut ours = Vec::new();
        let mut redis_runs = Vec::new();
        let mut etcd_runs = Vec::new();
        for run in 0..plan.runs {
            let session = format!("fanout-{followers}-{run}");
            ours.push(
                agentlog::fan_out(
                    &url,
                    &session,
                    followers,
                    plan.fan_out_events,
                    plan.fan_out_interval,
                )
                .await
                .with_context(|| format!("agentlog fan-out to {followers}"))?,
            );
            // A baseline that fails is reported and left out; the others go on.
            if let Some(redis) = &systems.redis {
                let events = plan.fan_out_events;
                match redis
                    .fan_out(&session, followers, events, plan.fan_out_interval)
                    .await
                {
                    Ok(latencies) => redis_runs.push(latencies),
                    Err(e) => report.note(format!("Redis fan-out to {followers} failed: {e:#}")),
                }
            }
            if let Some(etcd) = &systems.etcd {
                let events = plan.fan_out_events;
                match etcd
                    .fan_out(&session, followers, events, plan.fan_out_interval)
                    .await
                {
                    Ok(latencies) => etcd_runs.push(latencies),
                    Err(e) => report.note(format!("etcd fan-out to {followers} failed: {e:#}")),
                }
            }
        }
        fan_out.push(("agentlog Subscribe(follow)", followers, ours));
        if !redis_runs.is_empty() {
            fan_out.push(("Redis XREAD BLOCK", followers, redis_runs));
        }
        if !etcd_runs.is_empty() {
            fan_out.push(("etcd Watch", followers, etcd_runs));
        }
    }
    report.fan_out = (plan.fan_out_events, plan.fan_out_interval, fan_out);

    // The baselines are done: stop them so that they take no CPU from what follows.
    drop(systems);

    followers_section(plan, dir, report).await?;

    // 5. Resume, on a store of its own (the load sessions above are all runnable).
    resume_section(plan, dir, report).await?;

    // 7. Forks: checkpoints, restores and ForkSession.
    fork_section(plan, dir, report).await?;

    // 6. Memory and disk.
    progress("footprint");
    let (sessions, per_session) = plan.footprint;
    report.footprint =
        Some(agentlog::footprint(&fresh_dir(dir, "footprint")?, sessions, per_session).await?);
    Ok(())
}

/// The A/B of the write path: this build's store, on a fresh data dir of its own, against
/// `base` (started on one of its own), which `label` names in the report.
async fn ab_section(
    args: &Args,
    plan: &Plan,
    base: &Store,
    label: &str,
    dir: &Path,
    report: &mut Report,
) -> anyhow::Result<()> {
    let candidate = Store::start_in(&fresh_dir(dir, "ab-candidate")?)?;
    let perf_dir = (!args.quick && !args.no_profile).then_some(dir);
    let rounds = if args.quick { 1 } else { args.rounds.max(1) };
    report.ab = Some(ab::run(&candidate, base, label, rounds, plan.window, perf_dir).await?);
    Ok(())
}

/// Followers at scale, on a store of their own.
async fn followers_section(plan: &Plan, dir: &Path, report: &mut Report) -> anyhow::Result<()> {
    progress("idle followers");
    let (followers, events) = plan.idle_followers;
    report.followers = Some(
        followers::measure(
            &fresh_dir(dir, "followers")?,
            followers,
            events,
            plan.fan_out_interval,
        )
        .await
        .with_context(|| format!("{followers} idle followers"))?,
    );
    Ok(())
}

/// Section 5 on a store of its own.
async fn resume_section(plan: &Plan, dir: &Path, report: &mut Report) -> anyhow::Result<()> {
    progress("resume");
    let resume_dir = dir.join("resume");
    if resume_dir.exists() {
        std::fs::remove_dir_all(&resume_dir)?;
    }
    let resume_store = Store::start_in(&resume_dir.join("store"))?;
    report.resume = resume::measure(
        &resume_store.url(),
        &resume_dir,
        &plan.resume_sizes,
        plan.runs,
    )
    .await?;
    Ok(())
}

/// Section 7, in a directory and on a store of its own.
async fn fork_section(plan: &Plan, dir: &Path, report: &mut Report) -> anyhow::Result<()> {
    progress("forks: checkpoint against git status, restore against cp -a");
    let fork_dir = fresh_dir(dir, "fork")?;
    let mut figures = fork::ForkFigures {
        plan: Some(plan.fork),
        ..fork::ForkFigures::default()
    };
    tokio::task::block_in_place(|| fork::workspace_figures(&fork_dir, plan.fork, &mut figures))?;
    progress("forks: ForkSession against Subscribe");
    fork::log_figures(&fork_dir, plan.fork, &mut figures).await?;
    report.fork = figures;
    std::fs::remove_dir_all(&fork_dir)?;
    Ok(())
}

/// `dir/name`, empty.
fn fresh_dir(dir: &Path, name: &str) -> anyhow::Result<PathBuf> {
    let path = dir.join(name);
    if path.exists() {
        std::fs::remove_dir_all(&path)?;
    }
    std::fs::create_dir_all(&path)?;
    Ok(path)
}

/// The catch-up figure alone: agentlog and, unless `--no-baselines`, PostgreSQL.
async fn only_catch_up(
    args: &Args,
    plan: &Plan,
    dir: &Path,
    report: &mut Report,
) -> anyhow::Result<()> {
    let systems = start_systems(args, dir, report, false).await?;
    catch_up_section(&systems, plan, report).await
}

/// Starts the systems a run compares, each in a fresh directory under `dir`: agentlog and,
/// unless `--quick` or `--no-baselines`, PostgreSQL; with `all`, also the gRPC floor and the
/// durable floor, the fsync-skipped ceiling (unless `--quick`), Redis and etcd. A baseline
/// that does not start is noted in the report and left out.
async fn start_systems(
    args: &Args,
    dir: &Path,
    report: &mut Report,
    all: bool,
) -> anyhow::Result<Systems> {
    let fresh = |name: &str| fresh_dir(dir, name);
    let store = Store::start_in(&fresh("agentlog")?)?;
    let ceiling = match &args.nofsync_store {
        _ if !all => None,
        Some(binary) if !args.quick => {
            Some(Store::start_binary(binary, &fresh("agentlog-nofsync")?)?)
        }
        _ => {
            report.note(if args.quick {
                "Quick mode measures no fsync-skipped ceiling.".into()
            } else {
                "The fsync-skipped ceiling was not measured: no `--nofsync-store` binary \
                 (bench/run builds one when the event-store has the `unsafe-skip-fsync` feature)."
                    .into()
            });
            None
        }
    };
    let floor_binary = testkit::bin_path("agentlog-bench-floor");
    let floor = if all {
        start_or_note(
            report,
            "The gRPC floor",
            Store::start_binary(&floor_binary, &fresh("floor")?),
        )
    } else {
        None
    };
    let durable_floor = if all {
        start_or_note(
            report,
            "The durable floor",
            Store::start_backed(
                &floor_binary,
                Backing::Dir(fresh("durable-floor")?),
                "127.0.0.1:0",
                &["--durable"],
            ),
        )
    } else {
        None
    };
    let baselines = !args.quick && !args.no_baselines;
    let postgres = if baselines {
        start_or_note(
            report,
            "PostgreSQL",
            Postgres::start(&fresh("postgres")?).await,
        )
    } else {
        None
    };
    report
        .versions
        .push(("PostgreSQL", postgres.as_ref().map(|p| p.version.clone())));
    let (redis, etcd) = if baselines && all {
        (
            start_or_note(report, "Redis", Redis::start(&fresh("redis")?).await),
            start_or_note(report, "etcd", Etcd::start(&fresh("etcd")?).await),
        )
    } else {
        (None, None)
    };
    if all {
        report.versions.extend([
            ("Redis", redis.as_ref().map(|r| r.version.clone())),
            ("etcd", etcd.as_ref().map(|e| e.version.clone())),
        ]);
    }
    Ok(Systems {
        store,
        ceiling,
        floor,
        durable_floor,
        postgres,
        redis,
        etcd,
        naive_dir: fresh("naive")?,
    })
}

/// Catch-up: each reader reads the same whole session from its start, the readers taking
/// turns run after run; with the CPU each server and the reading process used.
async fn catch_up_section(
    systems: &Systems,
    plan: &Plan,
    report: &mut Report,
) -> anyhow::Result<()> {
    progress("catch-up");
    let n = plan.catch_up_events;
    let url = systems.store.url();
    agentlog::fill_session(&url, "catchup", n).await?;
    if let Some(pg) = &systems.postgres {
        pg.fill("catchup", n as i64).await?;
    }
    if let Some(redis) = &systems.redis {
        redis.fill("catchup", n).await?;
    }
    if let Some(etcd) = &systems.etcd {
        etcd.fill("catchup", n).await?;
    }
    progress("catch-up: reading");
    // (reader, its server's pid, its rates, server and reader CPU seconds of all runs)
    let mut readers: Vec<(&'static str, u32, Runs, f64, f64)> = vec![(
        "agentlog Subscribe from seq 1",
        systems.store.pid(),
        Runs::default(),
        0.0,
        0.0,
    )];
    if let Some(pg) = &systems.postgres {
        readers.push((
            "PostgreSQL SELECT … ORDER BY seq",
            pg.pid(),
            Runs::default(),
            0.0,
            0.0,
        ));
    }
    if let Some(redis) = &systems.redis {
        readers.push((
            "Redis XREAD COUNT 1000 from an id",
            redis.pid(),
            Runs::default(),
            0.0,
            0.0,
        ));
    }
    if let Some(etcd) = &systems.etcd {
        readers.push((
            "etcd Range pages of 1000",
            etcd.pid(),
            Runs::default(),
            0.0,
            0.0,
        ));
    }
    for _ in 0..plan.runs {
        for (name, pid, runs, server_cpu, reader_cpu) in readers.iter_mut() {
            // A server's CPU includes the children it started and reaped (PostgreSQL's
            // backend of the reading connection).
            let server_before = profile::tree_cpu_secs(*pid, &profile::with_children(*pid)[1..]);
            let reader_before = profile::cpu_secs(std::process::id());
            let rate = if name.starts_with("agentlog") {
                agentlog::catch_up(&url, "catchup", n).await?
            } else if name.starts_with("PostgreSQL") {
                systems
                    .postgres
                    .as_ref()
                    .context("postgres")?
                    .catch_up("catchup", n)
                    .await?
            } else if name.starts_with("Redis") {
                systems
                    .redis
                    .as_ref()
                    .context("redis")?
                    .catch_up("catchup", n)
                    .await?
            } else {
                systems
                    .etcd
                    .as_ref()
                    .context("etcd")?
                    .catch_up("catchup", n)
                    .await?
            };
            *reader_cpu += profile::cpu_secs(std::process::id()) - reader_before;
            *server_cpu +=
                profile::tree_cpu_secs(*pid, &profile::with_children(*pid)[1..]) - server_before;
            runs.push(rate);
        }
    }
    let events = (n * plan.runs) as f64;
    report.catch_up = (
        n,
        readers
            .into_iter()
            .map(|(name, _, runs, server, reader)| report::CatchUpRow {
                name,
                rates: runs,
                server_cpu_us_per_event: server * 1e6 / events,
                reader_cpu_us_per_event: reader * 1e6 / events,
            })
            .collect(),
    );
    Ok(())
}

fn start_or_note<T>(report: &mut Report, name: &str, started: anyhow::Result<T>) -> Option<T> {
    match started {
        Ok(server) => Some(server),
        Err(e) => {
            report.note(format!("{name} was not measured: it did not start: {e:#}"));
            None
        }
    }
}

/// The share of the slower closed-loop rate (the store's AppendStream or Redis) at which
/// [`same_rate`] paces every system: below what either sustains, so that each keeps up.
pub const SAME_RATE_SHARE: f64 = 0.8;

/// Server CPU per append of the store, the gRPC floor and Redis under the same paced load
/// (`rate` appends/s from `clients` clients on one session each): CPU per append falls as
/// the rate rises (more appends share each wake-up, read and fsync), so systems compared
/// at their own closed-loop rates are not compared at the same work. Each load starts on
/// an idle server and counts until it is idle again. Returns (target, rate kept up, µs).
async fn same_rate(
    systems: &Systems,
    clients: usize,
    rate: f64,
    window: Window,
) -> anyhow::Result<Vec<(Target, f64, f64)>> {
    let mut rows = Vec::new();
    for target in [
        Target::AgentlogStream,
        Target::CeilingStream,
        Target::FloorStream,
        Target::DurableFloorStream,
        Target::Redis,
    ] {
        let Some(pid) = systems.pid(target) else {
            continue;
        };
        let Some(appenders) = systems.appenders(target, clients, 2000).await? else {
            continue;
        };
        let pids = profile::with_children(pid);
        let tree_cpu = || profile::tree_cpu_secs(pid, &pids[1..]);
        profile::settle(tree_cpu).await;
        let (result, us) =
            profile::cpu_per_append(tree_cpu, load::paced(appenders, window, rate)).await?;
        rows.push((target, result.rate, us));
    }
    Ok(rows)
}

/// CPU use, fsync counts and a sampled profile of the store under `clients` clients, and
/// fsync counts of the baselines under the same load.
async fn profile_appends(
    systems: &Systems,
    clients: usize,
    window: Window,
    dir: &Path,
) -> anyhow::Result<report::Profile> {
    let perf = profile::perf_available();
    let mut rows = Vec::new();
    let targets = [
        Target::Agentlog,
        Target::AgentlogStream,
        Target::FloorStream,
        Target::Floor,
        Target::DurableFloorStream,
        Target::Postgres,
        Target::Redis,
        Target::Etcd,
    ];
    let mut recording = None;
    for target in targets {
        let Some(pid) = systems.pid(target) else {
            continue;
        };
        progress(&format!("profile: {}", target.label()));
        let Some(appenders) = systems.appenders(target, clients, 1000).await? else {
            continue;
        };
        let pids = profile::with_children(pid);
        let tree_cpu = || profile::tree_cpu_secs(pid, &pids[1..]);
        // What the loads before left this server to do is not this load's.
        profile::settle(tree_cpu).await;
        // Load for the whole window; count and sample over the measured part only; the CPU
        // per append over the whole load and until the server has settled (what an append
        // defers, such as indexing it, is its cost).
        let load_cpu_before = tree_cpu();
        let load_started = std::time::Instant::now();
        let load = tokio::spawn(closed_loop(appenders, window));
        tokio::time::sleep(window.warmup).await;
        let secs = window.measure.as_secs_f64();
        let counter = if perf {
            Some(profile::SyscallCount::start(
                &pids,
                &dir.join("perf-stat.txt"),
                secs,
            )?)
        } else {
            None
        };
        let record = if perf && target == Target::AgentlogStream {
            Some(profile::Recording::start(
                pid,
                &dir.join("perf.data"),
                secs,
            )?)
        } else {
            None
        };
        let server_cpu_before = tree_cpu();
        let bench_cpu_before = profile::cpu_secs(std::process::id());
        let started = std::time::Instant::now();
        let result = load.await??;
        let wall = started.elapsed().as_secs_f64();
        let load_wall = load_started.elapsed().as_secs_f64();
        let server_cpu = tree_cpu() - server_cpu_before;
        let bench_cpu = profile::cpu_secs(std::process::id()) - bench_cpu_before;
        profile::settle(tree_cpu).await;
        let load_cpu = tree_cpu() - load_cpu_before;
        let syncs = match counter {
            Some(c) => Some(tokio::task::block_in_place(|| c.finish())?),
            None => None,
        };
        if let Some(r) = record {
            let views = tokio::task::block_in_place(|| r.finish());
            recording = Some(views.unwrap_or_else(|e| profile::unrecorded(&e)));
        }
        rows.push(report::ProfileRow {
            target,
            rate: result.rate,
            server_cores: server_cpu / wall,
            bench_cores: bench_cpu / wall,
            server_cpu_us_per_append: load_cpu * 1e6 / (result.rate * load_wall),
            syncs_per_s: syncs.map(|s| s as f64 / secs),
            appends_per_sync: syncs
                .filter(|&s| s > 0)
                .map(|s| result.rate * secs / s as f64),
        });
    }
    Ok(report::Profile {
        clients,
        rows,
        perf: recording,
    })
}
