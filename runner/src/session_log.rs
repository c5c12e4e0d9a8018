//! A session's log as a runner sees it while it holds the lease: one live subscription
//! (history, then every new event) folded incrementally, and appends fenced by the lease
//! epoch.
//!
//! Promises:
//! - An append carries the lease epoch and the caller's deterministic `event_id`, so
//!   retrying it after a lost acknowledgement writes nothing new (the store answers with
//!   the original seq). Every append of a session's clones of its [`Appender`] goes on one
//!   `AppendStream` ([`AppendStream`]), opened again after it breaks; a request the broken
//!   stream left unanswered is retried like a unary call that lost its answer. A refusal
//!   whose reason says the lease is gone (`LEASE_FENCED`, `LEASE_HELD`, `SESSION_NOT_FOUND`)
//!   is reported as [`StoreError::LeaseLost`], one saying the session was deleted
//!   (`SESSION_DELETED`) as [`StoreError::SessionDeleted`]; neither is retried.
//! - The session's deletion is told at once ([`Deletion::seen`]): the store ends the live
//!   subscription with `SESSION_DELETED`, and the follower stops there.
//! - [`SessionLog::catch_up`] decides nothing on a stale log: the fold it returns has seen
//!   the whole log as it was when the session was claimed, our own last SYNC append, and
//!   every `interrupt` the subscription has shown. Events are applied once each, in seq
//!   order, so a step costs the events since the previous one, not the log's length.
//! - An `interrupt` is signalled ([`InterruptSignal`]) as soon as the subscription shows it,
//!   even while the runner is busy in a model stream or a tool.
//! - A session this runner worked before resumes from its kept fold ([`FoldCache`]) and
//!   reads only the events after it. That is exact because the log is append-only and a seq
//!   once seen always means the same event: the fold of seqs 1..n, then n+1.. applied, is
//!   the fold of the whole log (checked by the property tests in `fold.rs`).
//! - A session this runner never worked starts from the fold's snapshot in the store
//!   (`GetSnapshot`, format [`snapshot::FORMAT`]) when there is one, and reads only the events
//!   after its seq. A snapshot that does not decode, is of another fold version, or claims a
//!   seq past the log is ignored with a warning: the fold starts from seq 1, as without one.
//! - After a session's work ends (idle, or waiting for a person), while the lease is still
//!   held, the fold is put back as a snapshot once `snapshot_every` seqs have passed since
//!   the last one ([`SessionLog::write_snapshot_if_due`]); a failed put only costs a later
//!   cold claim a longer read.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;

use crate::fold::transcript::Form;
use crate::fold::{snapshot, FoldState};
use crate::lease::Deletion;
use crate::store_error::StoreError;
use agentlog_client::append_stream::AppendStream;
use agentlog_client::follow::{follow, Flow, FollowError, Note, Refusals};
use agentlog_client::refusal::{is_session_deleted, is_session_not_found};
use agentlog_client::retry::retry_transient;
use agentlog_client::StoreClient;
use agentlog_proto::v1::{
    event::Kind, AppendRequest, Durability, Event, ForkedFrom, GetSessionRequest,
    GetSnapshotRequest, SnapshotChunk,
};
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tracing::Instrument;

/// How long an append or read keeps retrying a store that is unreachable.
const STORE_PATIENCE: Duration = Duration::from_secs(6);
/// How long [`SessionLog::catch_up`] waits for the subscription to show what it must see.
/// Longer means the store is gone or lost an acknowledged event; the lease ends first in
/// the common case.
const CATCH_UP_LIMIT: Duration = Duration::from_secs(30);
/// Non-delta events buffered between the subscription and the fold. Deltas are not
/// buffered (the fold ignores them), so only client appends made during one step fill it.
const EVENT_BUFFER: usize = 1024;
/// PutSnapshot sends the fold in chunks of this size (the store takes up to 4 MiB each).
const SNAPSHOT_CHUNK_BYTES: usize = 1 << 20;

