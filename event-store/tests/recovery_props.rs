//! Recovery from any damaged log (proptest): a random history of appends (with retried
//! event_ids, buffered ones, runner-written kinds under a lease) and lease grants, renewals
//! and releases goes through a store on the simulated disk; then, optionally, one more
//! append is written but never fsync'd (its fsync fails), and the log is cut at any byte or
//! has a byte flipped in the tail, the index kept or deleted. The reopened store must hold
//! exactly the records before the damage, a prefix of what was written, with an index that
//! agrees with the log:
//! - Subscribe returns exactly each session's surviving events, seqs gapless from 1;
//! - GetSession's last_seq is the number of events read back;
//! - re-sending a surviving event_id returns its seq and writes nothing, and a new append
//!   continues at last_seq + 1;
//! - lease epochs in the log never go backwards, and the next grant is above every
//!   surviving one.
//!
//! Plus the same with several segments: a cut in the last one recovers, and corruption in
//! an earlier one (fsync'd before the next was created, so not a torn write) refuses to open
//! with `LogError::Corrupt` instead of dropping data. Damage to what the index absorbed is
//! never taken for a torn tail: an open reads only past it when the last absorbed record
//! checks out (and the damage shows when the record is read), and reads the last segment
//! whole, refusing to open, when it does not.

mod common;

use std::collections::HashMap;

use agentlog_proto::reason::Reason;
use agentlog_proto::v1::{event, AssistantDelta, Durability, Event};
use common::{
    append_ends, append_op, history, open_store, open_store_with, read_appends, read_log,
    try_open_store,
};
use event_store::backend::local::log::storage::{SimStorage, Storage};
use event_store::backend::local::log::LogConfig;
use event_store::backend::local::log::{LogError, Record};
use event_store::backend::local::{OpenError, Store};
use event_store::backend::AppendOp;
use event_store::StoreError;
use proptest::prelude::*;
use proptest::sample::Index;

/// One segment: every log offset is an offset into the one file `corrupt` edits.
const ONE_SEGMENT: u64 = 1 << 30;
const SESSIONS: [&str; 3] = ["rp-a", "rp-b", "rp-c"];
const OWNERS: [&str; 2] = ["runner-1", "runner-2"];
const TTL_MS: u64 = 60_000;

#[derive(Clone, Debug)]
enum Step {
    /// User messages; `reuse` re-sends an event_id the session already had.
    Append {
        session: usize,
        events: usize,
        reuse: Option<Index>,
        buffered: bool,
    },
    /// A runner-written event under the lease the model believes is current.
    Runner {
        session: usize,
    },
    Acquire {
        session: usize,
        owner: usize,
    },
    Renew {
        session: usize,
    },
    Release {
        session: usize,
    },
}

#[derive(Clone, Debug)]
enum Damage {
    None,
    /// Truncate the log at this byte (anywhere, fsync'd or not).
    Cut(Index),
    /// Flip bits of one byte in the tail: the bytes the index has not absorbed (or anywhere
    /// when the index is deleted, since then recovery reads the whole log).
    Flip(Index, u8),
}

fn step() -> impl Strategy<Value = Step> {
    let session = 0..SESSIONS.len();
    prop_oneof![
        4 => (session.clone(), 1usize..4, proptest::option::of(any::<Index>()), any::<bool>())
            .prop_map(|(session, events, reuse, buffered)| Step::Append { session, events, reuse, buffered }),
        1 => session.clone().prop_map(|session| Step::Runner { session }),
        1 => (session.clone(), 0..OWNERS.len()).prop_map(|(session, owner)| Step::Acquire { session, owner }),
        1 => session.clone().prop_map(|session| Step::Renew { session }),
        1 => session.prop_map(|session| Step::Release { session }),
    ]
}

fn damage() -> impl Strategy<Value = Damage> {
    prop_oneof![
        1 => Just(Damage::None),
        3 => any::<Index>().prop_map(Damage::Cut),
        3 => (any::<Index>(), 1u8..).prop_map(|(at, mask)| Damage::Flip(at, mask)),
    ]
}

