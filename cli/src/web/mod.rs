//! `agentlog web`: a live view of sessions in the browser, and the same events for programs
//! as Server-Sent Events and JSON — an HTTP server that is a gRPC client of the store.
//!
//! Safe by default: it listens on loopback unless `--listen` says otherwise, and off
//! loopback it refuses to start without HTTPS (`--tls-cert`, `--tls-key`) and a login token
//! (`--login-token-file`), unless `--as-loopback` says that only the host's loopback can
//! reach it (a container's published port); `guard` holds the rules every request passes. The store's own
//! token stays in this process: the browser only ever talks to this server.

mod api;
mod compare;
mod events;
mod guard;
mod pages;
mod search;
mod tls;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use axum::routing::{get, post};
use axum::Router;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::store;
use guard::Guard;

/// How long a shutdown waits for responses in flight.
const SHUTDOWN_GRACE: Duration = Duration::from_secs(5);

/// `agentlog web`'s settings.
#[derive(Debug)]
pub struct WebConfig {
    pub listen: String,
    pub tls_cert: Option<PathBuf>,
    pub tls_key: Option<PathBuf>,
    pub login_token_file: Option<PathBuf>,
    /// Treat --listen as loopback (`--as-loopback`).
    pub as_loopback: bool,
    /// The store's `--addr`.
    pub store_addr: String,
}

/// What every handler shares.
#[derive(Clone)]
pub struct App {
    store: store::Client,
    store_addr: Arc<str>,
    /// Becomes true at shutdown: open event streams end.
    shutdown: watch::Receiver<bool>,
}

/// Serves until SIGTERM or Ctrl-C.
pub async fn serve(config: WebConfig) -> Result<()> {
    let tcp = TcpListener::bind(&config.listen)
        .await
        .with_context(|| format!("--listen {}: cannot listen there", config.listen))?;
    let local = tcp.local_addr()?;
    let loopback = local.ip().is_loopback() || config.as_loopback;
    if config.as_loopback && !local.ip().is_loopback() {
        eprintln!(
            "agentlog web: --as-loopback: {local} is served as on loopback (no HTTPS or login needed; only requests naming localhost, 127.0.0.1 or [::1] are answered): publish it on the host's loopback only"
        );
    }
    let tls_config = match (&config.tls_cert, &config.tls_key) {
        (Some(cert), Some(key)) => Some(tls::server_config(cert, key)?),
        (None, None) => None,
        _ => bail!("--tls-cert and --tls-key go together"),
    };
    if !loopback && (tls_config.is_none() || config.login_token_file.is_none()) {
        bail!(
            "--listen {local} is reachable from other machines, so it needs HTTPS (--tls-cert and --tls-key) and a login token (--login-token-file); or listen on 127.0.0.1 (or, in a container whose port the host publishes on its loopback only, add --as-loopback)"
        );
    }
    let login = match &config.login_token_file {
        Some(path) => Some(Guard::read_login_token(path)?),
        None => None,
    };
    let guard = Arc::new(Guard::new(login, loopback, tls_config.is_some()));
    let (stop, shutdown) = watch::channel(false);
    let app = App {
        store: store::client(store::endpoint(&config.store_addr)?.connect_lazy()),
        store_addr: config.store_addr.as_str().into(),
        shutdown,
    };
    let router = routes(app, guard.clone());
    let scheme = if tls_config.is_some() {
        "https"
    } else {
        "http"
    };
    // The listen_addr= form is what scripts and tests look for.
    eprintln!(
        "agentlog web: listening listen_addr={local} url={scheme}://{local}/ store={} login={}",
        store::normalize(&config.store_addr),
        if guard.needs_login() {
            "required"
        } else {
            "off"
        }
    );
    let stopping = async move {
        wait_for_stop_signal().await;
        let _ = stop.send(true);
    };
    match tls_config {
        Some(tls_config) => {
            let listener = tls::TlsListener::new(tcp, tls_config)?;
            run(axum::serve(listener, router).with_graceful_shutdown(stopping)).await
        }
        None => run(axum::serve(tcp, router).with_graceful_shutdown(stopping)).await,
    }
}

/// Runs the server; once it stops accepting, gives responses in flight a grace period.
async fn run(server: impl std::future::IntoFuture<Output = std::io::Result<()>>) -> Result<()> {
    let server = server.into_future();
    tokio::pin!(server);
    tokio::select! {
        result = &mut server => Ok(result?),
        _ = async { wait_for_stop_signal().await; tokio::time::sleep(SHUTDOWN_GRACE).await } => {
            eprintln!("agentlog web: responses still open after {SHUTDOWN_GRACE:?}; stopping anyway");
            Ok(())
        }
    }
}

fn routes(app: App, guard: Arc<Guard>) -> Router {
    Router::new()
        .route("/", get(pages::list))
        .route("/sessions/{id}", get(pages::session))
        .route("/compare", get(pages::compare))
        .route("/v1/compare", get(compare::compare))
        .route("/login", get(pages::login).post(pages::post_login))
        .route("/logout", post(pages::post_logout))
        .route("/assets/{file}", get(pages::asset))
        .route("/v1/sessions", get(api::list_sessions))
        .route(
            "/v1/sessions/{id}",
            get(api::get_session).delete(api::delete_session),
        )
        .route("/v1/sessions/{id}/events", get(events::events))
        .route("/v1/sessions/{id}/messages", post(api::post_message))
        .route("/v1/sessions/{id}/cancel", post(api::post_cancel))
        .route("/v1/sessions/{id}/approve", post(api::post_approve))
        .route("/v1/sessions/{id}/deny", post(api::post_deny))
        .route("/v1/sessions/{id}/fork", post(api::post_fork))
        .route("/v1/sessions/{id}/settled", get(api::settled))
        .route("/v1/search", get(search::search))
        .with_state(app)
        .layer(axum::Extension(guard.clone()))
        .layer(axum::middleware::from_fn_with_state(guard, guard::protect))
}

/// SIGTERM (Kubernetes, systemd) or Ctrl-C.
async fn wait_for_stop_signal() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(term) => term,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
}
