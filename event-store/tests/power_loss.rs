//! Power loss, through the storage trait: concurrent appends to a store whose disk forgets
//! every byte not covered by the last `fdatasync` (keeping a torn, maybe garbled, piece of
//! the unsynced tail), cut at a random moment, many times over, with the store reopened on
//! what is left. After every cut:
//! - every acknowledged `DURABILITY_SYNC` append is there, at the seq it was acknowledged
//!   with (the acknowledgement follows the fdatasync); buffered ones may be lost, but never move;
//! - every session's seqs are gapless from 1 (rule 4) and the index agrees with the log;
//! - re-sending every unacknowledged append with its event_ids never duplicates an event;
//! - a lease epoch that was handed out is never handed out again.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentlog_proto::v1::Durability;
use common::{append_op, history, open_store_with};
use event_store::backend::local::log::storage::SimStorage;
use event_store::backend::local::log::LogConfig;
use event_store::backend::local::Store;
use event_store::StoreError;

const SESSIONS: [&str; 3] = ["pl-a", "pl-b", "pl-c"];
/// Its lease is taken over and over while the appends run.
const LEASED: &str = "pl-lease";
const WRITERS: usize = 6;
const ROUNDS: usize = 30;
/// Small segments, so rolls to a new segment happen under load and across cuts too.
/// Small segments, so rolls happen; preallocated as in production (in smaller steps, so the
/// zero-filled room is extended often), so power is cut with zeros ahead of the writer.
const LOG: LogConfig = LogConfig {
    segment_bytes: 16 << 10,
    preallocate_bytes: 4 << 10,
};
/// A writer gives up after this many appends if the power never went (it always does).
const MAX_APPENDS_PER_WRITER: usize = 2_000;

/// One append as a writer sent it.
#[derive(Clone, Debug)]
struct Attempt {
    session: &'static str,
    ids: Vec<String>,
    durability: Durability,
}

