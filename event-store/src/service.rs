//! The gRPC edge: `agentlog.v1.EventStore`, health and reflection. Every request is
//! validated here, before it reaches the writer, so a malformed request changes nothing and
//! gets a status that names the field to fix.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use agentlog_proto::v1::event_store_server::{EventStore, EventStoreServer};
use agentlog_proto::v1::{
    append_stream_response, AcquireLeaseRequest, AppendError, AppendRequest, AppendResponse,
    AppendStreamResponse, ClaimSessionRequest, ClaimSessionResponse, DeleteSessionRequest,
    DeleteSessionResponse, Durability, Event, ForkSessionRequest, ForkSessionResponse,
    GetSessionRequest, GetSnapshotRequest, Lease, ListSessionsRequest, ListSessionsResponse,
    PutSnapshotResponse, ReleaseLeaseRequest, ReleaseLeaseResponse, RenewLeaseRequest, SessionInfo,
    SnapshotChunk, SubscribeRequest,
};
use prost::Message;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};
use tracing::Instrument;

use crate::auth::{authorize_append, authorize_snapshot_put, Access, AuthLayer, Caller};
use crate::backend::{
    AppendAnswer, Backend, EventRun, Snapshot, SnapshotPieces, MAX_SNAPSHOT_BYTES,
};
use crate::error::StoreError;
use crate::incoming::ConnLimits;
use crate::limits::{CallerLimits, LimitsLayer, MessageBudget};
use crate::metrics::{AppendCall, AppendObserver};
use crate::subscribe_wire::SubscribeOnWire;
use crate::tls::ReloadingTls;
use crate::wire::{
    MAX_APPEND_BYTES, MAX_DECODED_FRAME_BYTES, MAX_EVENTS_PER_APPEND, MAX_EVENT_BYTES,
    MAX_EVENT_ID_LEN, MAX_ID_LEN, MAX_TTL_MS, MAX_WAIT_MS,
};
use crate::AppendOp;

const MAX_FORMAT_LEN: usize = 64;
/// GetSnapshot sends the data in chunks of this size.
const SNAPSHOT_CHUNK_BYTES: usize = 1 << 20;

pub struct EventStoreService {
    store: Arc<dyn Backend>,
    shutdown: CancellationToken,
}

impl EventStoreService {
    pub fn new(store: Arc<dyn Backend>, shutdown: CancellationToken) -> EventStoreService {
        EventStoreService { store, shutdown }
    }

    pub fn into_server(self) -> EventStoreServer<EventStoreService> {
        EventStoreServer::new(self)
            .max_decoding_message_size(MAX_DECODED_FRAME_BYTES)
            .max_encoding_message_size(MAX_DECODED_FRAME_BYTES)
    }

    /// Fires when the store begins to shut down: a stream that ends from then on ends with
    /// `UNAVAILABLE`, so that its client subscribes again (elsewhere).
    pub(crate) fn stopping(&self) -> &CancellationToken {
        &self.shutdown
    }

    /// Subscribe: the backend's runs of events.
    pub(crate) fn subscribe_runs(
        &self,
        req: SubscribeRequest,
    ) -> Result<mpsc::Receiver<Result<EventRun, StoreError>>, Status> {
        validate_session_id(&req.session_id)?;
        Ok(self.store.subscribe(
            req.session_id,
            req.from_seq,
            req.follow,
            self.shutdown.child_token(),
        ))
    }
}

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
        .http2_keepalive_interval(Some(Duration::from_secs(30)))
        .http2_keepalive_timeout(Some(Duration::from_secs(10)))
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
/// [`MAX_DECODED_FRAME_BYTES`] reach `validate_append`, which says so; a bigger frame is
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

type EventStream = Pin<Box<dyn Stream<Item = Result<Event, Status>> + Send>>;
type SnapshotStream = Pin<Box<dyn Stream<Item = Result<SnapshotChunk, Status>> + Send>>;
type AppendResponses = Pin<Box<dyn Stream<Item = Result<AppendStreamResponse, Status>> + Send>>;
/// Requests of one AppendStream queued for the writer and not answered yet, at most.
const APPEND_STREAM_IN_FLIGHT: usize = 1024;

