//! The PostgreSQL backend: every session, event, lease and dedup entry lives in the
//! database, and any number of store replicas serve it at once.
//!
//! How it keeps the contract of [`crate::backend`]:
//! - **One round trip per append.** Each replica caches the sessions it has seen lately
//!   (their [`SessionMeta`](crate::session::SessionMeta) and row `version`, within
//!   `--session-cache` bytes, so that no replica holds every session). An append runs the
//!   same rules as the local log ([`crate::rules`]) against that state, then sends one
//!   statement that lands only if the session row is still at that version and none of the
//!   event ids exists; if the state was stale, the replica re-reads the row and tries again
//!   ([`append`]).
//! - **Group commit** at two levels: the appends waiting on a replica are written together
//!   in one statement and one transaction ([`batch`]; a refusal or a stale state of one
//!   never fails the others), and the few batches in flight at once, on a pool of
//!   connections, share WAL flushes in PostgreSQL. An acknowledgement means committed with
//!   `synchronous_commit` on (on a standby too, with synchronous replication);
//!   `DURABILITY_BUFFERED` appends are committed the same way.
//! - **Live tail across replicas** without NOTIFY in the append transaction: see [`wake`].
//! - **ClaimSession** picks with `FOR UPDATE SKIP LOCKED`: one claimant per session across
//!   replicas, and claimants never queue behind each other ([`claims`]).
//! - **Deletion**: the session row becomes its tombstone, then its rows are erased in
//!   bounded transactions, by the deleting replica or any replica's sweep ([`deletion`]).
//! - **Forks share their parent's prefix**: the fork's row names its base and only its own
//!   events get rows; reads and dedup go down the line of bases in one statement
//!   ([`rows`]), and a deleted session's erasure first makes the prefix of every live fork
//!   reading through it the fork's own ([`fork`], [`deletion`]).
//! - **AppendStream pipelines**: a stream's appends are queued per session behind the
//!   ones before them and written together as they arrive ([`pipeline`]), so a stream's
//!   next request is read while the previous ones commit.
//! - **The database unreachable** (down, read-only during a failover, or silently cut
//!   off): a call answers `UNAVAILABLE` within about 2 s ([`connection`]), never an
//!   acknowledgement that did not commit (an append whose commit is in doubt is settled by
//!   its retry with the same event ids); health turns NOT_SERVING and, until its probe
//!   finds the database answering again, appends are answered at once ([`health`]); the
//!   pool reconnects (a multi-host URL with `target_session_attrs=read-write` finds the new
//!   primary) and the store serves again by itself.
//!
//! One concern a file. Each call is in a file of its own, as methods of
//! [`replica::Replica`]: [`append`] and [`pipeline`] (AppendStream's, on top of append's
//! plan), [`fork`], [`subscriptions`], [`listing`] (GetSession, ListSessions), [`leases`],
//! [`claims`], [`snapshots`], [`deletion`] (the tombstone and the erasure) and
//! [`retention`] (which deletes as deletion does); [`export`] (the walk of every id),
//! [`import`] (a session's rows in one transaction) and [`pin`]. Below them, what they share, each file
//! [`claims`], [`snapshots`], [`deletion`] (the tombstone and the erasure),
//! [`retention`] (which deletes as deletion does) and [`search`] (`SearchSessions` over
//! PostgreSQL's full-text search). Below them, what they share, each file
//! importing only the ones after it: [`replica`] (one replica's state: the cache of
//! states, the optimistic write's re-read, the wake-ups a write sends), [`batch`] (the
//! batch writer), [`wake`], [`health`], [`rows`] (how a session lies in the tables),
//! [`connection`] (the pool, the bound on a round trip, the migration at start) and
//! [`schema`]. Nothing below imports a call's file. A new call or concern (a search, an
//! export) is a file of its own beside the calls, with its line in the `Backend` impl here.
//!
//! [`PgBackend`] is the facade the gRPC service runs over (through [`super::Backend`]):
//! it opens the replica, starts its background tasks, and hands each call to its file.