/// What a record says, without its timestamp: how the model and the log are compared.
#[derive(Clone, Debug, PartialEq)]
enum Summary {
    Event {
        session: String,
        event_id: String,
        seq: u64,
    },
    Lease {
        session: String,
        epoch: u64,
        released: bool,
    },
    Fork {
        session: String,
    },
}

fn summary(record: &Record) -> Summary {
    match record {
        Record::Event(e) => Summary::Event {
            session: e.session_id.clone(),
            event_id: e.event_id.clone(),
            seq: e.seq,
        },
        Record::Lease(l) => Summary::Lease {
            session: l.session_id.clone(),
            epoch: l.epoch,
            released: l.released,
        },
        Record::Fork(f) => Summary::Fork {
            session: f.session_id.clone(),
        },
        Record::Placed(c) => Summary::Event {
            session: c.session_id.to_string(),
            event_id: c.event_id.clone(),
            seq: c.seq,
        },
        Record::Tombstone(t) => panic!("these tests delete no session, yet {t:?} is logged"),
        Record::Pin(p) => panic!("these tests pin no session, yet {p:?} is logged"),
    }
}

/// The model: what the store acknowledged, in order (one caller, so ack order is log order).
#[derive(Default)]
struct Model {
    written: Vec<Summary>,
    last_seq: HashMap<&'static str, u64>,
    ids: HashMap<&'static str, Vec<String>>,
    /// The lease each session is believed to have: (owner, epoch, released).
    lease: HashMap<&'static str, (usize, u64, bool)>,
    next_id: usize,
}

impl Model {
    fn fresh_id(&mut self) -> String {
        self.next_id += 1;
        format!("ev-{}", self.next_id)
    }

    /// Records an acknowledged append: the events with a seq past the old tail are new.
    fn appended(&mut self, session: &'static str, ids: &[String], seqs: &[u64], last_seq: u64) {
        let before = self.last_seq.get(session).copied().unwrap_or(0);
        for (id, &seq) in ids.iter().zip(seqs) {
            if seq > before && !self.ids[session].contains(id) {
                self.written.push(Summary::Event {
                    session: session.into(),
                    event_id: id.clone(),
                    seq,
                });
                self.ids.get_mut(session).expect("session").push(id.clone());
            }
        }
        self.last_seq.insert(session, last_seq);
    }

    fn leased(&mut self, session: &'static str, owner: usize, epoch: u64, released: bool) {
        self.written.push(Summary::Lease {
            session: session.into(),
            epoch,
            released,
        });
        self.lease.insert(session, (owner, epoch, released));
    }
}

