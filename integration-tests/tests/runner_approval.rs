//! Approvals and unknown outcomes against the real event store, runner and CLI (the
//! Anthropic stand-in plays the model): `runner --approve bash` makes each bash call wait
//! for `agentlog approve`/`deny` with no runner holding the session, across a restart of
//! both services; a yes runs the call exactly once, a no never runs it and tells the model
//! why; the store refuses a decision for a call that is not waiting; and
//! `--on-unknown-outcome` decides what happens to a call whose runner died mid-call.

mod runner_support;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use agentlog_proto::v1::{event::Kind, GetSessionRequest, SessionStatus};
use integration_tests::anthropic_standin::{AnthropicStandin, StandinReply};
use integration_tests::{bin_path, grpcurl, Store};
use runner_support::*;
use serde_json::json;

const TTL_MS: u64 = 1500;

fn key_script() -> Vec<StandinReply> {
    vec![
        StandinReply::text("Recording the key.").tool(
            "bash",
            json!({"command": "echo \"$IDEMPOTENCY_KEY\" >> keys.txt; echo recorded"}),
        ),
        StandinReply::text("Done."),
    ]
}

fn approving_runner(store: &Store, id: &str, root: &Path, model_url: &str) -> RunnerProc {
    start_runner_with(
        &store.url(),
        id,
        root,
        model_url,
        TTL_MS,
        2,
        &["--approve", "bash"],
    )
}