mod append;
mod batch;
mod claims;
mod connection;
mod deletion;
mod export;
mod fork;
mod health;
mod import;
mod leases;
mod listing;
mod pin;
mod pipeline;
mod replica;
mod retention;
mod rows;
pub mod schema;
mod search;
mod snapshots;
mod subscriptions;
pub mod wake;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentlog_proto::v1::{
    AppendResponse, ForkSessionResponse, Lease, ListSessionsRequest, ListSessionsResponse,
    SearchSessionsResponse, SessionInfo,
};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::backend::{
    AppendAnswer, AppendOp, Backend, EventRun, Expiring, ForkOp, ListedId, SearchOp, Snapshot,
    SnapshotRead, Staging,
};
use crate::retention::Retention;
use crate::scope::Scope;
use crate::StoreError;
use connection::Connector;
use replica::{Replica, StateCache};
use wake::Board;

pub use connection::PgOpenError;
pub use retention::RETENTION_LOCK;
pub use wake::NotifyMode;

/// How to reach the database.
#[derive(Debug, Clone)]
pub struct PgConfig {
    /// `postgres://…` or `host=… user=…`; several hosts with
    /// `target_session_attrs=read-write` ride out a failover.
    pub url: String,
    /// PEM CA certificates trusted for TLS to the database (besides the public roots).
    pub ca_file: Option<PathBuf>,
    /// Connections in the pool (appends in flight at once).
    pub pool_size: usize,
    pub notify: NotifyMode,
    /// How often followers and claimants re-read without a wake-up.
    pub poll_interval: Duration,
    /// `--retain-idle`, if set (run by one replica at a time).
    pub retention: Option<Retention>,
    /// `--session-cache`: bytes of sessions' states the replica keeps at hand (the
    /// database holds them all; a state not at hand is read with the next append's row).
    pub cache_bytes: usize,
    /// Whether appends write their searchable text for `SearchSessions` (off: the search
    /// answers `UNAVAILABLE`; for measuring what the index costs).
    pub search: bool,
}

/// The backend: a handle on one replica, and the lanes of its pipelined appends
/// ([`pipeline`]); the background tasks stop when the last handle on the replica is
/// dropped.
#[derive(Clone)]
pub struct PgBackend {
    replica: Arc<Replica>,
    /// Each session's appends queued by AppendStream on this replica, in order.
    lanes: Arc<pipeline::Lanes>,
}

impl PgBackend {
    /// Connects, creates or migrates the schema (retrying with backoff while the database
    /// is unreachable), and starts the background tasks.
    pub async fn open(config: PgConfig) -> Result<PgBackend, PgOpenError> {
        let connector = Arc::new(Connector::new(
            &config.url,
            config.ca_file.as_ref(),
            config.pool_size,
        )?);
        connection::migrate_with_retry(&connector).await?;

        let tasks = CancellationToken::new();
        let board = Arc::new(Board::default());
        let notify = match config.notify {
            NotifyMode::Listen => {
                let (tx, rx) = mpsc::unbounded_channel();
                tokio::spawn(wake::send_batches(connector.clone(), rx, tasks.clone()));
                tokio::spawn(wake::listen(
                    connector.clone(),
                    board.clone(),
                    tasks.clone(),
                ));
                Some(tx)
            }
            NotifyMode::Poll => None,
        };
        let health = health::start(connector.clone(), tasks.clone());
        let writes = batch::start(
            connector.clone(),
            health.clone(),
            batch::batches_in_flight(config.pool_size),
            tasks.clone(),
            config.search,
        );
        tokio::spawn(deletion::sweep_erasures(connector.clone(), tasks.clone()));
        if config.search {
            tokio::spawn(search::backfill(connector.clone(), tasks.clone()));
        }
        if let Some(retention) = config.retention {
            tokio::spawn(retention::run_retention(
                connector.clone(),
                board.clone(),
                notify.clone(),
                retention,
                tasks.clone(),
            ));
        }
        tracing::info!(
            pool_size = config.pool_size,
            notify = ?config.notify,
            schema_version = schema::VERSION,
            "connected to PostgreSQL"
        );
        Ok(PgBackend {
            replica: Arc::new(Replica {
                connector,
                board,
                notify,
                cache: Mutex::new(StateCache::new(config.cache_bytes)),
                writes,
                health,
                poll_interval: config.poll_interval,
                tasks,
                search: config.search,
            }),
            lanes: Arc::default(),
        })
    }

    /// The connection pool, for its metrics.
    pub fn pool_metrics(&self) -> crate::metrics::PgPool {
        crate::metrics::PgPool(self.replica.connector.pool.clone())
    }
}

