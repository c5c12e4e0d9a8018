//! `runner`: claims runnable agentlog sessions and works them (flags: README.md).
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use agentlog_client::StoreConnection;
use agentlog_proto::v1::Budget;
use anyhow::{Context, Result};
use clap::Parser;
use runner::context::TurnContext;
use runner::drain::{Drain, EXIT_MARGIN};
use runner::model::Models;
use runner::resilience::circuit::Circuits;
use runner::resilience::Settings;
use runner::secrets::{SecretFiles, Secrets};
use runner::sweep::Sweeper;
use runner::tools::sandbox::{self, Ids, Sandbox, SandboxMode, ToolNetwork, HELPER_ARG, SELF_EXE};
use runner::tools::{IgnoreRules, StoreUrl, ToolPolicy, Toolbox};
use runner::worker::{claim_loop, ClaimConfig};
use tokio::signal::unix::{signal, SignalKind};
use tokio_util::sync::CancellationToken;

/// What the runtime's leftover threads (a file tool stopped mid-call, the exporter) get
/// once the work is done.
const RUNTIME_SHUTDOWN: Duration = Duration::from_millis(500);
/// How long the trace exporter's last batch may take on the way out.
const TELEMETRY_SHUTDOWN: Duration = Duration::from_secs(1);

/// Works agentlog sessions: claims runnable ones from the event store, calls the model and
/// runs tools exactly once, resuming any session exactly where its log stops.
#[derive(Debug, Parser)]
#[command(version = build_info::VERSION_AND_COMMIT)]
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
    /// is read from the AGENTLOG_TOKEN environment variable, if set (then removed from the
    /// environment). Never logged. Mount it where tools cannot read it: the start-up table
    /// says whether they can.
    #[arg(long, env = "AGENTLOG_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// A file holding the Anthropic API key (instead of ANTHROPIC_API_KEY, which is read
    /// and then removed from the environment).
    #[arg(long, env = "ANTHROPIC_API_KEY_FILE")]
    anthropic_api_key_file: Option<PathBuf>,
    /// A file holding the OpenAI-compatible server's API key (instead of OPENAI_API_KEY,
    /// which is read and then removed from the environment).
    #[arg(long, env = "OPENAI_API_KEY_FILE")]
    openai_api_key_file: Option<PathBuf>,
    /// This runner's name, the owner of its leases (unique among live runners).
    #[arg(long, env = "AGENTLOG_RUNNER_ID")]
    runner_id: String,
    /// Sessions' workspaces are created under this directory: DIR/<session_id>/.
    #[arg(long, env = "AGENTLOG_WORKSPACE_ROOT")]
    workspace_root: PathBuf,
    /// anthropic:MODEL, openai:MODEL or scripted:FILE. Repeatable (the environment
    /// variable takes a comma-separated list): the first is the default, and a session runs on
    /// the one its latest session_config names.
    #[arg(long, env = "AGENTLOG_MODEL", value_delimiter = ',', required = true)]
    model: Vec<String>,
    /// Sessions worked at once.
    #[arg(long, env = "AGENTLOG_MAX_SESSIONS", default_value_t = 8)]
    max_sessions: usize,
    /// Lease time to live; leases are renewed every third of it.
    #[arg(long, env = "AGENTLOG_LEASE_TTL_MS", default_value_t = 30_000)]
    lease_ttl_ms: u64,
    /// Keep a session's fold in the store as a snapshot each time this many events have
    /// passed since the last one (sessions of fewer events have none), so that a runner that
    /// never worked the session reads only the events after it. 0: no snapshots.
    #[arg(long, env = "AGENTLOG_SNAPSHOT_EVERY", default_value_t = 1000)]
    snapshot_every: u64,
    /// The most tokens one model reply may have.
    #[arg(long, env = "AGENTLOG_MAX_TOKENS", default_value_t = 8192)]
    max_tokens: u32,
    /// The tool sandbox: `require` refuses to start where some protection (the start-up
    /// table lists them) has no mechanism on this node; `best-effort` enforces what the
    /// node can and marks every tool result; `off` runs tools without Landlock or seccomp.
    #[arg(long, env = "AGENTLOG_SANDBOX", value_enum, default_value = "require")]
    sandbox: SandboxMode,
    /// Network for tool calls: `none` (Unix sockets only) or `all` (whatever the runner
    /// reaches, including a store on loopback).
    #[arg(
        long,
        env = "AGENTLOG_TOOL_NETWORK",
        value_enum,
        default_value = "none"
    )]
    tool_network: ToolNetwork,
    /// The user tools run as, NAME or UID[:GID]; only a root runner can switch. Default:
    /// `nobody` (65534) when the runner is root, else the runner's own user.
    #[arg(long, env = "AGENTLOG_TOOL_USER")]
    tool_user: Option<String>,
    /// Another path tools may read and execute (a toolchain, say), besides /usr, /bin,
    /// /sbin, /lib*, /etc and /opt. Repeatable.
    #[arg(
        long = "tool-read-path",
        env = "AGENTLOG_TOOL_READ_PATHS",
        value_delimiter = ','
    )]
    tool_read_paths: Vec<PathBuf>,
    /// Serve Prometheus metrics at http://HOST:PORT/metrics. Traces go out over OTLP when
    /// the standard OTEL_EXPORTER_OTLP_ENDPOINT is set.
    #[arg(long, env = "AGENTLOG_METRICS_LISTEN")]
    metrics_listen: Option<String>,
    /// Tools whose every call waits for a person's `agentlog approve` (comma-separated, e.g.
    /// bash,edit_file). Default: none.
    #[arg(long, env = "AGENTLOG_APPROVE", value_delimiter = ',')]
    approve: Vec<String>,
    /// What a call interrupted with its outcome unknown does, per tool: TOOL=POLICY,…
    /// with POLICY one of rerun, rerun-same-key, report, ask (e.g. bash=report,edit_file=ask).
    /// Defaults: bash and edit_file rerun-same-key, the others rerun.
    #[arg(long, env = "AGENTLOG_ON_UNKNOWN_OUTCOME", value_delimiter = ',')]
    on_unknown_outcome: Vec<String>,
    /// On SIGTERM (or Ctrl-C) the runner drains: it claims nothing more and starts no new
    /// step, lets every tool call already started run to its end and logs its result (a
    /// model stream in flight may finish too), then gives its leases back. A call still
    /// running after this long is stopped (its process tree killed) and left to its tool's
    /// unknown-outcome policy. The runner exits within this plus 3 s; a second signal ends
    /// the drain at once. `20s`, `1500ms`, `2m`.
    #[arg(long, env = "AGENTLOG_DRAIN_TIMEOUT", default_value = "20s", value_parser = humantime::parse_duration)]
    drain_timeout: Duration,
    /// Paths the workspace checkpoints leave out (a fork does not get them back), as
    /// .gitignore-style globs; repeatable. Giving any replaces the defaults; '' keeps every
    /// path.
    #[arg(
        long,
        env = "AGENTLOG_CHECKPOINT_IGNORE",
        value_delimiter = ',',
        default_values_t = runner::tools::checkpoint::DEFAULT_IGNORE.map(String::from)
    )]
    checkpoint_ignore: Vec<String>,
    /// Where workspace checkpoints live: `file://` (the area beside the workspaces,
    /// `<workspace-root>/.checkpoints`), `file:///PATH` (an area at PATH, on the workspaces'
    /// file system), or an object store, so that runners share no volume:
    /// `s3://BUCKET/PREFIX` (endpoint, region and credentials from the `AWS_*` variables,
    /// e.g. `AWS_ENDPOINT_URL`), `gs://BUCKET/PREFIX`, `az://CONTAINER/PREFIX`.
    #[arg(long, env = "AGENTLOG_CHECKPOINT_STORE", default_value = "file://", value_parser = StoreUrl::parse)]
    checkpoint_store: StoreUrl,
    /// How often the runner sweeps for deleted sessions' workspaces and checkpoints under
    /// --workspace-root (it also sweeps at start, and after a session it holds is deleted,
    /// when it removes that workspace at once): a session deleted while no runner held it
    /// leaves the disk within this. `0` sweeps only then. `5m`, `30s`.
    #[arg(long, env = "AGENTLOG_SWEEP_EVERY", default_value = "5m", value_parser = humantime::parse_duration)]
    sweep_every: Duration,

    // When the work keeps failing.
    /// A model a failing turn falls back to (PROVIDER:MODEL), in the order given, for the
    /// sessions that name no fallbacks of their own; the runner is given it as if by
    /// --model. Repeatable (the environment variable takes a comma-separated list).
    #[arg(
        long = "fallback-model",
        env = "AGENTLOG_FALLBACK_MODEL",
        value_delimiter = ','
    )]
    fallback_models: Vec<String>,
    /// Failed calls of one model in a turn before its next call goes to the next model of
    /// the session's chain.
    #[arg(long, env = "AGENTLOG_FALLBACK_AFTER", default_value_t = 2)]
    fallback_after: u32,
    /// A model call that answers nothing for this long (no response at all, or a stream
    /// gone silent) is dropped and counts as a failure. `120s`, `2m`.
    #[arg(long, env = "AGENTLOG_MODEL_IDLE_TIMEOUT", default_value = "120s", value_parser = humantime::parse_duration)]
    model_idle_timeout: Duration,
    /// A wait for the next model call longer than this is not spent holding the session:
    /// the runner lets it go, and the store hands it to any runner once it is due. `10s`.
    #[arg(long, env = "AGENTLOG_PARK_AFTER", default_value = "10s", value_parser = humantime::parse_duration)]
    park_after: Duration,
    /// Failed calls of a model in a row, across this runner's sessions, that open its
    /// circuit: it is left alone for a cool-down (30 s, doubling up to 5 min while its
    /// probes fail), sessions with a fallback go straight to it.
    #[arg(long, env = "AGENTLOG_CIRCUIT_FAILURES", default_value_t = 5)]
    circuit_failures: u32,
    /// Once this long has passed since a turn's first failed call, the run pauses for a
    /// person (run_paused gave_up) instead of calling again. `1h`, `30m`.
    #[arg(long, env = "AGENTLOG_GIVE_UP_AFTER", default_value = "1h", value_parser = humantime::parse_duration)]
    give_up_after: Duration,
    /// The N-th identical tool call in a row (same tool, same input) waits for a person.
    #[arg(long, env = "AGENTLOG_REPEAT_LIMIT", default_value_t = 3)]
    repeat_limit: u32,
    /// A run's most model replies, where its session sets no budget (0: no limit).
    #[arg(long, env = "AGENTLOG_RUN_MAX_MODEL_CALLS", default_value_t = 200)]
    run_max_model_calls: u64,
    /// A run's most input plus output tokens of its replies (0: no limit).
    #[arg(long, env = "AGENTLOG_RUN_MAX_TOKENS", default_value_t = 0)]
    run_max_tokens: u64,
    /// A run's most wall time since its user message, in seconds (0: no limit).
    #[arg(long, env = "AGENTLOG_RUN_MAX_SECONDS", default_value_t = 0)]
    run_max_seconds: u64,
}

