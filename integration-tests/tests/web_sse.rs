//! `agentlog web`'s event stream, read as a program reads it (reqwest, no browser):
//! history, then a `caught_up` marker, then live; a reader that reconnects with
//! `Last-Event-ID` — after dropping its connection, after the web server was SIGKILLed, after
//! the store restarted, after being let go for reading too slowly — gets every event once,
//! in order, with no gap. And the JSON endpoints answer store errors with clear statuses.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::pin::Pin;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use agentlog_proto::v1::{
    event::Kind, AcquireLeaseRequest, AppendRequest, ApprovalRequested, Event,
};
use eventsource_stream::Eventsource;
use futures::{Stream, StreamExt};
use integration_tests::{bin_path, read_log, user_event, Store};
use serde_json::{json, Value};

/// Bounds a wait for something that must happen; never a claim about speed.
const PATIENCE: Duration = Duration::from_secs(30);

/// A running `agentlog web` against a store.
struct Web {
    child: Child,
    addr: SocketAddr,
}

impl Web {
    fn start(store: &Store) -> Web {
        let mut child = Command::new(bin_path("agentlog"))
            .args(["--addr", &store.url(), "web", "--listen", "127.0.0.1:0"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn agentlog web");
        let stderr = child.stderr.take().expect("piped stderr");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                eprintln!("[web] {line}");
                let addr = line
                    .split("listen_addr=")
                    .nth(1)
                    .and_then(|rest| rest.split_whitespace().next())
                    .and_then(|a| a.parse::<SocketAddr>().ok());
                if let (Some(addr), Some(tx)) = (addr, tx.take()) {
                    let _ = tx.send(addr);
                }
            }
        });
        let addr = rx
            .recv_timeout(PATIENCE)
            .expect("agentlog web logs its listen address");
        Web { child, addr }
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Web {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// One event of the stream: `id:` (absent on the marker), `event:`, `data:` as JSON.
#[derive(Debug)]
struct Sse {
    id: Option<u64>,
    event: String,
    data: Value,
}

type SseStream = Pin<Box<dyn Stream<Item = Sse> + Send>>;

/// Opens the event stream of `session`, optionally resuming after `last_event_id`.
async fn open(web: &Web, session: &str, from_seq: u64, last_event_id: Option<u64>) -> SseStream {
    let mut request = reqwest::Client::new().get(web.url(&format!(
        "/v1/sessions/{session}/events?from_seq={from_seq}"
    )));
    if let Some(id) = last_event_id {
        request = request.header("Last-Event-ID", id.to_string());
    }
    let response = request.send().await.expect("GET events");
    assert_eq!(response.status(), 200, "the event stream opens");
    assert_eq!(
        response.headers()["content-type"],
        "text/event-stream",
        "served as Server-Sent Events"
    );
    // A connection cut mid-event (a killed server) ends the stream, as it does for browsers.
    let events = response
        .bytes_stream()
        .eventsource()
        .take_while(|item| std::future::ready(item.is_ok()));
    Box::pin(events.map(|item| {
        let e = item.expect("only complete events pass");
        Sse {
            id: (!e.id.is_empty()).then(|| e.id.parse().expect("id is a seq")),
            event: e.event,
            data: serde_json::from_str(&e.data).expect("data is JSON"),
        }
    }))
}

async fn next(stream: &mut SseStream) -> Sse {
    tokio::time::timeout(PATIENCE, stream.next())
        .await
        .expect("an event within the patience bound")
        .expect("the stream goes on")
}

/// Reads `n` events and checks each against the store's record of that seq.
async fn read_events(stream: &mut SseStream, n: usize) -> Vec<u64> {
    let mut ids = Vec::new();
    for _ in 0..n {
        let e = next(stream).await;
        let id =
            e.id.unwrap_or_else(|| panic!("an event with an id, got {e:?}"));
        assert_eq!(e.event, "user_message", "event: names the kind's field");
        assert_eq!(
            e.data["seq"],
            json!(id.to_string()),
            "data is the event of that seq"
        );
        assert_eq!(
            e.data["userMessage"]["text"],
            json!(format!("message {id}"))
        );
        ids.push(id);
    }
    ids
}

async fn expect_caught_up(stream: &mut SseStream, last_seq: u64) {
    let e = next(stream).await;
    assert_eq!(
        e.event, "caught_up",
        "the marker follows the history: {e:?}"
    );
    // The marker carries no id of its own: the resume point stays at the last event.
    assert!(
        e.id.is_none() || e.id == Some(last_seq),
        "the marker does not move the resume point: {e:?}"
    );
    assert_eq!(e.data["lastSeq"], json!(last_seq.to_string()));
}

/// Appends user messages `range` ("message N" for seq N).
async fn append(store: &Store, session: &str, range: std::ops::RangeInclusive<u64>) {
    let mut client = store.client().await.expect("connect to the store");
    let events: Vec<Event> = range
        .map(|i| user_event(&format!("u{i}"), &format!("message {i}")))
        .collect();
    client
        .append(AppendRequest {
            session_id: session.into(),
            events,
            ..AppendRequest::default()
        })
        .await
        .expect("append");
}

#[tokio::test(flavor = "multi_thread")]
async fn history_then_live_and_every_resume_continues_with_no_gap_and_no_duplicate() {
    let store = Store::start().expect("store");
    let web = Web::start(&store);
    let session = "sse-resume";
    append(&store, session, 1..=10).await;
    let mut seen = Vec::new();

    // A reader that leaves mid-history...
    let mut stream = open(&web, session, 1, None).await;
    seen.extend(read_events(&mut stream, 5).await);
    drop(stream);
    // ...comes back with Last-Event-ID, which wins over from_seq.
    let mut stream = open(&web, session, 1, Some(5)).await;
    seen.extend(read_events(&mut stream, 5).await);
    expect_caught_up(&mut stream, 10).await;
    // Live events follow the marker.
    append(&store, session, 11..=13).await;
    seen.extend(read_events(&mut stream, 3).await);
    drop(stream);
    // What was appended while it was away comes first on its return.
    append(&store, session, 14..=20).await;
    let mut stream = open(&web, session, 1, Some(13)).await;
    seen.extend(read_events(&mut stream, 7).await);
    expect_caught_up(&mut stream, 20).await;
    // from_seq alone starts where asked; past the head, the marker comes at once.
    let mut stream = open(&web, session, 18, None).await;
    assert_eq!(read_events(&mut stream, 3).await, vec![18, 19, 20]);
    expect_caught_up(&mut stream, 20).await;
    let mut stream = open(&web, session, 21, None).await;
    expect_caught_up(&mut stream, 20).await;

    assert_eq!(
        seen,
        (1..=20).collect::<Vec<_>>(),
        "every event once, in order"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reader_resumes_across_a_killed_web_server_and_a_restarted_store() {
    let data = tempfile::tempdir().expect("tempdir");
    let mut store = Store::start_in(data.path()).expect("store");
    let session = "sse-restarts";
    append(&store, session, 1..=3).await;
    let mut web = Web::start(&store);
    let mut seen = Vec::new();
    let mut stream = open(&web, session, 1, None).await;
    seen.extend(read_events(&mut stream, 3).await);
    expect_caught_up(&mut stream, 3).await;

    // The web server dies mid-stream: the stream ends, and the reader resumes on another.
    web.kill9();
    let ended = tokio::time::timeout(PATIENCE, stream.next()).await;
    assert!(matches!(ended, Ok(None)), "the stream ends with its server");
    append(&store, session, 4..=6).await;
    let web = Web::start(&store);
    let mut stream = open(&web, session, 1, Some(*seen.last().expect("seen"))).await;
    seen.extend(read_events(&mut stream, 3).await);
    expect_caught_up(&mut stream, 6).await;

    // The store is SIGKILLed and restarted on its address: the same stream carries on.
    let addr = store.addr;
    store.kill9();
    let store = Store::start_on(data.path(), &addr.to_string()).expect("store again");
    append(&store, session, 7..=9).await;
    seen.extend(read_events(&mut stream, 3).await);

    assert_eq!(
        seen,
        (1..=9).collect::<Vec<_>>(),
        "every event once, in order"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reader_that_stops_reading_is_let_go_and_resumes_where_it_stopped() {
    let store = Store::start().expect("store");
    let web = Web::start(&store);
    let session = "sse-slow";
    let mut stream = open(&web, session, 1, None).await;
    expect_caught_up(&mut stream, 0).await;
    // Far more than the reader's buffer and the sockets hold, while it reads nothing.
    let text = "x".repeat(20_000);
    let total: u64 = 1500;
    let mut client = store.client().await.expect("connect");
    for batch in 0..total / 50 {
        let events = (0..50)
            .map(|i| user_event(&format!("big{}", batch * 50 + i), &text))
            .collect();
        client
            .append(AppendRequest {
                session_id: session.into(),
                events,
                ..AppendRequest::default()
            })
            .await
            .expect("append");
    }
    // Long enough for the server to give up on this reader (it waits a few seconds).
    tokio::time::sleep(Duration::from_secs(8)).await;
    let mut seen = Vec::new();
    while let Ok(Some(e)) = tokio::time::timeout(PATIENCE, stream.next()).await {
        seen.push(e.id.expect("an event"));
    }
    let got = seen.len() as u64;
    assert!(got < total, "the slow reader was let go ({got} of {total})");
    assert_eq!(
        seen,
        (1..=got).collect::<Vec<_>>(),
        "what it got has no gap"
    );
    let mut stream = open(&web, session, 1, Some(got)).await;
    for seq in got + 1..=total {
        let e = next(&mut stream).await;
        assert_eq!(e.id, Some(seq), "the resume continues at the next seq");
    }
    expect_caught_up(&mut stream, total).await;
}

async fn post(web: &Web, path: &str, body: Value) -> (u16, Value) {
    let response = reqwest::Client::new()
        .post(web.url(path))
        .header("X-Agentlog-Request", "1")
        .json(&body)
        .send()
        .await
        .expect("POST");
    let status = response.status().as_u16();
    (status, response.json().await.expect("a JSON body"))
}

async fn get(web: &Web, path: &str) -> (u16, Value) {
    let response = reqwest::get(web.url(path)).await.expect("GET");
    let status = response.status().as_u16();
    (status, response.json().await.expect("a JSON body"))
}

#[tokio::test(flavor = "multi_thread")]
async fn posts_append_what_people_decide_and_store_errors_become_http_statuses() {
    let store = Store::start().expect("store");
    let web = Web::start(&store);
    let session = "web-posts";

    let (status, body) = post(
        &web,
        &format!("/v1/sessions/{session}/messages"),
        json!({"text": "deploy it"}),
    )
    .await;
    assert_eq!((status, &body["seq"]), (201, &json!("1")), "{body}");
    let (status, info) = get(&web, &format!("/v1/sessions/{session}")).await;
    assert_eq!(status, 200);
    assert_eq!(info["title"], "deploy it");
    assert_eq!(info["status"], "SESSION_STATUS_RUNNABLE");

    // The test stands in for a runner that asks a person first.
    let mut client = store.client().await.expect("connect");
    let lease = client
        .acquire_lease(AcquireLeaseRequest {
            session_id: session.into(),
            owner: "test-runner".into(),
            ttl_ms: 60_000,
        })
        .await
        .expect("lease")
        .into_inner();
    client
        .append(AppendRequest {
            session_id: session.into(),
            events: vec![Event {
                event_id: "ask:toolu_1".into(),
                kind: Some(Kind::ApprovalRequested(ApprovalRequested {
                    tool_use_id: "toolu_1".into(),
                    tool_name: "bash".into(),
                    reason: "bash needs a person's yes".into(),
                    ..ApprovalRequested::default()
                })),
                ..Event::default()
            }],
            lease_epoch: Some(lease.epoch),
            ..AppendRequest::default()
        })
        .await
        .expect("append approval_requested");
    let (_, list) = get(&web, "/v1/sessions?status=waiting").await;
    assert_eq!(list["sessions"][0]["sessionId"], session, "{list}");

    let approve = format!("/v1/sessions/{session}/approve");
    let (status, body) = post(
        &web,
        &approve,
        json!({"toolUseId": "toolu_1", "note": "ok"}),
    )
    .await;
    assert_eq!(status, 201, "{body}");
    let (status, body) = post(&web, &approve, json!({"toolUseId": "toolu_1"})).await;
    assert_eq!(status, 409, "a second decision is refused: {body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("no pending approval"),
        "{body}"
    );
    let (status, _) = post(
        &web,
        &format!("/v1/sessions/{session}/deny"),
        json!({"toolUseId": "toolu_9"}),
    )
    .await;
    assert_eq!(
        status, 409,
        "a decision for a call nobody asked about is refused"
    );
    let (status, _) = post(&web, &format!("/v1/sessions/{session}/cancel"), json!({})).await;
    assert_eq!(status, 201);

    let log = read_log(&mut client, session).await;
    let kinds: Vec<_> = log.iter().map(|e| e.kind.clone()).collect();
    assert!(
        matches!(&kinds[2], Some(Kind::ApprovalDecision(d)) if d.approved && d.note == "ok" && d.tool_use_id == "toolu_1")
    );
    assert!(
        matches!(&kinds[3], Some(Kind::Interrupt(_))),
        "cancel appends an interrupt"
    );
    assert_eq!(log.len(), 4, "refused posts wrote nothing");

    // Bad input gets a clear JSON error, and nothing is written.
    let (status, body) = get(&web, "/v1/sessions/not%20valid").await;
    assert_eq!(status, 400, "{body}");
    assert!(body["error"]["message"]
        .as_str()
        .unwrap_or("")
        .contains("session_id"));
    let (status, _) = get(&web, "/v1/sessions/never-written").await;
    assert_eq!(status, 404);
    let (status, _) = get(&web, "/v1/sessions?status=sleepy").await;
    assert_eq!(status, 400);
    let response = reqwest::Client::new()
        .get(web.url(&format!("/v1/sessions/{session}/events")))
        .header("Last-Event-ID", "yesterday")
        .send()
        .await
        .expect("GET");
    assert_eq!(response.status(), 400);
    // A POST without the header (a cross-site form) or from another origin is refused.
    let response = reqwest::Client::new()
        .post(web.url(&format!("/v1/sessions/{session}/messages")))
        .json(&json!({"text": "from a form"}))
        .send()
        .await
        .expect("POST");
    assert_eq!(response.status(), 403);
    let response = reqwest::Client::new()
        .post(web.url(&format!("/v1/sessions/{session}/messages")))
        .header("X-Agentlog-Request", "1")
        .header("Origin", "https://evil.example")
        .json(&json!({"text": "from elsewhere"}))
        .send()
        .await
        .expect("POST");
    assert_eq!(response.status(), 403);
    assert_eq!(read_log(&mut client, session).await.len(), 4);
}

async fn delete(web: &Web, session: &str, with_header: bool) -> (u16, Value) {
    let mut request = reqwest::Client::new().delete(web.url(&format!("/v1/sessions/{session}")));
    if with_header {
        request = request.header("X-Agentlog-Request", "1");
    }
    let response = request.send().await.expect("DELETE");
    let status = response.status().as_u16();
    (status, response.json().await.unwrap_or(Value::Null))
}

#[tokio::test(flavor = "multi_thread")]
async fn a_delete_ends_the_session_for_its_readers_and_its_json() {
    let store = Store::start().expect("store");
    let web = Web::start(&store);
    let session = "sse-deleted";
    append(&store, session, 1..=3).await;
    let mut stream = open(&web, session, 1, None).await;
    read_events(&mut stream, 3).await;
    expect_caught_up(&mut stream, 3).await;

    // Without the request header (a cross-site form) nothing is deleted.
    let (status, _) = delete(&web, session, false).await;
    assert_eq!(status, 403);
    assert_eq!(get(&web, &format!("/v1/sessions/{session}")).await.0, 200);

    let (status, body) = delete(&web, session, true).await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body, json!({"sessionId": session, "deleted": true}));
    // The live reader is told, and its stream ends.
    let e = next(&mut stream).await;
    assert_eq!(e.event, "deleted", "{e:?}");
    assert!(
        e.id.is_none() || e.id == Some(3),
        "the marker moves no resume point: {e:?}"
    );
    assert!(
        tokio::time::timeout(PATIENCE, stream.next())
            .await
            .expect("the stream ends")
            .is_none(),
        "nothing follows the deleted marker"
    );
    // Every later request says why, with the store's reason.
    let (status, body) = get(&web, &format!("/v1/sessions/{session}")).await;
    assert_eq!(status, 404);
    assert_eq!(body["error"]["reason"], json!("SESSION_DELETED"), "{body}");
    let response = reqwest::get(web.url(&format!("/v1/sessions/{session}/events")))
        .await
        .expect("GET events");
    assert_eq!(response.status(), 404);
    let (status, body) = post(
        &web,
        &format!("/v1/sessions/{session}/messages"),
        json!({"text": "bring it back"}),
    )
    .await;
    assert_eq!(status, 404, "{body}");
    assert_eq!(body["error"]["reason"], json!("SESSION_DELETED"));
    // Deleting it again is done already; a session that never was is not found.
    assert_eq!(delete(&web, session, true).await.0, 200);
    let (status, body) = delete(&web, "never-written", true).await;
    assert_eq!(status, 404);
    assert_eq!(body["error"]["reason"], json!("SESSION_NOT_FOUND"));
}