/// PostgreSQL: any number of replicas over one database; each call in its own file.
#[tonic::async_trait]
impl Backend for PgBackend {
    async fn append(&self, op: AppendOp) -> Result<AppendResponse, StoreError> {
        self.replica.append(op).await
    }

    async fn fork(&self, op: ForkOp) -> Result<ForkSessionResponse, StoreError> {
        self.replica.fork(op).await
    }

    fn subscribe(
        &self,
        session_id: String,
        from_seq: u64,
        follow: bool,
        cancel: CancellationToken,
    ) -> mpsc::Receiver<Result<EventRun, StoreError>> {
        self.replica.subscribe(session_id, from_seq, follow, cancel)
    }

    async fn get_session(&self, session_id: &str) -> Result<SessionInfo, StoreError> {
        self.replica.get_session(session_id).await
    }

    async fn list_sessions(
        &self,
        req: &ListSessionsRequest,
        scope: &Scope,
    ) -> Result<ListSessionsResponse, StoreError> {
        self.replica.list_sessions(req, scope).await
    }

    async fn acquire_lease(
        &self,
        session_id: String,
        owner: String,
        ttl_ms: u64,
    ) -> Result<Lease, StoreError> {
        self.replica.acquire_lease(session_id, owner, ttl_ms).await
    }

    async fn renew_lease(
        &self,
        session_id: String,
        owner: String,
        epoch: u64,
        ttl_ms: u64,
    ) -> Result<Lease, StoreError> {
        self.replica
            .renew_lease(session_id, owner, epoch, ttl_ms)
            .await
    }

    async fn release_lease(
        &self,
        session_id: String,
        owner: String,
        epoch: u64,
    ) -> Result<(), StoreError> {
        self.replica.release_lease(session_id, owner, epoch).await
    }

    async fn claim(
        &self,
        owner: String,
        ttl_ms: u64,
        wait: Duration,
        cancel: &CancellationToken,
        scope: &Scope,
    ) -> Result<Option<Lease>, StoreError> {
        self.replica.claim(owner, ttl_ms, wait, cancel, scope).await
    }

    async fn put_snapshot(&self, snapshot: Snapshot, lease_epoch: u64) -> Result<u64, StoreError> {
        self.replica.put_snapshot(snapshot, lease_epoch).await
    }

    async fn get_snapshot(
        &self,
        session_id: &str,
        format: &str,
    ) -> Result<Option<SnapshotRead>, StoreError> {
        self.replica.get_snapshot(session_id, format).await
    }

    async fn delete_session(&self, session_id: &str) -> Result<(), StoreError> {
        self.replica.delete_session(session_id).await
    }

    fn serving(&self) -> watch::Receiver<bool> {
        self.replica.health.serving.subscribe()
    }

    async fn enqueue_append(&self, op: AppendOp) -> Result<AppendAnswer, StoreError> {
        Ok(self.lanes.enqueue(&self.replica, op))
    }

    async fn session_ids(
        &self,
        after: &str,
        limit: usize,
        scope: &Scope,
    ) -> Result<Vec<ListedId>, StoreError> {
        self.replica.session_ids(after, limit, scope).await
    }

    async fn pin(&self, session_id: &str, pinned: bool) -> Result<SessionInfo, StoreError> {
        self.replica.pin(session_id, pinned).await
    }

    async fn begin_import(&self, session_id: &str) -> Result<Box<dyn Staging>, StoreError> {
        Ok(Box::new(self.replica.begin_import(session_id).await?))
    }

    async fn import_deletion(
        &self,
        session_id: &str,
        deleted_unix_ms: i64,
    ) -> Result<bool, StoreError> {
        self.replica
            .import_deletion(session_id, deleted_unix_ms)
            .await
    }

    async fn expiring(&self, idle_before: i64, max: usize) -> Result<Vec<Expiring>, StoreError> {
        self.replica.expiring(idle_before, max).await
    }

    async fn delete_expiring(
        &self,
        expiring: &Expiring,
        _idle_before: i64,
    ) -> Result<bool, StoreError> {
        self.replica.delete_expiring(expiring).await
    }

    async fn search(
        &self,
        op: SearchOp,
        scope: &Scope,
    ) -> Result<SearchSessionsResponse, StoreError> {
        self.replica.search(op, scope).await
    }
}
