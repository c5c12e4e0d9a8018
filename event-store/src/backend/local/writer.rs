//! The single writer: group commit.
//!
//! One thread takes every pending operation from the queue, decides each against the
//! in-memory state by the rules of [`crate::rules`] (lease epoch, event-id dedup and seqs,
//! expected seq, approvals; lease grants), writes all resulting records in one write,
//! calls `fdatasync` **once** for the whole batch, and only then acknowledges and
//! publishes. While one fsync runs, the next
//! batch queues up, so concurrent appends share fsyncs without any artificial delay.
//!
//! The index (sled) follows behind the acknowledgements: the writer absorbs many commits
//! into one sled batch when it has nothing else to do (or when enough piled up). Until
//! then the positions of those durable records are in [`crate::backend::local::index::Recent`] for readers
//! and their event ids in the writer's own map for dedup, so neither ever misses them; and
//! recovery replays whatever the index had not absorbed from the log, as after any crash.
//!
//! Invariants kept here:
//! - a `DURABILITY_SYNC` append and every lease grant are answered only after the fsync
//!   that covers them;
//! - subscribers and readers see a record only after that fsync;
//! - dedup is permanent: an event id is looked up in the batch in hand, the window the
//!   index has not absorbed yet, and the index; for a fork that shares its parent's prefix,
//!   in its bases' too, up to the seqs it shares;
//! - a full volume refuses what would write (`RESOURCE_EXHAUSTED`, saying why) before
//!   anything of the batch is written, and appends resume by themselves once there is room;
//!   a deletion's tombstone still goes in, into the room kept free for the index, so that
//!   deleting sessions is how an operator frees a full volume;
//! - a deletion is answered only after its tombstone's fsync, and from the moment it is
//!   decided the session refuses every later op of the queue (and of the batch in hand);
//!   readers see the tombstone, and live subscribers are ended, only after that fsync;
//! - any other I/O error on the log stops the writer for good: after a failed fsync the
//!   kernel may have dropped the dirty pages, so nothing more may be acknowledged (the
//!   process exits and recovery re-reads what is really on disk);
//! - once the writer stops, for whatever reason, every op queued or on its way to the queue
//!   is answered (its reply dropped: `UNAVAILABLE` to its caller); none is left waiting.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, LazyLock};
use std::time::{Duration, Instant};

use agentlog_proto::kept::KeptEvent;
use agentlog_proto::v1::{AppendResponse, Durability, ForkSessionResponse, Lease};
use prost::Message;
use tokio::sync::mpsc::error::TryRecvError;
use tokio::sync::{mpsc, oneshot};

use agentlog_proto::reason::Reason;

use super::index::{
    generated_id, is_staging, self_named_seq, Index, IndexBatch, IndexError, Recent,
    LISTED_STATUSES,
};
use super::log::record::Tombstone;
use super::log::record::{CopiedEvent, PinRecord};
use super::log::storage::CrashPoint;
use super::log::{record, LogError, LogReader, LogWriter, Record};
use super::published::Shared;
use super::sessions::Sessions;
use crate::backend::AppendOp;
use crate::clock::now_unix_ms;
use crate::error::StoreError;
use crate::metrics;
use crate::rules::{self, Deletion};
use crate::scope::Scope;
use crate::session::{lease_of, ForkRecord, SessionMeta};
use agentlog_proto::v1::SessionStatus;

/// At most this many operations share one fsync, so one batch's latency stays bounded.
const MAX_BATCH_OPS: usize = 4096;
/// How long the writer looks for the next op before it sleeps (see [`next_op`]) after a
/// batch of several ops: under load the next op is near, and a writer that looks longer
/// takes the core from the threads that bring it.
const LINGER: Duration = Duration::from_micros(50);
/// The same after a batch of one op, the pace of a single caller: about one round trip of
/// its next append, so that the writer is still awake when it comes.
const LINGER_ALONE: Duration = Duration::from_micros(200);
/// The index absorbs the durable records once this many wait for it, even under load.
const INDEX_BATCH_RECORDS: usize = 8192;
/// When the writer is idle, records that waited this long are absorbed into the index. The
/// longer, the more appends share each session's metadata write in sled; what waits costs
/// only memory and, after a crash, replay.
const INDEX_LAG: Duration = Duration::from_millis(100);
/// How often, at most, an absorb also writes sled's buffers out (sled's own flusher is
/// off, see [`crate::backend::local::index`]): this bounds what a restart replays.
const INDEX_FLUSH_EVERY: Duration = Duration::from_millis(500);

pub enum Op {
    /// The span the append was submitted in (the request's, see
    /// [`metrics::AppendObserver`]): the fsync it waits for is traced under it.
    Append(
        AppendOp,
        oneshot::Sender<Result<AppendResponse, StoreError>>,
        tracing::Span,
    ),
    Lease(LeaseOp, oneshot::Sender<Result<LeaseOutcome, StoreError>>),
    /// A fork: written if its session does not exist yet and its parent still does.
    Fork(
        Box<rules::ForkPlan>,
        oneshot::Sender<Result<ForkSessionResponse, StoreError>>,
    ),
    /// Makes a fork's shared prefix its own; answered with whether it wrote it (not if the
    /// fork no longer reads through that base, or was deleted).
    Materialize(Box<Materialize>, oneshot::Sender<Result<bool, StoreError>>),
    /// Answered with the sessions it deleted (none: the session was deleted before).
    Delete(DeleteOp, oneshot::Sender<Result<Vec<String>, StoreError>>),
    /// Events of a session being imported, written into its staging session as the export
    /// gives them (see `import`).
    /// Answered with the first event whose id repeats one of the session's, if any
    /// (its seq, the earlier seq, the id): then nothing was written.
    Stage(
        Box<Stage>,
        oneshot::Sender<Result<Option<Repeated>, StoreError>>,
    ),
    /// An import made visible: the session, reading its events through its staging
    /// session, in one record (see `import`).
    Adopt(Box<Adopt>, oneshot::Sender<Result<(), StoreError>>),
    /// The sessions retention would take (`Backend::expiring`), each with its last seq;
    /// nothing is written.
    Expiring {
        idle_before: i64,
        max: usize,
        reply: oneshot::Sender<Result<Vec<(String, u64)>, StoreError>>,
    },
    /// PinSession: answered with the session's state after it.
    Pin(
        String,
        bool,
        oneshot::Sender<Result<SessionMeta, StoreError>>,
    ),
    /// Seal the active segment, if it holds any record, so that it can be rewritten;
    /// answered with the base of the active segment after it.
    Seal(oneshot::Sender<Result<u64, StoreError>>),
    /// Look whether the volume has room again (after a reclamation freed some): appends
    /// resume, and health says so, without waiting for an append to find out.
    Room(oneshot::Sender<Result<(), StoreError>>),
}