#[tonic::async_trait]
impl EventStore for EventStoreService {
    async fn append(
        &self,
        request: Request<AppendRequest>,
    ) -> Result<Response<AppendResponse>, Status> {
        let observer = AppendObserver::start(request.get_ref(), AppendCall::Unary);
        let op = validate_append(request.into_inner());
        let appended = observer.observe(async { self.store.append(op?).await });
        Ok(Response::new(appended.await?))
    }

    type AppendStreamStream = AppendResponses;

    async fn append_stream(
        &self,
        request: Request<tonic::Streaming<AppendRequest>>,
    ) -> Result<Response<AppendResponses>, Status> {
        let caller = caller_of(&request)?;
        let budget = request.extensions().get::<MessageBudget>().cloned();
        Ok(Response::new(Box::pin(AppendStreamAnswers {
            requests: request.into_inner(),
            caller,
            budget,
            span: tracing::Span::current(),
            store: self.store.clone(),
            shutdown: Box::pin(self.shutdown.clone().cancelled_owned()),
            queuing: None,
            answers: futures::stream::FuturesOrdered::new(),
            reading_done: None,
        })))
    }

    type SubscribeStream = EventStream;

    /// What `serve` never reaches (it answers Subscribe in [`SubscribeOnWire`]); here for
    /// an embedder that serves [`EventStoreService::into_server`] alone: the same
    /// subscription, each event decoded.
    async fn subscribe(
        &self,
        request: Request<SubscribeRequest>,
    ) -> Result<Response<EventStream>, Status> {
        let runs = self.subscribe_runs(request.into_inner())?;
        let stopping = self.shutdown.clone();
        let events = futures::StreamExt::flat_map(ReceiverStream::new(runs), |run| {
            let events: Vec<Result<Event, Status>> = match run.and_then(EventRun::into_events) {
                Ok(events) => events.into_iter().map(Ok).collect(),
                Err(e) => vec![Err(e.into())],
            };
            futures::stream::iter(events)
        });
        let end = futures::stream::once(async move {
            stopping
                .is_cancelled()
                .then(|| Err(stopping_status("Subscribe")))
        });
        let end = futures::StreamExt::filter_map(end, |end| async move { end });
        Ok(Response::new(Box::pin(futures::StreamExt::chain(
            events, end,
        ))))
    }

    async fn get_session(
        &self,
        request: Request<GetSessionRequest>,
    ) -> Result<Response<SessionInfo>, Status> {
        let req = request.into_inner();
        validate_session_id(&req.session_id)?;
        Ok(Response::new(
            self.store.get_session(&req.session_id).await?,
        ))
    }

    async fn list_sessions(
        &self,
        request: Request<ListSessionsRequest>,
    ) -> Result<Response<ListSessionsResponse>, Status> {
        let caller = caller_of(&request)?;
        Ok(Response::new(
            self.store
                .list_sessions(request.get_ref(), &caller.scope)
                .await?,
        ))
    }

    async fn claim_session(
        &self,
        request: Request<ClaimSessionRequest>,
    ) -> Result<Response<ClaimSessionResponse>, Status> {
        let caller = caller_of(&request)?;
        let req = request.into_inner();
        validate_owner(&req.owner)?;
        validate_ttl(req.ttl_ms)?;
        if req.wait_ms > MAX_WAIT_MS {
            return Err(invalid(format!(
                "wait_ms: {} is over the maximum of {MAX_WAIT_MS}",
                req.wait_ms
            ))
            .into());
        }
        let _waiting = crate::metrics::ClaimWaiting::enter();
        let store = self.store.clone();
        let cancel = self.shutdown.child_token();
        let scope = caller.scope.clone();
        let wait = Duration::from_millis(req.wait_ms);
        let mut claim = ClaimInFlight::start(self.store.clone(), cancel.clone(), async move {
            store
                .claim(req.owner, req.ttl_ms, wait, &cancel, &scope)
                .await
        });
        let lease = claim.answer().await?;
        if lease.is_some() {
            crate::metrics::lease_granted("claim");
        }
        Ok(Response::new(ClaimSessionResponse { lease }))
    }

    async fn acquire_lease(
        &self,
        request: Request<AcquireLeaseRequest>,
    ) -> Result<Response<Lease>, Status> {
        let req = request.into_inner();
        validate_session_id(&req.session_id)?;
        validate_owner(&req.owner)?;
        validate_ttl(req.ttl_ms)?;
        let lease = self
            .store
            .acquire_lease(req.session_id, req.owner, req.ttl_ms)
            .await?;
        crate::metrics::lease_granted("acquire");
        Ok(Response::new(lease))
    }

