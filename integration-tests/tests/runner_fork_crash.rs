//! A runner SIGKILLed between a call's workspace checkpoint and its `tool_result`: its
//! connection to the store is cut (a blackholing proxy) once the call started, so the
//! checkpoint is written and the result can never arrive; it is killed as soon as the
//! checkpoint is on disk. The next runner's guard settles the call as always (bash: run
//! again with the same key, one result), and every checkpoint after it is right: a fork at
//! each of the session's results gets exactly the files of that moment.

mod fault_support;
mod fork_support;
mod runner_support;

use std::path::Path;
use std::time::{Duration, Instant};

use agentlog_proto::v1::{event::Kind, ForkSessionRequest};
use fault_support::TcpProxy;
use fork_support::Copies;
use integration_tests::anthropic_standin::StandinReply;
use runner_support::*;
use serde_json::json;

/// Long enough that the first runner, cut off from the store, still finishes the call and
/// records its checkpoint before its lease timer stops it.
const TTL_MS: u64 = 3000;
const IDLE: Duration = Duration::from_secs(60);

/// The checkpoint ids the area keeps for `session` (its `refs`).
fn refs(root: &Path, session: &str) -> Vec<String> {
    std::fs::read_to_string(
        root.join(".checkpoints/sessions")
            .join(session)
            .join("refs"),
    )
    .unwrap_or_default()
    .lines()
    .map(str::to_string)
    .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_runner_killed_between_the_checkpoint_and_the_result_is_settled_and_checkpoints_stay_right(
) {
    let script = vec![
        StandinReply::text("Writing.").tool(
            "bash",
            json!({"command": "echo one > a.txt; mkdir -p d; sleep 0.5; echo two > d/b.txt; ln -sfn d/b.txt link"}),
        ),
        StandinReply::text("More.")
            .tool("write_file", json!({"path": "c.txt", "content": "c\n"}))
            .tool("bash", json!({"command": "rm a.txt; chmod 700 d"})),
        StandinReply::text("Done."),
        StandinReply::text("Continued."),
    ];
    let rig = Rig::start(script).await;
    let root = rig.workspaces.path();
    let copies_dir = tempfile::tempdir().expect("temp dir");
    let (copies, hook) = Copies::hook(root, copies_dir.path());
    rig.standin.on_request(hook);
    let mut client = rig.client.clone();
    let proxy = TcpProxy::start(rig.store.addr).await;
    let mut first = start_runner(&proxy.url(), "r1", root, &rig.standin.url(), TTL_MS, 1);
    user_says(&mut client, "s", "go").await;
    wait_for_log(&mut client, "s", IDLE, |events| has(events, "started")).await;
    // From now on nothing of the first runner reaches the store: its result cannot land.
    proxy.set_blackhole(true);
    let deadline = Instant::now() + IDLE;
    while refs(root, "s").is_empty() {
        assert!(
            Instant::now() < deadline,
            "the checkpoint was never written"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    first.kill9();
    let orphan = refs(root, "s");
    assert!(
        !has(&history(&mut client, "s").await, "result"),
        "killed after its checkpoint and before its result"
    );

    let _second = start_runner(&rig.store.url(), "r2", root, &rig.standin.url(), TTL_MS, 1);
    let events = wait_idle(&mut client, "s", 1, IDLE).await;
    assert_exactly_once_ending(&events, "end_turn");
    assert!(
        kinds(&events).contains(&"started(toolu_0_0#2)".to_string()),
        "{:?}",
        kinds(&events)
    );
    // The orphan stays among the session's checkpoints (nothing names it; it goes with
    // the session).
    assert!(refs(root, "s").starts_with(&orphan));

    // Each settled result's checkpoint is the workspace of that moment: a fork there has,
    // when its runner first asks the model, the files the session had when it asked.
    let parent_requests = copies.count();
    for (call, results) in [("toolu_0_0", 1), ("toolu_1_1", 3)] {
        let seq = events
            .iter()
            .find(|e| matches!(&e.kind, Some(Kind::ToolResult(r)) if r.tool_use_id == call))
            .map(|e| e.seq)
            .expect("a result");
        let fork = format!("s-{call}");
        let before = copies.count();
        client
            .fork_session(ForkSessionRequest {
                session_id: "s".into(),
                at_seq: seq,
                new_session_id: fork.clone(),
                events: vec![],
            })
            .await
            .expect("a fork at a settled result");
        let deadline = Instant::now() + IDLE;
        while copies.count() <= before {
            assert!(
                Instant::now() < deadline,
                "the fork's runner never asked the model"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let expected_at = copies
            .first_with(results)
            .filter(|&i| i < parent_requests)
            .expect("the session asked the model then");
        let expected = copies.of(expected_at, "s", &[]);
        assert!(expected.contains_key("d/b.txt"), "{expected:?}");
        assert_eq!(copies.of(before, &fork, &[]), expected, "after {call}");
        wait_idle(&mut client, &fork, seq, IDLE).await;
    }
}
