//! The reclamation of deleted sessions' space in the local log (`backend::local::reclaim`),
//! on the power-loss simulator:
//! - it runs while appends, a live follower and a catch-up reader go on, and none of them
//!   misses, repeats or reorders an event; afterwards no byte of a deleted session's text is
//!   left in the log's files or the index's;
//! - the power cut at each of its crash points (and after each segment it rewrites): every
//!   acknowledged event of a live session is there at its seq, the deleted sessions stay
//!   deleted (their old event ids and epochs write nothing), the index rebuilt from the log
//!   alone agrees, and the reclamation finishes after the restart;
//! - a fork's prefix, shared with its parent, is made the fork's own when the parent is
//!   deleted: it stays, and goes with the fork (more in `fork_shared.rs`).

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentlog_proto::reason::Reason;
use agentlog_proto::v1::{event, Event, ToolStarted};
use common::{held, history, in_files, op, open_store_reclaiming, reclaim_now, user};
use event_store::backend::local::log::storage::{CrashPoint, SimStorage};
use event_store::backend::local::log::LogConfig;
use event_store::backend::local::Store;
use event_store::backend::AppendOp;
use event_store::StoreError;
use tokio_util::sync::CancellationToken;

/// Small segments, so the sessions' records are spread over many.
const LOG: LogConfig = LogConfig {
    segment_bytes: 8 << 10,
    preallocate_bytes: 2 << 10,
};
const LIVE: [&str; 2] = ["live-a", "live-b"];
const DOOMED: [&str; 2] = ["doomed-a", "doomed-b"];
/// In every event of a doomed session, and nowhere else.
const MARK: &str = "FORGET-ME";

/// What was acknowledged: session → (event id → seq).
type Acked = BTreeMap<String, BTreeMap<String, u64>>;

/// Interleaved appends to the live and the doomed sessions, over several segments; a lease
/// on a doomed session too. Returns what was acknowledged and the doomed sessions' epoch.
async fn fill(store: &Store, acked: &mut Acked) -> u64 {
    for i in 0..60 {
        for session in LIVE.iter().chain(&DOOMED) {
            let doomed = DOOMED.contains(session);
            let text = if doomed {
                format!("{MARK} {session} {i} {}", "s".repeat(i * 7))
            } else {
                format!("kept {session} {i}")
            };
            let id = format!("{session}-{i}");
            let resp = store
                .append(op(session, vec![user(&id, &text)]))
                .await
                .unwrap();
            acked
                .entry(session.to_string())
                .or_default()
                .insert(id, resp.seqs[0]);
        }
    }
    let lease = store
        .acquire_lease(DOOMED[0].into(), "runner".into(), 60_000)
        .await
        .unwrap();
    lease.epoch
}

/// Checks every live session holds exactly what was acknowledged, at its seqs, and every
/// doomed one is deleted for good.
async fn check(store: &Store, acked: &Acked, epoch: u64) {
    for session in LIVE {
        let events = history(store, session).await;
        let want = &acked[session];
        assert_eq!(events.len(), want.len(), "{session}");
        for (i, e) in events.iter().enumerate() {
            assert_eq!(e.seq, i as u64 + 1, "{session}: gapless");
            assert_eq!(
                want.get(&e.event_id),
                Some(&e.seq),
                "{session}: {}",
                e.event_id
            );
        }
    }
    for session in DOOMED {
        let refused = |r: Result<_, StoreError>| r.err().and_then(|e| e.reason());
        assert_eq!(
            refused(store.get_session(session).map(|_| ())),
            Some(Reason::SessionDeleted)
        );
        let retry = op(session, vec![user(&format!("{session}-0"), MARK)]);
        assert_eq!(
            refused(store.append(retry).await.map(|_| ())),
            Some(Reason::SessionDeleted),
            "a retried append with an old id"
        );
        let zombie = AppendOp {
            lease_epoch: Some(epoch),
            ..op(
                session,
                vec![Event {
                    event_id: "started:t:1".into(),
                    kind: Some(event::Kind::ToolStarted(ToolStarted::default())),
                    ..Event::default()
                }],
            )
        };
        assert_eq!(
            refused(store.append(zombie).await.map(|_| ())),
            Some(Reason::SessionDeleted),
            "the old epoch"
        );
    }
}

