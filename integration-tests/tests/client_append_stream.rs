//! The client's `AppendStream` (many callers' appends on one stream) against the real store:
//! each caller gets what a unary `Append` would have answered (a refusal as the same status,
//! classified alike), in its own order, a refusal leaves the others alone, a store killed
//! mid-stream costs a retry and writes nothing twice, and dropping every handle ends the
//! stream's task.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use agentlog_client::append_stream::AppendStream;
use agentlog_client::refusal::{is_lease_lost, is_session_not_found};
use agentlog_client::retry::{is_transient, retry_transient};
use agentlog_client::{StoreClient, StoreConnection};
use agentlog_proto::reason::Reason;
use agentlog_proto::v1::{
    event, AcquireLeaseRequest, AppendRequest, Durability, Event, ReleaseLeaseRequest, ToolResult,
};
use integration_tests::{read_log, user_event, Store};
use tonic::{Code, Status};

fn store_client(store: &Store) -> StoreClient {
    StoreConnection {
        url: store.url(),
        ..StoreConnection::default()
    }
    .client()
    .expect("a client")
}

fn user_append(session_id: &str, id: &str) -> AppendRequest {
    AppendRequest {
        session_id: session_id.into(),
        events: vec![user_event(id, id)],
        ..AppendRequest::default()
    }
}

/// A runner-written event under `lease_epoch`.
fn runner_append(session_id: &str, id: &str, lease_epoch: u64) -> AppendRequest {
    AppendRequest {
        session_id: session_id.into(),
        events: vec![Event {
            event_id: id.into(),
            kind: Some(event::Kind::ToolResult(ToolResult {
                tool_use_id: id.into(),
                ..ToolResult::default()
            })),
            ..Event::default()
        }],
        lease_epoch: Some(lease_epoch),
        ..AppendRequest::default()
    }
}

/// What a caller decides a refusal on, and what it shows.
fn seen_as(status: &Status) -> (Code, String, Option<Reason>, bool, bool, bool, Vec<u8>) {
    (
        status.code(),
        status.message().to_string(),
        Reason::of(status),
        is_lease_lost(status),
        is_session_not_found(status),
        is_transient(status),
        status.details().to_vec(),
    )
}

/// Each refusal, sent once as a unary Append and once on the stream (refusals change
/// nothing, so both meet the same state), comes back as the same status: code, message,
/// ErrorInfo reason, and what the refusal helpers make of it. The appends around them on
/// the stream are answered as if the refusals were not there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusal_on_the_stream_is_the_unary_status_and_leaves_the_others_alone() {
    let store = Store::start().expect("store starts");
    let mut client = store_client(&store);
    let appends = AppendStream::new(client.clone());
    let session = "refusals";
    assert_eq!(
        appends
            .append(user_append(session, "u1"))
            .await
            .expect("u1")
            .seqs,
        [1]
    );
    let lease = client
        .acquire_lease(AcquireLeaseRequest {
            session_id: session.into(),
            owner: "runner-a".into(),
            ttl_ms: 60_000,
        })
        .await
        .expect("acquire")
        .into_inner();
    assert_eq!(
        appends
            .append(runner_append(session, "r1", lease.epoch))
            .await
            .expect("r1 under the live lease")
            .seqs,
        [2]
    );
    client
        .release_lease(ReleaseLeaseRequest {
            session_id: session.into(),
            owner: "runner-a".into(),
            epoch: lease.epoch,
        })
        .await
        .expect("release");

    let fenced = runner_append(session, "r2", lease.epoch);
    let stale = AppendRequest {
        expected_last_seq: Some(1),
        ..user_append(session, "u-stale")
    };
    let empty = AppendRequest {
        session_id: session.into(),
        ..AppendRequest::default()
    };
    let bad_session = user_append("not a session id!", "u-bad");
    let missing = runner_append("nowhere", "r-nowhere", 1);
    let cases = [
        ("LEASE_FENCED", fenced, Some(Reason::LeaseFenced)),
        ("SEQ_CONFLICT", stale, Some(Reason::SeqConflict)),
        ("no events", empty, None),
        ("a malformed session id", bad_session, None),
        (
            "a lease epoch on no session",
            missing,
            Some(Reason::LeaseFenced),
        ),
    ];
    let mut next_seq = 3;
    for (what, request, reason) in cases {
        let before = appends.append(user_append(session, &format!("before {what}")));
        assert_eq!(before.await.expect("before").seqs, [next_seq], "{what}");
        let unary = client
            .append(request.clone())
            .await
            .expect_err("unary refused");
        // On the stream with another caller's append in flight behind it.
        let after = user_append(session, &format!("after {what}"));
        let (streamed, after) = tokio::join!(appends.append(request), appends.append(after));
        let streamed = streamed.expect_err("refused on the stream");
        assert_eq!(seen_as(&streamed), seen_as(&unary), "{what}");
        assert_eq!(Reason::of(&streamed), reason, "{what}");
        assert_eq!(after.expect("after").seqs, [next_seq + 1], "{what}");
        next_seq += 2;
    }
    assert!(is_lease_lost(
        &appends
            .append(runner_append(session, "r3", lease.epoch))
            .await
            .expect_err("still fenced")
    ));
    let log = read_log(&mut store.client().await.expect("connect"), session).await;
    assert_eq!(log.len() as u64, next_seq - 1, "only the accepted appends");
}

