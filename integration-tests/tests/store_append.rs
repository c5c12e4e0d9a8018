//! Append against the real `event-store`, driven with grpcurl as users drive it: seqs,
//! event-id dedup, `expected_last_seq`, and all-or-nothing batches (also under concurrent
//! writers, checked with tonic clients for volume).

use std::collections::{BTreeMap, HashSet};

use agentlog_proto::reason::Reason;
use agentlog_proto::v1::{event, AppendRequest, ApprovalDecision, Event, GetSessionRequest};
use integration_tests::{grpcurl, json_seqs, json_u64, read_log, user_event, Store};
use serde_json::{json, Value};

const APPEND: &str = "agentlog.v1.EventStore/Append";
const SUBSCRIBE: &str = "agentlog.v1.EventStore/Subscribe";
const GET_SESSION: &str = "agentlog.v1.EventStore/GetSession";

fn append(store: &Store, request: Value) -> Value {
    grpcurl(store.addr, APPEND, Some(&request.to_string())).json()
}

/// The `seqs` of an AppendResponse.
fn seqs_of(response: &Value) -> Vec<u64> {
    response["seqs"]
        .as_array()
        .unwrap_or_else(|| panic!("no seqs in {response}"))
        .iter()
        .map(json_u64)
        .collect()
}

fn log_of(store: &Store, session_id: &str) -> Vec<Value> {
    grpcurl(
        store.addr,
        SUBSCRIBE,
        Some(&json!({ "session_id": session_id }).to_string()),
    )
    .json_stream()
}

fn texts(events: &[Value]) -> Vec<String> {
    events
        .iter()
        .map(|e| {
            e["userMessage"]["text"]
                .as_str()
                .unwrap_or_default()
                .to_string()
        })
        .collect()
}

fn user(text: &str) -> Value {
    json!({ "user_message": { "text": text } })
}

fn user_with_id(event_id: &str, text: &str) -> Value {
    json!({ "event_id": event_id, "user_message": { "text": text } })
}