fn main() -> Result<()> {
    let args: Vec<std::ffi::OsString> = std::env::args_os().collect();
    // The tool sandbox's helper and stage: the same binary, single-threaded, no runtime.
    if args.get(1).is_some_and(|arg| arg == HELPER_ARG) {
        std::process::exit(sandbox::process_main(&args[2..]));
    }
    let args = Args::parse();
    // Before any other thread exists: it reads the secrets and scrubs the environment.
    let secrets = Secrets::take(&SecretFiles {
        anthropic_api_key: args.anthropic_api_key_file.clone(),
        openai_api_key: args.openai_api_key_file.clone(),
        store_token: args.token_file.clone(),
    })?;
    // A tool of this process's user could otherwise read our memory (the keys, the token)
    // through /proc/<pid>/mem or ptrace. Not dumpable, those files belong to root and
    // ptrace is refused; the sandbox's table counts it as a mechanism only if it held.
    let non_dumpable = nix::sys::prctl::set_dumpable(false).is_ok()
        && nix::sys::prctl::get_dumpable().is_ok_and(|dumpable| !dumpable);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("start the async runtime")?;
    let result = runtime.block_on(async {
        let telemetry = telemetry::init("runner")?;
        let result = run(args, secrets, non_dumpable).await;
        // The exporter's last batch goes out (blocking, so off the async threads), if it can
        // in time: the drain's exit bound holds whatever the collector does.
        let shutdown = tokio::task::spawn_blocking(move || telemetry.shutdown());
        let _ = tokio::time::timeout(TELEMETRY_SHUTDOWN, shutdown).await;
        result
    });
    // Dropping a runtime would wait for its blocking threads however long they take.
    runtime.shutdown_timeout(RUNTIME_SHUTDOWN);
    result
}

