//! `GET /metrics`: the registry in the Prometheus text format (OpenMetrics 1.0), on its own
//! listener so that scraping never shares a port, TLS or auth with the gRPC service.

use std::sync::Arc;

use axum::http::{header, StatusCode};
use axum::response::IntoResponse;
use axum::routing::get;
use axum::Router;
use prometheus_client::registry::Registry;
use tokio_util::sync::CancellationToken;

const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Serves `registry` at `/metrics` on `listener` until `shutdown` fires.
pub async fn serve_metrics(
    listener: tokio::net::TcpListener,
    registry: Registry,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    serve_metrics_and_readiness(listener, registry, || Ok(()), shutdown).await
}

/// [`serve_metrics`], and `GET /ready`: `200 ready` while `ready` says so, else `503` with
/// its reason (for a readiness probe).
pub async fn serve_metrics_and_readiness(
    listener: tokio::net::TcpListener,
    registry: Registry,
    ready: impl Fn() -> Result<(), String> + Clone + Send + Sync + 'static,
    shutdown: CancellationToken,
) -> std::io::Result<()> {
    let registry = Arc::new(registry);
    let app = Router::new()
        .route(
            "/metrics",
            get(move || {
                let registry = registry.clone();
                async move { render(&registry) }
            }),
        )
        .route(
            "/ready",
            get(move || {
                let answer = ready();
                async move {
                    match answer {
                        Ok(()) => (StatusCode::OK, "ready\n".to_string()),
                        Err(why) => (StatusCode::SERVICE_UNAVAILABLE, format!("{why}\n")),
                    }
                }
            }),
        );
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
}

fn render(registry: &Registry) -> axum::response::Response {
    let mut body = String::new();
    match prometheus_client::encoding::text::encode(&mut body, registry) {
        Ok(()) => ([(header::CONTENT_TYPE, CONTENT_TYPE)], body).into_response(),
        Err(e) => (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("encoding the metrics failed: {e}"),
        )
            .into_response(),
    }
}
