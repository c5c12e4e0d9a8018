//! Export and Import at the gRPC edge: the request checked (ids, the caller's scope), the
//! work of `crate::transfer` run on a task of its own, its pieces or results streamed back
//! through a bounded channel (a client that stops reading holds the work, not memory),
//! and a shutdown ending the stream with `UNAVAILABLE`.

use std::pin::Pin;
use std::sync::Arc;

use agentlog_proto::v1::{ExportChunk, ExportRequest, ImportChunk, ImportResult};
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tokio_util::sync::CancellationToken;
use tonic::Status;

use super::{stopping_status, validate_session_id};
use crate::auth::Caller;
use crate::backend::Backend;
use crate::error::StoreError;
use crate::transfer::export::{export, Out, Which};
use crate::transfer::import::import;

pub(crate) type ExportStream = Pin<Box<dyn Stream<Item = Result<ExportChunk, Status>> + Send>>;
pub(crate) type ImportStream = Pin<Box<dyn Stream<Item = Result<ImportResult, Status>> + Send>>;

/// Pieces of an export queued for the client, at most.
const PIECES_AHEAD: usize = 4;
/// Import results queued for the client, at most.
const RESULTS_AHEAD: usize = 64;

/// What an Export request asks for, checked: named sessions in the caller's scope (one
/// outside it is answered as one that does not exist), or all of the scope.
pub(crate) async fn which(
    store: &Arc<dyn Backend>,
    req: ExportRequest,
    caller: &Caller,
) -> Result<Which, Status> {
    if req.all {
        if !req.session_ids.is_empty() {
            return Err(Status::invalid_argument(
                "session_ids: name sessions or set all, not both",
            ));
        }
        return Ok(Which::All(caller.scope.clone()));
    }
    if req.session_ids.is_empty() {
        return Err(Status::invalid_argument(
            "session_ids: name the sessions to export, or set all",
        ));
    }
    for id in &req.session_ids {
        validate_session_id(id)?;
        if !caller.scope.admits(id) {
            return Err(crate::auth::Denial::Hidden {
                session_id: id.clone(),
            }
            .into());
        }
        // A deleted one is exported as a deleted line; one that never existed is refused
        // before anything is sent.
        if let Err(e) = store.get_session(id).await {
            if e.reason() != Some(agentlog_proto::reason::Reason::SessionDeleted) {
                return Err(e.into());
            }
        }
    }
    Ok(Which::Named(req.session_ids))
}

struct ChannelOut(mpsc::Sender<Result<ExportChunk, Status>>);

#[tonic::async_trait]
impl Out for ChannelOut {
    async fn write(&mut self, piece: String) -> Result<(), StoreError> {
        self.0
            .send(Ok(ExportChunk { text: piece }))
            .await
            .map_err(|_| StoreError::Unavailable("the client went away".into()))
    }
}

pub(crate) fn export_stream(
    store: Arc<dyn Backend>,
    which: Which,
    shutdown: CancellationToken,
) -> ExportStream {
    let (tx, rx) = mpsc::channel(PIECES_AHEAD);
    tokio::spawn(async move {
        let mut out = ChannelOut(tx.clone());
        let ended = tokio::select! {
            ended = export(&store, which, &mut out) => ended.map_err(Status::from),
            _ = shutdown.cancelled() => Err(stopping_status("Export")),
        };
        if let Err(status) = ended {
            let _ = tx.send(Err(status)).await;
        }
    });
    Box::pin(ReceiverStream::new(rx))
}

pub(crate) fn import_stream(
    store: Arc<dyn Backend>,
    chunks: tonic::Streaming<ImportChunk>,
    shutdown: CancellationToken,
) -> ImportStream {
    let (results, rx) = mpsc::channel(RESULTS_AHEAD);
    let (end_tx, end_rx) = oneshot::channel::<Status>();
    let pieces = chunks.map(|chunk| {
        chunk.map(|c| c.text).map_err(|status| {
            StoreError::InvalidArgument(format!(
                "the import's stream broke off: {}",
                status.message()
            ))
        })
    });
    tokio::spawn(async move {
        let ended = tokio::select! {
            ended = import(store, Box::pin(pieces), results) => ended.map_err(Status::from),
            _ = shutdown.cancelled() => Err(stopping_status("Import")),
        };
        if let Err(status) = ended {
            let _ = end_tx.send(status);
        }
    });
    let end =
        futures::stream::once(async move { end_rx.await.ok().map(Err) }).filter_map(|end| end);
    Box::pin(ReceiverStream::new(rx).map(Ok).chain(end))
}
