//! The local backend: one replica keeping every session in our own segment log on one
//! volume, with a sled index beside it.
//!
//! - [`log`]: our CRC-framed segment files; the `fdatasync` that makes an ack true.
//! - [`writer`]: the single writer thread doing group commit; [`published`]: what it has
//!   made durable, as readers see it; [`recovery`]: the log replayed into the index at open.
//! - [`index`]: sled, rebuilt from the log past the offset it had absorbed, and kept up to
//!   date behind the acknowledgements.
//! - [`subscriptions`]: history then live, with disk catch-up for slow readers, history
//!   handed out in its wire form ([`framed`]); [`live`]: the live fan-out.
//! - [`snapshots`]: the snapshot files.
//! - [`search`]: the full-text index of `SearchSessions`, derived from the log by a thread
//!   of its own, caught up at open, forgetting deleted sessions.
//! - [`reclaim`]: deleted sessions' space given back, by rewriting the segments that hold
//!   their records; [`background`]: the store's own threads (retention, reclamation).
//! - `import`: an imported session staged out of sight and made visible in one record.
//!
//! [`Store`] is the facade the gRPC service runs over (through [`super::Backend`]).

mod background;
pub mod framed;
mod import;
pub mod index;
pub mod live;
pub mod log;
pub mod published;
pub mod readers;
pub mod reclaim;
mod recovery;
pub mod search;
mod sessions;
mod signal;
pub mod snapshots;
pub mod subscriptions;
pub mod writer;

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use agentlog_proto::kept::KeptEvent;
use agentlog_proto::v1::{
    AppendResponse, ForkSessionResponse, Lease, ListSessionsRequest, ListSessionsResponse,
    SessionInfo,
};
use tokio::sync::{mpsc, oneshot, watch, Semaphore};
use tokio_util::sync::CancellationToken;

use crate::backend::{
    self, AppendAnswer, AppendOp, Backend, EventRun, ForkOp, Snapshot, SnapshotRead, Staging,
};
use crate::clock::now_unix_ms;
use crate::error::StoreError;
use crate::queries::{self, ClaimAttempt};
use crate::retention::Retention;
use crate::rules;
use crate::scope::{self, Scope};
use crate::session::SessionMeta;
use index::{Index, IndexError, Recent};
use live::Hub;
use log::storage::{FsStorage, Storage};
use log::{LogError, Record};
use published::Shared;
use reclaim::{ReclaimConfig, Reclaimer};
use subscriptions::Source;
use writer::{DeleteOp, LeaseOp, LeaseOutcome, Op, Writer};

