//! The PostgreSQL backend: every session, event, lease and dedup entry lives in the
//! database, and any number of store replicas serve it at once.
//!
//! How it keeps the contract of [`crate::backend`]:
//! - **One round trip per append.** Each replica caches the sessions it has seen lately
//!   (their [`SessionMeta`] and row `version`, within `--session-cache` bytes, so that no
//!   replica holds every session; [`StateCache`]). An append runs the same rules as the local log
//!   ([`crate::rules`]) against that state, then sends one statement that lands only if
//!   the session row is still at that version and none of the event ids exists: it bumps
//!   the version, stores the new state and
//!   inserts the events. Seqs are gapless because each write names the version (and so the
//!   last seq) it extends; dedup and the lease epoch are checked atomically with the write
//!   for the same reason. If the state was stale, the replica re-reads the row (and which
//!   event ids are known, with their seqs) and tries again.
//! - **Group commit** at two levels: the appends waiting on a replica are written together
//!   in one statement and one transaction ([`batch`]; a refusal or a stale state of one
//!   never fails the others), and the few batches in flight at once, on a pool of
//!   connections, share WAL flushes in PostgreSQL. An acknowledgement means committed with
//!   `synchronous_commit` on (on a standby too, with synchronous replication);
//!   `DURABILITY_BUFFERED` appends are committed the same way.
//! - **Live tail across replicas** without NOTIFY in the append transaction: see [`wake`].
//! - **ClaimSession** picks with `FOR UPDATE SKIP LOCKED`: one claimant per session across
//!   replicas, and claimants never queue behind each other.
//! - **Deletion**: the session row becomes its tombstone (version-checked, like every
//!   write, so no append planned against the state before lands after it; a trigger keeps
//!   the row from changing again, see [`schema`]) with an entry in `agentlog_erasures`, in
//!   one statement; then its events and snapshots are deleted in transactions of at most
//!   [`ERASE_BATCH`] rows ([`erase`]), by the replica that deleted it, or by any replica's
//!   sweep of `agentlog_erasures` if that one stopped first. What PostgreSQL keeps after
//!   that (dead tuples until vacuum, WAL and backups) is the cluster's own retention
//!   (ARCHITECTURE.md).
//! - **Forks share their parent's prefix**: the fork's row names its base (`base_session`,
//!   `base_seq`) and only its own events get rows; reads and dedup go down the line of
//!   bases in one statement (`line_cte`), and a deleted session's erasure first makes the
//!   prefix of every live fork reading through it the fork's own ([`materialize_forks`]).
//! - **AppendStream pipelines**: a stream's appends are queued per session behind the
//!   ones before them and written together as they arrive ([`pipeline`]), so a stream's
//!   next request is read while the previous ones commit.
//! - **The database unreachable** (down, read-only during a failover, or silently cut
//!   off): a call answers `UNAVAILABLE` within about [`DB_ANSWER`] (2 s), never an
//!   acknowledgement that did not commit (an append whose commit is in doubt is settled by
//!   its retry with the same event ids); health turns NOT_SERVING and, until its probe
//!   finds the database answering again, appends are answered at once; the pool
//!   reconnects (a multi-host URL with `target_session_attrs=read-write` finds the new
//!   primary) and the store serves again by itself.

mod batch;
mod pipeline;
pub mod schema;
pub mod wake;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentlog_proto::v1::{
    AppendResponse, Event, ForkSessionResponse, Lease, ListSessionsRequest, ListSessionsResponse,
    SessionInfo, SessionStatus,
};
use deadpool_postgres::{Hook, Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use prost::Message;
use tokio::sync::{mpsc, oneshot, watch, Notify};
use tokio_postgres::error::SqlState;
use tokio_postgres_rustls::MakeRustlsConnect;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::CertificateDer;
use tokio_util::sync::CancellationToken;

use crate::backend::{local, AppendOp, ForkOp};
use crate::backend::{AppendAnswer, Backend, EventRun, Snapshot, SnapshotRead};
use crate::clock::now_unix_ms;
use crate::queries::{self, long_poll_claim, ClaimAttempt, ListQuery};
use crate::retention::{Retention, BATCH};
use crate::rules::{self, Deletion};
use crate::scope::Scope;
use crate::session::LeaseRecord;
use crate::session::{lease_of, SessionMeta};
use crate::StoreError;
use wake::Board;
pub use wake::NotifyMode;

/// Events read per query by a subscription.
const READ_BATCH: i64 = 500;
/// The rows a session's seqs are read from, `line(sid, hi)`: the session's own rows (`$1`),
/// then, for a fork sharing its parent's prefix, its base's rows with seq `<= base_seq`, and
/// so on down the line of bases (the `hi` of each is the least `base_seq` above it). A
/// session's own rows all have seqs above its `base_seq` (a fork's prefix is either its
/// base's or, once materialized, its own with no base), so the line's rows never overlap.
/// Read in one statement, it is one snapshot: a materialization (see [`erase`]) is seen
/// whole or not at all.
macro_rules! line_cte {
    () => {
        "WITH RECURSIVE line(sid, hi) AS (\
         SELECT $1::text COLLATE \"C\", 9223372036854775807::bigint \
         UNION ALL SELECT s.base_session, least(l.hi, s.base_seq) \
         FROM line l JOIN agentlog_sessions s ON s.session_id = l.sid \
         WHERE s.base_session <> '') "
    };
}
/// Attempts of an optimistic write before answering UNAVAILABLE (only reached when one
/// session is written by very many callers at once).
const MAX_ATTEMPTS: usize = 64;
/// How long the database may leave us without an answer before a call says UNAVAILABLE
/// (and health NOT_SERVING): what was sent and not acknowledged by its host's TCP
/// (`TCP_USER_TIMEOUT`), a connection idle for 1 s whose keepalive probe is not answered
/// within it (a statement whose answer never comes, the request having arrived), a
/// connection attempt, a wait for a pooled connection, and the health probe. Together they
/// answer a silently cut-off database within about this long, however the cut finds a
/// connection (`integration-tests/tests/pg_network_cut.rs`).
const DB_ANSWER: Duration = Duration::from_secs(2);
/// A statement that has not completed by then is answered UNAVAILABLE: the backstop for a
/// database whose host still acknowledges but which does not answer. Its commit may still
/// happen: a retry with the same event ids is answered with the original seqs.
const STATEMENT_DEADLINE: Duration = Duration::from_secs(5);
/// `SessionStatus::Runnable`, written into the claim queries as a literal so that they use
/// the partial index over runnable sessions (see [`schema`]).
const RUNNABLE: i32 = SessionStatus::Runnable as i32;
/// The share of the time a retention pass keeps the database busy: it rests between its
/// steps (measured, a pass deleting 100,000 sessions against appends at 64 clients: no
/// rest, p99 2.4x the same load alone; busy half the time, 1.52x and 1.94x; a third, 1.08x
/// and 1.44x, the pass taking 25-27 s; bench/RESULTS.md).
const RETENTION_BUSY_SHARE: f64 = 1.0 / 3.0;
/// Retention's advisory lock: the replica that holds it runs the pass, the others skip it.
pub const RETENTION_LOCK: i64 = 0x6167_656e_745f_7265; // "agent_re"
/// Rows one transaction of an erasure deletes at most, so that it never holds many locks
/// or writes much WAL at once.
const ERASE_BATCH: i64 = 5_000;
/// How often every replica looks for erasures left unfinished (by a replica that stopped
/// in the middle of one), and how old one must be to be taken up.
const ERASURE_SWEEP: Duration = Duration::from_secs(30);

/// Batches of appends in flight at once ([`batch`]), out of a pool of `pool_size`
/// connections: two, so that one commits while the next is written, and the appends
/// waiting meanwhile gather into large batches (a batch statement's fixed cost in
/// PostgreSQL is about that of a dozen of its rows; 2 in flight against 4 gave 0.66×
/// against 0.54× raw INSERT's rate at 64 clients, bench/RESULTS.md), leaving connections
/// for reads, leases and claims.
fn batches_in_flight(pool_size: usize) -> usize {
    (pool_size / 4).clamp(1, 2)
}

/// What every pooled connection runs first (see `PgBackend::open`). No bitmap scans
/// either: a bitmap scan never marks the index entries of dead row versions as dead, so
/// right after a burst of sessions that went runnable and then idle, every claim walked
/// all of their entries in the runnable index again, until autovacuum came (20 ms a claim
/// at 100,000 sessions, bench/RESULTS.md "Scale with sessions"); a plain index scan marks
/// them on its first walk and the next one skips them.
const CONNECTION_SETTINGS: [&str; 3] = [
    "SET enable_seqscan = off",
    "SET enable_bitmapscan = off",
    "SET plan_cache_mode = force_generic_plan",
];

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
}

