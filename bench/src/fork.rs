//! Forks: what a workspace checkpoint after a tool call costs against `git status` on the
//! same tree, what a fork's restore costs against `cp -a` of it, and what `ForkSession` of a
//! long log costs against reading that log with `Subscribe`, all in one run.
//!
//! The workspace is `files` files of random content (`bytes` in all) in directories of 100,
//! with a git index beside it (`--git-dir` outside the tree, so neither side sees the
//! other's files). Each run rewrites `changed` files (same sizes, new content), then times
//! the runner's checkpoint (`runner::tools::Checkpoints`, as the guard calls it before a
//! tool result) and `git status --porcelain`, in turn. The restore is the runner's fork
//! restore (staged, every byte synced with one `syncfs`, moved into place, marked) against
//! `cp -a` and against `cp -a` followed by `sync -f`. The fork is of a session of `events`
//! 300-byte user turns on a store of its own, once on the local log and once on PostgreSQL;
//! Subscribe reads the same session from seq 1 to its end, on the same store.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use agentlog_proto::v1::{ForkSessionRequest, SubscribeRequest};
use anyhow::Context;
use runner::tools::checkpoint::{IgnoreRules, PrefixCheckpoints};
use runner::tools::Checkpoints;
use testkit::Store;

use crate::stats::Runs;

/// The sizes of the fork figures.
#[derive(Debug, Clone, Copy)]
pub struct ForkPlan {
    pub files: usize,
    pub bytes: u64,
    pub changed: usize,
    pub events: usize,
    pub runs: usize,
}

#[derive(Debug, Clone, Default)]
pub struct ForkFigures {
    pub plan: Option<ForkPlan>,
    /// The session's first checkpoint, which reads and stores every file.
    pub first_checkpoint_ms: f64,
    pub checkpoint_ms: Runs,
    /// The checkpoint right after, nothing changed: the walk alone.
    pub unchanged_ms: Runs,
    pub files_read: Runs,
    pub git_status_ms: Runs,
    pub restore_ms: Runs,
    pub cp_ms: Runs,
    pub cp_sync_ms: Runs,
    pub fork_ms: Runs,
    pub subscribe_ms: Runs,
    /// The same on a PostgreSQL store.
    pub pg_fork_ms: Runs,
    pub pg_subscribe_ms: Runs,
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1000.0
}

/// Writes `files` files of random bytes (`bytes` in all) under `ws`, 100 to a directory.
fn make_tree(ws: &Path, files: usize, bytes: u64) -> anyhow::Result<Vec<PathBuf>> {
    let mut rng = fastrand::Rng::with_seed(7);
    let mean = (bytes / files as u64).max(1);
    let mut paths = Vec::with_capacity(files);
    for i in 0..files {
        let dir = ws.join(format!("d{:03}", i / 100));
        std::fs::create_dir_all(&dir)?;
        // Sizes from half to one and a half times the mean.
        let size = (mean / 2 + rng.u64(0..=mean)) as usize;
        let mut content = vec![0u8; size];
        rng.fill(&mut content);
        let path = dir.join(format!("f{i:05}.bin"));
        std::fs::write(&path, &content)?;
        paths.push(path);
    }
    Ok(paths)
}

fn git(git_dir: &Path, ws: &Path, args: &[&str]) -> anyhow::Result<()> {
    let status = Command::new("git")
        .arg(format!("--git-dir={}", git_dir.display()))
        .arg(format!("--work-tree={}", ws.display()))
        .args(["-c", "user.name=bench", "-c", "user.email=bench@localhost"])
        .args(args)
        .stdout(std::process::Stdio::null())
        .status()
        .context("run git")?;
    anyhow::ensure!(status.success(), "git {args:?} failed");
    Ok(())
}

fn cp(from: &Path, to: &Path, sync: bool) -> anyhow::Result<()> {
    let status = Command::new("cp").arg("-a").arg(from).arg(to).status()?;
    anyhow::ensure!(status.success(), "cp -a failed");
    if sync {
        let status = Command::new("sync").arg("-f").arg(to).status()?;
        anyhow::ensure!(status.success(), "sync -f failed");
    }
    Ok(())
}