/// Pending operations the writer may have queued; beyond this, callers wait (backpressure).
const QUEUE_DEPTH: usize = 8192;
/// Event bytes (in KiB) that may wait for the writer at once; beyond this, appends wait, so
/// a flood of 4 MiB appends cannot exhaust memory.
const QUEUED_KIB: usize = 64 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(transparent)]
    Index(#[from] IndexError),
    #[error(transparent)]
    Log(#[from] LogError),
    #[error("data dir {0}: {1}")]
    DataDir(String, std::io::Error),
    #[error(transparent)]
    Search(#[from] search::SearchError),
    #[error(transparent)]
    Readers(#[from] readers::ReadersError),
}

/// Where the store keeps its data.
pub struct StoreConfig {
    /// Segment files.
    pub log: Arc<dyn Storage>,
    /// The sled index directory.
    pub index_dir: std::path::PathBuf,
    /// Snapshot files ([`snapshots`]); created when the first snapshot is written.
    pub snapshot_dir: std::path::PathBuf,
    pub log_config: log::LogConfig,
    /// `--retain-idle`, if set.
    pub retention: Option<Retention>,
    pub reclaim: ReclaimConfig,
    /// `--session-cache`: bytes of sessions' states the writer keeps in memory.
    pub session_cache_bytes: usize,
    /// The full-text index's directory ([`search`]); `None`: no index, and
    /// `SearchSessions` is `UNAVAILABLE` (`--no-search-index`).
    pub search_dir: Option<std::path::PathBuf>,
    /// The least time between two commits of the full-text index
    /// ([`search::COMMIT_EVERY`] by default).
    pub search_commit_every: std::time::Duration,
}

impl StoreConfig {
    /// `<data-dir>/log/` and `<data-dir>/index/` on the real filesystem, with segments
    /// sized to the volume ([`log::LogConfig::for_volume`]).
    pub fn in_dir(data_dir: &Path) -> Result<StoreConfig, OpenError> {
        // Nothing of a directory a later release changed beyond this build is opened.
        std::fs::create_dir_all(data_dir)
            .map_err(|e| OpenError::DataDir(data_dir.display().to_string(), e))?;
        readers::check_and_mark(data_dir)?;
        let log_dir = data_dir.join("log");
        let dir_error = |e| OpenError::DataDir(log_dir.display().to_string(), e);
        let storage = FsStorage::open_dir(&log_dir).map_err(dir_error)?;
        let log_config = log::LogConfig::for_volume(storage.volume_bytes().map_err(dir_error)?);
        Ok(StoreConfig {
            log: Arc::new(storage),
            index_dir: data_dir.join("index"),
            snapshot_dir: data_dir.join("snapshots"),
            log_config,
            retention: None,
            reclaim: ReclaimConfig::for_segments(log_config.segment_bytes),
            session_cache_bytes: sessions::DEFAULT_CACHE_BYTES,
            search_dir: Some(search::dir_in(data_dir)),
            search_commit_every: search::COMMIT_EVERY,
        })
    }
}

/// The store: owns the writer thread; every method is safe to call concurrently.
pub struct Store {
    queue: mpsc::Sender<Op>,
    queued_kib: Arc<Semaphore>,
    shared: Arc<Shared>,
    source: Source,
    writer: Option<std::thread::JoinHandle<Result<(), StoreError>>>,
    writer_done: watch::Receiver<bool>,
    snapshots: Arc<snapshots::SnapshotDir>,
    /// Stops the background threads (retention, reclamation), which hold senders of
    /// `queue`.
    background: Vec<signal::Signal>,
    background_threads: Vec<std::thread::JoinHandle<()>>,
    /// Names this run's imports' staging sessions.
    staging_names: Arc<import::StagingNames>,
    search: Option<Arc<search::SearchIndex>>,
}

impl Store {
    /// Opens (and recovers) the store: replays the log past what the index absorbed,
    /// dropping a torn tail, then starts the writer.
    pub fn open(config: StoreConfig) -> Result<Store, OpenError> {
        config
            .log
            .keep_reserve(reclaim::reserve_bytes(config.log_config.segment_bytes))
            .map_err(|e| OpenError::DataDir("the log's reserve".into(), e))?;
        let index = Index::open_current(&config.index_dir)?;
        let log = recovery::open(&config, &index)?;
        let shared = Arc::new(Shared {
            sessions: RwLock::new(HashMap::new()),
            index: index.clone(),
            hub: Arc::new(Hub::default()),
            recent: Arc::new(Recent::default()),
            claimable: watch::channel(0).0,
            full: watch::channel(None).0,
            serving: watch::channel(true).0,
            erasing: Default::default(),
            reclaimer: signal::Signal::default(),
            absorbed: log.end().into(),
            durable: log.end().into(),
            indexer: signal::Signal::default(),
        });
        // Deletions whose records may still be in the log (their reclamation had not
        // finished when the store stopped).
        let erasing = index.erasing()?;
        let source = Source {
            shared: shared.clone(),
            index: index.clone(),
            log: log.reader(),
        };
        // Brought up to the log's end before anything is served (see `search`), by the
        // indexer's own thread.
        let search = match &config.search_dir {
            Some(dir) => Some(search::start(
                dir,
                config.search_commit_every,
                source.clone(),
                shared.indexer.clone(),
            )?),
            None => None,
        };
        let snapshots = Arc::new(snapshots::SnapshotDir::new(config.snapshot_dir.clone()));
        // A deletion whose tombstone was durable when the store stopped may not have removed
        // the session's snapshots yet; its reclamation, which removes them too, had not
        // finished either.
        snapshots
            .remove_sessions(erasing.iter().map(|(id, _)| id.as_str()))
            .map_err(|e| OpenError::DataDir(config.snapshot_dir.display().to_string(), e))?;
        shared.erase(erasing);
        let (queue, rx) = mpsc::channel(QUEUE_DEPTH);
        let (done_tx, writer_done) = watch::channel(false);
        let staging_names = Arc::new(import::StagingNames::new());
        let reclaimer = Reclaimer::new(
            log.rewriter(),
            log.reader(),
            index.clone(),
            shared.clone(),
            queue.clone(),
            config.reclaim,
            snapshots.clone(),
        )
        .with_staging_names(staging_names.clone());
        let writer = Writer::new(log, index, shared.clone(), config.session_cache_bytes)?;
        let writer = std::thread::Builder::new()
            .name("log-writer".into())
            .spawn(move || {
                let result = writer.run(rx);
                if let Err(e) = &result {
                    tracing::error!(error = %e, "the log writer stopped: nothing more can be acknowledged");
                }
                let _ = done_tx.send(true);
                result
            })
            .map_err(|e| OpenError::DataDir("writer thread".into(), e))?;
        let mut background = vec![shared.reclaimer.clone()];
        let mut background_threads = vec![std::thread::Builder::new()
            .name("log-reclaimer".into())
            .spawn(move || reclaimer.run())
            .map_err(|e| OpenError::DataDir("reclaimer thread".into(), e))?];
        let search = match search {
            Some((index, thread)) => {
                background.push(shared.indexer.clone());
                background_threads.push(thread);
                Some(index)
            }
            None => None,
        };
        if let Some(retention) = config.retention {
            let stop = signal::Signal::default();
            background.push(stop.clone());
            let (queue, snapshots) = (queue.clone(), snapshots.clone());
            let thread = std::thread::Builder::new()
                .name("retention".into())
                .spawn(move || background::run_retention(queue, retention, snapshots, stop))
                .map_err(|e| OpenError::DataDir("retention thread".into(), e))?;
            background_threads.push(thread);
        }
        Ok(Store {
            queue,
            queued_kib: Arc::new(Semaphore::new(QUEUED_KIB)),
            shared,
            source,
            writer: Some(writer),
            writer_done,
            snapshots,
            background,
            background_threads,
            staging_names,
            search,
        })
    }

    /// Resolves when the writer has stopped (after [`Store::close`], or because the log
    /// failed: then the process should exit).
    pub fn writer_stopped(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut done = self.writer_done.clone();
        async move {
            let _ = done.wait_for(|d| *d).await;
        }
    }

    /// Whether the log's volume is full, and why: while it is, appends are refused with
    /// `RESOURCE_EXHAUSTED` (reads go on), until the writer finds room again by itself.
    pub fn disk_full(&self) -> watch::Receiver<Option<String>> {
        self.shared.full.subscribe()
    }

    /// Whether appends can be acknowledged now: false while the volume is full.
    pub fn serving(&self) -> watch::Receiver<bool> {
        self.shared.serving.subscribe()
    }

    /// Stops taking operations, lets the writer finish and fsync what it has queued, and
    /// waits for it. Returns the writer's error, if the log failed.
    pub fn close(mut self) -> Result<(), StoreError> {
        self.background.iter().for_each(signal::Signal::stop);
        for thread in std::mem::take(&mut self.background_threads) {
            let _ = thread.join();
        }
        let writer = self.writer.take();
        drop(self);
        match writer.map(|w| w.join()) {
            Some(Ok(result)) => result,
            Some(Err(_)) => Err(StoreError::Internal("the log writer panicked".into())),
            None => Ok(()),
        }
    }

    async fn submit<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, StoreError>>) -> Op,
    ) -> Result<T, StoreError> {
        let (tx, rx) = oneshot::channel();
        self.queue.send(make(tx)).await.map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }

    /// Appends (validated) events; see [`AppendOp`].
    pub async fn append(&self, op: AppendOp) -> Result<AppendResponse, StoreError> {
        self.enqueue_append(op).await?.await
    }

    /// Queues an append for the writer and returns its answer to come: appends queued one
    /// after another are applied in that order, so a caller may queue the next one before
    /// the answer to the previous one arrives.
    pub async fn enqueue_append(
        &self,
        op: AppendOp,
    ) -> Result<impl std::future::Future<Output = Result<AppendResponse, StoreError>>, StoreError>
    {
        let bytes: usize = op.events.iter().map(KeptEvent::encoded_len).sum();
        let kib = (bytes / 1024 + 1).min(QUEUED_KIB) as u32;
        let budget = self
            .queued_kib
            .clone()
            .acquire_many_owned(kib)
            .await
            .map_err(|_| StoreError::Unavailable("the store is shutting down".into()))?;
        let alone = self.queued_kib.available_permits() + kib as usize == QUEUED_KIB;
        let (tx, rx) = oneshot::channel();
        self.queue
            .send(Op::Append(op, tx, tracing::Span::current()))
            .await
            .map_err(|_| gone())?;
        Ok(async move {
            let answer = answer_of(rx, alone).await.ok_or_else(gone)?;
            drop(budget);
            answer
        })
    }

    pub async fn acquire_lease(
        &self,
        session_id: String,
        owner: String,
        ttl_ms: u64,
    ) -> Result<Lease, StoreError> {
        granted(
            self.submit(|tx| {
                Op::Lease(
                    LeaseOp::Acquire {
                        session_id,
                        owner,
                        ttl_ms,
                    },
                    tx,
                )
            })
            .await?,
        )
    }

    pub async fn renew_lease(
        &self,
        session_id: String,
        owner: String,
        epoch: u64,
        ttl_ms: u64,
    ) -> Result<Lease, StoreError> {
        granted(
            self.submit(|tx| {
                Op::Lease(
                    LeaseOp::Renew {
                        session_id,
                        owner,
                        epoch,
                        ttl_ms,
                    },
                    tx,
                )
            })
            .await?,
        )
    }

    pub async fn release_lease(
        &self,
        session_id: String,
        owner: String,
        epoch: u64,
    ) -> Result<(), StoreError> {
        self.submit(|tx| {
            Op::Lease(
                LeaseOp::Release {
                    session_id,
                    owner,
                    epoch,
                },
                tx,
            )
        })
        .await
        .map(|_| ())
    }

    /// Waits up to `wait` for a runnable session in `scope` without a live lease and
    /// leases it to `owner`; `None` if none came (or `cancel` fired). The writer picks and
    /// grants in one step, so each runnable session goes to exactly one claimant.
    pub async fn claim(
        &self,
        owner: String,
        ttl_ms: u64,
        wait: Duration,
        cancel: &CancellationToken,
        scope: &scope::Scope,
    ) -> Result<Option<Lease>, StoreError> {
        let changes = self.shared.claimable.subscribe();
        queries::long_poll_claim(wait, cancel, changes, None, || {
            let claim = LeaseOp::Claim {
                owner: owner.clone(),
                ttl_ms,
                scope: scope.clone(),
            };
            async move {
                match self.submit(|tx| Op::Lease(claim, tx)).await? {
                    LeaseOutcome::Granted(lease) => Ok(ClaimAttempt::Granted(lease)),
                    LeaseOutcome::NothingToClaim {
                        next_expiry_unix_ms,
                    } => Ok(ClaimAttempt::Nothing {
                        next_expiry_unix_ms,
                    }),
                    LeaseOutcome::Released => Err(StoreError::Internal(
                        "a claim answered with a released lease".into(),
                    )),
                }
            }
        })
        .await
    }

    /// `ForkSession`: the parent's prefix is read as it is stored and checked here, each
    /// event parsed only as far as the settled-point rule and the fork's state need; the
    /// writer then writes the fork as one atomic append: its start, carrying its state at
    /// `at_seq`, and the request's new events, after checking in its own state that the new
    /// session does not exist and the parent still does. The prefix is not written again:
    /// the fork reads it through its parent ([`crate::session::SessionMeta::base_session`])
    /// until the parent is deleted, when it is made the fork's own (`reclaim`).
    pub async fn fork(&self, op: ForkOp) -> Result<ForkSessionResponse, StoreError> {
        rules::fork_target(
            self.shared.get(&op.new_session_id)?.as_ref(),
            &op.new_session_id,
        )?;
        let last_seq = Store::get_session(self, &op.parent)?.last_seq;
        let now = now_unix_ms();
        let mut point = rules::ForkPoint::new(op.at_seq);
        let mut state =
            rules::ForkPrefix::new(&op.new_session_id, &op.parent, op.at_seq, &op.events, now);
        let cancel = CancellationToken::new();
        let _stop = cancel.clone().drop_guard();
        let mut runs = Store::subscribe(self, op.parent.clone(), 1, false, cancel);
        let undecodable =
            |e: log::record::FrameError| StoreError::Internal(format!("a stored event: {e}"));
        'read: while let Some(run) = runs.recv().await {
            let messages: Vec<bytes::Bytes> = match run? {
                EventRun::Framed(framed) => framed.messages().collect::<Result<_, _>>()?,
                EventRun::Decoded(events) => events
                    .iter()
                    .map(|e| bytes::Bytes::from(e.encode_to_vec()))
                    .collect(),
            };
            for message in messages {
                let event = log::record::event_for_state(&message, state.wants_text())
                    .map_err(undecodable)?;
                let done = point.apply(&event);
                if event.seq <= op.at_seq {
                    state.apply(&event);
                }
                if done {
                    break 'read;
                }
            }
        }
        point.verdict(&op.parent, last_seq)?;
        let plan = rules::plan_fork(state, op.events, now)?;
        self.submit(|tx| Op::Fork(Box::new(plan), tx)).await
    }

    /// `SearchSessions` over the full-text index ([`search`]).
    pub async fn search(
        &self,
        op: backend::SearchOp,
        scope: &Scope,
    ) -> Result<agentlog_proto::v1::SearchSessionsResponse, StoreError> {
        let index = self.search.clone().ok_or_else(|| {
            StoreError::Unavailable(
                "this store runs without its search index (--no-search-index)".into(),
            )
        })?;
        let scope = scope.clone();
        tokio::task::spawn_blocking(move || index.search(&op, &scope))
            .await
            .map_err(|e| StoreError::Internal(format!("the search stopped: {e}")))?
    }

    /// Keeps a snapshot of the session if the caller holds its live lease of `lease_epoch`
    /// and `seq` is within the log; returns the seq of the snapshot kept.
    pub async fn put_snapshot(
        &self,
        snapshot: backend::Snapshot,
        lease_epoch: u64,
    ) -> Result<u64, StoreError> {
        let snapshots = self.snapshots.clone();
        let shared = self.shared.clone();
        tokio::task::spawn_blocking(move || {
            // Checked while puts are held off: a deletion that removes the session's
            // snapshots after its tombstone is published either comes after this put (and
            // removes what it wrote) or before it (and this check sees the tombstone).
            snapshots.put(&snapshot, || {
                let meta = shared.get(&snapshot.session_id)?;
                let meta = rules::existing(meta.as_ref(), &snapshot.session_id)?;
                rules::check_snapshot(
                    meta,
                    &snapshot.session_id,
                    lease_epoch,
                    snapshot.seq,
                    now_unix_ms(),
                )
            })
        })
        .await
        .map_err(|e| StoreError::Internal(format!("the snapshot write stopped: {e}")))?
    }

    /// Deletes the session for good (see [`crate::backend`]'s head): its tombstone is durable
    /// on return, and its snapshots are gone; its records leave the log with the next
    /// reclamation of the segments that hold them.
    pub async fn delete_session(&self, session_id: &str) -> Result<(), StoreError> {
        let id = session_id.to_string();
        let deleted = self
            .submit(|tx| Op::Delete(DeleteOp::Session(id), tx))
            .await?;
        crate::metrics::sessions_deleted("request", deleted.len());
        // Again when it was deleted before: the first call may have stopped short of this.
        let snapshots = self.snapshots.clone();
        let id = session_id.to_string();
        tokio::task::spawn_blocking(move || snapshots.remove_sessions([id.as_str()]))
            .await
            .map_err(|e| StoreError::Internal(format!("the snapshot removal stopped: {e}")))?
            .map_err(|e| {
                StoreError::Internal(format!("removing the snapshots of {session_id}: {e}"))
            })
    }

    /// The kept snapshot of `format` for the session, if any: its file is read a piece at a
    /// time on a blocking thread, a few pieces ahead of the caller.
    pub async fn get_snapshot(
        &self,
        session_id: &str,
        format: &str,
    ) -> Result<Option<backend::SnapshotRead>, StoreError> {
        const PIECE_BYTES: usize = 1 << 20;
        const PIECES_AHEAD: usize = 2;
        if self.shared.is_deleted(session_id)? {
            return Err(rules::session_deleted(session_id));
        }
        let snapshots = self.snapshots.clone();
        let (session_id, format) = (session_id.to_string(), format.to_string());
        let opened = tokio::task::spawn_blocking(move || snapshots.open(&session_id, &format))
            .await
            .map_err(|e| StoreError::Internal(format!("the snapshot read stopped: {e}")))??;
        let Some(mut file) = opened else {
            return Ok(None);
        };
        let seq = file.seq;
        let (pieces, read) = tokio::sync::mpsc::channel(PIECES_AHEAD);
        tokio::task::spawn_blocking(move || {
            // Stops at the end, after a failed read, or when the reader went away.
            while let Some(piece) = file.read_piece(PIECE_BYTES).transpose() {
                let failed = piece.is_err();
                if pieces.blocking_send(piece.map(bytes::Bytes::from)).is_err() || failed {
                    break;
                }
            }
        });
        Ok(Some(backend::SnapshotRead {
            seq,
            pieces: Box::pin(tokio_stream::wrappers::ReceiverStream::new(read)),
        }))
    }

    pub fn get_session(&self, session_id: &str) -> Result<SessionInfo, StoreError> {
        let meta = self.shared.get(session_id)?;
        let meta = rules::existing(meta.as_ref(), session_id)?;
        self.info(session_id, meta.clone(), now_unix_ms())
    }

    /// The session's `SessionInfo`, its title read back from the log if its state came
    /// from the index (which keeps the seq of the first user message, not its text).
    fn info(
        &self,
        session_id: &str,
        mut meta: SessionMeta,
        now: i64,
    ) -> Result<SessionInfo, StoreError> {
        self.with_text(session_id, &mut meta)?;
        Ok(meta.info(session_id, now))
    }

    /// Puts the first user message's text back into a state read from the index.
    fn with_text(&self, session_id: &str, meta: &mut SessionMeta) -> Result<(), StoreError> {
        let seq = meta.first_user_seq;
        if seq == 0 || !meta.first_user_text.is_empty() || meta.is_deleted() {
            return Ok(());
        }
        let position = subscriptions::position_of(&self.source, session_id, seq)?;
        let Some(position) = position else {
            return Err(StoreError::Internal(format!(
                "no position of {session_id}/{seq}, its first user message"
            )));
        };
        let event = match self.source.log.read(position).map_err(IndexError::from)? {
            Record::Event(event) => Some(event.into_event()),
            Record::Placed(placed) => placed.decode().ok(),
            _ => None,
        };
        match event {
            Some(event) => {
                if let Some(agentlog_proto::v1::event::Kind::UserMessage(m)) = &event.kind {
                    meta.set_first_user_text(seq, &m.text);
                }
                Ok(())
            }
            _ => Err(StoreError::Internal(format!(
                "{session_id}/{seq} is not an event"
            ))),
        }
    }

    /// Sessions in `scope`, most recently updated first; `page_token` is where the
    /// previous page ended. The index lists every session by status and update time
    /// ([`Index::listed`]); the sessions changed since its last absorb are merged in from
    /// the published states (their place in the index may be stale, so it is passed over).
    /// A page costs the page: a walk of each status's listing from where the previous page
    /// ended, as far as the page needs. A `query` reads each walked session's first
    /// message, so it walks at most [`queries::QUERY_SCAN`] sessions of each status per
    /// call, and a page that ends there says where, for the next to go on from.
    pub fn list_sessions(
        &self,
        req: &ListSessionsRequest,
        scope: &scope::Scope,
    ) -> Result<ListSessionsResponse, StoreError> {
        let query = queries::ListQuery::parse(req)?;
        let now = now_unix_ms();
        let changed: Vec<(String, SessionMeta)> = {
            let sessions = self
                .shared
                .sessions
                .read()
                .unwrap_or_else(|p| p.into_inner());
            sessions
                .iter()
                .map(|(id, m)| (id.clone(), m.clone()))
                .collect()
        };
        let passed_over: HashSet<&str> = changed.iter().map(|(id, _)| id.as_str()).collect();
        let mut found: Vec<(i64, String, SessionMeta)> = Vec::new();
        for (id, meta) in &changed {
            if !scope.admits(id) || index::is_staging(id) || !query.admits_but_text(id, meta) {
                continue;
            }
            let mut meta = meta.clone();
            self.with_text(id, &mut meta)?;
            if query.admits(id, &meta) {
                found.push((meta.updated_unix_ms, id.clone(), meta));
            }
        }
        let statuses: Vec<u8> = match query.status {
            agentlog_proto::v1::SessionStatus::Unspecified => index::LISTED_STATUSES.to_vec(),
            status => vec![status as u8],
        };
        // Where a walk stopped at the query's budget: nothing after the earliest such place
        // was looked at in every status.
        let mut stopped: Option<(i64, String)> = None;
        for status in statuses {
            let (mut matches, stopped_here) = self.walk(status, &query, scope, &passed_over)?;
            found.append(&mut matches);
            if let Some(place) = stopped_here {
                if stopped
                    .as_ref()
                    .is_none_or(|s| queries::listed_before(&place, s))
                {
                    stopped = Some(place);
                }
            }
        }
        if let Some(end) = &stopped {
            found.retain(|(t, id, _)| !queries::listed_before(end, &(*t, id.clone())));
        }
        found.sort_unstable_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
        found.truncate(query.page_size + 1);
        let page = found
            .into_iter()
            .map(|(t, id, meta)| {
                let info = self.info(&id, meta, now)?;
                Ok((t, id, info))
            })
            .collect::<Result<Vec<_>, StoreError>>()?;
        Ok(query.page_through(page, stopped))
    }

    /// One status's listing from where the query's previous page ended: up to a page and
    /// one of the sessions that match, and, if a query's budget ran out first, where.
    #[allow(clippy::type_complexity)]
    fn walk(
        &self,
        status: u8,
        query: &queries::ListQuery,
        scope: &scope::Scope,
        passed_over: &HashSet<&str>,
    ) -> Result<(Vec<(i64, String, SessionMeta)>, Option<(i64, String)>), StoreError> {
        let after = query.after.as_ref().map(|(t, id)| (*t, id.as_str()));
        let mut found = Vec::new();
        let mut walked = 0usize;
        for entry in self.source.index.listed(status, after) {
            let (updated, id) = entry?;
            if passed_over.contains(id.as_str()) || !scope.admits(&id) {
                continue;
            }
            let Some(mut meta) = self.source.index.session(&id)? else {
                continue;
            };
            if !query.text.is_empty() {
                walked += 1;
                self.with_text(&id, &mut meta)?;
                if !query.matches_text(&id, &meta) {
                    if walked >= queries::QUERY_SCAN {
                        return Ok((found, Some((updated, id))));
                    }
                    continue;
                }
            }
            found.push((updated, id, meta));
            if found.len() > query.page_size {
                break;
            }
            if walked >= queries::QUERY_SCAN {
                let (t, id, _) = found.last().expect("pushed");
                let place = (*t, id.clone());
                return Ok((found, Some(place)));
            }
        }
        Ok((found, None))
    }

    /// Streams the session from `from_seq` (history, then live with `follow`) into a
    /// bounded channel; a slow reader only ever delays itself.
    pub fn subscribe(
        &self,
        session_id: String,
        from_seq: u64,
        follow: bool,
        cancel: CancellationToken,
    ) -> mpsc::Receiver<Result<EventRun, StoreError>> {
        let (tx, rx) = mpsc::channel(backend::QUEUED_RUNS);
        tokio::spawn(subscriptions::run(
            self.source.clone(),
            session_id,
            from_seq,
            follow,
            tx,
            cancel,
        ));
        rx
    }
}

