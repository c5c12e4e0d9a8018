//! `event-store --listen HOST:PORT (--data-dir DIR | --database-url URL)`: serves
//! agentlog.v1.EventStore over the local log or over PostgreSQL.
//!
//! SIGTERM (or Ctrl-C): stop accepting, end streams (with UNAVAILABLE, so that clients
//! subscribe again elsewhere) and long-polls, answer every request already received (an
//! append acknowledged once fsync'd or committed, or refused), then exit 0. A connection
//! that is still open 50 s on (a client that stopped reading) is cut, so the store is gone
//! within its pod's 60 s grace period whatever its clients do. A failure of the log's disk exits 1:
//! nothing more can be acknowledged safely, and a restart recovers from what is really on
//! disk. The database being unreachable is not fatal: the store answers UNAVAILABLE and
//! reports NOT_SERVING until it is back.
//!
//! Test-only: `AGENTLOG_TEST_CLOCK_FILE=PATH` runs the store's clock ahead of the system's
//! by the milliseconds in that file (see `event_store::clock`), so that a test can make
//! sessions idle for a month in a second.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use event_store::auth::{Access, TokensFileWatch};
use event_store::backend::local::reclaim::ReclaimConfig;
use event_store::backend::local::{Store, StoreConfig};
use event_store::backend::postgres::{NotifyMode, PgBackend, PgConfig};
use event_store::backend::Backend;
use event_store::incoming::ConnLimits;
use event_store::limits::CallerLimits;
use event_store::retention::{self, Retention};
use event_store::service;
use event_store::service::ServeOptions;
use event_store::tls::{self, Reload, ReloadingTls, TlsFiles};
use event_store::transfer::archive::Archive;
use tokio::signal::unix::{signal, SignalKind};
use tokio_util::sync::CancellationToken;