pub enum DeleteOp {
    /// DeleteSession.
    Session(String),
    /// An imported `deleted` line: the id's tombstone, even if it never existed here.
    Imported {
        session_id: String,
        deleted_unix_ms: i64,
    },
    /// A step of retention: up to `max` sessions whose last event is before `idle_before`
    /// and that hold no live lease ([`rules::expired`]).
    Idle { idle_before: i64, max: usize },
    /// The archive's deletion: the session, if it is still expired at `last_seq` (nothing
    /// written since it was archived).
    IfExpired {
        session_id: String,
        idle_before: i64,
        last_seq: u64,
    },
}

/// A fork's prefix, read through its base, to be made its own ([`Record::Placed`]s, in one
/// atomic append, the last of which drops the base): written only if the fork still reads
/// its seqs `1..=base_seq` through `base`.
pub struct Materialize {
    pub session_id: String,
    pub base: String,
    pub base_seq: u64,
    /// Seqs 1 to `base_seq`, as stored, each with the fork's session id.
    pub placed: Vec<CopiedEvent>,
}

/// An event id repeated in an import: the event's seq, the earlier seq, the id.
pub type Repeated = (u64, u64, String);

/// Events staged for an import: they must go on from the staging session's last seq.
pub struct Stage {
    pub staging: String,
    pub events: Vec<KeptEvent>,
}

/// An import's commit: `session_id` made of the staging session's events, with the state
/// `rules::adopt_imported` makes of them and of the session line.
pub struct Adopt {
    pub session_id: String,
    pub staging: String,
    pub line: agentlog_proto::v1::SessionInfo,
}

pub enum LeaseOp {
    Acquire {
        session_id: String,
        owner: String,
        ttl_ms: u64,
    },
    Renew {
        session_id: String,
        owner: String,
        epoch: u64,
        ttl_ms: u64,
    },
    Release {
        session_id: String,
        owner: String,
        epoch: u64,
    },
    /// The oldest runnable, unleased session in `scope`.
    Claim {
        owner: String,
        ttl_ms: u64,
        scope: Scope,
    },
}

pub enum LeaseOutcome {
    Granted(Lease),
    Released,
    /// No claimable session now; the earliest time a runnable session becomes claimable (a
    /// live lease runs out, a `model_retry` falls due), if any.
    NothingToClaim {
        next_expiry_unix_ms: Option<i64>,
    },
}

/// The writer's own view, which runs ahead of the published one by at most the batch in
/// hand (records written but not yet fsync'd).
pub struct Writer {
    log: LogWriter,
    index: Index,
    /// The states of the sessions the writer has decided ops of lately.
    sessions: Sessions,
    /// Runnable sessions, oldest update first: the order `ClaimSession` hands them out.
    runnable: BTreeSet<(i64, String)>,
    shared: Arc<Shared>,
    /// Durable records the index has not absorbed yet.
    unindexed: IndexBatch,
    /// When the oldest record of `unindexed` became durable.
    unindexed_since: Option<Instant>,
    /// Event ids the index does not hold yet (the batch in hand and `unindexed`), by
    /// session.
    recent_ids: HashMap<String, HashMap<String, u64>>,
    /// Why what writes is refused, while the log's volume is full.
    full: Option<String>,
    /// When sled's buffers were last written out.
    index_flushed: Instant,
}

/// Replies that wait for the batch's fsync.
enum Pending {
    Append(
        oneshot::Sender<Result<AppendResponse, StoreError>>,
        AppendResponse,
    ),
    Lease(
        oneshot::Sender<Result<LeaseOutcome, StoreError>>,
        LeaseOutcome,
    ),
    Delete(
        oneshot::Sender<Result<Vec<String>, StoreError>>,
        Vec<String>,
    ),
    Fork(
        oneshot::Sender<Result<ForkSessionResponse, StoreError>>,
        ForkSessionResponse,
    ),
    Materialize(oneshot::Sender<Result<bool, StoreError>>, bool),
    Done(oneshot::Sender<Result<(), StoreError>>),
    Staged(oneshot::Sender<Result<Option<Repeated>, StoreError>>),
    Pinned(
        oneshot::Sender<Result<SessionMeta, StoreError>>,
        Box<SessionMeta>,
    ),
}

/// Whether a thread that waits for another may look again for a while before it sleeps
/// ([`next_op`]'s linger, and an append's wait for its answer in [`super::Store`]): only
/// with a core to spare. On fewer than two CPUs (a container's CPU quota counts) the
/// looking would take the core from the very thread that brings what it waits for, and
/// spend the quota for nothing.
pub(crate) fn may_look_again() -> bool {
    static SPARE_CORE: LazyLock<bool> = LazyLock::new(|| {
        looks_again_on(std::thread::available_parallelism().map_or(1, |n| n.get()))
    });
    *SPARE_CORE
}

fn looks_again_on(cpus: usize) -> bool {
    cpus >= 2
}

/// The next op, waiting for one if the queue is empty. It looks again for a short while
/// (`linger`, yielding the core to any other thread that can run) before it sleeps: a
/// sleeping writer costs the op that wakes it a thread wake-up on the way in, which at low
/// load is a large part of an append's latency (on a virtual machine whose idle cores
/// halt, as long as the fdatasync).
fn next_op(queue: &mut mpsc::Receiver<Op>, linger: Duration) -> Option<Op> {
    let linger = if may_look_again() {
        linger
    } else {
        Duration::ZERO
    };
    let since = Instant::now();
    while since.elapsed() < linger {
        match queue.try_recv() {
            Ok(op) => return Some(op),
            Err(TryRecvError::Disconnected) => return None,
            Err(TryRecvError::Empty) => std::thread::yield_now(),
        }
    }
    queue.blocking_recv()
}

/// Closes the queue of a writer that stopped and answers every op still in it, or still on
/// its way: a caller that had its place in the queue before the close puts its op in after
/// it (tokio's `send` takes the place, then puts the op), and a receiver merely dropped would
/// leave that op in the channel, its caller waiting for good. `recv` after `close` ends only
/// once no place is held, so each such op arrives here; dropping it drops its reply, which
/// its caller reads as `UNAVAILABLE`.
fn drain(mut queue: mpsc::Receiver<Op>) {
    queue.close();
    while let Some(op) = queue.blocking_recv() {
        drop(op);
    }
}

impl Writer {
    /// `cache_bytes`: the budget of the sessions' states kept in memory
    /// ([`Sessions`]). The runnable sessions are read from the index's listing.
    pub fn new(
        log: LogWriter,
        index: Index,
        shared: Arc<Shared>,
        cache_bytes: usize,
    ) -> Result<Writer, IndexError> {
        let runnable = index
            .with_status(SessionStatus::Runnable as u8)?
            .into_iter()
            .collect();
        let sessions = Sessions::new(index.clone(), cache_bytes);
        Ok(Writer {
            log,
            index,
            sessions,
            runnable,
            shared,
            unindexed: IndexBatch::default(),
            unindexed_since: None,
            recent_ids: HashMap::new(),
            full: None,
            index_flushed: Instant::now(),
        })
    }

    /// Runs until every sender of the queue is gone (shutdown) or the log fails, then
    /// answers whatever is still on its way ([`drain`]).
    pub fn run(self, mut queue: mpsc::Receiver<Op>) -> Result<(), StoreError> {
        let result = self.serve(&mut queue);
        drain(queue);
        result
    }