// Sessions that move: export's walk, pins, imports.
impl Store {
    /// The sessions after `after` in id order, deleted ones too, from the index and the
    /// states published since its last absorb.
    pub fn session_ids(
        &self,
        after: &str,
        limit: usize,
        scope: &Scope,
    ) -> Result<Vec<backend::ListedId>, StoreError> {
        const WALK: usize = 256;
        let mut found: std::collections::BTreeMap<String, i64> = Default::default();
        // The index's ids, from `after` on, until `limit` of them are in scope: `upper` is
        // the last one walked (none: the index ended), up to which the page is complete.
        let mut from = after.to_string();
        let mut in_scope = 0;
        let upper = loop {
            let page = self.source.index.sessions_after(&from, WALK)?;
            for (id, meta) in &page {
                if scope.admits(id) && (meta.last_seq > 0 || meta.is_deleted()) {
                    found.insert(id.clone(), meta.deleted_unix_ms);
                    in_scope += 1;
                }
            }
            match page.last() {
                Some((last, _)) if page.len() == WALK => from.clone_from(last),
                _ => break None,
            }
            if in_scope >= limit {
                break Some(from.clone());
            }
        };
        // The states published since the last absorb (the index may lack them, or hold
        // them as they were before).
        let sessions = self
            .shared
            .sessions
            .read()
            .unwrap_or_else(|p| p.into_inner());
        for (id, meta) in sessions.iter() {
            let within = id.as_str() > after && upper.as_ref().is_none_or(|u| id <= u);
            if within
                && scope.admits(id)
                && !index::is_staging(id)
                && (meta.last_seq > 0 || meta.is_deleted())
            {
                found.insert(id.clone(), meta.deleted_unix_ms);
            }
        }
        Ok(found
            .into_iter()
            .take(limit)
            .map(|(session_id, deleted_unix_ms)| backend::ListedId {
                session_id,
                deleted_unix_ms,
            })
            .collect())
    }