/// mimalloc rather than the system allocator: per append the gRPC layers and the writer
/// allocate and free many small buffers, which glibc's malloc made a tenth of the store's
/// CPU (bench/RESULTS.md, "The write path: before and after").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Parser, Debug)]
#[command(
    version = build_info::VERSION_AND_COMMIT,
    about = "agentlog event store: durable per-session logs over gRPC"
)]
#[command(group(
    clap::ArgGroup::new("backend")
        .required(true)
        .multiple(false)
        .args(["data_dir", "database_url"])
))]
struct Args {
    /// Address to serve gRPC on (port 0 picks a free port; the chosen one is logged).
    #[arg(long, env = "AGENTLOG_LISTEN", default_value = "127.0.0.1:50051")]
    listen: String,
    /// The local backend: directory for the log segments and the index (created if
    /// missing). One replica. Give exactly one of --data-dir and --database-url.
    #[arg(long, env = "AGENTLOG_DATA_DIR")]
    data_dir: Option<PathBuf>,
    /// The PostgreSQL backend: `postgres://user:pass@host:port/db` (several hosts and
    /// `target_session_attrs=read-write` ride out a failover). Any number of replicas may
    /// serve one database. Give exactly one of --data-dir and --database-url.
    #[arg(long, env = "AGENTLOG_DATABASE_URL", hide_env_values = true)]
    database_url: Option<String>,
    /// PEM CA certificates to trust for TLS to the database (besides the public roots).
    #[arg(long, env = "AGENTLOG_DATABASE_CA", requires = "database_url")]
    database_ca: Option<PathBuf>,
    /// Database connections in the pool: appends in flight at once.
    #[arg(long, env = "AGENTLOG_DATABASE_POOL_SIZE", default_value_t = 32)]
    database_pool_size: usize,
    /// How replicas wake each other's followers and claimants: `listen` (LISTEN/NOTIFY,
    /// sent after commit, plus a safety poll) or `poll` (for engines without LISTEN).
    #[arg(long, env = "AGENTLOG_NOTIFY", value_enum, default_value_t = NotifyMode::Listen)]
    notify: NotifyMode,
    /// How often followers and claimants re-read without a wake-up (default 1000 with
    /// `--notify listen`, 100 with `--notify poll`).
    #[arg(long, env = "AGENTLOG_POLL_INTERVAL_MS")]
    poll_interval_ms: Option<u64>,
    /// Delete every session whose last event is older than this and that holds no live
    /// lease, as DeleteSession does (e.g. 30d, 12h; units d, h, m, s, ms). Off by default:
    /// sessions are kept for good. With PostgreSQL one replica at a time runs it.
    #[arg(long, env = "AGENTLOG_RETAIN_IDLE", value_parser = retention::parse_duration)]
    retain_idle: Option<Duration>,
    /// How long retention waits after one pass before the next.
    #[arg(
        long,
        env = "AGENTLOG_RETENTION_INTERVAL",
        value_parser = retention::parse_duration,
        default_value = "1m",
        requires = "retain_idle"
    )]
    retention_interval: Duration,
    /// With --retain-idle: before retention deletes a session, export it to a file of its
    /// own in DIR (`<session>.agentlog.jsonl`, `agentlog import` reads it back) and fsync
    /// it; a session written to since is not deleted.
    #[arg(long, env = "AGENTLOG_ARCHIVE_DIR", requires = "retain_idle")]
    archive_dir: Option<PathBuf>,
    /// The local backend: a deleted session's records are rewritten out of the log at the
    /// latest this long after its deletion (sooner once a quarter of a segment is dead).
    #[arg(
        long,
        env = "AGENTLOG_RECLAIM_AFTER",
        value_parser = retention::parse_duration,
        default_value = "30s"
    )]
    reclaim_after: Duration,
    /// The local backend: the share of one core a reclamation pass takes at most (it rests
    /// between its pieces of work so that appends keep the machine; 1: never rests).
    #[arg(
        long,
        env = "AGENTLOG_RECLAIM_SHARE",
        default_value_t = 0.25,
        hide = true
    )]
    reclaim_share: f64,
    /// Memory for the states of the sessions in use (`64MiB`, `1GiB`, or bytes); every
    /// other session's state is read from the local index, or from PostgreSQL, when
    /// needed, so an idle session costs no memory.
    #[arg(
        long,
        env = "AGENTLOG_SESSION_CACHE",
        value_parser = parse_bytes,
        default_value = "64MiB"
    )]
    session_cache: usize,
    /// Run without the full-text index of SearchSessions (which then answers UNAVAILABLE):
    /// what the index costs appends, measured by the bench.
    #[arg(long, env = "AGENTLOG_NO_SEARCH_INDEX")]
    no_search_index: bool,
    /// The local backend: the least time between two commits of the search index (what an
    /// event waits, about, before a search finds it; less costs more CPU an append). For
    /// the search bench's sweep of it: SearchSessions promises 1 s only at the default.
    #[arg(
        long,
        env = "AGENTLOG_SEARCH_COMMIT_EVERY",
        value_parser = retention::parse_duration,
        conflicts_with_all = ["database_url", "no_search_index"],
        hide = true
    )]
    search_commit_every: Option<Duration>,
    /// The local backend: roll to a new segment file once the current one holds this many
    /// bytes (for tests that want many segments). Default: a sixteenth of the data volume,
    /// between 1 MiB and 64 MiB, so that a full volume comes back whatever its size.
    #[arg(long, env = "AGENTLOG_SEGMENT_BYTES", hide = true)]
    segment_bytes: Option<u64>,
    /// Close each client connection gracefully after this many seconds (0: never), so that
    /// long-lived HTTP/2 clients reconnect and rebalance.
    #[arg(long, env = "AGENTLOG_MAX_CONNECTION_AGE_SECS", default_value_t = 0)]
    max_connection_age_secs: u64,

    /// Serve TLS with this PEM certificate chain (re-read when the file changes or on
    /// SIGHUP). Without it the store speaks plaintext, which is allowed only on a loopback
    /// address unless --insecure-plaintext is given.
    #[arg(long, env = "AGENTLOG_TLS_CERT", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, env = "AGENTLOG_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Require every client to present a certificate signed by this PEM CA (mutual TLS).
    #[arg(long, env = "AGENTLOG_TLS_CLIENT_CA", requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
    /// Allow plaintext on a non-loopback --listen address (tokens and session contents then
    /// cross the network readable; logged as a warning).
    #[arg(long, env = "AGENTLOG_INSECURE_PLAINTEXT")]
    insecure_plaintext: bool,
    /// Bearer tokens and their roles: a JSON file of {"tokens": [{"name", "sha256", "role":
    /// client|runner|admin, "prefixes"}]} holding only SHA-256 hashes (see the README).
    /// Re-read when it changes or on SIGHUP. Without it every caller may do everything, which
    /// is allowed only on a loopback address, with mTLS, or with --allow-unauthenticated.
    #[arg(long, env = "AGENTLOG_TOKENS_FILE")]
    tokens_file: Option<PathBuf>,
    /// Allow serving without --tokens-file on a non-loopback address without mTLS (anyone
    /// who reaches the port may read and write every session; logged as a warning).
    #[arg(long, env = "AGENTLOG_ALLOW_UNAUTHENTICATED")]
    allow_unauthenticated: bool,
    /// Serve gRPC reflection (v1 and v1alpha) so that grpcurl needs no .proto files. With
    /// --tokens-file it needs a valid token, like every other call but health.
    #[arg(long, env = "AGENTLOG_REFLECTION", default_value_t = true, action = clap::ArgAction::Set)]
    reflection: bool,
    /// How often the certificate and tokens files are checked for changes.
    #[arg(long, env = "AGENTLOG_RELOAD_INTERVAL_MS", default_value_t = 1000)]
    reload_interval_ms: u64,

    /// Sustained requests per second per caller (a token; the peer address on an open
    /// store); more are answered RESOURCE_EXHAUSTED. 0: no limit.
    #[arg(long, env = "AGENTLOG_MAX_REQUESTS_PER_SEC", default_value_t = 0)]
    max_requests_per_sec: u32,
    /// Requests a caller may make in a burst above --max-requests-per-sec.
    #[arg(long, env = "AGENTLOG_REQUEST_BURST", default_value_t = 100)]
    request_burst: u32,
    /// Subscribe streams one caller may have open at once (0: no limit).
    #[arg(
        long,
        env = "AGENTLOG_MAX_SUBSCRIPTIONS_PER_CALLER",
        default_value_t = 1000
    )]
    max_subscriptions_per_caller: usize,
    /// Connections open at once from one peer address; calls on more are answered
    /// RESOURCE_EXHAUSTED and the connection is closed.
    #[arg(
        long,
        env = "AGENTLOG_MAX_CONNECTIONS_PER_PEER",
        default_value_t = 1000
    )]
    max_connections_per_peer: usize,
    /// Also serve gRPC health alone, in plaintext, on this address (for Kubernetes' native
    /// gRPC probes, which cannot use TLS).
    #[arg(long, env = "AGENTLOG_HEALTH_LISTEN")]
    health_listen: Option<String>,
    /// Connections open at once in all; more are closed as they arrive.
    #[arg(long, env = "AGENTLOG_MAX_CONNECTIONS", default_value_t = 10_000)]
    max_connections: usize,
    /// Serve Prometheus metrics at http://HOST:PORT/metrics (plaintext, no auth: bind it
    /// where only the scraper can reach it). Traces go out over OTLP when the standard
    /// OTEL_EXPORTER_OTLP_ENDPOINT is set.
    #[arg(long, env = "AGENTLOG_METRICS_LISTEN")]
    metrics_listen: Option<String>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(path) = std::env::var_os("AGENTLOG_TEST_CLOCK_FILE") {
        event_store::clock::follow_offset_file(path.into());
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let telemetry = runtime.block_on(async { telemetry::init("event-store") })?;
    let result = runtime.block_on(run(args));
    // Outside async code, with the runtime still up: the exporter's last batch goes out.
    telemetry.shutdown();
    result
}

