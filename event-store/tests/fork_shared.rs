//! A fork shares its parent's prefix in the local log (`backend::local`'s `fork`): its log
//! holds its start (with its state at the fork point) and its own events, and its seqs
//! `1..=at_seq` are read through the parent, down a line of forks. On the power-loss
//! simulator:
//! - Subscribe (from any seq), the title and dedup of a fork and of a fork of a fork read
//!   through their bases as if the prefix were theirs (same ids, contents, the fork's
//!   session id), and nothing of the prefix is written again; the same after a restart,
//!   with the index rebuilt from the log, and with an index that had not absorbed the
//!   forks' starts;
//! - deleting a parent first makes its forks' prefixes their own, then takes its records
//!   (its text too) off the disk: the forks read, dedup and append on, whole, and so does a
//!   fork of a fork whose middle is deleted, and a fork deleted before the index took in
//!   its prefix made its own leaves none of it behind;
//! - the power cut at each step of that (the materialization written, durable, the
//!   parent's segments rewritten, the index purged) leaves every fork whole, before and
//!   after the reclamation finishes;
//! - a prefix id retried on a fork right after its parent's deletion is not written again;
//! - a fork an earlier release wrote, its prefix copied, reads and dedups as before.

mod common;

use std::path::Path;
use std::time::{Duration, Instant};

use agentlog_proto::v1::Event;
use common::{held, history, in_files, op, open_store_reclaiming, read_log, reclaim_now, user};
use event_store::backend::local::log::storage::{CrashPoint, SimStorage};
use event_store::backend::local::log::{LogConfig, Record};
use event_store::backend::local::Store;
use event_store::backend::ForkOp;

/// Small segments, so the sessions' records are spread over several.
const LOG: LogConfig = LogConfig {
    segment_bytes: 8 << 10,
    preallocate_bytes: 2 << 10,
};
/// In the parent's events up to the fork point (so in the forks' prefixes).
const SHARED: &str = "SHARED-TEXT";
/// In the parent's events after the fork point only: gone from the disk with the parent.
const PARENT_ONLY: &str = "PARENT-ONLY";
const PREFIX: u64 = 20;

fn fork_op(parent: &str, at_seq: u64, new: &str, events: Vec<Event>) -> ForkOp {
    ForkOp {
        parent: parent.into(),
        at_seq,
        new_session_id: new.into(),
        events: events.into_iter().map(Into::into).collect(),
    }
}

/// The parent `p` (30 user messages, ids `p0…`), the fork `f` of it at seq 20 with one new
/// event (`f-new`, seq 21), and the fork `g` of `f` at seq 21 with one (`g-new`, seq 22);
/// another session's events between them all.
async fn make_line(store: &Store) {
    for i in 0..30u64 {
        let text = if i < PREFIX {
            format!("{SHARED} {i} {}", "s".repeat(200))
        } else {
            format!("{PARENT_ONLY} {i} {}", "o".repeat(200))
        };
        store
            .append(op("p", vec![user(&format!("p{i}"), &text)]))
            .await
            .unwrap();
        store
            .append(op("other", vec![user(&format!("o{i}"), "other")]))
            .await
            .unwrap();
    }
    let f = store
        .fork(fork_op("p", PREFIX, "f", vec![user("f-new", "f's own")]))
        .await
        .unwrap();
    assert_eq!(f.last_seq, PREFIX + 1);
    let g = store
        .fork(fork_op(
            "f",
            PREFIX + 1,
            "g",
            vec![user("g-new", "g's own")],
        ))
        .await
        .unwrap();
    assert_eq!(g.last_seq, PREFIX + 2);
}

/// What `f` and `g` must read: `p`'s first events as theirs, then their own.
fn expected(parent: &[Event], session: &str) -> Vec<Event> {
    let mut events: Vec<Event> = parent[..PREFIX as usize]
        .iter()
        .map(|e| Event {
            session_id: session.into(),
            ..e.clone()
        })
        .collect();
    let own = |id: &str, text: &str, seq: u64| Event {
        session_id: session.into(),
        seq,
        schema_version: 1,
        ..user(id, text)
    };
    events.push(own("f-new", "f's own", PREFIX + 1));
    if session == "g" {
        events.push(own("g-new", "g's own", PREFIX + 2));
    }
    events
}