async fn run_step(store: &Store, model: &mut Model, step: Step) {
    match step {
        Step::Append {
            session,
            events,
            reuse,
            buffered,
        } => {
            let session = SESSIONS[session];
            let known = model.ids.entry(session).or_default().clone();
            let mut ids: Vec<String> = (0..events).map(|_| model.fresh_id()).collect();
            if let (Some(at), false) = (reuse, known.is_empty()) {
                ids[0] = known[at.index(known.len())].clone();
            }
            let durability = if buffered {
                Durability::Buffered
            } else {
                Durability::Sync
            };
            let resp = store
                .append(append_op(session, &ids, durability))
                .await
                .expect("a valid append is acknowledged");
            model.appended(session, &ids, &resp.seqs, resp.last_seq);
        }
        Step::Runner { session } => {
            let session = SESSIONS[session];
            let Some(&(_, epoch, _)) = model.lease.get(session) else {
                return;
            };
            let id = model.fresh_id();
            let result = store
                .append(AppendOp {
                    session_id: session.into(),
                    events: vec![Event {
                        event_id: id.clone(),
                        kind: Some(event::Kind::AssistantDelta(AssistantDelta {
                            turn_id: "t".into(),
                            text: "partial".into(),
                        })),
                        ..Default::default()
                    }]
                    .into_iter()
                    .map(Into::into)
                    .collect(),
                    expected_last_seq: None,
                    lease_epoch: Some(epoch),
                    durability: Durability::Sync,
                })
                .await;
            match (result, model.lease[session]) {
                (Ok(resp), (_, _, false)) => {
                    model.appended(session, &[id], &resp.seqs, resp.last_seq)
                }
                (Err(StoreError::Refused(Reason::LeaseFenced, _)), (_, _, true)) => {}
                (other, lease) => panic!("runner append under {lease:?}: {other:?}"),
            }
        }
        Step::Acquire { session, owner } => {
            let session = SESSIONS[session];
            let result = store
                .acquire_lease(session.into(), OWNERS[owner].into(), TTL_MS)
                .await;
            match result {
                Ok(lease) => {
                    let floor = model.lease.get(session).map_or(0, |l| l.1);
                    assert_eq!(lease.epoch, floor + 1, "each grant is one epoch up");
                    model.leased(session, owner, lease.epoch, false);
                }
                // No event yet, or someone else holds it.
                Err(StoreError::Refused(Reason::SessionNotFound, _)) => {
                    assert!(!model.ids.contains_key(session))
                }
                Err(StoreError::Refused(Reason::LeaseHeld, _)) => {
                    let (holder, _, released) = model.lease[session];
                    assert!(holder != owner && !released);
                }
                Err(e) => panic!("AcquireLease: {e}"),
            }
        }
        Step::Renew { session } => {
            let session = SESSIONS[session];
            let Some(&(owner, epoch, released)) = model.lease.get(session) else {
                return;
            };
            let result = store
                .renew_lease(session.into(), OWNERS[owner].into(), epoch, TTL_MS)
                .await;
            match result {
                Ok(lease) if !released => {
                    assert_eq!(lease.epoch, epoch);
                    model.leased(session, owner, epoch, false);
                }
                Err(StoreError::Refused(Reason::LeaseFenced, _)) if released => {}
                other => panic!("RenewLease (released: {released}): {other:?}"),
            }
        }
        Step::Release { session } => {
            let session = SESSIONS[session];
            let Some(&(owner, epoch, released)) = model.lease.get(session) else {
                return;
            };
            store
                .release_lease(session.into(), OWNERS[owner].into(), epoch)
                .await
                .expect("releasing the current lease");
            if !released {
                model.leased(session, owner, epoch, true);
            }
        }
    }
}

