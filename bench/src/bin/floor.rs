//! The gRPC floor: `agentlog.v1.EventStore` served by tonic as the store serves it (the
//! generated server, prost's codec, `TCP_NODELAY`), with appends answered at once from
//! memory: nothing validated, stored, synced or published, no layers. What an append costs
//! here is what the contract's transport costs before the store does anything;
//! `agentlog-bench` measures it beside the store and Redis ("the gRPC floor").
//!
//! h2's default windows stand in for the store's larger ones: with one 300-byte append in
//! flight per stream they never fill, and only decide how often a WINDOW_UPDATE goes out
//! (every ~100 appends here, ~200 in the store).
//!
//! Seqs count per stream (`AppendStream`) or per process (`Append`): the answers have the
//! store's shape, not its meaning. Every other call is `UNIMPLEMENTED`. Started as the
//! bench starts a store: `--listen ADDR` (and `--data-dir`, which it ignores); it logs
//! `listen_addr=…` once it accepts.
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};

use agentlog_proto::v1::event_store_server::{EventStore, EventStoreServer};
use agentlog_proto::v1::*;
use clap::Parser;
use futures::{Stream, StreamExt};
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status, Streaming};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Accepted for the bench's store launcher; nothing is written.
    #[arg(long)]
    data_dir: Option<PathBuf>,
}

type Answers<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[derive(Default)]
struct Floor {
    unary_seq: AtomicU64,
}

/// What `Append` answers for `events` events ending at `last`.
fn answer(events: usize, last: u64) -> AppendResponse {
    AppendResponse {
        seqs: (last + 1 - events as u64..=last).collect(),
        last_seq: last,
    }
}

fn unimplemented<T>() -> Result<Response<T>, Status> {
    Err(Status::unimplemented("the gRPC floor answers appends only"))
}

#[tonic::async_trait]
impl EventStore for Floor {
    async fn append(
        &self,
        request: Request<AppendRequest>,
    ) -> Result<Response<AppendResponse>, Status> {
        let n = request.get_ref().events.len();
        let last = self.unary_seq.fetch_add(n as u64, Ordering::Relaxed) + n as u64;
        Ok(Response::new(answer(n, last)))
    }

    type AppendStreamStream = Answers<AppendStreamResponse>;

    async fn append_stream(
        &self,
        request: Request<Streaming<AppendRequest>>,
    ) -> Result<Response<Self::AppendStreamStream>, Status> {
        let mut last = 0u64;
        let answers = request.into_inner().map(move |request| {
            let n = request?.events.len();
            last += n as u64;
            Ok(AppendStreamResponse {
                result: Some(append_stream_response::Result::Response(answer(n, last))),
            })
        });
        Ok(Response::new(Box::pin(answers)))
    }

    type SubscribeStream = Answers<Event>;

    async fn subscribe(
        &self,
        _: Request<SubscribeRequest>,
    ) -> Result<Response<Self::SubscribeStream>, Status> {
        unimplemented()
    }

    async fn get_session(
        &self,
        _: Request<GetSessionRequest>,
    ) -> Result<Response<SessionInfo>, Status> {
        unimplemented()
    }

    async fn list_sessions(
        &self,
        _: Request<ListSessionsRequest>,
    ) -> Result<Response<ListSessionsResponse>, Status> {
        unimplemented()
    }

    async fn claim_session(
        &self,
        _: Request<ClaimSessionRequest>,
    ) -> Result<Response<ClaimSessionResponse>, Status> {
        unimplemented()
    }

    async fn acquire_lease(
        &self,
        _: Request<AcquireLeaseRequest>,
    ) -> Result<Response<Lease>, Status> {
        unimplemented()
    }

    async fn renew_lease(&self, _: Request<RenewLeaseRequest>) -> Result<Response<Lease>, Status> {
        unimplemented()
    }

    async fn release_lease(
        &self,
        _: Request<ReleaseLeaseRequest>,
    ) -> Result<Response<ReleaseLeaseResponse>, Status> {
        unimplemented()
    }

    async fn put_snapshot(
        &self,
        _: Request<Streaming<SnapshotChunk>>,
    ) -> Result<Response<PutSnapshotResponse>, Status> {
        unimplemented()
    }

    type GetSnapshotStream = Answers<SnapshotChunk>;

    async fn get_snapshot(
        &self,
        _: Request<GetSnapshotRequest>,
    ) -> Result<Response<Self::GetSnapshotStream>, Status> {
        unimplemented()
    }

    async fn delete_session(
        &self,
        _: Request<DeleteSessionRequest>,
    ) -> Result<Response<DeleteSessionResponse>, Status> {
        unimplemented()
    }

    async fn fork_session(
        &self,
        _: Request<ForkSessionRequest>,
    ) -> Result<Response<ForkSessionResponse>, Status> {
        unimplemented()
    }

    type ExportStream = Answers<ExportChunk>;

    async fn export(
        &self,
        _: Request<ExportRequest>,
    ) -> Result<Response<Self::ExportStream>, Status> {
        unimplemented()
    }

    type ImportStream = Answers<ImportResult>;

    async fn import(
        &self,
        _: Request<Streaming<ImportChunk>>,
    ) -> Result<Response<Self::ImportStream>, Status> {
        unimplemented()
    }

    async fn pin_session(
        &self,
        _: Request<PinSessionRequest>,
    ) -> Result<Response<SessionInfo>, Status> {
        unimplemented()
    }

    async fn search_sessions(
        &self,
        _: Request<SearchSessionsRequest>,
    ) -> Result<Response<SearchSessionsResponse>, Status> {
        unimplemented()
    }
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let incoming = TcpIncoming::bind(args.listen)?.with_nodelay(Some(true));
    eprintln!("listen_addr={}", incoming.local_addr()?);
    tonic::transport::Server::builder()
        .add_service(EventStoreServer::new(Floor::default()))
        .serve_with_incoming(incoming)
        .await?;
    Ok(())
}
