//! The network between a runner and the store cut mid-tool: runner A reaches the store
//! only through a TCP proxy, which blackholes every connection while A runs a slow,
//! side-effecting bash call. A's lease lapses (A stops the call on its own clock), runner B
//! takes the session over and re-runs the call under a newer epoch. Then the network heals
//! (with connection resets, at random moments too): A reconnects, and writes nothing; the
//! session finishes with every side effect applied once.

mod fault_support;
mod runner_support;

use std::time::Duration;

use agentlog_proto::v1::{event::Kind, GetSessionRequest};
use fault_support::{Faults, TcpProxy};
use integration_tests::anthropic_standin::{AnthropicStandin, StandinReply};
use integration_tests::{poll_until, Store};
use runner_support::*;
use serde_json::json;

const SESSION: &str = "cut-off";
const TTL_MS: u64 = 1200;

fn script() -> Vec<StandinReply> {
    vec![
        StandinReply::text("A slow step with a side effect.").tool(
            "bash",
            json!({"command": "sleep 3; echo \"$IDEMPOTENCY_KEY\" >> keys.txt"}),
        ),
        StandinReply::text("A quick one.").tool(
            "bash",
            json!({"command": "echo \"$IDEMPOTENCY_KEY\" >> keys.txt"}),
        ),
        StandinReply::text("Both steps are done.").slow(10),
    ]
}

/// Waits until the slow call's `tool_started` of `attempt` is logged; returns the log.
async fn wait_for_start(
    client: &mut agentlog_proto::v1::event_store_client::EventStoreClient<
        tonic::transport::Channel,
    >,
    attempt: u32,
) -> Vec<agentlog_proto::v1::Event> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let events = history(client, SESSION).await;
        let started = events.iter().any(|e| {
            matches!(&e.kind, Some(Kind::ToolStarted(s)) if s.tool_use_id == "toolu_0_0" && s.attempt == attempt)
        });
        if started {
            return events;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "attempt {attempt} of the slow call never started: {:?}",
            kinds(&events)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cut_runner_loses_its_lease_and_writes_nothing_after_reconnecting() {
    let store = Store::start().expect("store");
    let proxy = TcpProxy::start(store.addr).await;
    let standin = AnthropicStandin::start(script()).await.expect("stand-in");
    let workspaces = tempfile::tempdir().expect("temp dir");
    let faults = Faults::default();
    let mut client = store.client().await.expect("client");
    user_says(&mut client, SESSION, SESSION).await;

    let mut a = start_runner(
        &proxy.url(),
        "runner-a",
        workspaces.path(),
        &standin.url(),
        TTL_MS,
        2,
    );
    // A is in the slow call: cut it off.
    let started = wait_for_start(&mut client, 1).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    proxy.set_blackhole(true);
    faults.add("blackhole");
    let cut_seq = started.last().map_or(0, |e| e.seq);
    let epoch_a = client
        .get_session(GetSessionRequest {
            session_id: SESSION.into(),
        })
        .await
        .expect("get session")
        .into_inner()
        .lease
        .map_or(0, |l| l.epoch);
    assert!(epoch_a > 0, "runner A held a lease when it was cut off");

    let mut b = start_runner(
        &store.url(),
        "runner-b",
        workspaces.path(),
        &standin.url(),
        TTL_MS,
        2,
    );
    wait_for_start(&mut client, 2).await;

    // Heal while B is still working, resetting A's hung connections, then a few more resets.
    let accepted_before = proxy.accepted();
    proxy.set_blackhole(false);
    proxy.reset_all();
    faults.add("connection_reset");
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(fastrand::u64(100..500))).await;
        proxy.reset_all();
        faults.add("connection_reset");
    }
    poll_until("runner A reconnects", Duration::from_secs(30), || {
        (proxy.accepted() > accepted_before).then_some(())
    });

    let finished = wait_idle(&mut client, SESSION, 0, Duration::from_secs(60)).await;
    // A stays connected for a few lease periods: it must write nothing.
    tokio::time::sleep(Duration::from_millis(3 * TTL_MS)).await;
    let events = history(&mut client, SESSION).await;
    assert_eq!(
        events, finished,
        "nothing was written after the session finished"
    );
    assert!(a.is_running(), "runner A survived the cut");

    // After the cut, no streamed text came from A's epoch (turn ids are turn.epoch.attempt).
    for event in events.iter().filter(|e| e.seq > cut_seq) {
        if let Some(Kind::AssistantDelta(d)) = &event.kind {
            let epoch: u64 = d
                .turn_id
                .split('.')
                .nth(1)
                .and_then(|e| e.parse().ok())
                .unwrap_or(0);
            assert!(
                epoch > epoch_a,
                "seq {} was streamed under A's epoch {epoch_a}",
                event.seq
            );
        }
    }
    let starts = assert_exactly_once(&events);
    assert_eq!(
        starts.get("toolu_0_0"),
        Some(&2),
        "A's attempt, then B's: {:?}",
        kinds(&events)
    );
    let keys = key_counts(workspaces.path(), SESSION);
    for id in tool_use_ids(&events) {
        let key = format!("{SESSION}/{id}");
        assert_eq!(
            keys.get(&key),
            Some(&1),
            "{key}'s side effect applied once: {keys:?}"
        );
    }
    assert_eq!(standin.violations(), Vec::<String>::new());
    a.kill9();
    b.kill9();
    faults.report(
        "a_cut_runner_loses_its_lease_and_writes_nothing_after_reconnecting",
        &format!(
            "B took over from epoch {epoch_a}, A reconnected and wrote nothing, each side effect once ({} events)",
            events.len()
        ),
    );
}
