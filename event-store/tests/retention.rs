//! Retention on PostgreSQL runs on one replica at a time: a pass starts only on the replica
//! that takes the retention advisory lock, so while someone else holds it nothing is
//! deleted, and once it is free the idle sessions go. (This file is a test binary of its
//! own: it moves the process-wide clock, `event_store::clock::set_offset_ms`.)

use std::time::{Duration, Instant};

use agentlog_proto::reason::Reason;
use agentlog_proto::v1::{event, Durability, Event, UserMessage};
use event_store::backend::postgres::{NotifyMode, PgBackend, PgConfig, RETENTION_LOCK};
use event_store::backend::{AppendOp, Backend};
use event_store::retention::Retention;
use testkit::pg::Postgres;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retention_pass_runs_only_on_the_replica_holding_the_lock() {
    let pg = tokio::task::block_in_place(Postgres::start).unwrap();
    let url = tokio::task::block_in_place(|| pg.create_database()).unwrap();
    let backend = PgBackend::open(PgConfig {
        url: url.clone(),
        ca_file: None,
        pool_size: 4,
        notify: NotifyMode::Listen,
        poll_interval: Duration::from_millis(500),
        cache_bytes: 64 << 20,
        search: true,
        retention: Some(Retention {
            idle: Duration::from_secs(3600),
            interval: Duration::from_millis(100),
        }),
    })
    .await
    .unwrap();
    backend
        .append(AppendOp {
            session_id: "idle".into(),
            events: vec![Event {
                kind: Some(event::Kind::UserMessage(UserMessage { text: "hi".into() })),
                ..Event::default()
            }]
            .into_iter()
            .map(Into::into)
            .collect(),
            expected_last_seq: None,
            lease_epoch: None,
            durability: Durability::Sync,
        })
        .await
        .unwrap();

    // Another replica's pass, as far as this one can tell: the lock is taken.
    let (other, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    other
        .execute("SELECT pg_advisory_lock($1)", &[&RETENTION_LOCK])
        .await
        .unwrap();
    event_store::clock::set_offset_ms(2 * 3600 * 1000);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(
        backend.get_session("idle").await.is_ok(),
        "a pass ran while another replica held the lock"
    );

    other
        .execute("SELECT pg_advisory_unlock($1)", &[&RETENTION_LOCK])
        .await
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        match backend.get_session("idle").await {
            Err(e) if e.reason() == Some(Reason::SessionDeleted) => break,
            other => assert!(
                Instant::now() < deadline,
                "retention never ran once the lock was free: {other:?}"
            ),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