async fn run(args: Args, secrets: Secrets, non_dumpable: bool) -> Result<()> {
    if let Err(e) = &secrets.wiped {
        tracing::warn!(error = %e, "cannot wipe the secrets from the initial environment block; they were removed from the environment");
    }
    anyhow::ensure!(
        args.lease_ttl_ms >= 300,
        "--lease-ttl-ms {} is too short: renewals every third of it need at least 300 ms",
        args.lease_ttl_ms
    );
    anyhow::ensure!(args.max_sessions >= 1, "--max-sessions must be at least 1");
    // The fallbacks are models the runner was given too, after its own.
    let mut specs = args.model.clone();
    for fallback in &args.fallback_models {
        if !specs.contains(fallback) {
            specs.push(fallback.clone());
        }
    }
    let models = Models::from_specs(&specs, &secrets.api_keys)?;
    let policy = ToolPolicy::new(&args.approve, &args.on_unknown_outcome)?
        .with_repeat_limit(args.repeat_limit);
    std::fs::create_dir_all(&args.workspace_root).with_context(|| {
        format!(
            "cannot create the workspace root {}",
            args.workspace_root.display()
        )
    })?;
    let secret_files = [
        &args.token_file,
        &args.tls_client_key,
        &args.anthropic_api_key_file,
        &args.openai_api_key_file,
    ]
    .into_iter()
    .flatten()
    .cloned()
    .collect();
    let mut sandbox = Sandbox {
        mode: args.sandbox,
        network: args.tool_network,
        user: tool_user(args.tool_user.as_deref())?,
        read_paths: args.tool_read_paths.clone(),
        helper: SELF_EXE.into(),
        secret_files,
        table: None,
    };
    for dir in sandbox
        .open_path_to(&args.workspace_root)
        .context("cannot let the tool user reach the workspace root")?
    {
        tracing::warn!(dir = %dir.display(), "gave others search permission (o+x) so the tool user reaches the workspaces");
    }
    let (mode, network) = (sandbox.mode_name(), sandbox.network_name());
    let table = sandbox.start(&args.workspace_root, non_dumpable).await?;
    // Plain lines, not log events: the table is shown whatever RUST_LOG filters.
    eprint!("{}", table.render(mode, network));
    let gaps: Vec<&str> = table
        .gaps()
        .iter()
        .map(|row| row.protection.name())
        .collect();
    match (sandbox.mode, gaps.is_empty()) {
        (SandboxMode::Off, _) => tracing::warn!(
            "--sandbox off: tool calls can read and write everything the tool user can, \
             signal other processes and use the network"
        ),
        (_, false) => tracing::warn!(
            not_enforced = %gaps.join(", "),
            "--sandbox best-effort: this node does not enforce every protection of the tool \
             sandbox; every tool result says so"
        ),
        _ => {}
    }
    let client = StoreConnection {
        url: args.event_store.clone(),
        tls_ca: args.tls_ca.clone(),
        client_cert: args.tls_client_cert.clone(),
        client_key: args.tls_client_key.clone(),
        token_file: args.token_file.clone(),
        token: secrets
            .store_token
            .as_deref()
            .map(agentlog_client::BearerToken::new)
            .transpose()
            .context("the store token")?,
    }
    .client()
    .context("connecting to the event store")?;

    tracing::info!(
        runner_id = %args.runner_id,
        event_store = %args.event_store,
        models = %args.model.join(","),
        max_sessions = args.max_sessions,
        lease_ttl_ms = args.lease_ttl_ms,
        sandbox = %sandbox.mode_name(),
        tool_network = %sandbox.network_name(),
        tool_uid = ?sandbox.user.map(|ids| ids.uid),
        "runner started"
    );
    let toolbox = Toolbox::new(args.workspace_root.clone(), sandbox)
        .with_checkpoints(
            IgnoreRules::new(&args.checkpoint_ignore),
            &args.checkpoint_store,
            &secrets.object_store_env,
        )
        .map_err(anyhow::Error::msg)?;
    tracing::info!(checkpoint_store = %args.checkpoint_store, "workspace checkpoints live there");
    if let Some(remote) = toolbox.checkpoints().remote().cloned() {
        tokio::spawn(async move { remote.reach().await });
    }
    let shutdown = CancellationToken::new();
    if let Some(addr) = &args.metrics_listen {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding --metrics-listen {addr}"))?;
        let metrics_addr = listener.local_addr().context("reading the bound address")?;
        tracing::info!(%metrics_addr, "serving Prometheus metrics at /metrics");
        let providers: Vec<&'static str> = models.iter().map(|m| m.provider()).collect();
        let mut registry = runner::metrics::registry(&providers, &models.specs());
        build_info::register(&mut registry);
        let stop = shutdown.clone();
        // Not ready until the checkpoints' object store has answered, nor while it does not
        // answer: no call can end.
        let remote = toolbox.checkpoints().remote().cloned();
        let ready = move || remote.as_ref().map_or(Ok(()), |r| r.readiness());
        tokio::spawn(async move {
            if let Err(e) =
                telemetry::serve_metrics_and_readiness(listener, registry, ready, stop).await
            {
                tracing::error!(error = %e, "the metrics listener failed");
            }
        });
    }
    let mut terminate = signal(SignalKind::terminate()).context("install the SIGTERM handler")?;
    let mut interrupt = signal(SignalKind::interrupt()).context("install the SIGINT handler")?;
    let drain = Drain::new(args.drain_timeout);
    let on_signal = drain.clone();
    let drain_ms = args.drain_timeout.as_millis() as u64;
    tokio::spawn(async move {
        tokio::select! {
            _ = terminate.recv() => tracing::info!(drain_ms, "SIGTERM: draining (a second signal stops at once)"),
            _ = interrupt.recv() => tracing::info!(drain_ms, "SIGINT: draining (a second signal stops at once)"),
        }
        on_signal.begin();
        tokio::select! {
            _ = terminate.recv() => tracing::warn!("SIGTERM again: stopping what still runs"),
            _ = interrupt.recv() => tracing::warn!("SIGINT again: stopping what still runs"),
        }
        on_signal.begin();
    });

    let sweeper = Arc::new(Sweeper::new(
        args.workspace_root.clone(),
        toolbox.checkpoints().clone(),
        client.clone(),
    ));
    // At start, every --sweep-every and when kicked; not once the runner drains.
    let sweeping = sweeper.clone();
    let sweep_until = drain.clone();
    let sweep_every = args.sweep_every;
    tokio::spawn(async move {
        tokio::select! {
            _ = sweep_until.begun() => {}
            _ = sweeping.run(sweep_every) => {}
        }
    });
    let context = Arc::new(TurnContext {
        models,
        toolbox,
        tools: Toolbox::specs(),
        policy,
        max_tokens: args.max_tokens,
        settings: Settings {
            fallback_models: args.fallback_models.clone(),
            fallback_after: args.fallback_after.max(1),
            park_after: args.park_after,
            give_up_after: args.give_up_after,
            circuit_failures: args.circuit_failures.max(1),
            repeat_limit: args.repeat_limit,
            budget: Budget {
                max_model_calls: args.run_max_model_calls,
                max_tokens: args.run_max_tokens,
                max_seconds: args.run_max_seconds,
            },
            model_idle_timeout: args.model_idle_timeout,
        },
        circuits: Circuits::new(args.circuit_failures),
    });
    let work = claim_loop(
        client,
        ClaimConfig {
            runner_id: args.runner_id,
            lease_ttl: Duration::from_millis(args.lease_ttl_ms),
            max_sessions: args.max_sessions,
            snapshot_every: args.snapshot_every,
        },
        context,
        sweeper,
        drain.clone(),
    );
    // The backstop of the exit bound: whatever is still running by then is dropped (a
    // tool's helper kills its process tree when told, or when this process is gone).
    tokio::select! {
        _ = work => tracing::info!("runner stopped"),
        _ = drain.overrun() => tracing::error!(
            margin_ms = EXIT_MARGIN.as_millis() as u64,
            "the drain's budget and margin are spent; exiting with work unfinished"
        ),
    }
    shutdown.cancel();
    Ok(())
}

