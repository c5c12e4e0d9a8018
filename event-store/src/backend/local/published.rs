//! What the writer has made durable, as readers see it: the session states and positions
//! the index has not absorbed yet (tombstones included; the rest is read from the index),
//! the live hub, and the signals (a session may have become claimable; the volume is full).
//! The writer is its only writer, and only after the fsync that covers what it publishes;
//! it forgets what it published only once the index holds it.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Instant;

use agentlog_proto::kept::KeptEvent;
use tokio::sync::watch;

use crate::backend::local::index::{Index, Recent};
use crate::backend::local::live::Hub;
use crate::backend::local::log::Record;
use crate::backend::local::signal::Signal;
use crate::error::StoreError;
use crate::rules;
use crate::session::SessionMeta;

/// What the writer has made durable, as readers see it.
pub struct Shared {
    /// The states of the sessions changed since the index's last absorb.
    pub(crate) sessions: RwLock<HashMap<String, SessionMeta>>,
    /// Where every other session's state is read.
    pub(crate) index: Index,
    pub(crate) hub: Arc<Hub>,
    /// Where the durable records the index has not absorbed yet are.
    pub(crate) recent: Arc<Recent>,
    /// Bumped whenever a session may have become claimable.
    pub(crate) claimable: watch::Sender<u64>,
    /// Why appends are refused, while the log's volume is full.
    pub(crate) full: watch::Sender<Option<String>>,
    /// Whether appends can be acknowledged now (false while the volume is full): what
    /// health reports for `agentlog.v1.EventStore`.
    pub(crate) serving: watch::Sender<bool>,
    /// Deleted sessions whose records may still be in the log: the reclaimer's work
    /// (`reclaim`), filled by the writer as tombstones become durable (and at open).
    pub(crate) erasing: Mutex<BTreeMap<String, Erasing>>,
    /// Woken when a tombstone becomes durable.
    pub(crate) reclaimer: Signal,
    /// The log offset the index has absorbed up to.
    pub(crate) absorbed: AtomicU64,
    /// Where the durable log ends: what the search index may read up to.
    pub(crate) durable: AtomicU64,
    /// Woken when more of the log is durable: the search index's indexer.
    pub(crate) indexer: Signal,
}

/// A deleted session awaiting the erasure of its records.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Erasing {
    /// Where its tombstone ends in the log: once the index has absorbed this far, nothing
    /// of the session is written to it again.
    pub tombstone_end: u64,
    /// Since when it waits (at open, for one deleted before).
    pub since: Instant,
}

impl Shared {
    /// Called by the writer after the fsync of a batch, with the batch's records.
    pub(crate) fn publish(
        &self,
        records: Vec<Record>,
        sessions: &HashMap<String, SessionMeta>,
        now: i64,
    ) {
        let mut newly_claimable = false;
        {
            let touched: HashSet<&str> = records.iter().map(Record::session_id).collect();
            let mut shared = self.sessions.write().unwrap_or_else(|p| p.into_inner());
            for id in touched {
                if let Some(meta) = sessions.get(id) {
                    newly_claimable |= rules::claimable(meta, now);
                    match shared.get_mut(id) {
                        Some(published) => published.clone_from(meta),
                        None => {
                            shared.insert(id.to_string(), meta.clone());
                        }
                    }
                }
            }
        }
        // Each run of one session's events goes to its followers as one slice, in order; a
        // tombstone ends its session's followers (after the state above says it is deleted,
        // so that a subscription that registers later sees the tombstone instead).
        let mut run: Vec<KeptEvent> = Vec::new();
        for record in records {
            let event = match record {
                Record::Event(event) => event,
                Record::Tombstone(t) => {
                    if run.last().is_some_and(|e| e.session_id == t.session_id) {
                        self.hub.publish(std::mem::take(&mut run));
                    }
                    self.hub.end(&t.session_id);
                    continue;
                }
                // A fork's shared prefix made its own: its followers had it already.
                _ => continue,
            };
            if run.last().is_some_and(|e| e.session_id != event.session_id) {
                self.hub.publish(std::mem::take(&mut run));
            }
            run.push(event);
        }
        if !run.is_empty() {
            self.hub.publish(run);
        }
        if newly_claimable {
            self.claimable.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// Tombstones made durable (session, where its tombstone ends in the log): the
    /// sessions' records await reclamation.
    pub(crate) fn erase(&self, tombstones: impl IntoIterator<Item = (String, u64)>) {
        let now = Instant::now();
        let mut erasing = self.erasing.lock().unwrap_or_else(|p| p.into_inner());
        let before = erasing.len();
        for (session_id, tombstone_end) in tombstones {
            erasing.entry(session_id).or_insert(Erasing {
                tombstone_end,
                since: now,
            });
        }
        if erasing.len() > before {
            self.reclaimer.nudge();
        }
    }

    /// The log is durable up to `end`.
    pub(crate) fn made_durable(&self, end: u64) {
        self.durable.store(end, Ordering::Release);
        self.indexer.nudge();
    }

    pub(crate) fn durable(&self) -> u64 {
        self.durable.load(Ordering::Acquire)
    }

    /// The index has absorbed the log up to `end`.
    pub(crate) fn absorbed_to(&self, end: u64) {
        self.absorbed.store(end, Ordering::Release);
    }

    pub(crate) fn absorbed(&self) -> u64 {
        self.absorbed.load(Ordering::Acquire)
    }

    /// The log's volume is full (`Some(why)`) or has room again (`None`).
    pub(crate) fn set_full(&self, reason: Option<String>) {
        self.serving.send_replace(reason.is_none());
        self.full.send_replace(reason);
    }

    /// The index has absorbed everything published: its states are read from there now.
    pub(crate) fn absorbed_sessions(&self) {
        let mut sessions = self.sessions.write().unwrap_or_else(|p| p.into_inner());
        sessions.clear();
        // A burst of sessions leaves no large table behind.
        sessions.shrink_to(1024);
    }

    /// The session's published state (a tombstone if it was deleted), if it has one. The
    /// text of its first user message may be left out (see [`Index::session`]).
    pub(crate) fn get(&self, session_id: &str) -> Result<Option<SessionMeta>, StoreError> {
        {
            let sessions = self.sessions.read().unwrap_or_else(|p| p.into_inner());
            if let Some(meta) = sessions.get(session_id) {
                return Ok(Some(meta.clone()));
            }
        }
        // Absorbed (the writer writes the index before it forgets what it published).
        Ok(self.index.session(session_id)?)
    }

    /// Whether the session's deletion is durable.
    pub(crate) fn is_deleted(&self, session_id: &str) -> Result<bool, StoreError> {
        Ok(self.get(session_id)?.is_some_and(|meta| meta.is_deleted()))
    }
}
