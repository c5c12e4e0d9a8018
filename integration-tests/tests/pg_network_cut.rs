//! A store replica cut off from its database answers instead of hanging. PostgreSQL runs in
//! a network namespace (as root: `ip netns`, a veth pair), and the link is cut for a while
//! by setting its far end down: packets are dropped, nothing is refused or reset, every
//! socket stays open, as when a partition takes the database's host away. Four writers
//! append with a 5 s deadline, each retrying an unanswered append with the same event id.
//!
//! During the cut every call is answered UNAVAILABLE, none runs into the client's deadline,
//! and health turns NOT_SERVING; once the link is back, appends come back by themselves and
//! health turns SERVING. Nothing acknowledged is lost and nothing is written twice: an
//! append whose commit was in doubt is settled by its retry. (Times are printed, not
//! asserted: the bound that matters is that no call reached the client's deadline.)

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::AppendRequest;
use integration_tests::netns::NetNs;
use integration_tests::pg::Postgres;
use integration_tests::{assert_log_holds, bin_path, read_log, user_event, Backing, Store};
use tonic::transport::Channel;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

const WRITERS: usize = 4;
/// The writers' deadline per call.
const DEADLINE: Duration = Duration::from_secs(5);
/// How long the link stays cut: longer than the deadline, so that a call left hanging
/// would show.
const CUT: Duration = Duration::from_secs(8);
/// For conditions that must come eventually.
const BOUND: Duration = Duration::from_secs(60);

#[derive(Default)]
struct Seen {
    /// session → (event id → seq) acknowledged.
    acked: BTreeMap<String, BTreeMap<String, u64>>,
    /// Every failed call: its status code and how long it took.
    failed: Vec<(Code, Duration)>,
    /// When each acknowledgement came.
    ack_times: Vec<Instant>,
}

async fn writer(
    mut client: EventStoreClient<Channel>,
    session: String,
    seen: Arc<Mutex<Seen>>,
    stop: Arc<AtomicBool>,
    acks: Arc<AtomicUsize>,
) {
    let mut n = 0;
    while !stop.load(Ordering::Relaxed) {
        let id = format!("{session}-{n}");
        loop {
            let mut request = tonic::Request::new(AppendRequest {
                session_id: session.clone(),
                events: vec![user_event(&id, &id)],
                ..AppendRequest::default()
            });
            request.set_timeout(DEADLINE);
            let started = Instant::now();
            match client.append(request).await {
                Ok(resp) => {
                    let seq = resp.into_inner().seqs[0];
                    let mut seen = seen.lock().unwrap();
                    seen.acked
                        .entry(session.clone())
                        .or_default()
                        .insert(id.clone(), seq);
                    seen.ack_times.push(Instant::now());
                    acks.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                Err(status) => {
                    seen.lock()
                        .unwrap()
                        .failed
                        .push((status.code(), started.elapsed()));
                    // The same event id again: it settles an append whose commit is in doubt.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }
        }
        n += 1;
    }
}

async fn health(url: &str) -> Option<ServingStatus> {
    let channel = tonic::transport::Endpoint::from_shared(url.to_string())
        .ok()?
        .connect()
        .await
        .ok()?;
    let mut request = tonic::Request::new(HealthCheckRequest {
        service: "agentlog.v1.EventStore".into(),
    });
    request.set_timeout(Duration::from_secs(5));
    let resp = HealthClient::new(channel).check(request).await.ok()?;
    ServingStatus::try_from(resp.into_inner().status).ok()
}

async fn wait_for(what: &str, mut check: impl AsyncFnMut() -> bool) -> Duration {
    let started = Instant::now();
    while !check().await {
        assert!(started.elapsed() < BOUND, "gave up waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    started.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_cut_off_from_its_database_answers_unavailable_and_recovers() {
    let uid = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/proc/self").unwrap());
    assert!(
        uid == 0,
        "this test cuts a network namespace's link: run it as root (CI does)"
    );
    let netns = NetNs::create().unwrap();
    let root = tempfile::tempdir().unwrap();
    let pg =
        tokio::task::block_in_place(|| Postgres::init_in_netns(root.path(), &netns, &[])).unwrap();
    let url = tokio::task::block_in_place(|| pg.create_database()).unwrap();
    let store = Store::start_backed(
        &bin_path("event-store"),
        Backing::Database(url, None),
        "127.0.0.1:0",
        &[],
    )
    .unwrap();
    let store_url = store.url();

    let seen = Arc::new(Mutex::new(Seen::default()));
    let stop = Arc::new(AtomicBool::new(false));
    let acks = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for w in 0..WRITERS {
        tasks.push(tokio::spawn(writer(
            store.client().await.unwrap(),
            format!("w{w}"),
            seen.clone(),
            stop.clone(),
            acks.clone(),
        )));
    }
    wait_for("appends before the cut", async || {
        acks.load(Ordering::Relaxed) >= 100
    })
    .await;
    assert_eq!(health(&store_url).await, Some(ServingStatus::Serving));
    let failed_before = seen.lock().unwrap().failed.len();

    netns.cut().unwrap();
    let cut_at = Instant::now();
    let not_serving = wait_for("NOT_SERVING during the cut", async || {
        health(&store_url).await == Some(ServingStatus::NotServing)
    })
    .await;
    let acks_at_cut = acks.load(Ordering::Relaxed);
    tokio::time::sleep(CUT.saturating_sub(cut_at.elapsed())).await;
    let during = seen.lock().unwrap().failed[failed_before..].to_vec();
    netns.heal().unwrap();
    let healed_at = Instant::now();

    let serving = wait_for("SERVING after the cut", async || {
        health(&store_url).await == Some(ServingStatus::Serving)
    })
    .await;
    wait_for("appends after the cut", async || {
        acks.load(Ordering::Relaxed) >= acks_at_cut + 100
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.unwrap();
    }

    let seen = std::mem::take(&mut *seen.lock().unwrap());
    let first_ack_after = seen
        .ack_times
        .iter()
        .find(|t| **t > healed_at)
        .map(|t| t.duration_since(healed_at));
    let slowest = during.iter().map(|(_, took)| *took).max();
    eprintln!(
        "cut {CUT:?}: NOT_SERVING {not_serving:?} after the cut; {} calls failed during it, \
         the slowest in {slowest:?}; SERVING {serving:?} and the first ack {first_ack_after:?} \
         after the link came back",
        during.len()
    );
    assert!(
        !during.is_empty(),
        "the writers called the store during the cut"
    );
    let not_unavailable: Vec<_> = seen
        .failed
        .iter()
        .filter(|(code, _)| *code != Code::Unavailable)
        .collect();
    assert!(
        not_unavailable.is_empty(),
        "every failed call was answered UNAVAILABLE (none reached the {DEADLINE:?} deadline): \
         {not_unavailable:?}"
    );

    let mut reader = store.client().await.unwrap();
    for (session, acked) in &seen.acked {
        let log = read_log(&mut reader, session).await;
        assert_log_holds(session, &log, acked);
    }
}
