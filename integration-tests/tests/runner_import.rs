//! A session imported from another store resumes there, with nothing of its log run again:
//! a session whose runner died in the middle of a bash call (`tool_started`, no result) is
//! exported from a store that has no runner and imported into one that has; that store's
//! runner claims it, follows bash's unknown-outcome policy (the call runs again as attempt
//! 2, with the same idempotency key), runs none of the calls the log already answered, and
//! asks the model (the Anthropic stand-in) only for the turn after, once.

mod runner_support;

use std::time::Duration;

use agentlog_proto::v1::{event, Event, ExportRequest, ImportChunk, ImportOutcome};
use integration_tests::anthropic_standin::StandinReply;
use runner_support::*;
use serde_json::json;

const SESSION: &str = "imp-resume";

/// Three turns: a call that records it ran, a slow call that records its idempotency key,
/// and the final answer. Tool ids are `toolu_<turn>_<i>`.
fn script() -> Vec<StandinReply> {
    vec![
        StandinReply::text("First I note that I started.")
            .tool("bash", json!({"command": "echo first >> ran.txt"})),
        StandinReply::text("Now the key.").tool(
            "bash",
            json!({"command": "sleep 2; echo \"$IDEMPOTENCY_KEY\" >> keys.txt"}),
        ),
        StandinReply::text("Both are recorded."),
    ]
}

fn is_second_call_started(event: &Event) -> bool {
    matches!(&event.kind, Some(event::Kind::ToolStarted(s)) if s.tool_use_id == "toolu_1_0")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_imported_session_resumes_and_nothing_of_its_log_runs_again() {
    // The source: its runner killed (-9) once the second call started, so the log ends in
    // a call whose outcome is unknown; then no runner there any more.
    let mut source = Rig::start(script()).await;
    let mut runner = source.runner("r-source", 3_000, &[]);
    user_says(&mut source.client, SESSION, "record two things").await;
    let killed = kill_when(
        source.client.clone(),
        SESSION.into(),
        1,
        runner.pid(),
        is_second_call_started,
        Duration::ZERO,
    )
    .await;
    assert!(killed, "the second call never started");
    runner.kill9();
    let before = history(&mut source.client, SESSION).await;
    assert!(
        before.last().is_some_and(is_second_call_started),
        "{:#?}",
        kinds(&before)
    );
    let mut pieces = source
        .client
        .export(ExportRequest {
            session_ids: vec![SESSION.into()],
            all: false,
        })
        .await
        .expect("export")
        .into_inner();
    let mut text = String::new();
    while let Some(piece) = pieces.message().await.expect("export goes on") {
        text.push_str(&piece.text);
    }

    // The target: another store, with a runner of its own and the same model.
    let mut rig = Rig::start(script()).await;
    let _runner = rig.runner("r-target", 3_000, &[]);
    let mut results = rig
        .client
        .import(tokio_stream::iter(vec![ImportChunk { text }]))
        .await
        .expect("import")
        .into_inner();
    let result = results.message().await.expect("a result").expect("one");
    assert_eq!(result.outcome(), ImportOutcome::Imported, "{result:?}");

    let events = wait_idle(
        &mut rig.client,
        SESSION,
        before.len() as u64,
        Duration::from_secs(30),
    )
    .await;
    assert_eq!(
        &events[..before.len()],
        &before[..],
        "the imported log is kept as it was"
    );
    let after: Vec<&Event> = events[before.len()..]
        .iter()
        .filter(|e| !matches!(e.kind, Some(event::Kind::AssistantDelta(_))))
        .collect();
    assert_eq!(after.len(), 3, "{:#?}", kinds(&events));
    match &after[0].kind {
        Some(event::Kind::ToolStarted(s)) => {
            assert_eq!(s.tool_use_id, "toolu_1_0");
            assert_eq!(s.attempt, 2, "the dangling call runs again as attempt 2");
            assert_eq!(
                s.idempotency_key,
                format!("{SESSION}/toolu_1_0"),
                "with the same key"
            );
        }
        other => panic!("expected tool_started, got {other:?}"),
    }
    assert!(
        matches!(&after[1].kind, Some(event::Kind::ToolResult(r)) if r.tool_use_id == "toolu_1_0")
    );
    assert!(matches!(
        &after[2].kind,
        Some(event::Kind::AssistantMessage(_))
    ));
    // The call the log answered did not run here; the dangling one ran once, with its key.
    let workspace = rig.workspaces.path().join(SESSION);
    assert!(!workspace.join("ran.txt").exists(), "toolu_0_0 ran again");
    let keys = key_counts(rig.workspaces.path(), SESSION);
    assert_eq!(
        keys.get(&format!("{SESSION}/toolu_1_0")),
        Some(&1),
        "{keys:?}"
    );
    // The model was asked once, for the turn after the imported log, and the conversation it
    // got is the one it gave (the strict stand-in checks every earlier turn verbatim).
    assert_eq!(rig.standin.requests().len(), 1);
    assert!(
        rig.standin.violations().is_empty(),
        "{:?}",
        rig.standin.violations()
    );
}