    fn serve(mut self, queue: &mut mpsc::Receiver<Op>) -> Result<(), StoreError> {
        let mut linger = LINGER;
        loop {
            let first = match queue.try_recv() {
                Ok(op) => op,
                Err(TryRecvError::Disconnected) => break,
                Err(TryRecvError::Empty) => {
                    // Nothing to do: a good moment to bring the index up to date.
                    if self.index_due(true) {
                        self.absorb()?;
                        continue;
                    }
                    match next_op(queue, linger) {
                        Some(op) => op,
                        None => break,
                    }
                }
            };
            // Sized for what is queued now: a batch's `Op`s are large, and growing the vector
            // step by step copied them again each time.
            let mut ops = Vec::with_capacity((queue.len() + 1).min(MAX_BATCH_OPS));
            ops.push(first);
            while ops.len() < MAX_BATCH_OPS {
                match queue.try_recv() {
                    Ok(op) => ops.push(op),
                    Err(_) => break,
                }
            }
            linger = if ops.len() == 1 { LINGER_ALONE } else { LINGER };
            self.commit(ops)?;
            if self.index_due(false) {
                self.absorb()?;
            }
        }
        if self.full.is_none() {
            self.absorb()?;
            self.index.flush()?;
        }
        Ok(())
    }

    /// Whether the records waiting for the index should be absorbed now. Not while the
    /// volume is full: sled must not fail a write of its own (that would stop it for good);
    /// the records wait in memory, and recovery replays them after a restart anyway.
    fn index_due(&self, idle: bool) -> bool {
        match self.unindexed_since {
            Some(since) if self.full.is_none() => {
                self.unindexed.len() >= INDEX_BATCH_RECORDS
                    || (idle && since.elapsed() >= INDEX_LAG)
            }
            _ => false,
        }
    }

    /// Writes the durable records that waited into the index, in one sled batch.
    fn absorb(&mut self) -> Result<(), StoreError> {
        if self.unindexed_since.take().is_none() {
            return Ok(());
        }
        let batch = std::mem::take(&mut self.unindexed);
        self.index
            .apply(batch, self.sessions.states(), self.log.tail())?;
        // Only now: a reader that missed them in `recent` finds them in the index.
        self.shared.recent.clear();
        self.shared.absorbed_sessions();
        self.sessions.shrink();
        self.recent_ids.clear();
        self.shared.absorbed_to(self.log.end());
        if self.index_flushed.elapsed() >= INDEX_FLUSH_EVERY {
            self.index.flush()?;
            self.index_flushed = Instant::now();
        }
        Ok(())
    }

    /// Makes room in the log for everything `ops` may write and hands them back. While the
    /// volume is full, every op of the batch but the deletions is answered
    /// `RESOURCE_EXHAUSTED` here instead, before anything of it is written or any state
    /// changes (nothing torn), and is not handed back; the deletions get their few bytes from
    /// the room kept free for the index (a tombstone is how space comes back).
    fn make_room(&mut self, ops: Vec<Op>) -> Result<Vec<Op>, StoreError> {
        let bound: u64 = ops.iter().map(Op::max_log_bytes).sum();
        let reason = match self.log.reserve(bound) {
            Ok(()) => {
                if self.full.take().is_some() {
                    tracing::info!("the log's volume has room again: appends resume");
                    self.shared.set_full(None);
                }
                return Ok(ops);
            }
            Err(LogError::NoSpace(reason)) => reason,
            Err(e) => return Err(e.into()),
        };
        if self.full.is_none() {
            tracing::warn!(
                %reason,
                "the log's volume is full: refusing appends until there is room (reads and \
                 deletions go on)"
            );
            self.shared.set_full(Some(reason.clone()));
        }
        let refusal = || {
            StoreError::Refused(
                Reason::DiskFull,
                format!(
                    "the store's disk is full ({reason}); nothing was written. Appends resume by \
                 themselves once there is room (deleting sessions makes room); retry later"
                ),
            )
        };
        let (deletions, refused): (Vec<Op>, Vec<Op>) =
            ops.into_iter().partition(|op| matches!(op, Op::Delete(..)));
        for op in refused {
            op.refuse(refusal());
        }
        let bound: u64 = deletions.iter().map(Op::max_log_bytes).sum();
        let mut room = self.log.reserve_in_headroom(bound);
        if matches!(room, Err(LogError::NoSpace(_))) && self.log.release_reserve()? > 0 {
            room = self.log.reserve_in_headroom(bound);
        }
        let kept = match room {
            Ok(()) => deletions,
            Err(LogError::NoSpace(_)) => {
                for op in deletions {
                    op.refuse(refusal());
                }
                Vec::new()
            }
            Err(e) => return Err(e.into()),
        };
        self.full = Some(reason);
        Ok(kept)
    }

    /// Seals the active segment for the [`Op::Seal`]s among `ops` (before anything of the
    /// batch is written, so the batch goes to the new segment) and hands back the others.
    fn seal_first(&mut self, ops: Vec<Op>) -> Result<Vec<Op>, StoreError> {
        // Nearly every batch: handed back as it is, not moved op by op into a new vector.
        if !ops.iter().any(|op| matches!(op, Op::Seal(_))) {
            return Ok(ops);
        }
        let (seals, ops): (Vec<Op>, Vec<Op>) =
            ops.into_iter().partition(|op| matches!(op, Op::Seal(_)));
        let mut sealed = self.log.seal();
        if matches!(sealed, Err(LogError::NoSpace(_))) && self.log.release_reserve()? > 0 {
            sealed = self.log.seal();
        }
        let sealed = match sealed {
            Ok(base) => Ok(base),
            Err(LogError::NoSpace(reason)) => Err(StoreError::Refused(
                Reason::DiskFull,
                format!("no room for a new segment: {reason}"),
            )),
            Err(e) => return Err(e.into()),
        };
        for op in seals {
            if let Op::Seal(reply) = op {
                let _ = reply.send(sealed.clone());
            }
        }
        Ok(ops)
    }

