//! agentlog's event store: per-session append-only logs that acknowledge only what is
//! durable, with live subscriptions and leases with fencing epochs.
//!
//! - [`log`]: our CRC-framed segment files; the `fdatasync` that makes an ack true.
//! - [`index`]: sled, rebuilt from the log past the offset it had absorbed, and kept up to
//!   date behind the acknowledgements.
//! - [`rules`]: the append and lease rules, pure functions both backends decide by;
//!   [`session`]: the session state they decide on, derived from the log.
//! - [`writer`]: the single writer thread doing group commit.
//! - [`subscriptions`]: history then live, with disk catch-up for slow readers.
//! - [`service`]: the gRPC edge: validation, limits, status codes, over any [`backend`]:
//!   this local log ([`Store`]) or [`postgres`].
//! - [`auth`], [`limits`], [`tls`]: who may call, how much, and over what; [`scope`]: the
//!   one rule for which sessions a caller may see.
//! - [`metrics`]: what the store reports to Prometheus.
#![forbid(unsafe_code)]

pub mod auth;
pub mod backend;
pub mod error;
pub mod incoming;
pub mod index;
pub mod limits;
pub mod log;
pub mod metrics;
pub mod postgres;
pub mod rules;
pub mod scope;
pub mod service;
pub mod session;
pub mod subscribe_wire;
pub mod subscriptions;
pub mod tls;
pub mod wire;
pub mod writer;

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use agentlog_proto::v1::{
    AppendResponse, Event, Lease, ListSessionsRequest, ListSessionsResponse, SessionInfo,
    SessionStatus,
};
use prost::Message;
use tokio::sync::{mpsc, oneshot, watch, Semaphore};
use tokio_util::sync::CancellationToken;

use backend::WireEvent;
pub use error::StoreError;
use index::{Index, IndexBatch, IndexError, Recent};
use log::storage::{FsStorage, Storage};
use log::{LogError, LogWriter, Record};
use session::{now_unix_ms, SessionMeta};
use subscriptions::{Hub, Source};
pub use writer::AppendOp;
use writer::{LeaseOp, LeaseOutcome, Op, Writer};

/// Pending operations the writer may have queued; beyond this, callers wait (backpressure).
const QUEUE_DEPTH: usize = 8192;
/// Event bytes (in KiB) that may wait for the writer at once; beyond this, appends wait, so
/// a flood of 4 MiB appends cannot exhaust memory.
const QUEUED_KIB: usize = 64 * 1024;
/// Recovery writes replayed records into the index in batches of this many.
const REPLAY_BATCH: usize = 10_000;

