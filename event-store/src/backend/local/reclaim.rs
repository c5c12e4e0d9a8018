//! Reclamation: a deleted session's bytes leave the disk, online.
//!
//! Once a tombstone is durable the session's records are dead: the reclaimer (a thread of
//! its own) counts the bytes they take per segment (from the index's positions of the
//! session's events) and runs a pass when a segment's dead bytes pass
//! [`ReclaimConfig::dead_bytes`], or at the latest [`ReclaimConfig::after`] a deletion.
//! Before anything of a deleted session leaves the log, every live fork that reads its
//! prefix through it (its state's base, see `crate::session::SessionMeta::base_session`) gets
//! that prefix **materialized** (`Reclaimer::materialize_forks`): read through the
//! deleted session, written as the fork's own ([`super::log::Record::Placed`], one atomic
//! append whose last record drops the fork's base), and made durable; only then does the
//! reclamation go on. This runs at the first look after the deletion (again after a
//! restart, where it finds nothing left to do, and at every look until it succeeds: a
//! session whose forks could not be materialized, on a full volume, keeps its records
//! meanwhile), not only when a pass is due, so that by the time a session's records or
//! index entries go, no fork reads through it. A fork of a deleted fork reads through
//! both: the deleted fork awaits erasure too, and its own forks are materialized in the
//! same look, while everything they read is still there.
//!
//! A pass:
//! 1. seals the active segment if it holds dead records (the writer rolls to a new one);
//! 2. rewrites every sealed segment that holds dead records without them, most dead first
//!    ([`SegmentRewriter::rewrite`]: written beside it, fsync'd, renamed over it); appends
//!    go on into the active segment, and readers read on, a reader in the middle of an old
//!    file on that file;
//! 3. once the index has absorbed the sessions' tombstones, removes their entries from it
//!    (positions and event ids, [`Index::purge_entries`]) and then the mark that they await
//!    erasure ([`Index::erased`]).
//!
//! A record is dropped only if its session's tombstone is durable (the writer hands the
//! session over only after the tombstone's fsync), and tombstones are never dropped, so
//! a deleted session stays deleted whatever survives. A crash (`kill -9`, power loss) at
//! any point leaves:
//! - [`CrashPoint::MaterializeWritten`]: a fork's materialization written, not synced: a
//!   torn append, dropped at open; the fork still reads through its base, which is whole;
//! - [`CrashPoint::Materialized`]: the materialization durable (perhaps not in the index:
//!   recovery replays it, and the fork reads its own records); nothing of the base gone;
//! - [`CrashPoint::RewriteWritten`], [`CrashPoint::RewriteSynced`]: a rewrite file beside
//!   the whole old segment; it is removed at open, and the old segment is read as before;
//! - between the rename and the directory's fsync: the old segment or the new one, each
//!   whole, each holding every record of every live session at the same offsets;
//! - [`CrashPoint::Installed`]: segments without the dead records, and an index that still
//!   lists the sessions as awaiting erasure: the next pass (after the restart: the sessions
//!   are read back from the index) rewrites what is left, and a segment with nothing left
//!   to drop is not written again; recovery replays a log where a deleted session's seqs
//!   jump (see `recovery`);
//! - [`CrashPoint::Purged`]: the index without the sessions' entries but still marking
//!   them: the next pass finds nothing to rewrite and removes the marks.
//!
//! `event-store/tests/reclaim.rs` and `event-store/tests/fork_shared.rs` cut the power at
//! each of these points and after steps of a pass, and
//! `integration-tests/tests/store_reclaim.rs` kills the real binary while it rewrites.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, Instant};

use super::snapshots::SnapshotDir;

use tokio::sync::mpsc;

use super::background::ask;
use super::import::StagingNames;
use super::index::Index;
use super::log::record::{event_for_state, CopiedEvent};
use super::log::storage::CrashPoint;
use super::log::{LogError, LogReader, SegmentRewriter};
use super::published::{Erasing, Shared};
use super::signal::Signal;
use super::subscriptions::{read_up_to, Source};
use super::writer::{DeleteOp, Materialize, Op};
use crate::error::StoreError;
use crate::metrics;

/// When reclamation runs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ReclaimConfig {
    /// A deletion's records are reclaimed at the latest about this long after it.
    pub after: Duration,
    /// A pass starts as soon as one segment holds this many bytes of deleted sessions.
    pub dead_bytes: u64,
    /// How often the reclaimer looks (besides when a deletion wakes it).
    pub check_every: Duration,
    /// The share of one core a rewrite takes at most (it rests between its pieces of
    /// work), so that appends keep the machine; 1: no rest. On a full volume, where no
    /// append waits, it never rests.
    pub busy_share: f64,
}