/// Many callers on clones of one handle, each awaiting its appends one after another, more
/// requests at once than the stream keeps in flight: every caller's events are in the log
/// in the order it made them, each once, at the seqs it was given.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_callers_are_answered_each_in_its_own_order() {
    const CALLERS: usize = 12;
    const EACH: usize = 150;
    let store = Store::start().expect("store starts");
    let appends = AppendStream::new(store_client(&store));
    let session = "many-callers";
    let mut callers = Vec::new();
    for caller in 0..CALLERS {
        let appends = appends.clone();
        callers.push(tokio::spawn(async move {
            let mut given = Vec::new();
            for i in 0..EACH {
                let id = format!("c{caller}-{i}");
                let durability = if i % 2 == 0 {
                    Durability::Sync
                } else {
                    Durability::Buffered
                };
                let request = AppendRequest {
                    durability: durability as i32,
                    ..user_append(session, &id)
                };
                let response = appends.append(request).await.expect("appended");
                given.push((id, response.seqs[0]));
            }
            given
        }));
    }
    // And a burst from one more caller, all at once: beyond the in-flight bound.
    let burst: Vec<_> = (0..3 * agentlog_client::append_stream::IN_FLIGHT)
        .map(|i| appends.append(user_append(session, &format!("burst-{i}"))))
        .collect();
    let burst = futures::future::join_all(burst).await;
    let mut given: HashMap<String, u64> = HashMap::new();
    for (i, answer) in burst.into_iter().enumerate() {
        given.insert(format!("burst-{i}"), answer.expect("burst").seqs[0]);
    }
    for caller in callers {
        let seqs = caller.await.expect("caller");
        assert!(
            seqs.windows(2).all(|w| w[0].1 < w[1].1),
            "one caller's appends are logged in the order it made them: {seqs:?}"
        );
        given.extend(seqs);
    }
    let log = read_log(&mut store.client().await.expect("connect"), session).await;
    assert_eq!(log.len(), given.len(), "each append once");
    for event in &log {
        assert_eq!(given.get(&event.event_id), Some(&event.seq), "{event:?}");
    }
}

