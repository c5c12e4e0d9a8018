//! `runner`: claims runnable agentlog sessions and works them (SPEC §3, §4).
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use agentlog_proto::v1::event_store_client::EventStoreClient;
use anyhow::{Context, Result};
use clap::Parser;
use runner::lease::{claim_loop, ClaimConfig};
use runner::model::{Backoff, Model};
use runner::tools::Toolbox;
use runner::turn::TurnContext;
use tokio::signal::unix::{signal, SignalKind};
use tokio_util::sync::CancellationToken;
use tracing_subscriber::EnvFilter;

/// Works agentlog sessions: claims runnable ones from the event store, calls the model and
/// runs tools exactly once, resuming any session exactly where its log stops.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// The event store's gRPC URL, e.g. http://127.0.0.1:50051.
    #[arg(long, env = "AGENTLOG_EVENT_STORE")]
    event_store: String,
    /// This runner's name, the owner of its leases (unique among live runners).
    #[arg(long, env = "AGENTLOG_RUNNER_ID")]
    runner_id: String,
    /// Sessions' workspaces are created under this directory: DIR/<session_id>/.
    #[arg(long, env = "AGENTLOG_WORKSPACE_ROOT")]
    workspace_root: PathBuf,
    /// anthropic:MODEL, openai:MODEL or scripted:FILE.
    #[arg(long, env = "AGENTLOG_MODEL")]
    model: String,
    /// Sessions worked at once.
    #[arg(long, env = "AGENTLOG_MAX_SESSIONS", default_value_t = 8)]
    max_sessions: usize,
    /// Lease time to live; leases are renewed every third of it.
    #[arg(long, env = "AGENTLOG_LEASE_TTL_MS", default_value_t = 30_000)]
    lease_ttl_ms: u64,
    /// The most tokens one model reply may have.
    #[arg(long, env = "AGENTLOG_MAX_TOKENS", default_value_t = 8192)]
    max_tokens: u32,
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    anyhow::ensure!(
        args.lease_ttl_ms >= 300,
        "--lease-ttl-ms {} is too short: renewals every third of it need at least 300 ms",
        args.lease_ttl_ms
    );
    anyhow::ensure!(args.max_sessions >= 1, "--max-sessions must be at least 1");
    let model = Model::from_spec(&args.model)?;
    std::fs::create_dir_all(&args.workspace_root).with_context(|| {
        format!(
            "cannot create the workspace root {}",
            args.workspace_root.display()
        )
    })?;
    let channel = tonic::transport::Endpoint::from_shared(args.event_store.clone())
        .with_context(|| format!("--event-store {:?} is not a URL", args.event_store))?
        .connect_timeout(Duration::from_secs(5))
        .connect_lazy();
    let client = EventStoreClient::new(channel);

    let shutdown = CancellationToken::new();
    let mut terminate = signal(SignalKind::terminate()).context("install the SIGTERM handler")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("install the SIGINT handler")?;
    let on_signal = shutdown.clone();
    tokio::spawn(async move {
        tokio::select! {
            _ = terminate.recv() => tracing::info!("SIGTERM: stopping"),
            _ = interrupt.recv() => tracing::info!("SIGINT: stopping"),
        }
        on_signal.cancel();
    });

    tracing::info!(
        runner_id = %args.runner_id,
        event_store = %args.event_store,
        model = %args.model,
        max_sessions = args.max_sessions,
        lease_ttl_ms = args.lease_ttl_ms,
        "runner started"
    );
    let context = Arc::new(TurnContext {
        model,
        toolbox: Toolbox::new(args.workspace_root),
        tools: Toolbox::specs(),
        max_tokens: args.max_tokens,
        backoff: Backoff::default(),
    });
    claim_loop(
        client,
        ClaimConfig {
            runner_id: args.runner_id,
            lease_ttl: Duration::from_millis(args.lease_ttl_ms),
            max_sessions: args.max_sessions,
        },
        context,
        shutdown,
    )
    .await;
    tracing::info!("runner stopped");
    Ok(())
}