/// Writes `steps` (and an unsynced tail of `tail` events), damages the log, reopens, and
/// checks the recovered store.
fn recovers_a_prefix(steps: Vec<Step>, tail: usize, damage: Damage, rebuild_index: bool) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let disk = SimStorage::new();
        let dir = tempfile::tempdir().expect("temp dir");
        let index = dir.path().join("index");
        let store = open_store(&disk, &index, ONE_SEGMENT);
        let mut model = Model::default();
        for step in steps {
            run_step(&store, &mut model, step).await;
        }
        // A round trip through the writer queue: the fsync of a BUFFERED append answered
        // just before has finished once this is answered, so everything so far is fsync'd
        // and in the index.
        let barrier = store
            .acquire_lease("rp-none".into(), OWNERS[0].into(), TTL_MS)
            .await;
        assert!(
            matches!(
                barrier,
                Err(StoreError::Refused(Reason::SessionNotFound, _))
            ),
            "{barrier:?}"
        );
        let synced_end = disk.total_len();
        if tail > 0 {
            // Written, never fsync'd, never acknowledged: what a power cut can tear.
            disk.fail_syncs();
            let ids: Vec<String> = (0..tail).map(|_| model.fresh_id()).collect();
            let result = store
                .append(append_op("rp-tail", &ids, Durability::Sync))
                .await;
            assert!(
                matches!(result, Err(StoreError::Unavailable(_))),
                "{result:?}"
            );
            assert!(store.close().is_err(), "the writer stops on a failed fsync");
            disk.power_on();
        } else {
            store.close().expect("clean close");
        }

        let appends = read_appends(&disk);
        let written: Vec<Record> = appends.iter().flatten().cloned().collect();
        let summaries: Vec<Summary> = written.iter().map(summary).collect();
        assert_eq!(
            &summaries[..model.written.len()],
            &model.written[..],
            "the log holds exactly what was acknowledged, in order"
        );
        assert_eq!(summaries.len(), model.written.len() + tail);
        check_epochs(&written);

        // Damage, and where the valid log must now end: after the last append that ends
        // before the damage (an append is kept whole or not at all).
        let ends = append_ends(&appends);
        let total = disk.total_len();
        assert_eq!(ends.last().map_or(0, |e| e.0), total);
        let whole_before = |at: u64| {
            ends.iter()
                .take_while(|(end, _)| *end <= at)
                .last()
                .copied()
                .unwrap_or((0, 0))
        };
        let (valid_end, survivors) = match damage {
            Damage::None => (total, written.len()),
            Damage::Cut(at) => {
                let at = at.index(total as usize + 1) as u64;
                disk.corrupt(|bytes| bytes.truncate(at as usize));
                whole_before(at)
            }
            Damage::Flip(at, mask) => {
                let from = if rebuild_index { 0 } else { synced_end };
                if total > from {
                    let at = from + at.index((total - from) as usize) as u64;
                    disk.corrupt(|bytes| bytes[at as usize] ^= mask);
                    // The append holding the byte, and all after it, are dropped.
                    whole_before(at)
                } else {
                    (total, written.len())
                }
            }
        };
        if rebuild_index {
            std::fs::remove_dir_all(&index).expect("remove the index");
        }

        let store = open_store(&disk, &index, ONE_SEGMENT);
        assert_eq!(
            disk.total_len(),
            valid_end,
            "the torn or corrupt tail is cut off the file"
        );
        let recovered = read_log(&disk);
        assert_eq!(
            recovered,
            written[..survivors],
            "recovery keeps exactly the records before the damage"
        );
        check_index(&store, &recovered).await;
        store.close().expect("clean close");
    });
}

/// Lease records of each session: a grant is one epoch above the session's previous lease,
/// a renewal or release repeats the current epoch; never backwards.
fn check_epochs(records: &[Record]) {
    let mut current: HashMap<&str, u64> = HashMap::new();
    for record in records {
        if let Record::Lease(l) = record {
            let before = current.get(l.session_id.as_str()).copied().unwrap_or(0);
            assert!(
                l.epoch == before || l.epoch == before + 1,
                "session {}: epoch {} after {before}",
                l.session_id,
                l.epoch
            );
            current.insert(&l.session_id, l.epoch);
        }
    }
}