    fn commit(&mut self, ops: Vec<Op>) -> Result<(), StoreError> {
        let now = now_unix_ms();
        let ops = self.seal_first(ops)?;
        let ops = self.make_room(ops)?;
        // Sized for the batch (an append of one event is the usual op).
        let mut batch = Batch::with_capacity(ops.len());
        let mut pending = Vec::with_capacity(ops.len());
        let mut buffered = Vec::new();
        let mut waiting = Vec::with_capacity(ops.len());
        for op in ops {
            match op {
                Op::Append(req, reply, span) => {
                    let durability = req.durability;
                    match self.prepare_append(req, now, &mut batch) {
                        Ok(resp) if durability == Durability::Buffered => {
                            buffered.push((reply, resp))
                        }
                        Ok(resp) => {
                            waiting.push(span);
                            pending.push(Pending::Append(reply, resp))
                        }
                        Err(e) => {
                            let _ = reply.send(Err(e));
                        }
                    }
                }
                Op::Lease(req, reply) => match self.prepare_lease(req, now, &mut batch) {
                    // Answering "nothing to claim" needs no fsync.
                    Ok(outcome @ LeaseOutcome::NothingToClaim { .. }) => {
                        let _ = reply.send(Ok(outcome));
                    }
                    Ok(outcome) => pending.push(Pending::Lease(reply, outcome)),
                    Err(e) => {
                        let _ = reply.send(Err(e));
                    }
                },
                Op::Delete(req, reply) => match self.prepare_delete(req, now, &mut batch) {
                    Ok(deleted) => pending.push(Pending::Delete(reply, deleted)),
                    Err(e) => {
                        let _ = reply.send(Err(e));
                    }
                },
                Op::Fork(plan, reply) => match self.prepare_fork(*plan, &mut batch) {
                    Ok(answer) => pending.push(Pending::Fork(reply, answer)),
                    Err(e) => {
                        let _ = reply.send(Err(e));
                    }
                },
                Op::Materialize(m, reply) => match self.prepare_materialize(*m, &mut batch) {
                    Ok(true) => pending.push(Pending::Materialize(reply, true)),
                    other => {
                        let _ = reply.send(other);
                    }
                },
                Op::Stage(stage, reply) => match self.prepare_stage(*stage, &mut batch) {
                    Ok(None) => pending.push(Pending::Staged(reply)),
                    other => {
                        let _ = reply.send(other);
                    }
                },
                Op::Adopt(adopt, reply) => match self.prepare_adopt(*adopt, &mut batch) {
                    Ok(()) => pending.push(Pending::Done(reply)),
                    Err(e) => {
                        let _ = reply.send(Err(e));
                    }
                },
                Op::Pin(session_id, pinned, reply) => {
                    match self.prepare_pin(&session_id, pinned, &mut batch) {
                        Ok(meta) => pending.push(Pending::Pinned(reply, Box::new(meta))),
                        Err(e) => {
                            let _ = reply.send(Err(e));
                        }
                    }
                }
                Op::Expiring {
                    idle_before,
                    max,
                    reply,
                } => {
                    let found = self.expired(idle_before, max, now).map(|ids| {
                        ids.into_iter()
                            .map(|id| {
                                let last_seq = self.sessions.get(&id).map_or(0, |m| m.last_seq);
                                (id, last_seq)
                            })
                            .collect()
                    });
                    let _ = reply.send(found);
                }
                // Answered by `seal_first`, which takes every seal out of the batch.
                Op::Seal(reply) => {
                    let _ = reply.send(Ok(self.log.reader().active_base()));
                }
                // `make_room` looked.
                Op::Room(reply) => {
                    let _ = reply.send(Ok(()));
                }
            }
        }
        if batch.records.is_empty() {
            // Only deduplicated appends: their events are already durable.
            for (reply, resp) in buffered {
                let _ = reply.send(Ok(resp));
            }
            for p in pending {
                p.send();
            }
            return Ok(());
        }

        let positions = self
            .log
            .write(batch.records.iter().zip(batch.continued.iter().copied()))?;
        if batch.records.iter().any(|r| matches!(r, Record::Placed(_))) {
            self.log.crash_point(CrashPoint::MaterializeWritten)?;
        }
        // DURABILITY_BUFFERED: acknowledged once written; the fsync follows right here.
        for (reply, resp) in buffered {
            let _ = reply.send(Ok(resp));
        }
        let fsync = metrics::FsyncObserver::start(
            positions.len(),
            positions.iter().map(|p| u64::from(p.len)).sum(),
            &waiting,
        );
        self.log.sync()?;
        fsync.done();

        // Durable: readers find these records in `recent` until the index absorbs them.
        self.shared.recent.add(&positions, &batch.records);
        for (pos, record) in positions.iter().zip(&batch.records) {
            self.unindexed.add(*pos, record);
        }
        self.unindexed_since.get_or_insert_with(Instant::now);
        let tombstones: Vec<(String, u64)> = positions
            .iter()
            .zip(&batch.records)
            .filter_map(|(pos, record)| match record {
                Record::Tombstone(t) => Some((t.session_id.clone(), pos.offset + pos.len as u64)),
                _ => None,
            })
            .collect();
        self.shared
            .publish(batch.records, self.sessions.states(), now);
        self.shared.made_durable(self.log.end());
        if !tombstones.is_empty() {
            self.shared.erase(tombstones);
        }
        for p in pending {
            p.send();
        }
        Ok(())
    }

    /// The sessions whose logs hold events of `session_id` besides its own, each with the
    /// last seq of it they hold: its base (up to the seq they share), that one's base, and
    /// so on (none for a session that is no fork sharing a prefix).
    fn bases_of(&mut self, session_id: &str) -> Result<Vec<(String, u64)>, StoreError> {
        let mut bases: Vec<(String, u64)> = Vec::new();
        let mut up_to = u64::MAX;
        loop {
            let at = bases.last().map_or(session_id, |(base, _)| base.as_str());
            self.sessions.load(at)?;
            // A base is always older than its fork: the line ends.
            let Some(meta) = self.sessions.get(at).filter(|m| !m.base_session.is_empty()) else {
                break;
            };
            up_to = up_to.min(meta.base_seq);
            bases.push((meta.base_session.clone(), up_to));
        }
        Ok(bases)
    }

    fn prepare_append(
        &mut self,
        req: AppendOp,
        now: i64,
        batch: &mut Batch,
    ) -> Result<AppendResponse, StoreError> {
        self.sessions.load(&req.session_id)?;
        let empty = SessionMeta::default();
        let meta = self.sessions.get(&req.session_id).unwrap_or(&empty);
        let session_id = &req.session_id;
        rules::check_writer(
            meta,
            session_id,
            req.lease_epoch,
            req.events.iter().map(KeptEvent::event),
            now,
        )
        .inspect_err(|e| fenced(e, "append"))?;
        let bases = self.bases_of(session_id)?;
        let meta = self.sessions.get(&req.session_id).unwrap_or(&empty);

        // Dedup: an id is looked up in the window the index has not absorbed yet (this
        // batch included), then the index, then (for a generated id) the log itself; for a
        // fork that reads its prefix through its base, then in the base's, up to the seqs
        // it shares, and so on down its line.
        let numbered = rules::number(session_id, req.events, meta.last_seq, now, |id| {
            let own = std::iter::once((session_id.as_str(), meta.last_seq));
            let line = own.chain(bases.iter().map(|(base, up_to)| (base.as_str(), *up_to)));
            for (session, up_to) in line {
                let ids = self.recent_ids.get(session);
                let within = |seq: &u64| *seq <= up_to;
                if let Some(seq) = ids.and_then(|ids| ids.get(id)).filter(|s| within(s)) {
                    return Ok::<_, StoreError>(Some(*seq));
                }
                if let Some(seq) = self.index.event_seq(session, id)?.filter(within) {
                    return Ok(Some(seq));
                }
                let log = self.log.reader();
                let found = (&self.index, &*self.shared.recent, &*log);
                if let Some(seq) = self_named(found, session, id, up_to)? {
                    return Ok(Some(seq));
                }
            }
            Ok(None)
        })?;
        rules::check_fresh(meta, session_id, req.expected_last_seq, &numbered.fresh)?;

        // Accepted: new ids go into `recent_ids` at once, so a repeat later in this batch
        // finds them.
        let mut fresh = numbered.fresh;
        if !self.recent_ids.contains_key(session_id) {
            self.recent_ids.insert(session_id.clone(), HashMap::new());
        }
        let ids = self.recent_ids.get_mut(session_id).expect("inserted above");
        name_fresh(&mut fresh, ids);

        let last_seq = self.update_session(session_id, |meta| {
            for event in &fresh {
                meta.apply_event(event);
            }
            meta.last_seq
        });
        let count = fresh.len();
        for (i, event) in fresh.into_iter().enumerate() {
            batch.push(Record::Event(event), i + 1 < count);
        }
        Ok(AppendResponse {
            seqs: numbered.seqs,
            last_seq,
        })
    }

