//! Forks with the real runner: a session works through several turns of bash and file-tool
//! calls (files made, changed, renamed, deleted by bash; modes, links, an empty directory, a
//! tree `--checkpoint-ignore` leaves out), then is forked at every seq of its log. Each
//! unsettled seq is refused; at each settled seq the fork's log is the parent's up to there,
//! its workspace, when its runner first asks the model, is byte for byte the parent's when
//! the parent asked the model at that point (copies taken by the model stand-in while the
//! runner waits), and continuing it never runs a call of its prefix again (a counter
//! outside every session hears each bash run). Also: a fork of a fork, and a fork made
//! while its parent is running.

mod fork_support;
mod runner_support;

use std::time::{Duration, Instant};

use agentlog_proto::reason::Reason;
use agentlog_proto::v1::{event::Kind, Event, ForkSessionRequest, UserMessage};
use fork_support::{describe, ignoring_times, Copies};
use integration_tests::anthropic_standin::StandinReply;
use integration_tests::side_effects::Counter;
use runner_support::*;
use serde_json::json;

const TTL_MS: u64 = 3000;
const IDLE: Duration = Duration::from_secs(60);

/// Turn-indexed replies: two turns of calls and a final reply, then (after a second user
/// message) one more turn of calls and a final reply, and one reply for a fork continued
/// past the end.
fn script(counter: &Counter) -> Vec<StandinReply> {
    let report = counter.report();
    vec![
        StandinReply::text("Setting up.")
            .tool(
                "bash",
                json!({"command": format!(
                    "mkdir -p src docs node_modules/pkg && echo one > src/a.txt && printf x > docs/d.md \
                     && ln -sfn src/a.txt link && echo junk > node_modules/pkg/i.js && {report}"
                )}),
            )
            .tool("write_file", json!({"path": "notes.txt", "content": "hello\n"})),
        StandinReply::text("Reshaping.")
            .tool(
                "bash",
                json!({"command": format!(
                    "mv -f src/a.txt src/b.txt; chmod 755 docs/d.md; rm -f notes.txt; \
                     mkdir -p empty/inner; ln -sfn missing dangling; {report}"
                )}),
            )
            .tool("edit_file", json!({"path": "docs/d.md", "old": "x", "new": "y"})),
        StandinReply::text("Done."),
        StandinReply::text("More.")
            .tool(
                "bash",
                json!({"command": format!(
                    "echo two >> src/b.txt; rm -f link; date +%s%N > stamp; {report}"
                )}),
            )
            .tool("write_file", json!({"path": "src/c.txt", "content": "c\n"})),
        StandinReply::text("Finished."),
        StandinReply::text("Continued."),
    ]
}

fn user_event(text: &str) -> Event {
    Event {
        event_id: format!("fork-user:{text}"),
        kind: Some(Kind::UserMessage(UserMessage { text: text.into() })),
        ..Event::default()
    }
}

/// The log with session ids cleared: what a fork keeps of its parent's.
fn contents(events: &[Event]) -> Vec<Event> {
    events
        .iter()
        .map(|e| Event {
            session_id: String::new(),
            ..e.clone()
        })
        .collect()
}

fn tool_results_through(events: &[Event], seq: u64) -> usize {
    events
        .iter()
        .filter(|e| e.seq <= seq && matches!(e.kind, Some(Kind::ToolResult(_))))
        .count()
}

