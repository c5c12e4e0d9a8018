//! How the store is served: the gRPC server with its layers (trace context, auth, limits),
//! health and reflection, and graceful shutdown.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use agentlog_proto::v1::event_store_server::EventStoreServer;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::codegen::http::{HeaderName, HeaderValue};
use tonic::Status;
use tower_http::set_header::SetResponseHeaderLayer;

use super::subscribe::SubscribeOnWire;
use super::EventStoreService;
use crate::auth::{Access, AuthLayer};
use crate::backend::Backend;
use crate::incoming::ConnLimits;
use crate::limits::{CallerLimits, LimitsLayer};
use crate::tls::ReloadingTls;
use crate::wire::MAX_APPEND_BYTES;

/// How many bytes a client may send on one stream before the store reads them (HTTP/2's
/// stream window). Sized with [`CONNECTION_WINDOW`] and h2's guard against small DATA
/// frames; the arithmetic is in ARCHITECTURE.md ("Flow control, not hang-ups").
pub const STREAM_WINDOW: u32 = 128 << 10;

/// How many bytes a client may send on one connection, all its streams together, before
/// the store reads them. h2 allows half of it in the framing overhead of small DATA frames
/// left unread (each under 256 bytes counts 256 less its size, until read): at 64 MiB, 26
/// streams each holding a whole [`STREAM_WINDOW`] of unread 24-byte appends, 129 of
/// 86-byte ones, and any number of 171 bytes or more.
pub const CONNECTION_WINDOW: u32 = 64 << 20;

/// How the store is served: transport security, who may call, and how much.
pub struct ServeOptions {
    /// Close each connection (gracefully) after this long, so that clients behind a
    /// Service reconnect and spread over replacement pods.
    pub max_connection_age: Option<Duration>,
    /// `None`: plaintext (only ever chosen on loopback or with `--insecure-plaintext`).
    pub tls: Option<Arc<ReloadingTls>>,
    pub access: Access,
    /// Serve gRPC reflection (v1 and v1alpha).
    pub reflection: bool,
    pub caller_limits: CallerLimits,
    pub conn_limits: ConnLimits,
}

impl ServeOptions {
    /// Plaintext, open, reflection on, no per-caller limits: the store as tests embed it.
    pub fn open() -> ServeOptions {
        ServeOptions {
            max_connection_age: None,
            tls: None,
            access: Access::Open,
            reflection: true,
            caller_limits: CallerLimits {
                requests_per_sec: 0,
                burst: 1,
                max_subscriptions: 0,
            },
            conn_limits: ConnLimits {
                max_connections: usize::MAX,
                max_per_peer: usize::MAX,
            },
        }
    }
}

/// Serves the store, health and (optionally) reflection on `listener` until `shutdown`
/// fires; then stops accepting, ends streams (Subscribe and AppendStream with
/// `UNAVAILABLE`, so that clients go elsewhere) and long-polls, and answers every request
/// already received; a connection still open after [`crate::incoming::SHUTDOWN_GRACE`] is
/// cut. Every call but health passes the auth layer, then the limits layer.
pub async fn serve(
    store: Arc<dyn Backend>,
    listener: tokio::net::TcpListener,
    options: ServeOptions,
    shutdown: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let (health_reporter, health) = tonic_health::server::health_reporter();
    let serving = store.serving();
    let up = *serving.borrow();
    set_health(&health_reporter, up).await;
    tokio::spawn(report_health(health_reporter, serving, shutdown.clone()));
    let (reflection_v1, reflection_v1alpha) = if options.reflection {
        (
            Some(
                tonic_reflection::server::Builder::configure()
                    .register_encoded_file_descriptor_set(agentlog_proto::FILE_DESCRIPTOR_SET)
                    .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
                    .build_v1()
                    .expect("the compiled descriptor set is valid"),
            ),
            Some(
                tonic_reflection::server::Builder::configure()
                    .register_encoded_file_descriptor_set(agentlog_proto::FILE_DESCRIPTOR_SET)
                    .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
                    .build_v1alpha()
                    .expect("the compiled descriptor set is valid"),
            ),
        )
    } else {
        (None, None)
    };
    let server = EventStoreService::new(store.clone(), shutdown.clone()).into_server();
    let service = OversizedAsResourceExhausted(SubscribeOnWire::new(
        server,
        EventStoreService::new(store, shutdown.clone()),
    ));
    let incoming =
        crate::incoming::accept(listener, options.tls, options.conn_limits, shutdown.clone());
    let mut server = tonic::transport::Server::builder();
    if let Some(age) = options.max_connection_age {
        server = server.max_connection_age(age);
    }
    server
        .initial_stream_window_size(STREAM_WINDOW)
        .initial_connection_window_size(CONNECTION_WINDOW)
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
        // Outermost, so that a refusal of any layer below carries it too.
        .layer(release_header())
        .layer(telemetry::propagation::TraceContextLayer::new(
            "agentlog.v1.",
        ))
        .layer(AuthLayer::new(options.access))
        .layer(LimitsLayer::new(options.caller_limits))
        .add_service(health)
        .add_optional_service(reflection_v1)
        .add_optional_service(reflection_v1alpha)
        .add_service(service)
        .serve_with_incoming_shutdown(incoming, shutdown.cancelled_owned())
        .await
}