    fn prepare_lease(
        &mut self,
        req: LeaseOp,
        now: i64,
        batch: &mut Batch,
    ) -> Result<LeaseOutcome, StoreError> {
        let (session_id, record) = match req {
            LeaseOp::Acquire {
                session_id,
                owner,
                ttl_ms,
            } => {
                self.sessions.load(&session_id)?;
                let meta = rules::existing(self.sessions.get(&session_id), &session_id)?;
                let record = rules::acquire(meta, &session_id, owner, ttl_ms, now)?;
                (session_id, record)
            }
            LeaseOp::Renew {
                session_id,
                owner,
                epoch,
                ttl_ms,
            } => {
                self.sessions.load(&session_id)?;
                let meta = rules::existing(self.sessions.get(&session_id), &session_id)?;
                let record = rules::renew(meta, &session_id, &owner, epoch, ttl_ms, now)
                    .inspect_err(|e| fenced(e, "renew"))?;
                (session_id, record)
            }
            LeaseOp::Release {
                session_id,
                owner,
                epoch,
            } => {
                self.sessions.load(&session_id)?;
                let meta = rules::existing(self.sessions.get(&session_id), &session_id)?;
                match rules::release(meta, &session_id, &owner, epoch, now)? {
                    Some(record) => (session_id, record),
                    None => return Ok(LeaseOutcome::Released),
                }
            }
            LeaseOp::Claim {
                owner,
                ttl_ms,
                scope,
            } => {
                let mut claimable = None;
                let mut next_expiry_unix_ms: Option<i64> = None;
                for (_, id) in self.runnable.iter().filter(|(_, id)| scope.admits(id)) {
                    self.sessions.load(id)?;
                    let Some(meta) = self.sessions.get(id) else {
                        continue;
                    };
                    if rules::claimable(meta, now) {
                        claimable = Some(id.clone());
                        break;
                    }
                    let from = meta.claimable_from();
                    if from > now {
                        next_expiry_unix_ms =
                            Some(next_expiry_unix_ms.map_or(from, |e| e.min(from)));
                    }
                }
                let Some(session_id) = claimable else {
                    return Ok(LeaseOutcome::NothingToClaim {
                        next_expiry_unix_ms,
                    });
                };
                let meta = rules::existing(self.sessions.get(&session_id), &session_id)?;
                let record = rules::grant(meta, &session_id, owner, ttl_ms, now);
                (session_id, record)
            }
        };
        let outcome = if record.released {
            LeaseOutcome::Released
        } else {
            LeaseOutcome::Granted(lease_of(&record))
        };
        self.update_session(&session_id, |meta| meta.apply_lease(&record));
        batch.push(Record::Lease(record), false);
        Ok(outcome)
    }

    fn prepare_delete(
        &mut self,
        req: DeleteOp,
        now: i64,
        batch: &mut Batch,
    ) -> Result<Vec<String>, StoreError> {
        match req {
            DeleteOp::Session(session_id) => {
                self.sessions.load(&session_id)?;
                match rules::delete(self.sessions.get(&session_id), &session_id, now)? {
                    Deletion::Tombstone(tombstone) => {
                        self.tombstone(&session_id, *tombstone, batch);
                        Ok(vec![session_id])
                    }
                    Deletion::AlreadyDeleted => Ok(Vec::new()),
                }
            }
            DeleteOp::Imported {
                session_id,
                deleted_unix_ms,
            } => {
                self.sessions.load(&session_id)?;
                match rules::delete_imported(self.sessions.get(&session_id), deleted_unix_ms) {
                    Deletion::Tombstone(tombstone) => {
                        self.tombstone(&session_id, *tombstone, batch);
                        Ok(vec![session_id])
                    }
                    Deletion::AlreadyDeleted => Ok(Vec::new()),
                }
            }
            DeleteOp::Idle { idle_before, max } => {
                let mut expired = Vec::new();
                for session_id in self.expired(idle_before, max, now)? {
                    let meta = self.sessions.get(&session_id);
                    if let Deletion::Tombstone(tombstone) = rules::delete(meta, &session_id, now)? {
                        self.tombstone(&session_id, *tombstone, batch);
                        expired.push(session_id);
                    }
                }
                Ok(expired)
            }
            DeleteOp::IfExpired {
                session_id,
                idle_before,
                last_seq,
            } => {
                self.sessions.load(&session_id)?;
                let meta = self.sessions.get(&session_id);
                let unchanged = meta
                    .is_some_and(|m| m.last_seq == last_seq && rules::expired(m, idle_before, now));
                if !unchanged {
                    return Ok(Vec::new());
                }
                match rules::delete(meta, &session_id, now)? {
                    Deletion::Tombstone(tombstone) => {
                        self.tombstone(&session_id, *tombstone, batch);
                        Ok(vec![session_id])
                    }
                    Deletion::AlreadyDeleted => Ok(Vec::new()),
                }
            }
        }
    }

    /// Up to `max` sessions retention takes at `now` ([`rules::expired`]), least recently
    /// updated first (their states loaded). The least recently updated sessions of the
    /// index's listing are looked at (a bounded prefix, so that one step stays short even
    /// when many of the oldest are leased: a later pass looks again; pinned ones are passed
    /// over without counting, up to [`PINNED_PASSED`]), each judged on its state now (a
    /// session changed since the index's last absorb is in the cache).
    fn expired(
        &mut self,
        idle_before: i64,
        max: usize,
        now: i64,
    ) -> Result<Vec<String>, StoreError> {
        let look_at = max.saturating_mul(8);
        let mut oldest: Vec<(i64, String)> = Vec::new();
        for status in LISTED_STATUSES {
            let (mut taken, mut pinned) = (0, 0);
            for entry in self.index.oldest(status) {
                let (updated, id) = entry?;
                if updated >= idle_before || taken >= look_at || pinned >= PINNED_PASSED {
                    break;
                }
                self.sessions.load(&id)?;
                if self.sessions.get(&id).is_some_and(|m| m.pinned) {
                    pinned += 1;
                    continue;
                }
                taken += 1;
                oldest.push((updated, id));
            }
        }
        oldest.sort_unstable();
        oldest.truncate(look_at);
        let mut expired = Vec::new();
        for (_, session_id) in oldest {
            if expired.len() >= max {
                break;
            }
            self.sessions.load(&session_id)?;
            if self
                .sessions
                .get(&session_id)
                .is_some_and(|m| rules::expired(m, idle_before, now))
            {
                expired.push(session_id);
            }
        }
        Ok(expired)
    }

