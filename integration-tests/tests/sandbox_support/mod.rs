//! Shared by the sandbox tests: a real `runner` with a scripted model, started as root (its
//! tools then run as `nobody`) or as an unprivileged user (its tools run as that user), or in
//! one of the node configurations of `sandbox_escapes` ([`Config`]: as a pod gets it, through
//! `setpriv`, with Landlock capped or refused), and the tool results of a session.
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

/// How a node runs the runner, for [`start_config`].
#[derive(Debug, Clone)]
pub struct Config {
    /// Run as this uid (and gid) through `setpriv --reuid … --regid … --clear-groups
    /// --inh-caps=-all --bounding-set=-all --no-new-privs`, as a non-root pod with every
    /// capability dropped gets it; `None`: as this test's user (root in CI).
    pub uid: Option<u32>,
    /// `AGENTLOG_SANDBOX_MAX_ABI`.
    pub max_abi: Option<u32>,
    /// Start the runner under a seccomp filter that fails the landlock_* system calls with
    /// EPERM, as a container runtime's profile that lacks them does.
    pub landlock_eperm: bool,
    /// Flags beyond the store and the script.
    pub args: Vec<String>,
    /// Environment beyond the model key.
    pub env: Vec<(String, String)>,
    /// The owner of the workspace root (the tool user, or the runner's uid).
    pub workspace_owner: Option<u32>,
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

/// Starts a runner on `replies` (one reply per assistant turn of each session) as `config`
/// says.
pub fn start_config(store_url: &str, replies: &[Value], config: &Config) -> SandboxRunner {
    let dir = tempfile::tempdir().expect("temp dir");
    std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let script = dir.path().join("script.jsonl");
    let lines: Vec<String> = replies.iter().map(Value::to_string).collect();
    std::fs::write(&script, lines.join("\n")).expect("write script");
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    let workspaces = dir.path().join("workspaces");
    std::fs::create_dir(&workspaces).expect("mkdir");
    if let Some(owner) = config.workspace_owner.or(config.uid) {
        std::os::unix::fs::chown(&workspaces, Some(owner), Some(owner)).expect("chown");
    }
    let runner = bin_path_for_any_user("runner");
    let mut program: Vec<std::ffi::OsString> = Vec::new();
    if let Some(uid) = config.uid {
        let uid = uid.to_string();
        program.extend(
            [
                "setpriv",
                "--reuid",
                &uid,
                "--regid",
                &uid,
                "--clear-groups",
                "--inh-caps=-all",
                "--bounding-set=-all",
                "--no-new-privs",
            ]
            .map(Into::into),
        );
    }
    if config.landlock_eperm {
        program.push(landlock_eperm_wrapper(dir.path()).into());
    }
    program.push(runner.into());
    let mut cmd = Command::new(&program[0]);
    cmd.args(&program[1..])
        .args(["--event-store", store_url, "--runner-id", "sandbox-runner"])
        .arg("--workspace-root")
        .arg(&workspaces)
        .arg("--model")
        .arg(format!("scripted:{}", script.display()))
        .args(["--lease-ttl-ms", "5000", "--max-sessions", "12"])
        .args(&config.args)
        .env("ANTHROPIC_API_KEY", MODEL_KEY)
        .env("RUST_LOG", "info")
        .env("NO_COLOR", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if let Some(max) = config.max_abi {
        cmd.env("AGENTLOG_SANDBOX_MAX_ABI", max.to_string());
    }
    for (name, value) in &config.env {
        cmd.env(name, value);
    }
    spawn(cmd, workspaces, dir)
}

/// The model key every test runner gets in its environment (the scripted model ignores it;
/// the runner reads and scrubs it all the same).
pub const MODEL_KEY: &str = "sk-sandbox-SECRET-model-key";

/// Compiles (with the system's C compiler) the program that runs its arguments under a
/// seccomp filter failing landlock_create_ruleset, landlock_add_rule and
/// landlock_restrict_self with EPERM.
fn landlock_eperm_wrapper(dir: &Path) -> PathBuf {
    const SOURCE: &str = r#"
#include <errno.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

int main(int argc, char **argv) {
    struct sock_filter code[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_landlock_create_ruleset, 2, 0),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_landlock_add_rule, 1, 0),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_landlock_restrict_self, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | EPERM),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {sizeof code / sizeof code[0], code};
    if (argc < 2) { fprintf(stderr, "usage: %s PROGRAM [ARG...]\n", argv[0]); return 2; }
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) || prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog)) {
        perror("seccomp");
        return 2;
    }
    execvp(argv[1], argv + 1);
    perror(argv[1]);
    return 127;
}
"#;
    let source = dir.join("landlock-eperm.c");
    let binary = dir.join("landlock-eperm");
    std::fs::write(&source, SOURCE).expect("write the wrapper's source");
    let status = Command::new("gcc")
        .arg("-o")
        .arg(&binary)
        .arg(&source)
        .status()
        .expect("gcc runs");
    assert!(status.success(), "the wrapper compiles");
    std::fs::set_permissions(&binary, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    binary
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
    spawn(cmd, workspaces, dir)
}

fn spawn(mut cmd: Command, workspaces: PathBuf, dir: tempfile::TempDir) -> SandboxRunner {
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
    /// runner would (owned by the tool user, `nobody` for [`start`]).
    pub fn plant(&self, session: &str, file: &str, content: &str) {
        self.plant_as(NOBODY, session, file, content);
    }

    /// [`SandboxRunner::plant`], owned by `owner`.
    pub fn plant_as(&self, owner: u32, session: &str, file: &str, content: &str) {
        let ws = self.workspace(session);
        std::fs::create_dir_all(&ws).expect("mkdir");
        std::fs::write(ws.join(file), content).expect("write");
        if is_root() {
            for path in [ws.clone(), ws.join(file)] {
                std::os::unix::fs::chown(&path, Some(owner), Some(owner)).expect("chown");
            }
        }
    }

    /// Waits (up to 60 s) until the runner has logged a line containing `needle`.
    pub fn wait_for_log(&mut self, needle: &str) {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !self.log().contains(needle) {
            assert!(
                self.is_running(),
                "the runner exited before logging {needle:?}:\n{}",
                self.log()
            );
            assert!(
                Instant::now() < deadline,
                "no {needle:?} in:\n{}",
                self.log()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The start-up table: the lines starting with `sandbox: `.
    pub fn table(&self) -> String {
        self.log()
            .lines()
            .filter(|line| line.starts_with("sandbox: "))
            .map(|line| format!("{line}\n"))
            .collect()
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

/// Waits until `path` holds a whole line (up to 30 s) and returns its text. A shell's
/// `echo x > file` creates the file before it writes, so existing is not enough.
pub fn wait_for_file(path: &Path) -> String {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            if text.ends_with('\n') {
                return text;
            }
        }
        assert!(
            Instant::now() < deadline,
            "{} never got a whole line",
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