#[test]
fn append_assigns_gapless_seqs_and_the_log_holds_the_events() {
    let store = Store::start().unwrap();

    let first = append(
        &store,
        json!({ "session_id": "s1", "events": [user("hello")] }),
    );
    assert_eq!(seqs_of(&first), vec![1]);
    assert_eq!(json_u64(&first["lastSeq"]), 1);

    // Two events without event_ids, same text: the store makes two distinct ids.
    let second = append(
        &store,
        json!({ "session_id": "s1", "events": [user("again"), user("again")] }),
    );
    let seqs = seqs_of(&second);
    assert_eq!(seqs, vec![2, 3]);
    assert_eq!(json_u64(&second["lastSeq"]), 3);

    let log = log_of(&store, "s1");
    assert_eq!(json_seqs(&log), vec![1, 2, 3]);
    assert_eq!(texts(&log), vec!["hello", "again", "again"]);
    let ids: HashSet<&str> = log.iter().map(|e| e["eventId"].as_str().unwrap()).collect();
    assert_eq!(ids.len(), 3, "store-made event ids are distinct: {log:?}");
    assert!(ids.iter().all(|id| !id.is_empty()));
    for event in &log {
        assert_eq!(event["sessionId"], "s1");
        assert!(
            json_u64(&event["tsUnixMs"]) > 0,
            "ts set by the store: {event}"
        );
        assert_eq!(event["schemaVersion"], 1);
    }

    let info = grpcurl(store.addr, GET_SESSION, Some(r#"{"session_id":"s1"}"#)).json();
    assert_eq!(json_u64(&info["lastSeq"]), 3);
    assert_eq!(info["title"], "hello");
    assert_eq!(info["status"], "SESSION_STATUS_RUNNABLE");

    // Another session has its own seqs.
    let other = append(&store, json!({ "session_id": "s2", "events": [user("x")] }));
    assert_eq!(json_u64(&other["lastSeq"]), 1);
}

#[test]
fn appending_an_event_id_again_writes_nothing_and_returns_the_original_seq() {
    let store = Store::start().unwrap();
    append(
        &store,
        json!({ "session_id": "d", "events": [user_with_id("e1", "one")] }),
    );
    append(
        &store,
        json!({ "session_id": "d", "events": [user_with_id("e2", "two")] }),
    );

    // A retry of e1 (even with other content) is answered with e1's seq.
    let retry = append(
        &store,
        json!({ "session_id": "d", "events": [user_with_id("e1", "one, retried")] }),
    );
    assert_eq!(json_u64(&retry["seqs"][0]), 1);
    assert_eq!(json_u64(&retry["lastSeq"]), 2);

    // A batch mixing a known and a new id: only the new one is written.
    let mixed = append(
        &store,
        json!({ "session_id": "d", "events": [user_with_id("e2", "dup"), user_with_id("e3", "three")] }),
    );
    let seqs = seqs_of(&mixed);
    assert_eq!(seqs, vec![2, 3]);

    // The same id twice in one request is one event.
    let twice = append(
        &store,
        json!({ "session_id": "d", "events": [user_with_id("e4", "four"), user_with_id("e4", "four")] }),
    );
    let seqs = seqs_of(&twice);
    assert_eq!(seqs, vec![4, 4]);

    // The same id in another session is another event.
    let elsewhere = append(
        &store,
        json!({ "session_id": "other", "events": [user_with_id("e1", "x")] }),
    );
    assert_eq!(json_u64(&elsewhere["seqs"][0]), 1);

    let log = log_of(&store, "d");
    assert_eq!(json_seqs(&log), vec![1, 2, 3, 4]);
    assert_eq!(texts(&log), vec!["one", "two", "three", "four"]);

    // Dedup survives a restart: the retry after a lost ack may come to a restarted store.
    let mut store = store;
    assert!(store.terminate().unwrap().success());
    let restarted = store.restart().unwrap();
    let retry = append(
        &restarted,
        json!({ "session_id": "d", "events": [user_with_id("e3", "three, after restart")] }),
    );
    assert_eq!(json_u64(&retry["seqs"][0]), 3);
    assert_eq!(json_seqs(&log_of(&restarted, "d")), vec![1, 2, 3, 4]);
}

#[test]
fn expected_last_seq_guards_the_append_and_a_mismatch_writes_nothing() {
    let store = Store::start().unwrap();

    // 0 = the session must be empty: true for a new session.
    let first = append(
        &store,
        json!({ "session_id": "x", "expected_last_seq": 0, "events": [user("first")] }),
    );
    assert_eq!(json_u64(&first["lastSeq"]), 1);

    // 0 again: the session is no longer empty.
    let out = grpcurl(
        store.addr,
        APPEND,
        Some(
            &json!({ "session_id": "x", "expected_last_seq": 0, "events": [user("lost race")] })
                .to_string(),
        ),
    );
    assert_eq!(out.code().as_deref(), Some("Aborted"), "{}", out.stderr);
    assert!(
        out.message().contains("expected_last_seq"),
        "{}",
        out.message()
    );

    // A stale or future seq, for a batch: nothing of it is written.
    for expected in [5, 2] {
        let out = grpcurl(
            store.addr,
            APPEND,
            Some(
                &json!({ "session_id": "x", "expected_last_seq": expected,
                          "events": [user("a"), user("b")] })
                .to_string(),
            ),
        );
        assert_eq!(out.code().as_deref(), Some("Aborted"), "{}", out.stderr);
    }
    assert_eq!(texts(&log_of(&store, "x")), vec!["first"]);

    // The right one goes through; so does an append without the field.
    let ok = append(
        &store,
        json!({ "session_id": "x", "expected_last_seq": 1, "events": [user("second")] }),
    );
    assert_eq!(json_u64(&ok["lastSeq"]), 2);
    append(
        &store,
        json!({ "session_id": "x", "events": [user("third")] }),
    );
    assert_eq!(
        texts(&log_of(&store, "x")),
        vec!["first", "second", "third"]
    );
}

#[test]
fn a_batch_with_one_bad_event_writes_none_of_it() {
    let store = Store::start().unwrap();
    append(
        &store,
        json!({ "session_id": "b", "events": [user("before")] }),
    );

    // The third event has no kind.
    let out = grpcurl(
        store.addr,
        APPEND,
        Some(&json!({ "session_id": "b", "events": [user("1"), user("2"), {}] }).to_string()),
    );
    assert_eq!(
        out.code().as_deref(),
        Some("InvalidArgument"),
        "{}",
        out.stderr
    );

    // The second event is runner-written and there is no lease.
    let out = grpcurl(
        store.addr,
        APPEND,
        Some(
            &json!({ "session_id": "b", "events": [
                user("1"),
                { "tool_result": { "tool_use_id": "t1", "content": "ok" } }
            ] })
            .to_string(),
        ),
    );
    assert_eq!(
        out.code().as_deref(),
        Some("FailedPrecondition"),
        "{}",
        out.stderr
    );

    assert_eq!(texts(&log_of(&store, "b")), vec!["before"]);

    // The largest allowed batch goes in whole, at consecutive seqs.
    let events: Vec<Value> = (0..1000).map(|i| user(&format!("m{i}"))).collect();
    let big = append(&store, json!({ "session_id": "b", "events": events }));
    let seqs = seqs_of(&big);
    assert_eq!(seqs, (2..=1001).collect::<Vec<_>>());
    let log = log_of(&store, "b");
    assert_eq!(json_seqs(&log), (1..=1001).collect::<Vec<_>>());
    assert_eq!(log[1000]["userMessage"]["text"], "m999");
}

/// Concurrent multi-event appends to one session never interleave: each batch lands at
/// consecutive seqs, and every acknowledged event is in the log at its seq.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_batches_are_atomic_and_land_where_acknowledged() {
    let store = Store::start().unwrap();
    const WRITERS: usize = 6;
    const BATCHES: usize = 15;
    const BATCH: usize = 5;

    let mut tasks = Vec::new();
    for w in 0..WRITERS {
        let mut client = store.client().await.unwrap();
        tasks.push(tokio::spawn(async move {
            let mut acked = Vec::new();
            for b in 0..BATCHES {
                let ids: Vec<String> = (0..BATCH).map(|i| format!("w{w}-b{b}-{i}")).collect();
                let resp = client
                    .append(AppendRequest {
                        session_id: "shared".into(),
                        events: ids.iter().map(|id| user_event(id, id)).collect(),
                        ..Default::default()
                    })
                    .await
                    .expect("append")
                    .into_inner();
                let first = resp.seqs[0];
                assert_eq!(
                    resp.seqs,
                    (first..first + BATCH as u64).collect::<Vec<_>>(),
                    "a batch lands at consecutive seqs"
                );
                acked.extend(ids.into_iter().zip(resp.seqs));
            }
            acked
        }));
    }
    let mut acked: BTreeMap<u64, String> = BTreeMap::new();
    for task in tasks {
        for (id, seq) in task.await.unwrap() {
            assert!(
                acked.insert(seq, id).is_none(),
                "seq {seq} acknowledged twice"
            );
        }
    }
    let total = (WRITERS * BATCHES * BATCH) as u64;
    assert_eq!(
        acked.keys().copied().collect::<Vec<_>>(),
        (1..=total).collect::<Vec<_>>()
    );

    let mut client = store.client().await.unwrap();
    let log = read_log(&mut client, "shared").await;
    assert_eq!(log.len() as u64, total);
    for event in &log {
        assert_eq!(
            acked.get(&event.seq),
            Some(&event.event_id),
            "event at seq {}",
            event.seq
        );
    }
    let info = client
        .get_session(GetSessionRequest {
            session_id: "shared".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.last_seq, total);
}

/// DURABILITY_BUFFERED is acknowledged and readable like a sync append, and a clean
/// shutdown keeps it.
#[test]
fn buffered_appends_are_readable_and_survive_a_clean_restart() {
    let mut store = Store::start().unwrap();
    for text in ["a", "b", "c"] {
        append(
            &store,
            json!({ "session_id": "buf", "durability": "DURABILITY_BUFFERED", "events": [user(text)] }),
        );
    }
    assert_eq!(texts(&log_of(&store, "buf")), vec!["a", "b", "c"]);
    assert!(store.terminate().unwrap().success());
    let restarted = store.restart().unwrap();
    let log = log_of(&restarted, "buf");
    assert_eq!(json_seqs(&log), vec![1, 2, 3]);
    assert_eq!(texts(&log), vec!["a", "b", "c"]);
}

/// The append refusals that are not about leases carry their reason over the wire too:
/// a stale `expected_last_seq`, and an approval decision that answers no pending request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn append_refusals_carry_their_reason() {
    let store = Store::start().expect("store starts");
    let mut client = store.client().await.expect("connect");
    let append = |event: Event, expected_last_seq: Option<u64>| AppendRequest {
        session_id: "why".into(),
        events: vec![event],
        expected_last_seq,
        ..AppendRequest::default()
    };
    client
        .append(append(user_event("u1", "first"), Some(0)))
        .await
        .expect("first append");
    let stale = client
        .append(append(user_event("u2", "lost race"), Some(0)))
        .await
        .expect_err("a stale expected_last_seq is refused");
    assert_eq!(stale.code(), tonic::Code::Aborted);
    assert!(stale.message().contains("expected_last_seq"), "{stale:?}");
    assert_eq!(Reason::of(&stale), Some(Reason::SeqConflict));

    let decision = Event {
        kind: Some(event::Kind::ApprovalDecision(ApprovalDecision {
            tool_use_id: "never-requested".into(),
            approved: true,
            note: String::new(),
        })),
        ..Event::default()
    };
    let unasked = client
        .append(append(decision, None))
        .await
        .expect_err("a decision without a request is refused");
    assert_eq!(unasked.code(), tonic::Code::FailedPrecondition);
    assert_eq!(Reason::of(&unasked), Some(Reason::ApprovalNotPending));
}