/// The recovered store's index against its log: every surviving event readable at its
/// seq, nothing else; dedup; the next seq and the next epoch.
async fn check_index(store: &Store, log: &[Record]) {
    check_epochs(log);
    let mut events: HashMap<&str, Vec<&Event>> = HashMap::new();
    let mut epochs: HashMap<&str, u64> = HashMap::new();
    for record in log {
        match record {
            Record::Event(e) => events.entry(&e.session_id).or_default().push(e),
            Record::Lease(l) => {
                epochs.insert(&l.session_id, l.epoch);
            }
            Record::Fork(_) | Record::Placed(_) => {}
            Record::Tombstone(t) => panic!("these tests delete no session, yet {t:?} is logged"),
            Record::Pin(p) => panic!("these tests pin no session, yet {p:?} is logged"),
        }
    }
    for session in SESSIONS.into_iter().chain(["rp-tail"]) {
        let expected: Vec<Event> = events
            .get(session)
            .map(|es| es.iter().map(|e| (*e).clone()).collect())
            .unwrap_or_default();
        let read = history(store, session).await;
        assert_eq!(read, expected, "Subscribe({session}) vs. the log");
        for (i, e) in read.iter().enumerate() {
            assert_eq!(e.seq, i as u64 + 1, "{session}: seqs are gapless from 1");
        }
        let last_seq = read.len() as u64;
        match store.get_session(session) {
            Ok(info) => assert_eq!(info.last_seq, last_seq, "GetSession({session})"),
            Err(StoreError::Refused(Reason::SessionNotFound, _)) => {
                assert_eq!(last_seq, 0, "GetSession({session})")
            }
            Err(e) => panic!("GetSession({session}): {e}"),
        }
        if read.is_empty() {
            continue;
        }

        // Every surviving event_id is known: re-sending them all writes nothing.
        let ids: Vec<String> = read.iter().map(|e| e.event_id.clone()).collect();
        let resp = store
            .append(append_op(session, &ids, Durability::Sync))
            .await
            .expect("re-send surviving events");
        let seqs: Vec<u64> = read.iter().map(|e| e.seq).collect();
        assert_eq!(resp.seqs, seqs, "{session}: dedup of surviving events");
        assert_eq!(resp.last_seq, last_seq, "{session}: dedup wrote nothing");

        // A new event continues right after the tail.
        let resp = store
            .append(AppendOp {
                expected_last_seq: Some(last_seq),
                ..append_op(session, &[format!("after-{session}")], Durability::Sync)
            })
            .await
            .expect("append after recovery");
        assert_eq!(resp.seqs, vec![last_seq + 1]);

        // The next grant is above every surviving epoch. Whoever holds a live lease may
        // take a new one; anyone may when none is live.
        let owner = store
            .get_session(session)
            .ok()
            .and_then(|info| info.lease)
            .map_or_else(|| OWNERS[0].to_string(), |l| l.owner);
        let lease = store
            .acquire_lease(session.into(), owner, TTL_MS)
            .await
            .expect("acquire after recovery");
        let floor = epochs.get(session).copied().unwrap_or(0);
        assert_eq!(
            lease.epoch,
            floor + 1,
            "{session}: next epoch after recovery"
        );
    }
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: 128,
        max_shrink_iters: 2_000,
        ..ProptestConfig::default()
    })]

    #[test]
    fn recovery_from_a_damaged_log_keeps_a_consistent_prefix(
        steps in proptest::collection::vec(step(), 1..40),
        tail in prop_oneof![1 => Just(0usize), 1 => 1usize..5],
        damage in damage(),
        rebuild_index in any::<bool>(),
    ) {
        recovers_a_prefix(steps, tail, damage, rebuild_index);
    }
}

/// A store on `disk` given [`fill_segments`]'s appends, then closed.
async fn filled_and_closed(disk: &SimStorage, index: &std::path::Path, segment_bytes: u64) {
    let store = open_store(disk, index, segment_bytes);
    fill_segments(&store).await;
    store.close().expect("close");
}

/// Small segments: appends that roll over several segment files.
async fn fill_segments(store: &Store) -> Vec<String> {
    let mut ids = Vec::new();
    for i in 0..60 {
        let id = format!("seg-{i}");
        store
            .append(append_op(
                SESSIONS[i % 3],
                std::slice::from_ref(&id),
                Durability::Sync,
            ))
            .await
            .expect("append");
        ids.push(id);
    }
    ids
}

const SMALL_SEGMENT: u64 = 512;

