//! Exactly-once under SIGKILL: a multi-step session whose bash tool appends its
//! `$IDEMPOTENCY_KEY` to a file, with the runner killed at each specific point (after
//! `tool_started`, during the tool, after `tool_result`, mid-stream, after the reply) and at
//! random moments, restarted each time under a new id. Afterwards every tool_use has
//! exactly one result, no tool ran after its result was logged, the model was never asked
//! again for a turn whose reply was logged, and the session finished.

mod runner_support;

use std::time::Duration;

use agentlog_proto::v1::{event::Kind, Event};
use integration_tests::anthropic_standin::{AnthropicStandin, StandinReply};
use integration_tests::Store;
use runner_support::*;
use serde_json::json;

const TTL_MS: u64 = 1000;

fn script() -> Vec<StandinReply> {
    let mut replies: Vec<StandinReply> = (0..3)
        .map(|i| {
            StandinReply::text(&format!(
                "Step {i}: I am recording the idempotency key in the file now."
            ))
            .slow(10)
            .tool(
                "bash",
                json!({"command": "sleep 0.3; echo \"$IDEMPOTENCY_KEY\" >> keys.txt"}),
            )
        })
        .collect();
    replies.push(StandinReply::text("Every step is done and the keys are recorded.").slow(10));
    replies
}

/// Checks the finished session against the log, the workspace and the stand-in.
fn assert_resumed_exactly_once(
    events: &[Event],
    workspace_root: &std::path::Path,
    session: &str,
    standin: &AnthropicStandin,
) {
    let starts = assert_exactly_once(events);
    let keys = key_counts(workspace_root, session);
    for id in tool_use_ids(events) {
        let key = format!("{session}/{id}");
        let ran = keys.get(&key).copied().unwrap_or(0);
        let started = starts.get(&id).copied().unwrap_or(0);
        // Each run was preceded by its own tool_started, and none followed the result.
        assert!(
            ran <= started,
            "{key} ran {ran} times but was started {started} times"
        );
        assert!(ran >= 1 || started > 1, "{key} never completed a run");
    }
    let replies = reply_times(events);
    for request in standin
        .requests()
        .iter()
        .filter(|r| r.first_user_text == session)
    {
        if let Some(&logged) = replies.get(request.turn) {
            assert!(
                request.received_unix_ms <= logged,
                "turn {} was asked for at {} after its reply was logged at {logged}",
                request.turn,
                request.received_unix_ms
            );
        }
    }
    assert_eq!(standin.violations(), Vec::<String>::new());
}

async fn last_seq(
    client: &mut agentlog_proto::v1::event_store_client::EventStoreClient<
        tonic::transport::Channel,
    >,
    session: &str,
) -> u64 {
    history(client, session).await.last().map_or(0, |e| e.seq)
}

async fn kill_at(point: &str, matches: fn(&Event) -> bool, delay: Duration) {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    let standin = AnthropicStandin::start(script()).await.expect("stand-in");
    let workspaces = tempfile::tempdir().expect("temp dir");
    let session = format!("kill-{point}");
    user_says(&mut client, &session, &session).await;

    let mut kills = 0;
    for generation in 0..3 {
        if status(&mut client, &session).await == agentlog_proto::v1::SessionStatus::Idle {
            break;
        }
        let from = last_seq(&mut client, &session).await + 1;
        let mut runner = start_runner(
            &store.url(),
            &format!("{point}-{generation}"),
            workspaces.path(),
            &standin.url(),
            TTL_MS,
            2,
        );
        let watcher = tokio::spawn(kill_when(
            client.clone(),
            session.clone(),
            from,
            runner.pid(),
            matches,
            delay,
        ));
        let fired = tokio::time::timeout(Duration::from_secs(30), watcher).await;
        runner.kill9();
        if matches!(fired, Ok(Ok(true))) {
            kills += 1;
        }
    }
    assert!(kills >= 1, "the runner was never killed at {point}");
    let _survivor = start_runner(
        &store.url(),
        &format!("{point}-final"),
        workspaces.path(),
        &standin.url(),
        TTL_MS,
        2,
    );
    let events = wait_idle(&mut client, &session, 0, Duration::from_secs(60)).await;
    assert_resumed_exactly_once(&events, workspaces.path(), &session, &standin);
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_after_tool_started() {
    kill_at(
        "started",
        |e| matches!(e.kind, Some(Kind::ToolStarted(_))),
        Duration::ZERO,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_during_the_tool() {
    kill_at(
        "during",
        |e| matches!(e.kind, Some(Kind::ToolStarted(_))),
        Duration::from_millis(120),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_after_tool_result() {
    kill_at(
        "result",
        |e| matches!(e.kind, Some(Kind::ToolResult(_))),
        Duration::ZERO,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_mid_stream() {
    kill_at(
        "stream",
        |e| matches!(e.kind, Some(Kind::AssistantDelta(_))),
        Duration::ZERO,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_after_the_reply() {
    kill_at(
        "reply",
        |e| matches!(e.kind, Some(Kind::AssistantMessage(_))),
        Duration::ZERO,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn killed_at_random_moments() {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    let standin = AnthropicStandin::start(script()).await.expect("stand-in");
    let workspaces = tempfile::tempdir().expect("temp dir");
    let session = "kill-random".to_string();
    user_says(&mut client, &session, &session).await;
    for generation in 0..10 {
        if status(&mut client, &session).await == agentlog_proto::v1::SessionStatus::Idle {
            break;
        }
        let mut runner = start_runner(
            &store.url(),
            &format!("random-{generation}"),
            workspaces.path(),
            &standin.url(),
            TTL_MS,
            2,
        );
        // Long enough to claim (after the previous lease expires) and get some way in.
        tokio::time::sleep(Duration::from_millis(300 + fastrand_ms(1500))).await;
        runner.kill9();
    }
    let _survivor = start_runner(
        &store.url(),
        "random-final",
        workspaces.path(),
        &standin.url(),
        TTL_MS,
        2,
    );
    let events = wait_idle(&mut client, &session, 0, Duration::from_secs(60)).await;
    assert_resumed_exactly_once(&events, workspaces.path(), &session, &standin);
}

/// A pseudo-random delay below `max` ms, seeded from the clock (the test logs it via the
/// runners' output when it fails).
fn fastrand_ms(max: u64) -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos() as u64)
        .unwrap_or(0);
    nanos % max
}