impl ReclaimConfig {
    /// The defaults for segments of `segment_bytes`: a pass within 30 s of a deletion, or
    /// as soon as a quarter of a segment is dead.
    pub fn for_segments(segment_bytes: u64) -> ReclaimConfig {
        ReclaimConfig {
            after: Duration::from_secs(30),
            dead_bytes: (segment_bytes / 4).max(1),
            check_every: Duration::from_secs(1),
            busy_share: 0.25,
        }
    }
}

/// The reserve the log's volume keeps for deletions and their reclamation
/// ([`super::log::storage::Storage::keep_reserve`]): room to rewrite one segment (its kept
/// records are at most the segment), and a MiB for the tombstones and the index.
pub fn reserve_bytes(segment_bytes: u64) -> u64 {
    segment_bytes.saturating_add(1 << 20)
}

pub(crate) struct Reclaimer {
    pub rewriter: SegmentRewriter,
    pub reader: Arc<LogReader>,
    pub index: Index,
    pub shared: Arc<Shared>,
    pub queue: mpsc::Sender<Op>,
    pub config: ReclaimConfig,
    /// A deleted session's snapshots go before it stops awaiting erasure (its deletion
    /// removed them already, unless the store stopped in between).
    snapshots: Arc<SnapshotDir>,
    /// Dead bytes per segment of each session awaiting erasure, counted once.
    dead: HashMap<String, Vec<(u64, u64)>>,
    /// Sessions awaiting erasure whose forks are all their own now: no fork is made of a
    /// deleted session, so none reads through them again.
    materialized: HashSet<String>,
    /// Tells a rewrite to stop when the store does.
    signal: Signal,
    /// This run's imports' staging sessions: those of earlier runs that no session reads
    /// through are imports a crash cut short (see `import`).
    staging_names: Arc<StagingNames>,
}

impl Reclaimer {
    pub fn new(
        rewriter: SegmentRewriter,
        reader: Arc<LogReader>,
        index: Index,
        shared: Arc<Shared>,
        queue: mpsc::Sender<Op>,
        config: ReclaimConfig,
        snapshots: Arc<SnapshotDir>,
    ) -> Reclaimer {
        Reclaimer {
            rewriter,
            reader,
            index,
            signal: shared.reclaimer.clone(),
            shared,
            queue,
            config,
            snapshots,
            dead: HashMap::new(),
            materialized: HashSet::new(),
            staging_names: Arc::new(StagingNames::new()),
        }
    }

    /// The names of this run's imports (the others' unfinished ones are removed at start).
    pub fn with_staging_names(mut self, names: Arc<StagingNames>) -> Reclaimer {
        self.staging_names = names;
        self
    }

    /// Looks for work every `check_every` (and when a deletion wakes it) until the store
    /// stops. A failed pass is retried at the next look.
    pub fn run(mut self) {
        let signal = self.signal.clone();
        if let Err(Failed::WriterGone) = self.drop_unfinished_imports() {
            return;
        }
        while !signal.wait(self.config.check_every) {
            if let Err(Failed::WriterGone) = self.restore_reserve() {
                return;
            }
            match self.step() {
                Ok(()) => {}
                Err(Failed::WriterGone) => return,
                Err(Failed::Store(e)) => {
                    tracing::warn!(error = %e, "a reclamation pass stopped; it is tried again");
                }
            }
        }
    }

    /// Deletes the staging sessions of imports an earlier run of the store left unfinished
    /// (see `import`): their records then leave the log as a deleted session's do.
    fn drop_unfinished_imports(&self) -> Result<(), Failed> {
        let unfinished = match self.index.unfinished_stagings() {
            Ok(unfinished) => unfinished,
            Err(e) => {
                tracing::warn!(error = %e, "looking for unfinished imports failed");
                return Ok(());
            }
        };
        for staging in unfinished {
            if self.staging_names.is_this_runs(&staging) {
                continue;
            }
            let op = DeleteOp::Session(staging.clone());
            match ask(&self.queue, |tx| Op::Delete(op, tx)).ok_or(Failed::WriterGone)? {
                Ok(_) => tracing::info!(
                    staging,
                    "removing the events of an import that did not finish (the store stopped \
                     in the middle of it)"
                ),
                Err(e) => tracing::warn!(staging, error = %e, "an unfinished import stays"),
            }
        }
        Ok(())
    }

