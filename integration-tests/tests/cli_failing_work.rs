//! What a person reads of work that keeps failing, against the real `event-store` and
//! `agentlog` (either backend: `AGENTLOG_TEST_BACKEND`): `agentlog ls` says a parked
//! session is parked and when its next model call is due, and a paused one that it is
//! paused, why, and how to go on (a call waiting for an approval stays `waiting`);
//! `ls --json` carries `notBeforeUnixMs`; `agentlog show` says each retry, which model a
//! fallback reply stood in for, and the pause. The runner's events are appended here under
//! a lease, as a runner appends them; and, with a real runner on the Anthropic stand-in,
//! `agentlog send --fallback-model … --budget calls=1` streams the retries, the fallback's
//! reply and the pause, and returns at the pause.

mod runner_support;

use std::process::{Command, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::{
    content_block::Block, event::Kind, AcquireLeaseRequest, AppendRequest, ApprovalRequested,
    AssistantMessage, Budget, ContentBlock, Event, ModelRetry, ReleaseLeaseRequest, RunPaused,
    SessionConfig, TextBlock, ToolResult, ToolStarted, ToolUseBlock, UserMessage,
};
use integration_tests::anthropic_standin::{Fault, StandinReply};
use integration_tests::standin::FaultPlan;
use integration_tests::{bin_path, Store};
use runner_support::Rig;
use serde_json::Value;
use tonic::transport::Channel;

type Client = EventStoreClient<Channel>;

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

fn agentlog(store: &Store, args: &[&str]) -> String {
    let out = Command::new(bin_path("agentlog"))
        .args(["--addr", &store.url()])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run agentlog");
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "agentlog {args:?} failed: {}{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
}

fn event(id: &str, kind: Kind) -> Event {
    Event {
        event_id: id.into(),
        kind: Some(kind),
        ..Event::default()
    }
}

/// A client's append (no lease).
async fn client_append(client: &mut Client, session: &str, events: Vec<Event>) {
    client
        .append(AppendRequest {
            session_id: session.into(),
            events,
            ..AppendRequest::default()
        })
        .await
        .expect("a client append");
}

/// A runner's append: leased, written, let go.
async fn runner_append(client: &mut Client, session: &str, events: Vec<Event>) {
    let lease = client
        .acquire_lease(AcquireLeaseRequest {
            session_id: session.into(),
            owner: "r1".into(),
            ttl_ms: 30_000,
        })
        .await
        .expect("lease")
        .into_inner();
    client
        .append(AppendRequest {
            session_id: session.into(),
            lease_epoch: Some(lease.epoch),
            events,
            ..AppendRequest::default()
        })
        .await
        .expect("a runner append");
    client
        .release_lease(ReleaseLeaseRequest {
            session_id: session.into(),
            owner: "r1".into(),
            epoch: lease.epoch,
        })
        .await
        .expect("release");
}

fn user(id: &str, text: &str) -> Event {
    event(id, Kind::UserMessage(UserMessage { text: text.into() }))
}

fn retry(id: &str, attempt: u32, model: &str, retry_at_unix_ms: i64) -> Event {
    event(
        id,
        Kind::ModelRetry(ModelRetry {
            turn: 0,
            attempt,
            model: model.into(),
            reason: "rate_limited".into(),
            message: "HTTP 429".into(),
            retry_at_unix_ms,
        }),
    )
}

fn call(id: &str, model: &str, text: &str, tool_use_id: &str) -> Event {
    event(
        id,
        Kind::AssistantMessage(AssistantMessage {
            content: vec![
                ContentBlock {
                    block: Some(Block::Text(TextBlock { text: text.into() })),
                },
                ContentBlock {
                    block: Some(Block::ToolUse(ToolUseBlock {
                        id: tool_use_id.into(),
                        name: "bash".into(),
                        input: None,
                    })),
                },
            ],
            stop_reason: "tool_use".into(),
            model: model.into(),
            ..AssistantMessage::default()
        }),
    )
}

#[tokio::test]
async fn ls_says_parked_and_paused_and_show_says_which_model_stood_in() {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("connect");
    let due = now_ms() + 3_600_000;

    // Parked: the next call is an hour away.
    client_append(
        &mut client,
        "parked",
        vec![user("u1", "summarise the report")],
    )
    .await;
    runner_append(
        &mut client,
        "parked",
        vec![retry("retry:1", 1, "anthropic:big", due)],
    )
    .await;

    // Paused: a fallback answered after two retries, then the run reached its budget.
    let config = event(
        "config",
        Kind::SessionConfig(SessionConfig {
            model: "anthropic:big".into(),
            fallback_models: vec!["openai:small".into()],
            budget: Some(Budget {
                max_model_calls: 1,
                ..Budget::default()
            }),
            ..SessionConfig::default()
        }),
    );
    client_append(
        &mut client,
        "paused",
        vec![config, user("u1", "tidy the workspace")],
    )
    .await;
    let now = now_ms();
    runner_append(
        &mut client,
        "paused",
        vec![
            retry("retry:1", 1, "anthropic:big", now),
            retry("retry:2", 2, "anthropic:big", now),
            call(
                "reply:1",
                "small-2025-01-01",
                "Listing it first.",
                "toolu_1",
            ),
            event(
                "started:1",
                Kind::ToolStarted(ToolStarted {
                    tool_use_id: "toolu_1".into(),
                    idempotency_key: "paused/toolu_1".into(),
                    attempt: 1,
                }),
            ),
            event(
                "result:1",
                Kind::ToolResult(ToolResult {
                    tool_use_id: "toolu_1".into(),
                    content: "report.txt".into(),
                    ..ToolResult::default()
                }),
            ),
            event(
                "paused",
                Kind::RunPaused(RunPaused {
                    reason: "budget".into(),
                    detail: "max_model_calls 1 reached (1 replies)".into(),
                }),
            ),
        ],
    )
    .await;

    // Waiting for a person's yes: waiting, not paused.
    client_append(&mut client, "asks", vec![user("u1", "clean up")]).await;
    runner_append(
        &mut client,
        "asks",
        vec![
            call("reply:1", "anthropic:big", "", "toolu_1"),
            event(
                "ask:1",
                Kind::ApprovalRequested(ApprovalRequested {
                    tool_use_id: "toolu_1".into(),
                    tool_name: "bash".into(),
                    reason: "bash needs a person's yes".into(),
                    ..ApprovalRequested::default()
                }),
            ),
        ],
    )
    .await;

    let listed = agentlog(&store, &["ls"]);
    let lines: Vec<&str> = listed.lines().collect();
    let row = |session: &str| {
        lines
            .iter()
            .position(|l| l.starts_with(&format!("{session} ")))
            .unwrap_or_else(|| panic!("{session} is listed:\n{listed}"))
    };
    let parked = row("parked");
    assert!(lines[parked].contains(" parked "), "{listed}");
    let words = lines[parked + 1].trim();
    assert!(
        words.starts_with("parked: the next model call is due in 59m")
            || words.starts_with("parked: the next model call is due in 1h"),
        "{listed}"
    );
    assert!(
        words.ends_with("(`agentlog cancel parked` stops waiting)"),
        "{listed}"
    );
    let paused = row("paused");
    assert!(lines[paused].contains(" paused "), "{listed}");
    assert_eq!(
        lines[paused + 1].trim(),
        "paused: the run reached its budget (max_model_calls 1 reached (1 replies)); the \
         session waits for you: `agentlog resume paused TEXT` goes on with a fresh run",
        "{listed}"
    );
    let asks = row("asks");
    assert!(lines[asks].contains(" waiting "), "{listed}");
    assert!(
        lines
            .get(asks + 1)
            .is_none_or(|next| !next.starts_with(' ')),
        "a wait for an approval has no pause to tell:\n{listed}"
    );

    // The JSON is SessionInfo's mapping: the due time is notBeforeUnixMs.
    let json = agentlog(&store, &["--json", "ls", "--query", "parked"]);
    let info: Value = serde_json::from_str(json.lines().next().expect("a line")).expect("JSON");
    assert_eq!(info["notBeforeUnixMs"], due.to_string(), "{json}");
    assert_eq!(info["status"], "SESSION_STATUS_RUNNABLE", "{json}");

    let shown = agentlog(&store, &["show", "paused"]);
    for said in [
        "(when its model keeps failing, a turn falls back to openai:small)",
        "(each run's budget: 1 model calls, the runner's tokens, the runner's seconds)",
        "  ! anthropic:big is rate limited (attempt 1): HTTP 429; the next call is due now",
        "  (reply by small-2025-01-01, a fallback of anthropic:big)",
        "(paused: the run reached its budget (max_model_calls 1 reached (1 replies)); the \
         session waits for you: `agentlog resume paused TEXT` goes on with a fresh run)",
    ] {
        assert!(shown.contains(said), "show says {said:?}:\n{shown}");
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn send_streams_the_retries_the_fallbacks_reply_and_the_pause_then_returns() {
    let rig = Rig::start(vec![
        StandinReply::text("Looking first.")
            .tool("bash", serde_json::json!({"command": "echo hi"})),
        StandinReply::text("Done."),
    ])
    .await;
    // The session's model is overloaded for its first two calls: the turn falls back.
    rig.standin.fail_model(
        "standin-1",
        FaultPlan::Calls(vec![
            Fault::Overloaded {
                retry_after_s: Some(0)
            };
            2
        ]),
    );
    let _runner = rig.runner("r1", 10_000, &["--fallback-model", "anthropic:standin-2"]);

    let sent = agentlog(
        &rig.store,
        &[
            "send",
            "--session",
            "s1",
            "--fallback-model",
            "anthropic:standin-2",
            "--budget",
            "calls=1",
            "look around",
        ],
    );
    for said in [
        "  ! anthropic:standin-1 is overloaded (attempt 1)",
        "  ! anthropic:standin-1 is overloaded (attempt 2)",
        "agent> Looking first.\n",
        "  (reply by standin-2, a fallback of anthropic:standin-1)\n",
        "(paused: the run reached its budget (max_model_calls 1 reached (1 replies)); the \
         session waits for you: `agentlog resume s1 TEXT` goes on with a fresh run)\n",
    ] {
        assert!(sent.contains(said), "send says {said:?}:\n{sent}");
    }
    assert!(
        !sent.contains("Done."),
        "the run paused before its next call:\n{sent}"
    );

    let listed = agentlog(&rig.store, &["ls"]);
    assert!(
        listed.contains("paused: the run reached its budget (max_model_calls 1 reached"),
        "{listed}"
    );
}
