//! Shared by the runner tests: starting `runner` processes as users start them, driving a
//! session over gRPC, and the log invariants every test checks.
#![allow(dead_code)] // each test file uses its own subset

pub mod sigkill;

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentlog_proto::v1::{
    content_block::Block, event::Kind, event_store_client::EventStoreClient, AppendRequest, Event,
    GetSessionRequest, SessionStatus, SubscribeRequest, UserMessage,
};
use integration_tests::anthropic_standin::{AnthropicStandin, StandinReply};
use integration_tests::{bin_path, signal, Signal, Store};
use tokio_stream::StreamExt;
use tonic::transport::Channel;

/// What most runner tests start from: a store, a client on it, the Anthropic stand-in
/// playing a script, and a root for the sessions' workspaces.
pub struct Rig {
    pub store: Store,
    pub client: EventStoreClient<Channel>,
    pub standin: AnthropicStandin,
    pub workspaces: tempfile::TempDir,
}

impl Rig {
    pub async fn start(script: Vec<StandinReply>) -> Rig {
        let store = Store::start().expect("store");
        let client = store.client().await.expect("client");
        let standin = AnthropicStandin::start(script).await.expect("stand-in");
        Rig {
            store,
            client,
            standin,
            workspaces: tempfile::tempdir().expect("temp dir"),
        }
    }

    /// A runner on this rig: lease TTL `ttl_ms`, two sessions at once, and `flags`.
    pub fn runner(&self, id: &str, ttl_ms: u64, flags: &[&str]) -> RunnerProc {
        start_runner_with(
            &self.store.url(),
            id,
            self.workspaces.path(),
            &self.standin.url(),
            ttl_ms,
            2,
            flags,
        )
    }
}

/// A `runner` process; SIGKILLed when dropped.
pub struct RunnerProc {
    child: Child,
    pub id: String,
    /// Every line it has written to stderr so far.
    log: Arc<Mutex<Vec<String>>>,
}

/// Starts `runner` against `store_url` with the Anthropic stand-in at `model_url`.
pub fn start_runner(
    store_url: &str,
    id: &str,
    workspace_root: &Path,
    model_url: &str,
    ttl_ms: u64,
    max_sessions: usize,
) -> RunnerProc {
    start_runner_with(
        store_url,
        id,
        workspace_root,
        model_url,
        ttl_ms,
        max_sessions,
        &[],
    )
}

/// [`start_runner`] with more flags (e.g. `--approve bash`).
pub fn start_runner_with(
    store_url: &str,
    id: &str,
    workspace_root: &Path,
    model_url: &str,
    ttl_ms: u64,
    max_sessions: usize,
    extra: &[&str],
) -> RunnerProc {
    start_runner_binary(
        &bin_path("runner"),
        store_url,
        id,
        workspace_root,
        model_url,
        ttl_ms,
        max_sessions,
        extra,
    )
}

/// [`start_runner_with`] of another build of the runner (the last release's:
/// `testkit::previous`).
#[allow(clippy::too_many_arguments)]
pub fn start_runner_binary(
    binary: &Path,
    store_url: &str,
    id: &str,
    workspace_root: &Path,
    model_url: &str,
    ttl_ms: u64,
    max_sessions: usize,
    extra: &[&str],
) -> RunnerProc {
    spawn_runner(
        Command::new(binary),
        store_url,
        id,
        workspace_root,
        (
            "anthropic:standin-1",
            &[
                ("ANTHROPIC_BASE_URL", model_url),
                ("ANTHROPIC_API_KEY", "test-key"),
            ],
        ),
        ttl_ms,
        max_sessions,
        extra,
    )
}

/// A runner on any `--model`, with the environment that model reads (its URL and key).
pub fn start_runner_on_model(
    store_url: &str,
    id: &str,
    workspace_root: &Path,
    model: (&str, &[(&str, &str)]),
    ttl_ms: u64,
    max_sessions: usize,
    extra: &[&str],
) -> RunnerProc {
    spawn_runner(
        Command::new(bin_path("runner")),
        store_url,
        id,
        workspace_root,
        model,
        ttl_ms,
        max_sessions,
        extra,
    )
}

