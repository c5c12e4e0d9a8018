//! One build deployed as users deploy it: its own event store (local backend, a fresh data
//! dir) and its runners, each with its `--max-sessions` slots, working the model of the
//! stand-in. A release's runners run beside its own store: this build's runner keeps its
//! retries in the log only on a store that keeps `model_retry`, and against a 0.1.0 store it
//! works as 0.1.0's runner does (`runner/src/call_model.rs`), so each build's column is
//! that release whole.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use testkit::previous::Build;
use testkit::{Backing, Signal, Store};

use crate::scrape::{free_port, metric};

/// How the runners are deployed; the same for both builds.
#[derive(Debug, Clone)]
pub struct Shape {
    pub runners: usize,
    pub max_sessions: usize,
    /// `PROVIDER:MODEL` as the runners are given it.
    pub model: String,
    /// This build's `--park-after` (the release has no such flag: it never parks).
    pub park_after: Duration,
    /// More arguments for this build's runners.
    pub this_runner_args: Vec<String>,
}

/// A store and its runners; all stopped when dropped.
pub struct Deployment {
    pub store: Store,
    runners: Vec<Child>,
    /// Each runner's `--metrics-listen`.
    metrics: Vec<String>,
}

impl Deployment {
    /// Starts `build`'s store on `dir/store` and `shape.runners` runners reaching the
    /// model at `model_url`; their logs go to `dir`.
    pub async fn start(
        build: Build,
        shape: &Shape,
        model_url: &str,
        dir: &Path,
    ) -> anyhow::Result<Deployment> {
        let store = build.start_store(Backing::Dir(dir.join("store")), &[])?;
        let mut deployment = Deployment {
            store,
            runners: Vec::new(),
            metrics: Vec::new(),
        };
        for i in 0..shape.runners {
            let metrics = format!("127.0.0.1:{}", free_port()?);
            let log = dir.join(format!("runner-{i}.log"));
            let mut command = Command::new(build.bin_path("runner"));
            command
                .args(["--event-store", &deployment.store.url()])
                .args(["--runner-id", &format!("drill-{i}")])
                .arg("--workspace-root")
                .arg(dir.join("workspaces"))
                .args(["--model", &shape.model])
                .args(["--max-sessions", &shape.max_sessions.to_string()])
                .args(["--metrics-listen", &metrics]);
            if build == Build::This {
                let park_after = format!("{}ms", shape.park_after.as_millis());
                command.args(["--park-after", &park_after]);
                command.args(&shape.this_runner_args);
            }
            let child = command
                .env("ANTHROPIC_BASE_URL", model_url)
                .env("ANTHROPIC_API_KEY", "drill-key")
                .env("RUST_LOG", "warn")
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(std::fs::File::create(&log)?)
                .spawn()
                .with_context(|| format!("start {build}'s runner"))?;
            deployment.runners.push(child);
            deployment.metrics.push(metrics);
        }
        // A runner is up once its metrics answer (it serves them once it has started).
        let deadline = Instant::now() + Duration::from_secs(60);
        for (i, addr) in deployment.metrics.iter().enumerate() {
            while metric(addr, "agentlog_runner_sessions_held").await.is_err() {
                if Instant::now() > deadline {
                    bail!(
                        "{build}'s runner {i} did not serve its metrics within 60 s (its log: {:?})",
                        dir.join(format!("runner-{i}.log"))
                    );
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        Ok(deployment)
    }

    /// The sessions the runners hold a lease on right now, all runners together
    /// (`agentlog_runner_sessions_held`).
    pub async fn sessions_held(&self) -> anyhow::Result<f64> {
        let mut held = 0.0;
        for addr in &self.metrics {
            held += metric(addr, "agentlog_runner_sessions_held").await?;
        }
        Ok(held)
    }

    /// The times the runners let a session go until its next call was due (this build's
    /// `agentlog_runner_sessions_parked`; 0 for a release without it).
    pub async fn sessions_parked(&self) -> anyhow::Result<f64> {
        let mut parked = 0.0;
        for addr in &self.metrics {
            parked += metric(addr, "agentlog_runner_sessions_parked_total").await?;
        }
        Ok(parked)
    }
}

impl Drop for Deployment {
    /// The runners are drained (SIGTERM: nothing is left running in their sandboxes), then
    /// the store is killed with the deployment.
    fn drop(&mut self) {
        for runner in &self.runners {
            testkit::signal(runner.id(), Signal::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        for runner in &mut self.runners {
            while matches!(runner.try_wait(), Ok(None)) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = runner.kill();
            let _ = runner.wait();
        }
    }
}