    pub async fn pin(&self, session_id: &str, pinned: bool) -> Result<SessionInfo, StoreError> {
        let id = session_id.to_string();
        let meta = self.submit(|tx| Op::Pin(id, pinned, tx)).await?;
        self.info(session_id, meta, now_unix_ms())
    }

    pub async fn expiring(
        &self,
        idle_before: i64,
        max: usize,
    ) -> Result<Vec<backend::Expiring>, StoreError> {
        let (tx, rx) = oneshot::channel();
        let op = Op::Expiring {
            idle_before,
            max,
            reply: tx,
        };
        self.queue.send(op).await.map_err(|_| gone())?;
        let found = rx.await.map_err(|_| gone())??;
        Ok(found
            .into_iter()
            .map(|(session_id, last_seq)| backend::Expiring {
                session_id,
                read_at: last_seq as i64,
            })
            .collect())
    }

    pub async fn delete_expiring(
        &self,
        expiring: &backend::Expiring,
        idle_before: i64,
    ) -> Result<bool, StoreError> {
        let op = DeleteOp::IfExpired {
            session_id: expiring.session_id.clone(),
            idle_before,
            last_seq: expiring.read_at as u64,
        };
        let deleted = self.submit(|tx| Op::Delete(op, tx)).await?;
        if deleted.is_empty() {
            return Ok(false);
        }
        crate::metrics::sessions_deleted("retention", 1);
        let snapshots = self.snapshots.clone();
        let id = expiring.session_id.clone();
        let removed = tokio::task::spawn_blocking(move || snapshots.remove_sessions([id.as_str()]))
            .await
            .map_err(|e| StoreError::Internal(format!("the snapshot removal stopped: {e}")))?;
        if let Err(e) = removed {
            tracing::warn!(error = %e, "removing a deleted session's snapshots failed; the next open does it");
        }
        Ok(true)
    }