/// The store is killed (-9) and restarted on the same address while callers append: the
/// requests the broken stream left unanswered fail with a transient status, the retry (same
/// event id) opens a new stream, and every event is in the log once, at the seq its caller
/// was finally given, in each caller's order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_killed_mid_stream_costs_a_retry_and_writes_nothing_twice() {
    const CALLERS: usize = 4;
    let data = tempfile::tempdir().expect("temp dir");
    let mut store = Store::start_in(data.path()).expect("store starts");
    let listen = store.addr.to_string();
    let appends = AppendStream::new(store_client(&store));
    let session = "killed";
    let stop = Arc::new(AtomicBool::new(false));
    let failed_transiently = Arc::new(AtomicUsize::new(0));
    let mut callers = Vec::new();
    for caller in 0..CALLERS {
        let appends = appends.clone();
        let stop = stop.clone();
        let failed_transiently = failed_transiently.clone();
        callers.push(tokio::spawn(async move {
            let mut given = Vec::new();
            let mut i = 0;
            while !stop.load(Ordering::SeqCst) {
                let request = user_append(session, &format!("c{caller}-{i}"));
                let response = retry_transient("Append", Duration::from_secs(30), || {
                    let failed_transiently = failed_transiently.clone();
                    let answer = appends.append(request.clone());
                    async move {
                        let answer = answer.await;
                        if answer.as_ref().is_err_and(is_transient) {
                            failed_transiently.fetch_add(1, Ordering::SeqCst);
                        }
                        answer
                    }
                })
                .await
                .expect("appended, after retries");
                given.push((request.events[0].event_id.clone(), response.seqs[0]));
                i += 1;
            }
            given
        }));
    }
    let mut client = store.client().await.expect("connect");
    for kill in 0..2 {
        wait_for_log_to_grow(&mut client, session, 200 * (kill + 1)).await;
        store.kill9();
        tokio::time::sleep(Duration::from_millis(300)).await;
        store = Store::start_on(data.path(), &listen).expect("restart the store");
        client = store.client().await.expect("connect");
    }
    wait_for_log_to_grow(&mut client, session, 600).await;
    stop.store(true, Ordering::SeqCst);
    let mut given: HashMap<String, u64> = HashMap::new();
    for caller in callers {
        let seqs = caller.await.expect("caller");
        assert!(seqs.windows(2).all(|w| w[0].1 < w[1].1), "{seqs:?}");
        given.extend(seqs);
    }
    assert!(
        failed_transiently.load(Ordering::SeqCst) > 0,
        "the kills broke a stream with requests in flight"
    );
    let log = read_log(&mut client, session).await;
    assert_eq!(log.len(), given.len(), "every acknowledged append once");
    for event in &log {
        assert_eq!(given.get(&event.event_id), Some(&event.seq), "{event:?}");
    }
}

/// Once every clone of the handle is dropped, the task that owns the stream ends (and the
/// stream with it): the runtime is back to the tasks it had before.
#[tokio::test(flavor = "current_thread")]
async fn dropping_every_handle_ends_the_stream_and_its_task() {
    let store = Store::start().expect("store starts");
    let mut client = store_client(&store);
    // Connect first: the connection's own tasks are not the stream's.
    client
        .append(user_append("dropped", "u0"))
        .await
        .expect("unary");
    let metrics = tokio::runtime::Handle::current().metrics();
    let before = metrics.num_alive_tasks();
    let appends = AppendStream::new(client.clone());
    let other = appends.clone();
    appends
        .append(user_append("dropped", "u1"))
        .await
        .expect("u1");
    other
        .append(user_append("dropped", "u2"))
        .await
        .expect("u2");
    assert!(metrics.num_alive_tasks() > before, "the stream's task runs");
    drop(appends);
    drop(other);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while metrics.num_alive_tasks() > before {
        assert!(
            tokio::time::Instant::now() < deadline,
            "{} tasks left, {before} before the stream",
            metrics.num_alive_tasks()
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

async fn wait_for_log_to_grow(
    client: &mut agentlog_proto::v1::event_store_client::EventStoreClient<
        tonic::transport::Channel,
    >,
    session: &str,
    events: u64,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let info = client
            .get_session(agentlog_proto::v1::GetSessionRequest {
                session_id: session.into(),
            })
            .await;
        if info.is_ok_and(|info| info.into_inner().last_seq >= events) {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the log did not reach {events} events"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
