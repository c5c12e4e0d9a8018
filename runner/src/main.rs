//! `runner`: claims runnable agentlog sessions and works them (flags: README.md).
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Parser;
use runner::lease::{claim_loop, ClaimConfig};
use runner::model::{Backoff, Model};
use runner::store_client::StoreConnection;
use runner::tools::{ToolPolicy, Toolbox};
use runner::turn::TurnContext;
use tokio::signal::unix::{signal, SignalKind};
use tokio_util::sync::CancellationToken;
use tracing_subscriber::EnvFilter;

/// Works agentlog sessions: claims runnable ones from the event store, calls the model and
/// runs tools exactly once, resuming any session exactly where its log stops.
#[derive(Debug, Parser)]
#[command(version)]
struct Args {
    /// The event store's gRPC URL: http://127.0.0.1:50051, or https://HOST:PORT for TLS.
    #[arg(long, env = "AGENTLOG_EVENT_STORE")]
    event_store: String,
    /// PEM CA certificate that signed the store's TLS certificate (https:// only; default:
    /// the public web roots).
    #[arg(long, env = "AGENTLOG_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// PEM client certificate this runner presents to a store that requires mTLS.
    #[arg(long, env = "AGENTLOG_TLS_CLIENT_CERT", requires = "tls_client_key")]
    tls_client_cert: Option<PathBuf>,
    /// The PEM private key of --tls-client-cert.
    #[arg(long, env = "AGENTLOG_TLS_CLIENT_KEY", requires = "tls_client_cert")]
    tls_client_key: Option<PathBuf>,
    /// A file holding this runner's store token (a runner-role token). Without it the token
    /// is read from the AGENTLOG_TOKEN environment variable, if set. Never logged.
    #[arg(long, env = "AGENTLOG_TOKEN_FILE")]
    token_file: Option<PathBuf>,
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
    /// Tools whose every call waits for a person's `agentlog approve` (comma-separated, e.g.
    /// bash,edit_file). Default: none.
    #[arg(long, env = "AGENTLOG_APPROVE", value_delimiter = ',')]
    approve: Vec<String>,
    /// What a call interrupted with its outcome unknown does, per tool: TOOL=POLICY,…
    /// with POLICY one of rerun, rerun-same-key, report, ask (e.g. bash=report,edit_file=ask).
    /// Defaults: bash and edit_file rerun-same-key, the others rerun.
    #[arg(long, env = "AGENTLOG_ON_UNKNOWN_OUTCOME", value_delimiter = ',')]
    on_unknown_outcome: Vec<String>,
}

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")),
        )
        .init();
    // A tool runs as this process's user: without this it could read our environment (the
    // model API key, the store token) from /proc/<pid>/environ or our memory. Not dumpable,
    // those files belong to root and ptrace is refused.
    if let Err(e) = nix::sys::prctl::set_dumpable(false) {
        tracing::warn!(error = %e, "cannot mark the runner non-dumpable; tools may read its environment");
    }
    let args = Args::parse();
    anyhow::ensure!(
        args.lease_ttl_ms >= 300,
        "--lease-ttl-ms {} is too short: renewals every third of it need at least 300 ms",
        args.lease_ttl_ms
    );
    anyhow::ensure!(args.max_sessions >= 1, "--max-sessions must be at least 1");
    let model = Model::from_spec(&args.model)?;
    let policy = ToolPolicy::new(&args.approve, &args.on_unknown_outcome)?;
    std::fs::create_dir_all(&args.workspace_root).with_context(|| {
        format!(
            "cannot create the workspace root {}",
            args.workspace_root.display()
        )
    })?;
    let client = StoreConnection {
        url: args.event_store.clone(),
        tls_ca: args.tls_ca.clone(),
        client_cert: args.tls_client_cert.clone(),
        client_key: args.tls_client_key.clone(),
        token_file: args.token_file.clone(),
    }
    .client()
    .context("connecting to the event store")?;

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
        policy,
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
