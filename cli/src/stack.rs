//! `agentlog up`: the local stack (one event store, one runner) as child processes.
//!
//! Promise: `up` reports ready only once the store answers its gRPC health check SERVING
//! and the runner has started; on Ctrl-C or SIGTERM it drains the runner (which claims
//! nothing more, lets the tool calls it started finish and logs their results, within its
//! `--drain-timeout`, and gives its leases back) and then stops the store (which answers
//! every request it received and fsyncs), each with SIGTERM, and waits for both. A second
//! Ctrl-C passes on to the runner, which then stops what still runs at once. The children
//! run in their own process groups, so a terminal's Ctrl-C reaches only `up`, which stops
//! them in that order.

use std::io::IsTerminal;
use std::net::{SocketAddr, ToSocketAddrs};
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

use crate::store;

/// How long the runner gets to exit after SIGTERM before it is killed: its drain budget
/// (`runner --drain-timeout`, 20 s by default) and the margin it exits within, with room.
pub const RUNNER_STOP_GRACE: Duration = Duration::from_secs(30);
/// How long the store gets: it cuts connections still open 50 s after SIGTERM.
pub const STORE_STOP_GRACE: Duration = Duration::from_secs(60);
/// How long start-up (the store's log replay included) may take.
const START_BOUND: Duration = Duration::from_secs(60);
/// How long a runner that logs no start-up line must stay up to count as started.
const RUNNER_QUIET_START: Duration = Duration::from_secs(5);

/// The default Anthropic model, when `ANTHROPIC_MODEL` does not name one.
pub const DEFAULT_ANTHROPIC_MODEL: &str = "claude-sonnet-4-5";
/// The default model for an OpenAI-compatible server, when `OPENAI_MODEL` does not name one.
pub const DEFAULT_OPENAI_MODEL: &str = "gpt-4o-mini";

/// Settings of `agentlog up`.
#[derive(Debug)]
pub struct UpConfig {
    pub data_dir: PathBuf,
    /// Keep the sessions in this PostgreSQL database instead of under `data_dir`.
    pub database_url: Option<String>,
    pub listen: String,
    pub model: Option<String>,
    pub runner_id: String,
    pub lease_ttl_ms: Option<u64>,
}

/// Which of a child's log lines are copied to our stderr.
#[derive(Debug, Clone, Copy)]
pub enum LogView {
    All,
    WarningsOnly,
}

impl LogView {
    fn shows(self, line: &str) -> bool {
        match self {
            LogView::All => true,
            LogView::WarningsOnly => line.contains("WARN") || line.contains("ERROR"),
        }
    }
}

/// The children's log filter: the user's `RUST_LOG`, or info.
fn rust_log() -> String {
    std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into())
}

/// A child process whose stderr lines are copied to ours with a prefix.
pub struct Proc {
    pub name: String,
    child: Child,
    /// Every line it logged, for whoever waits on one (the listen address, "started").
    lines: watch::Receiver<Vec<String>>,
}

