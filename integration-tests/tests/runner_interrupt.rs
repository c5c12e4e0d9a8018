//! `agentlog cancel` against the real event store, runner and CLI (the Anthropic stand-in
//! plays the model): an interrupt stops a model stream, a long tool and its child
//! processes, and a call waiting for approval; it is answered by whichever runner holds or
//! next claims the session, without running anything of the turn again; an idle session
//! shrugs it off; and the next user turn continues with a request the provider accepts.

mod runner_support;

use std::path::Path;
use std::time::Duration;

use agentlog_proto::v1::{
    content_block::Block, event::Kind, AcquireLeaseRequest, AppendRequest, AssistantMessage,
    ContentBlock, Event, Interrupt, ReleaseLeaseRequest, SessionStatus, ToolResult, ToolUseBlock,
};
use integration_tests::anthropic_standin::StandinReply;
use integration_tests::Store;
use runner_support::*;
use serde_json::json;

const TTL_MS: u64 = 1500;

fn cancel(store: &Store, session: &str, reason: &str) {
    let out = agentlog(&store.url(), &["cancel", session, "--reason", reason]);
    assert!(out.success, "agentlog cancel failed: {}", out.stderr);
}

fn interrupted_reason(events: &[agentlog_proto::v1::Event]) -> Option<String> {
    events.iter().find_map(|e| match &e.kind {
        Some(Kind::Interrupted(i)) => Some(i.reason.clone()),
        _ => None,
    })
}

/// Whether a process is gone (or a zombie nobody has reaped yet: it runs nothing).
fn process_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
    }
}

