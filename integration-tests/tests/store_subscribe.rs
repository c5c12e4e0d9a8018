//! Subscribe against the real `event-store`: history from a seq, the end of a history-only
//! stream, and `follow` (with grpcurl, as users follow a session) while several writers
//! append concurrently: every event exactly once, ascending, no gap, across the switch from
//! history to live.

use std::collections::BTreeMap;
use std::time::Duration;

use agentlog_proto::v1::{AppendRequest, GetSessionRequest, SubscribeRequest};
use integration_tests::{
    grpcurl, grpcurl_args, json_seqs, json_u64, read_log, user_event, GrpcurlChild, Store,
};
use serde_json::json;
use tonic::transport::Endpoint;

const APPEND: &str = "agentlog.v1.EventStore/Append";
const SUBSCRIBE: &str = "agentlog.v1.EventStore/Subscribe";
/// Bounds for waiting on things that must happen; generous, never assertions of speed.
const BOUND: Duration = Duration::from_secs(60);

fn append_text(store: &Store, session_id: &str, text: &str) -> u64 {
    let out = grpcurl(
        store.addr,
        APPEND,
        Some(
            &json!({ "session_id": session_id, "events": [{ "user_message": { "text": text } }] })
                .to_string(),
        ),
    );
    json_u64(&out.json()["seqs"][0])
}

#[test]
fn subscribe_from_a_seq_streams_the_rest_of_the_history_and_ends_at_the_tail() {
    let store = Store::start().unwrap();
    for i in 1..=5 {
        assert_eq!(append_text(&store, "h", &format!("m{i}")), i);
    }
    for (from_seq, expected) in [
        (0, vec![1, 2, 3, 4, 5]),
        (1, vec![1, 2, 3, 4, 5]),
        (3, vec![3, 4, 5]),
        (5, vec![5]),
        (6, vec![]),
        (1000, vec![]),
    ] {
        // -max-time only bounds a broken store: a history-only stream ends by itself, and
        // grpcurl then exits successfully (at the bound it would fail DeadlineExceeded).
        let out = grpcurl_args(
            store.addr,
            &["-max-time", "30"],
            SUBSCRIBE,
            Some(&json!({ "session_id": "h", "from_seq": from_seq }).to_string()),
        );
        assert!(out.success, "from_seq {from_seq}: {}", out.stderr);
        let events = out.json_stream();
        assert_eq!(json_seqs(&events), expected, "from_seq {from_seq}");
        for event in &events {
            let seq = json_u64(&event["seq"]);
            assert_eq!(event["userMessage"]["text"], format!("m{seq}"));
        }
    }
}

