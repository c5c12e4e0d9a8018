//! The PostgreSQL backend riding out the loss of its database, with real processes: a
//! primary and one synchronous standby (`pg_basebackup -R`, `synchronous_standby_names`),
//! two store replicas on a multi-host URL with `target_session_attrs=read-write`, appenders
//! and followers on both, and a runner working sessions whose bash tool records its
//! idempotency key. `kill -9` the primary, promote the standby: every acknowledged event is
//! there at its seq, gapless; no epoch is granted twice; the followers on both replicas see
//! every event once, in order; every tool ran once; and the only error anyone saw was
//! UNAVAILABLE. (The appenders' sessions are runnable too, so the runner works them as
//! well: more traffic through the switch.)
//!
//! Also: with the one database down, appends answer UNAVAILABLE, health NOT_SERVING, and
//! the store serves again by itself when the database is back.

mod runner_support;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentlog_proto::v1::event::Kind;
use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::{
    AcquireLeaseRequest, AppendRequest, ReleaseLeaseRequest, SubscribeRequest,
};
use integration_tests::anthropic_standin::{AnthropicStandin, StandinReply};
use integration_tests::pg::{pg_bin, Postgres};
use integration_tests::{
    assert_log_holds, bin_path, poll_until, read_log, user_event, Backing, Store,
};
use runner_support::{
    assert_exactly_once, history, key_counts, start_runner, tool_use_ids, user_says, wait_idle,
};
use serde_json::json;
use tonic::transport::Channel;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

const BOUND: Duration = Duration::from_secs(90);

/// Errors other than UNAVAILABLE, as "what: status".
type Failures = Arc<Mutex<Vec<String>>>;

fn run_as_owner(pg: &Postgres, cmd: &mut std::process::Command) {
    use std::os::unix::process::CommandExt;
    if let Some((uid, gid)) = pg.owner() {
        cmd.uid(uid).gid(gid);
    }
}

/// A primary, and a standby streaming from it that the primary waits for on every commit.
fn primary_and_sync_standby(root: &Path) -> (Postgres, Postgres) {
    let primary_dir = root.join("primary");
    let standby_dir = root.join("standby");
    std::fs::create_dir_all(&primary_dir).unwrap();
    std::fs::create_dir_all(&standby_dir).unwrap();
    let primary =
        Postgres::init(&primary_dir, &["wal_level=replica", "max_wal_senders=5"]).unwrap();
    if let Some((uid, gid)) = primary.owner() {
        std::os::unix::fs::chown(&standby_dir, Some(uid), Some(gid)).unwrap();
    }
    let mut basebackup = std::process::Command::new(pg_bin("pg_basebackup"));
    basebackup
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &primary.port.to_string(),
            "-U",
            "postgres",
        ])
        .arg("-D")
        .arg(standby_dir.join("data"))
        .args(["-R", "-X", "stream", "--no-sync"]);
    run_as_owner(&primary, &mut basebackup);
    let out = basebackup.output().unwrap();
    assert!(
        out.status.success(),
        "pg_basebackup: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let standby = Postgres::start_existing(&standby_dir, &["cluster_name=standby1"]).unwrap();
    primary
        .psql(
            "postgres",
            "ALTER SYSTEM SET synchronous_standby_names = 'standby1'",
        )
        .unwrap();
    primary.psql("postgres", "SELECT pg_reload_conf()").unwrap();
    poll_until("the standby to be synchronous", BOUND, || {
        let state = primary
            .psql("postgres", "SELECT sync_state FROM pg_stat_replication")
            .ok()?;
        (state == "sync").then_some(())
    });
    (primary, standby)
}

#[derive(Default)]
struct Acked {
    /// session → (event_id → seq) acknowledged.
    events: BTreeMap<String, BTreeMap<String, u64>>,
    /// Every epoch granted, in order of grant.
    epochs: Vec<u64>,
}

async fn client(store: &Store) -> EventStoreClient<Channel> {
    store.client().await.unwrap()
}