    async fn renew_lease(
        &self,
        request: Request<RenewLeaseRequest>,
    ) -> Result<Response<Lease>, Status> {
        let req = request.into_inner();
        validate_session_id(&req.session_id)?;
        validate_owner(&req.owner)?;
        validate_ttl(req.ttl_ms)?;
        let lease = self
            .store
            .renew_lease(req.session_id, req.owner, req.epoch, req.ttl_ms)
            .await?;
        crate::metrics::lease_renewed();
        Ok(Response::new(lease))
    }

    async fn release_lease(
        &self,
        request: Request<ReleaseLeaseRequest>,
    ) -> Result<Response<ReleaseLeaseResponse>, Status> {
        let req = request.into_inner();
        validate_session_id(&req.session_id)?;
        validate_owner(&req.owner)?;
        self.store
            .release_lease(req.session_id, req.owner, req.epoch)
            .await?;
        Ok(Response::new(ReleaseLeaseResponse {}))
    }

    async fn put_snapshot(
        &self,
        request: Request<tonic::Streaming<SnapshotChunk>>,
    ) -> Result<Response<PutSnapshotResponse>, Status> {
        let caller = caller_of(&request)?;
        let mut chunks = request.into_inner();
        let first = chunks.message().await?.ok_or_else(|| {
            invalid(
                "the stream carries no chunk; the first names session_id, lease_epoch, seq \
                 and format"
                    .into(),
            )
        })?;
        validate_session_id(&first.session_id)?;
        authorize_snapshot_put(&caller, &first.session_id)?;
        validate_format(&first.format)?;
        let mut data = first.data.to_vec();
        loop {
            if data.len() > MAX_SNAPSHOT_BYTES {
                return Err(StoreError::ResourceExhausted(format!(
                    "the snapshot is over the limit of {MAX_SNAPSHOT_BYTES} bytes (64 MiB)"
                ))
                .into());
            }
            match chunks.message().await? {
                Some(chunk) => data.extend_from_slice(&chunk.data),
                None => break,
            }
        }
        let snapshot = Snapshot {
            session_id: first.session_id,
            format: first.format,
            seq: first.seq,
            data,
        };
        let seq = self.store.put_snapshot(snapshot, first.lease_epoch).await?;
        Ok(Response::new(PutSnapshotResponse { seq }))
    }

    type GetSnapshotStream = SnapshotStream;

    async fn get_snapshot(
        &self,
        request: Request<GetSnapshotRequest>,
    ) -> Result<Response<SnapshotStream>, Status> {
        let req = request.into_inner();
        validate_session_id(&req.session_id)?;
        validate_format(&req.format)?;
        let snapshot = self
            .store
            .get_snapshot(&req.session_id, &req.format)
            .await?
            .ok_or_else(|| {
                // Not a refusal (nothing to act on but reading the log), so no reason.
                Status::not_found(format!(
                    "session {} has no snapshot of format {}",
                    req.session_id, req.format
                ))
            })?;
        let header = SnapshotChunk {
            session_id: req.session_id,
            seq: snapshot.seq,
            format: req.format,
            ..SnapshotChunk::default()
        };
        Ok(Response::new(Box::pin(snapshot_chunks(
            header,
            snapshot.pieces,
        ))))
    }
    async fn delete_session(
        &self,
        request: Request<DeleteSessionRequest>,
    ) -> Result<Response<DeleteSessionResponse>, Status> {
        validate_session_id(&request.get_ref().session_id)?;
        Err(Status::unimplemented(
            "DeleteSession is not served by this build yet",
        ))
    }

    async fn fork_session(
        &self,
        request: Request<ForkSessionRequest>,
    ) -> Result<Response<ForkSessionResponse>, Status> {
        validate_session_id(&request.get_ref().session_id)?;
        Err(Status::unimplemented(
            "ForkSession is not served by this build yet",
        ))
    }
}

/// The status a stream ends with when the store shuts down.
fn stopping_status(rpc: &str) -> Status {
    Status::unavailable(format!(
        "the store is shutting down; call {rpc} again (it reconnects to another replica or to \
         this one once it is back)"
    ))
}