    /// Replaces the session's state by its tombstone (from now on every op refuses it) and
    /// writes the tombstone record.
    /// An imported session's staging session (its base, which nothing else reads through)
    /// goes with it.
    fn tombstone(&mut self, session_id: &str, mut tombstone: SessionMeta, batch: &mut Batch) {
        let deleted_unix_ms = tombstone.deleted_unix_ms;
        let base = self.update_session(session_id, |meta| {
            // Its forks may read through it until its records are gone.
            tombstone.base_session = std::mem::take(&mut meta.base_session);
            tombstone.base_seq = meta.base_seq;
            *meta = tombstone;
            meta.base_session.clone()
        });
        if is_staging(&base) && !is_staging(session_id) {
            if let Ok(Deletion::Tombstone(staging)) =
                rules::delete(self.sessions.get(&base), &base, deleted_unix_ms)
            {
                self.tombstone(&base, *staging, batch);
            }
        }
        // Its recent ids stay until the next absorb writes them into the index: a fork that
        // reads its prefix through it dedups against them.
        batch.push(
            Record::Tombstone(Tombstone {
                session_id: session_id.to_string(),
                deleted_unix_ms,
            }),
            false,
        );
    }

    /// A fork's records, as one atomic append: its start (carrying its state at the fork
    /// point, its prefix read through the parent), then the request's new events. The
    /// parent must still exist: a fork is never made through a deleted session, so its
    /// start comes before the parent's tombstone in the log.
    fn prepare_fork(
        &mut self,
        plan: rules::ForkPlan,
        batch: &mut Batch,
    ) -> Result<ForkSessionResponse, StoreError> {
        let rules::ForkPlan {
            mut record,
            mut fresh,
            at_fork,
            mut meta,
            seqs: _,
        } = plan;
        let session_id = record.session_id.clone();
        self.sessions.load(&session_id)?;
        rules::fork_target(self.sessions.get(&session_id), &session_id)?;
        self.sessions.load(&record.parent)?;
        let parent = rules::existing(self.sessions.get(&record.parent), &record.parent)?;
        if parent.last_seq < record.seq {
            return Err(StoreError::Internal(format!(
                "session {} is shorter than the fork's prefix",
                record.parent
            )));
        }
        let mut state = at_fork;
        state.first_user_text.clear();
        state.base_session = record.parent.clone();
        state.base_seq = record.seq;
        meta.base_session = record.parent.clone();
        meta.base_seq = record.seq;
        record.state = Some(state);
        let ids = self.recent_ids.entry(session_id.clone()).or_default();
        name_fresh(&mut fresh, ids);
        let last_seq = meta.last_seq;
        self.update_session(&session_id, |current| *current = meta);
        let count = fresh.len();
        batch.push(Record::Fork(record), count > 0);
        for (i, event) in fresh.into_iter().enumerate() {
            batch.push(Record::Event(event), i + 1 < count);
        }
        Ok(ForkSessionResponse {
            session_id,
            last_seq,
        })
    }

    /// A fork's shared prefix made its own, as one atomic append of [`Record::Placed`]s,
    /// if it still reads it through the same base (false: nothing to do).
    fn prepare_materialize(
        &mut self,
        m: Materialize,
        batch: &mut Batch,
    ) -> Result<bool, StoreError> {
        self.sessions.load(&m.session_id)?;
        let Some(meta) = self.sessions.get(&m.session_id) else {
            return Ok(false);
        };
        if meta.is_deleted() || meta.base_session != m.base || meta.base_seq != m.base_seq {
            return Ok(false);
        }
        let expected = 1..=m.base_seq;
        if m.placed.len() as u64 != m.base_seq
            || m.placed.iter().zip(expected).any(|(p, seq)| p.seq != seq)
        {
            return Err(StoreError::Internal(format!(
                "the prefix of {} read through {} is not seqs 1 to {}",
                m.session_id, m.base, m.base_seq
            )));
        }
        let ids = self.recent_ids.entry(m.session_id.clone()).or_default();
        for event in &m.placed {
            if self_named_seq(&event.event_id) != Some(event.seq) {
                ids.insert(event.event_id.clone(), event.seq);
            }
        }
        self.update_session(&m.session_id, |meta| {
            meta.base_session.clear();
            meta.base_seq = 0;
        });
        let count = m.placed.len();
        batch.records.reserve(count);
        batch.continued.reserve(count);
        for (i, placed) in m.placed.into_iter().enumerate() {
            batch.push(Record::Placed(placed), i + 1 < count);
        }
        Ok(true)
    }

    /// An import's events into its staging session, as one atomic append: each must go on
    /// from the staging session's last seq, with an id of its own (a repeat is refused,
    /// naming both seqs). Their seqs, ids, times and contents are the export's.
    fn prepare_stage(
        &mut self,
        stage: Stage,
        batch: &mut Batch,
    ) -> Result<Option<Repeated>, StoreError> {
        let Stage { staging, events } = stage;
        self.sessions.load(&staging)?;
        let empty = SessionMeta::default();
        let meta = self.sessions.get(&staging).unwrap_or(&empty);
        rules::not_deleted(meta, &staging)?;
        let mut last_seq = meta.last_seq;
        let mut ids: HashMap<&str, u64> = HashMap::new();
        for event in &events {
            if event.seq != last_seq + 1 {
                return Err(StoreError::InvalidArgument(format!(
                    "seq {} where {} was next",
                    event.seq,
                    last_seq + 1
                )));
            }
            let earlier = match ids.get(event.event_id.as_str()) {
                Some(seq) => Some(*seq),
                None => self.staged_seq(&staging, &event.event_id, last_seq)?,
            };
            if let Some(seq) = earlier {
                return Ok(Some((event.seq, seq, event.event_id.clone())));
            }
            ids.insert(&event.event_id, event.seq);
            last_seq = event.seq;
        }
        let mut staged = events;
        for event in &mut staged {
            event.set_session_id(&staging);
        }
        let recent = self.recent_ids.entry(staging.clone()).or_default();
        for event in &staged {
            if self_named_seq(&event.event_id) != Some(event.seq) {
                recent.insert(event.event_id.clone(), event.seq);
            }
        }
        self.update_session(&staging, |meta| {
            for event in &staged {
                meta.apply_event(event);
            }
        });
        let count = staged.len();
        for (i, event) in staged.into_iter().enumerate() {
            batch.push(Record::Event(event), i + 1 < count);
        }
        Ok(None)
    }