impl Proc {
    /// Starts `program ARGS` in its own process group, its stderr prefixed with `name`.
    pub fn spawn(
        name: &str,
        program: &Path,
        args: &[String],
        rust_log: &str,
        view: LogView,
    ) -> Result<Proc> {
        let mut child = Command::new(program)
            .args(args)
            .env("RUST_LOG", rust_log)
            // Their lines are copied, not shown on a terminal: no colour codes unless ours is.
            .envs((!std::io::stderr().is_terminal()).then_some(("NO_COLOR", "1")))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .process_group(0)
            .kill_on_drop(true)
            .spawn()
            .with_context(|| format!("cannot start {}", program.display()))?;
        let stderr = child.stderr.take().context("piped stderr")?;
        let (tx, lines) = watch::channel(Vec::new());
        let prefix = name.to_string();
        tokio::spawn(async move {
            let mut reader = BufReader::new(stderr).lines();
            while let Ok(Some(line)) = reader.next_line().await {
                if view.shows(&line) {
                    eprintln!("{prefix:>11} | {line}");
                }
                tx.send_modify(|all| all.push(line));
            }
        });
        Ok(Proc {
            name: name.to_string(),
            child,
            lines,
        })
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Waits for a logged line that `find` accepts; fails if the process exits first.
    pub async fn wait_for_line<T>(&mut self, find: impl Fn(&str) -> Option<T>) -> Result<T> {
        let deadline = tokio::time::Instant::now() + START_BOUND;
        let mut checked = 0;
        loop {
            {
                let lines = self.lines.borrow_and_update();
                for line in &lines[checked..] {
                    if let Some(found) = find(line) {
                        return Ok(found);
                    }
                }
                checked = lines.len();
            }
            self.fail_if_exited().await?;
            if tokio::time::Instant::now() > deadline {
                bail!("{} did not start within {START_BOUND:?}", self.name);
            }
            let _ = tokio::time::timeout(Duration::from_millis(100), self.lines.changed()).await;
        }
    }

    /// The first line logged so far that `find` accepts, without waiting.
    pub fn find_line<T>(&self, find: impl Fn(&str) -> Option<T>) -> Option<T> {
        self.lines.borrow().iter().find_map(|line| find(line))
    }

    pub fn last_line(&self) -> String {
        self.lines
            .borrow()
            .last()
            .cloned()
            .unwrap_or_else(|| "(it logged nothing)".into())
    }

    pub fn send(&self, sig: Signal) {
        if let Some(pid) = self.child.id() {
            let _ = kill(Pid::from_raw(pid as i32), sig);
        }
    }

    /// SIGTERM, then waits; SIGKILL if it takes longer than `grace`.
    pub async fn stop(&mut self, grace: Duration) -> Result<ExitStatus> {
        self.send(Signal::SIGTERM);
        match tokio::time::timeout(grace, self.child.wait()).await {
            Ok(status) => Ok(status?),
            Err(_) => {
                eprintln!(
                    "agentlog: {} did not exit within {grace:?} of SIGTERM; killing it",
                    self.name
                );
                self.child.kill().await?;
                Ok(self.child.wait().await?)
            }
        }
    }

    /// SIGKILL, and reap it.
    pub async fn kill9(&mut self) {
        let _ = self.child.kill().await;
    }

    pub async fn wait(&mut self) -> Result<ExitStatus> {
        Ok(self.child.wait().await?)
    }
}

/// A sibling binary: next to this `agentlog` executable, or else on PATH.
pub fn find_binary(name: &str) -> Result<PathBuf> {
    if let Ok(exe) = std::env::current_exe() {
        if let Some(dir) = exe.parent() {
            let candidate = dir.join(name);
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    if let Some(path) = std::env::var_os("PATH") {
        for dir in std::env::split_paths(&path) {
            let candidate = dir.join(name);
            if candidate.is_file() {
                return Ok(candidate);
            }
        }
    }
    Err(anyhow!(
        "cannot find `{name}` next to the agentlog binary or on PATH: build every binary with \
         `cargo build --release --workspace --bins` and run ./target/release/agentlog"
    ))
}

/// Starts `event-store` and waits for it to be healthy; returns it with its address.
pub async fn start_store(
    data_dir: &Path,
    listen: &str,
    view: LogView,
) -> Result<(Proc, SocketAddr)> {
    start_store_backed(
        &["--data-dir".to_string(), data_dir.display().to_string()],
        listen,
        view,
    )
    .await
}

/// Like [`start_store`], with the backend's arguments (`--data-dir DIR` or
/// `--database-url URL`).
pub async fn start_store_backed(
    backend: &[String],
    listen: &str,
    view: LogView,
) -> Result<(Proc, SocketAddr)> {
    let program = find_binary("event-store")?;
    let mut args = vec!["--listen".to_string(), listen.to_string()];
    args.extend_from_slice(backend);
    let known = listen
        .to_socket_addrs()
        .ok()
        .and_then(|mut addrs| addrs.next())
        .filter(|addr| addr.port() != 0);
    // With port 0 the chosen port is only in the store's start-up line (info level).
    let filter = match known {
        Some(_) => rust_log(),
        None => format!("{},event_store=info", rust_log()),
    };
    let mut store = Proc::spawn("event-store", &program, &args, &filter, view)?;
    let started = async {
        let addr = match known {
            Some(addr) => addr,
            None => store.wait_for_line(listen_addr).await?,
        };
        store.wait_healthy(&format!("http://{addr}")).await?;
        Ok::<_, anyhow::Error>(addr)
    }
    .await;
    match started {
        Ok(addr) => Ok((store, addr)),
        Err(e) if e.to_string().contains("Address already in use") => Err(anyhow!(
            "{e}\nsomething already listens on {listen}: is another `agentlog up` running? \
             Pass --listen HOST:PORT (and --addr to the other commands) to use another port"
        )),
        Err(e) => Err(e),
    }
}

/// `listen_addr=HOST:PORT` in the store's start-up line (info level, always logged).
fn listen_addr(line: &str) -> Option<SocketAddr> {
    let rest = line.split("listen_addr=").nth(1)?;
    rest.split_whitespace()
        .next()?
        .trim_matches('"')
        .parse()
        .ok()
}

impl Proc {
    /// Polls `grpc.health.v1.Health/Check` for the EventStore service until it is SERVING;
    /// fails at once if the store exits.
    pub async fn wait_healthy(&mut self, url: &str) -> Result<()> {
        let deadline = tokio::time::Instant::now() + START_BOUND;
        loop {
            if let Ok(channel) = store::endpoint(url)?.connect().await {
                let check = HealthClient::new(channel)
                    .check(HealthCheckRequest {
                        service: "agentlog.v1.EventStore".into(),
                    })
                    .await;
                if matches!(&check, Ok(r) if r.get_ref().status() == ServingStatus::Serving) {
                    return Ok(());
                }
            }
            self.fail_if_exited().await?;
            if tokio::time::Instant::now() > deadline {
                bail!("the event store at {url} did not report SERVING within {START_BOUND:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    async fn fail_if_exited(&mut self) -> Result<()> {
        if let Some(status) = self.child.try_wait()? {
            // Let the copier catch the last words.
            tokio::time::sleep(Duration::from_millis(100)).await;
            bail!(
                "{} exited during start-up ({status}): {}",
                self.name,
                self.last_line()
            );
        }
        Ok(())
    }
}

/// Starts a `runner` against `store_url` and waits until it says it started.
pub async fn start_runner(
    store_url: &str,
    runner_id: &str,
    workspace_root: &Path,
    model: &str,
    extra: &[String],
    view: LogView,
) -> Result<Proc> {
    let program = find_binary("runner")?;
    let mut args = vec![
        "--event-store".to_string(),
        store_url.to_string(),
        "--runner-id".to_string(),
        runner_id.to_string(),
        "--workspace-root".to_string(),
        workspace_root.display().to_string(),
        "--model".to_string(),
        model.to_string(),
    ];
    args.extend_from_slice(extra);
    let mut runner = Proc::spawn(runner_id, &program, &args, &rust_log(), view)?;
    // The runner checks its arguments and model before it logs that it started; a filter
    // that hides info lines leaves only "still running after a moment" to go by.
    let started = runner.wait_for_line(|line| line.contains("runner started").then_some(()));
    match tokio::time::timeout(RUNNER_QUIET_START, started).await {
        Ok(result) => result?,
        Err(_) => runner.fail_if_exited().await?,
    }
    Ok(runner)
}

/// The model the environment asks for, and why.
pub fn model_from_env(data_dir: &Path) -> Result<(String, String)> {
    let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
    // The runner reads the key from the file or the variable (and scrubs the variable).
    if let Some(source) = ["ANTHROPIC_API_KEY_FILE", "ANTHROPIC_API_KEY"]
        .into_iter()
        .find(|name| var(name).is_some())
    {
        let model = var("ANTHROPIC_MODEL").unwrap_or(DEFAULT_ANTHROPIC_MODEL.into());
        return Ok((
            format!("anthropic:{model}"),
            format!("{source} is set (ANTHROPIC_MODEL picks another model)"),
        ));
    }
    if let Some(base) = var("OPENAI_BASE_URL") {
        let model = var("OPENAI_MODEL").unwrap_or(DEFAULT_OPENAI_MODEL.into());
        return Ok((
            format!("openai:{model}"),
            format!("OPENAI_BASE_URL is {base} (OPENAI_MODEL picks another model)"),
        ));
    }
    let script = data_dir.join("demo-model.jsonl");
    std::fs::write(&script, demo_script())
        .with_context(|| format!("cannot write the demo model's script {}", script.display()))?;
    Ok((
        format!("scripted:{}", script.display()),
        "the built-in scripted demo model: it does not read what you write. \
         Set ANTHROPIC_API_KEY or OPENAI_BASE_URL for a real one"
            .into(),
    ))
}

/// The built-in demo model (`deploy/demo-model.jsonl`, which deploy/compose.yaml mounts into
/// its runner too): each turn records itself in the workspace with one bash call, then
/// answers. Enough turns for a good while of `send`/`continue`/`resume`.
fn demo_script() -> &'static str {
    include_str!("../../deploy/demo-model.jsonl")
}

/// Runs `agentlog up` until Ctrl-C / SIGTERM or a child's unexpected exit.
pub async fn up(config: UpConfig) -> Result<()> {
    let mut sigterm = signal(SignalKind::terminate()).context("install the SIGTERM handler")?;
    let mut sigint = signal(SignalKind::interrupt()).context("install the SIGINT handler")?;
    let store_dir = config.data_dir.join("store");
    let workspaces = config.data_dir.join("workspaces");
    for dir in [&store_dir, &workspaces] {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("cannot create the data dir {}", dir.display()))?;
    }
    let (model, why) = match &config.model {
        Some(model) => (model.clone(), "--model".to_string()),
        None => model_from_env(&config.data_dir)?,
    };
    eprintln!("agentlog: model {model} ({why})");

    let backend = match &config.database_url {
        Some(url) => vec!["--database-url".to_string(), url.clone()],
        None => vec!["--data-dir".to_string(), store_dir.display().to_string()],
    };
    let (mut store, addr) = start_store_backed(&backend, &config.listen, LogView::All).await?;
    let url = format!("http://{addr}");
    let mut extra = Vec::new();
    if let Some(ttl) = config.lease_ttl_ms {
        extra.extend(["--lease-ttl-ms".to_string(), ttl.to_string()]);
    }
    let mut runner = match start_runner(
        &url,
        &config.runner_id,
        &workspaces,
        &model,
        &extra,
        LogView::All,
    )
    .await
    {
        Ok(runner) => runner,
        Err(e) => {
            let _ = store.stop(STORE_STOP_GRACE).await;
            return Err(e);
        }
    };
    println!("agentlog is up at {url}");
    println!("  event store  {url}  (data in {})", store_dir.display());
    println!(
        "  runner       {} with model {model}  (workspaces in {})",
        config.runner_id,
        workspaces.display()
    );
    println!("  tool sandbox {}", sandbox_line(&runner));
    for line in sandbox_table(&runner) {
        println!("    {line}");
    }
    println!(
        "  try          agentlog send \"hello\"   (another terminal; add --addr {url} if not the default)"
    );
    println!("  stop         Ctrl-C");

    let outcome = tokio::select! {
        _ = sigint.recv() => Ok("Ctrl-C"),
        _ = sigterm.recv() => Ok("SIGTERM"),
        status = store.wait() => Err(("event-store", status)),
        status = runner.wait() => Err(("runner", status)),
    };
    match outcome {
        Ok(why) => {
            eprintln!(
                "agentlog: {why}: draining the runner (the tool calls it started finish; Ctrl-C \
                 again to stop them now), then stopping the event store"
            );
            let runner_pid = runner.pid();
            let stopping = runner.stop(RUNNER_STOP_GRACE);
            tokio::pin!(stopping);
            let runner_status = loop {
                tokio::select! {
                    status = &mut stopping => break status?,
                    _ = sigint.recv() => {}
                    _ = sigterm.recv() => {}
                }
                eprintln!("agentlog: stopping what the runner still runs");
                if let Some(pid) = runner_pid {
                    let _ = kill(Pid::from_raw(pid as i32), Signal::SIGTERM);
                }
            };
            let store_status = store.stop(STORE_STOP_GRACE).await?;
            if runner_status.success() && store_status.success() {
                eprintln!("agentlog: stopped cleanly");
                Ok(())
            } else {
                bail!(
                    "stopped, but not cleanly: runner {runner_status}, event store {store_status}"
                )
            }
        }
        Err((which, status)) => {
            let status = status.map(|s| s.to_string()).unwrap_or_default();
            eprintln!("agentlog: {which} exited unexpectedly ({status}); stopping the rest");
            if which == "runner" {
                let _ = store.stop(STORE_STOP_GRACE).await;
            } else {
                let _ = runner.stop(RUNNER_STOP_GRACE).await;
            }
            bail!("{which} exited unexpectedly ({status}); its log is above")
        }
    }
}

/// What the runner's start-up line says about the tool sandbox: its mode and tool network.
fn sandbox_line(runner: &Proc) -> String {
    let field = |line: &str, name: &str| {
        line.split_whitespace()
            .find_map(|word| word.strip_prefix(name))
            .map(|value| value.trim_matches('"').to_string())
    };
    let found = runner.find_line(|line| {
        let line = &strip_ansi(line);
        if !line.contains("runner started") {
            return None;
        }
        let mode = field(line, "sandbox=")?;
        let network = field(line, "tool_network=").unwrap_or_else(|| "?".into());
        Some(match mode.as_str() {
            "require" => format!("require: every protection below enforced, network {network}"),
            "best-effort" => format!(
                "best-effort: this node does not enforce all of it (below), network {network}"
            ),
            _ => format!("{mode}: tools are NOT confined (runner --sandbox {mode})"),
        })
    });
    found.unwrap_or_else(|| {
        "the runner's start-up line was filtered out (RUST_LOG); it says which mode is in force"
            .to_string()
    })
}

/// The runner's start-up table of the sandbox's protections (its lines start with
/// `sandbox: `; the runner prints them whatever RUST_LOG filters), without that prefix.
fn sandbox_table(runner: &Proc) -> Vec<String> {
    runner
        .lines
        .borrow()
        .iter()
        .filter_map(|line| {
            strip_ansi(line)
                .strip_prefix("sandbox: ")
                .map(|rest| rest.trim_end().to_string())
        })
        .collect()
}

/// `text` without ANSI colour sequences (the logs are coloured even into a pipe).
fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // ESC [ parameters… final letter
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}
