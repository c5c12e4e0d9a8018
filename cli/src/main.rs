//! `agentlog`: run the local stack, talk to sessions, and watch them — durably.
#![forbid(unsafe_code)]

mod commands;
mod compare;
mod control;
mod demo;
mod follow;
mod fork;
mod lifecycle;
mod render;
mod replay;
mod search;
mod stack;
mod store;
mod transfer;
mod web;

use std::path::PathBuf;
use std::process::ExitCode;

use agentlog_proto::v1::SessionStatus;
use clap::{Parser, Subcommand, ValueEnum};

use commands::Output;

/// Durable AI-agent sessions: every step is in an fsync'd event log, so a crash resumes
/// exactly where it stopped.
#[derive(Debug, Parser)]
#[command(name = "agentlog", version = build_info::VERSION_AND_COMMIT)]
struct Cli {
    /// The event store to talk to.
    #[arg(long, global = true, env = "AGENTLOG_ADDR", default_value = store::DEFAULT_ADDR)]
    addr: String,
    /// Print JSON (one object per line, proto3 JSON mapping as grpcurl prints) for scripts.
    #[arg(long, global = true)]
    json: bool,
    /// PEM CA that signed the store's certificate, for an https:// --addr (default: the
    /// public web roots).
    #[arg(long, global = true, env = "AGENTLOG_TLS_CA")]
    tls_ca: Option<PathBuf>,
    /// File holding this caller's bearer token for a store that checks tokens (or put the
    /// token itself in AGENTLOG_TOKEN).
    #[arg(long, global = true, env = "AGENTLOG_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start the local stack: an event store and one runner, until Ctrl-C.
    Up {
        /// Where the store's log and the sessions' workspaces live.
        #[arg(long, env = "AGENTLOG_DATA_DIR", default_value = ".agentlog")]
        data_dir: PathBuf,
        /// Keep the sessions in this PostgreSQL database (`postgres://…`) instead of the
        /// local log under --data-dir (which then holds only the workspaces).
        #[arg(long, env = "AGENTLOG_DATABASE_URL", hide_env_values = true)]
        database_url: Option<String>,
        /// HOST:PORT for the store (default: the host and port of --addr).
        #[arg(long)]
        listen: Option<String>,
        /// PROVIDER:MODEL for the runner (default: from ANTHROPIC_API_KEY, OPENAI_BASE_URL,
        /// or the built-in demo model).
        #[arg(long)]
        model: Option<String>,
        /// The runner's name (the owner of its leases).
        #[arg(long, default_value = "local-runner")]
        runner_id: String,
        /// The runner's lease time to live.
        #[arg(long)]
        lease_ttl_ms: Option<u64>,
    },
    /// Append a user message (to a new session unless --session) and stream the reply.
    Send {
        #[arg(long)]
        session: Option<String>,
        /// Run the session on this model (PROVIDER:MODEL, one the runners were given) from
        /// this message on.
        #[arg(long)]
        model: Option<String>,
        /// When its model keeps failing, a turn falls back to this model (PROVIDER:MODEL),
        /// in the order given. Repeatable.
        #[arg(long = "fallback-model")]
        fallback_models: Vec<String>,
        /// Each run's limits: calls=N (model replies), tokens=N (in and out), seconds=N
        /// (since its user message), comma-separated; a limit left out is the runner's.
        #[arg(long, value_parser = commands::parse_budget)]
        budget: Option<agentlog_proto::v1::Budget>,
        text: String,
    },
    /// Follow a session live; reconnects by itself, never shows an event twice.
    Tail {
        session: String,
        /// The first seq to show.
        #[arg(long, default_value_t = 1)]
        from: u64,
    },
    /// List sessions, most recently updated first.
    Ls {
        /// Case-insensitive substring of the session id or its first message.
        #[arg(long)]
        query: Option<String>,
        #[arg(long)]
        status: Option<StatusArg>,
        /// At most this many sessions.
        #[arg(long, default_value_t = 100)]
        limit: usize,
    },
    /// A session's transcript.
    Show { session: String },
    /// Branch a session at a settled point: a new session holding its log up to there (and,
    /// once a runner works it, its workspace as it was then). Prints the new id.
    Fork {
        session: String,
        /// The last seq the fork takes (default: the last settled point).
        #[arg(long)]
        at: Option<u64>,
        /// The fork's next message; at a user message, it takes that message's place.
        text: Option<String>,
    },
    /// Send to the most recently updated session.
    Continue { text: String },
    /// Send to a session that already exists.
    Resume { session: String, text: String },
    /// Watch sessions live in a browser, and serve their events to programs as
    /// Server-Sent Events (GET /v1/sessions/{id}/events) and JSON.
    Web {
        /// HOST:PORT to serve on. Off loopback, --tls-cert, --tls-key and
        /// --login-token-file are required.
        #[arg(long, env = "AGENTLOG_WEB_LISTEN", default_value = "127.0.0.1:8080")]
        listen: String,
        /// PEM certificate chain of this web server: serve HTTPS (the store's CA is --tls-ca).
        #[arg(long, requires = "tls_key")]
        tls_cert: Option<PathBuf>,
        /// PEM private key of --tls-cert.
        #[arg(long, requires = "tls_cert")]
        tls_key: Option<PathBuf>,
        /// File holding the token people sign in with (at least 16 characters); without
        /// it, a loopback server needs no login.
        #[arg(long, env = "AGENTLOG_WEB_LOGIN_TOKEN_FILE")]
        login_token_file: Option<PathBuf>,
        /// Serve as on loopback although --listen is not: plaintext and no login allowed,
        /// and only requests naming localhost, 127.0.0.1 or [::1] answered. For a container
        /// whose port the host publishes on its own loopback only (deploy/compose.yaml);
        /// whoever reaches --listen directly can still send such a name.
        #[arg(long, env = "AGENTLOG_WEB_AS_LOOPBACK")]
        as_loopback: bool,
    },
    /// Ask a session to stop what it is doing now (its runner answers with `interrupted`).
    Cancel {
        session: String,
        /// Why, for the log and the model's next turn.
        #[arg(long, default_value = "")]
        reason: String,
    },
    /// Let a call that waits for a person run (without an id: the one waiting call).
    Approve {
        session: String,
        tool_use_id: Option<String>,
    },
    /// Refuse a call that waits for a person; the model is told, with the note.
    Deny {
        session: String,
        tool_use_id: Option<String>,
        /// Why, passed to the model in the call's error result.
        #[arg(long, default_value = "")]
        note: String,
    },
    /// Delete sessions for good: their events, title, snapshots and workspace go, and the
    /// store reclaims their space. `--idle-for 30d` picks the sessions whose last event is
    /// older than that and that no runner holds, and lists them; `--yes` deletes them.
    Rm {
        sessions: Vec<String>,
        /// Sessions idle for longer than this (`30d`, `12h`, `90m`) instead of named ones.
        #[arg(long, value_parser = humantime::parse_duration, conflicts_with = "sessions")]
        idle_for: Option<std::time::Duration>,
        /// With --idle-for: delete what it lists (without it, nothing is deleted).
        #[arg(long, requires = "idle_for")]
        yes: bool,
    },
    /// Replay a recorded session against another model: a fork whose calls get the
    /// recording's results while the model asks for what was recorded, and run for real once
    /// it asks for something else. Prints the replay's id.
    Replay {
        /// The recorded session (or --all).
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        session: Option<String>,
        /// PROVIDER:MODEL to replay with (one the runners were given).
        #[arg(long)]
        model: String,
        /// Where the replay starts: the last seq it takes (default: the first user message).
        #[arg(long, conflicts_with = "all")]
        at: Option<u64>,
        /// What the first call off the recorded path does: `run` (it and every later call
        /// run for real, in the replay's own workspace) or `stop` (not run; the replay ends).
        #[arg(long, value_enum, default_value = "run")]
        off_path: replay::OffPathArg,
        /// Replay every session that matches --query and --status (replays left out).
        #[arg(long)]
        all: bool,
        /// With --all: a case-insensitive substring of the session id or its first message.
        #[arg(long, requires = "all")]
        query: Option<String>,
        /// With --all: only sessions of this status.
        #[arg(long, requires = "all")]
        status: Option<StatusArg>,
    },
    /// Two sessions side by side from their fork point (a replay and its recording): per
    /// turn the models, the calls (served, ran, only on one side), where they diverged,
    /// tokens and time, the final answers.
    Compare {
        #[arg(required_unless_present = "batch", conflicts_with = "batch")]
        a: Option<String>,
        #[arg(requires = "a")]
        b: Option<String>,
        /// A file of replay ids, one a line (`-`: standard input), each compared with its
        /// recording: one row per pair, and the totals.
        #[arg(long)]
        batch: Option<String>,
    },
    /// Find words inside sessions: user and assistant text, tool inputs and outputs. Every
    /// word must be in one event; `prefix*`, "a phrase"; newest first, one hit a line.
    Search {
        query: String,
        /// At most this many hits.
        #[arg(long, default_value_t = 20)]
        limit: usize,
    },
    /// SIGKILL a runner mid-tool and watch a new one finish, each side effect applied once.
    Demo {
        /// Keep the demo's data in this (new) directory instead of a temp dir.
        #[arg(long)]
        keep: Option<PathBuf>,
    },
    // Sessions that move.
    /// Write sessions in the export format (one JSON object a line): the named ones, or
    /// with --all every session and deleted id the token's scope covers.
    Export {
        sessions: Vec<String>,
        #[arg(long, conflicts_with = "sessions")]
        all: bool,
        /// Write here (made whole only at the end) instead of to standard output.
        #[arg(short = 'o', long = "output")]
        output: Option<PathBuf>,
    },
    /// Recreate the sessions of an export (FILE, or - for standard input) exactly: prints
    /// per session imported, unchanged, deleted, or refused and why; fails if any was
    /// refused. Needs an admin token.
    Import { file: PathBuf },
    /// Keep a session from retention (--retain-idle, rm --idle-for).
    Pin { session: String },
    /// Let retention take a pinned session again.
    Unpin { session: String },
}