/// [`start_runner_on_model`] inside the network namespace `netns` (`ip netns exec`, which
/// execs the runner itself: the pid is the runner's).
#[allow(clippy::too_many_arguments)]
pub fn start_runner_in_netns(
    netns: &str,
    store_url: &str,
    id: &str,
    workspace_root: &Path,
    model: (&str, &[(&str, &str)]),
    ttl_ms: u64,
    max_sessions: usize,
    extra: &[&str],
) -> RunnerProc {
    let mut command = Command::new("ip");
    command
        .args(["netns", "exec", netns])
        .arg(bin_path("runner"));
    spawn_runner(
        command,
        store_url,
        id,
        workspace_root,
        model,
        ttl_ms,
        max_sessions,
        extra,
    )
}

#[allow(clippy::too_many_arguments)]
fn spawn_runner(
    mut command: Command,
    store_url: &str,
    id: &str,
    workspace_root: &Path,
    (model, model_env): (&str, &[(&str, &str)]),
    ttl_ms: u64,
    max_sessions: usize,
    extra: &[&str],
) -> RunnerProc {
    let mut child = command
        .args([
            "--event-store",
            store_url,
            "--runner-id",
            id,
            "--model",
            model,
        ])
        .arg("--workspace-root")
        .arg(workspace_root)
        .args([
            "--lease-ttl-ms",
            &ttl_ms.to_string(),
            "--max-sessions",
            &max_sessions.to_string(),
        ])
        .args(extra)
        // These tests' scripts repeat a call on purpose (to count how often it runs): no
        // person is asked before the third identical one, unless a test says otherwise
        // (`--repeat-limit N` in `extra` wins; a runner of the last release ignores it).
        .env("AGENTLOG_REPEAT_LIMIT", "0")
        .envs(model_env.iter().copied())
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
        )
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn runner");
    let log = Arc::new(Mutex::new(Vec::new()));
    if let Some(stderr) = child.stderr.take() {
        let name = id.to_string();
        let log = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("[{name}] {line}");
                log.lock().unwrap_or_else(|p| p.into_inner()).push(line);
            }
        });
    }
    RunnerProc {
        child,
        id: id.to_string(),
        log,
    }
}

impl RunnerProc {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn signal(&self, sig: Signal) {
        signal(self.child.id(), sig);
    }