/// Appends to one session under one lease epoch. Cheap to clone (the delta writer has one);
/// its appends share one `AppendStream`, closed when the last clone is dropped.
#[derive(Debug, Clone)]
pub struct Appender {
    client: StoreClient,
    appends: AppendStream,
    session_id: String,
    epoch: u64,
    /// The highest seq any clone of this appender was given for a SYNC append: the store
    /// makes those readable before it acknowledges them, so a read of the log that does not
    /// reach it means the store lost an acknowledged event. (BUFFERED deltas are
    /// acknowledged before they are durable and readable; the fold ignores them anyway.)
    appended: Arc<AtomicU64>,
    /// Told when an append is refused because the session was deleted.
    deletion: Option<Deletion>,
}

impl Appender {
    /// Call it inside a tokio runtime, in the span the session's work is traced in (the
    /// store's side of the `AppendStream` joins that trace).
    pub fn new(client: StoreClient, session_id: String, epoch: u64) -> Appender {
        Appender {
            appends: AppendStream::new(client.clone()),
            client,
            session_id,
            epoch,
            appended: Arc::new(AtomicU64::new(0)),
            deletion: None,
        }
    }

    /// The same appender, telling `deletion` at once when an append of any of its clones
    /// (the delta writer's too) is refused because the session was deleted.
    pub fn telling(self, deletion: Deletion) -> Appender {
        Appender {
            deletion: Some(deletion),
            ..self
        }
    }

    pub fn session_id(&self) -> &str {
        &self.session_id
    }

    /// The release of the store its appends reach, once one was answered.
    pub fn store_release(&self) -> Option<agentlog_proto::release::Release> {
        self.appends.store_release()
    }

    /// Appends one event; returns its seq (the original one if `event_id` was already
    /// written).
    #[tracing::instrument(name = "append", skip_all, fields(%event_id, ?durability, seq))]
    pub async fn append(
        &self,
        event_id: String,
        kind: Kind,
        durability: Durability,
    ) -> Result<u64, StoreError> {
        let request = AppendRequest {
            session_id: self.session_id.clone(),
            events: vec![Event {
                session_id: self.session_id.clone(),
                event_id,
                kind: Some(kind),
                ..Event::default()
            }],
            expected_last_seq: None,
            lease_epoch: Some(self.epoch),
            durability: durability as i32,
        };
        // A retry carries the same event id: it writes nothing twice.
        let response = retry_transient("Append", STORE_PATIENCE, || {
            self.appends.append(request.clone())
        })
        .await
        .map_err(StoreError::from);
        if let (Err(StoreError::SessionDeleted), Some(deletion)) = (&response, &self.deletion) {
            deletion.seen("an append");
        }
        let response = response?;
        let seq = response.seqs.first().copied().unwrap_or(response.last_seq);
        if durability == Durability::Sync {
            self.appended.fetch_max(seq, Ordering::SeqCst);
        }
        tracing::Span::current().record("seq", seq);
        Ok(seq)
    }
}

/// What the subscription has shown so far.
#[derive(Debug, Clone, Copy, Default)]
struct Seen {
    /// Every event up to this seq is in the buffer (or was applied).
    through_seq: u64,
    /// The seq of the latest `interrupt` shown, published before the event is buffered.
    latest_interrupt: u64,
}

/// Fires when an `interrupt` newer than the fold's appears in the session's log.
#[derive(Debug, Clone)]
pub struct InterruptSignal {
    seen: watch::Receiver<Seen>,
    known: u64,
}

impl InterruptSignal {
    /// A signal that never fires: for running calls outside a followed session (the tool
    /// guard's crash tests run them against an in-memory log).
    pub fn never() -> InterruptSignal {
        let (_, seen) = watch::channel(Seen::default());
        InterruptSignal { seen, known: 0 }
    }