#[derive(Debug, Clone, Copy, ValueEnum)]
enum StatusArg {
    Runnable,
    Idle,
    Waiting,
}

impl StatusArg {
    fn status(self) -> SessionStatus {
        match self {
            StatusArg::Runnable => SessionStatus::Runnable,
            StatusArg::Idle => SessionStatus::Idle,
            StatusArg::Waiting => SessionStatus::Waiting,
        }
    }
}

#[tokio::main]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(e) = store::configure(&cli.addr, cli.tls_ca.clone(), cli.token_file.clone()) {
        eprintln!("agentlog: {e:#}");
        return ExitCode::FAILURE;
    }
    let out = Output {
        addr: cli.addr.clone(),
        json: cli.json,
    };
    let result = match cli.command {
        Command::Up {
            data_dir,
            database_url,
            listen,
            model,
            runner_id,
            lease_ttl_ms,
        } => {
            let listen = listen.unwrap_or_else(|| {
                let url = store::normalize(&cli.addr);
                url.split("://")
                    .nth(1)
                    .unwrap_or(&url)
                    .trim_end_matches('/')
                    .to_string()
            });
            stack::up(stack::UpConfig {
                data_dir,
                database_url,
                listen,
                model,
                runner_id,
                lease_ttl_ms,
            })
            .await
        }
        Command::Send {
            session,
            model,
            fallback_models,
            budget,
            text,
        } => {
            let config = commands::Config {
                model,
                fallback_models,
                budget,
            };
            commands::send_on(&out, session, config, &text).await
        }
        Command::Tail { session, from } => commands::tail(&out, &session, from).await,
        Command::Ls {
            query,
            status,
            limit,
        } => commands::ls(&out, query, status.map(StatusArg::status), limit).await,
        Command::Show { session } => commands::show(&out, &session).await,
        Command::Fork { session, at, text } => {
            commands::fork(&out, &session, at, text.as_deref()).await
        }
        Command::Continue { text } => commands::continue_latest(&out, &text).await,
        Command::Resume { session, text } => commands::resume(&out, session, &text).await,
        Command::Cancel { session, reason } => control::cancel(&out, &session, &reason).await,
        Command::Approve {
            session,
            tool_use_id,
        } => control::decide(&out, &session, tool_use_id, true, "").await,
        Command::Deny {
            session,
            tool_use_id,
            note,
        } => control::decide(&out, &session, tool_use_id, false, &note).await,
        Command::Rm {
            idle_for: Some(idle_for),
            yes,
            ..
        } => lifecycle::rm_idle(&out, idle_for, yes).await,
        Command::Rm { sessions, .. } => lifecycle::rm(&out, &sessions).await,
        Command::Search { query, limit } => search::search(&out, &query, limit).await,
        Command::Demo { keep } => demo::demo(keep).await,
        Command::Replay {
            session: Some(session),
            model,
            at,
            off_path,
            ..
        } => replay::replay(&out, &session, &model, at, off_path).await,
        Command::Replay {
            model,
            off_path,
            query,
            status,
            ..
        } => {
            let status = status.map(StatusArg::status);
            replay::replay_all(&out, query.as_deref(), status, &model, off_path).await
        }
        Command::Compare {
            batch: Some(batch), ..
        } => compare::run_batch(&out, &batch).await,
        Command::Compare { a, b, .. } => match (a, b) {
            (Some(a), Some(b)) => compare::run(&out, &a, &b).await,
            _ => Err(anyhow::anyhow!(
                "compare needs two sessions (A B), or --batch FILE"
            )),
        },
        Command::Export {
            sessions,
            all,
            output,
        } => transfer::export(&out, sessions, all, output).await,
        Command::Import { file } => transfer::import(&out, &file).await,
        Command::Pin { session } => transfer::pin(&out, &session, true).await,
        Command::Unpin { session } => transfer::pin(&out, &session, false).await,
        Command::Web {
            listen,
            tls_cert,
            tls_key,
            login_token_file,
            as_loopback,
        } => {
            web::serve(web::WebConfig {
                listen,
                tls_cert,
                tls_key,
                login_token_file,
                as_loopback,
                store_addr: cli.addr.clone(),
            })
            .await
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("agentlog: {e:#}");
            ExitCode::FAILURE
        }
    }
}
