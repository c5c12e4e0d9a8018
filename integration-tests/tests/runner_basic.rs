//! The runner against the real event store and the Anthropic stand-in: a multi-step session
//! runs to the end through transient provider failures, and a refused request ends the
//! turn with `run_error`.

mod runner_support;

use std::time::Duration;

use agentlog_proto::v1::event::Kind;
use integration_tests::anthropic_standin::{Fault, StandinReply};
use runner_support::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread")]
async fn a_session_runs_to_the_end_through_transient_failures() {
    let mut rig = Rig::start(vec![
        StandinReply::text("I will record the key.")
            .tool(
                "bash",
                json!({"command": "echo \"$IDEMPOTENCY_KEY\" >> keys.txt; echo done"}),
            )
            .tool(
                "write_file",
                json!({"path": "notes/a.txt", "content": "hello"}),
            ),
        StandinReply::text("Now reading it back.")
            .tool("read_file", json!({"path": "notes/a.txt"})),
        StandinReply::text("All finished."),
    ])
    .await;
    rig.standin.inject(
        0,
        Fault::Overloaded {
            retry_after_s: Some(0),
        },
    );
    rig.standin.inject(0, Fault::CutStream);
    rig.standin.inject(1, Fault::ErrorEvent);
    let mut runner = start_runner(
        &rig.store.url(),
        "r1",
        rig.workspaces.path(),
        &rig.standin.url(),
        3000,
        4,
    );

    user_says(&mut rig.client, "s1", "please record the key").await;
    let events = wait_idle(&mut rig.client, "s1", 0, Duration::from_secs(60)).await;

    assert_eq!(rig.standin.violations(), Vec::<String>::new());
    assert_exactly_once(&events);
    assert_eq!(
        kinds(&events),
        [
            "user",
            "model_retry(anthropic:standin-1,overloaded)",
            "model_retry(anthropic:standin-1,cut)",
            "reply(tool_use)",
            "started(toolu_0_0#1)",
            "result(toolu_0_0)",
            "started(toolu_0_1#1)",
            "result(toolu_0_1)",
            "model_retry(anthropic:standin-1,server_error)",
            "reply(tool_use)",
            "started(toolu_1_0#1)",
            "result(toolu_1_0)",
            "reply(end_turn)",
        ]
    );
    let read_back = events.iter().find_map(|e| match &e.kind {
        Some(Kind::ToolResult(r)) if r.tool_use_id == "toolu_1_0" => Some(r.content.clone()),
        _ => None,
    });
    assert_eq!(read_back.as_deref(), Some("hello"));
    assert_eq!(
        std::fs::read_to_string(rig.workspaces.path().join("s1/keys.txt"))
            .ok()
            .as_deref(),
        Some("s1/toolu_0_0\n")
    );
    assert!(
        events
            .iter()
            .any(|e| matches!(e.kind, Some(Kind::AssistantDelta(_)))),
        "text was streamed as deltas"
    );
    let served: Vec<(usize, String)> = rig
        .standin
        .requests()
        .into_iter()
        .map(|r| (r.turn, r.served))
        .collect();
    assert_eq!(
        served,
        [
            (0, "overloaded".to_string()),
            (0, "cut_stream".to_string()),
            (0, "reply".to_string()),
            (1, "error_event".to_string()),
            (1, "reply".to_string()),
            (2, "reply".to_string()),
        ]
    );
    assert!(runner.terminate().success(), "runner exits 0 on SIGTERM");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refused_request_ends_the_turn_with_run_error() {
    let mut rig = Rig::start(vec![
        StandinReply::text("never sent"),
        StandinReply::text("second try"),
    ])
    .await;
    rig.standin.inject(0, Fault::BadRequest);
    let _runner = start_runner(
        &rig.store.url(),
        "r1",
        rig.workspaces.path(),
        &rig.standin.url(),
        3000,
        4,
    );

    user_says(&mut rig.client, "s2", "hi").await;
    let events = wait_idle(&mut rig.client, "s2", 0, Duration::from_secs(30)).await;
    let kinds = kinds(&events);
    assert_eq!(kinds.len(), 2, "{kinds:?}");
    assert!(kinds[1].starts_with("run_error(HTTP 400"), "{kinds:?}");
    assert!(
        kinds[1].contains("the stand-in refuses this request"),
        "{kinds:?}"
    );
    assert_eq!(rig.standin.requests().len(), 1, "a refusal is not retried");

    // The user speaks again: the next turn is asked for, with both user turns merged.
    let again = user_says(&mut rig.client, "s2", "again").await;
    let events = wait_idle(&mut rig.client, "s2", again, Duration::from_secs(30)).await;
    assert!(
        super_last_is_reply(&events),
        "{:?}",
        runner_support::kinds(&events)
    );
    assert_eq!(rig.standin.violations(), Vec::<String>::new());
}

fn super_last_is_reply(events: &[agentlog_proto::v1::Event]) -> bool {
    matches!(events.last().and_then(|e| e.kind.as_ref()), Some(Kind::AssistantMessage(m)) if m.stop_reason == "end_turn")
}