    pub async fn import_deletion(
        &self,
        session_id: &str,
        deleted_unix_ms: i64,
    ) -> Result<bool, StoreError> {
        let op = DeleteOp::Imported {
            session_id: session_id.to_string(),
            deleted_unix_ms,
        };
        let deleted = self.submit(|tx| Op::Delete(op, tx)).await?;
        Ok(!deleted.is_empty())
    }
}

impl Drop for Store {
    /// The background threads let go of the writer's queue (a store dropped without
    /// [`Store::close`] still lets its writer finish).
    fn drop(&mut self) {
        self.background.iter().for_each(signal::Signal::stop);
    }
}

/// The local log: one replica, its segment files and sled index on a volume.
#[tonic::async_trait]
impl Backend for Store {
    async fn append(&self, op: AppendOp) -> Result<AppendResponse, StoreError> {
        Store::append(self, op).await
    }

    fn subscribe(
        &self,
        session_id: String,
        from_seq: u64,
        follow: bool,
        cancel: CancellationToken,
    ) -> mpsc::Receiver<Result<EventRun, StoreError>> {
        Store::subscribe(self, session_id, from_seq, follow, cancel)
    }

    async fn get_session(&self, session_id: &str) -> Result<SessionInfo, StoreError> {
        Store::get_session(self, session_id)
    }