/// The checkpoint and restore figures (blocking: files and processes).
pub fn workspace_figures(dir: &Path, plan: ForkPlan, out: &mut ForkFigures) -> anyhow::Result<()> {
    let root = dir.join("workspaces");
    let ws = root.join("s");
    std::fs::create_dir_all(&ws)?;
    let paths = make_tree(&ws, plan.files, plan.bytes)?;
    let git_dir = dir.join("git");
    git(&git_dir, &ws, &["init", "-q"])?;
    git(&git_dir, &ws, &["add", "-A"])?;
    git(&git_dir, &ws, &["commit", "-q", "-m", "tree"])?;
    let checkpoints = Checkpoints::new(&root, IgnoreRules::new([""]), None);
    let started = Instant::now();
    let mut last = checkpoints.record_blocking("s")?;
    out.first_checkpoint_ms = ms(started);

    let mut rng = fastrand::Rng::with_seed(11);
    for run in 0..plan.runs {
        // A tool call changed `changed` files.
        for k in 0..plan.changed {
            let path = &paths[(run * plan.changed + k) * 7 % paths.len()];
            let size = std::fs::metadata(path)?.len() as usize;
            let mut content = vec![0u8; size];
            rng.fill(&mut content);
            std::fs::write(path, &content)?;
        }
        let started = Instant::now();
        last = checkpoints.record_blocking("s")?;
        out.checkpoint_ms.push(ms(started));
        out.files_read.push(last.files_read as f64);
        let started = Instant::now();
        git(&git_dir, &ws, &["status", "--porcelain"])?;
        out.git_status_ms.push(ms(started));
        let started = Instant::now();
        checkpoints.record_blocking("s")?;
        out.unchanged_ms.push(ms(started));
    }

    let prefix = PrefixCheckpoints {
        named: vec![last.id.clone()],
        latest: Some((1, last.id.clone())),
        last_result_seq: Some(1),
    };
    for run in 0..plan.runs {
        let fork = format!("f{run}");
        let started = Instant::now();
        checkpoints.restore_fork_blocking(&fork, "s", 1, &prefix)?;
        out.restore_ms.push(ms(started));
        std::fs::remove_dir_all(root.join(&fork))?;
        for (sync, runs) in [(false, &mut out.cp_ms), (true, &mut out.cp_sync_ms)] {
            let copy = dir.join(format!("copy-{run}"));
            let started = Instant::now();
            cp(&ws, &copy, sync)?;
            runs.push(ms(started));
            std::fs::remove_dir_all(&copy)?;
        }
    }
    Ok(())
}

/// ForkSession of a session of `plan.events` events against Subscribe of it, on a local
/// store and on a PostgreSQL one (a private server, `testkit::pg::Postgres`).
pub async fn log_figures(dir: &Path, plan: ForkPlan, out: &mut ForkFigures) -> anyhow::Result<()> {
    {
        let store = Store::start_in(&dir.join("store"))?;
        fork_against_subscribe(&store, plan, &mut out.fork_ms, &mut out.subscribe_ms).await?;
    }
    let pg = std::sync::Arc::new(tokio::task::block_in_place(testkit::pg::Postgres::start)?);
    let url = tokio::task::block_in_place(|| pg.create_database())?;
    let store = Store::start_backed(
        &testkit::bin_path("event-store"),
        testkit::Backing::Database(url, Some(pg)),
        "127.0.0.1:0",
        &[],
    )?;
    fork_against_subscribe(&store, plan, &mut out.pg_fork_ms, &mut out.pg_subscribe_ms).await
}

async fn fork_against_subscribe(
    store: &Store,
    plan: ForkPlan,
    fork_ms: &mut Runs,
    subscribe_ms: &mut Runs,
) -> anyhow::Result<()> {
    crate::agentlog::fill_session(&store.url(), "long", plan.events).await?;
    // Connected as the product's programs connect (its HTTP/2 windows and frame size).
    let connection = agentlog_client::StoreConnection {
        url: store.url(),
        ..Default::default()
    };
    let mut client = agentlog_proto::v1::event_store_client::EventStoreClient::new(
        connection.endpoint()?.connect().await?,
    );
    for run in 0..plan.runs {
        let started = Instant::now();
        let mut stream = client
            .subscribe(SubscribeRequest {
                session_id: "long".into(),
                from_seq: 1,
                follow: false,
            })
            .await?
            .into_inner();
        let mut read = 0usize;
        while stream.message().await?.is_some() {
            read += 1;
        }
        subscribe_ms.push(ms(started));
        anyhow::ensure!(read == plan.events, "read {read} of {} events", plan.events);
        let started = Instant::now();
        let made = client
            .fork_session(ForkSessionRequest {
                session_id: "long".into(),
                at_seq: plan.events as u64,
                new_session_id: format!("long-fork-{run}"),
                events: vec![],
            })
            .await?
            .into_inner();
        fork_ms.push(ms(started));
        anyhow::ensure!(made.last_seq == plan.events as u64, "the fork is short");
    }
    Ok(())
}
