//! A rolling deploy, end to end (the real binaries; over PostgreSQL too with
//! `AGENTLOG_TEST_BACKEND=postgres`): three runners work 20 sessions of bash calls and are
//! replaced one at a time while the sessions run, as a Deployment with `maxSurge: 1,
//! maxUnavailable: 0` does (the new runner starts, then the old one gets SIGTERM); then the
//! store is replaced too (SIGTERM, and a new process on the same data and address). Every
//! session finishes; no call runs twice (one `tool_started` per call in the logs, and one
//! line per key in the sessions' key files, outside the logs); every acknowledged event is
//! there (the logs are gapless and hold each user turn at the seq it was acknowledged
//! with); each replaced runner exits 0 within its drain budget plus margin and leaves no
//! lease behind.

mod runner_support;

use std::time::Duration;

use agentlog_proto::v1::{AppendRequest, GetSessionRequest, SessionStatus};
use integration_tests::anthropic_standin::{AnthropicStandin, StandinReply};
use integration_tests::{user_event, Store};
use runner_support::*;
use serde_json::json;

const SESSIONS: usize = 20;
const STEPS: usize = 4;
const TTL_MS: u64 = 5000;
const MAX_SESSIONS: usize = 4;
/// `--drain-timeout`: far more than a 0.6 s call needs.
const BUDGET: &str = "10s";
/// The budget, the runner's 3 s margin past it, and a loaded machine's share.
const BOUND: Duration = Duration::from_secs(10 + 3 + 2);

fn script() -> Vec<StandinReply> {
    let mut replies: Vec<StandinReply> = (0..STEPS)
        .map(|i| {
            StandinReply::text(&format!("Step {i}: recording this call's key."))
                .slow(10)
                .tool(
                    "bash",
                    json!({"command": "sleep 0.6; echo \"$IDEMPOTENCY_KEY\" >> keys.txt"}),
                )
        })
        .collect();
    replies.push(StandinReply::text("All steps are done.").slow(10));
    replies
}

fn session(i: usize) -> String {
    format!("roll-{i}")
}

async fn busy_sessions(
    client: &mut agentlog_proto::v1::event_store_client::EventStoreClient<
        tonic::transport::Channel,
    >,
) -> usize {
    let mut busy = 0;
    for i in 0..SESSIONS {
        if status(client, &session(i)).await == SessionStatus::Runnable {
            busy += 1;
        }
    }
    busy
}

#[tokio::test(flavor = "multi_thread")]
async fn a_rolling_deploy_finishes_every_session_and_runs_nothing_twice() {
    let mut store = Store::start().expect("store");
    let standin = AnthropicStandin::start(script()).await.expect("stand-in");
    let workspaces = tempfile::tempdir().expect("temp dir");
    let url = store.url();
    let start = |n: usize| {
        start_runner_with(
            &url,
            &format!("runner-{n}"),
            workspaces.path(),
            &standin.url(),
            TTL_MS,
            MAX_SESSIONS,
            &["--drain-timeout", BUDGET],
        )
    };
    let mut runners: Vec<RunnerProc> = (0..3).map(start).collect();
    let mut client = store.client().await.expect("client");
    let mut acked = Vec::new();
    for i in 0..SESSIONS {
        let seq = client
            .append(AppendRequest {
                session_id: session(i),
                events: vec![user_event(&format!("user:{i}"), &session(i))],
                ..AppendRequest::default()
            })
            .await
            .expect("append the user turn")
            .into_inner()
            .last_seq;
        acked.push(seq);
    }

    // Replace the runners one at a time while the sessions run.
    let mut exits = Vec::new();
    let mut drained = 0;
    for generation in 0..3 {
        tokio::time::sleep(Duration::from_millis(1200)).await;
        let busy = busy_sessions(&mut client).await;
        runners.push(start(3 + generation));
        let mut old = runners.remove(0);
        let (status, took) = tokio::task::block_in_place(|| old.terminate_timed(BOUND));
        assert!(status.success(), "{} exited {status}", old.id);
        drained += old.log_lines("drained: releasing the session").len();
        for i in 0..SESSIONS {
            let lease = client
                .get_session(GetSessionRequest {
                    session_id: session(i),
                })
                .await
                .expect("the session")
                .into_inner()
                .lease;
            assert!(
                lease.as_ref().is_none_or(|l| l.owner != old.id),
                "{} left its lease on {}",
                old.id,
                session(i)
            );
        }
        exits.push((old.id.clone(), busy, took));
    }

    // Then the store: SIGTERM, and a new process on the same data and address.
    let busy = busy_sessions(&mut client).await;
    let stopped = tokio::task::block_in_place(|| store.terminate()).expect("the store stops");
    assert!(stopped.success(), "the store exited {stopped}");
    let store = store
        .restart_on(&store.addr.to_string())
        .expect("the store again");
    let mut client = store.client().await.expect("client");

    let mut calls = 0;
    for i in 0..SESSIONS {
        let events = wait_idle(&mut client, &session(i), 0, Duration::from_secs(120)).await;
        let seqs: Vec<u64> = events.iter().map(|e| e.seq).collect();
        assert_eq!(
            seqs,
            (1..=events.len() as u64).collect::<Vec<_>>(),
            "{}: gapless",
            session(i)
        );
        let user = &events[acked[i] as usize - 1];
        assert_eq!(
            user.event_id,
            format!("user:{i}"),
            "{}: the acknowledged user turn",
            session(i)
        );
        let starts = assert_exactly_once(&events);
        assert_eq!(starts.len(), STEPS, "{}: {:?}", session(i), kinds(&events));
        for (call, n) in &starts {
            assert_eq!(
                *n,
                1,
                "{}: {call} started {n} times: {:?}",
                session(i),
                kinds(&events)
            );
        }
        let keys = key_counts(workspaces.path(), &session(i));
        for id in tool_use_ids(&events) {
            let key = format!("{}/{id}", session(i));
            assert_eq!(keys.get(&key), Some(&1), "{key} ran once: {keys:?}");
        }
        calls += starts.len();
    }
    assert!(
        drained > 0,
        "some runner drained a session in hand: {exits:?}"
    );
    assert_eq!(standin.violations(), Vec::<String>::new());
    let shown: Vec<String> = exits
        .iter()
        .map(|(id, busy, took)| {
            format!(
                "{id} ({busy} sessions running) exited in {} ms",
                took.as_millis()
            )
        })
        .collect();
    println!(
        "ROLLING DEPLOY ({}): {}; the store restarted with {busy} running; {calls} calls, each run once, {drained} sessions drained",
        if testkit::test_backend_is_postgres() { "postgres" } else { "local" },
        shown.join(", ")
    );
    drop(runners);
}