    async fn list_sessions(
        &self,
        req: &ListSessionsRequest,
        scope: &Scope,
    ) -> Result<ListSessionsResponse, StoreError> {
        Store::list_sessions(self, req, scope)
    }

    async fn acquire_lease(
        &self,
        session_id: String,
        owner: String,
        ttl_ms: u64,
    ) -> Result<Lease, StoreError> {
        Store::acquire_lease(self, session_id, owner, ttl_ms).await
    }

    async fn renew_lease(
        &self,
        session_id: String,
        owner: String,
        epoch: u64,
        ttl_ms: u64,
    ) -> Result<Lease, StoreError> {
        Store::renew_lease(self, session_id, owner, epoch, ttl_ms).await
    }

    async fn release_lease(
        &self,
        session_id: String,
        owner: String,
        epoch: u64,
    ) -> Result<(), StoreError> {
        Store::release_lease(self, session_id, owner, epoch).await
    }

    async fn claim(
        &self,
        owner: String,
        ttl_ms: u64,
        wait: Duration,
        cancel: &CancellationToken,
        scope: &Scope,
    ) -> Result<Option<Lease>, StoreError> {
        Store::claim(self, owner, ttl_ms, wait, cancel, scope).await
    }

    async fn put_snapshot(&self, snapshot: Snapshot, lease_epoch: u64) -> Result<u64, StoreError> {
        Store::put_snapshot(self, snapshot, lease_epoch).await
    }