    /// Resolves once the log shows an `interrupt` the fold had not seen. Never resolves if
    /// the subscription is gone (the session's work is stopping anyway).
    pub async fn arrived(&self) {
        let known = self.known;
        let mut seen = self.seen.clone();
        if seen.wait_for(|s| s.latest_interrupt > known).await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

/// A session's fold as this runner last left it: every event up to `applied_through`.
#[derive(Debug)]
struct KeptFold {
    fold: FoldState,
    applied_through: u64,
    /// The seq of the snapshot the store holds for the session, as far as we know.
    snapshot_seq: u64,
    last_used: u64,
}

/// Where a claim's fold starts.
#[derive(Debug, Default)]
struct Start {
    fold: FoldState,
    applied_through: u64,
    snapshot_seq: u64,
}

/// The folds of the sessions this runner worked most recently, so that claiming one of
/// them again costs the events since, not the log's length. Bounded: the least recently
/// used fold is dropped first. It also says how often folds go to the store as snapshots,
/// for the claims of runners that never worked the session.
#[derive(Debug)]
pub struct FoldCache {
    capacity: usize,
    snapshot_every: u64,
    /// The forms of the runner's models, the default's first: a new fold keeps its settled
    /// messages in the first, and a snapshot in any of them is taken.
    forms: Vec<&'static dyn Form>,
    kept: Mutex<(u64, HashMap<String, KeptFold>)>,
}

impl FoldCache {
    /// Keeps at most `capacity` sessions' folds (0 keeps none), and reads and writes
    /// snapshots of sessions whose log has at least `snapshot_every` events, writing one
    /// each time that many seqs have passed since the last (0: no snapshots). New folds keep
    /// their settled messages in the first of `forms` (none: as messages).
    pub fn new(capacity: usize, snapshot_every: u64, forms: Vec<&'static dyn Form>) -> FoldCache {
        FoldCache {
            capacity,
            snapshot_every,
            forms,
            kept: Mutex::new((0, HashMap::new())),
        }
    }

    fn take(&self, session_id: &str) -> Option<Start> {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        kept.1.remove(session_id).map(|k| Start {
            fold: k.fold,
            applied_through: k.applied_through,
            snapshot_seq: k.snapshot_seq,
        })
    }

    fn keep(&self, session_id: String, start: Start) {
        let Start {
            fold,
            applied_through,
            snapshot_seq,
        } = start;
        if self.capacity == 0 || applied_through == 0 {
            return;
        }
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        kept.0 += 1;
        let last_used = kept.0;
        kept.1.insert(
            session_id,
            KeptFold {
                fold,
                applied_through,
                snapshot_seq,
                last_used,
            },
        );
        while kept.1.len() > self.capacity {
            let oldest = kept
                .1
                .iter()
                .min_by_key(|(_, k)| k.last_used)
                .map(|(id, _)| id.clone());
            match oldest {
                Some(id) => kept.1.remove(&id),
                None => break,
            };
        }
    }
}

/// The session's log, followed live and folded as it comes, plus its appender.
#[derive(Debug)]
pub struct SessionLog {
    appender: Appender,
    fold: FoldState,
    /// The seq of the last event applied to `fold`.
    applied_through: u64,
    events: mpsc::Receiver<Event>,
    seen: watch::Receiver<Seen>,
    /// The last seq when the session was claimed: a fold short of it would act on a log
    /// that lacks what the previous lease holder wrote.
    claimed_tail: u64,
    /// The seq of the snapshot the store holds, as far as we know (0: none).
    snapshot_seq: u64,
    snapshot_every: u64,
    /// Where the session was forked from, if it is a fork.
    forked_from: Option<ForkedFrom>,
    follower: JoinHandle<()>,
}

impl Drop for SessionLog {
    fn drop(&mut self) {
        self.follower.abort();
    }
}

impl SessionLog {
    /// Starts following the session's log (call it after the lease is held): from the fold
    /// `cache` kept for it, else from the store's snapshot of it, else from seq 1. The
    /// session's deletion, once the subscription shows it, is told to `deletion`.
    pub async fn open(
        appender: Appender,
        cache: &FoldCache,
        deletion: Deletion,
    ) -> Result<SessionLog, StoreError> {
        let asked = retry_transient("GetSession", STORE_PATIENCE, || {
            let mut client = appender.client.clone();
            let session_id = appender.session_id.clone();
            async move {
                match client.get_session(GetSessionRequest { session_id }).await {
                    Ok(info) => {
                        let info = info.into_inner();
                        Ok((info.last_seq, info.forked_from))
                    }
                    Err(status) if is_session_not_found(&status) => Ok((0, None)),
                    Err(status) => Err(status),
                }
            }
        })
        .await;
        let (claimed_tail, forked_from) = match asked {
            Ok(found) => found,
            Err(status) if is_session_deleted(&status) => return Err(StoreError::SessionDeleted),
            Err(status) => return Err(StoreError::Failed(status)),
        };
        let fresh = || Start {
            fold: cache
                .forms
                .first()
                .map(|form| FoldState::rendering(*form))
                .unwrap_or_default(),
            ..Start::default()
        };
        let kept = cache
            .take(&appender.session_id)
            .filter(|start| start.applied_through <= claimed_tail);
        let Start {
            fold,
            applied_through,
            snapshot_seq,
        } = match kept {
            Some(start) => start,
            None if cache.snapshot_every > 0 && claimed_tail >= cache.snapshot_every => {
                restore_snapshot(&appender, claimed_tail, &cache.forms)
                    .await
                    .unwrap_or_else(fresh)
            }
            None => fresh(),
        };
        let (sender, events) = mpsc::channel(EVENT_BUFFER);
        let (publish, seen) = watch::channel(Seen {
            through_seq: applied_through,
            latest_interrupt: fold.last_interrupt_seq(),
        });
        // In the claim's span, so the store's side of the subscription joins its trace.
        let follower = tokio::spawn(
            follow_log(
                appender.client.clone(),
                appender.session_id.clone(),
                applied_through + 1,
                sender,
                publish,
                deletion,
            )
            .instrument(tracing::Span::current()),
        );
        Ok(SessionLog {
            appender,
            fold,
            applied_through,
            events,
            seen,
            claimed_tail,
            snapshot_seq,
            snapshot_every: cache.snapshot_every,
            forked_from,
            follower,
        })
    }

    pub fn appender(&self) -> &Appender {
        &self.appender
    }

    /// The parent and seq the session was forked at, if it is a fork (`GetSession`).
    pub fn forked_from(&self) -> Option<&ForkedFrom> {
        self.forked_from.as_ref()
    }

    pub fn client(&self) -> &StoreClient {
        &self.appender.client
    }

    /// Stops following and leaves the fold in `cache` for the next claim of this session.
    pub fn keep_in(mut self, cache: &FoldCache) {
        self.follower.abort();
        if self.fold.is_lent() {
            // A step ended without giving its conversation back: the fold is incomplete.
            return;
        }
        let start = Start {
            fold: std::mem::take(&mut self.fold),
            applied_through: self.applied_through,
            snapshot_seq: self.snapshot_seq,
        };
        cache.keep(self.appender.session_id.clone(), start);
    }

    /// Puts the fold in the store as a snapshot if `snapshot_every` seqs have passed since
    /// the last one (call it while the lease is held, between steps). A refusal or a failure
    /// is logged and otherwise ignored: the snapshot only saves a later claim some reading.
    pub async fn write_snapshot_if_due(&mut self) {
        let every = self.snapshot_every;
        if every == 0 || self.applied_through < self.snapshot_seq.saturating_add(every) {
            return;
        }
        let Some(data) = self.fold.to_snapshot() else {
            return;
        };
        let seq = self.applied_through;
        let bytes = data.len();
        let data = Bytes::from(data);
        let mut chunks: Vec<SnapshotChunk> = (0..bytes)
            .step_by(SNAPSHOT_CHUNK_BYTES)
            .map(|at| SnapshotChunk {
                data: data.slice(at..bytes.min(at + SNAPSHOT_CHUNK_BYTES)),
                ..SnapshotChunk::default()
            })
            .collect();
        drop(data);
        if let Some(first) = chunks.first_mut() {
            first.session_id = self.appender.session_id.clone();
            first.lease_epoch = self.appender.epoch;
            first.seq = seq;
            first.format = snapshot::FORMAT.to_string();
        }
        let put = self
            .appender
            .client
            .clone()
            .put_snapshot(tokio_stream::iter(chunks))
            .await;
        match put {
            Ok(kept) => {
                self.snapshot_seq = kept.into_inner().seq.max(seq);
                tracing::info!(seq, bytes, "kept the fold as a snapshot");
            }
            Err(status) => {
                tracing::warn!(%status, seq, "the store did not keep the fold's snapshot")
            }
        }
    }

    /// The session's model and its replay, as folded so far.
    pub fn config(&self) -> &crate::fold::config::SessionConfigState {
        self.fold.config()
    }

    /// The current run, as folded so far.
    pub fn run(&self) -> &crate::fold::run::RunState {
        self.fold.run()
    }

    /// [`FoldState::dangling_calls`] of the fold as caught up.
    pub fn dangling_calls(&self) -> Vec<crate::fold::PendingCall> {
        self.fold.dangling_calls()
    }

    /// [`FoldState::take_folded`] of the fold as caught up.
    pub fn take_folded(&mut self) -> crate::fold::Folded {
        self.fold.take_folded()
    }

    /// Makes the fold keep its conversation in `form`, the form of the model the session
    /// runs on: a fold kept in another (a session whose model changed, or a fold made before
    /// its `session_config` was seen) is folded again from seq 1, reading the log through
    /// what was applied.
    pub async fn ensure_form(&mut self, form: &'static dyn Form) -> Result<(), StoreError> {
        if self
            .fold
            .form()
            .is_some_and(|kept| kept.name() == form.name())
            || self.fold.is_lent()
        {
            return Ok(());
        }
        let through = self.applied_through;
        let session_id = self.appender.session_id.clone();
        let client = self.appender.client.clone();
        let events = retry_transient("Subscribe", STORE_PATIENCE, || {
            let mut client = client.clone();
            let session_id = session_id.clone();
            async move { agentlog_client::log::read_log(&mut client, &session_id).await }
        })
        .await
        .map_err(StoreError::from)?;
        let mut fold = FoldState::rendering(form);
        for event in events.iter().take_while(|e| e.seq <= through) {
            fold.apply(event);
        }
        tracing::info!(
            form = form.name(),
            through,
            "folded the log again in its model's form"
        );
        self.fold = fold;
        Ok(())
    }

    /// Returns the messages of a conversation taken with [`FoldState::take_folded`].
    pub fn give_back(&mut self, conversation: crate::fold::Conversation) {
        self.fold.give_back(conversation);
    }

    /// A signal for `interrupt`s the current fold has not seen.
    pub fn interrupt_signal(&self) -> InterruptSignal {
        InterruptSignal {
            seen: self.seen.clone(),
            known: self.fold.last_interrupt_seq(),
        }
    }

    /// Applies every event the subscription has shown and returns the fold, once it has
    /// seen the claimed tail, our own last SYNC append and every `interrupt` signalled.
    /// Deciding the next step on a log that lacks our append would redo that step, so a log
    /// that does not get there in time is an error, never folded.
    pub async fn catch_up(&mut self) -> Result<&mut FoldState, StoreError> {
        let deadline = tokio::time::Instant::now() + CATCH_UP_LIMIT;
        loop {
            let seen = *self.seen.borrow_and_update();
            let target = self
                .claimed_tail
                .max(self.appender.appended.load(Ordering::SeqCst))
                .max(seen.latest_interrupt);
            // `through_seq` is published after the event is buffered: drain after reading it.
            while let Ok(event) = self.events.try_recv() {
                self.fold.apply(&event);
                self.applied_through = event.seq;
            }
            if seen.through_seq >= target {
                return Ok(&mut self.fold);
            }
            match tokio::time::timeout_at(deadline, self.seen.changed()).await {
                Ok(Ok(())) => {}
                Ok(Err(_)) | Err(_) => {
                    return Err(StoreError::Failed(tonic::Status::data_loss(format!(
                        "the log shows seq {} but must reach seq {target} (the claimed tail or \
                         our acknowledged append)",
                        seen.through_seq
                    ))))
                }
            }
        }
    }
}

/// The fold of the store's snapshot of the session, if there is a usable one.
async fn restore_snapshot(
    appender: &Appender,
    claimed_tail: u64,
    forms: &[&'static dyn Form],
) -> Option<Start> {
    let request = GetSnapshotRequest {
        session_id: appender.session_id.clone(),
        format: snapshot::FORMAT.to_string(),
    };
    let read = async {
        let mut chunks = appender
            .client
            .clone()
            .get_snapshot(request)
            .await?
            .into_inner();
        let Some(first) = chunks.message().await? else {
            return Ok(None);
        };
        let mut parts = vec![first.data];
        while let Some(chunk) = chunks.message().await? {
            parts.push(chunk.data);
        }
        Ok::<_, tonic::Status>(Some((first.seq, parts)))
    };
    let (seq, data) = match read.await {
        Ok(Some(found)) => found,
        Ok(None) => return None,
        Err(status) if status.code() == tonic::Code::NotFound => return None,
        Err(status) => {
            tracing::warn!(%status, "could not read the fold's snapshot; folding from seq 1");
            return None;
        }
    };
    if seq > claimed_tail {
        tracing::warn!(
            seq,
            claimed_tail,
            "ignoring a snapshot past the end of the log; folding from seq 1"
        );
        return None;
    }
    let bytes: usize = data.iter().map(Bytes::len).sum();
    match FoldState::from_snapshot_in(data, forms) {
        Ok(fold) => {
            tracing::info!(seq, bytes, "resuming from the fold's snapshot");
            Some(Start {
                fold,
                applied_through: seq,
                snapshot_seq: seq,
            })
        }
        Err(e) => {
            tracing::warn!(error = %e, seq, "ignoring the fold's snapshot; folding from seq 1");
            None
        }
    }
}

/// Follows the session's log from `next` for as long as the receiver lives, resubscribing
/// from the next seq after any failure (the lease, not the follower, decides when to stop),
/// until the session is deleted: that is told to `deletion`. Non-delta events go to
/// `sender` in seq order, each once; `publish` says how far the log has been shown.
async fn follow_log(
    client: StoreClient,
    session_id: String,
    next: u64,
    sender: mpsc::Sender<Event>,
    publish: watch::Sender<Seen>,
    deletion: Deletion,
) {
    let note = |note: Note<'_>| match note {
        Note::Unreachable { next, status } => {
            tracing::warn!(%status, next, "subscribing to the log failed; retrying")
        }
        Note::Ended { next, status } => {
            tracing::warn!(?status, next, "the log subscription ended; resubscribing")
        }
        Note::Gap { next, seq } => {
            tracing::warn!(seq, next, "a gap in the log subscription; resubscribing")
        }
        Note::Resumed { next } => tracing::info!(next, "following the log again"),
    };
    let on_event = |event: Event| {
        let seq = event.seq;
        let is_delta = matches!(event.kind, Some(Kind::AssistantDelta(_)));
        if matches!(event.kind, Some(Kind::Interrupt(_))) {
            publish.send_modify(|s| s.latest_interrupt = seq);
        }
        let sender = sender.clone();
        let publish = &publish;
        async move {
            // Deltas are not buffered: the fold ignores them.
            if !is_delta && sender.send(event).await.is_err() {
                return Ok::<_, std::convert::Infallible>(Flow::Stop);
            }
            publish.send_modify(|s| s.through_seq = seq);
            Ok(Flow::Continue)
        }
    };
    let followed = follow(&client, &session_id, next, Refusals::Retry, note, on_event).await;
    if let Err(FollowError::Refused(status)) = followed {
        if is_session_deleted(&status) {
            deletion.seen("the log's subscription");
        }
    }
}

#[cfg(test)]
mod tests {
    use agentlog_proto::reason::Reason;

    use super::*;

    #[test]
    fn a_refusal_is_classified_by_its_reason() {
        let class = |status: tonic::Status| match StoreError::from(status) {
            StoreError::LeaseLost => "lost",
            StoreError::SessionDeleted => "deleted",
            StoreError::Failed(_) => "failed",
        };
        assert_eq!(class(Reason::SessionDeleted.status("gone")), "deleted");
        for reason in [
            Reason::LeaseFenced,
            Reason::LeaseHeld,
            Reason::SessionNotFound,
        ] {
            assert_eq!(class(reason.status("x")), "lost", "{reason}");
        }
        assert_eq!(class(tonic::Status::not_found("no reason")), "failed");
        assert_eq!(class(Reason::DiskFull.status("full")), "failed");
    }
}