async fn wait_requests(copies: &Copies, more_than: usize) -> usize {
    let deadline = Instant::now() + IDLE;
    while copies.count() <= more_than {
        assert!(Instant::now() < deadline, "no model request came");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    more_than
}

#[tokio::test(flavor = "multi_thread")]
async fn a_fork_at_every_settled_seq_has_the_parents_log_and_files_and_reruns_nothing() {
    let counter = Counter::start();
    let rig = Rig::start(script(&counter)).await;
    let copies_dir = tempfile::tempdir().expect("temp dir");
    let (copies, hook) = Copies::hook(rig.workspaces.path(), copies_dir.path());
    rig.standin.on_request(hook);
    let _runner = rig.runner("r1", TTL_MS, &["--tool-network", "all"]);
    let mut client = rig.client.clone();

    user_says(&mut client, "p", "build").await;
    let first = wait_idle(&mut client, "p", 0, IDLE).await;
    user_says(&mut client, "p", "more").await;
    let parent = wait_idle(&mut client, "p", first.len() as u64, IDLE).await;
    assert_exactly_once_ending(&parent, "end_turn");
    let parent_requests = copies.count();
    let parent_keys = counter.counts();
    assert_eq!(parent_keys.len(), 3, "{parent_keys:?}");
    assert!(parent_keys.values().all(|&n| n == 1), "{parent_keys:?}");

    let mut settled = Vec::new();
    for event in &parent {
        let seq = event.seq;
        let fork_id = format!("p-at-{seq}");
        // A fork at a final reply is idle: a message makes its runner take it up.
        let idle_point =
            matches!(&event.kind, Some(Kind::AssistantMessage(m)) if m.stop_reason == "end_turn");
        let events = if idle_point {
            vec![user_event("continue")]
        } else {
            vec![]
        };
        let before = copies.count();
        let made = client
            .fork_session(ForkSessionRequest {
                session_id: "p".into(),
                at_seq: seq,
                new_session_id: fork_id.clone(),
                events,
            })
            .await;
        let Ok(_) = made else {
            let refused = made.expect_err("refused");
            assert_eq!(refused.code(), tonic::Code::FailedPrecondition, "seq {seq}");
            assert_eq!(Reason::of(&refused), Some(Reason::ForkPointUnsettled));
            continue;
        };
        settled.push(seq);
        // The fork's log is the parent's up to the fork point: so is its fold.
        let forked = history(&mut client, &fork_id).await;
        assert_eq!(
            contents(&forked[..seq as usize]),
            contents(&parent[..seq as usize]),
            "fork at {seq}"
        );
        // Its workspace when its runner first asks the model: nothing of it has run yet.
        let request = wait_requests(&copies, before).await;
        let expected_at = copies
            .first_with(tool_results_through(&parent, seq))
            .filter(|&i| i < parent_requests)
            .expect("the parent asked the model at this point");
        let expected = copies.of(expected_at, "p", &["node_modules"]);
        assert_eq!(
            expected.is_empty(),
            tool_results_through(&parent, seq) == 0,
            "the parent's copy at {seq}: {expected:?}"
        );
        assert_eq!(
            copies.of(request, &fork_id, &["node_modules"]),
            expected,
            "the workspace of the fork at {seq}"
        );
        // The tree --checkpoint-ignore leaves out is not brought back.
        let restored = describe(
            &copies_dir.path().join(request.to_string()).join(&fork_id),
            &[],
        );
        assert!(!restored.keys().any(|p| p.starts_with("node_modules")));
        let continued = wait_idle(&mut client, &fork_id, seq, IDLE).await;
        assert_exactly_once_ending(&continued, "end_turn");
        // Never a call of its prefix again: the counter heard no key of the fork's for one.
        let keys = counter.counts();
        for id in tool_use_ids(&parent[..seq as usize]) {
            assert!(
                !keys.contains_key(&format!("{fork_id}/{id}")),
                "the fork at {seq} ran {id} of its prefix again: {keys:?}"
            );
        }
        assert!(keys.values().all(|&n| n == 1), "{keys:?}");
    }
    // user(build), the last result of each turn of calls, each final reply, user(more).
    assert_eq!(
        settled.len(),
        7,
        "settled seqs {settled:?} of {:?}",
        kinds(&parent)
    );
    // The parent's own calls ran once each, forks or not.
    let keys = counter.counts();
    for (key, n) in &parent_keys {
        assert_eq!(keys.get(key), Some(n), "{key}");
    }
    assert_eq!(rig.standin.violations(), Vec::<String>::new());
}

/// A fork made while its parent's call runs starts from the point it names, and the parent
/// goes on untouched; a fork of that fork starts from its parent's files.
#[tokio::test(flavor = "multi_thread")]
async fn a_fork_made_while_the_parent_runs_and_a_fork_of_a_fork() {
    let counter = Counter::start();
    let report = counter.report();
    let script = vec![
        StandinReply::text("Working.")
            .tool(
                "bash",
                json!({"command": format!(
                    "printf one > one.txt && mkdir -p d && ln -sfn ../one.txt d/link && sleep 1 && {report}"
                )}),
            )
            .tool("write_file", json!({"path": "two.txt", "content": "two\n"})),
        StandinReply::text("Done."),
        StandinReply::text("Continued."),
    ];
    let rig = Rig::start(script).await;
    let copies_dir = tempfile::tempdir().expect("temp dir");
    let (copies, hook) = Copies::hook(rig.workspaces.path(), copies_dir.path());
    rig.standin.on_request(hook);
    let _runner = rig.runner("r1", TTL_MS, &["--tool-network", "all"]);
    let mut client = rig.client.clone();

    user_says(&mut client, "p", "go").await;
    wait_for_log(&mut client, "p", IDLE, |events| has(events, "started")).await;
    client
        .fork_session(ForkSessionRequest {
            session_id: "p".into(),
            at_seq: 1,
            new_session_id: "f".into(),
            events: vec![],
        })
        .await
        .expect("a fork while the parent's call runs");
    let parent = wait_idle(&mut client, "p", 1, IDLE).await;
    let fork = wait_idle(&mut client, "f", 1, IDLE).await;
    assert_exactly_once_ending(&parent, "end_turn");
    assert_exactly_once_ending(&fork, "end_turn");
    // The fork ran the calls its model asked for, as calls of its own; the parent's ran once.
    let keys = counter.counts();
    let expected: Vec<String> = vec!["f/toolu_0_0".into(), "p/toolu_0_0".into()];
    assert_eq!(keys.keys().cloned().collect::<Vec<_>>(), expected);
    assert!(keys.values().all(|&n| n == 1), "{keys:?}");
    let root = rig.workspaces.path();
    assert_eq!(
        ignoring_times(describe(&root.join("f"), &[])),
        ignoring_times(describe(&root.join("p"), &[]))
    );

    // A fork of the fork, at its final reply: it starts with the fork's files.
    let at = fork.last().map(|e| e.seq).expect("events");
    let before = copies.count();
    client
        .fork_session(ForkSessionRequest {
            session_id: "f".into(),
            at_seq: at,
            new_session_id: "g".into(),
            events: vec![user_event("go on")],
        })
        .await
        .expect("a fork of a fork");
    let request = wait_requests(&copies, before).await;
    let f_files = describe(&root.join("f"), &[]);
    assert!(f_files.contains_key("d/link") && f_files.contains_key("two.txt"));
    assert_eq!(copies.of(request, "g", &[]), f_files);
    let grandchild = wait_idle(&mut client, "g", at + 1, IDLE).await;
    assert_eq!(
        contents(&grandchild[..at as usize]),
        contents(&fork[..at as usize])
    );
    assert_eq!(
        counter.counts().len(),
        2,
        "the fork of a fork reran nothing"
    );
}