    async fn get_snapshot(
        &self,
        session_id: &str,
        format: &str,
    ) -> Result<Option<SnapshotRead>, StoreError> {
        Store::get_snapshot(self, session_id, format).await
    }

    async fn delete_session(&self, session_id: &str) -> Result<(), StoreError> {
        Store::delete_session(self, session_id).await
    }

    /// Not serving while the log's volume is full (appends resume by themselves once there
    /// is room); a writer that stopped ends the process, and a restart recovers.
    fn serving(&self) -> watch::Receiver<bool> {
        Store::serving(self)
    }

    async fn enqueue_append(&self, op: AppendOp) -> Result<AppendAnswer, StoreError> {
        Ok(Box::pin(Store::enqueue_append(self, op).await?))
    }

    async fn search(
        &self,
        op: backend::SearchOp,
        scope: &Scope,
    ) -> Result<agentlog_proto::v1::SearchSessionsResponse, StoreError> {
        Store::search(self, op, scope).await
    }

    async fn fork(&self, op: ForkOp) -> Result<ForkSessionResponse, StoreError> {
        Store::fork(self, op).await
    }

    async fn session_ids(
        &self,
        after: &str,
        limit: usize,
        scope: &Scope,
    ) -> Result<Vec<backend::ListedId>, StoreError> {
        Store::session_ids(self, after, limit, scope)
    }

