//! The single writer: group commit.
//!
//! One thread takes every pending operation from the queue, validates each against the
//! in-memory state (expected seq, lease epoch, event-id dedup), assigns seqs and lease
//! epochs, writes all resulting records in one write, calls `fdatasync` **once** for the
//! whole batch, updates the index, and only then acknowledges and publishes. While one
//! fsync runs, the next batch queues up, so concurrent appends share fsyncs without any
//! artificial delay.
//!
//! Invariants kept here:
//! - a `DURABILITY_SYNC` append and every lease grant are answered only after the fsync
//!   that covers them;
//! - subscribers and readers see a record only after that fsync (the index and the
//!   published session state are updated after it);
//! - an I/O error on the log stops the writer for good: after a failed fsync the kernel may
//!   have dropped the dirty pages, so nothing more may be acknowledged (the process exits
//!   and recovery re-reads what is really on disk).

use std::collections::{BTreeSet, HashMap};
use std::sync::Arc;

use agentlog_proto::v1::{AppendResponse, Durability, Event, Lease};
use tokio::sync::{mpsc, oneshot};

use crate::error::StoreError;
use crate::index::{Index, IndexBatch};
use crate::log::{LeaseRecord, LogWriter, Record};
use crate::scope::Scope;
use crate::session::{
    check_approval_decisions, is_runner_kind, kind_name, lease_of, now_unix_ms, SessionMeta,
    SCHEMA_VERSION,
};
use crate::Shared;

/// At most this many operations share one fsync, so one batch's latency stays bounded.
const MAX_BATCH_OPS: usize = 4096;

pub enum Op {
    Append(
        AppendOp,
        oneshot::Sender<Result<AppendResponse, StoreError>>,
    ),
    Lease(LeaseOp, oneshot::Sender<Result<LeaseOutcome, StoreError>>),
}

/// A validated append request (session id syntax and sizes were checked at the edge).
pub struct AppendOp {
    pub session_id: String,
    pub events: Vec<Event>,
    pub expected_last_seq: Option<u64>,
    pub lease_epoch: Option<u64>,
    pub durability: Durability,
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
    /// No claimable session now; the earliest time a live lease on a runnable session
    /// expires, if any (then its session becomes claimable).
    NothingToClaim {
        next_expiry_unix_ms: Option<i64>,
    },
}

/// The writer's own view, which runs ahead of the published one by at most the batch in
/// hand (records written but not yet fsync'd).
pub struct Writer {
    log: LogWriter,
    index: Index,
    sessions: HashMap<String, SessionMeta>,
    /// Runnable sessions, oldest update first: the order `ClaimSession` hands them out.
    runnable: BTreeSet<(i64, String)>,
    shared: Arc<Shared>,
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
}

impl Writer {
    pub fn new(
        log: LogWriter,
        index: Index,
        sessions: HashMap<String, SessionMeta>,
        shared: Arc<Shared>,
    ) -> Writer {
        let runnable = sessions
            .iter()
            .filter(|(_, m)| m.is_runnable())
            .map(|(id, m)| (m.updated_unix_ms, id.clone()))
            .collect();
        Writer {
            log,
            index,
            sessions,
            runnable,
            shared,
        }
    }

    /// Runs until every sender of the queue is gone (shutdown) or the log fails.
    pub fn run(mut self, mut queue: mpsc::Receiver<Op>) -> Result<(), StoreError> {
        while let Some(first) = queue.blocking_recv() {
            let mut ops = vec![first];
            while ops.len() < MAX_BATCH_OPS {
                match queue.try_recv() {
                    Ok(op) => ops.push(op),
                    Err(_) => break,
                }
            }
            self.commit(ops)?;
        }
        self.index.flush()?;
        Ok(())
    }