#[test]
fn a_cut_in_the_last_of_several_segments_recovers_a_prefix() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let mut rng = fastrand::Rng::with_seed(7);
        for round in 0..24 {
            let disk = SimStorage::new();
            let dir = tempfile::tempdir().expect("temp dir");
            let index = dir.path().join("index");
            filled_and_closed(&disk, &index, SMALL_SEGMENT).await;
            let appends = read_appends(&disk);
            let written: Vec<Record> = appends.iter().flatten().cloned().collect();
            let bases = disk.list().expect("list");
            assert!(bases.len() >= 4, "several segments: {bases:?}");
            let last = *bases.last().expect("a segment");
            let last_len = disk.total_len() - last;
            let at = rng.u64(0..=last_len);
            disk.corrupt(|bytes| bytes.truncate(at as usize));
            if round % 2 == 0 {
                std::fs::remove_dir_all(&index).expect("remove the index");
            }

            let store = open_store(&disk, &index, SMALL_SEGMENT);
            let recovered = read_log(&disk);
            assert!(
                recovered.len() <= written.len() && recovered[..] == written[..recovered.len()],
                "round {round}: a prefix"
            );
            // Everything in the earlier segments survives.
            let in_earlier = append_ends(&appends)
                .iter()
                .take_while(|(end, _)| *end <= last)
                .last()
                .map_or(0, |e| e.1);
            assert!(
                recovered.len() >= in_earlier,
                "round {round}: earlier segments intact"
            );
            check_index(&store, &recovered).await;
            store.close().expect("close");
        }
    });
}

#[test]
fn corruption_in_an_earlier_segment_refuses_to_open() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let disk = SimStorage::new();
        let dir = tempfile::tempdir().expect("temp dir");
        let index = dir.path().join("index");
        filled_and_closed(&disk, &index, SMALL_SEGMENT).await;
        let bases = disk.list().expect("list");
        assert!(bases.len() >= 3, "several segments: {bases:?}");
        let victim = bases[1];
        assert!(disk.corrupt_segment(victim, |bytes| bytes[20] ^= 0x40));

        // With the index intact, nothing re-reads that segment at open; but a read of the
        // damaged event fails loudly rather than skipping it.
        let store = open_store(&disk, &index, SMALL_SEGMENT);
        let mut failed = false;
        for session in SESSIONS {
            let mut rx = store.subscribe(
                session.into(),
                0,
                false,
                tokio_util::sync::CancellationToken::new(),
            );
            let mut last = 0;
            while let Some(item) = rx.recv().await {
                match item {
                    Ok(run) => {
                        for e in run.into_events().expect("a read event decodes") {
                            assert_eq!(e.seq, last + 1, "{session}: no event is skipped");
                            last = e.seq;
                        }
                    }
                    Err(e) => {
                        assert!(matches!(e, StoreError::Internal(_)), "{e:?}");
                        failed = true;
                    }
                }
            }
        }
        assert!(failed, "some session's read hit the damaged record");
        store.close().expect("close");

        // Rebuilding the index reads every segment: the open refuses, naming the segment,
        // and cuts nothing away.
        std::fs::remove_dir_all(&index).expect("remove the index");
        let bytes = disk.total_len();
        match try_open_store(&disk, &index, SMALL_SEGMENT) {
            Err(OpenError::Log(LogError::Corrupt { base, .. })) => assert_eq!(base, victim),
            Err(e) => panic!("expected LogError::Corrupt, got {e}"),
            Ok(_) => panic!("a corrupt earlier segment must refuse to open"),
        }
        assert_eq!(disk.total_len(), bytes, "a refused open changes nothing");
    });
}

#[test]
fn a_flipped_byte_in_the_indexed_part_of_the_last_segment_is_never_cut_off() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let disk = SimStorage::new();
        let dir = tempfile::tempdir().expect("temp dir");
        let index = dir.path().join("index");
        filled_and_closed(&disk, &index, ONE_SEGMENT).await;

        // This byte (in the first record, of SESSIONS[0]) was fsync'd and indexed: damage
        // to it is not a torn write. The open reads the log only past what the index
        // absorbed (the record the index names as the last one it absorbed is whole), so
        // it neither sees the damage nor cuts anything off; a read of the damaged record
        // fails on its checksum, and every other record is served.
        assert!(disk.corrupt_segment(0, |bytes| bytes[40] ^= 0x08));
        let bytes = disk.total_len();
        let store = open_store(&disk, &index, ONE_SEGMENT);
        assert_eq!(disk.total_len(), bytes, "nothing is cut off");
        for session in &SESSIONS[1..] {
            assert_eq!(history(&store, session).await.len(), 20);
        }
        let mut rx = store.subscribe(
            SESSIONS[0].to_string(),
            0,
            false,
            tokio_util::sync::CancellationToken::new(),
        );
        let mut failed = None;
        while let Some(item) = rx.recv().await {
            if let Err(e) = item.and_then(|run| run.into_events()) {
                failed = Some(e);
            }
        }
        let failed = failed.expect("the damaged record is not served");
        assert!(failed.to_string().contains("checksum"), "{failed}");
        let appended = store
            .append(append_op(SESSIONS[0], &["after".into()], Durability::Sync))
            .await
            .expect("appends go on");
        assert_eq!(appended.last_seq, 21);
        store.close().expect("close");
    });
}