#[derive(Debug, thiserror::Error)]
pub enum PgOpenError {
    #[error("--database-url: {0}")]
    Url(tokio_postgres::Error),
    #[error("--database-ca {0}: {1}")]
    Ca(String, String),
    #[error("TLS for the database: {0}")]
    Tls(#[from] rustls::Error),
    #[error("the connection pool: {0}")]
    Pool(String),
    #[error(transparent)]
    Schema(#[from] schema::SchemaError),
}

/// The pool and how to make connections outside it (the LISTEN connection).
pub struct Connector {
    pool: Pool,
    pg_config: tokio_postgres::Config,
    tls: MakeRustlsConnect,
}

/// The states a replica keeps at hand, bounded in bytes: past its budget it gives back
/// states (the map's order decides which) down to three quarters of it. Any state may go:
/// the database holds every one, and an append whose state is not at hand reads it with
/// its row.
struct StateCache {
    states: HashMap<String, Cached>,
    /// What `states` takes ([`SessionMeta::cached_bytes`]).
    bytes: usize,
    budget: usize,
}

impl StateCache {
    fn shrink(&mut self) {
        self.bytes =
            crate::session::shrink_cache(&mut self.states, self.bytes, self.budget, |c| &c.meta);
    }
}

#[derive(Clone)]
struct Cached {
    version: i64,
    /// Shared: reading the cache copies no state, and an append copies it once, to fold
    /// its events into.
    meta: Arc<SessionMeta>,
}

/// The backend: a handle on one replica's state, cloned into the answers of pipelined
/// appends ([`pipeline`]); the background tasks stop when the last handle is dropped.
#[derive(Clone)]
pub struct PgBackend(Arc<Replica>);

impl std::ops::Deref for PgBackend {
    type Target = Replica;

    fn deref(&self) -> &Replica {
        &self.0
    }
}

pub struct Replica {
    connector: Arc<Connector>,
    board: Arc<Board>,
    /// Wake-ups for the other replicas (absent in poll mode).
    notify: Option<mpsc::UnboundedSender<(String, bool)>>,
    cache: Mutex<StateCache>,
    /// Appends ready to write, for the batch writer ([`batch`]).
    writes: mpsc::UnboundedSender<batch::Write>,
    health: Arc<Health>,
    poll_interval: Duration,
    /// Each session's appends queued by AppendStream on this replica, in order.
    lanes: pipeline::Lanes,
    /// Stops the background tasks when the backend is dropped.
    tasks: CancellationToken,
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.tasks.cancel();
    }
}

fn tls_config(ca_file: Option<&PathBuf>) -> Result<MakeRustlsConnect, PgOpenError> {
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = ca_file {
        let shown = path.display().to_string();
        let pem = std::fs::read(path).map_err(|e| PgOpenError::Ca(shown.clone(), e.to_string()))?;
        let mut added = 0;
        for cert in CertificateDer::pem_slice_iter(&pem) {
            let cert = cert.map_err(|e| PgOpenError::Ca(shown.clone(), e.to_string()))?;
            roots
                .add(cert)
                .map_err(|e| PgOpenError::Ca(shown.clone(), e.to_string()))?;
            added += 1;
        }
        if added == 0 {
            return Err(PgOpenError::Ca(shown, "no PEM certificate in it".into()));
        }
    }
    let config = rustls::ClientConfig::builder_with_provider(Arc::new(
        rustls::crypto::ring::default_provider(),
    ))
    .with_safe_default_protocol_versions()?
    .with_root_certificates(roots)
    .with_no_client_auth();
    Ok(MakeRustlsConnect::new(config))
}

impl PgBackend {
    /// Connects, creates or migrates the schema (retrying with backoff while the database
    /// is unreachable), and starts the background tasks.
    pub async fn open(config: PgConfig) -> Result<PgBackend, PgOpenError> {
        let mut pg_config: tokio_postgres::Config = config.url.parse().map_err(PgOpenError::Url)?;
        // A URL's own `connect_timeout` and `tcp_user_timeout` win.
        if pg_config.get_connect_timeout().is_none() {
            pg_config.connect_timeout(DB_ANSWER);
        }
        if pg_config.get_tcp_user_timeout().is_none() {
            pg_config.tcp_user_timeout(DB_ANSWER);
        }
        if pg_config.get_application_name().is_none() {
            pg_config.application_name("agentlog-event-store");
        }
        // Probes after 1 s of silence; with the user timeout, one unanswered for DB_ANSWER
        // closes the connection.
        pg_config
            .keepalives(true)
            .keepalives_idle(Duration::from_secs(1))
            .keepalives_interval(Duration::from_secs(1));
        let tls = tls_config(config.ca_file.as_ref())?;
        let manager = Manager::from_config(
            pg_config.clone(),
            tls.clone(),
            ManagerConfig {
                recycling_method: RecyclingMethod::Fast,
            },
        );
        let pool = Pool::builder(manager)
            .post_create(Hook::async_fn(|client, _| {
                Box::pin(async move {
                    // Every statement here finds its rows by key, so one plan per
                    // statement and connection, made without seq or bitmap scans, stays right however
                    // the tables grow; planned anew per call (PostgreSQL's choice when the
                    // first calls were cheaper than its generic estimate, as one-append
                    // batches are) the batch statement spent 0.3 ms planning each call.
                    // See `batch::WRITE_BATCH`. An engine without these settings plans its
                    // own way.
                    for setting in CONNECTION_SETTINGS {
                        if let Err(e) = client.batch_execute(setting).await {
                            tracing::debug!(error = %e, setting, "not set");
                        }
                    }
                    Ok(())
                })
            }))
            .max_size(config.pool_size.max(1))
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(DB_ANSWER))
            .create_timeout(Some(DB_ANSWER))
            .recycle_timeout(Some(DB_ANSWER))
            .build()
            .map_err(|e| PgOpenError::Pool(e.to_string()))?;
        let connector = Arc::new(Connector {
            pool,
            pg_config,
            tls,
        });
        migrate_with_retry(&connector).await?;

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
        let health = Arc::new(Health {
            serving: watch::channel(true).0,
            check: Notify::new(),
        });
        tokio::spawn(watch_health(
            connector.clone(),
            health.clone(),
            tasks.clone(),
        ));
        let writes = batch::start(
            connector.clone(),
            health.clone(),
            batches_in_flight(config.pool_size),
            tasks.clone(),
        );
        tokio::spawn(sweep_erasures(connector.clone(), tasks.clone()));
        if let Some(retention) = config.retention {
            tokio::spawn(run_retention(
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
        Ok(PgBackend(Arc::new(Replica {
            connector,
            board,
            notify,
            cache: Mutex::new(StateCache {
                states: HashMap::new(),
                bytes: 0,
                budget: config.cache_bytes,
            }),
            writes,
            health,
            poll_interval: config.poll_interval,
            lanes: pipeline::Lanes::default(),
            tasks,
        })))
    }

    /// The connection pool, for its metrics.
    pub fn pool_metrics(&self) -> crate::metrics::PgPool {
        crate::metrics::PgPool(self.connector.pool.clone())
    }

    async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        match self.connector.pool.get().await {
            Ok(client) => Ok(client),
            Err(e) => {
                self.lost();
                Err(StoreError::Unavailable(format!(
                    "the database is unreachable ({e}); retry"
                )))
            }
        }
    }

    fn lost(&self) {
        self.health.lost();
    }

    fn timed_error(&self, e: Timed) -> StoreError {
        self.health.timed_error(e)
    }

    /// `ListSessions` with a `query`: walks at most [`queries::QUERY_SCAN`] sessions of the
    /// listing from the page token on (the text is matched on each), and a page that ends
    /// where the walk stopped carries a token to go on from there.
    async fn list_by_text(
        &self,
        client: &deadpool_postgres::Object,
        query: &ListQuery,
        (all, prefixes): (bool, &[String]),
        (after_t, after_id, after_second): (Option<i64>, &str, i64),
    ) -> Result<ListSessionsResponse, StoreError> {
        let walk = queries::QUERY_SCAN as i64;
        let rows = timed("list_sessions", async {
            let stmt = client
                .prepare_cached(
                    "WITH walked AS MATERIALIZED (\
                     SELECT session_id, meta, updated_second, updated_unix_ms, \
                     (strpos(lower(session_id), $4) > 0 \
                     OR strpos(lower(first_user_text), $4) > 0) AS hit \
                     FROM agentlog_sessions WHERE deleted_unix_ms = 0 AND last_seq > 0 \
                     AND ($1 OR EXISTS (SELECT 1 FROM unnest($2::text[]) p \
                     WHERE starts_with(session_id, p))) \
                     AND ($3 = 0 OR status = $3) \
                     AND updated_second <= $8 \
                     AND ($5::bigint IS NULL OR updated_unix_ms < $5 \
                     OR (updated_unix_ms = $5 AND session_id > $6)) \
                     ORDER BY updated_second DESC, updated_unix_ms DESC, session_id \
                     LIMIT $7) \
                     SELECT session_id, CASE WHEN hit THEN meta END, hit, updated_unix_ms \
                     FROM walked \
                     ORDER BY updated_second DESC, updated_unix_ms DESC, session_id",
                )
                .await?;
            client
                .query(
                    &stmt,
                    &[
                        &all,
                        &prefixes,
                        &(query.status as i32),
                        &query.text,
                        &after_t,
                        &after_id,
                        &walk,
                        &after_second,
                    ],
                )
                .await
        })
        .await
        .map_err(|e| self.timed_error(e))?;
        let now = now_unix_ms();
        let mut sessions = Vec::new();
        for row in &rows {
            if !row.get::<_, bool>(2) {
                continue;
            }
            let id: String = row.get(0);
            let meta = decode_meta(row.get(1))?;
            sessions.push((meta.updated_unix_ms, id.clone(), meta.info(&id, now)));
            if sessions.len() > query.page_size {
                break;
            }
        }
        let looked_to = (rows.len() as i64 >= walk).then(|| {
            let last = rows.last().expect("walked");
            (last.get::<_, i64>(3), last.get::<_, String>(0))
        });
        Ok(query.page_through(sessions, looked_to))
    }

    fn cached(&self, session_id: &str) -> Option<Cached> {
        let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        cache.states.get(session_id).cloned()
    }

    fn remember(&self, session_id: &str, state: &Cached) {
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        let bytes = state.meta.cached_bytes(session_id);
        match cache.states.get_mut(session_id) {
            Some(cached) => {
                let before = cached.meta.cached_bytes(session_id);
                *cached = state.clone();
                cache.bytes = cache.bytes - before.min(cache.bytes) + bytes;
            }
            None => {
                cache.states.insert(session_id.to_string(), state.clone());
                cache.bytes += bytes;
            }
        }
        cache.shrink();
    }

    /// Tells followers and claimants here and on the other replicas that the session
    /// changed.
    fn changed(&self, session_id: &str, meta: &SessionMeta, now: i64) {
        let claimable = rules::claimable(meta, now);
        self.board.wake(session_id, claimable);
        if let Some(notify) = &self.notify {
            let _ = notify.send((session_id.to_string(), claimable));
        }
    }

    /// The session's row as the database has it now (version 0: no row), and the seqs of
    /// those of `event_ids` it already holds (in its own rows or the prefix it shares with
    /// its base), in one round trip.
    async fn refresh(
        &self,
        client: &deadpool_postgres::Object,
        session_id: &str,
        event_ids: &[&str],
    ) -> Result<(Cached, HashMap<String, u64>), StoreError> {
        let row = client
            .prepare_cached("SELECT version, meta FROM agentlog_sessions WHERE session_id = $1");
        let known = client.prepare_cached(concat!(
            line_cte!(),
            "SELECT e.event_id, e.seq FROM line l CROSS JOIN LATERAL (\
             SELECT event_id, seq FROM agentlog_events WHERE session_id = l.sid \
             AND event_id = ANY($2::text[]) AND seq <= l.hi) e"
        ));
        let (row, known) = timed("read_session", async { tokio::try_join!(row, known) })
            .await
            .map_err(|e| self.timed_error(e))?;
        let ids: Vec<&str> = event_ids.to_vec();
        let row_params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&session_id];
        let known_params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&session_id, &ids];
        let (row, known) = timed("read_session", async {
            tokio::try_join!(client.query_opt(&row, &row_params), async {
                if ids.is_empty() {
                    Ok(Vec::new())
                } else {
                    client.query(&known, &known_params).await
                }
            })
        })
        .await
        .map_err(|e| self.timed_error(e))?;
        let state = match row {
            None => Cached {
                version: 0,
                meta: Arc::default(),
            },
            Some(row) => Cached {
                version: row.get(0),
                meta: Arc::new(decode_meta(row.get(1))?),
            },
        };
        if state.version > 0 {
            self.remember(session_id, &state);
        }
        let known = known
            .iter()
            .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1) as u64))
            .collect();
        Ok((state, known))
    }

    /// Writes `meta` over the session's row if it is still at `version`; the new version,
    /// or `None` if someone wrote in between.
    async fn write_meta(
        &self,
        client: &deadpool_postgres::Object,
        session_id: &str,
        version: i64,
        meta: &SessionMeta,
    ) -> Result<Option<i64>, StoreError> {
        let columns = Columns::of(meta);
        let result = timed("write_session", async {
            let stmt = client
                .prepare_cached(
                    "UPDATE agentlog_sessions SET version = version + 1, meta = $3, \
                     last_seq = $4, updated_unix_ms = $5, status = $6, \
                     lease_expires_unix_ms = $7, \
                     first_user_text = CASE first_user_text WHEN '' THEN $8 \
                     ELSE first_user_text END \
                     WHERE session_id = $1 AND version = $2 RETURNING version",
                )
                .await?;
            client
                .query_opt(
                    &stmt,
                    &[
                        &session_id,
                        &version,
                        &columns.meta,
                        &columns.last_seq,
                        &columns.updated,
                        &columns.status,
                        &columns.lease_expires,
                        &columns.first_user_text,
                    ],
                )
                .await
        })
        .await;
        match result {
            Ok(row) => Ok(row.map(|r| r.get(0))),
            Err(e) => Err(self.timed_error(e)),
        }
    }

    /// Appends `fresh` (already numbered) with the session's new state, if the row is still
    /// at `version` and none of their ids exists: queued for the batch writer, which writes
    /// it together with the other appends waiting. The new version, or `None`.
    async fn write_events(
        &self,
        session_id: &str,
        version: i64,
        meta: &SessionMeta,
        fresh: Vec<Event>,
    ) -> Result<Option<i64>, StoreError> {
        let (answer, written) = oneshot::channel();
        let write = batch::Write {
            session_id: session_id.to_string(),
            version,
            columns: Columns::of(meta),
            events: fresh,
            answer,
        };
        let stopped = || StoreError::Unavailable("the store is shutting down; retry".into());
        self.writes.send(write).map_err(|_| stopped())?;
        written.await.map_err(|_| stopped())?
    }

    /// Runs a lease rule against the session's state and writes the outcome, re-reading
    /// and re-running while the state it used was stale. `rule` returns the new state to
    /// write (or `None`: nothing to write) and the answer.
    async fn change_session<T>(
        &self,
        session_id: &str,
        rule: impl Fn(&SessionMeta, i64) -> Result<(Option<SessionMeta>, T), StoreError>,
    ) -> Result<T, StoreError> {
        let client = self.client().await?;
        let mut state = self.cached(session_id);
        let mut fresh = false;
        for _ in 0..MAX_ATTEMPTS {
            let current = state.take();
            if let Err(e) = rules::existing(current.as_ref().map(|s| &*s.meta), session_id) {
                if fresh {
                    return Err(e);
                }
                state = Some(self.refresh(&client, session_id, &[]).await?.0);
                fresh = true;
                continue;
            }
            let current = current.expect("checked above");
            let now = now_unix_ms();
            match rule(&current.meta, now) {
                Ok((Some(meta), answer)) => {
                    if let Some(version) = self
                        .write_meta(&client, session_id, current.version, &meta)
                        .await?
                    {
                        let meta = Arc::new(meta);
                        self.remember(
                            session_id,
                            &Cached {
                                version,
                                meta: meta.clone(),
                            },
                        );
                        self.changed(session_id, &meta, now);
                        return Ok(answer);
                    }
                }
                Ok((None, answer)) if fresh => return Ok(answer),
                Err(e) if fresh => return Err(e),
                Ok(_) | Err(_) => {}
            }
            state = Some(self.refresh(&client, session_id, &[]).await?.0);
            fresh = true;
        }
        Err(contended(session_id))
    }

    /// Writes the session's tombstone over its row if it is still at `version`, with its
    /// entry in `agentlog_erasures`; the new version, or `None` if someone wrote in between.
    async fn write_tombstone(
        &self,
        client: &deadpool_postgres::Object,
        session_id: &str,
        version: i64,
        tombstone: &SessionMeta,
    ) -> Result<Option<i64>, StoreError> {
        let meta = tombstone.encode_to_vec();
        let result = timed("delete_session", async {
            let stmt = client
                .prepare_cached(
                    "WITH t AS (UPDATE agentlog_sessions SET version = version + 1, meta = $3, \
                     last_seq = 0, status = 0, lease_expires_unix_ms = 0, \
                     first_user_text = '', deleted_unix_ms = $4 \
                     WHERE session_id = $1 AND version = $2 RETURNING version), \
                     e AS (INSERT INTO agentlog_erasures (session_id, deleted_unix_ms) \
                     SELECT $1, $4 FROM t ON CONFLICT (session_id) DO NOTHING) \
                     SELECT version FROM t",
                )
                .await?;
            client
                .query_opt(
                    &stmt,
                    &[&session_id, &version, &meta, &tombstone.deleted_unix_ms],
                )
                .await
        })
        .await;
        match result {
            Ok(row) => Ok(row.map(|r| r.get(0))),
            Err(e) => Err(self.timed_error(e)),
        }
    }

    /// One attempt at a claim: the oldest runnable, unleased session in `scope`, locked
    /// with SKIP LOCKED so that concurrent claimants on any replica take different ones.
    async fn try_claim(
        &self,
        owner: &str,
        ttl_ms: u64,
        scope: &Scope,
    ) -> Result<ClaimAttempt, StoreError> {
        let mut client = self.client().await?;
        let now = now_unix_ms();
        let all = scope.is_everything();
        let prefixes: Vec<String> = scope
            .prefix_list()
            .map(<[String]>::to_vec)
            .unwrap_or_default();
        let result = timed("claim", async {
            let tx = client.transaction().await?;
            let picked = tx
                .query_opt(
                    &format!(
                        "SELECT session_id, version, meta FROM agentlog_sessions \
                         WHERE status = {RUNNABLE} AND lease_expires_unix_ms <= $1 \
                         AND ($2 OR EXISTS (SELECT 1 FROM unnest($3::text[]) p \
                         WHERE starts_with(session_id, p))) \
                         ORDER BY updated_unix_ms, session_id LIMIT 1 FOR UPDATE SKIP LOCKED"
                    ),
                    &[&now, &all, &prefixes],
                )
                .await?;
            let Some(row) = picked else {
                let next: Option<i64> = tx
                    .query_one(
                        &format!(
                            "SELECT min(lease_expires_unix_ms) FROM agentlog_sessions \
                             WHERE status = {RUNNABLE} AND lease_expires_unix_ms > $1 \
                             AND ($2 OR EXISTS (SELECT 1 FROM unnest($3::text[]) p \
                             WHERE starts_with(session_id, p)))"
                        ),
                        &[&now, &all, &prefixes],
                    )
                    .await?
                    .get(0);
                tx.commit().await?;
                return Ok(Err(next));
            };
            let session_id: String = row.get(0);
            let version: i64 = row.get(1);
            let bytes: Vec<u8> = row.get(2);
            Ok(Ok((tx, session_id, version, bytes)))
        })
        .await;
        let (tx, session_id, version, bytes) = match result {
            Ok(Ok(picked)) => picked,
            Ok(Err(next_expiry_unix_ms)) => {
                return Ok(ClaimAttempt::Nothing {
                    next_expiry_unix_ms,
                })
            }
            Err(e) => return Err(self.timed_error(e)),
        };
        let mut meta = decode_meta(bytes)?;
        if !rules::claimable(&meta, now) {
            return Ok(ClaimAttempt::Nothing {
                next_expiry_unix_ms: Some(now),
            });
        }
        let record = rules::grant(&meta, &session_id, owner.to_string(), ttl_ms, now);
        meta.apply_lease(&record);
        let columns = Columns::of(&meta);
        let written = timed("claim", async {
            let row = tx
                .query_one(
                    "UPDATE agentlog_sessions SET version = version + 1, meta = $3, \
                     lease_expires_unix_ms = $4 WHERE session_id = $1 AND version = $2 \
                     RETURNING version",
                    &[&session_id, &version, &columns.meta, &columns.lease_expires],
                )
                .await?;
            tx.commit().await?;
            Ok(row.get::<_, i64>(0))
        })
        .await;
        let version = written.map_err(|e| self.timed_error(e))?;
        let meta = Arc::new(meta);
        self.remember(
            &session_id,
            &Cached {
                version,
                meta: meta.clone(),
            },
        );
        self.changed(&session_id, &meta, now);
        Ok(ClaimAttempt::Granted(lease_of(&record)))
    }
}