/// Checks `f` and `g` read `parent`'s prefix as theirs (ids, contents, times; their own
/// session id), from seq 1 and from within, and their titles.
async fn check_line(store: &Store, parent: &[Event]) {
    for session in ["f", "g"] {
        let read = history(store, session).await;
        let want = expected(parent, session);
        // The times of the forks' own events are the store's.
        let strip = |events: &[Event]| -> Vec<Event> {
            events
                .iter()
                .map(|e| Event {
                    ts_unix_ms: if e.seq > PREFIX { 0 } else { e.ts_unix_ms },
                    ..e.clone()
                })
                .collect()
        };
        same(&strip(&read), &strip(&want), session);
        for from in [2, PREFIX, PREFIX + 1] {
            let mut rx = store.subscribe(
                session.into(),
                from,
                false,
                tokio_util::sync::CancellationToken::new(),
            );
            let mut got = Vec::new();
            while let Some(run) = rx.recv().await {
                got.extend(run.and_then(|r| r.into_events()).unwrap());
            }
            same(&strip(&got), &strip(&want[from as usize - 1..]), session);
        }
        let info = store.get_session(session).unwrap();
        assert_eq!(info.last_seq, want.len() as u64);
        assert!(info.title.starts_with(SHARED), "{session}: {}", info.title);
    }
}

/// `read` is `want`, or the first difference is named.
fn same(read: &[Event], want: &[Event], what: &str) {
    for (r, w) in read.iter().zip(want) {
        assert_eq!(r, w, "{what}: the first difference");
    }
    assert_eq!(read.len(), want.len(), "{what}: events read");
}

/// Dedup through the line: an id of the shared prefix is answered with its seq, one of the
/// parent after the fork point is new to the fork. Returns nothing; writes nothing for the
/// repeats.
async fn check_dedup(store: &Store) {
    let again = store.append(op("f", vec![user("p5", "x")])).await.unwrap();
    assert_eq!(again.seqs, vec![6], "an id of f's prefix");
    let again = store.append(op("g", vec![user("p3", "x")])).await.unwrap();
    assert_eq!(again.seqs, vec![4], "an id of g's prefix, two bases down");
    let again = store
        .append(op("g", vec![user("f-new", "x")]))
        .await
        .unwrap();
    assert_eq!(again.seqs, vec![PREFIX + 1], "an id of f, g's base");
}

fn marks(disk: &SimStorage, what: &str) -> usize {
    disk.all_bytes()
        .windows(what.len())
        .filter(|w| *w == what.as_bytes())
        .count()
}

/// Whether any event of `session` is left in the log (true while the log cannot be read:
/// asked again).
fn has_events(disk: &SimStorage, session: &str) -> bool {
    let Ok(records) = common::try_read_log(disk) else {
        return true;
    };
    records.iter().any(|r| {
        matches!(r, Record::Event(e) if e.session_id == session)
            || matches!(r, Record::Placed(p) if &*p.session_id == session)
    })
}

