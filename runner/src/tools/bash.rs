//! The `bash` tool: `bash -c COMMAND` in the workspace, under the tool sandbox's helper
//! (see `tools::sandbox`), with a minimal environment (no secret of the runner leaks into
//! it: `PATH`, `HOME` = the workspace, a private `TMPDIR` inside it, `IDEMPOTENCY_KEY`) and
//! a timeout. When the call ends, times out, is stopped or its future is dropped, the
//! helper kills and reaps everything the command started; a stopped call returns only once
//! the helper has done so (or [`STOP_WAIT`] has passed).

use std::process::Stdio;
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;
use serde::Deserialize;
use tokio::io::{AsyncRead, AsyncReadExt};
use tokio_util::sync::CancellationToken;

use super::sandbox::Sandbox;
use super::{Stopped, ToolOutput, Workspace, OUTPUT_CAP};

const DEFAULT_TIMEOUT_MS: u64 = 120_000;
pub(super) const MAX_TIMEOUT_MS: u64 = 600_000;
/// How long output is still collected after the command exits, for background processes
/// that keep its pipes open.
const DRAIN_GRACE: Duration = Duration::from_millis(500);
/// How long a stopped call waits for the helper to have killed and reaped the command's
/// processes (SIGKILL takes effect at once; only a process stuck in the kernel takes longer).
const STOP_WAIT: Duration = Duration::from_secs(1);
const DEFAULT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

#[derive(Deserialize)]
pub(super) struct BashInput {
    command: String,
    #[serde(default)]
    timeout_ms: Option<u64>,
}

pub(super) async fn run(
    ws: &Workspace,
    sandbox: &Sandbox,
    input: BashInput,
    idempotency_key: &str,
    stop: &CancellationToken,
) -> Result<ToolOutput, Stopped> {
    let timeout_ms = input
        .timeout_ms
        .unwrap_or(DEFAULT_TIMEOUT_MS)
        .clamp(1, MAX_TIMEOUT_MS);
    let path = std::env::var("PATH").unwrap_or_else(|_| DEFAULT_PATH.to_string());
    // CPU time is wall time at most, per process: the rlimit backs up the timeout.
    let cpu_secs = timeout_ms.div_ceil(1000) + 1;
    let mut child = match sandbox
        .command(ws.dir(), cpu_secs, input.command)
        .env_clear()
        .env("PATH", path)
        .env("HOME", ws.dir())
        .env("TMPDIR", ws.tmp_dir())
        .env("IDEMPOTENCY_KEY", idempotency_key)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
    {
        Ok(child) => child,
        Err(e) => {
            return Ok(ToolOutput::error(format!(
                "cannot start the tool sandbox: {e}"
            )))
        }
    };
    // If this future is dropped (an interrupt, the lease was lost, the runner is stopping)
    // the guard tells the helper to stop, and it kills the whole call; tokio reaps it.
    let helper = child
        .id()
        .and_then(|pid| i32::try_from(pid).ok())
        .map(|pid| StopHelper(Pid::from_raw(pid)));
    let stdout = child
        .stdout
        .take()
        .map(|out| tokio::spawn(read_capped(out)));
    let stderr = child
        .stderr
        .take()
        .map(|err| tokio::spawn(read_capped(err)));

    let waited = tokio::select! {
        waited = tokio::time::timeout(Duration::from_millis(timeout_ms), child.wait()) => waited,
        _ = stop.cancelled() => {
            if let Some(helper) = &helper {
                helper.stop();
            }
            // The helper exits once every process of the call is killed and reaped.
            if tokio::time::timeout(STOP_WAIT, child.wait()).await.is_err() {
                tracing::warn!("the sandbox helper did not finish killing the call within {STOP_WAIT:?}");
            }
            return Err(Stopped);
        }
    };
    let (status, timed_out) = match waited {
        Ok(status) => (status, false),
        Err(_) => {
            if let Some(helper) = &helper {
                helper.stop();
            }
            (child.wait().await, true)
        }
    };
    if let Some(mut helper) = helper {
        helper.disarm();
    }
    let stdout = drain(stdout).await;
    let stderr = drain(stderr).await;

    let mut report = match (&status, timed_out) {
        (_, true) => format!(
            "timed out after {timeout_ms} ms; the command and every process it started were killed\n"
        ),
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
    Ok(if succeeded {
        ToolOutput::ok(report)
    } else {
        ToolOutput::error(report)
    })
}

/// Tells the helper to stop (it kills and reaps every process of the call, then exits)
/// when dropped, unless disarmed.
struct StopHelper(Pid);

impl StopHelper {
    fn stop(&self) {
        // ESRCH (the helper is already gone) is the outcome we want anyway.
        let _ = kill(self.0, Signal::SIGTERM);
    }

    fn disarm(&mut self) {
        self.0 = Pid::from_raw(0);
    }
}

impl Drop for StopHelper {
    fn drop(&mut self) {
        if self.0.as_raw() > 0 {
            self.stop();
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
