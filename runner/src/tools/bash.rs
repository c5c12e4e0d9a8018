//! The `bash` tool: `bash -c COMMAND` in the workspace, in its own process group, with a
//! minimal environment (no secret of the runner leaks into it) and a timeout after which
//! the whole group is killed.

use std::process::Stdio;
use std::time::Duration;

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;
use serde::Deserialize;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio::process::Command;

use super::{ToolOutput, Workspace, OUTPUT_CAP};

const DEFAULT_TIMEOUT_MS: u64 = 120_000;
pub(super) const MAX_TIMEOUT_MS: u64 = 600_000;
/// How long output is still collected after the command exits, for background processes
/// that keep its pipes open.
const DRAIN_GRACE: Duration = Duration::from_millis(500);
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

#[derive(Deserialize)]
pub(super) struct BashInput {
    command: String,
    #[serde(default)]
    timeout_ms: Option<u64>,
}

pub(super) async fn run(ws: &Workspace, input: BashInput, idempotency_key: &str) -> ToolOutput {
    let timeout_ms = input
        .timeout_ms
        .unwrap_or(DEFAULT_TIMEOUT_MS)
        .clamp(1, MAX_TIMEOUT_MS);
    let path = std::env::var("PATH").unwrap_or_else(|_| DEFAULT_PATH.to_string());
    let mut child = match Command::new("bash")
        .arg("-c")
        .arg(&input.command)
        .current_dir(ws.dir())
        .env_clear()
        .env("PATH", path)
        .env("HOME", ws.dir())
        .env("IDEMPOTENCY_KEY", idempotency_key)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true)
        .spawn()
    {
        Ok(child) => child,
        Err(e) => return ToolOutput::error(format!("cannot start bash: {e}")),
    };
    // The group id is the child's pid (process_group(0)). If this future is dropped (the
    // lease was lost, the runner is stopping) the guard kills the whole group.
    let group = child
        .id()
        .and_then(|pid| i32::try_from(pid).ok())
        .map(|pid| GroupKill(Pid::from_raw(pid)));
    let stdout = child
        .stdout
        .take()
        .map(|out| tokio::spawn(read_capped(out)));
    let stderr = child
        .stderr
        .take()
        .map(|err| tokio::spawn(read_capped(err)));

    let (status, timed_out) =
        match tokio::time::timeout(Duration::from_millis(timeout_ms), child.wait()).await {
            Ok(status) => (status, false),
            Err(_) => {
                if let Some(group) = &group {
                    group.kill();
                }
                (child.wait().await, true)
            }
        };
    if let Some(mut group) = group {
        group.disarm();
    }
    let stdout = drain(stdout).await;
    let stderr = drain(stderr).await;

    let mut report = match (&status, timed_out) {
        (_, true) => {
            format!("timed out after {timeout_ms} ms; the command's process group was killed\n")
        }
        (Ok(status), false) => match status.code() {
            Some(code) => format!("exit code: {code}\n"),
            None => format!("terminated by a signal ({status})\n"),
        },
        (Err(e), false) => format!("lost track of the command: {e}\n"),
    };
    for (name, (text, total)) in [("stdout", stdout), ("stderr", stderr)] {
        if total == 0 {
            continue;
        }
        report.push_str(&format!("--- {name} ---\n{text}"));
        if !text.ends_with('\n') {
            report.push('\n');
        }
        if total > text.len() {
            report.push_str(&format!("[{name} cut: {total} bytes in all]\n"));
        }
    }
    let succeeded = !timed_out && matches!(&status, Ok(s) if s.success());
    if succeeded {
        ToolOutput::ok(report)
    } else {
        ToolOutput::error(report)
    }
}

/// Kills a process group when dropped, unless disarmed.
struct GroupKill(Pid);

impl GroupKill {
    fn kill(&self) {
        // ESRCH (the group is already gone) is the outcome we want anyway.
        let _ = killpg(self.0, Signal::SIGKILL);
    }

    fn disarm(&mut self) {
        self.0 = Pid::from_raw(0);
    }
}

impl Drop for GroupKill {
    fn drop(&mut self) {
        if self.0.as_raw() > 0 {
            self.kill();
        }
    }
}