/// Waits until no byte of the doomed sessions' text is in the log or the index.
async fn erased(disk: &SimStorage, index_dir: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let in_log = disk
            .all_bytes()
            .windows(MARK.len())
            .any(|w| w == MARK.as_bytes());
        let in_index = in_files(index_dir, MARK.as_bytes());
        if !in_log && in_index.is_empty() {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "deleted text is still on disk (log: {in_log}, index files: {in_index:?})"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleted_sessions_leave_the_log_while_appends_and_readers_go_on() {
    let disk = SimStorage::new();
    let dir = tempfile::tempdir().unwrap();
    let index_dir = dir.path().join("index");
    let store = Arc::new(open_store_reclaiming(&disk, &index_dir, LOG, held()));
    let mut acked = Acked::new();
    let epoch = fill(&store, &mut acked).await;
    drop(store);
    // Reopened with reclamation on: the deletions below are reclaimed at once.
    let store = Arc::new(open_store_reclaiming(&disk, &index_dir, LOG, reclaim_now()));

    // A catch-up reader of the whole history, taking one run and then pausing; a live
    // follower; appends all along.
    let mut reader = store.subscribe(LIVE[0].into(), 1, false, CancellationToken::new());
    let first = reader.recv().await.unwrap().unwrap().into_events().unwrap();
    let mut follower = store.subscribe(LIVE[1].into(), 1, true, CancellationToken::new());
    let appending = {
        let store = store.clone();
        tokio::spawn(async move {
            let mut acked = Acked::new();
            for i in 0..200 {
                for session in LIVE {
                    let id = format!("{session}-during-{i}");
                    let resp = store
                        .append(op(session, vec![user(&id, "during")]))
                        .await
                        .unwrap();
                    acked
                        .entry(session.to_string())
                        .or_default()
                        .insert(id, resp.seqs[0]);
                }
            }
            acked
        })
    };
    for session in DOOMED {
        store.delete_session(session).await.unwrap();
    }
    erased(&disk, &index_dir).await;
    for (session, ids) in appending.await.unwrap() {
        acked.get_mut(&session).unwrap().extend(ids);
    }

    // The reader, paused across the rewrites, reads on without a gap.
    let mut read: Vec<u64> = first.iter().map(|e| e.seq).collect();
    while let Some(run) = reader.recv().await {
        read.extend(run.unwrap().into_events().unwrap().iter().map(|e| e.seq));
    }
    assert_eq!(read, (1..=read.len() as u64).collect::<Vec<_>>());
    assert!(
        read.len() >= 60,
        "at least the history before the reader started"
    );
    // The follower saw every event of its session, once, in order.
    let total = acked[LIVE[1]].len() as u64;
    let mut seen = Vec::new();
    while (seen.len() as u64) < total {
        let run = follower.recv().await.unwrap().unwrap();
        seen.extend(run.into_events().unwrap().iter().map(|e| e.seq));
    }
    assert_eq!(seen, (1..=total).collect::<Vec<_>>());
    check(&store, &acked, epoch).await;
    drop(follower);
    let store = Arc::into_inner(store).expect("the only handle");
    store.close().unwrap();

    // Reopened on what is left: the same.
    let store = open_store_reclaiming(&disk, &index_dir, LOG, reclaim_now());
    check(&store, &acked, epoch).await;
    store.close().unwrap();
}

/// Cuts the power at `point` (the `nth` time a pass reaches it) while appends go on, then
/// restarts, checks, lets the reclamation finish and checks again, and once more with the
/// index rebuilt from the log alone.
async fn cut_at(point: CrashPoint, nth: usize) {
    let disk = SimStorage::new();
    let dir = tempfile::tempdir().unwrap();
    let index_dir = dir.path().join("index");
    let store = open_store_reclaiming(&disk, &index_dir, LOG, held());
    let mut acked = Acked::new();
    let epoch = fill(&store, &mut acked).await;
    let marked = disk.all_bytes();
    let spread = marked.windows(MARK.len()).filter(|w| *w == MARK.as_bytes());
    assert!(
        spread.count() >= 100,
        "the doomed sessions' text is in the log"
    );
    for session in DOOMED {
        store.delete_session(session).await.unwrap();
    }
    drop(store);

    // Reopened with reclamation on, it takes the deletions up at once.
    disk.crash_at(point, nth);
    let store = Arc::new(open_store_reclaiming(&disk, &index_dir, LOG, reclaim_now()));
    // Appends go on until the power goes (or, should the pass never reach the point, a
    // while).
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut i = 0;
    // The append the cut failed, if any: unacknowledged, so it may or may not have been
    // made durable (a sync of the reclamation's may have covered its bytes before the cut).
    let mut in_doubt = None;
    while !disk.is_off() && Instant::now() < deadline {
        let session = LIVE[i % 2];
        let id = format!("{session}-during-{i}");
        match store.append(op(session, vec![user(&id, "during")])).await {
            Ok(resp) => {
                acked
                    .entry(session.to_string())
                    .or_default()
                    .insert(id, resp.seqs[0]);
            }
            Err(StoreError::Unavailable(_)) | Err(StoreError::Internal(_)) => {
                in_doubt = Some((session, id));
                break;
            }
            Err(e) => panic!("an append failed otherwise: {e}"),
        }
        i += 1;
    }
    assert!(disk.is_off(), "the pass never reached {point:?} #{nth}");
    drop(store);
    disk.power_on();

    // Restarted on what the cut left, reclamation held: nothing live lost, nothing back
    // (but the append in doubt, if it was kept: then it stays, right after the others).
    let store = open_store_reclaiming(&disk, &index_dir, LOG, held());
    if let Some((session, id)) = in_doubt {
        let next = acked.get(session).map_or(0, |a| a.len()) as u64 + 1;
        let kept = history(&store, session)
            .await
            .iter()
            .any(|e| e.event_id == id && e.seq == next);
        if kept {
            acked
                .entry(session.to_string())
                .or_default()
                .insert(id, next);
        }
    }
    check(&store, &acked, epoch).await;
    store.close().unwrap();
    // The same with the index rebuilt from the log alone, where the deleted sessions'
    // records may now be partly gone (their seqs jump).
    std::fs::remove_dir_all(&index_dir).unwrap();
    let store = open_store_reclaiming(&disk, &index_dir, LOG, held());
    check(&store, &acked, epoch).await;
    store.close().unwrap();
    // And the reclamation finishes.
    let store = open_store_reclaiming(&disk, &index_dir, LOG, reclaim_now());
    erased(&disk, &index_dir).await;
    check(&store, &acked, epoch).await;
    store.close().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_while_a_rewrite_is_written_loses_nothing() {
    cut_at(CrashPoint::RewriteWritten, 1).await;
    cut_at(CrashPoint::RewriteWritten, 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_before_a_rewrite_is_put_in_place_loses_nothing() {
    cut_at(CrashPoint::RewriteSynced, 1).await;
    cut_at(CrashPoint::RewriteSynced, 4).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_after_the_rewrites_before_the_index_forgets_loses_nothing() {
    cut_at(CrashPoint::Installed, 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_after_the_index_forgot_before_the_marks_go_loses_nothing() {
    cut_at(CrashPoint::Purged, 1).await;
}

/// A fork shares its parent's prefix: deleting the parent makes the prefix the fork's own
/// and leaves the fork whole (the parent's records go), and deleting the fork then takes the
/// last of the text off the disk.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forks_prefix_outlives_its_deleted_parent_and_goes_with_the_fork() {
    use event_store::backend::local::log::Record;
    use event_store::backend::ForkOp;
    let disk = SimStorage::new();
    let dir = tempfile::tempdir().unwrap();
    let index_dir = dir.path().join("index");
    let store = open_store_reclaiming(&disk, &index_dir, LOG, reclaim_now());
    for i in 0..40 {
        let text = format!("{MARK} parent {i} {}", "p".repeat(300));
        store
            .append(op("parent", vec![user(&format!("p{i}"), &text)]))
            .await
            .unwrap();
        store
            .append(op(LIVE[0], vec![user(&format!("l{i}"), "kept")]))
            .await
            .unwrap();
    }
    store
        .fork(ForkOp {
            parent: "parent".into(),
            at_seq: 40,
            new_session_id: "fork".into(),
            events: Vec::new(),
        })
        .await
        .unwrap();
    let shared = history(&store, "fork").await;
    assert_eq!(shared.len(), 40);

    let marks = |d: &SimStorage| {
        d.all_bytes()
            .windows(MARK.len())
            .filter(|w| *w == MARK.as_bytes())
            .count()
    };
    assert_eq!(marks(&disk), 40, "the parent's 40, shared by the fork");

    store.delete_session("parent").await.unwrap();
    // The parent's records go; the fork's own copies of them (made before) stay, and read
    // back the same.
    // The parent's text is in the fork's records too once they are its own: the parent is
    // gone when none of the text's records is the parent's (asked again while the log
    // cannot be read).
    let parents_left = |d: &SimStorage| {
        let Ok(records) = common::try_read_log(d) else {
            return true;
        };
        records
            .iter()
            .any(|r| matches!(r, Record::Event(e) if e.session_id == "parent"))
    };
    let deadline = Instant::now() + Duration::from_secs(30);
    while parents_left(&disk) {
        assert!(
            Instant::now() < deadline,
            "the parent's reclamation never ended"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(marks(&disk), 40, "the fork's own now");
    assert_eq!(history(&store, "fork").await, shared);

    store.delete_session("fork").await.unwrap();
    erased(&disk, &index_dir).await;
    assert_eq!(history(&store, LIVE[0]).await.len(), 40);
    store.close().unwrap();
}