/// `agentlog send`, which must come back by itself once the session waits for a person.
fn send_until_it_stops(store: &Store, session: &str, text: &str) -> CliOutput {
    let mut child = Command::new(bin_path("agentlog"))
        .args(["--addr", &store.url(), "send", "--session", session, text])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run agentlog send");
    let deadline = Instant::now() + Duration::from_secs(30);
    while matches!(child.try_wait(), Ok(None)) {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("agentlog send kept waiting on a session that waits for a person");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = child.wait_with_output().expect("send's output");
    CliOutput {
        success: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// Sends the first turn and checks the session parks, waiting for a person, with no lease.
async fn park_for_approval(store: &Store, session: &str) {
    let sent = send_until_it_stops(store, session, "record the key");
    assert!(sent.success, "{}", sent.stderr);
    assert!(
        sent.stdout.contains("agentlog approve") && sent.stderr.contains("waiting for approval"),
        "send shows the request and how to answer it: {sent:?}"
    );
    let mut client = store.client().await.expect("client");
    wait_status(
        &mut client,
        session,
        SessionStatus::Waiting,
        Duration::from_secs(10),
    )
    .await;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let info = client
            .get_session(GetSessionRequest {
                session_id: session.into(),
            })
            .await
            .expect("GetSession")
            .into_inner();
        if info.lease.is_none() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "a waiting session holds no lease: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let waiting = agentlog(&store.url(), &["ls", "--status", "waiting"]);
    assert!(waiting.stdout.contains(session), "{waiting:?}");
}

/// A session parked for approval of its bash call, then the store and the runner SIGKILLed
/// and started again: what both decision tests start from.
struct Parked {
    store: Store,
    workspaces: tempfile::TempDir,
    standin: AnthropicStandin,
    _runner: RunnerProc,
    _data: tempfile::TempDir,
}

async fn parked_across_a_restart() -> Parked {
    let data = tempfile::tempdir().expect("temp dir");
    let workspaces = tempfile::tempdir().expect("temp dir");
    let standin = AnthropicStandin::start(key_script())
        .await
        .expect("stand-in");
    let mut store = Store::start_in(data.path()).expect("store");
    let mut runner = approving_runner(&store, "r1", workspaces.path(), &standin.url());
    park_for_approval(&store, "s1").await;

    runner.kill9();
    store.kill9();
    let store = Store::start_in(data.path()).expect("store restarted");
    let runner = approving_runner(&store, "r2", workspaces.path(), &standin.url());
    Parked {
        store,
        workspaces,
        standin,
        _runner: runner,
        _data: data,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn an_approved_call_runs_once_across_a_restart_of_both_services() {
    // Bound whole: the runner and the data dir must live to the end of the test.
    let parked = parked_across_a_restart().await;
    let Parked {
        store,
        workspaces,
        standin,
        ..
    } = &parked;
    let approved = agentlog(&store.url(), &["approve", "s1"]);
    assert!(approved.success, "{}", approved.stderr);

    let mut client = store.client().await.expect("client");
    let events = wait_idle(&mut client, "s1", 0, Duration::from_secs(30)).await;
    assert_exactly_once(&events);
    assert_eq!(
        kinds(&events),
        [
            "user",
            "reply(tool_use)",
            "approval_requested(toolu_0_0)",
            "approval_decision(toolu_0_0,true)",
            "started(toolu_0_0#1)",
            "result(toolu_0_0)",
            "reply(end_turn)"
        ]
    );
    assert_eq!(
        key_counts(workspaces.path(), "s1").get("s1/toolu_0_0"),
        Some(&1)
    );
    assert_eq!(standin.violations(), Vec::<String>::new());

    // The call is answered: another decision for it is refused, by the store.
    let again = agentlog(&store.url(), &["approve", "s1", "toolu_0_0"]);
    assert!(!again.success);
    assert!(
        again.stderr.contains("not waiting for approval"),
        "{}",
        again.stderr
    );
    let none = agentlog(&store.url(), &["deny", "s1"]);
    assert!(!none.success);
    assert!(none.stderr.contains("no call waiting"), "{}", none.stderr);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_denied_call_never_runs_and_the_model_reads_the_note() {
    // Bound whole: the runner and the data dir must live to the end of the test.
    let parked = parked_across_a_restart().await;
    let Parked {
        store,
        workspaces,
        standin,
        ..
    } = &parked;
    let denied = agentlog(
        &store.url(),
        &["deny", "s1", "toolu_0_0", "--note", "not on a Friday"],
    );
    assert!(denied.success, "{}", denied.stderr);

    let mut client = store.client().await.expect("client");
    let events = wait_idle(&mut client, "s1", 0, Duration::from_secs(30)).await;
    assert_exactly_once(&events);
    assert!(!has(&events, "started"), "{:?}", kinds(&events));
    let (content, is_error) = result_of(&events, "toolu_0_0").expect("a result");
    assert!(is_error && content.contains("not on a Friday"), "{content}");
    assert!(key_counts(workspaces.path(), "s1").is_empty());
    assert_eq!(standin.violations(), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_decision_for_a_call_that_is_not_waiting_is_refused() {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    user_says(&mut client, "s1", "hello").await;
    let out = grpcurl(
        store.addr,
        "agentlog.v1.EventStore/Append",
        Some(
            &json!({"session_id": "s1", "events": [
                {"approval_decision": {"tool_use_id": "toolu_9_9", "approved": true}}
            ]})
            .to_string(),
        ),
    );
    assert!(!out.success);
    assert_eq!(
        out.code().as_deref(),
        Some("FailedPrecondition"),
        "{}",
        out.stderr
    );
    let cli = agentlog(&store.url(), &["approve", "s1", "toolu_9_9"]);
    assert!(!cli.success);
    assert!(
        cli.stderr.contains("not waiting for approval"),
        "{}",
        cli.stderr
    );
    let nothing = agentlog(&store.url(), &["approve", "s1"]);
    assert!(!nothing.success);
    assert!(
        nothing.stderr.contains("no call waiting"),
        "{}",
        nothing.stderr
    );
    assert_eq!(kinds(&history(&mut client, "s1").await), ["user"]);
}

/// A bash call that records each run, and on its first run never finishes. The record is
/// under `target/`, which checkpoints leave out: a re-run first brings the workspace back to
/// the call's start, and keeps what checkpoints leave out as it was.
fn run_counting_script() -> Vec<StandinReply> {
    vec![
        StandinReply::text("Working.").tool(
            "bash",
            json!({"command": "mkdir -p target; echo x >> target/runs.txt; [ \"$(wc -l < target/runs.txt)\" -ge 2 ] || sleep 300"}),
        ),
        StandinReply::text("Done."),
    ]
}

/// Starts a runner with `flags`, lets the bash call start, and SIGKILLs the runner mid-call.
async fn kill_mid_call(rig: &mut Rig, flags: &[&str]) {
    let mut runner = rig.runner("r1", TTL_MS, flags);
    user_says(&mut rig.client, "s1", "work").await;
    let runs = rig.workspaces.path().join("s1/target/runs.txt");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !std::fs::read_to_string(&runs).is_ok_and(|t| t.ends_with('\n')) {
        assert!(Instant::now() < deadline, "the call did not start");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    runner.kill9();
}

#[tokio::test(flavor = "multi_thread")]
async fn report_tells_the_model_the_outcome_is_unknown_and_never_reruns() {
    let mut rig = Rig::start(run_counting_script()).await;
    let flags = ["--on-unknown-outcome", "bash=report"];
    kill_mid_call(&mut rig, &flags).await;
    let _second = rig.runner("r2", TTL_MS, &flags);
    let events = wait_idle(&mut rig.client, "s1", 0, Duration::from_secs(30)).await;
    assert_exactly_once(&events);
    let (content, is_error) = result_of(&events, "toolu_0_0").expect("a result");
    assert!(
        is_error && content.contains("interrupted; it may or may not have taken effect"),
        "{content}"
    );
    assert_eq!(
        std::fs::read_to_string(rig.workspaces.path().join("s1/target/runs.txt"))
            .expect("runs.txt"),
        "x\n"
    );
    assert_eq!(rig.standin.violations(), Vec::<String>::new());
}

#[tokio::test(flavor = "multi_thread")]
async fn ask_waits_for_a_person_before_running_an_uncertain_call_again() {
    let mut rig = Rig::start(run_counting_script()).await;
    let flags = ["--on-unknown-outcome", "bash=ask"];
    kill_mid_call(&mut rig, &flags).await;
    let _second = rig.runner("r2", TTL_MS, &flags);
    wait_status(
        &mut rig.client,
        "s1",
        SessionStatus::Waiting,
        Duration::from_secs(20),
    )
    .await;
    let events = history(&mut rig.client, "s1").await;
    let reason = events
        .iter()
        .find_map(|e| match &e.kind {
            Some(Kind::ApprovalRequested(r)) => Some(r.reason.clone()),
            _ => None,
        })
        .expect("an approval request");
    assert!(
        reason.contains("may or may not have taken effect"),
        "{reason}"
    );

    let approved = agentlog(&rig.store.url(), &["approve", "s1"]);
    assert!(approved.success, "{}", approved.stderr);
    let events = wait_idle(&mut rig.client, "s1", 0, Duration::from_secs(30)).await;
    let starts = assert_exactly_once(&events);
    assert_eq!(starts.get("toolu_0_0"), Some(&2), "{:?}", kinds(&events));
    assert!(kinds(&events).contains(&"started(toolu_0_0#2)".to_string()));
    assert_eq!(
        std::fs::read_to_string(rig.workspaces.path().join("s1/target/runs.txt"))
            .expect("runs.txt"),
        "x\nx\n"
    );
}