/// The ids `--tool-user` names; by default `nobody` when the runner is root, else none (the
/// runner's own user).
fn tool_user(spec: Option<&str>) -> Result<Option<Ids>> {
    let root = nix::unistd::geteuid().is_root();
    let Some(spec) = spec else {
        if !root {
            return Ok(None);
        }
        let nobody = nix::unistd::User::from_name("nobody").ok().flatten();
        return Ok(Some(nobody.map_or(
            Ids {
                uid: 65534,
                gid: 65534,
            },
            |user| Ids {
                uid: user.uid.as_raw(),
                gid: user.gid.as_raw(),
            },
        )));
    };
    let ids = match spec.split_once(':') {
        Some((uid, gid)) => Ids {
            uid: uid.parse().context("--tool-user UID:GID needs numbers")?,
            gid: gid.parse().context("--tool-user UID:GID needs numbers")?,
        },
        None => match spec.parse::<u32>() {
            Ok(uid) => Ids { uid, gid: uid },
            Err(_) => {
                let user = nix::unistd::User::from_name(spec)
                    .with_context(|| format!("cannot look up --tool-user {spec}"))?
                    .with_context(|| format!("--tool-user {spec}: no such user"))?;
                Ids {
                    uid: user.uid.as_raw(),
                    gid: user.gid.as_raw(),
                }
            }
        },
    };
    anyhow::ensure!(
        ids.uid != 0,
        "--tool-user must not be root: tools never run as root"
    );
    let own = nix::unistd::geteuid().as_raw();
    anyhow::ensure!(
        root || ids.uid == own,
        "--tool-user {spec}: only a runner started as root can run tools as another user"
    );
    Ok((ids.uid != own).then_some(ids))
}
