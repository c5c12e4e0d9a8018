//! The W3C trace context (`traceparent`, `tracestate`) in gRPC metadata.
//!
//! A client calls [`inject`] from its interceptor; the server wraps its routes in
//! [`TraceContextLayer`], which opens one span per request whose parent is the context the
//! caller sent (when spans are exported; otherwise a debug-level one, made only when the
//! log filter asks for debug). When spans are not exported (no OTLP endpoint) the global propagator is the
//! no-op one: nothing is written to the metadata and the request span has no remote parent.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use opentelemetry::propagation::{Extractor, Injector};
use tonic::codegen::http;
use tonic::metadata::{MetadataKey, MetadataMap, MetadataValue};
use tracing::Instrument;
use tracing_opentelemetry::OpenTelemetrySpanExt;

/// Writes the current span's trace context into an outgoing call's metadata.
pub fn inject(metadata: &mut MetadataMap) {
    let context = tracing::Span::current().context();
    opentelemetry::global::get_text_map_propagator(|propagator| {
        propagator.inject_context(&context, &mut MetadataInjector(metadata))
    });
}

struct MetadataInjector<'a>(&'a mut MetadataMap);

impl Injector for MetadataInjector<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(key), Ok(value)) = (
            MetadataKey::from_bytes(key.as_bytes()),
            MetadataValue::try_from(value),
        ) {
            self.0.insert(key, value);
        }
    }
}

struct HeaderExtractor<'a>(&'a http::HeaderMap);

impl Extractor for HeaderExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(|k| k.as_str()).collect()
    }
}

/// A tower layer for a gRPC server: every call under `/<service_prefix>` runs in a span
/// named for its method (`rpc.method`), child of the caller's trace context if it sent one.
#[derive(Debug, Clone, Copy)]
pub struct TraceContextLayer {
    service_prefix: &'static str,
}

impl TraceContextLayer {
    /// Traces calls whose path starts with `/<service_prefix>` (e.g. `agentlog.v1.`); health
    /// checks and reflection are left out.
    pub fn new(service_prefix: &'static str) -> TraceContextLayer {
        TraceContextLayer { service_prefix }
    }
}

impl<S> tower::Layer<S> for TraceContextLayer {
    type Service = TraceContext<S>;

    fn layer(&self, inner: S) -> TraceContext<S> {
        TraceContext {
            inner,
            service_prefix: self.service_prefix,
        }
    }
}

#[derive(Debug, Clone)]
pub struct TraceContext<S> {
    inner: S,
    service_prefix: &'static str,
}

impl<S, B> tower::Service<http::Request<B>> for TraceContext<S>
where
    S: tower::Service<http::Request<B>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let path = request.uri().path();
        let Some(rpc) = path
            .strip_prefix('/')
            .filter(|p| p.starts_with(self.service_prefix))
        else {
            return Box::pin(self.inner.call(request));
        };
        let method = rpc.rsplit('/').next().unwrap_or(rpc);
        let span = if crate::exporting() {
            tracing::info_span!(
                "grpc.server",
                otel.name = %rpc,
                otel.kind = "server",
                rpc.system = "grpc",
                rpc.method = %method,
            )
        } else {
            // Not exported, the span would only prefix log lines, which the default filter
            // (`info`) does not ask for; with `RUST_LOG=debug` it is made.
            tracing::debug_span!("grpc.server", rpc.method = %method)
        };
        if span.is_disabled() {
            return Box::pin(self.inner.call(request));
        }
        let parent = opentelemetry::global::get_text_map_propagator(|propagator| {
            propagator.extract(&HeaderExtractor(request.headers()))
        });
        // A failure means no OpenTelemetry layer is installed: the span stays a log span.
        let _ = span.set_parent(parent);
        let response = span.in_scope(|| self.inner.call(request));
        Box::pin(response.instrument(span))
    }
}
