//! `event-store --listen HOST:PORT --data-dir DIR`: serves agentlog.v1.EventStore.
//!
//! SIGTERM (or Ctrl-C): stop accepting, end streams and long-polls, let in-flight appends
//! finish and be fsync'd, then exit 0. A failure of the log's disk exits 1: nothing more can
//! be acknowledged safely, and a restart recovers from what is really on disk.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use event_store::{service, Store, StoreConfig};
use tokio::signal::unix::{signal, SignalKind};
use tokio_util::sync::CancellationToken;

#[derive(Parser, Debug)]
#[command(
    version,
    about = "agentlog event store: durable per-session logs over gRPC"
)]
struct Args {
    /// Address to serve gRPC on (port 0 picks a free port; the chosen one is logged).
    #[arg(long, env = "AGENTLOG_LISTEN", default_value = "127.0.0.1:50051")]
    listen: String,
    /// Directory for the log segments and the index (created if missing).
    #[arg(long, env = "AGENTLOG_DATA_DIR")]
    data_dir: PathBuf,
    /// Close each client connection gracefully after this many seconds (0: never), so that
    /// long-lived HTTP/2 clients reconnect and rebalance.
    #[arg(long, env = "AGENTLOG_MAX_CONNECTION_AGE_SECS", default_value_t = 0)]
    max_connection_age_secs: u64,
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .init();
    let args = Args::parse();
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run(args))
}

async fn run(args: Args) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("creating --data-dir {}", args.data_dir.display()))?;
    let store = Store::open(StoreConfig::in_dir(&args.data_dir)?)
        .with_context(|| format!("opening the store in {}", args.data_dir.display()))?;
    let store = Arc::new(store);
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .with_context(|| format!("binding --listen {}", args.listen))?;
    let listen_addr = service::local_addr(&listener).context("reading the bound address")?;
    tracing::info!(%listen_addr, data_dir = %args.data_dir.display(), "event store serving");

    let shutdown = CancellationToken::new();
    let writer_stopped = store.writer_stopped();
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

    let max_connection_age = (args.max_connection_age_secs > 0)
        .then(|| Duration::from_secs(args.max_connection_age_secs));
    service::serve(store.clone(), listener, max_connection_age, shutdown).await?;
    let disk_failed = disk_failed.await.unwrap_or(true);
    let store = Arc::into_inner(store).context("requests still hold the store after shutdown")?;
    store.close().context("the log writer failed")?;
    if disk_failed {
        anyhow::bail!("the log writer stopped; exiting so that a restart recovers from disk");
    }
    tracing::info!("every acknowledged append is fsync'd; exiting");
    Ok(())
}
