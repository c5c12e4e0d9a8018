//! The gRPC edge: `agentlog.v1.EventStore`, health and reflection. Every request is
//! validated here, before it reaches the writer, so a malformed request changes nothing and
//! gets a status that names the field to fix.

mod append_stream;
mod claim;
mod serve;
mod subscribe;
mod transfer;
mod validate;

pub use serve::{local_addr, serve, serve_health, OversizedAsResourceExhausted, ServeOptions};
pub use validate::{validate_append, validate_fork, validate_search, validate_session_id};

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use agentlog_proto::kept::{KeptAppendRequest, KeptForkRequest};
use agentlog_proto::v1::event_store_server::{EventStore, EventStoreServer};
use agentlog_proto::v1::{
    AcquireLeaseRequest, AppendResponse, AppendStreamResponse, ClaimSessionRequest,
    ClaimSessionResponse, DeleteSessionRequest, DeleteSessionResponse, Event, ForkSessionResponse,
    GetSessionRequest, GetSnapshotRequest, Lease, ListSessionsRequest, ListSessionsResponse,
    PutSnapshotResponse, ReleaseLeaseRequest, ReleaseLeaseResponse, RenewLeaseRequest, SessionInfo,
    SnapshotChunk, SubscribeRequest,
};
use agentlog_proto::v1::{ExportRequest, ImportChunk, PinSessionRequest};
use agentlog_proto::v1::{SearchSessionsRequest, SearchSessionsResponse};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::auth::{authorize_snapshot_put, Caller};
use crate::backend::{Backend, EventRun, Snapshot, SnapshotPieces, MAX_SNAPSHOT_BYTES};
use crate::error::StoreError;
use crate::limits::MessageBudget;
use crate::metrics::{AppendCall, AppendObserver};
use crate::stop::Stop;
use crate::wire::{MAX_DECODED_FRAME_BYTES, MAX_WAIT_MS};
use append_stream::AppendStreamAnswers;
use claim::ClaimInFlight;
use validate::{invalid, validate_format, validate_owner, validate_ttl};

/// GetSnapshot sends the data in chunks of this size.
const SNAPSHOT_CHUNK_BYTES: usize = 1 << 20;

pub struct EventStoreService {
    store: Arc<dyn Backend>,
    /// The store's shutdown (its token for what waits on it, its checks for what looks at
    /// it at every request).
    shutdown: Stop,
}

impl EventStoreService {
    /// Needs the runtime ([`Stop::following`]).
    pub fn new(store: Arc<dyn Backend>, shutdown: CancellationToken) -> EventStoreService {
        EventStoreService {
            store,
            shutdown: Stop::following(shutdown),
        }
    }

    pub fn into_server(self) -> EventStoreServer<EventStoreService> {
        EventStoreServer::new(self)
            .max_decoding_message_size(MAX_DECODED_FRAME_BYTES)
            .max_encoding_message_size(MAX_DECODED_FRAME_BYTES)
    }

    /// Fires when the store begins to shut down: a stream that ends from then on ends with
    /// `UNAVAILABLE` ([`stopping_status`]), so that its client subscribes again (elsewhere).
    pub(crate) fn stopping(&self) -> &CancellationToken {
        self.shutdown.token()
    }

    /// Subscribe: the backend's runs of events.
    pub(crate) fn subscribe_runs(
        &self,
        req: SubscribeRequest,
    ) -> Result<mpsc::Receiver<Result<EventRun, StoreError>>, Status> {
        crate::metrics::read_request("subscribe");
        validate_session_id(&req.session_id)?;
        Ok(self.store.subscribe(
            req.session_id,
            req.from_seq,
            req.follow,
            self.shutdown.token().child_token(),
        ))
    }
}

/// The status a stream ends with when the store shuts down.
pub(crate) fn stopping_status(rpc: &str) -> Status {
    Status::unavailable(format!(
        "the store is shutting down; call {rpc} again (it reconnects to another replica or to \
         this one once it is back)"
    ))
}