    /// Puts the volume's reserve back once there is room for it (it was released for a
    /// deletion or a rewrite on a full volume), and then tells the writer, so that appends
    /// resume without waiting for one to find out.
    fn restore_reserve(&self) -> Result<(), Failed> {
        let storage = self.rewriter.storage();
        let full = self.shared.full.borrow().is_some();
        match storage.restore_reserve() {
            Ok(true) if full => {
                // Refused while the volume is still short of its headroom: the writer says so.
                let _ = ask(&self.queue, Op::Room).ok_or(Failed::WriterGone)?;
            }
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "putting the volume's reserve back failed"),
        }
        Ok(())
    }

    /// Counts the dead bytes, rewrites the segments that hold them if a pass is due, and
    /// makes the index forget the sessions whose records are gone.
    fn step(&mut self) -> Result<(), Failed> {
        let erasing: Vec<(String, Erasing)> = {
            let erasing = self
                .shared
                .erasing
                .lock()
                .unwrap_or_else(|p| p.into_inner());
            erasing.iter().map(|(id, e)| (id.clone(), *e)).collect()
        };
        if erasing.is_empty() {
            self.dead.clear();
            self.materialized.clear();
            metrics::reclaim_dead_bytes(0);
            return Ok(());
        }
        // A session whose forks could not be made whole yet (a full volume) waits, and the
        // others go on.
        let mut erasing = erasing;
        let mut waiting = Vec::new();
        let unseen: Vec<String> = erasing
            .iter()
            .map(|(id, _)| id)
            .filter(|id| !self.materialized.contains(*id))
            .cloned()
            .collect();
        // Forks the index has not absorbed yet, by base, looked for once per look.
        let mut unabsorbed: HashMap<String, Vec<String>> = HashMap::new();
        if !unseen.is_empty() {
            let looked_for: HashSet<&str> = unseen.iter().map(String::as_str).collect();
            let published = self
                .shared
                .sessions
                .read()
                .unwrap_or_else(|p| p.into_inner());
            for (id, meta) in published.iter() {
                if looked_for.contains(meta.base_session.as_str()) {
                    unabsorbed
                        .entry(meta.base_session.clone())
                        .or_default()
                        .push(id.clone());
                }
            }
        }
        for session_id in &unseen {
            let also = unabsorbed.remove(session_id).unwrap_or_default();
            match self.materialize_forks(session_id, also) {
                Ok(()) => {
                    self.materialized.insert(session_id.clone());
                }
                Err(Failed::Store(e)) => {
                    tracing::warn!(
                        session_id,
                        error = %e,
                        "a deleted session's forks are not their own yet; its records stay"
                    );
                    waiting.push(session_id.clone());
                }
                Err(gone) => return Err(gone),
            }
        }
        erasing.retain(|(id, _)| !waiting.contains(id));
        if erasing.is_empty() {
            return Ok(());
        }
        let mut by_segment: BTreeMap<u64, u64> = BTreeMap::new();
        for (session_id, _) in &erasing {
            for (base, bytes) in self.dead_of(session_id)? {
                *by_segment.entry(base).or_default() += bytes;
            }
        }
        metrics::reclaim_dead_bytes(by_segment.values().sum());
        let oldest = erasing.iter().map(|(_, e)| e.since).min();
        let due = oldest.is_some_and(|since| since.elapsed() >= self.config.after)
            || by_segment.values().any(|b| *b >= self.config.dead_bytes);
        if due && !by_segment.is_empty() {
            self.rewrite(&erasing, &by_segment)?;
            // Their records are gone from the log: only the index is left to forget them.
            for (session_id, _) in &erasing {
                self.dead.insert(session_id.clone(), Vec::new());
            }
            metrics::reclaim_dead_bytes(0);
        }
        self.forget(&erasing)
    }

    /// Makes the prefix of every live fork that reads it through the deleted `session_id`
    /// its own (see the module head); durable on return.
    /// `unabsorbed`: forks of it that the index may not hold yet.
    fn materialize_forks(
        &mut self,
        session_id: &str,
        unabsorbed: Vec<String>,
    ) -> Result<(), Failed> {
        let mut forks: Vec<String> = self.index.children(session_id).map_err(StoreError::from)?;
        forks.extend(unabsorbed);
        forks.sort_unstable();
        forks.dedup();
        for fork in forks {
            let Some(meta) = self.shared.get(&fork)? else {
                continue;
            };
            if meta.is_deleted() || meta.base_session != session_id {
                continue;
            }
            let placed = self.shared_prefix(&fork, meta.base_seq)?;
            let materialize = Materialize {
                session_id: fork.clone(),
                base: session_id.to_string(),
                base_seq: meta.base_seq,
                placed,
            };
            let wrote = ask(&self.queue, |tx| Op::Materialize(Box::new(materialize), tx))
                .ok_or(Failed::WriterGone)??;
            if wrote {
                tracing::info!(
                    fork,
                    base = session_id,
                    seqs = meta.base_seq,
                    "a fork's shared prefix is its own now: its base was deleted"
                );
                self.rewriter
                    .storage()
                    .crash_point(CrashPoint::Materialized)
                    .map_err(LogError::from)?;
            }
        }
        Ok(())
    }

    /// The fork's seqs 1 to `up_to`, read through its base as they are stored, each given
    /// the fork's session id.
    fn shared_prefix(&self, fork: &str, up_to: u64) -> Result<Vec<CopiedEvent>, Failed> {
        let source = Source {
            shared: self.shared.clone(),
            index: self.index.clone(),
            log: self.reader.clone(),
        };
        let id: Arc<str> = fork.into();
        let mut placed = Vec::with_capacity(up_to as usize);
        let mut next = 1;
        while next <= up_to {
            let (pieces, after, _) = read_up_to(&source, fork, next, up_to)?;
            if after == next {
                return Err(StoreError::Internal(format!(
                    "{fork}'s shared prefix ends at seq {next}, before {up_to}"
                ))
                .into());
            }
            for piece in pieces {
                for message in piece.messages() {
                    let message = message?;
                    let event = event_for_state(&message, false).map_err(|e| {
                        StoreError::Internal(format!("a stored event of {fork}: {e}"))
                    })?;
                    placed.push(CopiedEvent {
                        session_id: id.clone(),
                        seq: event.seq,
                        event_id: event.event_id,
                        message,
                    });
                }
            }
            next = after;
        }
        Ok(placed)
    }

    /// Where a deleted session's events are (segment, bytes), from the index's positions,
    /// those it has not absorbed yet, and the records recovery could not index.
    fn dead_of(&mut self, session_id: &str) -> Result<Vec<(u64, u64)>, Failed> {
        if let Some(dead) = self.dead.get(session_id) {
            return Ok(dead.clone());
        }
        // The positions the index has not absorbed are read first: an absorb between the
        // two reads then moves them into the index before it is read, and none is missed
        // (read the other way round, an absorb in between hid them from both). Each is
        // counted once, by offset, whichever holds it: both may (an absorb in between), and
        // either may hold the lower seqs (a fork's prefix made its own is written after its
        // newer events, and may be recent while they are indexed).
        let recent = self.shared.recent.positions(session_id, 1, usize::MAX);
        let indexed = self
            .index
            .positions(session_id, 1, usize::MAX)
            .map_err(StoreError::from)?;
        let unindexed = self
            .index
            .dead_positions(session_id)
            .map_err(StoreError::from)?;
        let records: HashMap<u64, u32> = recent
            .into_iter()
            .chain(indexed)
            .map(|(_, p)| p)
            .chain(unindexed)
            .map(|p| (p.offset, p.len))
            .collect();
        let mut by_segment: BTreeMap<u64, u64> = BTreeMap::new();
        for (offset, len) in records {
            if let Some(base) = self.reader.segment_of(offset) {
                *by_segment.entry(base).or_default() += u64::from(len);
            }
        }
        let dead: Vec<(u64, u64)> = by_segment.into_iter().collect();
        self.dead.insert(session_id.to_string(), dead.clone());
        Ok(dead)
    }

    /// A pass: rewrites every segment of `by_segment` without the records of `erasing`'s
    /// sessions (sealing the active segment first if it is one of them).
    fn rewrite(
        &mut self,
        erasing: &[(String, Erasing)],
        by_segment: &BTreeMap<u64, u64>,
    ) -> Result<(), Failed> {
        let started = Instant::now();
        let dead: HashSet<&str> = erasing.iter().map(|(id, _)| id.as_str()).collect();
        if by_segment
            .keys()
            .any(|base| *base >= self.reader.active_base())
        {
            ask(&self.queue, Op::Seal).ok_or(Failed::WriterGone)??;
        }
        let active = self.reader.active_base();
        // The segments with the fewest live bytes first: on a full volume their rewrites
        // need the least room and free the most.
        let mut order: Vec<(u64, u64)> = Vec::new();
        for (base, dead) in by_segment.range(..active) {
            let live = self.reader.file_bytes(*base)?.saturating_sub(*dead);
            order.push((*base, live));
        }
        order.sort_unstable_by_key(|(base, live)| (*live, *base));
        let mut reclaimed = 0u64;
        let storage = self.rewriter.storage().clone();
        let mut pace = Pace {
            share: self.config.busy_share,
            busy_since: Instant::now(),
            signal: &self.signal,
            shared: &self.shared,
        };
        let mut pause = || pace.rest();
        for (base, _) in order {
            let is_dead =
                |session: &[u8]| std::str::from_utf8(session).is_ok_and(|s| dead.contains(s));
            let mut rewritten = self.rewriter.rewrite(base, is_dead, &mut pause);
            // A full volume: the reserve is there for this.
            if matches!(rewritten, Err(LogError::NoSpace(_)))
                && storage.release_reserve().map_err(LogError::from)? > 0
            {
                rewritten = self.rewriter.rewrite(base, is_dead, &mut pause);
            }
            if let Some(r) = rewritten? {
                reclaimed += r.file_bytes_before.saturating_sub(r.file_bytes_after);
                tracing::debug!(
                    segment = base,
                    dropped_records = r.dropped_records,
                    dropped_bytes = r.dropped_bytes,
                    "rewrote a segment without deleted sessions' records"
                );
            }
        }
        storage
            .crash_point(CrashPoint::Installed)
            .map_err(LogError::from)?;
        self.restore_reserve()?;
        let seconds = started.elapsed().as_secs_f64();
        metrics::reclaimed(reclaimed, seconds);
        tracing::info!(
            sessions = erasing.len(),
            reclaimed_bytes = reclaimed,
            seconds,
            "reclaimed deleted sessions' space"
        );
        Ok(())
    }

    /// Makes the index forget the sessions whose records are gone from the log and whose
    /// tombstones it holds (nothing of them is written to it again); the others wait.
    fn forget(&mut self, erasing: &[(String, Erasing)]) -> Result<(), Failed> {
        let absorbed = self.shared.absorbed();
        let done: Vec<&str> = erasing
            .iter()
            .filter(|(id, e)| {
                e.tombstone_end <= absorbed && self.dead.get(id).is_some_and(Vec::is_empty)
            })
            .map(|(id, _)| id.as_str())
            .collect();
        if done.is_empty() {
            return Ok(());
        }
        for session_id in &done {
            self.index
                .purge_entries(session_id)
                .map_err(StoreError::from)?;
        }
        self.snapshots
            .remove_sessions(done.iter().copied())
            .map_err(LogError::from)?;
        let storage = self.rewriter.storage().clone();
        storage
            .crash_point(CrashPoint::Purged)
            .map_err(LogError::from)?;
        for session_id in &done {
            self.index.erased(session_id).map_err(StoreError::from)?;
            self.dead.remove(*session_id);
            self.materialized.remove(*session_id);
        }
        let mut erasing = self
            .shared
            .erasing
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        for session_id in &done {
            erasing.remove(*session_id);
        }
        Ok(())
    }
}

/// Keeps a rewrite's share of a core at about `share`: after each piece of work it rests
/// long enough that work / (work + rest) is `share`; while the volume is full (no append
/// to leave room for) it does not rest. Stops the rewrite when the store stops.
struct Pace<'a> {
    share: f64,
    busy_since: Instant,
    signal: &'a Signal,
    shared: &'a Shared,
}

impl Pace<'_> {
    fn rest(&mut self) -> std::io::Result<()> {
        let full = self.shared.full.borrow().is_some();
        if self.share < 1.0 && self.share > 0.0 && !full {
            let rest = self
                .busy_since
                .elapsed()
                .mul_f64((1.0 - self.share) / self.share);
            self.signal.rest(rest.min(Duration::from_secs(1)));
        }
        if self.signal.is_stopped() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::Interrupted,
                "the store is stopping",
            ));
        }
        self.busy_since = Instant::now();
        Ok(())
    }
}

enum Failed {
    /// The store is closing.
    WriterGone,
    Store(StoreError),
}

impl From<StoreError> for Failed {
    fn from(e: StoreError) -> Failed {
        Failed::Store(e)
    }
}

impl From<LogError> for Failed {
    fn from(e: LogError) -> Failed {
        Failed::Store(e.into())
    }
}