/// Reads a pipe to its end, keeping the first [`OUTPUT_CAP`] bytes (it must be drained, or
/// a chatty command would block on a full pipe). Returns the kept text and the byte count.
async fn read_capped(mut pipe: impl AsyncRead + Unpin) -> (String, usize) {
    let mut kept = Vec::new();
    let mut total = 0;
    let mut buf = [0u8; 8192];
    while let Ok(n) = pipe.read(&mut buf).await {
        if n == 0 {
            break;
        }
        total += n;
        let room = OUTPUT_CAP.saturating_sub(kept.len());
        kept.extend_from_slice(&buf[..n.min(room)]);
    }
    (String::from_utf8_lossy(&kept).into_owned(), total)
}

async fn drain(reader: Option<tokio::task::JoinHandle<(String, usize)>>) -> (String, usize) {
    let Some(mut reader) = reader else {
        return (String::new(), 0);
    };
    match tokio::time::timeout(DRAIN_GRACE, &mut reader).await {
        Ok(Ok(output)) => output,
        _ => {
            reader.abort();
            (String::new(), 0)
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use serde_json::{json, Value};

    use crate::tools::Toolbox;

    use super::*;

    async fn bash(root: &std::path::Path, input: Value) -> ToolOutput {
        let Value::Object(input) = input else {
            return ToolOutput::error("test input is not an object");
        };
        Toolbox::new(root.to_path_buf())
            .run("s1", "bash", input, "s1/toolu_1")
            .await
    }

    #[tokio::test]
    async fn runs_in_the_workspace_with_the_key_and_a_clean_env() {
        let root = tempfile::tempdir().expect("temp dir");
        std::env::set_var("RUNNER_TEST_SECRET", "hunter2");
        let out = bash(
            root.path(),
            json!({"command": "pwd; echo \"key=$IDEMPOTENCY_KEY home=$HOME secret=$RUNNER_TEST_SECRET\"; echo oops >&2; echo $IDEMPOTENCY_KEY >> log"}),
        )
        .await;
        assert!(!out.is_error, "{out:?}");
        let ws = root.path().join("s1").canonicalize().expect("workspace");
        assert!(
            out.content.starts_with("exit code: 0\n--- stdout ---\n"),
            "{}",
            out.content
        );
        assert!(out.content.contains(&format!("{}\n", ws.display())));
        assert!(out
            .content
            .contains(&format!("key=s1/toolu_1 home={} secret=\n", ws.display())));
        assert!(out.content.contains("--- stderr ---\noops\n"));
        assert_eq!(
            std::fs::read_to_string(ws.join("log")).ok().as_deref(),
            Some("s1/toolu_1\n")
        );
    }

    #[tokio::test]
    async fn failures_are_error_results_with_the_exit_code() {
        let root = tempfile::tempdir().expect("temp dir");
        let out = bash(root.path(), json!({"command": "echo half; exit 3"})).await;
        assert!(out.is_error);
        assert!(out
            .content
            .starts_with("exit code: 3\n--- stdout ---\nhalf\n"));
    }

    #[tokio::test]
    async fn a_timeout_kills_the_whole_process_group() {
        let root = tempfile::tempdir().expect("temp dir");
        let started = Instant::now();
        // The background sleeper would outlive a kill of bash alone and write the file.
        let out = bash(
            root.path(),
            json!({"command": "(sleep 1; touch survived) & sleep 30", "timeout_ms": 200}),
        )
        .await;
        assert!(out.is_error);
        assert!(
            out.content.starts_with("timed out after 200 ms"),
            "{}",
            out.content
        );
        assert!(started.elapsed() < Duration::from_secs(10));
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(!root.path().join("s1/survived").exists());
    }

    #[tokio::test]
    async fn dropping_the_call_kills_the_process_group() {
        let root = tempfile::tempdir().expect("temp dir");
        let call = bash(root.path(), json!({"command": "sleep 1; touch survived"}));
        assert!(tokio::time::timeout(Duration::from_millis(200), call)
            .await
            .is_err());
        tokio::time::sleep(Duration::from_millis(1500)).await;
        assert!(!root.path().join("s1/survived").exists());
    }

    #[tokio::test]
    async fn big_output_is_capped_and_marked() {
        let root = tempfile::tempdir().expect("temp dir");
        let out = bash(
            root.path(),
            json!({"command": "head -c 200000 /dev/zero | tr '\\0' x"}),
        )
        .await;
        assert!(!out.is_error);
        assert!(out.content.len() <= OUTPUT_CAP + 200);
        assert!(
            out.content.contains("cut"),
            "{}",
            &out.content[out.content.len() - 200..]
        );
    }
}