/// The backend chosen on the command line; the local one is kept by its type so that it can
/// be closed (and its writer joined) at the end.
enum Opened {
    Local(Arc<Store>),
    Postgres(Arc<PgBackend>),
}

async fn open_backend(args: &Args) -> anyhow::Result<Opened> {
    // With --archive-dir, retention is the archive's (see `run`), not the backend's own.
    let retention = args
        .retain_idle
        .filter(|_| args.archive_dir.is_none())
        .map(|idle| Retention {
            idle,
            interval: args.retention_interval,
        });
    if let Some(url) = &args.database_url {
        let poll_ms = args.poll_interval_ms.unwrap_or(match args.notify {
            NotifyMode::Listen => 1000,
            NotifyMode::Poll => 100,
        });
        let backend = PgBackend::open(PgConfig {
            url: url.clone(),
            ca_file: args.database_ca.clone(),
            pool_size: args.database_pool_size,
            notify: args.notify,
            poll_interval: Duration::from_millis(poll_ms.max(10)),
            retention,
            cache_bytes: args.session_cache,
            search: !args.no_search_index,
        })
        .await
        .context("opening the PostgreSQL backend")?;
        return Ok(Opened::Postgres(Arc::new(backend)));
    }
    let data_dir = args
        .data_dir
        .as_ref()
        .context("give --data-dir DIR or --database-url URL")?;
    std::fs::create_dir_all(data_dir)
        .with_context(|| format!("creating --data-dir {}", data_dir.display()))?;
    let mut config = StoreConfig {
        retention,
        session_cache_bytes: args.session_cache,
        ..StoreConfig::in_dir(data_dir)?
    };
    if args.no_search_index {
        config.search_dir = None;
    }
    if let Some(every) = args.search_commit_every {
        config.search_commit_every = every;
    }
    if let Some(segment_bytes) = args.segment_bytes {
        anyhow::ensure!(
            segment_bytes >= 64 << 10,
            "--segment-bytes {segment_bytes} is below the smallest segment, 64 KiB"
        );
        config.log_config.segment_bytes = segment_bytes;
        config.log_config.preallocate_bytes =
            event_store::backend::local::log::DEFAULT_PREALLOCATE_BYTES.min(segment_bytes / 4);
    }
    anyhow::ensure!(
        args.reclaim_share > 0.0 && args.reclaim_share <= 1.0,
        "--reclaim-share {} is not a share of a core; give one above 0 and at most 1",
        args.reclaim_share
    );
    config.reclaim = ReclaimConfig {
        after: args.reclaim_after,
        busy_share: args.reclaim_share,
        ..ReclaimConfig::for_segments(config.log_config.segment_bytes)
    };
    let store = Store::open(config)
        .with_context(|| format!("opening the store in {}", data_dir.display()))?;
    Ok(Opened::Local(Arc::new(store)))
}