/// Whether the database answers: health turns NOT_SERVING when a call finds it gone, until
/// [`watch_health`] sees it answer again.
struct Health {
    serving: watch::Sender<bool>,
    /// Asks [`watch_health`] to check at once.
    check: Notify,
}

impl Health {
    /// Whether the database answered the last call or probe.
    fn serving_now(&self) -> bool {
        *self.serving.borrow()
    }

    /// The database failed us: report NOT_SERVING until the health check passes again.
    fn lost(&self) {
        self.serving
            .send_if_modified(|up| std::mem::replace(up, false));
        self.check.notify_one();
    }

    fn db_error(&self, e: &tokio_postgres::Error) -> StoreError {
        let contended = matches!(
            e.code(),
            Some(&SqlState::T_R_SERIALIZATION_FAILURE) | Some(&SqlState::T_R_DEADLOCK_DETECTED)
        );
        let lost = match e.code() {
            None => true,
            Some(code) => {
                let c = code.code();
                c.starts_with("08")
                    || c.starts_with("57P")
                    || c.starts_with("53")
                    || *code == SqlState::READ_ONLY_SQL_TRANSACTION
            }
        };
        if contended {
            StoreError::Unavailable(format!("the database failed the call ({e}); retry"))
        } else if lost {
            self.lost();
            StoreError::Unavailable(format!("the database failed the call ({e}); retry"))
        } else {
            StoreError::Internal(format!("database: {e}"))
        }
    }