    /// The seq of `event_id` among the staging session's events up to `last_seq`, if it
    /// is there.
    fn staged_seq(
        &mut self,
        staging: &str,
        event_id: &str,
        last_seq: u64,
    ) -> Result<Option<u64>, StoreError> {
        if let Some(seq) = self
            .recent_ids
            .get(staging)
            .and_then(|ids| ids.get(event_id))
        {
            return Ok(Some(*seq));
        }
        if let Some(seq) = self.index.event_seq(staging, event_id)? {
            return Ok(Some(seq));
        }
        let log = self.log.reader();
        let found = (&self.index, &*self.shared.recent, &*log);
        self_named(found, staging, event_id, last_seq)
    }

    /// An import made visible: the session's start record, a fork's, carrying its state
    /// (folded from the staged events, with the session line's times, `forked_from` and
    /// `pinned`: `rules::adopt_imported`) and naming the staging session as the base of
    /// all its seqs. The session must not exist (nor have been deleted) here.
    fn prepare_adopt(&mut self, adopt: Adopt, batch: &mut Batch) -> Result<(), StoreError> {
        let Adopt {
            session_id,
            staging,
            line,
        } = adopt;
        self.sessions.load(&session_id)?;
        if let Some(taken) = self.sessions.get(&session_id) {
            if taken.is_deleted() || taken.last_seq > 0 {
                return Err(rules::imported_taken(&session_id, taken.is_deleted()));
            }
        }
        self.sessions.load(&staging)?;
        let mut staged = rules::existing(self.sessions.get(&staging), &staging)?.clone();
        if staged.first_user_seq > 0 && staged.first_user_text.is_empty() {
            // Read from the index, which keeps no text: the title is read back from the log.
            let text = self.user_text(&staging, staged.first_user_seq)?;
            staged.set_first_user_text(staged.first_user_seq, &text);
        }
        let mut meta = rules::adopt_imported(&staged, &line)?;
        meta.base_session = staging.clone();
        meta.base_seq = meta.last_seq;
        let mut state = meta.clone();
        state.first_user_text.clear();
        let record = ForkRecord {
            session_id: session_id.clone(),
            parent: staging,
            seq: meta.last_seq,
            ts_unix_ms: meta.created_unix_ms,
            state: Some(state),
        };
        self.update_session(&session_id, |current| *current = meta);
        batch.push(Record::Fork(record), false);
        Ok(())
    }

    /// The text of the session's user message at `seq` (a durable one), read from the log.
    fn user_text(&mut self, session_id: &str, seq: u64) -> Result<String, StoreError> {
        let recent = self.shared.recent.positions(session_id, seq, 1);
        let position = match recent.first() {
            Some(&(s, pos)) if s == seq => Some(pos),
            _ => self
                .index
                .positions(session_id, seq, 1)?
                .first()
                .filter(|(s, _)| *s == seq)
                .map(|(_, pos)| *pos),
        };
        let record = match position {
            Some(pos) => Some(self.log.reader().read(pos)?),
            None => None,
        };
        let kind = match record {
            Some(Record::Event(event)) => event.into_event().kind,
            _ => None,
        };
        match kind {
            Some(agentlog_proto::v1::event::Kind::UserMessage(m)) => Ok(m.text),
            _ => Err(StoreError::Internal(format!(
                "{session_id}/{seq} is not the user message its state names"
            ))),
        }
    }

    /// PinSession: a pin record, if the session's `pinned` changes.
    fn prepare_pin(
        &mut self,
        session_id: &str,
        pinned: bool,
        batch: &mut Batch,
    ) -> Result<SessionMeta, StoreError> {
        self.sessions.load(session_id)?;
        let current = self.sessions.get(session_id);
        let Some(changed) = rules::pin(current, session_id, pinned)? else {
            return Ok(current.cloned().unwrap_or_default());
        };
        self.update_session(session_id, |meta| meta.pinned = changed.pinned);
        batch.push(
            Record::Pin(PinRecord {
                session_id: session_id.to_string(),
                pinned,
            }),
            false,
        );
        Ok(self.sessions.get(session_id).cloned().unwrap_or(changed))
    }

    /// Changes one session's state (loaded first), keeping the runnable order in step.
    fn update_session<T>(&mut self, session_id: &str, f: impl FnOnce(&mut SessionMeta) -> T) -> T {
        let runnable = &mut self.runnable;
        // A staging session is never claimed (see `import`).
        let claimable = !is_staging(session_id);
        self.sessions.update(session_id, |meta| {
            let before = (claimable && meta.is_runnable(), meta.updated_unix_ms);
            let out = f(meta);
            let after = (claimable && meta.is_runnable(), meta.updated_unix_ms);
            if before != after {
                if before.0 {
                    runnable.remove(&(before.1, session_id.to_string()));
                }
                if after.0 {
                    runnable.insert((after.1, session_id.to_string()));
                }
            }
            out
        })
    }
}

struct Batch {
    records: Vec<Record>,
    /// Per record: whether the next record belongs to the same atomic append.
    continued: Vec<bool>,
}

impl Batch {
    fn with_capacity(records: usize) -> Batch {
        Batch {
            records: Vec::with_capacity(records),
            continued: Vec::with_capacity(records),
        }
    }

    fn push(&mut self, record: Record, continued: bool) {
        self.records.push(record);
        self.continued.push(continued);
    }
}

impl Op {
    /// The most bytes of log this operation can write (it is given its seqs, ids and
    /// timestamps only later, so this bounds what they add).
    fn max_log_bytes(&self) -> u64 {
        // Frame and kind byte; session id, seq, event id (a generated one is at most 58),
        // timestamp and schema version with their tags and lengths.
        const PER_EVENT: usize = record::HEADER_LEN + 1 + 3 + 11 + 3 + 58 + 11 + 6;
        match self {
            Op::Append(op, _, _) => op
                .events
                .iter()
                .map(|e| e.encoded_len() + op.session_id.len() + PER_EVENT)
                .sum::<usize>() as u64,
            // Session id and owner (each at most 128 bytes, with tags and lengths), epoch,
            // expiry and the released flag.
            Op::Lease(..) => (record::HEADER_LEN + 1 + 2 * 131 + 11 + 11 + 2) as u64,
            // The fork's start (as a lease record bounds it, and its state), then its
            // events, which have their ids already but may still get a generated one.
            Op::Fork(plan, _) => {
                let id = plan.record.session_id.len() + 3;
                let state = plan.at_fork.encoded_len() + 2 * 131 + 2 * 11;
                let fresh: usize = plan
                    .fresh
                    .iter()
                    .map(|e| e.encoded_len() + id + PER_EVENT)
                    .sum();
                (record::HEADER_LEN + 1 + 2 * 131 + 11 + 11 + state + fresh) as u64
            }
            Op::Materialize(m, _) => {
                let id = m.session_id.len() + 3;
                m.placed
                    .iter()
                    .map(|c| record::HEADER_LEN + 1 + c.message.len() + id)
                    .sum::<usize>() as u64
            }
            Op::Stage(stage, _) => stage
                .events
                .iter()
                .map(|e| e.encoded_len() + stage.staging.len() + PER_EVENT)
                .sum::<usize>() as u64,
            // The session's start, as a fork's (its state with a title of up to 80
            // characters, its forked_from and base).
            Op::Adopt(adopt, _) => {
                let ids = adopt.session_id.len() + adopt.staging.len() + 6;
                (record::HEADER_LEN + 1 + 2 * 131 + 11 + 11 + 4 * 131 + 320 + 128 + ids) as u64
            }
            Op::Pin(..) => (record::HEADER_LEN + 1 + 131 + 2) as u64,
            // A deletion may take the staging session of an imported one with it.
            Op::Delete(DeleteOp::Session(_) | DeleteOp::Imported { .. }, _) => 2 * TOMBSTONE_BYTES,
            Op::Delete(DeleteOp::Idle { max, .. }, _) => 2 * TOMBSTONE_BYTES * *max as u64,
            Op::Delete(DeleteOp::IfExpired { .. }, _) => 2 * TOMBSTONE_BYTES,
            Op::Expiring { .. } => 0,
            Op::Seal(_) | Op::Room(_) => 0,
        }
    }