#[test]
fn a_damaged_last_absorbed_record_has_the_last_segment_read_whole_and_refuses_to_open() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let disk = SimStorage::new();
        let dir = tempfile::tempdir().expect("temp dir");
        let index = dir.path().join("index");
        filled_and_closed(&disk, &index, ONE_SEGMENT).await;

        // The record the index names as the last it absorbed no longer checks out, so the
        // log cannot vouch for what the index absorbed: the open reads the last segment
        // whole, finds the damage below the indexed offset and refuses, rather than taking
        // the damage for a torn tail and dropping acknowledged events.
        let bytes = disk.total_len();
        assert!(disk.corrupt_segment(0, |b| {
            let last = b.len() - 3;
            b[last] ^= 0x08
        }));
        match try_open_store(&disk, &index, ONE_SEGMENT) {
            Err(OpenError::Log(LogError::Corrupt { base, offset, .. })) => {
                assert_eq!(base, 0);
                assert!(offset < bytes, "the damaged record is named: {offset}");
            }
            Err(e) => panic!("expected LogError::Corrupt, got {e}"),
            Ok(_) => panic!("damage below the indexed offset must refuse to open"),
        }
        assert_eq!(disk.total_len(), bytes, "a refused open changes nothing");
    });
}

#[test]
fn a_preallocated_log_ends_at_its_last_record_and_recovers_a_prefix_from_any_cut() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let log = LogConfig {
        segment_bytes: 2048,
        preallocate_bytes: 1024,
    };
    rt.block_on(async {
        let mut rng = fastrand::Rng::with_seed(11);
        for round in 0..16 {
            let disk = SimStorage::new();
            let dir = tempfile::tempdir().expect("temp dir");
            let index = dir.path().join("index");
            let store = open_store_with(&disk, &index, log);
            fill_segments(&store).await;
            store.close().expect("close");
            let written = read_log(&disk);
            assert_eq!(written.len(), 60, "every append is read back");

            // A clean restart reads the zero-filled room as the end, drops nothing and
            // keeps the room.
            let bytes = disk.total_len();
            let store = open_store_with(&disk, &index, log);
            assert_eq!(disk.total_len(), bytes, "round {round}: nothing was cut");
            for session in SESSIONS {
                let info = store.get_session(session).expect("the session survived");
                assert_eq!(info.last_seq, 20, "round {round}: {session}");
            }
            store.close().expect("close");
            assert_eq!(read_log(&disk), written, "round {round}: every record kept");

            // A cut anywhere in the last segment (records or zeros) keeps a prefix.
            let last = *disk.list().expect("list").last().expect("a segment");
            let at = rng.u64(0..=disk.total_len() - last);
            disk.corrupt(|bytes| bytes.truncate(at as usize));
            std::fs::remove_dir_all(&index).expect("remove the index");
            let store = open_store_with(&disk, &index, log);
            let recovered = read_log(&disk);
            assert!(
                recovered[..] == written[..recovered.len()],
                "round {round}: a prefix"
            );
            check_index(&store, &recovered).await;
            store.close().expect("close");
        }
    });
}