    fn timed_error(&self, e: Timed) -> StoreError {
        match e {
            Timed::Db(e) => self.db_error(&e),
            Timed::Elapsed => {
                self.lost();
                StoreError::Unavailable(format!(
                    "the database did not answer within {} s; retry",
                    STATEMENT_DEADLINE.as_secs()
                ))
            }
        }
    }
}

/// The session state's columns, derived from its [`SessionMeta`].
struct Columns {
    /// The state, its first user text cut to the title: the whole text is in
    /// `first_user_text`, written once (see `schema`), so that a long first message is not
    /// written again, into TOAST, by every append.
    meta: Vec<u8>,
    last_seq: i64,
    updated: i64,
    status: i32,
    /// When the lease stops being live (0: released or never granted).
    lease_expires: i64,
    first_user_text: String,
    /// Whether the session is a fork (it may share a prefix with a base: dedup looks there
    /// too, see [`batch`]).
    fork: bool,
}

impl Columns {
    fn of(meta: &SessionMeta) -> Columns {
        let title_len = meta.title_len();
        let meta_bytes = if title_len < meta.first_user_text.len() {
            let mut short = meta.clone();
            short.first_user_text.truncate(title_len);
            short.encode_to_vec()
        } else {
            meta.encode_to_vec()
        };
        Columns {
            meta: meta_bytes,
            last_seq: meta.last_seq as i64,
            updated: meta.updated_unix_ms,
            status: meta.status,
            lease_expires: meta
                .lease
                .as_ref()
                .filter(|l| !l.released)
                .map_or(0, |l| l.expires_unix_ms),
            first_user_text: meta.first_user_text.clone(),
            fork: meta.forked_from.is_some(),
        }
    }
}

fn decode_meta(bytes: Vec<u8>) -> Result<SessionMeta, StoreError> {
    SessionMeta::decode(bytes.as_slice())
        .map_err(|e| StoreError::Internal(format!("a session row does not decode: {e}")))
}

fn contended(session_id: &str) -> StoreError {
    StoreError::Unavailable(format!(
        "session {session_id} is being written by many callers at once; retry"
    ))
}

enum Timed {
    Db(tokio_postgres::Error),
    Elapsed,
}

impl From<tokio_postgres::Error> for Timed {
    fn from(e: tokio_postgres::Error) -> Timed {
        Timed::Db(e)
    }
}

/// One database round trip, bounded by [`STATEMENT_DEADLINE`] and timed for the metrics
/// under `statement`.
async fn timed<T>(
    statement: &'static str,
    call: impl std::future::Future<Output = Result<T, tokio_postgres::Error>>,
) -> Result<T, Timed> {
    let started = std::time::Instant::now();
    let result = tokio::time::timeout(STATEMENT_DEADLINE, call).await;
    crate::metrics::pg_statement(statement, started.elapsed().as_secs_f64());
    match result {
        Ok(result) => result.map_err(Timed::Db),
        Err(_) => Err(Timed::Elapsed),
    }
}

impl PgBackend {
    /// Folds the parent's events from seq 1 into the fork's state and the settled-point
    /// check, reading the rows down the parent's line (`line_cte`): `1..=at_seq` in one
    /// streamed statement, then, only if `at_seq` is not settled, on to the next settled
    /// seq to name it in the refusal. Each event is parsed only as far as the state needs.
    async fn fold_prefix(
        &self,
        parent: &str,
        at_seq: u64,
        point: &mut rules::ForkPoint,
        state: &mut rules::ForkPrefix,
    ) -> Result<(), StoreError> {
        use futures::TryStreamExt;
        let client = self.client().await?;
        let stmt = timed(
            "fork",
            client.prepare_cached(concat!(
                line_cte!(),
                "SELECT e.body FROM line l CROSS JOIN LATERAL (\
                 SELECT seq, body FROM agentlog_events WHERE session_id = l.sid \
                 AND seq >= $2 AND seq <= least(l.hi, $3)) e ORDER BY e.seq"
            )),
        )
        .await
        .map_err(|e| self.timed_error(e))?;
        let undecodable = |e| StoreError::Internal(format!("a stored event: {e}"));
        let mut from = 1i64;
        let mut to = at_seq as i64;
        loop {
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] = [&parent, &from, &to];
            let rows = timed("fork", client.query_raw(&stmt, params))
                .await
                .map_err(|e| self.timed_error(e))?;
            futures::pin_mut!(rows);
            let mut read = 0;
            loop {
                let row = tokio::time::timeout(STATEMENT_DEADLINE, rows.try_next())
                    .await
                    .map_err(|_| self.timed_error(Timed::Elapsed))?
                    .map_err(|e| self.timed_error(Timed::Db(e)))?;
                let Some(row) = row else { break };
                read += 1;
                let body: &[u8] = row.get(0);
                let event = local::log::record::event_for_state(body, state.wants_text())
                    .map_err(undecodable)?;
                let done = point.apply(&event);
                if event.seq <= at_seq {
                    state.apply(&event);
                }
                if done {
                    return Ok(());
                }
            }
            if read < to - from + 1 {
                return Ok(()); // The log ends here.
            }
            from = to + 1;
            to = from + READ_BATCH - 1;
        }
    }

    /// Writes a planned fork in one transaction: the parent's row is locked and must still
    /// be live (a deletion of the parent waits for this transaction, or this one finds the
    /// tombstone and refuses: so the erasure of the parent's rows always finds the fork and
    /// materializes its prefix first, see [`erase`]); then the fork's row, naming the
    /// parent as its base (a session that exists, or is being created by an append or
    /// another fork, refuses it); then the request's new events. The prefix is not written:
    /// the row's `base_session` and `base_seq` columns name it (the state in `meta` does
    /// not: they change, when the prefix is materialized, without a new version).
    /// `None` if the session exists.
    async fn write_fork(
        &self,
        plan: &rules::ForkPlan,
        parent: &str,
        at_seq: u64,
    ) -> Result<Option<i64>, StoreError> {
        let mut client = self.client().await?;
        let columns = Columns::of(&plan.meta);
        let session_id = plan.record.session_id.as_str();
        let tx = timed("fork", client.transaction())
            .await
            .map_err(|e| self.timed_error(e))?;
        let live = timed(
            "fork",
            tx.query_opt(
                "SELECT 1 FROM agentlog_sessions WHERE session_id = $1 \
                 AND deleted_unix_ms = 0 FOR SHARE",
                &[&parent],
            ),
        )
        .await
        .map_err(|e| self.timed_error(e))?;
        if live.is_none() {
            return Err(rules::session_deleted(parent));
        }
        let created = timed(
            "fork",
            tx.query_opt(
                "INSERT INTO agentlog_sessions (session_id, version, meta, last_seq, \
                 updated_unix_ms, status, lease_expires_unix_ms, first_user_text, \
                 base_session, base_seq) \
                 VALUES ($1, 1, $2, $3, $4, $5, $6, $7, $8, $9) \
                 ON CONFLICT (session_id) DO NOTHING RETURNING version",
                &[
                    &session_id,
                    &columns.meta,
                    &columns.last_seq,
                    &columns.updated,
                    &columns.status,
                    &columns.lease_expires,
                    &columns.first_user_text,
                    &parent,
                    &(at_seq as i64),
                ],
            ),
        )
        .await
        .map_err(|e| self.timed_error(e))?;
        let Some(created) = created else {
            return Ok(None);
        };
        if !plan.fresh.is_empty() {
            let seqs: Vec<i64> = plan.fresh.iter().map(|e| e.seq as i64).collect();
            let ids: Vec<&str> = plan.fresh.iter().map(|e| e.event_id.as_str()).collect();
            let bodies: Vec<Vec<u8>> = plan.fresh.iter().map(|e| e.encode_to_vec()).collect();
            timed(
                "fork",
                tx.execute(
                    "INSERT INTO agentlog_events (session_id, seq, event_id, body) \
                     SELECT $1, seq, event_id, body \
                     FROM unnest($2::bigint[], $3::text[], $4::bytea[]) AS ev(seq, event_id, body)",
                    &[&session_id, &seqs, &ids, &bodies],
                ),
            )
            .await
            .map_err(|e| self.timed_error(e))?;
        }
        timed("fork", tx.commit())
            .await
            .map_err(|e| self.timed_error(e))?;
        Ok(Some(created.get(0)))
    }
}