async fn wait_for_file(path: &Path, limit: Duration) -> String {
    let deadline = std::time::Instant::now() + limit;
    loop {
        if let Ok(text) = std::fs::read_to_string(path) {
            if text.ends_with('\n') {
                return text;
            }
        }
        assert!(
            std::time::Instant::now() < deadline,
            "{} did not appear within {limit:?}",
            path.display()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn cancel_drops_a_model_stream() {
    // About 60 s of streaming: an answer to the interrupt can only come from dropping it.
    let mut rig = Rig::start(vec![StandinReply::text(&"word ".repeat(300)).slow(200)]).await;
    let _runner = rig.runner("r1", TTL_MS, &[]);

    user_says(&mut rig.client, "s1", "talk for a long time").await;
    wait_for_log(&mut rig.client, "s1", Duration::from_secs(20), |events| {
        events
            .iter()
            .any(|e| matches!(e.kind, Some(Kind::AssistantDelta(_))))
    })
    .await;
    cancel(&rig.store, "s1", "enough");
    let events = wait_for_log(&mut rig.client, "s1", Duration::from_secs(10), |events| {
        has(events, "interrupted")
    })
    .await;
    assert_eq!(kinds(&events), ["user", "interrupt", "interrupted"]);
    assert_eq!(interrupted_reason(&events).as_deref(), Some("enough"));
    assert_eq!(status(&mut rig.client, "s1").await, SessionStatus::Idle);
    // The stream is gone: nothing more is written for that turn.
    let last = events.last().map(|e| e.seq);
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(
        history(&mut rig.client, "s1").await.last().map(|e| e.seq),
        last
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn cancel_kills_a_running_tool_and_its_children_and_the_session_continues() {
    let mut rig = Rig::start(vec![
        StandinReply::text("Starting a long job.").tool(
            "bash",
            json!({"command": "sleep 300 & echo $! > child.pid; echo x >> runs.txt; sleep 300"}),
        ),
        StandinReply::text("Understood, I stopped."),
    ])
    .await;
    let _runner = rig.runner("r1", TTL_MS, &[]);

    user_says(&mut rig.client, "s1", "run the long job").await;
    let workspace = rig.workspaces.path().join("s1");
    wait_for_file(&workspace.join("runs.txt"), Duration::from_secs(20)).await;
    let child: u32 = std::fs::read_to_string(workspace.join("child.pid"))
        .expect("child.pid")
        .trim()
        .parse()
        .expect("a pid");
    assert!(
        !process_gone(child),
        "the tool's child runs before the cancel"
    );

    cancel(&rig.store, "s1", "wrong job");
    let events = wait_for_log(&mut rig.client, "s1", Duration::from_secs(10), |events| {
        has(events, "interrupted")
    })
    .await;
    assert_eq!(
        kinds(&events),
        [
            "user",
            "reply(tool_use)",
            "started(toolu_0_0#1)",
            "interrupt",
            "result(toolu_0_0)",
            "interrupted"
        ]
    );
    let (content, is_error) = result_of(&events, "toolu_0_0").expect("a result");
    assert!(is_error, "{content}");
    assert!(
        content.contains("interrupted") && content.contains("while it was running"),
        "{content}"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !process_gone(child) {
        assert!(
            std::time::Instant::now() < deadline,
            "the tool's child process {child} outlived the interrupt"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    let seq = user_says(&mut rig.client, "s1", "fine, stop there").await;
    let events = wait_idle(&mut rig.client, "s1", seq, Duration::from_secs(20)).await;
    assert_eq!(rig.standin.violations(), Vec::<String>::new());
    assert_exactly_once(&events);
    assert_eq!(
        std::fs::read_to_string(workspace.join("runs.txt")).expect("runs.txt"),
        "x\n",
        "the interrupted call never ran again"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn an_interrupt_with_no_runner_is_answered_by_the_next_without_running_anything() {
    let mut rig = Rig::start(vec![
        StandinReply::text("Working.")
            .tool("bash", json!({"command": "echo x >> runs.txt; sleep 300"})),
        StandinReply::text("Stopped."),
    ])
    .await;
    let mut first = rig.runner("r1", TTL_MS, &[]);
    user_says(&mut rig.client, "s1", "work").await;
    let runs = rig.workspaces.path().join("s1/runs.txt");
    wait_for_file(&runs, Duration::from_secs(20)).await;
    first.kill9();

    cancel(&rig.store, "s1", "stop");
    assert_eq!(status(&mut rig.client, "s1").await, SessionStatus::Runnable);
    let _second = rig.runner("r2", TTL_MS, &[]);
    let events = wait_for_log(&mut rig.client, "s1", Duration::from_secs(20), |events| {
        has(events, "interrupted")
    })
    .await;
    assert_eq!(
        kinds(&events),
        [
            "user",
            "reply(tool_use)",
            "started(toolu_0_0#1)",
            "interrupt",
            "result(toolu_0_0)",
            "interrupted"
        ]
    );
    let (content, _) = result_of(&events, "toolu_0_0").expect("a result");
    assert!(
        content.contains("may or may not have taken effect"),
        "{content}"
    );
    wait_status(
        &mut rig.client,
        "s1",
        SessionStatus::Idle,
        Duration::from_secs(5),
    )
    .await;
    assert_eq!(std::fs::read_to_string(&runs).expect("runs.txt"), "x\n");
}

#[tokio::test(flavor = "multi_thread")]
async fn interrupting_an_idle_session_is_harmless() {
    let mut rig = Rig::start(vec![
        StandinReply::text("Hello."),
        StandinReply::text("Hello again."),
    ])
    .await;
    let _runner = rig.runner("r1", TTL_MS, &[]);
    let seq = user_says(&mut rig.client, "s1", "hi").await;
    wait_idle(&mut rig.client, "s1", seq, Duration::from_secs(20)).await;

    cancel(&rig.store, "s1", "");
    wait_for_log(&mut rig.client, "s1", Duration::from_secs(10), |events| {
        has(events, "interrupted")
    })
    .await;
    wait_status(
        &mut rig.client,
        "s1",
        SessionStatus::Idle,
        Duration::from_secs(5),
    )
    .await;

    let seq = user_says(&mut rig.client, "s1", "still there?").await;
    let events = wait_idle(&mut rig.client, "s1", seq, Duration::from_secs(20)).await;
    assert_eq!(
        kinds(&events),
        [
            "user",
            "reply(end_turn)",
            "interrupt",
            "interrupted",
            "user",
            "reply(end_turn)"
        ]
    );
    assert_eq!(rig.standin.violations(), Vec::<String>::new());

    // A session that does not exist is not started by a cancel.
    let nothing = agentlog(&rig.store.url(), &["cancel", "nope"]);
    assert!(
        !nothing.success && nothing.stderr.contains("there is no session"),
        "{nothing:?}"
    );
    assert_eq!(
        status(&mut rig.client, "nope").await,
        SessionStatus::Unspecified
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn cancel_while_waiting_for_approval_closes_the_call_unrun() {
    let mut rig = Rig::start(vec![
        StandinReply::text("Deleting.").tool("bash", json!({"command": "echo ran > ran.txt"})),
        StandinReply::text("OK, I did not."),
    ])
    .await;
    let _runner = rig.runner("r1", TTL_MS, &["--approve", "bash"]);
    user_says(&mut rig.client, "s1", "clean up").await;
    wait_status(
        &mut rig.client,
        "s1",
        SessionStatus::Waiting,
        Duration::from_secs(20),
    )
    .await;

    cancel(&rig.store, "s1", "never mind");
    let events = wait_for_log(&mut rig.client, "s1", Duration::from_secs(10), |events| {
        has(events, "interrupted")
    })
    .await;
    assert_eq!(
        kinds(&events),
        [
            "user",
            "reply(tool_use)",
            "approval_requested(toolu_0_0)",
            "interrupt",
            "result(toolu_0_0)",
            "interrupted"
        ]
    );
    let (content, is_error) = result_of(&events, "toolu_0_0").expect("a result");
    assert!(
        is_error && content.contains("waited for approval"),
        "{content}"
    );
    wait_status(
        &mut rig.client,
        "s1",
        SessionStatus::Idle,
        Duration::from_secs(5),
    )
    .await;
    // The request is closed: a late approval is refused and nothing runs.
    let late = agentlog(&rig.store.url(), &["approve", "s1", "toolu_0_0"]);
    assert!(!late.success, "a late approval is refused");
    assert!(
        late.stderr.contains("not waiting for approval"),
        "{}",
        late.stderr
    );
    assert!(!rig.workspaces.path().join("s1/ran.txt").exists());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_half_written_answer_is_finished_by_the_next_runner_without_running_anything() {
    let mut rig = Rig::start(vec![StandinReply::text("Never asked.")]).await;
    user_says(&mut rig.client, "s1", "two jobs").await;
    // The log a runner leaves when it dies answering an interrupt: a reply with two calls,
    // the interrupt, and the first call closed under that runner's lease.
    let lease = rig
        .client
        .acquire_lease(AcquireLeaseRequest {
            session_id: "s1".into(),
            owner: "dead-runner".into(),
            ttl_ms: 60_000,
        })
        .await
        .expect("lease")
        .into_inner();
    let call = |id: &str| ContentBlock {
        block: Some(Block::ToolUse(ToolUseBlock {
            id: id.into(),
            name: "bash".into(),
            input: None,
        })),
    };
    let runner_event = |event_id: &str, kind: Kind| Event {
        event_id: event_id.into(),
        kind: Some(kind),
        ..Event::default()
    };
    let append = |events: Vec<Event>, lease_epoch: Option<u64>| AppendRequest {
        session_id: "s1".into(),
        events,
        lease_epoch,
        ..AppendRequest::default()
    };
    rig.client
        .append(append(
            vec![runner_event(
                "reply:0",
                Kind::AssistantMessage(AssistantMessage {
                    content: vec![call("toolu_0_0"), call("toolu_0_1")],
                    stop_reason: "tool_use".into(),
                    ..AssistantMessage::default()
                }),
            )],
            Some(lease.epoch),
        ))
        .await
        .expect("reply");
    rig.client
        .append(append(
            vec![runner_event(
                "interrupt:1",
                Kind::Interrupt(Interrupt {
                    reason: "stop".into(),
                }),
            )],
            None,
        ))
        .await
        .expect("interrupt");
    rig.client
        .append(append(
            vec![runner_event(
                "result:toolu_0_0",
                Kind::ToolResult(ToolResult {
                    tool_use_id: "toolu_0_0".into(),
                    content: "interrupted by the user (stop) before it started; it never ran"
                        .into(),
                    is_error: true,
                    workspace_checkpoint: None,
                    served_from: None,
                }),
            )],
            Some(lease.epoch),
        ))
        .await
        .expect("first closing result");
    rig.client
        .release_lease(ReleaseLeaseRequest {
            session_id: "s1".into(),
            owner: "dead-runner".into(),
            epoch: lease.epoch,
        })
        .await
        .expect("release");

    let _runner = rig.runner("r1", TTL_MS, &[]);
    let events = wait_for_log(&mut rig.client, "s1", Duration::from_secs(20), |events| {
        has(events, "interrupted")
    })
    .await;
    assert_eq!(
        kinds(&events),
        [
            "user",
            "reply(tool_use)",
            "interrupt",
            "result(toolu_0_0)",
            "result(toolu_0_1)",
            "interrupted"
        ]
    );
    wait_status(
        &mut rig.client,
        "s1",
        SessionStatus::Idle,
        Duration::from_secs(5),
    )
    .await;
    assert!(rig.standin.requests().is_empty(), "the model was not asked");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_user_turn_sent_between_an_interrupt_and_its_answer_is_worked_after_it() {
    let mut rig = Rig::start(vec![
        StandinReply::text("Hello."),
        StandinReply::text("Here is the next one."),
    ])
    .await;
    let mut runner = rig.runner("r1", TTL_MS, &[]);
    let seq = user_says(&mut rig.client, "s1", "hi").await;
    wait_idle(&mut rig.client, "s1", seq, Duration::from_secs(20)).await;
    runner.kill9();

    // The interrupt, then a new user turn, then the answer to the interrupt, written by a
    // runner that stops right after it (here: by hand, under a lease, as a runner writes it).
    cancel(&rig.store, "s1", "stop");
    let client = &mut rig.client;
    let interrupt_seq = user_says(client, "s1", "do the next one instead").await - 1;
    let lease = client
        .acquire_lease(AcquireLeaseRequest {
            session_id: "s1".into(),
            owner: "answering-runner".into(),
            ttl_ms: 60_000,
        })
        .await
        .expect("lease")
        .into_inner();
    client
        .append(AppendRequest {
            session_id: "s1".into(),
            events: vec![Event {
                event_id: format!("interrupted:{interrupt_seq}"),
                kind: Some(Kind::Interrupted(agentlog_proto::v1::Interrupted {
                    reason: "stop".into(),
                })),
                ..Event::default()
            }],
            lease_epoch: Some(lease.epoch),
            ..AppendRequest::default()
        })
        .await
        .expect("append interrupted");
    client
        .release_lease(ReleaseLeaseRequest {
            session_id: "s1".into(),
            owner: "answering-runner".into(),
            epoch: lease.epoch,
        })
        .await
        .expect("release");
    assert_eq!(
        status(client, "s1").await,
        SessionStatus::Runnable,
        "the user turn after the interrupt is work"
    );

    // Whichever runner claims the session next answers that turn.
    let _runner = rig.runner("r2", TTL_MS, &[]);
    let events = wait_idle(
        &mut rig.client,
        "s1",
        interrupt_seq + 2,
        Duration::from_secs(20),
    )
    .await;
    assert_eq!(
        kinds(&events),
        [
            "user",
            "reply(end_turn)",
            "interrupt",
            "user",
            "interrupted",
            "reply(end_turn)"
        ]
    );
    assert_eq!(rig.standin.violations(), Vec::<String>::new());
}
