//! How a replica reaches the database: the connection pool (TLS, the settings every
//! connection runs first), the bound on every round trip, and the schema migrated at start.
//!
//! Promises:
//! - No call waits on the database longer than about [`DB_ANSWER`] for a sign of life, nor
//!   on one statement longer than [`STATEMENT_DEADLINE`] ([`timed`]): a database that is
//!   down, read-only or silently cut off is answered `UNAVAILABLE` (see [`super::health`]),
//!   never waited on to the client's deadline.
//! - Every pooled connection plans its statements the same way ([`CONNECTION_SETTINGS`]).
//! - A replica that starts before its database waits for it ([`migrate_with_retry`]); one
//!   that finds a schema newer than its own refuses to start.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Hook, Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres_rustls::MakeRustlsConnect;
use tokio_rustls::rustls;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::CertificateDer;

use super::schema;

/// How long the database may leave us without an answer before a call says UNAVAILABLE
/// (and health NOT_SERVING): what was sent and not acknowledged by its host's TCP
/// (`TCP_USER_TIMEOUT`), a connection idle for 1 s whose keepalive probe is not answered
/// within it (a statement whose answer never comes, the request having arrived), a
/// connection attempt, a wait for a pooled connection, and the health probe. Together they
/// answer a silently cut-off database within about this long, however the cut finds a
/// connection (`integration-tests/tests/pg_network_cut.rs`).
pub(super) const DB_ANSWER: Duration = Duration::from_secs(2);
/// A statement that has not completed by then is answered UNAVAILABLE: the backstop for a
/// database whose host still acknowledges but which does not answer. Its commit may still
/// happen: a retry with the same event ids is answered with the original seqs.
pub(super) const STATEMENT_DEADLINE: Duration = Duration::from_secs(5);

/// What every pooled connection runs first (see [`Connector::new`]). No bitmap scans
/// either: a bitmap scan never marks the index entries of dead row versions as dead, so
/// right after a burst of sessions that went runnable and then idle, every claim walked
/// all of their entries in the runnable index again, until autovacuum came (20 ms a claim
/// at 100,000 sessions, bench/RESULTS.md "Scale with sessions"); a plain index scan marks
/// them on its first walk and the next one skips them.
pub(super) const CONNECTION_SETTINGS: [&str; 3] = [
    "SET enable_seqscan = off",
    "SET enable_bitmapscan = off",
    "SET plan_cache_mode = force_generic_plan",
];

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
    pub(super) pool: Pool,
    pub(super) pg_config: tokio_postgres::Config,
    pub(super) tls: MakeRustlsConnect,
}

impl Connector {
    /// The pool over `url` (no connection is made yet), every connection bounded by
    /// [`DB_ANSWER`] and running [`CONNECTION_SETTINGS`] first.
    pub(super) fn new(
        url: &str,
        ca_file: Option<&PathBuf>,
        pool_size: usize,
    ) -> Result<Connector, PgOpenError> {
        let mut pg_config: tokio_postgres::Config = url.parse().map_err(PgOpenError::Url)?;
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
        let tls = tls_config(ca_file)?;
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
            .max_size(pool_size.max(1))
            .runtime(Runtime::Tokio1)
            .wait_timeout(Some(DB_ANSWER))
            .create_timeout(Some(DB_ANSWER))
            .recycle_timeout(Some(DB_ANSWER))
            .build()
            .map_err(|e| PgOpenError::Pool(e.to_string()))?;
        Ok(Connector {
            pool,
            pg_config,
            tls,
        })
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

pub(super) enum Timed {
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
pub(super) async fn timed<T>(
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

/// Creates or migrates the schema, waiting with backoff while the database is unreachable
/// (replicas may start before it); a schema newer than this build is an error at once.
pub(super) async fn migrate_with_retry(connector: &Connector) -> Result<(), PgOpenError> {
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