/// What an append does against one state of the session: the rules of the local writer,
/// through the same functions.
struct Plan {
    fresh: Vec<Event>,
    meta: SessionMeta,
    response: AppendResponse,
}

fn plan(
    op: &AppendOp,
    events: &[Event],
    meta: &SessionMeta,
    known: &HashMap<String, u64>,
    now: i64,
) -> Result<Plan, StoreError> {
    let session_id = &op.session_id;
    rules::check_writer(meta, session_id, op.lease_epoch, events, now)?;
    let numbered = rules::number(
        session_id,
        events.iter().cloned(),
        meta.last_seq,
        now,
        |id| Ok::<_, StoreError>(known.get(id).copied()),
    )?;
    rules::check_fresh(meta, session_id, op.expected_last_seq, &numbered.fresh)?;
    let mut meta = meta.clone();
    for event in &numbered.fresh {
        meta.apply_event(event);
    }
    Ok(Plan {
        fresh: numbered.fresh,
        response: AppendResponse {
            seqs: numbered.seqs,
            last_seq: meta.last_seq,
        },
        meta,
    })
}

#[tonic::async_trait]
impl Backend for PgBackend {
    async fn append(&self, mut op: AppendOp) -> Result<AppendResponse, StoreError> {
        let mut events = std::mem::take(&mut op.events);
        for event in &mut events {
            if event.event_id.is_empty() {
                event.event_id = crate::ids::random_uuid().to_string();
            }
        }
        let mut state = self.cached(&op.session_id);
        let mut known = HashMap::new();
        let mut fresh_state = false;
        for _ in 0..MAX_ATTEMPTS {
            let now = now_unix_ms();
            let current = state.take().unwrap_or_else(|| Cached {
                version: 0,
                meta: Arc::default(),
            });
            match plan(&op, &events, &current.meta, &known, now) {
                Ok(plan) if plan.fresh.is_empty() && fresh_state => return Ok(plan.response),
                Ok(plan) if !plan.fresh.is_empty() => {
                    let written = self
                        .write_events(&op.session_id, current.version, &plan.meta, plan.fresh)
                        .await?;
                    if let Some(version) = written {
                        let meta = Arc::new(plan.meta);
                        self.remember(
                            &op.session_id,
                            &Cached {
                                version,
                                meta: meta.clone(),
                            },
                        );
                        self.changed(&op.session_id, &meta, now);
                        return Ok(plan.response);
                    }
                }
                Err(e) if fresh_state => return Err(e),
                Ok(_) | Err(_) => {}
            }
            let ids: Vec<&str> = events.iter().map(|e| e.event_id.as_str()).collect();
            let client = self.client().await?;
            let (refreshed, ids_known) = self.refresh(&client, &op.session_id, &ids).await?;
            state = Some(refreshed);
            known = ids_known;
            fresh_state = true;
        }
        Err(contended(&op.session_id))
    }

    async fn fork(&self, op: ForkOp) -> Result<ForkSessionResponse, StoreError> {
        let client = self.client().await?;
        let (existing, _) = self.refresh(&client, &op.new_session_id, &[]).await?;
        rules::fork_target(Some(&existing.meta), &op.new_session_id)?;
        let (parent, _) = self.refresh(&client, &op.parent, &[]).await?;
        drop(client);
        let last_seq = rules::existing(Some(&parent.meta), &op.parent)?.last_seq;
        let mut events = op.events;
        for event in &mut events {
            if event.event_id.is_empty() {
                event.event_id = crate::ids::random_uuid().to_string();
            }
        }
        let now = now_unix_ms();
        let mut point = rules::ForkPoint::new(op.at_seq);
        let mut state =
            rules::ForkPrefix::new(&op.new_session_id, &op.parent, op.at_seq, &events, now);
        self.fold_prefix(&op.parent, op.at_seq, &mut point, &mut state)
            .await?;
        point.verdict(&op.parent, last_seq)?;
        let plan = rules::plan_fork(state, events, now)?;
        let Some(version) = self.write_fork(&plan, &op.parent, op.at_seq).await? else {
            return Err(rules::session_exists(&op.new_session_id));
        };
        let meta = Arc::new(plan.meta);
        self.remember(
            &op.new_session_id,
            &Cached {
                version,
                meta: meta.clone(),
            },
        );
        self.changed(&op.new_session_id, &meta, now);
        Ok(ForkSessionResponse {
            session_id: op.new_session_id,
            last_seq: meta.last_seq,
        })
    }

