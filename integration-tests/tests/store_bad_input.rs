//! Every bad input the protocol names (`proto/agentlog/v1/event_store.proto`), sent with grpcurl as a user would send it: the
//! exact status code, a message that names the field, and afterwards nothing changed (the
//! sessions and their logs, read back over gRPC, are exactly as before). Also GetSession of
//! an unknown session, and ListSessions paging, query and status filter.

use std::collections::HashSet;

use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::{AppendRequest, Event, ListSessionsRequest, SessionInfo};
use integration_tests::{
    grpcurl, grpcurl_stdin, json_u64, read_log, user_event, GrpcurlOutput, Store,
};
use serde_json::{json, Value};
use tonic::transport::Channel;

const APPEND: &str = "agentlog.v1.EventStore/Append";

/// Every session and its whole log, as clients can see them.
async fn snapshot(client: &mut EventStoreClient<Channel>) -> Vec<(SessionInfo, Vec<Event>)> {
    let sessions = client
        .list_sessions(ListSessionsRequest {
            page_size: 1000,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .sessions;
    let mut all = Vec::new();
    for info in sessions {
        let log = read_log(client, &info.session_id).await;
        all.push((info, log));
    }
    all
}

/// A store with one session `s` of two events, and a tonic client for checking.
async fn store_with_a_session() -> (Store, EventStoreClient<Channel>) {
    let store = Store::start().unwrap();
    let mut client = store.client().await.unwrap();
    client
        .append(AppendRequest {
            session_id: "s".into(),
            events: vec![user_event("e1", "first"), user_event("e2", "second")],
            ..Default::default()
        })
        .await
        .unwrap();
    (store, client)
}

fn user(text: &str) -> Value {
    json!({ "user_message": { "text": text } })
}

/// Asserts the call failed with `code` and a message naming `field`.
fn assert_refused(out: &GrpcurlOutput, code: &str, field: &str, what: &str) {
    assert!(!out.success, "{what}: accepted: {}", out.stdout);
    assert_eq!(out.code().as_deref(), Some(code), "{what}: {}", out.stderr);
    assert!(
        out.message().contains(field),
        "{what}: the message should name {field:?}: {}",
        out.message()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_session_ids_are_refused_naming_session_id_and_change_nothing() {
    let (store, mut client) = store_with_a_session().await;
    let before = snapshot(&mut client).await;
    let too_long = "a".repeat(129);
    for bad in [
        "",
        too_long.as_str(),
        "-leading-dash",
        ".leading-dot",
        "has space",
        "slash/inside",
        "semi;colon",
        "ünïcode",
    ] {
        let out = grpcurl(
            store.addr,
            APPEND,
            Some(&json!({ "session_id": bad, "events": [user("hi")] }).to_string()),
        );
        assert_refused(
            &out,
            "InvalidArgument",
            "session_id",
            &format!("Append to {bad:?}"),
        );
    }
    // The other calls that name a session check it too.
    for (method, request) in [
        ("GetSession", json!({ "session_id": "-x" })),
        ("Subscribe", json!({ "session_id": "-x" })),
        (
            "AcquireLease",
            json!({ "session_id": "-x", "owner": "r", "ttl_ms": 1000 }),
        ),
    ] {
        let out = grpcurl(
            store.addr,
            &format!("agentlog.v1.EventStore/{method}"),
            Some(&request.to_string()),
        );
        assert_refused(&out, "InvalidArgument", "session_id", method);
    }
    assert_eq!(snapshot(&mut client).await, before);

    // The edges of the valid syntax are accepted.
    let longest = "b".repeat(128);
    for good in [longest.as_str(), "0.a_b:c-D", "Z"] {
        let out = grpcurl(
            store.addr,
            APPEND,
            Some(&json!({ "session_id": good, "events": [user("hi")] }).to_string()),
        );
        assert_eq!(json_u64(&out.json()["lastSeq"]), 1, "{good:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_count_and_kind_are_checked_naming_the_field() {
    let (store, mut client) = store_with_a_session().await;
    let before = snapshot(&mut client).await;

    let none = grpcurl(
        store.addr,
        APPEND,
        Some(r#"{"session_id":"s","events":[]}"#),
    );
    assert_refused(&none, "InvalidArgument", "events", "0 events");
    // The same for a session that does not exist yet.
    let none = grpcurl(store.addr, APPEND, Some(r#"{"session_id":"new"}"#));
    assert_refused(&none, "InvalidArgument", "events", "no events field");

    let many: Vec<Value> = (0..1001).map(|i| user(&format!("m{i}"))).collect();
    let out = grpcurl(
        store.addr,
        APPEND,
        Some(&json!({ "session_id": "s", "events": many }).to_string()),
    );
    assert_refused(&out, "InvalidArgument", "events", "1001 events");

    let out = grpcurl(
        store.addr,
        APPEND,
        Some(
            &json!({ "session_id": "s", "events": [user("ok"), { "event_id": "no-kind" }] })
                .to_string(),
        ),
    );
    assert_refused(&out, "InvalidArgument", "kind", "an event without a kind");

    let out = grpcurl(
        store.addr,
        APPEND,
        Some(&json!({ "session_id": "s", "events": [{ "session_id": "other", "user_message": { "text": "x" } }] }).to_string()),
    );
    assert_refused(
        &out,
        "InvalidArgument",
        "session_id",
        "an event of another session",
    );

    assert_eq!(snapshot(&mut client).await, before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn size_limits_are_resource_exhausted_and_change_nothing() {
    let (store, mut client) = store_with_a_session().await;
    let before = snapshot(&mut client).await;

    // One event over 1 MiB.
    let big = "x".repeat((1 << 20) + 10);
    let out = grpcurl_stdin(
        store.addr,
        &[],
        APPEND,
        &json!({ "session_id": "s", "events": [user(&big)] }).to_string(),
    );
    assert_refused(
        &out,
        "ResourceExhausted",
        "events[0]",
        "an event over 1 MiB",
    );

    // Five events under 1 MiB each, over 4 MiB together.
    let chunk = "y".repeat(900 * 1024);
    let events: Vec<Value> = (0..5).map(|_| user(&chunk)).collect();
    let out = grpcurl_stdin(
        store.addr,
        &[],
        APPEND,
        &json!({ "session_id": "s", "events": events }).to_string(),
    );
    assert_eq!(
        out.code().as_deref(),
        Some("ResourceExhausted"),
        "{}",
        out.stderr
    );
    assert!(out.message().contains("4 MiB"), "{}", out.message());

    // Far over the limit (beyond what the store even decodes): still RESOURCE_EXHAUSTED.
    let huge = client
        .append(AppendRequest {
            session_id: "s".into(),
            events: (0..20)
                .map(|i| user_event(&format!("h{i}"), &chunk))
                .collect(),
            ..Default::default()
        })
        .await
        .expect_err("a 18 MiB append is refused");
    assert_eq!(huge.code(), tonic::Code::ResourceExhausted, "{huge:?}");

    assert_eq!(snapshot(&mut client).await, before);

    // Just under the limits is fine: an event of 1,000,000 bytes of text, and 4 of them.
    let under = "z".repeat(1_000_000);
    let events: Vec<Value> = (0..4).map(|_| user(&under)).collect();
    let out = grpcurl_stdin(
        store.addr,
        &[],
        APPEND,
        &json!({ "session_id": "s", "events": events }).to_string(),
    );
    assert_eq!(json_u64(&out.json()["lastSeq"]), 6);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_and_sequence_preconditions_are_refused_and_change_nothing() {
    let (store, mut client) = store_with_a_session().await;
    let before = snapshot(&mut client).await;

    let out = grpcurl(
        store.addr,
        APPEND,
        Some(r#"{"session_id":"s","events":[{"tool_result":{"tool_use_id":"t","content":"x"}}]}"#),
    );
    assert_refused(
        &out,
        "FailedPrecondition",
        "lease_epoch",
        "runner kind without a lease",
    );

    let out = grpcurl(
        store.addr,
        APPEND,
        Some(
            r#"{"session_id":"s","lease_epoch":7,"events":[{"tool_result":{"tool_use_id":"t","content":"x"}}]}"#,
        ),
    );
    assert_refused(
        &out,
        "FailedPrecondition",
        "lease_epoch",
        "an epoch never granted",
    );

    let out = grpcurl(
        store.addr,
        APPEND,
        Some(
            r#"{"session_id":"s","expected_last_seq":1,"events":[{"user_message":{"text":"late"}}]}"#,
        ),
    );
    assert_refused(
        &out,
        "Aborted",
        "expected_last_seq",
        "a stale expected_last_seq",
    );

    assert_eq!(snapshot(&mut client).await, before);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_malformed_requests_name_their_field() {
    let (store, mut client) = store_with_a_session().await;
    let before = snapshot(&mut client).await;
    let cases = [
        (
            "GetSession",
            json!({ "session_id": "nobody" }),
            "NotFound",
            "nobody",
        ),
        (
            "AcquireLease",
            json!({ "session_id": "s", "owner": "r", "ttl_ms": 0 }),
            "InvalidArgument",
            "ttl_ms",
        ),
        (
            "AcquireLease",
            json!({ "session_id": "s", "owner": "", "ttl_ms": 1000 }),
            "InvalidArgument",
            "owner",
        ),
        (
            "ClaimSession",
            json!({ "owner": "r", "ttl_ms": 1000, "wait_ms": 86_400_000 }),
            "InvalidArgument",
            "wait_ms",
        ),
        (
            "ListSessions",
            json!({ "page_token": "not-a-token" }),
            "InvalidArgument",
            "page_token",
        ),
        (
            "Append",
            json!({ "session_id": "s", "events": [{ "session_config": { "model": "gpt-4" } }] }),
            "InvalidArgument",
            "events[0].session_config.model",
        ),
        (
            "Append",
            json!({ "session_id": "s", "events": [{ "session_config": {
                "model": "openai:m",
                "replay": { "session_id": "s", "after_seq": 2, "through_seq": 1 },
            } }] }),
            "InvalidArgument",
            "events[0].session_config.replay",
        ),
        (
            "Append",
            json!({ "session_id": "s", "events": [{ "session_config": {
                "model": "openai:m",
                "replay": { "session_id": "no/such" },
            } }] }),
            "InvalidArgument",
            "events[0].session_config.replay.session_id",
        ),
    ];
    for (method, request, code, field) in cases {
        let out = grpcurl(
            store.addr,
            &format!("agentlog.v1.EventStore/{method}"),
            Some(&request.to_string()),
        );
        assert_refused(&out, code, field, &format!("{method} {request}"));
    }
    assert_eq!(snapshot(&mut client).await, before);
}

/// Pages through ListSessions with grpcurl; returns the session ids in order.
fn list_all(store: &Store, request: Value, page_size: u64) -> Vec<Value> {
    let mut all = Vec::new();
    let mut token = String::new();
    loop {
        let mut request = request.clone();
        request["page_size"] = json!(page_size);
        request["page_token"] = json!(token);
        let page = grpcurl(
            store.addr,
            "agentlog.v1.EventStore/ListSessions",
            Some(&request.to_string()),
        )
        .json();
        let sessions = page["sessions"].as_array().cloned().unwrap_or_default();
        assert!(sessions.len() as u64 <= page_size);
        all.extend(sessions);
        token = page["nextPageToken"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        if token.is_empty() {
            return all;
        }
        assert!(all.len() < 100, "paging does not end");
    }
}

fn ids(sessions: &[Value]) -> Vec<String> {
    sessions
        .iter()
        .map(|s| s["sessionId"].as_str().unwrap().to_string())
        .collect()
}

/// Updates are ordered by their millisecond timestamps; keep consecutive writes in distinct
/// milliseconds so that "most recently updated first" has one right answer.
fn next_millisecond() {
    std::thread::sleep(std::time::Duration::from_millis(3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn list_sessions_pages_filters_by_query_and_status() {
    let store = Store::start().unwrap();
    let mut client = store.client().await.unwrap();
    let firsts = [
        ("alpha-1", "Please refactor the parser"),
        ("beta-2", "write a haiku"),
        ("ALPHA-3", "fix the flaky test"),
        ("gamma-4", "deploy to staging"),
        ("delta-5", "Refactor the lexer too"),
    ];
    for (id, text) in firsts {
        next_millisecond();
        client
            .append(AppendRequest {
                session_id: id.into(),
                events: vec![user_event("", text)],
                ..Default::default()
            })
            .await
            .unwrap();
    }
    // A later message does not change the title, and moves gamma-4 to the front.
    next_millisecond();
    client
        .append(AppendRequest {
            session_id: "gamma-4".into(),
            events: vec![user_event("", "and then prod")],
            ..Default::default()
        })
        .await
        .unwrap();
    // Make beta-2 idle.
    let lease = client
        .acquire_lease(agentlog_proto::v1::AcquireLeaseRequest {
            session_id: "beta-2".into(),
            owner: "runner".into(),
            ttl_ms: 60_000,
        })
        .await
        .unwrap()
        .into_inner();
    next_millisecond();
    client
        .append(AppendRequest {
            session_id: "beta-2".into(),
            lease_epoch: Some(lease.epoch),
            events: vec![Event {
                kind: Some(agentlog_proto::v1::event::Kind::RunError(
                    agentlog_proto::v1::RunError {
                        message: "refused".into(),
                        retryable: false,
                    },
                )),
                ..Default::default()
            }],
            ..Default::default()
        })
        .await
        .unwrap();

    // Paging: every session exactly once, most recently updated first.
    let all = list_all(&store, json!({}), 2);
    let all_ids = ids(&all);
    assert_eq!(all_ids.len(), 5, "{all_ids:?}");
    assert_eq!(all_ids.iter().collect::<HashSet<_>>().len(), 5);
    let updated: Vec<u64> = all.iter().map(|s| json_u64(&s["updatedUnixMs"])).collect();
    assert!(
        updated.windows(2).all(|w| w[0] >= w[1]),
        "most recently updated first: {all_ids:?} {updated:?}"
    );
    assert_eq!(all_ids[0], "beta-2", "the last one written to");
    assert_eq!(all_ids[1], "gamma-4");
    let one_page = list_all(&store, json!({}), 100);
    assert_eq!(ids(&one_page), all_ids, "pages add up to the single page");
    let gamma = all.iter().find(|s| s["sessionId"] == "gamma-4").unwrap();
    assert_eq!(gamma["title"], "deploy to staging");
    assert_eq!(json_u64(&gamma["lastSeq"]), 2);

    // Query: case-insensitive, over the id and the first user message.
    let mut by_id = ids(&list_all(&store, json!({ "query": "alpha" }), 100));
    by_id.sort();
    assert_eq!(by_id, vec!["ALPHA-3", "alpha-1"]);
    let mut by_text = ids(&list_all(&store, json!({ "query": "REFACTOR" }), 100));
    by_text.sort();
    assert_eq!(by_text, vec!["alpha-1", "delta-5"]);
    assert!(
        list_all(&store, json!({ "query": "prod" }), 100).is_empty(),
        "only the first message counts"
    );
    assert!(list_all(&store, json!({ "query": "nothing-like-this" }), 100).is_empty());

    // Status.
    let idle = list_all(&store, json!({ "status": "SESSION_STATUS_IDLE" }), 100);
    assert_eq!(ids(&idle), vec!["beta-2"]);
    assert_eq!(idle[0]["status"], "SESSION_STATUS_IDLE");
    let mut runnable = ids(&list_all(
        &store,
        json!({ "status": "SESSION_STATUS_RUNNABLE" }),
        1,
    ));
    runnable.sort();
    assert_eq!(runnable, vec!["ALPHA-3", "alpha-1", "delta-5", "gamma-4"]);
    let both = list_all(
        &store,
        json!({ "status": "SESSION_STATUS_RUNNABLE", "query": "alpha" }),
        100,
    );
    assert_eq!(both.len(), 2);
}