/// A `ClaimSession` long-poll whose caller may go away (a runner that drains cancels its
/// poll; a cut connection drops the call): the poll then ends at once, and a lease it
/// granted meanwhile is given back instead of being left to expire while its session
/// waits. The poll runs in a task of its own, which keeps the lease until the handler has
/// taken it.
struct ClaimInFlight {
    store: Arc<dyn Backend>,
    /// Ends the poll.
    cancel: CancellationToken,
    task: Option<tokio::task::JoinHandle<Result<Option<Lease>, StoreError>>>,
}

impl ClaimInFlight {
    fn start(
        store: Arc<dyn Backend>,
        cancel: CancellationToken,
        poll: impl std::future::Future<Output = Result<Option<Lease>, StoreError>> + Send + 'static,
    ) -> ClaimInFlight {
        ClaimInFlight {
            store,
            cancel,
            task: Some(tokio::spawn(poll.in_current_span())),
        }
    }

    async fn answer(&mut self) -> Result<Option<Lease>, StoreError> {
        let Some(task) = self.task.as_mut() else {
            return Ok(None);
        };
        let answer = task
            .await
            .unwrap_or_else(|e| Err(StoreError::Internal(format!("the claim stopped: {e}"))));
        self.task = None;
        answer
    }
}

impl Drop for ClaimInFlight {
    fn drop(&mut self) {
        let Some(task) = self.task.take() else {
            return;
        };
        self.cancel.cancel();
        let store = self.store.clone();
        tokio::spawn(async move {
            if let Ok(Ok(Some(lease))) = task.await {
                tracing::info!(session_id = %lease.session_id, epoch = lease.epoch, "the claimant went away; giving its lease back");
                let _ = store
                    .release_lease(lease.session_id, lease.owner, lease.epoch)
                    .await;
            }
        });
    }
}

/// The chunks of a snapshot read in `pieces`: each piece sent in slices of at most
/// [`SNAPSHOT_CHUNK_BYTES`] as it comes, the first carrying `header` (an empty snapshot is
/// the header alone). A failed read ends the stream with its status.
fn snapshot_chunks(
    header: SnapshotChunk,
    pieces: SnapshotPieces,
) -> impl Stream<Item = Result<SnapshotChunk, Status>> + Send {
    let start = (pieces, Some(header), std::collections::VecDeque::new());
    futures::stream::unfold(Some(start), |state| async move {
        let (mut pieces, mut header, mut ready) = state?;
        loop {
            if let Some(data) = ready.pop_front() {
                let chunk = SnapshotChunk {
                    data,
                    ..header.take().unwrap_or_default()
                };
                return Some((Ok(chunk), Some((pieces, header, ready))));
            }
            match pieces.next().await {
                Some(Ok(piece)) => ready.extend(
                    (0..piece.len())
                        .step_by(SNAPSHOT_CHUNK_BYTES)
                        .map(|at| piece.slice(at..piece.len().min(at + SNAPSHOT_CHUNK_BYTES))),
                ),
                Some(Err(e)) => return Some((Err(e.into()), None)),
                None => return header.take().map(|header| (Ok(header), None)),
            }
        }
    })
}

type AnswerToCome =
    Pin<Box<dyn std::future::Future<Output = Result<AppendResponse, Status>> + Send>>;

/// An AppendStream request on its way into the writer's queue, with its observer.
type Queuing = Pin<
    Box<
        dyn std::future::Future<Output = (AppendObserver, Result<AppendAnswer, StoreError>)> + Send,
    >,
>;

/// The responses of one AppendStream. Requests are read, checked and queued for the writer
/// as the response side is polled (so in order, and at most [`APPEND_STREAM_IN_FLIGHT`]
/// unanswered), and their answers are sent in that same order: one task per call, no
/// channel between reading a request and sending its answer. A request that breaks the
/// stream (a bad frame) ends it with that status after the answers before it; shutdown
/// stops the reading, the answers already queued still go out, and the stream ends with
/// `UNAVAILABLE` (a request the store did not read is the client's to send again). Each request is counted,
/// timed and traced as a unary Append is ([`AppendObserver`]), its span a child of the
/// call's.
struct AppendStreamAnswers {
    requests: tonic::Streaming<AppendRequest>,
    caller: Caller,
    budget: Option<MessageBudget>,
    /// The call's span (the responses are polled outside it).
    span: tracing::Span,
    store: Arc<dyn Backend>,
    shutdown: Pin<Box<tokio_util::sync::WaitForCancellationFutureOwned>>,
    /// A request being queued (waiting for room in the writer's queue).
    queuing: Option<Queuing>,
    answers: futures::stream::FuturesOrdered<AnswerToCome>,
    /// Set once no more requests are read; the status to end with after the answers, if
    /// the stream broke.
    reading_done: Option<Option<Status>>,
}