/// What the writers were told, across every round.
#[derive(Default)]
struct Ledger {
    /// Acknowledged as durable (SYNC, or verified present after a recovery): must survive.
    durable: HashMap<String, (&'static str, u64)>,
    /// Acknowledged BUFFERED and not yet seen to survive a cut: may be lost, never moved.
    buffered: HashMap<String, (&'static str, u64)>,
    /// Sent but never acknowledged: may or may not be in the log.
    unacked: Vec<Attempt>,
    /// The newest lease epoch acknowledged on `LEASED`.
    max_epoch: u64,
}

impl Ledger {
    fn record(&mut self, attempt: Attempt, result: Result<Vec<u64>, StoreError>) {
        match result {
            Ok(seqs) => {
                let acked = match attempt.durability {
                    Durability::Buffered => &mut self.buffered,
                    _ => &mut self.durable,
                };
                for (id, seq) in attempt.ids.into_iter().zip(seqs) {
                    acked.insert(id, (attempt.session, seq));
                }
            }
            Err(StoreError::Unavailable(_)) => self.unacked.push(attempt),
            Err(e) => panic!("an append failed with something other than UNAVAILABLE: {e}"),
        }
    }
}

/// How the store goes down this time: the power is cut (the disk keeps a torn piece of the
/// unsynced tail, maybe with its last byte garbled), or only the process dies (like
/// SIGKILL: every written byte stays, synced or not, and the writer's next fsync never
/// happens).
#[derive(Clone, Copy, Debug)]
enum Cut {
    PowerLoss {
        /// Keeps `keep % (unsynced + 1)` bytes, or all of them when `u64::MAX`.
        keep: u64,
        garble: Option<u8>,
    },
    ProcessCrash,
}

impl Cut {
    fn random(rng: &mut fastrand::Rng) -> Cut {
        if rng.u8(0..4) == 0 {
            return Cut::ProcessCrash;
        }
        Cut::PowerLoss {
            keep: match rng.u8(0..4) {
                0 => 0,
                1 => u64::MAX,
                _ => rng.u64(..),
            },
            garble: rng.bool().then(|| rng.u8(1..)),
        }
    }

    fn apply(self, disk: &SimStorage) {
        match self {
            Cut::PowerLoss { keep, garble } => disk.power_loss(
                move |unsynced| match keep {
                    u64::MAX => unsynced,
                    k => (k % (unsynced as u64 + 1)) as usize,
                },
                garble,
            ),
            Cut::ProcessCrash => disk.fail_syncs(),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_appends_survive_power_loss_at_any_moment() {
    // A few seconds alone, under a minute beside the other suites on two cores.
    let _watchdog = testkit::watchdog(
        "acknowledged_appends_survive_power_loss_at_any_moment",
        Duration::from_secs(300),
    );
    let seed = std::env::var("POWER_LOSS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0x5eed_1055);
    eprintln!("POWER_LOSS_SEED={seed}");
    let mut rng = fastrand::Rng::with_seed(seed);
    let disk = SimStorage::new();
    let index_dir = tempfile::tempdir().expect("temp dir");
    let index_path = index_dir.path().join("index");
    let mut ledger = Ledger::default();

    let mut store = open_store_with(&disk, &index_path, LOG);
    let first = vec!["lease-session-start".to_string()];
    let resp = store
        .append(append_op(LEASED, &first, Durability::Sync))
        .await;
    ledger.record(
        Attempt {
            session: LEASED,
            ids: first,
            durability: Durability::Sync,
        },
        resp.map(|r| r.seqs),
    );

    let mut partial_appends = 0;
    for round in 0..ROUNDS {
        let cut = Cut::random(&mut rng);
        let cut_after_acks = rng.usize(1..=200);
        let store_arc = Arc::new(store);
        let shared = Arc::new(Mutex::new(std::mem::take(&mut ledger)));

        // The load: writers append 1-3 events at a time, mixing SYNC and BUFFERED, until the
        // store stops answering; the one whose acknowledgement is number `cut_after_acks`
        // cuts the power, while the others' appends are in flight.
        let acks = Arc::new(AtomicUsize::new(0));
        let mut tasks = Vec::new();
        for w in 0..WRITERS {
            let store = store_arc.clone();
            let ledger = shared.clone();
            let acks = acks.clone();
            let disk = disk.clone();
            let mut rng = fastrand::Rng::with_seed(rng.u64(..));
            tasks.push(tokio::spawn(async move {
                for i in 0..MAX_APPENDS_PER_WRITER {
                    let session = SESSIONS[rng.usize(..SESSIONS.len())];
                    let ids = (0..rng.usize(1..=3))
                        .map(|k| format!("r{round}-w{w}-{i}-{k}"))
                        .collect::<Vec<_>>();
                    let durability = if rng.u8(0..4) == 0 {
                        Durability::Buffered
                    } else {
                        Durability::Sync
                    };
                    let attempt = Attempt {
                        session,
                        ids,
                        durability,
                    };
                    let result = store
                        .append(append_op(session, &attempt.ids, durability))
                        .await
                        .map(|r| r.seqs);
                    let failed = result.is_err();
                    lock(&ledger).record(attempt, result);
                    if failed {
                        return;
                    }
                    if acks.fetch_add(1, Ordering::SeqCst) + 1 == cut_after_acks {
                        cut.apply(&disk);
                    }
                }
            }));
        }
        // Lease grants on one session run alongside: each must be durable before it is
        // returned, so no epoch is ever granted twice.
        let lease_task = {
            let store = store_arc.clone();
            tokio::spawn(async move {
                let mut max_epoch = 0;
                for _ in 0..MAX_APPENDS_PER_WRITER {
                    match store
                        .acquire_lease(LEASED.into(), "holder".into(), 60_000)
                        .await
                    {
                        Ok(lease) => {
                            assert!(lease.epoch > max_epoch, "epochs grow with every grant");
                            max_epoch = lease.epoch;
                        }
                        Err(StoreError::Unavailable(_)) => break,
                        Err(e) => panic!("AcquireLease failed: {e}"),
                    }
                }
                max_epoch
            })
        };
        for task in tasks {
            task.await.expect("writer task");
        }
        let epoch = lease_task.await.expect("lease task");
        ledger = Arc::into_inner(shared)
            .expect("writers are done")
            .into_inner()
            .unwrap_or_else(|p| p.into_inner());
        ledger.max_epoch = ledger.max_epoch.max(epoch);

        // The old store must be gone (its writer stopped on the dead disk, sled's lock
        // released) before the next one opens the same index.
        let old = Arc::into_inner(store_arc).expect("no task holds the store");
        let closed = old.close();
        assert!(
            matches!(closed, Err(StoreError::Internal(_)) | Ok(())),
            "{closed:?}"
        );
        let rebuild = rng.u8(0..3) == 0;
        if rebuild {
            std::fs::remove_dir_all(&index_path).expect("remove the index");
        }
        disk.power_on();
        store = open_store_with(&disk, &index_path, LOG);

        let context = format!(
            "round {round} ({cut:?}, after {cut_after_acks} acks, rebuild index: {rebuild})"
        );
        if matches!(cut, Cut::ProcessCrash) {
            // Written bytes outlive the process: buffered acknowledgements hold too.
            ledger.durable.extend(ledger.buffered.drain());
        }
        partial_appends += check_after_cut(&store, &mut ledger, &context).await;
    }
    store.close().expect("clean shutdown");
    eprintln!(
        "{ROUNDS} power cuts survived; {} events durable; {partial_appends} unacknowledged \
         multi-event appends were found partly written and completed by their retry",
        ledger.durable.len()
    );
}

/// Checks the recovered store against the ledger, re-sends every unacknowledged append
/// (after which everything in the ledger is durable), and checks again. Returns how many
/// unacknowledged appends had survived only in part.
async fn check_after_cut(store: &Store, ledger: &mut Ledger, context: &str) -> usize {
    let found = read_all(store, context).await;
    for (id, place) in &ledger.durable {
        assert_eq!(
            found.get(id),
            Some(place),
            "{context}: acknowledged-durable event {id} is not where it was acknowledged"
        );
    }
    for (id, place) in std::mem::take(&mut ledger.buffered) {
        match found.get(&id) {
            Some(at) => {
                assert_eq!(*at, place, "{context}: buffered event {id} moved");
                ledger.durable.insert(id, place);
            }
            // Lost with the power, as DURABILITY_BUFFERED allows: send it again.
            None => ledger.unacked.push(Attempt {
                session: place.0,
                ids: vec![id],
                durability: Durability::Sync,
            }),
        }
    }

    // Retry what was never acknowledged: whatever already made it to the log comes back
    // with its seq (dedup), the rest is appended once.
    let mut partial = 0;
    for attempt in std::mem::take(&mut ledger.unacked) {
        let present = attempt
            .ids
            .iter()
            .filter(|id| found.contains_key(*id))
            .count();
        if present > 0 && present < attempt.ids.len() {
            partial += 1;
        }
        let resp = store
            .append(append_op(attempt.session, &attempt.ids, Durability::Sync))
            .await
            .unwrap_or_else(|e| panic!("{context}: re-sending {:?} failed: {e}", attempt.ids));
        for (id, seq) in attempt.ids.iter().zip(&resp.seqs) {
            if let Some(at) = found.get(id) {
                assert_eq!(*at, (attempt.session, *seq), "{context}: {id} re-sent");
            }
            ledger.durable.insert(id.clone(), (attempt.session, *seq));
        }
    }

    // Now the log holds exactly the ledger: each event once, where it was acknowledged.
    let found = read_all(store, context).await;
    assert_eq!(
        found.len(),
        ledger.durable.len(),
        "{context}: events in the log vs. events ever acknowledged"
    );
    for (id, place) in &ledger.durable {
        assert_eq!(
            found.get(id),
            Some(place),
            "{context}: event {id} after retries"
        );
    }

    // Re-sending acknowledged events changes nothing.
    for session in SESSIONS {
        let before = store.get_session(session).map(|s| s.last_seq).unwrap_or(0);
        let sample: Vec<String> = ledger
            .durable
            .iter()
            .filter(|(_, (s, _))| *s == session)
            .take(5)
            .map(|(id, _)| id.clone())
            .collect();
        if sample.is_empty() {
            continue;
        }
        let resp = store
            .append(append_op(session, &sample, Durability::Sync))
            .await
            .expect("re-send acknowledged events");
        let expected: Vec<u64> = sample.iter().map(|id| ledger.durable[id].1).collect();
        assert_eq!(
            resp.seqs, expected,
            "{context}: dedup of acknowledged events"
        );
        assert_eq!(resp.last_seq, before, "{context}: dedup wrote nothing");
    }

    // No epoch is handed out twice, even one whose grant was cut before it was answered.
    let lease = store
        .acquire_lease(LEASED.into(), "holder".into(), 60_000)
        .await
        .expect("acquire after recovery");
    assert!(
        lease.epoch > ledger.max_epoch,
        "{context}: epoch {} granted again after recovery (newest acknowledged: {})",
        lease.epoch,
        ledger.max_epoch
    );
    ledger.max_epoch = lease.epoch;
    partial
}

/// Reads every session back, checking that seqs are gapless from 1, that each event_id
/// appears once, and that GetSession agrees; returns event_id → (session, seq).
async fn read_all(store: &Store, context: &str) -> HashMap<String, (&'static str, u64)> {
    let mut found = HashMap::new();
    for session in SESSIONS.into_iter().chain([LEASED]) {
        let events = history(store, session).await;
        for (i, event) in events.iter().enumerate() {
            assert_eq!(event.seq, i as u64 + 1, "{context}: {session} has a gap");
            assert_eq!(event.session_id, session);
            let before = found.insert(event.event_id.clone(), (session, event.seq));
            assert_eq!(
                before, None,
                "{context}: event {} is in the log twice",
                event.event_id
            );
        }
        let last_seq = store.get_session(session).map(|s| s.last_seq).unwrap_or(0);
        assert_eq!(
            last_seq,
            events.len() as u64,
            "{context}: GetSession({session}).last_seq disagrees with the log"
        );
    }
    found
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// SIGKILL (or a crash of the store alone) keeps what was written in the page cache, so a
/// restarted store can find records that were never fsync'd. It must make them durable
/// before it serves them: a re-sent append deduplicated against them is acknowledged as
/// durable, and subscribers see them (acknowledged and seen events are never taken back).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn records_found_by_recovery_are_durable_before_they_are_served() {
    let disk = SimStorage::new();
    let index_dir = tempfile::tempdir().expect("temp dir");
    let index = index_dir.path().join("index");
    let session = "found-at-recovery";

    let store = open_store_with(&disk, &index, LOG);
    let first = vec!["first".to_string()];
    store
        .append(append_op(session, &first, Durability::Sync))
        .await
        .expect("append");
    // The next append is written, but the process dies before its fsync completes.
    disk.fail_syncs();
    let cut_off = vec!["cut-off-1".to_string(), "cut-off-2".to_string()];
    let result = store
        .append(append_op(session, &cut_off, Durability::Sync))
        .await;
    assert!(
        matches!(result, Err(StoreError::Unavailable(_))),
        "{result:?}"
    );
    assert!(store.close().is_err());

    // Restart on the same machine: the written bytes are still there, unsynced.
    disk.power_on();
    let store = open_store_with(&disk, &index, LOG);
    let resp = store
        .append(append_op(session, &cut_off, Durability::Sync))
        .await
        .expect("re-send the unacknowledged append");
    assert_eq!(
        resp.seqs,
        vec![2, 3],
        "deduplicated against what recovery found"
    );
    assert_eq!(history(&store, session).await.len(), 3);

    // Now the power goes: an acknowledged, seen event must not go with it.
    disk.power_loss(|_| 0, None);
    let _ = store.close();
    disk.power_on();
    let store = open_store_with(&disk, &index, LOG);
    let ids: Vec<String> = history(&store, session)
        .await
        .into_iter()
        .map(|e| e.event_id)
        .collect();
    assert_eq!(ids, ["first", "cut-off-1", "cut-off-2"]);
    store.close().expect("close");
}