    async fn pin(&self, session_id: &str, pinned: bool) -> Result<SessionInfo, StoreError> {
        Store::pin(self, session_id, pinned).await
    }

    async fn begin_import(&self, session_id: &str) -> Result<Box<dyn Staging>, StoreError> {
        Ok(Box::new(import::LocalStaging::begin(
            self.queue.clone(),
            &self.staging_names,
            session_id,
        )))
    }

    async fn import_deletion(
        &self,
        session_id: &str,
        deleted_unix_ms: i64,
    ) -> Result<bool, StoreError> {
        Store::import_deletion(self, session_id, deleted_unix_ms).await
    }

    async fn expiring(
        &self,
        idle_before: i64,
        max: usize,
    ) -> Result<Vec<backend::Expiring>, StoreError> {
        Store::expiring(self, idle_before, max).await
    }

    async fn delete_expiring(
        &self,
        expiring: &backend::Expiring,
        idle_before: i64,
    ) -> Result<bool, StoreError> {
        Store::delete_expiring(self, expiring, idle_before).await
    }
}

fn gone() -> StoreError {
    StoreError::Unavailable("the store is shutting down (or its disk failed); retry".into())
}

fn granted(outcome: LeaseOutcome) -> Result<Lease, StoreError> {
    match outcome {
        LeaseOutcome::Granted(lease) => Ok(lease),
        _ => Err(StoreError::Internal(
            "lease operation returned no lease".into(),
        )),
    }
}

/// How long an append that is the only one in flight keeps its tokio worker looking for the
/// writer's answer (yielding to any other task) before the worker may sleep: about one
/// fdatasync. A sleeping worker is woken by the answer, and on a virtual machine whose idle
/// cores halt, that wake-up costs an append at low load as much as the fdatasync itself.
/// Under load the workers have other tasks and appends are never alone, so nothing spins;
/// on fewer than two CPUs nothing spins either ([`writer::may_look_again`]).
const ANSWER_SPIN: Duration = Duration::from_micros(250);

/// The writer's answer, or `None` if the writer is gone.
async fn answer_of<T>(mut rx: oneshot::Receiver<T>, alone: bool) -> Option<T> {
    if alone && writer::may_look_again() {
        let since = std::time::Instant::now();
        while since.elapsed() < ANSWER_SPIN {
            match rx.try_recv() {
                Ok(answer) => return Some(answer),
                Err(oneshot::error::TryRecvError::Closed) => return None,
                Err(oneshot::error::TryRecvError::Empty) => look_again().await,
            }
        }
    }
    rx.await.ok()
}

/// Lets the worker's other tasks take their turns, then polls the caller again, on this
/// worker. `tokio::task::yield_now` sends the worker searching for work, and a worker that
/// stops searching wakes a sleeping one to search in its place: each round of the look
/// woke the other worker for nothing (4.5 voluntary and 3.7 involuntary context switches
/// per worker per append at one client, against 1.2 and 0.6 this way; latency and CPU the
/// same).
async fn look_again() {
    let mut woken = false;
    std::future::poll_fn(|cx| {
        if woken {
            return std::task::Poll::Ready(());
        }
        woken = true;
        cx.waker().wake_by_ref();
        std::task::Poll::Pending
    })
    .await
}