async fn run(args: Args) -> anyhow::Result<()> {
    // Where it listens and how it is secured are settled before the data is touched, so
    // a refusal (a container's default command without TLS, say) leaves the data dir as
    // it was.
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("binding --listen {}", args.listen))?;
    let listen_addr = service::local_addr(&listener).context("reading the bound address")?;
    let security = Security::from_args(&args, listen_addr)?;
    let opened = open_backend(&args).await?;
    let (backend, backend_name): (Arc<dyn Backend>, &str) = match &opened {
        Opened::Local(store) => (store.clone(), "local"),
        Opened::Postgres(pg) => (pg.clone(), "postgres"),
    };
    let archiving = CancellationToken::new();
    if let (Some(dir), Some(idle)) = (&args.archive_dir, args.retain_idle) {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating --archive-dir {}", dir.display()))?;
        let archive = Archive {
            dir: dir.clone(),
            retention: Retention {
                idle,
                interval: args.retention_interval,
            },
        };
        tokio::spawn(archive.run(backend.clone(), archiving.clone()));
    }
    let _stop_archiving = archiving.drop_guard();
    tracing::info!(
        %listen_addr,
        backend = backend_name,
        data_dir = %args.data_dir.as_deref().map(|d| d.display().to_string()).unwrap_or_default(),
        tls = security.tls.is_some(),
        mtls = security.tls.as_ref().is_some_and(|t| t.requires_client_cert()),
        tokens = security.tokens.as_ref().map_or(0, |t| t.len()),
        "event store serving"
    );

    let shutdown = CancellationToken::new();
    let writer_stopped: std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>> =
        match &opened {
            Opened::Local(store) => Box::pin(store.writer_stopped()),
            Opened::Postgres(_) => Box::pin(std::future::pending()),
        };
    let mut sigterm = signal(SignalKind::terminate())?;
    let mut sigint = signal(SignalKind::interrupt())?;
    let trigger = shutdown.clone();
    let disk_failed = tokio::spawn(async move {
        let failed = tokio::select! {
            _ = sigterm.recv() => { tracing::info!("SIGTERM: draining"); false }
            _ = sigint.recv() => { tracing::info!("SIGINT: draining"); false }
            _ = writer_stopped => true,
        };
        trigger.cancel();
        failed
    });

    let mut watched: Vec<Arc<dyn Reload>> = Vec::new();
    if let Some(tls) = &security.tls {
        watched.push(tls.clone());
    }
    if let Some(tokens) = &security.tokens {
        watched.push(tokens.clone());
    }
    tokio::spawn(tls::watch_files(
        watched,
        Duration::from_millis(args.reload_interval_ms.max(50)),
        shutdown.clone(),
    ));
    if let Some(addr) = &args.metrics_listen {
        let metrics = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding --metrics-listen {addr}"))?;
        let metrics_addr = service::local_addr(&metrics).context("reading the bound address")?;
        tracing::info!(%metrics_addr, "serving Prometheus metrics at /metrics");
        let mut registry =
            event_store::metrics::registry(args.data_dir.as_ref().map(|dir| dir.join("log")));
        if let Opened::Postgres(pg) = &opened {
            registry.register_collector(Box::new(pg.pool_metrics()));
        }
        build_info::register(&mut registry);
        let stop = shutdown.clone();
        tokio::spawn(async move {
            if let Err(e) = telemetry::serve_metrics(metrics, registry, stop).await {
                tracing::error!(error = %e, "the metrics listener failed");
            }
        });
    }
    if let Some(addr) = &args.health_listen {
        let health = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding --health-listen {addr}"))?;
        tracing::info!(health_addr = %addr, "serving plaintext health checks");
        let stop = shutdown.clone();
        let serving = backend.serving();
        tokio::spawn(async move {
            if let Err(e) = service::serve_health(health, serving, stop).await {
                tracing::error!(error = %e, "the health listener failed");
            }
        });
    }
    let options = ServeOptions {
        max_connection_age: (args.max_connection_age_secs > 0)
            .then(|| Duration::from_secs(args.max_connection_age_secs)),
        tls: security.tls,
        access: security.tokens.map_or(Access::Open, Access::Tokens),
        reflection: args.reflection,
        caller_limits: CallerLimits {
            requests_per_sec: args.max_requests_per_sec,
            burst: args.request_burst,
            max_subscriptions: args.max_subscriptions_per_caller,
        },
        conn_limits: ConnLimits {
            max_connections: args.max_connections.max(1),
            max_per_peer: args.max_connections_per_peer.max(1),
        },
    };
    service::serve(backend, listener, options, shutdown).await?;
    let disk_failed = disk_failed.await.unwrap_or(true);
    match opened {
        Opened::Local(store) => {
            let store = sole_owner(store)
                .await
                .context("requests still hold the store after shutdown")?;
            store.close().context("the log writer failed")?;
            if disk_failed {
                anyhow::bail!(
                    "the log writer stopped; exiting so that a restart recovers from disk"
                );
            }
            tracing::info!("every acknowledged append is fsync'd; exiting");
        }
        Opened::Postgres(_) => tracing::info!("every acknowledged append is committed; exiting"),
    }
    Ok(())
}