#[test]
fn subscribe_to_a_session_that_does_not_exist_is_an_empty_stream() {
    let store = Store::start().unwrap();
    append_text(&store, "exists", "x");
    let out = grpcurl_args(
        store.addr,
        &["-max-time", "30"],
        SUBSCRIBE,
        Some(r#"{"session_id":"nobody-here"}"#),
    );
    assert!(out.success, "{}", out.stderr);
    assert!(out.json_stream().is_empty(), "{}", out.stdout);
    // Looking did not create it.
    let out = grpcurl(
        store.addr,
        "agentlog.v1.EventStore/GetSession",
        Some(r#"{"session_id":"nobody-here"}"#),
    );
    assert_eq!(out.code().as_deref(), Some("NotFound"), "{}", out.stderr);
}

#[test]
fn follow_on_a_session_that_does_not_exist_yet_waits_for_its_first_event() {
    let store = Store::start().unwrap();
    // -v prints "Response headers received" once the store has accepted the stream.
    let mut follower = GrpcurlChild::spawn(
        store.addr,
        &["-v", "-max-time", "120"],
        SUBSCRIBE,
        r#"{"session_id":"later","follow":true}"#,
    );
    follower.wait_for_output("Response headers received", BOUND);

    // The empty stream stays open (without follow it would have ended here) and delivers
    // the session's events as they come.
    assert_eq!(append_text(&store, "later", "first"), 1);
    append_text(&store, "other", "not for this follower");
    assert_eq!(append_text(&store, "later", "second"), 2);
    let events = follower.wait_for_messages(2, BOUND);
    assert_eq!(json_seqs(&events), vec![1, 2]);
    assert_eq!(events[0]["userMessage"]["text"], "first");
    assert_eq!(events[1]["userMessage"]["text"], "second");
    assert!(
        !follower.exited(),
        "a follow stream stays open after the events"
    );
}

/// A grpcurl follower (from seq 0, so history then live) and a tonic follower (from the
/// middle) while 2 grpcurl writers and 3 tonic writers append concurrently.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn follow_sees_every_event_of_concurrent_writers_exactly_once_in_order() {
    const SESSION: &str = "busy";
    const HISTORY: u64 = 10;
    const GRPCURL_WRITERS: usize = 2;
    const GRPCURL_APPENDS: usize = 6;
    const TONIC_WRITERS: usize = 3;
    const TONIC_APPENDS: usize = 60;
    let store = Store::start().unwrap();
    let mut client = store.client().await.unwrap();
    let mut acked: BTreeMap<u64, String> = BTreeMap::new();
    for i in 0..HISTORY {
        let id = format!("history-{i}");
        let resp = client
            .append(AppendRequest {
                session_id: SESSION.into(),
                events: vec![user_event(&id, "history")],
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        acked.insert(resp.seqs[0], id);
    }

    let mut follower = GrpcurlChild::spawn(
        store.addr,
        &["-max-time", "180"],
        SUBSCRIBE,
        &json!({ "session_id": SESSION, "follow": true }).to_string(),
    );
    // Once the history is out, everything else reaches this follower live.
    let mut follower = tokio::task::spawn_blocking(move || {
        follower.wait_for_messages(HISTORY as usize, BOUND);
        follower
    })
    .await
    .unwrap();

    let mut tonic_follower = client
        .subscribe(SubscribeRequest {
            session_id: SESSION.into(),
            from_seq: 7,
            follow: true,
        })
        .await
        .unwrap()
        .into_inner();

    let mut writers = Vec::new();
    for w in 0..GRPCURL_WRITERS {
        let addr = store.addr;
        writers.push(tokio::task::spawn_blocking(move || {
            let mut acked = Vec::new();
            for i in 0..GRPCURL_APPENDS {
                let id = format!("grpcurl-{w}-{i}");
                let request = json!({ "session_id": SESSION,
                    "events": [{ "event_id": id, "user_message": { "text": "via grpcurl" } }] });
                let out = grpcurl(addr, APPEND, Some(&request.to_string())).json();
                acked.push((json_u64(&out["seqs"][0]), id));
            }
            acked
        }));
    }
    for w in 0..TONIC_WRITERS {
        let mut client = store.client().await.unwrap();
        writers.push(tokio::spawn(async move {
            let mut acked = Vec::new();
            for i in 0..TONIC_APPENDS {
                // Batches of 1 to 4 events.
                let ids: Vec<String> = (0..=(i % 4))
                    .map(|j| format!("tonic-{w}-{i}-{j}"))
                    .collect();
                let resp = client
                    .append(AppendRequest {
                        session_id: SESSION.into(),
                        events: ids.iter().map(|id| user_event(id, "via tonic")).collect(),
                        ..Default::default()
                    })
                    .await
                    .expect("append")
                    .into_inner();
                acked.extend(resp.seqs.into_iter().zip(ids));
            }
            acked
        }));
    }
    for writer in writers {
        for (seq, id) in writer.await.unwrap() {
            assert!(
                acked.insert(seq, id).is_none(),
                "seq {seq} acknowledged twice"
            );
        }
    }
    let total = acked.len() as u64;
    assert_eq!(
        acked.keys().copied().collect::<Vec<_>>(),
        (1..=total).collect::<Vec<_>>()
    );

    let seen = tokio::task::spawn_blocking(move || {
        let seen = follower.wait_for_messages(total as usize, BOUND);
        (seen, follower)
    })
    .await
    .unwrap();
    let (seen, mut follower) = seen;
    assert_eq!(
        json_seqs(&seen),
        (1..=total).collect::<Vec<_>>(),
        "grpcurl follower"
    );
    for event in &seen {
        let seq = json_u64(&event["seq"]);
        assert_eq!(
            event["eventId"].as_str(),
            Some(acked[&seq].as_str()),
            "seq {seq}"
        );
    }
    assert!(!follower.exited(), "the follow stream is still open");

    let mut tonic_seen = Vec::new();
    while (tonic_seen.len() as u64) < total - 6 {
        let event = tokio::time::timeout(BOUND, tonic_follower.message())
            .await
            .expect("tonic follower stalled")
            .unwrap()
            .expect("tonic follower ended");
        assert_eq!(
            Some(&event.event_id),
            acked.get(&event.seq),
            "seq {}",
            event.seq
        );
        tonic_seen.push(event.seq);
    }
    assert_eq!(
        tonic_seen,
        (7..=total).collect::<Vec<_>>(),
        "tonic follower from seq 7"
    );
}

/// A follower that stops reading never holds up appends (they all complete while it is
/// stalled, far past its live buffer), and when it reads again it catches up from disk:
/// every event, in order, no gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_follower_never_blocks_appends_and_catches_up_without_gaps() {
    const APPENDS: u64 = 1500; // more separately committed batches than the live buffer holds
    let store = Store::start().unwrap();
    // A tiny HTTP/2 window: the store can push little before the stalled reader blocks it.
    let channel = Endpoint::from_shared(store.url())
        .unwrap()
        .initial_stream_window_size(Some(65_535))
        .initial_connection_window_size(Some(65_535))
        .connect()
        .await
        .unwrap();
    let mut slow_client = agentlog_proto::v1::event_store_client::EventStoreClient::new(channel);
    let mut stalled = slow_client
        .subscribe(SubscribeRequest {
            session_id: "firehose".into(),
            from_seq: 0,
            follow: true,
        })
        .await
        .unwrap()
        .into_inner();

    let text = "x".repeat(2048);
    let mut client = store.client().await.unwrap();
    for i in 1..=APPENDS {
        let resp = client
            .append(AppendRequest {
                session_id: "firehose".into(),
                events: vec![user_event(&format!("e{i}"), &text)],
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(resp.seqs, vec![i]);
    }
    let info = client
        .get_session(GetSessionRequest {
            session_id: "firehose".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.last_seq, APPENDS);

    let mut next = 1;
    while next <= APPENDS {
        let event = tokio::time::timeout(BOUND, stalled.message())
            .await
            .expect("the stalled follower never caught up")
            .unwrap()
            .expect("the follow stream ended");
        assert_eq!(event.seq, next, "ascending, no gap, no duplicate");
        assert_eq!(event.event_id, format!("e{next}"));
        next += 1;
    }
    // And the log itself is whole.
    assert_eq!(
        read_log(&mut client, "firehose").await.len() as u64,
        APPENDS
    );
}

/// A record damaged on disk after it was acknowledged (a flipped bit, which its checksum
/// catches) is never sent: the stream ends with INTERNAL before reaching it, and nothing of
/// it or after it arrives. (The local log only: a PostgreSQL store keeps no such file.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_damaged_on_disk_is_never_sent() {
    if integration_tests::test_backend_is_postgres() {
        return;
    }
    let store = Store::start().unwrap();
    let mut client = agentlog_proto::v1::event_store_client::EventStoreClient::connect(store.url())
        .await
        .unwrap();
    let texts = ["first", "second, soon damaged", "third"];
    for (i, text) in texts.into_iter().enumerate() {
        client
            .append(AppendRequest {
                session_id: "d".into(),
                events: vec![user_event(&format!("d{i}"), text)],
                ..Default::default()
            })
            .await
            .unwrap();
    }
    assert_eq!(read_log(&mut client, "d").await.len(), 3);

    let segment = store.data_dir.join("log").join(format!("{:020}.seg", 0));
    let bytes = std::fs::read(&segment).unwrap();
    let at = bytes
        .windows(texts[1].len())
        .position(|w| w == texts[1].as_bytes())
        .expect("the second event's text is in the log");
    std::os::unix::fs::FileExt::write_at(
        &std::fs::OpenOptions::new()
            .write(true)
            .open(&segment)
            .unwrap(),
        &[bytes[at] ^ 0x20],
        at as u64,
    )
    .unwrap();

    let mut stream = client
        .subscribe(SubscribeRequest {
            session_id: "d".into(),
            from_seq: 1,
            follow: false,
        })
        .await
        .unwrap()
        .into_inner();
    let mut seqs = Vec::new();
    let status = loop {
        match stream.message().await {
            Ok(Some(event)) => seqs.push(event.seq),
            Ok(None) => panic!("the stream ended cleanly after {seqs:?}"),
            Err(status) => break status,
        }
    };
    assert_eq!(status.code(), tonic::Code::Internal, "{status:?}");
    assert!(seqs.iter().all(|&seq| seq < 2), "sent {seqs:?}");
}