    fn commit(&mut self, ops: Vec<Op>) -> Result<(), StoreError> {
        let now = now_unix_ms();
        let mut batch = Batch::default();
        let mut pending = Vec::new();
        let mut buffered = Vec::new();
        for op in ops {
            match op {
                Op::Append(req, reply) => {
                    let durability = req.durability;
                    match self.prepare_append(req, now, &mut batch) {
                        Ok(resp) if durability == Durability::Buffered => {
                            buffered.push((reply, resp))
                        }
                        Ok(resp) => pending.push(Pending::Append(reply, resp)),
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
        // DURABILITY_BUFFERED: acknowledged once written; the fsync follows right here.
        for (reply, resp) in buffered {
            let _ = reply.send(Ok(resp));
        }
        self.log.sync()?;

        let mut index_batch = IndexBatch::default();
        for (pos, record) in positions.into_iter().zip(&batch.records) {
            index_batch.add(pos, record);
        }
        self.index
            .apply(index_batch, &self.sessions, self.log.end())?;
        self.shared.publish(&batch.records, &self.sessions, now);
        for p in pending {
            p.send();
        }
        Ok(())
    }

    fn prepare_append(
        &mut self,
        req: AppendOp,
        now: i64,
        batch: &mut Batch,
    ) -> Result<AppendResponse, StoreError> {
        let empty = SessionMeta::default();
        let meta = self.sessions.get(&req.session_id).unwrap_or(&empty);

        let runner_kind = req
            .events
            .iter()
            .filter_map(|e| e.kind.as_ref())
            .find(|k| is_runner_kind(k));
        match (req.lease_epoch, runner_kind) {
            (Some(epoch), _) => check_lease(meta, &req.session_id, epoch, now)?,
            (None, Some(kind)) => {
                return Err(StoreError::FailedPrecondition(format!(
                    "lease_epoch: required to append {} (a runner-written kind); acquire a \
                     lease on session {} and pass its epoch",
                    kind_name(kind),
                    req.session_id
                )))
            }
            (None, None) => {}
        }

        // Dedup, then seqs for what is new.
        let mut seqs = Vec::with_capacity(req.events.len());
        let mut fresh = Vec::new();
        let mut in_request: HashMap<String, u64> = HashMap::new();
        let mut next = meta.last_seq + 1;
        for mut event in req.events {
            if event.event_id.is_empty() {
                event.event_id = uuid::Uuid::new_v4().to_string();
            }
            let known = match in_request.get(&event.event_id) {
                Some(seq) => Some(*seq),
                None => match batch
                    .event_ids
                    .get(&(req.session_id.clone(), event.event_id.clone()))
                {
                    Some(seq) => Some(*seq),
                    None => self.index.event_seq(&req.session_id, &event.event_id)?,
                },
            };
            if let Some(seq) = known {
                seqs.push(seq);
                continue;
            }
            event.seq = next;
            event.session_id = req.session_id.clone();
            event.ts_unix_ms = now;
            event.schema_version = SCHEMA_VERSION;
            in_request.insert(event.event_id.clone(), next);
            seqs.push(next);
            fresh.push(event);
            next += 1;
        }
        if !fresh.is_empty() {
            if let Some(expected) = req.expected_last_seq {
                if expected != meta.last_seq {
                    return Err(StoreError::Aborted {
                        session_id: req.session_id,
                        expected,
                        actual: meta.last_seq,
                    });
                }
            }
            check_approval_decisions(&req.session_id, &meta.pending_approvals, &fresh)
                .map_err(|e| StoreError::FailedPrecondition(e.to_string()))?;
        }

        let session_id = req.session_id;
        let last_seq = self.update_session(&session_id, |meta| {
            for event in &fresh {
                meta.apply_event(event);
            }
            meta.last_seq
        });
        let count = fresh.len();
        for (i, event) in fresh.into_iter().enumerate() {
            batch
                .event_ids
                .insert((session_id.clone(), event.event_id.clone()), event.seq);
            batch.push(Record::Event(event), i + 1 < count);
        }
        Ok(AppendResponse { seqs, last_seq })
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
                let meta = self.existing(&session_id)?;
                if let Some(live) = meta.live_lease(now) {
                    if live.owner != owner {
                        return Err(StoreError::FailedPrecondition(format!(
                            "session {session_id} is leased by {} (epoch {}) until {} ms",
                            live.owner, live.epoch, live.expires_unix_ms
                        )));
                    }
                }
                let record = grant(meta, &session_id, owner, ttl_ms, now);
                (session_id, record)
            }
            LeaseOp::Renew {
                session_id,
                owner,
                epoch,
                ttl_ms,
            } => {
                let meta = self.existing(&session_id)?;
                let current = current_lease(meta, &session_id, &owner, epoch)?;
                if current.released {
                    return Err(StoreError::FailedPrecondition(format!(
                        "the lease of epoch {epoch} on session {session_id} was released"
                    )));
                }
                let mut record = current.clone();
                record.expires_unix_ms = now.saturating_add(ttl_ms as i64);
                (session_id, record)
            }
            LeaseOp::Release {
                session_id,
                owner,
                epoch,
            } => {
                let meta = self.existing(&session_id)?;
                let current = current_lease(meta, &session_id, &owner, epoch)?;
                if current.released {
                    return Ok(LeaseOutcome::Released);
                }
                let mut record = current.clone();
                record.released = true;
                record.expires_unix_ms = now;
                (session_id, record)
            }
            LeaseOp::Claim {
                owner,
                ttl_ms,
                scope,
            } => {
                let claimable = self.runnable.iter().find(|(_, id)| {
                    scope.admits(id)
                        && self
                            .sessions
                            .get(id)
                            .is_some_and(|m| m.live_lease(now).is_none())
                });
                let Some((_, session_id)) = claimable.cloned() else {
                    let next_expiry_unix_ms = self
                        .runnable
                        .iter()
                        .filter(|(_, id)| scope.admits(id))
                        .filter_map(|(_, id)| self.sessions.get(id)?.live_lease(now))
                        .map(|l| l.expires_unix_ms)
                        .min();
                    return Ok(LeaseOutcome::NothingToClaim {
                        next_expiry_unix_ms,
                    });
                };
                let meta = self.existing(&session_id)?;
                let record = grant(meta, &session_id, owner, ttl_ms, now);
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

    fn existing(&self, session_id: &str) -> Result<&SessionMeta, StoreError> {
        self.sessions
            .get(session_id)
            .filter(|m| m.last_seq > 0)
            .ok_or_else(|| {
                StoreError::NotFound(format!(
                    "session {session_id} does not exist (no event was ever appended to it)"
                ))
            })
    }

    /// Changes one session's state, keeping the runnable order in step.
    fn update_session<T>(&mut self, session_id: &str, f: impl FnOnce(&mut SessionMeta) -> T) -> T {
        let meta = self.sessions.entry(session_id.to_string()).or_default();
        let before = (meta.is_runnable(), meta.updated_unix_ms);
        let out = f(meta);
        let after = (meta.is_runnable(), meta.updated_unix_ms);
        if before != after {
            if before.0 {
                self.runnable.remove(&(before.1, session_id.to_string()));
            }
            if after.0 {
                self.runnable.insert((after.1, session_id.to_string()));
            }
        }
        out
    }
}

#[derive(Default)]
struct Batch {
    records: Vec<Record>,
    /// Per record: whether the next record belongs to the same atomic append.
    continued: Vec<bool>,
    /// Event ids assigned in this batch, which the index does not hold yet.
    event_ids: HashMap<(String, String), u64>,
}

impl Batch {
    fn push(&mut self, record: Record, continued: bool) {
        self.records.push(record);
        self.continued.push(continued);
    }
}

impl Pending {
    fn send(self) {
        match self {
            Pending::Append(reply, resp) => {
                let _ = reply.send(Ok(resp));
            }
            Pending::Lease(reply, outcome) => {
                let _ = reply.send(Ok(outcome));
            }
        }
    }
}

pub(crate) fn grant(
    meta: &SessionMeta,
    session_id: &str,
    owner: String,
    ttl_ms: u64,
    now: i64,
) -> LeaseRecord {
    LeaseRecord {
        session_id: session_id.to_string(),
        owner,
        epoch: meta.next_epoch(),
        expires_unix_ms: now.saturating_add(ttl_ms as i64),
        released: false,
    }
}

/// The session's newest lease, if it is `epoch` and held by `owner`.
pub(crate) fn current_lease<'a>(
    meta: &'a SessionMeta,
    session_id: &str,
    owner: &str,
    epoch: u64,
) -> Result<&'a LeaseRecord, StoreError> {
    match &meta.lease {
        Some(l) if l.epoch == epoch && l.owner == owner => Ok(l),
        Some(l) if l.epoch == epoch => Err(StoreError::FailedPrecondition(format!(
            "the lease of epoch {epoch} on session {session_id} belongs to {}, not {owner}",
            l.owner
        ))),
        Some(l) => Err(StoreError::FailedPrecondition(format!(
            "epoch {epoch} is not the current lease of session {session_id} (current epoch is \
             {}): this holder has been fenced off",
            l.epoch
        ))),
        None => Err(StoreError::FailedPrecondition(format!(
            "session {session_id} has no lease"
        ))),
    }
}

/// An append carrying `epoch` is accepted only under the session's current, unexpired lease.
pub(crate) fn check_lease(
    meta: &SessionMeta,
    session_id: &str,
    epoch: u64,
    now: i64,
) -> Result<(), StoreError> {
    match meta.live_lease(now) {
        Some(l) if l.epoch == epoch => Ok(()),
        Some(l) => Err(StoreError::FailedPrecondition(format!(
            "lease_epoch {epoch} is not the current lease of session {session_id} (epoch {} \
             held by {}): this writer has been fenced off",
            l.epoch, l.owner
        ))),
        None => Err(StoreError::FailedPrecondition(format!(
            "lease_epoch {epoch}: session {session_id} has no live lease (it expired or was \
             released); acquire a new one"
        ))),
    }
}
