//! The store SIGKILLed while a runner is mid-session — during a tool, mid-stream, right
//! after a tool result — and restarted on the same address each time. The runner rides it
//! out (its appends and reads retry with backoff, its lease outlives the outage), the
//! session finishes, every event anyone saw before a kill is still in the log unchanged,
//! and no tool ran twice.

mod fault_support;
mod runner_support;

use std::time::Duration;

use agentlog_proto::v1::{event::Kind, Event, SubscribeRequest};
use fault_support::Faults;
use integration_tests::anthropic_standin::{AnthropicStandin, StandinReply};
use integration_tests::Store;
use prost::Message;
use runner_support::*;
use serde_json::json;
use tokio_stream::StreamExt;

const SESSION: &str = "store-dies";
/// Long enough to outlive an outage of the store, short enough to matter.
const TTL_MS: u64 = 6000;

fn script() -> Vec<StandinReply> {
    let mut replies: Vec<StandinReply> = (0..4)
        .map(|i| {
            StandinReply::text(&format!("Step {i}: recording my idempotency key now."))
                .slow(25)
                .tool(
                    "bash",
                    json!({"command": "sleep 0.4; echo \"$IDEMPOTENCY_KEY\" >> keys.txt"}),
                )
        })
        .collect();
    replies.push(StandinReply::text("All steps are recorded.").slow(25));
    replies
}

/// Where to kill the store: a name, the event that marks the moment, a delay after it.
type KillPoint = (&'static str, fn(&Event) -> bool, Duration);

/// Follows the session from `from` until an event matches; returns what it saw, through
/// the match. Empty if the session went idle first.
async fn watch_for(url: &str, from: u64, matches: fn(&Event) -> bool) -> Vec<Event> {
    let mut client =
        agentlog_proto::v1::event_store_client::EventStoreClient::connect(url.to_string())
            .await
            .expect("connect");
    let mut stream = client
        .subscribe(SubscribeRequest {
            session_id: SESSION.into(),
            from_seq: from,
            follow: true,
        })
        .await
        .expect("subscribe")
        .into_inner();
    let mut seen = Vec::new();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    while let Ok(Some(Ok(event))) = tokio::time::timeout_at(deadline, stream.next()).await {
        let hit = matches(&event);
        let done =
            matches!(&event.kind, Some(Kind::AssistantMessage(m)) if m.stop_reason == "end_turn");
        seen.push(event);
        if hit {
            return seen;
        }
        if done {
            return Vec::new();
        }
    }
    Vec::new()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_runner_rides_out_store_kills_and_the_session_finishes_exactly_once() {
    let data = tempfile::tempdir().expect("temp dir");
    let mut store = Store::start_in(data.path()).expect("store");
    let listen = store.addr.to_string();
    let url = store.url();
    let standin = AnthropicStandin::start(script()).await.expect("stand-in");
    let workspaces = tempfile::tempdir().expect("temp dir");
    let faults = Faults::default();
    let mut client = store.client().await.expect("client");
    user_says(&mut client, SESSION, SESSION).await;
    let mut runner = start_runner(&url, "rider", workspaces.path(), &standin.url(), TTL_MS, 2);

    let points: [KillPoint; 4] = [
        (
            "during_a_tool",
            |e| matches!(e.kind, Some(Kind::ToolStarted(_))),
            Duration::from_millis(150),
        ),
        (
            "mid_stream",
            |e| matches!(e.kind, Some(Kind::AssistantDelta(_))),
            Duration::ZERO,
        ),
        (
            "after_a_tool_result",
            |e| matches!(e.kind, Some(Kind::ToolResult(_))),
            Duration::ZERO,
        ),
        (
            "during_a_tool",
            |e| matches!(e.kind, Some(Kind::ToolStarted(_))),
            Duration::from_millis(300),
        ),
    ];
    // Everything seen before each kill: it was acknowledged, so it must survive.
    let mut seen: Vec<Event> = Vec::new();
    for (point, matches, delay) in points {
        let from = seen.last().map_or(1, |e| e.seq + 1);
        let events = watch_for(&url, from, matches).await;
        if events.is_empty() {
            break; // finished before this point came
        }
        seen.extend(events);
        tokio::time::sleep(delay).await;
        store.kill9();
        faults.add(&format!("store_sigkill_{point}"));
        tokio::time::sleep(Duration::from_millis(800)).await;
        store = Store::start_on(data.path(), &listen).expect("restart the store");
    }
    let kills: usize = ["during_a_tool", "mid_stream", "after_a_tool_result"]
        .iter()
        .map(|p| faults.count(&format!("store_sigkill_{p}")))
        .sum();
    assert!(kills >= 3, "the store was killed only {kills} times");

    let mut client = store.client().await.expect("client");
    let events = wait_idle(&mut client, SESSION, 0, Duration::from_secs(90)).await;
    assert!(
        runner.is_running(),
        "the runner survived the store's deaths"
    );

    for before in &seen {
        let after = events.iter().find(|e| e.seq == before.seq);
        assert!(
            after.is_some_and(|a| a.encode_to_vec() == before.encode_to_vec()),
            "seq {} was seen before a kill and must be in the log unchanged",
            before.seq
        );
    }
    let starts = assert_exactly_once(&events);
    let keys = key_counts(workspaces.path(), SESSION);
    let ids = tool_use_ids(&events);
    assert_eq!(ids.len(), 4, "four tool calls: {:?}", kinds(&events));
    for id in &ids {
        let key = format!("{SESSION}/{id}");
        assert_eq!(keys.get(&key), Some(&1), "{key} ran exactly once: {keys:?}");
        assert_eq!(
            starts.get(id),
            Some(&1),
            "{id} was started once: {:?}",
            kinds(&events)
        );
    }
    assert_eq!(standin.violations(), Vec::<String>::new());
    runner.kill9();
    faults.report(
        "the_runner_rides_out_store_kills_and_the_session_finishes_exactly_once",
        &format!(
            "session finished ({} events), {} seen-before-kill events intact, each of {} tools ran once",
            events.len(),
            seen.len(),
            ids.len()
        ),
    );
}