/// Every response names the store's release ([`agentlog_proto::release::HEADER`]), so that
/// a writer sends what is new in its own release only to a store that has it.
fn release_header() -> SetResponseHeaderLayer<HeaderValue> {
    SetResponseHeaderLayer::overriding(
        HeaderName::from_static(agentlog_proto::release::HEADER),
        HeaderValue::from_static(agentlog_proto::release::VERSION),
    )
}

/// Serves only `grpc.health.v1.Health`, in plaintext, for Kubernetes' native gRPC probes
/// (which cannot speak TLS). It reveals nothing but "SERVING".
pub async fn serve_health(
    listener: tokio::net::TcpListener,
    serving: watch::Receiver<bool>,
    shutdown: CancellationToken,
) -> Result<(), tonic::transport::Error> {
    let (health_reporter, health) = tonic_health::server::health_reporter();
    let up = *serving.borrow();
    set_health(&health_reporter, up).await;
    tokio::spawn(report_health(health_reporter, serving, shutdown.clone()));
    tonic::transport::Server::builder()
        .add_service(health)
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener),
            shutdown.cancelled_owned(),
        )
        .await
}

/// Keeps `agentlog.v1.EventStore`'s health in step with whether the backend can acknowledge
/// appends: NOT_SERVING while its storage is out of reach, SERVING again once it is back
/// (readiness). The overall status (`""`) stays SERVING while the process runs (liveness:
/// restarting the store does not bring a database back).
async fn report_health(
    reporter: tonic_health::server::HealthReporter,
    mut serving: watch::Receiver<bool>,
    shutdown: CancellationToken,
) {
    loop {
        tokio::select! {
            changed = serving.changed() => if changed.is_err() { return },
            _ = shutdown.cancelled() => return,
        }
        let up = *serving.borrow_and_update();
        set_health(&reporter, up).await;
    }
}

async fn set_health(reporter: &tonic_health::server::HealthReporter, up: bool) {
    let status = if up {
        tonic_health::ServingStatus::Serving
    } else {
        tonic_health::ServingStatus::NotServing
    };
    reporter
        .set_service_status(
            <EventStoreServer<EventStoreService> as tonic::server::NamedService>::NAME,
            status,
        )
        .await;
}

/// The address the listener is bound to (for logs: `--listen 127.0.0.1:0` picks a port).
pub fn local_addr(listener: &tokio::net::TcpListener) -> Option<SocketAddr> {
    listener.local_addr().ok()
}

/// The protocol promises RESOURCE_EXHAUSTED for a request over 4 MiB. Requests up to
/// [`crate::wire::MAX_DECODED_FRAME_BYTES`] reach `validate_append`, which says so; a bigger frame is
/// refused by tonic's decoder before any handler runs, as OUT_OF_RANGE. This wrapper turns
/// that one status into the RESOURCE_EXHAUSTED the contract promises (found by the
/// integration test `store_bad_input::size_limits_are_resource_exhausted_and_change_nothing`).
#[derive(Clone)]
pub struct OversizedAsResourceExhausted<S>(pub S);

impl<S: tonic::server::NamedService> tonic::server::NamedService
    for OversizedAsResourceExhausted<S>
{
    const NAME: &'static str = S::NAME;
}

impl<S, B, R> tonic::codegen::Service<tonic::codegen::http::Request<B>>
    for OversizedAsResourceExhausted<S>
where
    S: tonic::codegen::Service<
        tonic::codegen::http::Request<B>,
        Response = tonic::codegen::http::Response<R>,
    >,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn std::future::Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(
        &mut self,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Result<(), S::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: tonic::codegen::http::Request<B>) -> Self::Future {
        let response = self.0.call(request);
        Box::pin(async move {
            let mut response = response.await?;
            // The decoder's refusal is a trailers-only response: the status is in the headers.
            let headers = response.headers_mut();
            if let Some(status) = Status::from_header_map(headers) {
                if status.code() == tonic::Code::OutOfRange
                    && status
                        .message()
                        .contains("decoded message length too large")
                {
                    headers.remove("grpc-status");
                    headers.remove("grpc-message");
                    headers.remove("grpc-status-details-bin");
                    let ours = Status::resource_exhausted(format!(
                        "the request is over the limit of {MAX_APPEND_BYTES} bytes (4 MiB); \
                         split it into several appends ({})",
                        status.message()
                    ));
                    let _ = ours.add_header(headers);
                }
            }
            Ok(response)
        })
    }
}
