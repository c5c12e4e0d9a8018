//! agentlog's telemetry, shared by `event-store` and `runner`.
//!
//! Promise: with no flag and no `OTEL_EXPORTER_OTLP_ENDPOINT`, nothing here costs more than
//! the structured log lines both binaries always wrote; metrics are plain atomics, served
//! only with `--metrics-listen`, and spans leave the process only when the endpoint is set.
//!
//! - [`logs_and_traces`]: the stderr log subscriber (`RUST_LOG`), plus OTLP span export
//!   over gRPC when the standard environment asks for it.
//! - [`exposition`]: Prometheus text at `GET /metrics`.
//! - [`propagation`]: the W3C trace context in gRPC metadata, injected by clients and
//!   taken as the parent of the server's request span, so one runner turn and the store
//!   requests it makes are one trace.
#![forbid(unsafe_code)]

pub mod exposition;
pub mod logs_and_traces;
pub mod propagation;

pub use exposition::{serve_metrics, serve_metrics_and_readiness};
pub use logs_and_traces::{exporting, init, Telemetry, TelemetryError};