/// Appends one event at a time to `session`, retrying each (same event id) on UNAVAILABLE
/// until it is acknowledged.
async fn appender(
    mut client: EventStoreClient<Channel>,
    session: String,
    acked: Arc<Mutex<Acked>>,
    count: Arc<AtomicUsize>,
    stop: Arc<AtomicBool>,
    failures: Failures,
) {
    let mut i = 0;
    while !stop.load(Ordering::Relaxed) {
        let id = format!("{session}-e{i}");
        loop {
            let request = AppendRequest {
                session_id: session.clone(),
                events: vec![user_event(&id, &id)],
                ..AppendRequest::default()
            };
            match client.append(request).await {
                Ok(resp) => {
                    let seq = resp.into_inner().seqs[0];
                    acked
                        .lock()
                        .unwrap()
                        .events
                        .entry(session.clone())
                        .or_default()
                        .insert(id.clone(), seq);
                    count.fetch_add(1, Ordering::Relaxed);
                    break;
                }
                Err(status) if status.code() == Code::Unavailable => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                Err(status) => {
                    failures
                        .lock()
                        .unwrap()
                        .push(format!("append {id}: {status}"));
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
            }
        }
        i += 1;
    }
}

/// Acquires and releases a lease on `session` over and over as `owner`, recording every
/// epoch granted.
async fn leaser(
    mut client: EventStoreClient<Channel>,
    session: String,
    owner: String,
    acked: Arc<Mutex<Acked>>,
    stop: Arc<AtomicBool>,
    failures: Failures,
) {
    while !stop.load(Ordering::Relaxed) {
        let lease = client
            .acquire_lease(AcquireLeaseRequest {
                session_id: session.clone(),
                owner: owner.clone(),
                ttl_ms: 2_000,
            })
            .await;
        match lease {
            Ok(lease) => {
                let lease = lease.into_inner();
                acked.lock().unwrap().epochs.push(lease.epoch);
                let released = client
                    .release_lease(ReleaseLeaseRequest {
                        session_id: session.clone(),
                        owner: owner.clone(),
                        epoch: lease.epoch,
                    })
                    .await;
                if let Err(status) = released {
                    if status.code() != Code::Unavailable {
                        failures.lock().unwrap().push(format!("release: {status}"));
                    }
                }
            }
            // The other leaser holds it (or its release was not acknowledged: then it
            // expires).
            Err(status)
                if matches!(status.code(), Code::Unavailable | Code::FailedPrecondition) => {}
            Err(status) => failures.lock().unwrap().push(format!("acquire: {status}")),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Follows `session` and records every seq it is sent.
async fn follower(
    mut client: EventStoreClient<Channel>,
    session: String,
    seen: Arc<Mutex<Vec<u64>>>,
) {
    let mut stream = client
        .subscribe(SubscribeRequest {
            session_id: session,
            from_seq: 0,
            follow: true,
        })
        .await
        .unwrap()
        .into_inner();
    while let Ok(Some(event)) = stream.message().await {
        seen.lock().unwrap().push(event.seq);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failover_loses_no_acknowledged_event_and_answers_only_unavailable() {
    let root = tempfile::tempdir().unwrap();
    let (mut primary, standby) =
        tokio::task::block_in_place(|| primary_and_sync_standby(root.path()));
    primary
        .psql("postgres", "CREATE DATABASE agentlog")
        .unwrap();
    let url = format!(
        "postgres://postgres@127.0.0.1:{},127.0.0.1:{}/agentlog?target_session_attrs=read-write&connect_timeout=2",
        primary.port, standby.port
    );
    let start = || {
        Store::start_backed(
            &bin_path("event-store"),
            Backing::Database(url.clone(), None),
            "127.0.0.1:0",
            &[],
        )
        .unwrap()
    };
    let replicas = [start(), start()];

    let acked = Arc::new(Mutex::new(Acked::default()));
    let failures: Failures = Arc::default();
    let stop = Arc::new(AtomicBool::new(false));
    let count = Arc::new(AtomicUsize::new(0));
    let sessions: Vec<String> = (0..4).map(|i| format!("f{i}")).collect();
    let mut followers = Vec::new();
    for session in &sessions {
        for replica in &replicas {
            let seen = Arc::new(Mutex::new(Vec::new()));
            tokio::spawn(follower(
                client(replica).await,
                session.clone(),
                seen.clone(),
            ));
            followers.push((session.clone(), seen));
        }
    }
    let mut tasks = Vec::new();
    for (i, session) in sessions.iter().enumerate() {
        tasks.push(tokio::spawn(appender(
            client(&replicas[i % 2]).await,
            session.clone(),
            acked.clone(),
            count.clone(),
            stop.clone(),
            failures.clone(),
        )));
    }
    // The leased session needs an event first.
    let mut c = client(&replicas[0]).await;
    c.append(AppendRequest {
        session_id: "leased".into(),
        events: vec![user_event("l0", "go")],
        ..AppendRequest::default()
    })
    .await
    .unwrap();
    for (i, replica) in replicas.iter().enumerate() {
        tasks.push(tokio::spawn(leaser(
            client(replica).await,
            "leased".into(),
            format!("leaser-{i}"),
            acked.clone(),
            stop.clone(),
            failures.clone(),
        )));
    }

    // A runner works two sessions of three side-effecting steps across the switch.
    let steps: Vec<StandinReply> = (0..3)
        .map(|i| {
            StandinReply::text(&format!("Step {i}: recording the key.")).tool(
                "bash",
                json!({"command": "sleep 1; echo \"$IDEMPOTENCY_KEY\" >> keys.txt"}),
            )
        })
        .chain([StandinReply::text("All steps are done.")])
        .collect();
    let standin = AnthropicStandin::start(steps).await.unwrap();
    let workspaces = tempfile::tempdir().unwrap();
    let _runner = start_runner(
        &replicas[0].url(),
        "runner-0",
        workspaces.path(),
        &standin.url(),
        10_000,
        4,
    );
    let runs = ["run0", "run1"];
    for run in runs {
        user_says(&mut c, run, run).await;
    }

    let before = |n: usize| {
        let count = count.clone();
        move || (count.load(Ordering::Relaxed) >= n).then_some(())
    };
    tokio::task::block_in_place(|| poll_until("acks before the failover", BOUND, before(100)));
    let epochs_before = acked.lock().unwrap().epochs.len();
    // Kill while the runner is inside the sessions: each has started its first tool.
    for run in runs {
        let deadline = tokio::time::Instant::now() + BOUND;
        while !history(&mut c, run)
            .await
            .iter()
            .any(|e| matches!(e.kind, Some(Kind::ToolStarted(_))))
        {
            assert!(
                tokio::time::Instant::now() < deadline,
                "{run} never started a tool"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    primary.kill9();
    tokio::time::sleep(Duration::from_millis(500)).await;
    standby.psql("postgres", "SELECT pg_promote()").unwrap();

    let after = count.load(Ordering::Relaxed) + 100;
    tokio::task::block_in_place(|| poll_until("acks after the promotion", BOUND, before(after)));
    tokio::task::block_in_place(|| {
        poll_until("leases after the promotion", BOUND, || {
            (acked.lock().unwrap().epochs.len() > epochs_before + 5).then_some(())
        })
    });
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.unwrap();
    }

    let acked = std::mem::take(&mut *acked.lock().unwrap());
    let mut reader = client(&replicas[1]).await;
    for session in &sessions {
        let log = read_log(&mut reader, session).await;
        assert_log_holds(session, &log, &acked.events[session]);
        for (followed, seen) in followers.iter().filter(|(s, _)| s == session) {
            tokio::task::block_in_place(|| {
                poll_until("the followers to catch up", BOUND, || {
                    (seen.lock().unwrap().len() >= log.len()).then_some(())
                })
            });
            // The runner may still be appending to the session: what the follower saw is
            // the log so far (or more), each seq once, in order.
            let seen = seen.lock().unwrap().clone();
            assert_eq!(
                seen,
                (1..=seen.len() as u64).collect::<Vec<_>>(),
                "{followed}: a follower saw every event once, in order"
            );
        }
    }
    for run in runs {
        let events = wait_idle(&mut reader, run, 0, BOUND).await;
        assert_exactly_once(&events);
        let keys = key_counts(workspaces.path(), run);
        let ids = tool_use_ids(&events);
        assert_eq!(ids.len(), 3, "{run}: three tool calls");
        for id in ids {
            assert_eq!(
                keys.get(&format!("{run}/{id}")),
                Some(&1),
                "{run}/{id} ran once: {keys:?}"
            );
        }
    }
    let epochs = &acked.epochs;
    let mut sorted = epochs.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(
        sorted.len(),
        epochs.len(),
        "no epoch was granted twice: {epochs:?}"
    );
    assert_eq!(
        failures.lock().unwrap().as_slice(),
        &[] as &[String],
        "only UNAVAILABLE during the switch"
    );
}

async fn health(store: &Store) -> Option<ServingStatus> {
    let channel = tonic::transport::Endpoint::from_shared(store.url())
        .ok()?
        .connect()
        .await
        .ok()?;
    let resp = HealthClient::new(channel)
        .check(HealthCheckRequest {
            service: "agentlog.v1.EventStore".into(),
        })
        .await
        .ok()?;
    ServingStatus::try_from(resp.into_inner().status).ok()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_database_down_appends_are_unavailable_and_the_store_recovers_by_itself() {
    let root = tempfile::tempdir().unwrap();
    let mut pg = tokio::task::block_in_place(|| Postgres::init(root.path(), &[])).unwrap();
    let port = pg.port;
    let url = pg.create_database().unwrap();
    let store = Store::start_backed(
        &bin_path("event-store"),
        Backing::Database(url, None),
        "127.0.0.1:0",
        &[],
    )
    .unwrap();
    let mut c = client(&store).await;
    let append = |id: &str| AppendRequest {
        session_id: "s".into(),
        events: vec![user_event(id, id)],
        ..AppendRequest::default()
    };
    assert_eq!(c.append(append("a")).await.unwrap().into_inner().seqs, [1]);
    assert_eq!(health(&store).await, Some(ServingStatus::Serving));

    pg.kill9();
    let refused = c.append(append("b")).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable, "{refused}");
    tokio::task::block_in_place(|| {
        poll_until("NOT_SERVING", BOUND, || {
            let rt = tokio::runtime::Handle::current();
            (rt.block_on(health(&store)) == Some(ServingStatus::NotServing)).then_some(())
        })
    });

    let _back = tokio::task::block_in_place(|| Postgres::start_existing_on(root.path(), port, &[]))
        .unwrap();
    tokio::task::block_in_place(|| {
        poll_until("SERVING again", BOUND, || {
            let rt = tokio::runtime::Handle::current();
            (rt.block_on(health(&store)) == Some(ServingStatus::Serving)).then_some(())
        })
    });
    // The retry of the refused append lands once, after the acknowledged one.
    assert_eq!(c.append(append("b")).await.unwrap().into_inner().seqs, [2]);
    assert_eq!(c.append(append("b")).await.unwrap().into_inner().seqs, [2]);
    let seqs: Vec<u64> = read_log(&mut c, "s").await.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, [1, 2]);
}