impl AppendStreamAnswers {
    /// Reads and queues one request if one is ready and there is room; whether it did.
    fn read_one(&mut self, cx: &mut std::task::Context<'_>) -> bool {
        use std::task::Poll;
        if self.reading_done.is_some() {
            return false;
        }
        if let Some(queuing) = self.queuing.as_mut() {
            return match queuing.as_mut().poll(cx) {
                Poll::Ready((observer, queued)) => {
                    self.queuing = None;
                    self.answers.push_back(Box::pin(async move {
                        let answer = observer.observe(async move { queued?.await });
                        answer.await.map_err(Status::from)
                    }));
                    true
                }
                Poll::Pending => false,
            };
        }
        if std::future::Future::poll(self.shutdown.as_mut(), cx).is_ready() {
            self.reading_done = Some(Some(stopping_status("AppendStream")));
            return false;
        }
        if self.answers.len() >= APPEND_STREAM_IN_FLIGHT {
            return false;
        }
        match Pin::new(&mut self.requests).poll_next(cx) {
            Poll::Ready(Some(Ok(req))) => {
                if let Err(status) = admit_streamed(&self.caller, self.budget.as_ref(), &req) {
                    self.answers
                        .push_back(Box::pin(std::future::ready(Err(status))));
                    return true;
                }
                let observer = self
                    .span
                    .in_scope(|| AppendObserver::start(&req, AppendCall::Stream));
                match validate_append(req) {
                    Ok(op) => {
                        let store = self.store.clone();
                        let span = observer.span().clone();
                        self.queuing = Some(Box::pin(async move {
                            let queued = store.enqueue_append(op).instrument(span).await;
                            (observer, queued)
                        }));
                    }
                    Err(e) => self.answers.push_back(Box::pin(async move {
                        let refused = observer.observe(std::future::ready(Err(e)));
                        refused.await.map_err(Status::from)
                    })),
                }
                true
            }
            Poll::Ready(Some(Err(status))) => {
                self.reading_done = Some(Some(status));
                false
            }
            Poll::Ready(None) => {
                self.reading_done = Some(None);
                false
            }
            Poll::Pending => false,
        }
    }
}

impl Stream for AppendStreamAnswers {
    type Item = Result<AppendStreamResponse, Status>;

    fn poll_next(
        self: Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        use std::task::Poll;
        let this = self.get_mut();
        loop {
            let read = this.read_one(cx);
            match Pin::new(&mut this.answers).poll_next(cx) {
                Poll::Ready(Some(answer)) => return Poll::Ready(Some(Ok(streamed(answer)))),
                Poll::Ready(None) if this.queuing.is_none() => {
                    if let Some(end) = &mut this.reading_done {
                        return Poll::Ready(end.take().map(Err));
                    }
                }
                _ => {}
            }
            if !read {
                return Poll::Pending;
            }
        }
    }
}

/// One request of an AppendStream, checked as the auth and limits layers check a single
/// Append (then [`validate_append`] checks it as it checks one).
fn admit_streamed(
    caller: &Caller,
    budget: Option<&MessageBudget>,
    req: &AppendRequest,
) -> Result<(), Status> {
    if let Some(budget) = budget {
        budget.take()?;
    }
    Ok(authorize_append(caller, req)?)
}

/// An answer of Append as one response of AppendStream.
fn streamed(answer: Result<AppendResponse, Status>) -> AppendStreamResponse {
    AppendStreamResponse {
        result: Some(match answer {
            Ok(response) => append_stream_response::Result::Response(response),
            Err(status) => append_stream_response::Result::Error(AppendError::from(&status)),
        }),
    }
}

/// The caller the auth layer admitted. Its absence means the layer did not run: refuse
/// rather than serve every session.
fn caller_of<T>(request: &Request<T>) -> Result<Caller, Status> {
    request
        .extensions()
        .get::<Caller>()
        .cloned()
        .ok_or_else(|| Status::permission_denied("no authenticated caller for this call"))
}

fn invalid(message: String) -> StoreError {
    StoreError::InvalidArgument(message)
}