    fn subscribe(
        &self,
        session_id: String,
        from_seq: u64,
        follow: bool,
        cancel: CancellationToken,
    ) -> mpsc::Receiver<Result<EventRun, StoreError>> {
        let (tx, rx) = mpsc::channel(crate::backend::QUEUED_RUNS);
        let follower = Follower {
            connector: self.connector.clone(),
            wake: self.board.follow(&session_id),
            session_id,
            next: from_seq.max(1),
            poll_interval: self.poll_interval,
        };
        let cancel = cancel.clone();
        let stop = self.tasks.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = follower.run(follow, tx) => {}
                _ = cancel.cancelled() => {}
                _ = stop.cancelled() => {}
            }
        });
        rx
    }

    async fn get_session(&self, session_id: &str) -> Result<SessionInfo, StoreError> {
        let client = self.client().await?;
        let (state, _) = self.refresh(&client, session_id, &[]).await?;
        let meta = rules::existing(Some(&state.meta), session_id)?;
        Ok(meta.info(session_id, now_unix_ms()))
    }

    async fn list_sessions(
        &self,
        req: &ListSessionsRequest,
        scope: &Scope,
    ) -> Result<ListSessionsResponse, StoreError> {
        let query = ListQuery::parse(req)?;
        let all = scope.is_everything();
        let prefixes: Vec<String> = scope
            .prefix_list()
            .map(<[String]>::to_vec)
            .unwrap_or_default();
        let (after_t, after_id) = match &query.after {
            Some((t, id)) => (Some(*t), id.clone()),
            None => (None, String::new()),
        };
        // The bound on the indexed `updated_second` (the same division PostgreSQL computes
        // it with), so that a later page starts its index walk where the previous ended.
        let after_second = after_t.map_or(i64::MAX, |t| t / 1000);
        let client = self.client().await?;
        if !query.text.is_empty() {
            return self
                .list_by_text(
                    &client,
                    &query,
                    (all, &prefixes),
                    (after_t, &after_id, after_second),
                )
                .await;
        }
        let limit = query.page_size as i64 + 1;
        // A statement per status filter, the status written into it, so that the planner
        // (which plans once for every call, `force_generic_plan`) knows how rare it is: a
        // rare status walks the (status, update time) index, a common one the update
        // time's; either way in order, so a page costs the page.
        let status = query.status as i32;
        let status_filter = if status == 0 {
            "$3 = 0".to_string()
        } else {
            format!("$3 = {status} AND status = {status}")
        };
        let sql = format!(
            "SELECT session_id, meta FROM agentlog_sessions \
             WHERE deleted_unix_ms = 0 AND last_seq > 0 \
             AND ($1 OR EXISTS (SELECT 1 FROM unnest($2::text[]) p \
             WHERE starts_with(session_id, p))) \
             AND {status_filter} \
             AND updated_second <= $7 \
             AND ($4::bigint IS NULL OR updated_unix_ms < $4 \
             OR (updated_unix_ms = $4 AND session_id > $5)) \
             ORDER BY updated_second DESC, updated_unix_ms DESC, session_id \
             LIMIT $6"
        );
        let rows = timed("list_sessions", async {
            let stmt = client.prepare_cached(&sql).await?;
            client
                .query(
                    &stmt,
                    &[
                        &all,
                        &prefixes,
                        &(query.status as i32),
                        &after_t,
                        &after_id,
                        &limit,
                        &after_second,
                    ],
                )
                .await
        })
        .await
        .map_err(|e| self.timed_error(e))?;
        let now = now_unix_ms();
        let mut sessions = Vec::with_capacity(rows.len());
        for row in &rows {
            let id: String = row.get(0);
            let meta = decode_meta(row.get(1))?;
            sessions.push((meta.updated_unix_ms, id.clone(), meta.info(&id, now)));
        }
        // Already in ListSessions order (the query's ORDER BY).
        Ok(query.page(sessions))
    }

    async fn acquire_lease(
        &self,
        session_id: String,
        owner: String,
        ttl_ms: u64,
    ) -> Result<Lease, StoreError> {
        self.change_session(&session_id, |meta, now| {
            let record = rules::acquire(meta, &session_id, owner.clone(), ttl_ms, now)?;
            Ok((Some(with_lease(meta, &record)), lease_of(&record)))
        })
        .await
    }

    async fn renew_lease(
        &self,
        session_id: String,
        owner: String,
        epoch: u64,
        ttl_ms: u64,
    ) -> Result<Lease, StoreError> {
        self.change_session(&session_id, |meta, now| {
            let record = rules::renew(meta, &session_id, &owner, epoch, ttl_ms, now)?;
            Ok((Some(with_lease(meta, &record)), lease_of(&record)))
        })
        .await
    }

    async fn release_lease(
        &self,
        session_id: String,
        owner: String,
        epoch: u64,
    ) -> Result<(), StoreError> {
        self.change_session(&session_id, |meta, now| {
            let released = rules::release(meta, &session_id, &owner, epoch, now)?;
            Ok((released.map(|record| with_lease(meta, &record)), ()))
        })
        .await
    }

    async fn claim(
        &self,
        owner: String,
        ttl_ms: u64,
        wait: Duration,
        cancel: &CancellationToken,
        scope: &Scope,
    ) -> Result<Option<Lease>, StoreError> {
        let changes = self.board.claimable();
        long_poll_claim(wait, cancel, changes, Some(self.poll_interval), || {
            self.try_claim(&owner, ttl_ms, scope)
        })
        .await
    }

    async fn put_snapshot(&self, snapshot: Snapshot, lease_epoch: u64) -> Result<u64, StoreError> {
        // Lands only while the session row is at the version the lease was checked against,
        // and only over an older snapshot; says which of the three happened.
        const PUT: &str = "WITH s AS (SELECT 1 FROM agentlog_sessions \
             WHERE session_id = $1 AND version = $2), \
             put AS (INSERT INTO agentlog_snapshots (session_id, format, seq, data) \
             SELECT $1, $3, $4, $5 FROM s ON CONFLICT (session_id, format) DO UPDATE \
             SET seq = excluded.seq, data = excluded.data \
             WHERE agentlog_snapshots.seq <= excluded.seq RETURNING seq) \
             SELECT (SELECT count(*) FROM s), (SELECT seq FROM put), \
             (SELECT seq FROM agentlog_snapshots WHERE session_id = $1 AND format = $3)";
        let client = self.client().await?;
        let seq = snapshot.seq as i64;
        for _ in 0..MAX_ATTEMPTS {
            let (state, _) = self.refresh(&client, &snapshot.session_id, &[]).await?;
            let meta = rules::existing(Some(&state.meta), &snapshot.session_id)?;
            rules::check_snapshot(
                meta,
                &snapshot.session_id,
                lease_epoch,
                snapshot.seq,
                now_unix_ms(),
            )?;
            let row = timed("put_snapshot", async {
                let statement = client.prepare_cached(PUT).await?;
                client
                    .query_one(
                        &statement,
                        &[
                            &snapshot.session_id,
                            &state.version,
                            &snapshot.format,
                            &seq,
                            &snapshot.data,
                        ],
                    )
                    .await
            })
            .await
            .map_err(|e| self.timed_error(e))?;
            let (matched, put, kept): (i64, Option<i64>, Option<i64>) =
                (row.get(0), row.get(1), row.get(2));
            if matched == 0 {
                continue; // The session changed since it was read: check again.
            }
            return Ok(put.or(kept).unwrap_or(seq) as u64);
        }
        Err(contended(&snapshot.session_id))
    }

    async fn get_snapshot(
        &self,
        session_id: &str,
        format: &str,
    ) -> Result<Option<SnapshotRead>, StoreError> {
        let client = self.client().await?;
        // The snapshot and whether the session was deleted, as of one moment.
        let row = timed("get_snapshot", async {
            let statement = client
                .prepare_cached(
                    "SELECT (SELECT deleted_unix_ms FROM agentlog_sessions \
                     WHERE session_id = $1), seq, data FROM agentlog_snapshots \
                     RIGHT JOIN (SELECT 1) one ON session_id = $1 AND format = $2",
                )
                .await?;
            client.query_one(&statement, &[&session_id, &format]).await
        })
        .await
        .map_err(|e| self.timed_error(e))?;
        if row
            .get::<_, Option<i64>>(0)
            .is_some_and(|deleted| deleted > 0)
        {
            return Err(rules::session_deleted(session_id));
        }
        let seq: Option<i64> = row.get(1);
        let data: Option<Vec<u8>> = row.get(2);
        let (Some(seq), Some(data)) = (seq, data) else {
            return Ok(None);
        };
        Ok(Some(SnapshotRead {
            seq: seq as u64,
            pieces: Box::pin(futures::stream::once(std::future::ready(Ok(
                bytes::Bytes::from(data),
            )))),
        }))
    }

    async fn delete_session(&self, session_id: &str) -> Result<(), StoreError> {
        let client = self.client().await?;
        for _ in 0..MAX_ATTEMPTS {
            let (state, _) = self.refresh(&client, session_id, &[]).await?;
            let now = now_unix_ms();
            let tombstone = match rules::delete(Some(&state.meta), session_id, now)? {
                Deletion::AlreadyDeleted => return Ok(()),
                Deletion::Tombstone(tombstone) => *tombstone,
            };
            let Some(version) = self
                .write_tombstone(&client, session_id, state.version, &tombstone)
                .await?
            else {
                continue; // Written in between: decide again on what is there now.
            };
            let tombstone = Arc::new(tombstone);
            self.remember(
                session_id,
                &Cached {
                    version,
                    meta: tombstone.clone(),
                },
            );
            // Followers here and on every replica look again and find the tombstone.
            self.changed(session_id, &tombstone, now);
            crate::metrics::sessions_deleted("request", 1);
            let connector = self.connector.clone();
            let id = session_id.to_string();
            tokio::spawn(async move {
                let erased = match connector.pool.get().await {
                    Ok(client) => erase(&client, std::slice::from_ref(&id)).await,
                    Err(e) => Err(e.to_string()),
                };
                if let Err(e) = erased {
                    tracing::warn!(session_id = %id, error = %e, "erasing a deleted session's rows stopped; the sweep takes it up again");
                }
            });
            return Ok(());
        }
        Err(contended(session_id))
    }

    fn serving(&self) -> watch::Receiver<bool> {
        self.health.serving.subscribe()
    }

    async fn enqueue_append(&self, op: AppendOp) -> Result<AppendAnswer, StoreError> {
        Ok(self.enqueue_pipelined(op))
    }
}

/// Deletes deleted sessions' events and snapshots, in transactions of at most
/// [`ERASE_BATCH`] rows, then their `agentlog_erasures` entries, once every live fork that
/// reads through them has its prefix of its own ([`materialize_forks`]). Safe to run twice
/// at once (two replicas, or a sweep beside the deleting replica): each deletes what is
/// left.
async fn erase(client: &tokio_postgres::Client, session_ids: &[String]) -> Result<(), String> {
    if session_ids.is_empty() {
        return Ok(());
    }
    let failed = |e: Timed| match e {
        Timed::Db(e) => e.to_string(),
        Timed::Elapsed => "the database did not answer".to_string(),
    };
    materialize_forks(client, session_ids).await?;
    loop {
        let deleted = timed("erase", async {
            client
                .execute(
                    "DELETE FROM agentlog_events WHERE (session_id, seq) IN \
                     (SELECT session_id, seq FROM agentlog_events \
                     WHERE session_id = ANY($1) LIMIT $2)",
                    &[&session_ids, &ERASE_BATCH],
                )
                .await
        })
        .await
        .map_err(failed)?;
        if deleted < ERASE_BATCH as u64 {
            break;
        }
    }
    for statement in [
        "DELETE FROM agentlog_snapshots WHERE session_id = ANY($1)",
        "DELETE FROM agentlog_erasures WHERE session_id = ANY($1)",
    ] {
        timed("erase", async {
            client.execute(statement, &[&session_ids]).await
        })
        .await
        .map_err(failed)?;
    }
    Ok(())
}

