//! Shared by the sandbox tests: a real `runner` with a scripted model, started as root (its
//! tools then run as `nobody`) or as an unprivileged user (its tools run as that user), and
//! the tool results of a session.
#![allow(dead_code)] // each test file uses its own subset

use std::io::{BufRead, BufReader};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentlog_proto::v1::event::Kind;
use agentlog_proto::v1::event_store_client::EventStoreClient;
use integration_tests::{bin_path, bin_path_for_any_user};
use serde_json::Value;
use tonic::transport::Channel;

#[path = "../runner_support/mod.rs"]
mod runner_support;
pub use runner_support::{user_says, wait_idle};

/// The unprivileged user the tests start a runner as, and the default tool user of a root
/// runner.
pub const NOBODY: u32 = 65534;

/// Who the runner process is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunAs {
    /// This test's user: root in CI, whose tools run as `nobody`.
    Me,
    /// `nobody`, when this test is root (else this test's user): tools run as the runner's
    /// own user, so only the sandbox keeps sessions apart.
    Unprivileged,
}

pub fn is_root() -> bool {
    // /proc/self belongs to this process's effective user.
    std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0)
}

/// A `runner` with a scripted model; SIGKILLed when dropped.
pub struct SandboxRunner {
    child: Child,
    log: Arc<Mutex<String>>,
    pub workspaces: PathBuf,
    _dir: tempfile::TempDir,
}

/// Options beyond the store and the script.
#[derive(Default)]
pub struct Options<'a> {
    pub args: &'a [&'a str],
    pub env: &'a [(&'a str, &'a str)],
}

/// Writes `replies` as the script (one reply per assistant turn of each session) and starts
/// a runner on it.
pub fn start(store_url: &str, replies: &[Value], run_as: RunAs, options: Options) -> SandboxRunner {
    let dir = tempfile::tempdir().expect("temp dir");
    // Reachable by an unprivileged runner and its tools.
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let script = dir.path().join("script.jsonl");
    let lines: Vec<String> = replies.iter().map(Value::to_string).collect();
    std::fs::write(&script, lines.join("\n")).expect("write script");
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let workspaces = dir.path().join("workspaces");
    std::fs::create_dir(&workspaces).expect("mkdir");
    if run_as == RunAs::Unprivileged && is_root() {
        std::os::unix::fs::chown(&workspaces, Some(NOBODY), Some(NOBODY)).expect("chown");
    }
    let binary = if run_as == RunAs::Unprivileged && is_root() {
        bin_path_for_any_user("runner")
    } else {
        bin_path("runner")
    };
    let mut cmd = Command::new(binary);
    cmd.args(["--event-store", store_url, "--runner-id", "sandbox-runner"])
        .arg("--workspace-root")
        .arg(&workspaces)
        .arg("--model")
        .arg(format!("scripted:{}", script.display()))
        .args(["--lease-ttl-ms", "5000"])
        .args(options.args)
        .env("ANTHROPIC_API_KEY", "sk-sandbox-SECRET-model-key")
        .env("RUST_LOG", "info")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (name, value) in options.env {
        cmd.env(name, value);
    }
    if run_as == RunAs::Unprivileged && is_root() {
        cmd.uid(NOBODY).gid(NOBODY);
    }
    let mut child = cmd.spawn().expect("spawn runner");
    let log = Arc::new(Mutex::new(String::new()));
    if let Some(stderr) = child.stderr.take() {
        let log = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("[runner] {line}");
                let mut log = log.lock().unwrap_or_else(|p| p.into_inner());
                log.push_str(&line);
                log.push('\n');
            }
        });
    }
    SandboxRunner {
        child,
        log,
        workspaces,
        _dir: dir,
    }
}

impl SandboxRunner {
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    /// The runner's stderr so far, without colours.
    pub fn log(&self) -> String {
        strip_ansi(&self.log.lock().unwrap_or_else(|p| p.into_inner()))
    }

    /// Waits (up to 30 s) for the runner to exit by itself; its exit status.
    pub fn wait_exit(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                // Let the log thread read the last lines.
                std::thread::sleep(Duration::from_millis(200));
                return status;
            }
            assert!(Instant::now() < deadline, "the runner did not exit");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The workspace of `session`.
    pub fn workspace(&self, session: &str) -> PathBuf {
        self.workspaces.join(session)
    }

    /// Creates `session`'s workspace ahead of its first call, with `file` in it, as the
    /// runner would (owned by the tool user).
    pub fn plant(&self, session: &str, file: &str, content: &str) {
        let ws = self.workspace(session);
        std::fs::create_dir_all(&ws).expect("mkdir");
        std::fs::write(ws.join(file), content).expect("write");
        if is_root() {
            for path in [ws.clone(), ws.join(file)] {
                std::os::unix::fs::chown(&path, Some(NOBODY), Some(NOBODY)).expect("chown");
            }
        }
    }
}

impl Drop for SandboxRunner {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// One `tool_result`: its content and whether it is an error.
#[derive(Debug, Clone)]
pub struct ToolResult {
    pub content: String,
    pub is_error: bool,
}

/// Appends a user turn to `session`, waits until the session is idle, and returns its tool
/// results in log order.
pub async fn run_session(client: &mut EventStoreClient<Channel>, session: &str) -> Vec<ToolResult> {
    let seq = user_says(client, session, "go").await;
    let events = wait_idle(client, session, seq, Duration::from_secs(90)).await;
    events
        .iter()
        .filter_map(|e| match &e.kind {
            Some(Kind::ToolResult(r)) => Some(ToolResult {
                content: r.content.clone(),
                is_error: r.is_error,
            }),
            _ => None,
        })
        .collect()
}

/// One scripted reply that calls `bash` with `command`.
pub fn bash(command: &str) -> Value {
    serde_json::json!({"text": "Running it.", "tool_uses": [{"name": "bash", "input": {"command": command}}]})
}

/// The final scripted reply.
pub fn done() -> Value {
    serde_json::json!({"text": "Done."})
}

/// Every live process whose command line contains `needle`.
pub fn processes_with(needle: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains(needle) {
            found.push(format!(
                "{}: {cmdline}",
                entry.file_name().to_string_lossy()
            ));
        }
    }
    found
}

/// Waits until `path` exists (up to 30 s).
pub fn wait_for_file(path: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
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
