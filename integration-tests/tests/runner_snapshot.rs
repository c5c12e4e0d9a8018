//! Cold resume from the fold's snapshot, with the real store and runner (the Anthropic
//! stand-in plays the model and checks every request is verbatim and well paired): a runner
//! that never saw a long session starts from the snapshot another runner left in the store
//! and asks the model for the right turn with the whole conversation; a snapshot that does
//! not decode or is of another fold version is ignored and the log is folded from seq 1.

mod runner_support;

use std::time::{Duration, Instant};

use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::{
    event::Kind, AcquireLeaseRequest, Event, GetSessionRequest, GetSnapshotRequest,
    ReleaseLeaseRequest, SnapshotChunk,
};
use integration_tests::anthropic_standin::{AnthropicStandin, StandinReply};
use runner_support::*;
use serde_json::json;
use tonic::transport::Channel;

const TTL_MS: u64 = 1500;
const LIMIT: Duration = Duration::from_secs(60);
/// The runner's snapshot format (`runner::fold::snapshot::FORMAT`).
const FORMAT: &str = "runner-fold";
const RESUMED: &str = "resuming from the fold's snapshot";
const IGNORED: &str = "ignoring the fold's snapshot";

/// Text replies, with a `bash` call every fifth turn (its result is part of the fold).
fn replies(n: usize) -> Vec<StandinReply> {
    (0..n)
        .map(|i| {
            let reply = StandinReply::text(&format!("reply {i}"));
            if i % 5 == 2 {
                reply.tool("bash", json!({"command": format!("echo call {i}")}))
            } else {
                reply
            }
        })
        .collect()
}

fn assistant_turns(events: &[Event]) -> usize {
    events
        .iter()
        .filter(|e| matches!(e.kind, Some(Kind::AssistantMessage(_))))
        .count()
}

/// The seq of the session's snapshot in the store, if any.
async fn snapshot_seq(client: &mut EventStoreClient<Channel>, session: &str) -> Option<u64> {
    let request = GetSnapshotRequest {
        session_id: session.into(),
        format: FORMAT.into(),
    };
    match client.get_snapshot(request).await {
        Ok(stream) => Some(
            stream
                .into_inner()
                .message()
                .await
                .expect("read the snapshot")
                .expect("a first chunk")
                .seq,
        ),
        Err(status) if status.code() == tonic::Code::NotFound => None,
        Err(status) => panic!("GetSnapshot: {status:?}"),
    }
}

/// Waits until no lease is held on the session (the runner let it go).
async fn wait_released(client: &mut EventStoreClient<Channel>, session: &str) {
    let deadline = Instant::now() + LIMIT;
    loop {
        let info = client
            .get_session(GetSessionRequest {
                session_id: session.into(),
            })
            .await
            .expect("get session")
            .into_inner();
        if info.lease.is_none() {
            return;
        }
        assert!(Instant::now() < deadline, "{session} still leased");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One user turn answered; returns the log.
async fn round(client: &mut EventStoreClient<Channel>, session: &str, text: &str) -> Vec<Event> {
    let seq = user_says(client, session, text).await;
    wait_idle(client, session, seq, LIMIT).await
}

/// The last model request was served, asked for the turn the log says is next (every
/// earlier reply was in it: the stand-in checks them verbatim), and nothing was refused.
fn assert_right_request(standin: &AnthropicStandin, events: &[Event]) {
    assert_eq!(standin.violations(), Vec::<String>::new());
    let last = standin.requests().pop().expect("a model request");
    assert_eq!(last.served, "reply");
    assert_eq!(
        last.turn,
        assistant_turns(events) - 1,
        "the request carried every earlier reply"
    );
    assert_exactly_once(events);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cold_runner_resumes_a_long_session_from_the_snapshot() {
    let rig = Rig::start(replies(40)).await;
    let mut client = rig.client.clone();
    let standin = &rig.standin;
    let session = "snap-long";
    let every = ["--snapshot-every", "20"];

    let first = rig.runner("r1", TTL_MS, &every);
    let mut events = Vec::new();
    for i in 0..12 {
        events = round(&mut client, session, &format!("message {i}")).await;
    }
    wait_released(&mut client, session).await;
    let kept = snapshot_seq(&mut client, session)
        .await
        .expect("the runner kept a snapshot of the long session");
    let last = events.last().expect("events").seq;
    assert!(
        (20..=last).contains(&kept),
        "snapshot at {kept}, log at {last}"
    );
    assert!(first.log_lines(RESUMED).is_empty(), "r1 never needed one");
    drop(first);

    let second = rig.runner("r2", TTL_MS, &every);
    let events = round(&mut client, session, "and after the restart").await;
    let resumed = second.log_lines(RESUMED);
    assert_eq!(resumed.len(), 1, "r2 started from the snapshot once");
    assert!(resumed[0].contains(&format!("seq={kept}")), "{resumed:?}");
    assert_right_request(standin, &events);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_garbage_or_old_version_snapshot_is_ignored() {
    let rig = Rig::start(replies(40)).await;
    let mut client = rig.client.clone();
    let standin = &rig.standin;
    let session = "snap-bad";

    let builder = rig.runner("r0", TTL_MS, &["--snapshot-every", "0"]);
    for i in 0..4 {
        round(&mut client, session, &format!("message {i}")).await;
    }
    wait_released(&mut client, session).await;
    assert_eq!(snapshot_seq(&mut client, session).await, None);
    drop(builder);

    // A record that is not a fold, and a fold record of version 99 (field 1 = 99).
    let bad: [(&str, Vec<u8>); 2] = [
        ("garbage", b"\xff\xff\xff this is not a fold".to_vec()),
        ("old version", vec![0x08, 99]),
    ];
    for (i, (what, data)) in bad.into_iter().enumerate() {
        let last = history(&mut client, session).await.last().unwrap().seq;
        let epoch = client
            .acquire_lease(AcquireLeaseRequest {
                session_id: session.into(),
                owner: "test".into(),
                ttl_ms: 60_000,
            })
            .await
            .expect("lease")
            .into_inner()
            .epoch;
        let chunk = SnapshotChunk {
            session_id: session.into(),
            lease_epoch: epoch,
            seq: last,
            format: FORMAT.into(),
            data: data.into(),
        };
        client
            .put_snapshot(tokio_stream::iter([chunk]))
            .await
            .expect("put the bad snapshot");
        client
            .release_lease(ReleaseLeaseRequest {
                session_id: session.into(),
                owner: "test".into(),
                epoch,
            })
            .await
            .expect("release");

        let runner = rig.runner(&format!("r{}", i + 1), TTL_MS, &["--snapshot-every", "1"]);
        let events = round(&mut client, session, &format!("after the {what}")).await;
        assert_eq!(runner.log_lines(IGNORED).len(), 1, "{what} was ignored");
        assert!(runner.log_lines(RESUMED).is_empty(), "{what} was not used");
        assert_right_request(standin, &events);
        // It put a good snapshot in its place.
        wait_released(&mut client, session).await;
        assert!(snapshot_seq(&mut client, session).await > Some(last));
    }
}