type EventStream = Pin<Box<dyn Stream<Item = Result<Event, Status>> + Send>>;
type SnapshotStream = Pin<Box<dyn Stream<Item = Result<SnapshotChunk, Status>> + Send>>;
type AppendResponses = Pin<Box<dyn Stream<Item = Result<AppendStreamResponse, Status>> + Send>>;

#[tonic::async_trait]
impl EventStore for EventStoreService {
    async fn append(
        &self,
        request: Request<KeptAppendRequest>,
    ) -> Result<Response<AppendResponse>, Status> {
        let observer = AppendObserver::start(request.get_ref(), AppendCall::Unary);
        let op = validate_append(request.into_inner());
        let appended = observer.observe(async { self.store.append(op?).await });
        Ok(Response::new(appended.await?))
    }

    type AppendStreamStream = AppendResponses;

    async fn append_stream(
        &self,
        request: Request<tonic::Streaming<KeptAppendRequest>>,
    ) -> Result<Response<AppendResponses>, Status> {
        let caller = caller_of(&request)?;
        let budget = request.extensions().get::<MessageBudget>().cloned();
        Ok(Response::new(Box::pin(AppendStreamAnswers::new(
            request.into_inner(),
            caller,
            budget,
            self.store.clone(),
            self.shutdown.check(),
        ))))
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
        let stopping = self.shutdown.token().clone();
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
        crate::metrics::read_request("get_session");
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
        crate::metrics::read_request("list_sessions");
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
        let cancel = self.shutdown.token().child_token();
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
        crate::metrics::read_request("get_snapshot");
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
        let req = request.into_inner();
        validate_session_id(&req.session_id)?;
        self.store.delete_session(&req.session_id).await?;
        Ok(Response::new(DeleteSessionResponse {}))
    }

    async fn fork_session(
        &self,
        request: Request<KeptForkRequest>,
    ) -> Result<Response<ForkSessionResponse>, Status> {
        let caller = caller_of(&request)?;
        let op = validate_fork(request.into_inner(), &caller.scope)?;
        Ok(Response::new(self.store.fork(op).await?))
    }

    // Sessions that move.

    type ExportStream = transfer::ExportStream;

    async fn export(
        &self,
        request: Request<ExportRequest>,
    ) -> Result<Response<transfer::ExportStream>, Status> {
        let caller = caller_of(&request)?;
        let which = transfer::which(&self.store, request.into_inner(), &caller).await?;
        Ok(Response::new(transfer::export_stream(
            self.store.clone(),
            which,
            self.shutdown.token().clone(),
        )))
    }

    type ImportStream = transfer::ImportStream;

    async fn import(
        &self,
        request: Request<tonic::Streaming<ImportChunk>>,
    ) -> Result<Response<transfer::ImportStream>, Status> {
        caller_of(&request)?;
        Ok(Response::new(transfer::import_stream(
            self.store.clone(),
            request.into_inner(),
            self.shutdown.token().clone(),
        )))
    }

    async fn pin_session(
        &self,
        request: Request<PinSessionRequest>,
    ) -> Result<Response<SessionInfo>, Status> {
        let req = request.into_inner();
        validate_session_id(&req.session_id)?;
        Ok(Response::new(
            self.store.pin(&req.session_id, req.pinned).await?,
        ))
    }

    async fn search_sessions(
        &self,
        request: Request<SearchSessionsRequest>,
    ) -> Result<Response<SearchSessionsResponse>, Status> {
        let caller = caller_of(&request)?;
        let op = validate_search(request.into_inner())?;
        Ok(Response::new(self.store.search(op, &caller.scope).await?))
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

/// The caller the auth layer admitted. Its absence means the layer did not run: refuse
/// rather than serve every session.
pub(crate) fn caller_of<T>(request: &Request<T>) -> Result<Caller, Status> {
    request
        .extensions()
        .get::<Caller>()
        .cloned()
        .ok_or_else(|| Status::permission_denied("no authenticated caller for this call"))
}