#[derive(Debug, thiserror::Error)]
pub enum OpenError {
    #[error(transparent)]
    Index(#[from] IndexError),
    #[error(transparent)]
    Log(#[from] LogError),
    #[error("data dir {0}: {1}")]
    DataDir(String, std::io::Error),
}

/// What the writer has made durable, as readers see it.
pub struct Shared {
    sessions: RwLock<HashMap<String, SessionMeta>>,
    hub: Arc<Hub>,
    /// Where the durable records the index has not absorbed yet are.
    recent: Arc<Recent>,
    /// Bumped whenever a session may have become claimable.
    claimable: watch::Sender<u64>,
    /// Why appends are refused, while the log's volume is full.
    full: watch::Sender<Option<String>>,
    /// Whether appends can be acknowledged now (false while the volume is full): what
    /// health reports for `agentlog.v1.EventStore`.
    serving: watch::Sender<bool>,
}

impl Shared {
    /// Called by the writer after the fsync of a batch, with the batch's records.
    fn publish(&self, records: Vec<Record>, sessions: &HashMap<String, SessionMeta>, now: i64) {
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
        // Each run of one session's events goes to its followers as one slice, in order.
        let mut run: Vec<Event> = Vec::new();
        for record in records {
            let Record::Event(event) = record else {
                continue;
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

    /// The log's volume is full (`Some(why)`) or has room again (`None`).
    fn set_full(&self, reason: Option<String>) {
        self.serving.send_replace(reason.is_none());
        self.full.send_replace(reason);
    }

    fn get(&self, session_id: &str) -> Option<SessionMeta> {
        let sessions = self.sessions.read().unwrap_or_else(|p| p.into_inner());
        sessions.get(session_id).filter(|m| m.last_seq > 0).cloned()
    }
}

/// Where the store keeps its data.
pub struct StoreConfig {
    /// Segment files.
    pub log: Arc<dyn Storage>,
    /// The sled index directory.
    pub index_dir: std::path::PathBuf,
    pub log_config: log::LogConfig,
}

impl StoreConfig {
    /// `<data-dir>/log/` and `<data-dir>/index/` on the real filesystem.
    pub fn in_dir(data_dir: &Path) -> Result<StoreConfig, OpenError> {
        let log_dir = data_dir.join("log");
        let storage = FsStorage::open_dir(&log_dir)
            .map_err(|e| OpenError::DataDir(log_dir.display().to_string(), e))?;
        Ok(StoreConfig {
            log: Arc::new(storage),
            index_dir: data_dir.join("index"),
            log_config: log::LogConfig::default(),
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
}

impl Store {
    /// Opens (and recovers) the store: replays the log past what the index absorbed,
    /// dropping a torn tail, then starts the writer.
    pub fn open(config: StoreConfig) -> Result<Store, OpenError> {
        let index = Index::open(&config.index_dir)?;
        let (log, sessions) = match recover(&config, &index) {
            Err(OpenError::Log(LogError::IndexAhead { absorbed, end })) => {
                tracing::warn!(
                    absorbed,
                    end,
                    "the index is ahead of the log (was the log restored from an older \
                     backup?); rebuilding the index from the whole log"
                );
                index.clear()?;
                recover(&config, &index)?
            }
            other => other?,
        };
        let shared = Arc::new(Shared {
            sessions: RwLock::new(sessions.clone()),
            hub: Arc::new(Hub::default()),
            recent: Arc::new(Recent::default()),
            claimable: watch::channel(0).0,
            full: watch::channel(None).0,
            serving: watch::channel(true).0,
        });
        let source = Source {
            hub: shared.hub.clone(),
            index: index.clone(),
            recent: shared.recent.clone(),
            log: log.reader(),
        };
        let (queue, rx) = mpsc::channel(QUEUE_DEPTH);
        let (done_tx, writer_done) = watch::channel(false);
        let writer = Writer::new(log, index, sessions, shared.clone());
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
        Ok(Store {
            queue,
            queued_kib: Arc::new(Semaphore::new(QUEUED_KIB)),
            shared,
            source,
            writer: Some(writer),
            writer_done,
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
        let bytes: usize = op.events.iter().map(Message::encoded_len).sum();
        let kib = (bytes / 1024 + 1).min(QUEUED_KIB) as u32;
        let budget = self
            .queued_kib
            .clone()
            .acquire_many_owned(kib)
            .await
            .map_err(|_| StoreError::Unavailable("the store is shutting down".into()))?;
        let (tx, rx) = oneshot::channel();
        self.queue
            .send(Op::Append(op, tx, tracing::Span::current()))
            .await
            .map_err(|_| gone())?;
        Ok(async move {
            let answer = rx.await.map_err(|_| gone())?;
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
        let deadline = tokio::time::Instant::now() + wait;
        let mut changes = self.shared.claimable.subscribe();
        loop {
            changes.borrow_and_update();
            let claim = LeaseOp::Claim {
                owner: owner.clone(),
                ttl_ms,
                scope: scope.clone(),
            };
            let outcome = self.submit(|tx| Op::Lease(claim, tx)).await?;
            let retry_at = match outcome {
                LeaseOutcome::Granted(lease) => return Ok(Some(lease)),
                LeaseOutcome::Released => return Ok(None),
                LeaseOutcome::NothingToClaim {
                    next_expiry_unix_ms,
                } => next_expiry_unix_ms,
            };
            let mut wake = deadline;
            if let Some(at) = retry_at {
                let in_ms = (at - now_unix_ms()).max(0) as u64 + 1;
                wake = wake.min(tokio::time::Instant::now() + Duration::from_millis(in_ms));
            }
            tokio::select! {
                _ = cancel.cancelled() => return Ok(None),
                _ = changes.changed() => {}
                _ = tokio::time::sleep_until(wake) => {}
            }
            if tokio::time::Instant::now() >= deadline {
                return Ok(None);
            }
        }
    }

    pub fn get_session(&self, session_id: &str) -> Result<SessionInfo, StoreError> {
        self.shared
            .get(session_id)
            .map(|m| m.info(session_id, now_unix_ms()))
            .ok_or_else(|| {
                StoreError::Refused(
                    agentlog_proto::reason::Reason::SessionNotFound,
                    format!("session {session_id} does not exist"),
                )
            })
    }

    /// Sessions in `scope`, most recently updated first; `page_token` is where the
    /// previous page ended.
    pub fn list_sessions(
        &self,
        req: &ListSessionsRequest,
        scope: &scope::Scope,
    ) -> Result<ListSessionsResponse, StoreError> {
        const MAX_PAGE: usize = 1000;
        let page_size = match req.page_size as usize {
            0 => 100,
            n => n.min(MAX_PAGE),
        };
        let after = parse_page_token(&req.page_token)?;
        let query = req.query.to_lowercase();
        let status = SessionStatus::try_from(req.status).map_err(|_| {
            StoreError::InvalidArgument(format!("status: {} is not a SessionStatus", req.status))
        })?;
        let now = now_unix_ms();
        let mut matches: Vec<(i64, String, SessionInfo)> = {
            let sessions = self
                .shared
                .sessions
                .read()
                .unwrap_or_else(|p| p.into_inner());
            sessions
                .iter()
                .filter(|(id, m)| m.last_seq > 0 && scope.admits(id))
                .filter(|(_, m)| status == SessionStatus::Unspecified || m.status() == status)
                .filter(|(id, m)| {
                    query.is_empty()
                        || id.to_lowercase().contains(&query)
                        || m.first_user_text.to_lowercase().contains(&query)
                })
                .filter(|(id, m)| match &after {
                    None => true,
                    Some((t, last)) => {
                        m.updated_unix_ms < *t
                            || (m.updated_unix_ms == *t && id.as_str() > last.as_str())
                    }
                })
                .map(|(id, m)| (m.updated_unix_ms, id.clone(), m.info(id, now)))
                .collect()
        };
        matches.sort_unstable_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));
        let more = matches.len() > page_size;
        matches.truncate(page_size);
        let next_page_token = match (more, matches.last()) {
            (true, Some((t, id, _))) => format!("{t}/{id}"),
            _ => String::new(),
        };
        Ok(ListSessionsResponse {
            sessions: matches.into_iter().map(|(_, _, info)| info).collect(),
            next_page_token,
        })
    }

    /// Streams the session from `from_seq` (history, then live with `follow`) into a
    /// bounded channel; a slow reader only ever delays itself.
    pub fn subscribe(
        &self,
        session_id: String,
        from_seq: u64,
        follow: bool,
        cancel: CancellationToken,
    ) -> mpsc::Receiver<Result<Vec<WireEvent>, StoreError>> {
        let (tx, rx) = mpsc::channel(subscriptions::QUEUED_RUNS);
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

/// `updated_unix_ms/session_id` of the last session of the previous page (every backend
/// pages the same way).
pub(crate) fn parse_page_token(token: &str) -> Result<Option<(i64, String)>, StoreError> {
    if token.is_empty() {
        return Ok(None);
    }
    let bad = || {
        StoreError::InvalidArgument(
            "page_token: not a token from a previous ListSessions response".into(),
        )
    };
    let (t, id) = token.split_once('/').ok_or_else(bad)?;
    Ok(Some((t.parse().map_err(|_| bad())?, id.to_string())))
}

/// Replays the log past the index's absorbed offset into the index and the session map.
fn recover(
    config: &StoreConfig,
    index: &Index,
) -> Result<(LogWriter, HashMap<String, SessionMeta>), OpenError> {
    let from = index.absorbed()?;
    let mut sessions = index.load_sessions()?;
    let mut batch = IndexBatch::default();
    let mut pending = 0usize;
    let mut replayed = 0u64;
    let mut failure: Option<IndexError> = None;
    let started = std::time::Instant::now();
    let log = LogWriter::open(config.log.clone(), config.log_config, from, |append| {
        for (pos, record) in append {
            if failure.is_some() {
                return;
            }
            let meta = sessions.entry(record.session_id().to_string()).or_default();
            match record {
                Record::Event(event) => {
                    if event.seq != meta.last_seq + 1 {
                        failure = Some(IndexError::SeqGap {
                            offset: pos.offset,
                            session: event.session_id.clone(),
                            seq: event.seq,
                            expected: meta.last_seq + 1,
                        });
                        return;
                    }
                    meta.apply_event(event);
                }
                Record::Lease(lease) => meta.apply_lease(lease),
            }
            batch.add(*pos, record);
            pending += 1;
            replayed += 1;
        }
        // Absorbed offsets are always append boundaries.
        if pending >= REPLAY_BATCH {
            let end = append
                .last()
                .map_or(0, |(pos, _)| pos.offset + pos.len as u64);
            let full = std::mem::take(&mut batch);
            if let Err(e) = index.apply(full, &sessions, end) {
                failure = Some(e);
            }
            pending = 0;
        }
    })?;
    if let Some(e) = failure {
        return Err(e.into());
    }
    if !batch.is_empty() || from != log.end() {
        index.apply(batch, &sessions, log.end())?;
    }
    tracing::info!(
        from_offset = from,
        log_end = log.end(),
        replayed,
        sessions = sessions.len(),
        elapsed_ms = started.elapsed().as_millis() as u64,
        "recovered the index from the log"
    );
    Ok((log, sessions))
}
