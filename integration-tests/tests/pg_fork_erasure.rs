//! A PostgreSQL store replica killed (`kill -9`) in the middle of erasing a deleted parent
//! whose forks share its prefix (`backend::postgres`'s `materialize_forks`): the parent's
//! deletion is answered, the replica dies while the forks' prefixes are being made their
//! own, and another replica's sweep of `agentlog_erasures` finishes the work. Every fork,
//! and a fork of a fork, then reads its whole log (the parent's prefix, as the fork's, and
//! its own events), dedups a prefix id, appends on, and no row of the parent is left.
//!
//! The sweep takes up erasures at least 30 s old, so this test waits that long.

use std::time::{Duration, Instant};

use agentlog_proto::v1::{AppendRequest, DeleteSessionRequest, Event, ForkSessionRequest};
use integration_tests::{bin_path, pg, read_log, user_event, Backing, Store};

/// The parent's events: enough that materializing its forks takes a moment.
const PREFIX: u64 = 20_000;
const FORKS: usize = 24;
/// The sweep's age (30 s) and period (30 s), with room on a loaded machine.
const BOUND: Duration = Duration::from_secs(150);

fn start(url: &str, pg: &std::sync::Arc<pg::Postgres>) -> Store {
    Store::start_backed(
        &bin_path("event-store"),
        Backing::Database(url.to_string(), Some(pg.clone())),
        "127.0.0.1:0",
        &[],
    )
    .expect("a store replica starts")
}

fn query(pg: &pg::Postgres, db: &str, sql: &str) -> String {
    pg.psql(db, sql).expect("psql answers")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_killed_while_materializing_forks_leaves_them_whole_for_another() {
    let pg = pg::shared().unwrap();
    let url = tokio::task::block_in_place(|| pg.create_database()).unwrap();
    let db = url.rsplit('/').next().unwrap().to_string();
    let mut a = start(&url, &pg);
    let mut client = a.client().await.unwrap();
    let mut next = 0u64;
    while next < PREFIX {
        let events: Vec<Event> = (next..(next + 1000).min(PREFIX))
            .map(|i| user_event(&format!("p{i}"), &format!("PARENT-TEXT {i}")))
            .collect();
        next += events.len() as u64;
        client
            .append(AppendRequest {
                session_id: "p".into(),
                events,
                ..Default::default()
            })
            .await
            .unwrap();
    }
    let forks: Vec<String> = (0..FORKS).map(|i| format!("k{i}")).collect();
    for fork in &forks {
        client
            .fork_session(ForkSessionRequest {
                session_id: "p".into(),
                at_seq: PREFIX,
                new_session_id: fork.clone(),
                events: vec![user_event(&format!("{fork}-own"), "the fork's own")],
            })
            .await
            .unwrap();
    }
    // A fork of a fork reads through k0 and p.
    client
        .fork_session(ForkSessionRequest {
            session_id: "k0".into(),
            at_seq: PREFIX + 1,
            new_session_id: "g".into(),
            events: vec![],
        })
        .await
        .unwrap();
    let parent = read_log(&mut client, "p").await;
    let mut want = Vec::new();
    for fork in forks.iter().chain(std::iter::once(&"g".to_string())) {
        want.push((fork.clone(), read_log(&mut client, fork).await));
    }
    assert_eq!(
        query(
            &pg,
            &db,
            "SELECT count(*) FROM agentlog_events WHERE session_id <> 'p'"
        ),
        FORKS.to_string(),
        "the forks hold only their own events"
    );

    client
        .delete_session(DeleteSessionRequest {
            session_id: "p".into(),
        })
        .await
        .unwrap();
    // Killed while its erasure works through the forks (each takes tens of ms).
    tokio::time::sleep(Duration::from_millis(300)).await;
    a.kill9();
    let materialized = query(
        &pg,
        &db,
        "SELECT count(*) FROM agentlog_sessions WHERE session_id LIKE 'k%' \
         AND base_session = ''",
    );
    eprintln!("the killed replica had materialized {materialized} of {FORKS} forks");

    let b = start(&url, &pg);
    let mut client = b.client().await.unwrap();
    let deadline = Instant::now() + BOUND;
    while query(&pg, &db, "SELECT count(*) FROM agentlog_erasures") != "0" {
        assert!(Instant::now() < deadline, "the erasure was never finished");
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(
        query(
            &pg,
            &db,
            "SELECT count(*) FROM agentlog_events WHERE session_id = 'p'"
        ),
        "0"
    );
    for (fork, log) in &want {
        assert_eq!(
            &read_log(&mut client, fork).await,
            log,
            "{fork} after the erasure"
        );
        let prefix: Vec<Event> = parent
            .iter()
            .map(|e| Event {
                session_id: fork.clone(),
                ..e.clone()
            })
            .collect();
        assert_eq!(log[..PREFIX as usize], prefix[..], "{fork}'s prefix is p's");
        let answer = client
            .append(AppendRequest {
                session_id: fork.clone(),
                events: vec![
                    user_event("p7", "again"),
                    user_event(&format!("{fork}-after"), "after"),
                ],
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        let last = log.len() as u64 + 1;
        assert_eq!(
            answer.seqs,
            vec![8, last],
            "{fork}: dedup of a prefix id, then new"
        );
    }
    assert_eq!(
        query(
            &pg,
            &db,
            "SELECT count(*) FROM agentlog_sessions WHERE base_session <> ''"
        ),
        "1",
        "only g still reads through its (live) base k0"
    );
}