/// The store once no task holds it any more: a task that gives back the lease of a claimant
/// that went away may finish just after the last connection closed.
async fn sole_owner<T>(mut shared: Arc<T>) -> Option<T> {
    for _ in 0..200 {
        match Arc::try_unwrap(shared) {
            Ok(owned) => return Some(owned),
            Err(still_shared) => shared = still_shared,
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    None
}

/// Transport security and authentication, checked against where the store listens: on a
/// loopback address anything goes (local use stays two commands); elsewhere plaintext needs
/// --insecure-plaintext and an open store needs mTLS or --allow-unauthenticated.
struct Security {
    tls: Option<Arc<ReloadingTls>>,
    tokens: Option<Arc<TokensFileWatch>>,
}

impl Security {
    fn from_args(args: &Args, listen_addr: std::net::SocketAddr) -> anyhow::Result<Security> {
        let loopback = listen_addr.ip().is_loopback();
        let tls = match (&args.tls_cert, &args.tls_key) {
            (Some(cert), Some(key)) => Some(Arc::new(
                ReloadingTls::open(TlsFiles {
                    cert: cert.clone(),
                    key: key.clone(),
                    client_ca: args.tls_client_ca.clone(),
                })
                .context("loading the TLS certificate")?,
            )),
            _ => None,
        };
        let tokens = match &args.tokens_file {
            Some(path) => Some(Arc::new(
                TokensFileWatch::open(path).context("loading --tokens-file")?,
            )),
            None => None,
        };
        if tls.is_none() && !loopback {
            anyhow::ensure!(
                args.insecure_plaintext,
                "--listen {listen_addr} is not a loopback address: give --tls-cert and --tls-key \
                 (or accept plaintext on the network with --insecure-plaintext)"
            );
            tracing::warn!(
                %listen_addr,
                "serving PLAINTEXT on a non-loopback address (--insecure-plaintext): tokens and \
                 session contents cross the network readable"
            );
        }
        let mtls = tls.as_ref().is_some_and(|t| t.requires_client_cert());
        if tokens.is_none() && !loopback && !mtls {
            anyhow::ensure!(
                args.allow_unauthenticated,
                "--listen {listen_addr} is not a loopback address: give --tokens-file (or \
                 --tls-client-ca), or accept that anyone who reaches the port may read and \
                 write every session with --allow-unauthenticated"
            );
            tracing::warn!(
                %listen_addr,
                "serving WITHOUT AUTHENTICATION on a non-loopback address \
                 (--allow-unauthenticated): anyone who reaches the port may read and write \
                 every session"
            );
        }
        if tokens.as_ref().is_some_and(|t| t.is_empty()) {
            tracing::warn!("--tokens-file holds no tokens: every call but health is refused");
        }
        Ok(Security { tls, tokens })
    }
}

/// A size people write: bytes, or a number with KiB, MiB or GiB (K, M, G for short).
fn parse_bytes(text: &str) -> Result<usize, String> {
    let text = text.trim();
    let digits = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(digits);
    let shift = match unit.trim() {
        "" | "B" => 0,
        "K" | "KiB" => 10,
        "M" | "MiB" => 20,
        "G" | "GiB" => 30,
        _ => {
            return Err(format!(
                "{text:?}: write bytes, or e.g. 512KiB, 64MiB, 1GiB"
            ))
        }
    };
    let number: usize = number
        .parse()
        .map_err(|_| format!("{text:?}: write bytes, or e.g. 512KiB, 64MiB, 1GiB"))?;
    number
        .checked_mul(1 << shift)
        .ok_or_else(|| format!("{text:?} is too large"))
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn sizes_are_bytes_or_a_number_and_a_binary_unit() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("64MiB"), Ok(64 << 20));
        assert_eq!(parse_bytes("512K"), Ok(512 << 10));
        assert_eq!(parse_bytes("1 GiB"), Ok(1 << 30));
        assert!(parse_bytes("64MB").unwrap_err().contains("64MiB"));
        assert!(parse_bytes("lots").is_err());
    }
}