    /// Answers the op with `error`, having done nothing.
    fn refuse(self, error: StoreError) {
        match self {
            Op::Append(_, reply, _) => {
                let _ = reply.send(Err(error));
            }
            Op::Lease(_, reply) => {
                let _ = reply.send(Err(error));
            }
            Op::Delete(_, reply) => {
                let _ = reply.send(Err(error));
            }
            Op::Seal(reply) => {
                let _ = reply.send(Err(error));
            }
            Op::Room(reply) => {
                let _ = reply.send(Err(error));
            }
            Op::Fork(_, reply) => {
                let _ = reply.send(Err(error));
            }
            Op::Materialize(_, reply) => {
                let _ = reply.send(Err(error));
            }
            Op::Stage(_, reply) => {
                let _ = reply.send(Err(error));
            }
            Op::Adopt(_, reply) => {
                let _ = reply.send(Err(error));
            }
            Op::Pin(_, _, reply) => {
                let _ = reply.send(Err(error));
            }
            Op::Expiring { reply, .. } => {
                let _ = reply.send(Err(error));
            }
        }
    }
}

/// Gives each new event without an id one that names its own seq (so it needs no index
/// entry, see `index`; the random part keeps it from meeting an id a client chose), and
/// puts every other id into `ids`, so that a repeat later in the batch finds it.
fn name_fresh(fresh: &mut [KeptEvent], ids: &mut HashMap<String, u64>) {
    for event in fresh {
        if event.event_id.is_empty() {
            let id = generated_id(event.seq);
            event.set_event_id(id);
        } else {
            ids.insert(event.event_id.clone(), event.seq);
        }
    }
}

/// Pinned sessions one retention step passes over, at most, in each status's listing (a
/// store with more pinned sessions idle past the span than this finds the ones after them
/// only as the pinned ones move on).
const PINNED_PASSED: usize = 100_000;

/// The most bytes of log one tombstone takes: frame and kind byte, the session id (at most
/// 128 bytes, with tag and length) and the time.
const TOMBSTONE_BYTES: u64 = (record::HEADER_LEN + 1 + 131 + 11) as u64;

impl Pending {
    fn send(self) {
        match self {
            Pending::Append(reply, resp) => {
                let _ = reply.send(Ok(resp));
            }
            Pending::Lease(reply, outcome) => {
                let _ = reply.send(Ok(outcome));
            }
            Pending::Delete(reply, deleted) => {
                let _ = reply.send(Ok(deleted));
            }
            Pending::Fork(reply, answer) => {
                let _ = reply.send(Ok(answer));
            }
            Pending::Materialize(reply, wrote) => {
                let _ = reply.send(Ok(wrote));
            }
            Pending::Done(reply) => {
                let _ = reply.send(Ok(()));
            }
            Pending::Staged(reply) => {
                let _ = reply.send(Ok(None));
            }
            Pending::Pinned(reply, meta) => {
                let _ = reply.send(Ok(*meta));
            }
        }
    }
}

/// Dedup of an id of the form `auto-<seq>-…` (see [`self_named_seq`]) that the index does
/// not hold: the seq of the durable event at that seq, if it carries this very id. (An event
/// of the batch in hand cannot be meant: its id was never told to anyone.)
fn self_named(
    (index, recent, log): (&Index, &Recent, &LogReader),
    session_id: &str,
    event_id: &str,
    last_seq: u64,
) -> Result<Option<u64>, StoreError> {
    let Some(seq) = self_named_seq(event_id).filter(|s| (1..=last_seq).contains(s)) else {
        return Ok(None);
    };
    let in_recent = recent.positions(session_id, seq, 1);
    let found = match in_recent.first() {
        Some(&(s, pos)) if s == seq => Some(pos),
        _ => index
            .positions(session_id, seq, 1)?
            .first()
            .filter(|(s, _)| *s == seq)
            .map(|(_, pos)| *pos),
    };
    let Some(pos) = found else {
        return Ok(None);
    };
    Ok(match log.read(pos)? {
        Record::Event(event) if event.event_id == event_id => Some(seq),
        Record::Placed(placed) if placed.event_id == event_id => Some(seq),
        _ => None,
    })
}

/// Counts a write refused for a stale lease epoch (`op`: append or renew).
fn fenced(error: &StoreError, op: &'static str) {
    if error.reason() == Some(Reason::LeaseFenced) {
        metrics::fencing_refused(op);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio::sync::{mpsc, oneshot};

    use super::{drain, looks_again_on, Op};

    /// The race a stopping writer meets: a caller holds its place in the queue (between the
    /// two steps of `send`) when the writer stops, and puts its op in afterwards.
    #[test]
    fn an_op_on_its_way_when_the_writer_stops_is_answered() {
        let (queue, rx) = mpsc::channel(4);
        let runtime = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        let place = runtime.block_on(queue.reserve()).expect("a place");
        let stopped = std::thread::spawn(move || drain(rx));
        // The drain has closed the queue and waits (if it has not yet, the op is merely
        // queued before the close: answered all the same).
        std::thread::sleep(Duration::from_millis(20));
        let (reply, mut answer) = oneshot::channel();
        place.send(Op::Room(reply));
        stopped
            .join()
            .expect("the drain ends once no place is held");
        assert_eq!(
            answer.try_recv(),
            Err(oneshot::error::TryRecvError::Closed),
            "the op's reply is dropped (UNAVAILABLE to its caller), not left waiting"
        );
        let (reply, _answer) = oneshot::channel();
        assert!(
            queue.try_send(Op::Room(reply)).is_err(),
            "a stopped writer's queue takes nothing more"
        );
    }

    #[test]
    fn waiting_threads_look_again_only_with_a_core_to_spare() {
        assert!(!looks_again_on(1));
        assert!(looks_again_on(2));
        assert!(looks_again_on(64));
    }
}