/// Quotes a caller's value in an error message without echoing a megabyte back.
fn shown(value: &str) -> String {
    let mut s: String = value.chars().take(40).collect();
    if s.len() < value.len() {
        s.push('…');
    }
    format!("{s:?}")
}

/// A session id: 1-128 chars of `[A-Za-z0-9._:-]`, starting with a letter or digit.
pub fn validate_session_id(id: &str) -> Result<(), StoreError> {
    let ok = !id.is_empty()
        && id.len() <= MAX_ID_LEN
        && id.as_bytes()[0].is_ascii_alphanumeric()
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(invalid(format!(
            "session_id: {} is not valid; use 1-128 characters of [A-Za-z0-9._:-] starting \
             with a letter or digit",
            shown(id)
        )))
    }
}

fn validate_owner(owner: &str) -> Result<(), StoreError> {
    if owner.is_empty() || owner.len() > MAX_ID_LEN || owner.chars().any(char::is_control) {
        return Err(invalid(format!(
            "owner: {} is not valid; name the lease holder in 1-128 printable characters",
            shown(owner)
        )));
    }
    Ok(())
}

/// A snapshot format: 1-64 chars of `[A-Za-z0-9._-]`, starting with a letter or digit.
fn validate_format(format: &str) -> Result<(), StoreError> {
    let ok = !format.is_empty()
        && format.len() <= MAX_FORMAT_LEN
        && format.as_bytes()[0].is_ascii_alphanumeric()
        && format
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(invalid(format!(
            "format: {} is not valid; use 1-{MAX_FORMAT_LEN} characters of [A-Za-z0-9._-] \
             starting with a letter or digit",
            shown(format)
        )))
    }
}

fn validate_ttl(ttl_ms: u64) -> Result<(), StoreError> {
    if ttl_ms == 0 || ttl_ms > MAX_TTL_MS {
        return Err(invalid(format!(
            "ttl_ms: {ttl_ms} is out of range; use 1 to {MAX_TTL_MS} milliseconds"
        )));
    }
    Ok(())
}

/// Checks everything about an append that needs no state: ids, counts, sizes, kinds.
pub fn validate_append(req: AppendRequest) -> Result<AppendOp, StoreError> {
    validate_session_id(&req.session_id)?;
    let total = req.encoded_len();
    if total > MAX_APPEND_BYTES {
        return Err(StoreError::ResourceExhausted(format!(
            "the append request is {total} bytes, over the limit of {MAX_APPEND_BYTES} (4 MiB); \
             split it into several appends"
        )));
    }
    if req.events.is_empty() || req.events.len() > MAX_EVENTS_PER_APPEND {
        return Err(invalid(format!(
            "events: {} given; an append carries 1 to {MAX_EVENTS_PER_APPEND} events",
            req.events.len()
        )));
    }
    let durability = Durability::try_from(req.durability).map_err(|_| {
        invalid(format!(
            "durability: {} is not a Durability (use DURABILITY_SYNC or DURABILITY_BUFFERED)",
            req.durability
        ))
    })?;
    for (i, event) in req.events.iter().enumerate() {
        let size = event.encoded_len();
        if size > MAX_EVENT_BYTES {
            return Err(StoreError::ResourceExhausted(format!(
                "events[{i}]: {size} bytes, over the limit of {MAX_EVENT_BYTES} (1 MiB) per event"
            )));
        }
        if event.kind.is_none() {
            return Err(invalid(format!(
                "events[{i}].kind: an event needs exactly one kind (user_message, \
                 assistant_message, tool_started, tool_result, assistant_delta, run_error)"
            )));
        }
        if !event.session_id.is_empty() && event.session_id != req.session_id {
            return Err(invalid(format!(
                "events[{i}].session_id: {} differs from the request's session_id {}; leave it \
                 empty",
                shown(&event.session_id),
                shown(&req.session_id)
            )));
        }
        if event.event_id.len() > MAX_EVENT_ID_LEN || event.event_id.chars().any(char::is_control) {
            return Err(invalid(format!(
                "events[{i}].event_id: {} is not valid; use up to {MAX_EVENT_ID_LEN} bytes of \
                 printable characters",
                shown(&event.event_id)
            )));
        }
    }
    Ok(AppendOp {
        session_id: req.session_id,
        events: req.events,
        expected_last_seq: req.expected_last_seq,
        lease_epoch: req.lease_epoch,
        durability,
    })
}