/// Materializes the fork `$1` (see [`materialize_forks`]) in one statement: its row locked,
/// if it is still live with a base; the rows of its line up to its `base_seq` inserted as
/// its own, each body's field 1 (the head of the base's id, checked: a body that does not
/// start with it makes the statement fail, nothing written) replaced by `$2`, the fork's;
/// its base dropped. Returns the rows copied and the `base_seq` dropped (0, 0: nothing to
/// do, another replica did it).
const MATERIALIZE: &str = "WITH RECURSIVE fork AS MATERIALIZED (\
    SELECT session_id, base_session, base_seq FROM agentlog_sessions \
    WHERE session_id = $1 AND deleted_unix_ms = 0 \
    AND base_session <> '' FOR UPDATE), \
    line(sid, hi) AS (SELECT base_session, base_seq FROM fork \
    UNION ALL SELECT s.base_session, least(l.hi, s.base_seq) \
    FROM line l JOIN agentlog_sessions s ON s.session_id = l.sid \
    WHERE s.base_session <> ''), \
    copied AS (INSERT INTO agentlog_events (session_id, seq, event_id, body) \
    SELECT $1, e.seq, e.event_id, \
    CASE WHEN substring(e.body FROM 1 FOR octet_length(h.head)) = h.head \
    THEN $2::bytea || substring(e.body FROM octet_length(h.head) + 1) END \
    FROM line l CROSS JOIN LATERAL (SELECT decode('0a', 'hex') || \
    CASE WHEN octet_length(l.sid) < 128 \
    THEN set_byte(decode('00', 'hex'), 0, octet_length(l.sid)) \
    ELSE set_byte(set_byte(decode('0000', 'hex'), 0, \
    octet_length(l.sid) % 128 + 128), 1, octet_length(l.sid) / 128) END \
    || convert_to(l.sid, 'UTF8') AS head) h \
    CROSS JOIN LATERAL (SELECT seq, event_id, body FROM agentlog_events \
    WHERE session_id = l.sid AND seq <= l.hi) e RETURNING seq), \
    dropped AS (UPDATE agentlog_sessions s SET base_session = '', \
    base_seq = 0 FROM fork WHERE s.session_id = fork.session_id \
    RETURNING fork.base_seq) \
    SELECT (SELECT count(*) FROM copied), \
    coalesce((SELECT base_seq FROM dropped), 0)";

/// Gives every live session that reads part of its prefix through one of the deleted
/// `session_ids` (a fork of one, or a fork of a deleted fork of one, and so on) that
/// prefix as rows of its own, before their rows are erased. Each fork in one statement,
/// so one transaction: its row locked (and still live, still with a base), the rows of its
/// line (`line_cte`) up to its `base_seq` inserted as its own, their bodies' field 1 (the
/// session id, which prost writes first) made the fork's, and its base dropped. A replica
/// killed in the middle leaves each fork whole or untouched, and the sweep of
/// `agentlog_erasures` finds the rest. A fork made after the walk cannot read through
/// these sessions: a fork's transaction locks its parent live (see `write_fork`), and a
/// live session found here reads none of them once materialized, nor does any fork of it.
async fn materialize_forks(
    client: &tokio_postgres::Client,
    session_ids: &[String],
) -> Result<(), String> {
    let failed = |e: Timed| match e {
        Timed::Db(e) => e.to_string(),
        Timed::Elapsed => "the database did not answer".to_string(),
    };
    let forks: Vec<String> = timed("erase", async {
        client
            .query(
                "WITH RECURSIVE d(session_id, deleted) AS (\
                 SELECT session_id, deleted_unix_ms > 0 FROM agentlog_sessions \
                 WHERE base_session = ANY($1) AND base_session <> '' \
                 UNION SELECT s.session_id, s.deleted_unix_ms > 0 FROM d \
                 JOIN agentlog_sessions s ON s.base_session = d.session_id \
                 AND s.base_session <> '' WHERE d.deleted) \
                 SELECT session_id FROM d WHERE NOT deleted",
                &[&session_ids],
            )
            .await
    })
    .await
    .map_err(failed)?
    .iter()
    .map(|r| r.get(0))
    .collect();
    for fork in &forks {
        let head = session_id_field(fork);
        let materialized = timed("erase", async {
            client.query_one(MATERIALIZE, &[fork, &head]).await
        })
        .await
        .map_err(failed)?;
        let (copied, expected): (i64, i64) = (materialized.get(0), materialized.get(1));
        if copied != expected {
            // Never reached while every seq of a line is stored. Should it be, the erasure
            // stops here, keeping the base's rows for a person to look at.
            tracing::error!(session_id = %fork, copied, expected, "a fork's materialized prefix is short; the erasure of its base stops");
            return Err(format!(
                "fork {fork}'s materialized prefix is short: {copied} of {expected} events"
            ));
        }
        tracing::info!(session_id = %fork, events = copied, "a fork's prefix materialized before its base's erasure");
    }
    Ok(())
}

/// The start of a stored event's body that holds `session_id` (field 1, which prost
/// writes first): the key, the length and the id.
fn session_id_field(session_id: &str) -> Vec<u8> {
    let mut head = vec![0x0a];
    prost::encoding::encode_varint(session_id.len() as u64, &mut head);
    head.extend_from_slice(session_id.as_bytes());
    head
}

/// Retention: every `retention.interval`, the replica that gets [`RETENTION_LOCK`] runs a
/// pass; the others skip it.
async fn run_retention(
    connector: Arc<Connector>,
    board: Arc<Board>,
    notify: Option<mpsc::UnboundedSender<(String, bool)>>,
    retention: Retention,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(retention.interval) => {}
            _ = stop.cancelled() => return,
        }
        let pass = retention_pass(&connector, &board, notify.as_ref(), retention);
        let result = tokio::select! {
            result = pass => result,
            _ = stop.cancelled() => return,
        };
        if let Err(e) = result {
            tracing::warn!(error = %e, "a retention pass stopped; the next one tries again");
        }
    }
}

/// One pass of retention, on a connection of its own (the advisory lock is the
/// connection's: it goes with it, should this replica die in the middle): steps of at most
/// [`BATCH`] sessions, each read, decided by [`rules::expired`], tombstoned in one
/// version-checked statement (a session written since it was read is left for the next
/// pass) and erased, until no idle session is left.
async fn retention_pass(
    connector: &Connector,
    board: &Board,
    notify: Option<&mpsc::UnboundedSender<(String, bool)>>,
    retention: Retention,
) -> Result<(), String> {
    let (client, connection) = connector
        .pg_config
        .connect(connector.tls.clone())
        .await
        .map_err(|e| e.to_string())?;
    let driver = tokio::spawn(connection);
    // Planned as the pool's connections plan (see `PgBackend::open`).
    for setting in CONNECTION_SETTINGS {
        if let Err(e) = client.batch_execute(setting).await {
            tracing::debug!(error = %e, setting, "not set");
        }
    }
    let locked: bool = client
        .query_one("SELECT pg_try_advisory_lock($1)", &[&RETENTION_LOCK])
        .await
        .map_err(|e| e.to_string())?
        .get(0);
    if !locked {
        driver.abort();
        return Ok(());
    }
    let result = async {
        loop {
            let step_started = std::time::Instant::now();
            let now = now_unix_ms();
            let idle_before = retention.idle_before(now);
            let rows = client
                .query(
                    "SELECT session_id, version, meta FROM agentlog_sessions \
                     WHERE updated_second <= $1 AND updated_unix_ms < $2 \
                     AND deleted_unix_ms = 0 AND last_seq > 0 \
                     AND lease_expires_unix_ms <= $3 ORDER BY updated_second LIMIT $4",
                    &[&(idle_before / 1000), &idle_before, &now, &(BATCH as i64)],
                )
                .await
                .map_err(|e| e.to_string())?;
            let mut expired: Vec<(String, i64)> = Vec::with_capacity(rows.len());
            for row in &rows {
                let meta = decode_meta(row.get(2)).map_err(|e| e.to_string())?;
                if rules::expired(&meta, idle_before, now) {
                    expired.push((row.get(0), row.get(1)));
                }
            }
            if expired.is_empty() {
                return Ok(());
            }
            // Locked in session_id order, as the append batches lock them.
            expired.sort_unstable();
            let (ids, versions): (Vec<String>, Vec<i64>) = expired.into_iter().unzip();
            let tombstone = SessionMeta::tombstone(now);
            let deleted: Vec<String> = timed("retention", async {
                client
                    .query(
                        "WITH w AS (SELECT * FROM unnest($1::text[], $2::bigint[]) \
                         AS w(session_id, version)), \
                         t AS (UPDATE agentlog_sessions s SET version = s.version + 1, \
                         meta = $3, last_seq = 0, status = 0, lease_expires_unix_ms = 0, \
                         first_user_text = '', deleted_unix_ms = $4 FROM w \
                         WHERE s.session_id = w.session_id COLLATE \"C\" \
                         AND s.version = w.version RETURNING s.session_id), \
                         e AS (INSERT INTO agentlog_erasures (session_id, deleted_unix_ms) \
                         SELECT session_id, $4 FROM t ON CONFLICT (session_id) DO NOTHING) \
                         SELECT session_id FROM t",
                        &[&ids, &versions, &tombstone.encode_to_vec(), &now],
                    )
                    .await
            })
            .await
            .map_err(|e| match e {
                Timed::Db(e) => e.to_string(),
                Timed::Elapsed => "the database did not answer".to_string(),
            })?
            .iter()
            .map(|row| row.get(0))
            .collect();
            for session_id in &deleted {
                board.wake(session_id, false);
                if let Some(notify) = notify {
                    let _ = notify.send((session_id.clone(), false));
                }
            }
            crate::metrics::sessions_deleted("retention", deleted.len());
            tracing::info!(sessions = deleted.len(), "retention deleted idle sessions");
            erase(&client, &deleted).await?;
            if rows.len() < BATCH || deleted.is_empty() {
                return Ok(());
            }
            // The database's time between steps is the appends' (their commits share its
            // WAL flushes): the pass rests twice as long as each step took.
            let rest = step_started
                .elapsed()
                .mul_f64((1.0 - RETENTION_BUSY_SHARE) / RETENTION_BUSY_SHARE);
            tokio::time::sleep(rest.min(Duration::from_secs(1))).await;
        }
    }
    .await;
    let _ = client
        .execute("SELECT pg_advisory_unlock($1)", &[&RETENTION_LOCK])
        .await;
    driver.abort();
    result
}