/// The placed records of `session` in the log.
fn placed(disk: &SimStorage, session: &str) -> usize {
    let records = loop {
        if let Ok(records) = common::try_read_log(disk) {
            break records;
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    records
        .iter()
        .filter(|r| matches!(r, Record::Placed(p) if &*p.session_id == session))
        .count()
}

async fn wait_for(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !done() {
        assert!(Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forks_read_their_prefix_through_their_parents_and_write_none_of_it() {
    let disk = SimStorage::new();
    let dir = tempfile::tempdir().unwrap();
    let index_dir = dir.path().join("index");
    let store = open_store_reclaiming(&disk, &index_dir, LOG, held());
    make_line(&store).await;
    let parent = history(&store, "p").await;
    assert_eq!(
        marks(&disk, SHARED),
        PREFIX as usize,
        "no copy of the prefix"
    );
    let log = read_log(&disk);
    assert!(!log.iter().any(|r| matches!(r, Record::Placed(_))));
    let forks = log.iter().filter(|r| matches!(r, Record::Fork(_))).count();
    assert_eq!(forks, 2, "one start for each fork");
    check_line(&store, &parent).await;
    check_dedup(&store).await;
    check_line(&store, &parent).await;
    store.close().unwrap();

    let store = open_store_reclaiming(&disk, &index_dir, LOG, held());
    check_line(&store, &parent).await;
    check_dedup(&store).await;
    store.close().unwrap();
    std::fs::remove_dir_all(&index_dir).unwrap();
    let store = open_store_reclaiming(&disk, &index_dir, LOG, held());
    check_line(&store, &parent).await;
    check_dedup(&store).await;
    store.close().unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_whose_index_never_took_the_forks_in_rebuilds_them_from_their_starts() {
    let disk = SimStorage::new();
    let dir = tempfile::tempdir().unwrap();
    let index_dir = dir.path().join("index");
    let store = open_store_reclaiming(&disk, &index_dir, LOG, held());
    store
        .append(op("warm", vec![user("w", "warm")]))
        .await
        .unwrap();
    store.close().unwrap();
    // The index as it was before the forks: as if it had absorbed none of them when the
    // store was killed (the index is never on the acknowledgement path).
    let before = dir.path().join("index-before");
    copy_dir(&index_dir, &before);
    let store = open_store_reclaiming(&disk, &index_dir, LOG, held());
    make_line(&store).await;
    let parent = history(&store, "p").await;
    store.close().unwrap();
    std::fs::remove_dir_all(&index_dir).unwrap();
    std::fs::rename(&before, &index_dir).unwrap();

    let store = open_store_reclaiming(&disk, &index_dir, LOG, held());
    check_line(&store, &parent).await;
    check_dedup(&store).await;
    store.close().unwrap();
    // The forks were found again as forks of their parents: deleting `p` keeps them whole.
    let store = open_store_reclaiming(&disk, &index_dir, LOG, reclaim_now());
    store.delete_session("p").await.unwrap();
    wait_for("p's records gone", || !has_events(&disk, "p")).await;
    check_line(&store, &parent).await;
    store.close().unwrap();
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for entry in std::fs::read_dir(from).unwrap().flatten() {
        let path = entry.path();
        let target = to.join(entry.file_name());
        if path.is_dir() {
            copy_dir(&path, &target);
        } else {
            std::fs::copy(&path, &target).unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deleting_a_parent_makes_its_forks_prefix_their_own_then_takes_its_text_off_the_disk() {
    let disk = SimStorage::new();
    let dir = tempfile::tempdir().unwrap();
    let index_dir = dir.path().join("index");
    let store = open_store_reclaiming(&disk, &index_dir, LOG, reclaim_now());
    make_line(&store).await;
    let parent = history(&store, "p").await;
    let g_before = history(&store, "g").await;
    assert!(marks(&disk, PARENT_ONLY) > 0);

    store.delete_session("p").await.unwrap();
    wait_for("p's records and text gone", || {
        !has_events(&disk, "p")
            && marks(&disk, PARENT_ONLY) == 0
            && in_files(&index_dir, PARENT_ONLY.as_bytes()).is_empty()
    })
    .await;
    assert_eq!(placed(&disk, "f"), PREFIX as usize, "f's prefix is its own");
    assert_eq!(placed(&disk, "g"), 0, "g reads through f, which is whole");
    assert_eq!(marks(&disk, SHARED), PREFIX as usize, "held once, by f");
    check_line(&store, &parent).await;
    check_dedup(&store).await;
    let next = store
        .append(op("f", vec![user("f-2", "on")]))
        .await
        .unwrap();
    assert_eq!(next.seqs, vec![PREFIX + 2]);

    // g's base goes too: g's prefix, read through f, becomes g's.
    store.delete_session("f").await.unwrap();
    wait_for("f's records gone", || !has_events(&disk, "f")).await;
    assert_eq!(placed(&disk, "g"), PREFIX as usize + 1);
    let g = history(&store, "g").await;
    assert_eq!(g[..PREFIX as usize + 2], g_before[..]);
    let next = store
        .append(op("g", vec![user("p7", "again")]))
        .await
        .unwrap();
    assert_eq!(next.seqs, vec![8], "dedup of g's own prefix");
    store.close().unwrap();

    // The same from the log alone.
    std::fs::remove_dir_all(&index_dir).unwrap();
    let store = open_store_reclaiming(&disk, &index_dir, LOG, reclaim_now());
    assert_eq!(history(&store, "g").await, g);
    store.delete_session("g").await.unwrap();
    wait_for("the shared text gone with the last fork", || {
        marks(&disk, SHARED) == 0 && in_files(&index_dir, SHARED.as_bytes()).is_empty()
    })
    .await;
    assert_eq!(history(&store, "other").await.len(), 30);
    store.close().unwrap();
}

/// A fork deleted right after its base's deletion made its prefix its own: that prefix
/// is written after the fork's own events, and is still waiting for the index (which holds
/// those, from before a restart) when the fork's dead records are counted. Every one of
/// them leaves the disk all the same.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_deleted_before_the_index_took_its_prefix_in_leaves_none_of_it_behind() {
    let disk = SimStorage::new();
    let dir = tempfile::tempdir().unwrap();
    let index_dir = dir.path().join("index");
    let store = open_store_reclaiming(&disk, &index_dir, LOG, held());
    make_line(&store).await;
    // The index takes the line in at the close.
    store.close().unwrap();
    let store = open_store_reclaiming(&disk, &index_dir, LOG, reclaim_now());
    // Past the segments of the line: the prefix is written into one of the others'.
    for i in 0..LOG.segment_bytes / 200 {
        let text = "o".repeat(200);
        store
            .append(op("other", vec![user(&format!("o-late{i}"), &text)]))
            .await
            .unwrap();
    }
    let g = history(&store, "g").await;
    store.delete_session("p").await.unwrap();
    wait_for("f's prefix its own", || {
        placed(&disk, "f") == PREFIX as usize
    })
    .await;
    store.delete_session("f").await.unwrap();
    wait_for("p's and f's records gone", || {
        !has_events(&disk, "p") && !has_events(&disk, "f")
    })
    .await;
    assert_eq!(history(&store, "g").await, g);
    store.close().unwrap();
}

/// The parent deleted with reclamation held, then the power cut at `point` of its
/// reclamation after a restart: the forks are whole after the cut, with the index rebuilt
/// from the log, and once the reclamation finishes.
async fn cut_at(point: CrashPoint) {
    let disk = SimStorage::new();
    let dir = tempfile::tempdir().unwrap();
    let index_dir = dir.path().join("index");
    let store = open_store_reclaiming(&disk, &index_dir, LOG, held());
    make_line(&store).await;
    let parent = history(&store, "p").await;
    let f = history(&store, "f").await;
    let g = history(&store, "g").await;
    // A deletion makes the forks' prefixes their own at once (the reclaimer is told of
    // it); its rewrites wait for the pass, held here until the restart.
    disk.crash_at(point, 1);
    store.delete_session("p").await.unwrap();
    let materializing = matches!(
        point,
        CrashPoint::MaterializeWritten | CrashPoint::Materialized
    );
    if materializing {
        wait_for(&format!("the cut at {point:?}"), || disk.is_off()).await;
        drop(store);
    } else {
        drop(store);
        let store = open_store_reclaiming(&disk, &index_dir, LOG, reclaim_now());
        wait_for(&format!("the cut at {point:?}"), || disk.is_off()).await;
        drop(store);
    }
    disk.power_on();
    match point {
        CrashPoint::MaterializeWritten => {
            assert_eq!(placed(&disk, "f"), 0, "a torn materialization is dropped")
        }
        CrashPoint::Materialized => assert_eq!(placed(&disk, "f"), PREFIX as usize),
        _ => {}
    }
    assert!(
        has_events(&disk, "p") || point == CrashPoint::Purged || point == CrashPoint::Installed
    );

    let store = open_store_reclaiming(&disk, &index_dir, LOG, held());
    whole(&store, &f, &g, point).await;
    store.close().unwrap();
    std::fs::remove_dir_all(&index_dir).unwrap();
    let store = open_store_reclaiming(&disk, &index_dir, LOG, held());
    whole(&store, &f, &g, point).await;
    store.close().unwrap();
    let store = open_store_reclaiming(&disk, &index_dir, LOG, reclaim_now());
    wait_for("p's records gone", || !has_events(&disk, "p")).await;
    whole(&store, &f, &g, point).await;
    check_line(&store, &parent).await;
    check_dedup(&store).await;
    store.close().unwrap();
}

/// `f` and `g` read as they did before `p` was deleted; `p` stays deleted.
async fn whole(store: &Store, f: &[Event], g: &[Event], point: CrashPoint) {
    same(&history(store, "f").await, f, &format!("f {point:?}"));
    same(&history(store, "g").await, g, &format!("g {point:?}"));
    assert!(store.get_session("p").is_err(), "{point:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_while_a_forks_prefix_is_written_as_its_own_loses_nothing() {
    cut_at(CrashPoint::MaterializeWritten).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_once_a_forks_prefix_is_its_own_loses_nothing() {
    cut_at(CrashPoint::Materialized).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_while_the_parents_segments_are_rewritten_loses_nothing() {
    cut_at(CrashPoint::RewriteSynced).await;
    cut_at(CrashPoint::Installed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cut_after_the_index_forgot_the_parent_loses_nothing() {
    cut_at(CrashPoint::Purged).await;
}

/// A retried append of a prefix event to a fork, right after its parent's deletion (before
/// the index has absorbed the parent's newest events): answered with the seq the fork
/// already holds it at, not written again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prefix_id_retried_on_a_fork_right_after_its_parent_went_is_not_written_again() {
    for round in 0..20 {
        let disk = SimStorage::new();
        let dir = tempfile::tempdir().unwrap();
        let store = open_store_reclaiming(&disk, &dir.path().join("index"), LOG, held());
        let ids: Vec<String> = (1..=3).map(|i| format!("r{round}-{i}")).collect();
        for id in &ids {
            store
                .append(op("p", vec![user(id, "parent")]))
                .await
                .unwrap();
        }
        store.fork(fork_op("p", 3, "f", Vec::new())).await.unwrap();
        store.delete_session("p").await.unwrap();
        let retried = store
            .append(op("f", vec![user(&ids[2], "parent")]))
            .await
            .unwrap();
        assert_eq!(
            retried.seqs,
            vec![3],
            "round {round}: answered with its seq"
        );
        assert_eq!(store.get_session("f").unwrap().last_seq, 3, "round {round}");
        store.close().unwrap();
    }
}

/// A fork an earlier release wrote, with its prefix copied into its own events and a start
/// without a state, still reads, dedups and appends as it did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_written_with_its_prefix_copied_reads_as_before() {
    use event_store::backend::local::log::{LogTail, LogWriter};
    use event_store::session::ForkRecord;

    let disk = SimStorage::new();
    let dir = tempfile::tempdir().unwrap();
    let index_dir = dir.path().join("index");
    let store = open_store_reclaiming(&disk, &index_dir, LOG, held());
    for i in 1..=3 {
        let id = format!("p{i}");
        store
            .append(op("p", vec![user(&id, SHARED)]))
            .await
            .unwrap();
    }
    let parent = history(&store, "p").await;
    store.close().unwrap();

    // As that release wrote it: the start, then the prefix as events of the fork, in one
    // atomic append past what the index absorbed.
    let mut log = LogWriter::open(
        std::sync::Arc::new(disk.clone()),
        LOG,
        LogTail::default(),
        |_| {},
    )
    .unwrap();
    let mut records = vec![Record::Fork(ForkRecord {
        session_id: "f".into(),
        parent: "p".into(),
        seq: 3,
        ts_unix_ms: parent[2].ts_unix_ms + 1,
        state: None,
    })];
    records.extend(parent.iter().map(|e| {
        Record::Event(
            Event {
                session_id: "f".into(),
                ..e.clone()
            }
            .into(),
        )
    }));
    let last = records.len() - 1;
    log.write(records.iter().enumerate().map(|(i, r)| (r, i < last)))
        .unwrap();
    log.sync().unwrap();
    drop(log);

    let store = open_store_reclaiming(&disk, &index_dir, LOG, held());
    let fork = history(&store, "f").await;
    let want: Vec<Event> = parent
        .iter()
        .map(|e| Event {
            session_id: "f".into(),
            ..e.clone()
        })
        .collect();
    assert_eq!(fork, want);
    let info = store.get_session("f").unwrap();
    assert_eq!(info.last_seq, 3);
    let from = info.forked_from.expect("a fork");
    assert_eq!((from.session_id.as_str(), from.seq), ("p", 3));
    assert!(info.title.starts_with(SHARED), "{}", info.title);
    let again = store.append(op("f", vec![user("p2", "x")])).await.unwrap();
    assert_eq!(again.seqs, vec![2], "an id of its copied prefix");
    let new = store.append(op("f", vec![user("f4", "x")])).await.unwrap();
    assert_eq!(new.seqs, vec![4]);
    // Its parent's deletion leaves it whole: it reads nothing through it.
    store.delete_session("p").await.unwrap();
    assert_eq!(history(&store, "f").await[..3], want[..]);
    store.close().unwrap();
}
