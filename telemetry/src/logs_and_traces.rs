//! Log lines to stderr, and spans to an OpenTelemetry collector when
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set.
//!
//! Without the variable no OpenTelemetry layer is installed at all: spans stay what they
//! always were, `tracing` spans for the log lines. With it, spans go out in batches over
//! OTLP/gRPC from a background thread (the SDK's batch processor; `OTEL_BSP_*` tune it) and
//! [`Telemetry::shutdown`] flushes what is left before the process exits.

use std::io::IsTerminal;
use std::sync::atomic::{AtomicBool, Ordering};

use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use opentelemetry_sdk::Resource;
use tracing_subscriber::filter::filter_fn;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::Layer;

/// The standard variables that turn OTLP trace export on.
const ENDPOINT_VARS: [&str; 2] = [
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
];

/// Log targets of the gRPC stack the exporter itself runs on.
const TRANSPORT_TARGETS: [&str; 5] = ["h2", "hyper", "tonic", "tower", "opentelemetry"];

static EXPORTING: AtomicBool = AtomicBool::new(false);

/// Whether spans leave this process: a caller that would make many spans only for the trace
/// (one per waiting append, say) skips them otherwise.
pub fn exporting() -> bool {
    EXPORTING.load(Ordering::Relaxed)
}

#[derive(Debug, thiserror::Error)]
pub enum TelemetryError {
    #[error("cannot build the OTLP span exporter (check OTEL_EXPORTER_OTLP_ENDPOINT): {0}")]
    Exporter(#[from] opentelemetry_otlp::ExporterBuildError),
    #[error("a log subscriber is already installed: {0}")]
    Subscriber(#[from] tracing_subscriber::util::TryInitError),
}

/// What [`init`] set up; keep it for the life of the process and call
/// [`Telemetry::shutdown`] on the way out.
#[must_use = "spans still in the exporter's queue are lost unless shutdown() is called"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// Flushes and stops the span exporter. Blocks until the collector answered or the
    /// export timed out: call it outside async code (or in `spawn_blocking`), with the
    /// Tokio runtime still running.
    pub fn shutdown(self) {
        if let Some(provider) = self.provider {
            if let Err(e) = provider.shutdown() {
                tracing::warn!(error = %e, "the last spans could not be exported");
            }
        }
    }
}

/// Installs the global subscriber: stderr log lines filtered by `RUST_LOG` (default
/// `info`), and, when the OTLP endpoint variable is set, an OpenTelemetry layer exporting
/// every span as `service.name = service`. Must run inside a Tokio runtime (the gRPC
/// exporter's channel lives on it).
pub fn init(service: &'static str) -> Result<Telemetry, TelemetryError> {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let exporting = ENDPOINT_VARS
        .iter()
        .any(|var| std::env::var_os(var).is_some_and(|v| !v.is_empty()));
    if !exporting {
        tracing_subscriber::registry()
            .with(filter)
            .with(fmt)
            .try_init()?;
        return Ok(Telemetry { provider: None });
    }
    // The exporter reads the endpoint, headers and timeout from the standard variables.
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .build()?;
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(Resource::builder().with_service_name(service).build())
        .build();
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    // The exporter's own transport (tonic over hyper and h2) must not feed spans back into
    // the exporter, whatever RUST_LOG enables.
    let otel = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer(service))
        .with_filter(filter_fn(|meta| {
            !TRANSPORT_TARGETS
                .iter()
                .any(|t| meta.target().starts_with(t))
        }));
    tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .with(otel)
        .try_init()?;
    EXPORTING.store(true, Ordering::Relaxed);
    Ok(Telemetry {
        provider: Some(provider),
    })
}