    /// The lines of its stderr log so far that contain `needle`.
    pub fn log_lines(&self, needle: &str) -> Vec<String> {
        let log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        log.iter().filter(|l| l.contains(needle)).cloned().collect()
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// SIGTERM, then the exit status and how long after the signal the process was gone
    /// (polled every 5 ms); panics if it is still running after `limit`.
    pub fn terminate_timed(&mut self, limit: Duration) -> (std::process::ExitStatus, Duration) {
        let sent = Instant::now();
        self.signal(Signal::SIGTERM);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return (status, sent.elapsed());
            }
            assert!(
                sent.elapsed() < limit,
                "runner {} still running {limit:?} after SIGTERM; its log ends: {:#?}",
                self.id,
                self.last_lines(8)
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The last `n` lines of its log.
    pub fn last_lines(&self, n: usize) -> Vec<String> {
        let log = self.log.lock().unwrap_or_else(|p| p.into_inner());
        log[log.len().saturating_sub(n)..].to_vec()
    }

    /// SIGTERM, then the exit status (within 30 s).
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        self.signal(Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "runner did not exit within 30 s of SIGTERM"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for RunnerProc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Appends a user turn; returns its seq.
pub async fn user_says(client: &mut EventStoreClient<Channel>, session: &str, text: &str) -> u64 {
    client
        .append(AppendRequest {
            session_id: session.into(),
            events: vec![Event {
                kind: Some(Kind::UserMessage(UserMessage { text: text.into() })),
                ..Event::default()
            }],
            ..AppendRequest::default()
        })
        .await
        .expect("append a user message")
        .into_inner()
        .last_seq
}

pub async fn history(client: &mut EventStoreClient<Channel>, session: &str) -> Vec<Event> {
    integration_tests::read_log(client, session).await
}

pub async fn status(client: &mut EventStoreClient<Channel>, session: &str) -> SessionStatus {
    client
        .get_session(GetSessionRequest {
            session_id: session.into(),
        })
        .await
        .map(|r| r.into_inner().status())
        .unwrap_or(SessionStatus::Unspecified)
}

/// Waits until the session is idle — its status says so and its log ends, past `after_seq`,
/// in a reply or a `run_error` (reads may trail an append that just happened); panics after
/// `limit`.
pub async fn wait_idle(
    client: &mut EventStoreClient<Channel>,
    session: &str,
    after_seq: u64,
    limit: Duration,
) -> Vec<Event> {
    let deadline = Instant::now() + limit;
    loop {
        if status(client, session).await == SessionStatus::Idle {
            let events = history(client, session).await;
            let last = events
                .iter()
                .rev()
                .find(|e| !matches!(e.kind, Some(Kind::AssistantDelta(_))));
            let answered = last.is_some_and(|e| {
                e.seq > after_seq
                    && matches!(e.kind, Some(Kind::AssistantMessage(_) | Kind::RunError(_)))
            });
            if answered {
                return events;
            }
        }
        assert!(
            Instant::now() < deadline,
            "session {session} not idle within {limit:?}: {:#?}",
            kinds(&history(client, session).await)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A compact view of a log, for assertions and failure messages.
pub fn kinds(events: &[Event]) -> Vec<String> {
    events
        .iter()
        .map(|e| match &e.kind {
            Some(Kind::UserMessage(_)) => "user".to_string(),
            Some(Kind::AssistantMessage(m)) => format!("reply({})", m.stop_reason),
            Some(Kind::ToolStarted(s)) => format!("started({}#{})", s.tool_use_id, s.attempt),
            Some(Kind::ToolResult(r)) => match &r.served_from {
                Some(from) => format!("result({}, served from {})", r.tool_use_id, from.seq),
                None => format!("result({})", r.tool_use_id),
            },
            Some(Kind::AssistantDelta(_)) => "delta".to_string(),
            Some(Kind::SessionConfig(c)) => format!("session_config({})", c.model),
            Some(Kind::RunError(r)) => format!("run_error({})", r.message),
            Some(Kind::Interrupt(_)) => "interrupt".to_string(),
            Some(Kind::Interrupted(_)) => "interrupted".to_string(),
            Some(Kind::ApprovalRequested(r)) => format!("approval_requested({})", r.tool_use_id),
            Some(Kind::ApprovalDecision(d)) => {
                format!("approval_decision({},{})", d.tool_use_id, d.approved)
            }
            Some(Kind::ModelRetry(r)) => format!("model_retry({},{})", r.model, r.reason),
            Some(Kind::RunPaused(p)) => format!("run_paused({})", p.reason),
            None => "unknown".to_string(),
        })
        .filter(|k| k != "delta")
        .collect()
}

/// The tool_use ids of every logged reply, in order.
pub fn tool_use_ids(events: &[Event]) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| match &e.kind {
            Some(Kind::AssistantMessage(m)) => {
                Some(m.content.iter().filter_map(|b| match &b.block {
                    Some(Block::ToolUse(t)) => Some(t.id.clone()),
                    _ => None,
                }))
            }
            _ => None,
        })
        .flatten()
        .collect()
}

/// The exactly-once invariants of a finished session's log: every tool_use has exactly one
/// result, no tool_started follows its result, results come after their reply, and the
/// session ends in a final reply. Returns the number of tool_started per call.
pub fn assert_exactly_once(events: &[Event]) -> HashMap<String, usize> {
    assert_exactly_once_ending(events, "end_turn")
}

/// [`assert_exactly_once`] for a provider whose final reply has `final_stop_reason`.
pub fn assert_exactly_once_ending(
    events: &[Event],
    final_stop_reason: &str,
) -> HashMap<String, usize> {
    let ids = tool_use_ids(events);
    let mut results: HashMap<String, usize> = HashMap::new();
    let mut starts: HashMap<String, usize> = HashMap::new();
    for event in events {
        match &event.kind {
            Some(Kind::ToolResult(r)) => *results.entry(r.tool_use_id.clone()).or_default() += 1,
            Some(Kind::ToolStarted(s)) => {
                assert!(
                    !results.contains_key(&s.tool_use_id),
                    "{} started after its result: {:?}",
                    s.tool_use_id,
                    kinds(events)
                );
                *starts.entry(s.tool_use_id.clone()).or_default() += 1;
            }
            _ => {}
        }
    }
    for id in &ids {
        assert_eq!(
            results.get(id),
            Some(&1),
            "{id} needs exactly one result: {:?}",
            kinds(events)
        );
    }
    assert_eq!(
        results.len(),
        ids.len(),
        "results only for logged calls: {:?}",
        kinds(events)
    );
    let last = events
        .iter()
        .rev()
        .find(|e| !matches!(e.kind, Some(Kind::AssistantDelta(_))));
    assert!(
        matches!(&last.and_then(|e| e.kind.as_ref()), Some(Kind::AssistantMessage(m)) if m.stop_reason == final_stop_reason),
        "the session finished with a final reply: {:?}",
        kinds(events)
    );
    starts
}

/// The logged replies' times, by turn (the n-th reply answers turn n).
pub fn reply_times(events: &[Event]) -> Vec<i64> {
    events
        .iter()
        .filter(|e| matches!(e.kind, Some(Kind::AssistantMessage(_))))
        .map(|e| e.ts_unix_ms)
        .collect()
}

/// Follows the session's log from `from_seq` and SIGKILLs `pid` `delay` after the first
/// event that matches. Returns whether it fired.
pub async fn kill_when(
    mut client: EventStoreClient<Channel>,
    session: String,
    from_seq: u64,
    pid: u32,
    matches: fn(&Event) -> bool,
    delay: Duration,
) -> bool {
    let Ok(response) = client
        .subscribe(SubscribeRequest {
            session_id: session,
            from_seq,
            follow: true,
        })
        .await
    else {
        return false;
    };
    let mut stream = response.into_inner();
    while let Some(Ok(event)) = stream.next().await {
        if matches(&event) {
            tokio::time::sleep(delay).await;
            signal(pid, Signal::SIGKILL);
            return true;
        }
    }
    false
}

/// Every key line the session's bash calls wrote to `keys.txt`, counted.
pub fn key_counts(workspace_root: &Path, session: &str) -> HashMap<String, usize> {
    let mut counts = HashMap::new();
    let text =
        std::fs::read_to_string(workspace_root.join(session).join("keys.txt")).unwrap_or_default();
    for line in text.lines() {
        *counts.entry(line.to_string()).or_default() += 1;
    }
    counts
}

/// What one `agentlog` command printed.
#[derive(Debug)]
pub struct CliOutput {
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

/// Runs the `agentlog` CLI against the store at `store_url`, as a user would.
pub fn agentlog(store_url: &str, args: &[&str]) -> CliOutput {
    let out = Command::new(bin_path("agentlog"))
        .args(["--addr", store_url])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run agentlog");
    CliOutput {
        success: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Polls the session's log until `done` holds; panics with the log after `limit`.
pub async fn wait_for_log(
    client: &mut EventStoreClient<Channel>,
    session: &str,
    limit: Duration,
    done: impl Fn(&[Event]) -> bool,
) -> Vec<Event> {
    let deadline = Instant::now() + limit;
    loop {
        let events = history(client, session).await;
        if done(&events) {
            return events;
        }
        assert!(
            Instant::now() < deadline,
            "session {session}: condition not met within {limit:?}: {:#?}",
            kinds(&events)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Whether the log has an event of this kind (by its [`kinds`] name prefix).
pub fn has(events: &[Event], kind: &str) -> bool {
    kinds(events).iter().any(|k| k.starts_with(kind))
}

/// The logged result of a call.
pub fn result_of(events: &[Event], tool_use_id: &str) -> Option<(String, bool)> {
    events.iter().find_map(|e| match &e.kind {
        Some(Kind::ToolResult(r)) if r.tool_use_id == tool_use_id => {
            Some((r.content.clone(), r.is_error))
        }
        _ => None,
    })
}

/// Waits until the store reports `want` for the session.
pub async fn wait_status(
    client: &mut EventStoreClient<Channel>,
    session: &str,
    want: SessionStatus,
    limit: Duration,
) {
    let deadline = Instant::now() + limit;
    while status(client, session).await != want {
        assert!(
            Instant::now() < deadline,
            "session {session} not {want:?} within {limit:?}: {:#?}",
            kinds(&history(client, session).await)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
