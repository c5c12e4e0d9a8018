//! The `bash` tool through the real sandbox helper (this package's `runner` binary): output,
//! exit codes, the environment, the cap, and that a timeout, a stopped or a dropped call
//! leaves no process of the call behind — `setsid` and double-forked ones included (a
//! stopped call not even for a moment after it returns).

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use runner::tools::{Stopped, ToolOutput, OUTPUT_CAP};
use serde_json::{json, Value};
use tokio_util::sync::CancellationToken;

async fn bash(root: &Path, input: Value) -> ToolOutput {
    bash_until(root, input, &CancellationToken::new())
        .await
        .expect("nothing stops the call")
}

async fn bash_until(
    root: &Path,
    input: Value,
    stop: &CancellationToken,
) -> Result<ToolOutput, Stopped> {
    let Value::Object(input) = input else {
        return Ok(ToolOutput {
            content: "test input is not an object".into(),
            is_error: true,
        });
    };
    common::toolbox(root)
        .await
        .run("s1", "bash", input, "s1/toolu_1", stop)
        .await
}

#[tokio::test]
async fn runs_in_the_workspace_with_the_key_and_a_clean_env() {
    let root = tempfile::tempdir().expect("temp dir");
    std::env::set_var("RUNNER_TEST_SECRET", "hunter2");
    let out = bash(
        root.path(),
        json!({"command": "pwd; echo \"key=$IDEMPOTENCY_KEY home=$HOME tmp=$TMPDIR secret=$RUNNER_TEST_SECRET\"; echo oops >&2; echo $IDEMPOTENCY_KEY >> log"}),
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
    assert!(out.content.contains(&format!(
        "key=s1/toolu_1 home={0} tmp={0}/.tmp secret=\n",
        ws.display()
    )));
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
    let out = bash(root.path(), json!({"command": "kill -9 $$"})).await;
    assert!(
        out.is_error && out.content.starts_with("terminated by a signal"),
        "{out:?}"
    );
}

/// Writes `survived` in the workspace a second after the call unless it was killed: from a
/// background job, a `setsid` process and a double fork.
const SURVIVORS: &str = "(sleep 1; touch survived-bg) & \
     setsid bash -c 'sleep 1; touch survived-setsid' & \
     (bash -c 'sleep 1; touch survived-double' &) ; ";

fn survivors(root: &Path) -> Vec<String> {
    std::fs::read_dir(root.join("s1"))
        .map(|dir| {
            dir.flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|name| name.starts_with("survived"))
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test]
async fn a_finished_call_leaves_no_process_behind() {
    let root = tempfile::tempdir().expect("temp dir");
    let out = bash(
        root.path(),
        json!({"command": format!("{SURVIVORS} echo left")}),
    )
    .await;
    assert!(!out.is_error, "{out:?}");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(survivors(root.path()), Vec::<String>::new());
}

#[tokio::test]
async fn a_timeout_kills_every_process_of_the_call() {
    let root = tempfile::tempdir().expect("temp dir");
    let started = Instant::now();
    let out = bash(
        root.path(),
        json!({"command": format!("{SURVIVORS} sleep 30"), "timeout_ms": 300}),
    )
    .await;
    assert!(out.is_error);
    assert!(
        out.content.starts_with("timed out after 300 ms"),
        "{}",
        out.content
    );
    assert!(started.elapsed() < Duration::from_secs(10));
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(survivors(root.path()), Vec::<String>::new());
}

#[tokio::test]
async fn dropping_the_call_kills_every_process_of_the_call() {
    let root = tempfile::tempdir().expect("temp dir");
    let call = bash(
        root.path(),
        json!({"command": format!("{SURVIVORS} sleep 1; touch survived")}),
    );
    assert!(tokio::time::timeout(Duration::from_millis(300), call)
        .await
        .is_err());
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(survivors(root.path()), Vec::<String>::new());
}

/// A stopped call returns once the helper has killed and reaped the whole tree: the
/// processes that would write `ticked` every 20 ms are gone by then, not a moment later.
#[tokio::test]
async fn a_stopped_call_returns_after_every_process_of_the_call_is_gone() {
    let root = tempfile::tempdir().expect("temp dir");
    let stop = CancellationToken::new();
    let stopper = stop.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(500)).await;
        stopper.cancel();
    });
    let ticker = "while true; do date +%s%N >> ticked; sleep 0.02; done";
    let command = format!("{SURVIVORS} (setsid bash -c '{ticker}' &); {ticker}");
    let started = Instant::now();
    let out = bash_until(root.path(), json!({"command": command}), &stop).await;
    assert_eq!(out, Err(Stopped));
    assert!(started.elapsed() < Duration::from_secs(5));
    let ticks = |root: &Path| std::fs::read_to_string(root.join("s1/ticked")).unwrap_or_default();
    let at_return = ticks(root.path());
    assert!(!at_return.is_empty(), "the call ran before it was stopped");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(ticks(root.path()), at_return, "nothing of the call ran on");
    tokio::time::sleep(Duration::from_millis(1200)).await;
    assert_eq!(survivors(root.path()), Vec::<String>::new());
}

#[tokio::test]
async fn big_output_is_capped_and_marked() {
    let root = tempfile::tempdir().expect("temp dir");
    let out = bash(
        root.path(),
        json!({"command": "head -c 200000 /dev/zero | tr '\\0' x"}),
    )
    .await;
    assert!(!out.is_error, "{out:?}");
    assert!(out.content.len() <= OUTPUT_CAP + 200);
    assert!(
        out.content.contains("cut"),
        "{}",
        &out.content[out.content.len() - 200..]
    );
}