/// Every [`ERASURE_SWEEP`], finishes the erasures that a replica left behind (it stopped,
/// or lost the database, in the middle of one).
async fn sweep_erasures(connector: Arc<Connector>, stop: CancellationToken) {
    loop {
        let left: Result<Vec<String>, String> = async {
            let client = connector.pool.get().await.map_err(|e| e.to_string())?;
            let before = now_unix_ms() - ERASURE_SWEEP.as_millis() as i64;
            let rows = client
                .query(
                    "SELECT session_id FROM agentlog_erasures WHERE deleted_unix_ms < $1 \
                     ORDER BY deleted_unix_ms LIMIT 100",
                    &[&before],
                )
                .await
                .map_err(|e| e.to_string())?;
            Ok(rows.iter().map(|r| r.get(0)).collect())
        }
        .await;
        let left = left.unwrap_or_default();
        if !left.is_empty() {
            let erased = match connector.pool.get().await {
                Ok(client) => erase(&client, &left).await,
                Err(e) => Err(e.to_string()),
            };
            if let Err(e) = erased {
                tracing::debug!(error = %e, "an erasure sweep stopped; retrying later");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(ERASURE_SWEEP) => {}
            _ = stop.cancelled() => return,
        }
    }
}

fn with_lease(meta: &SessionMeta, record: &LeaseRecord) -> SessionMeta {
    let mut meta = meta.clone();
    meta.apply_lease(record);
    meta
}

/// One subscription: reads the session's events from `next` on, in seq order with no gap,
/// and with `follow` keeps reading whenever it is woken or the safety poll comes round.
struct Follower {
    connector: Arc<Connector>,
    wake: watch::Receiver<u64>,
    session_id: String,
    next: u64,
    poll_interval: Duration,
}

impl Follower {
    async fn run(mut self, follow: bool, tx: mpsc::Sender<Result<EventRun, StoreError>>) {
        let mut backoff = Duration::from_millis(100);
        loop {
            self.wake.borrow_and_update();
            let read = self.read().await;
            let full = match read {
                Ok(events) => {
                    backoff = Duration::from_millis(100);
                    let full = events.len() as i64 == READ_BATCH;
                    let mut run = Vec::with_capacity(events.len());
                    for event in events {
                        // Seqs commit in order per session; a hole would be a bug, and is
                        // never skipped over.
                        if event.seq != self.next {
                            break;
                        }
                        run.push(event);
                        self.next += 1;
                    }
                    if !run.is_empty() && tx.send(Ok(EventRun::Decoded(run))).await.is_err() {
                        return;
                    }
                    full
                }
                // A follower rides out an outage; a one-off read reports it, and a refusal
                // (the session was deleted) ends either.
                Err(e) if !follow || e.reason().is_some() => {
                    let _ = tx.send(Err(e)).await;
                    return;
                }
                Err(e) => {
                    tracing::debug!(error = %e, session_id = %self.session_id, "a follower's read failed; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = tx.closed() => return,
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                    continue;
                }
            };
            if full {
                continue;
            }
            if !follow {
                return;
            }
            tokio::select! {
                _ = self.wake.changed() => {}
                _ = tokio::time::sleep(self.poll_interval) => {}
                _ = tx.closed() => return,
            }
        }
    }

    /// The next events, or the refusal of a deleted session: none is read once its tombstone
    /// is committed (the erasure of its rows may still be under way). A fork's shared
    /// prefix is read down its line of bases (`line_cte`), each event given the fork's id.
    async fn read(&self) -> Result<Vec<Event>, StoreError> {
        let unavailable = |e: String| StoreError::Unavailable(format!("reading events: {e}"));
        let client = self
            .connector
            .pool
            .get()
            .await
            .map_err(|e| unavailable(e.to_string()))?;
        let failed = |e| match e {
            Timed::Db(e) => unavailable(e.to_string()),
            Timed::Elapsed => unavailable("the database did not answer".into()),
        };
        let rows = timed("read_events", async {
            let stmt = client
                .prepare_cached(concat!(
                    line_cte!(),
                    "SELECT e.body FROM line l CROSS JOIN LATERAL (\
                     SELECT seq, body FROM agentlog_events WHERE session_id = l.sid \
                     AND seq >= $2 AND seq <= l.hi ORDER BY seq LIMIT $3) e \
                     WHERE NOT EXISTS (SELECT 1 FROM agentlog_sessions \
                     WHERE session_id = $1 AND deleted_unix_ms > 0) \
                     ORDER BY e.seq LIMIT $3"
                ))
                .await?;
            client
                .query(&stmt, &[&self.session_id, &(self.next as i64), &READ_BATCH])
                .await
        })
        .await
        .map_err(failed)?;
        if rows.is_empty() {
            let deleted = timed("read_events", async {
                let stmt = client
                    .prepare_cached(
                        "SELECT 1 FROM agentlog_sessions WHERE session_id = $1 \
                         AND deleted_unix_ms > 0",
                    )
                    .await?;
                client.query_opt(&stmt, &[&self.session_id]).await
            })
            .await
            .map_err(failed)?;
            if deleted.is_some() {
                return Err(rules::session_deleted(&self.session_id));
            }
        }
        rows.iter()
            .map(|row| {
                let mut event = Event::decode(row.get::<_, &[u8]>(0))
                    .map_err(|e| StoreError::Internal(format!("an event does not decode: {e}")))?;
                // A prefix read through the base is the fork's.
                event.session_id.clone_from(&self.session_id);
                Ok(event)
            })
            .collect()
    }
}

/// Creates or migrates the schema, waiting with backoff while the database is unreachable
/// (replicas may start before it); a schema newer than this build is an error at once.
async fn migrate_with_retry(connector: &Connector) -> Result<(), PgOpenError> {
    let mut backoff = Duration::from_millis(200);
    loop {
        let attempt = async {
            let mut client = connector.pool.get().await.map_err(|e| e.to_string())?;
            let client: &mut tokio_postgres::Client = &mut client;
            match schema::migrate(client).await {
                Ok(()) => Ok(Ok(())),
                Err(e @ schema::SchemaError::TooNew { .. }) => Ok(Err(e)),
                Err(e) => Err(e.to_string()),
            }
        };
        match attempt.await {
            Ok(result) => return result.map_err(PgOpenError::from),
            Err(e) => {
                tracing::warn!(error = %e, retry_in_ms = backoff.as_millis() as u64, "the database is not reachable yet");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
}

/// Keeps `serving` true while the database answers: a `SELECT 1` answered within
/// [`DB_ANSWER`] on a connection of the probe's own (so that a busy pool is not taken for a
/// lost database, nor a pooled connection for a live one), every second, and at once (then
/// every half second until it answers) when a call found the database gone.
async fn watch_health(connector: Arc<Connector>, health: Arc<Health>, shutdown: CancellationToken) {
    let mut probe: Option<tokio_postgres::Client> = None;
    loop {
        let answered = tokio::time::timeout(DB_ANSWER, async {
            let client = match probe.take().filter(|c| !c.is_closed()) {
                Some(client) => client,
                None => {
                    let (client, connection) =
                        connector.pg_config.connect(connector.tls.clone()).await?;
                    tokio::spawn(connection);
                    client
                }
            };
            client.simple_query("SELECT 1").await?;
            Ok::<_, tokio_postgres::Error>(client)
        })
        .await;
        let up = match answered {
            Ok(Ok(client)) => {
                probe = Some(client);
                true
            }
            // Dropped: a connection that did not answer in time is not asked again.
            Ok(Err(_)) | Err(_) => false,
        };
        if health
            .serving
            .send_if_modified(|now| std::mem::replace(now, up) != up)
        {
            if up {
                tracing::info!("the database answers again: serving");
            } else {
                tracing::warn!(
                    "the database is unreachable: NOT_SERVING, appends answer UNAVAILABLE"
                );
            }
        }
        let wait = if up {
            Duration::from_secs(1)
        } else {
            Duration::from_millis(500)
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = health.check.notified() => {}
            _ = shutdown.cancelled() => return,
        }
    }
}
