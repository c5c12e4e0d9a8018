//! The gRPC floor: `agentlog.v1.EventStore` served by tonic as the store serves it (the
//! generated server, prost's codec, `TCP_NODELAY`), with appends answered at once from
//! memory: nothing validated, stored, synced or published, no layers. What an append costs
//! here is what the contract's transport costs before the store does anything;
//! `agentlog-bench` measures it beside the store and Redis ("the gRPC floor").
//!
//! With `--durable`, the durable floor: every append is handed to one writer thread, which
//! writes the requests it took from its queue in one `pwrite` to a preallocated file in
//! `--data-dir`, calls `fdatasync` once for them, and only then answers them (group
//! commit, the store's writer without the store: no validation, seqs, dedup, session
//! state, index or subscribers). What an append costs here is the least any store that
//! acknowledges after an fsync costs over this transport on this disk: the hand-off to a
//! thread that may block in `fdatasync` and back, the write and the sync. It is a floor
//! under load; one client alone is faster on the store, whose writer and callers spin
//! briefly for each other instead of sleeping (the writer's `LINGER_ALONE`, the answer's
//! `ANSWER_SPIN`).
//!
//! h2's default windows stand in for the store's larger ones: with one 300-byte append in
//! flight per stream they never fill, and only decide how often a WINDOW_UPDATE goes out
//! (every ~100 appends here, ~200 in the store).
//!
//! Seqs count per stream (`AppendStream`) or per process (`Append`): the answers have the
//! store's shape, not its meaning. Every other call is `UNIMPLEMENTED`. Started as the
//! bench starts a store: `--listen ADDR` and `--data-dir DIR` (used only with
//! `--durable`); it logs `listen_addr=…` once it accepts.
#![forbid(unsafe_code)]

use std::fs::File;
use std::io::Write;
use std::net::SocketAddr;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentlog_proto::kept::{KeptAppendRequest, KeptForkRequest};
use agentlog_proto::v1::event_store_server::{EventStore, EventStoreServer};
use agentlog_proto::v1::*;
use anyhow::Context;
use clap::Parser;
use futures::{Stream, StreamExt};
use prost::Message;
use tokio::sync::mpsc::error::TryRecvError;
use tokio::sync::{mpsc, oneshot};
use tonic::transport::server::TcpIncoming;
use tonic::{Request, Response, Status, Streaming};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// Where the durable floor keeps its file; nothing is written without `--durable`.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Answer each append only after the fdatasync that covers it (the durable floor).
    #[arg(long, requires = "data_dir")]
    durable: bool,
}

/// The durable floor's file, preallocated (zero-filled and synced once, as the store's
/// segments are, so that an `fdatasync` persists data and no size) and written round and
/// round.
const FILE_BYTES: u64 = 256 << 20;
/// How long the writer looks again for the next append before it sleeps on its queue, as
/// the store's writer does after a batch of several.
const LINGER: Duration = Duration::from_micros(50);
/// At most this many appends share one fdatasync, as in the store.
const MAX_BATCH: usize = 4096;

/// An append's bytes, and whom to answer once they are durable.
type Queued = (Vec<u8>, oneshot::Sender<()>);

/// The durable floor's writer (see the module head).
struct Durable {
    queue: mpsc::Sender<Queued>,
}

impl Durable {
    fn start(dir: &Path) -> anyhow::Result<Durable> {
        let path = dir.join("durable-floor.log");
        let mut file = File::create(&path).with_context(|| format!("create {}", path.display()))?;
        let zeros = vec![0u8; 1 << 20];
        for _ in 0..FILE_BYTES / zeros.len() as u64 {
            file.write_all(&zeros)?;
        }
        file.sync_all()?;
        File::open(dir)?.sync_all()?;
        let (queue, requests) = mpsc::channel(MAX_BATCH);
        std::thread::Builder::new()
            .name("floor-writer".into())
            .spawn(move || {
                if let Err(e) = write_loop(&file, requests) {
                    // Its queue closes with it: every append still waiting is refused.
                    eprintln!("durable floor: the writer stopped: {e}");
                }
            })?;
        Ok(Durable { queue })
    }

    /// Returns once `bytes` are written and fdatasync'd.
    async fn append(&self, bytes: Vec<u8>) -> Result<(), Status> {
        let stopped = || Status::unavailable("the durable floor's writer stopped");
        let (reply, durable) = oneshot::channel();
        self.queue
            .send((bytes, reply))
            .await
            .map_err(|_| stopped())?;
        durable.await.map_err(|_| stopped())
    }
}

/// Group commit: whatever is queued, in one write and one fdatasync, then the answers.
fn write_loop(file: &File, mut requests: mpsc::Receiver<Queued>) -> std::io::Result<()> {
    let mut offset = 0u64;
    let mut buf = Vec::new();
    let mut batch: Vec<Queued> = Vec::new();
    loop {
        let first = match requests.try_recv() {
            Ok(queued) => queued,
            Err(TryRecvError::Disconnected) => return Ok(()),
            Err(TryRecvError::Empty) => match next(&mut requests) {
                Some(queued) => queued,
                None => return Ok(()),
            },
        };
        batch.push(first);
        while batch.len() < MAX_BATCH {
            match requests.try_recv() {
                Ok(queued) => batch.push(queued),
                Err(_) => break,
            }
        }
        buf.clear();
        for (bytes, _) in &batch {
            buf.extend_from_slice(bytes);
        }
        if offset + buf.len() as u64 > FILE_BYTES {
            offset = 0;
        }
        file.write_all_at(&buf, offset)?;
        offset += buf.len() as u64;
        file.sync_data()?;
        for (_, reply) in batch.drain(..) {
            let _ = reply.send(());
        }
    }
}

/// The next append: looked for again for [`LINGER`], yielding the core, then waited for.
fn next(requests: &mut mpsc::Receiver<Queued>) -> Option<Queued> {
    let since = Instant::now();
    while since.elapsed() < LINGER {
        match requests.try_recv() {
            Ok(queued) => return Some(queued),
            Err(TryRecvError::Disconnected) => return None,
            Err(TryRecvError::Empty) => std::thread::yield_now(),
        }
    }
    requests.blocking_recv()
}

type Answers<T> = Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>;

#[derive(Default)]
struct Floor {
    unary_seq: AtomicU64,
    /// Set with `--durable`.
    durable: Option<Arc<Durable>>,
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
        request: Request<KeptAppendRequest>,
    ) -> Result<Response<AppendResponse>, Status> {
        if let Some(durable) = &self.durable {
            durable.append(request.get_ref().encode_to_vec()).await?;
        }
        let n = request.get_ref().events.len();
        let last = self.unary_seq.fetch_add(n as u64, Ordering::Relaxed) + n as u64;
        Ok(Response::new(answer(n, last)))
    }

    type AppendStreamStream = Answers<AppendStreamResponse>;

    async fn append_stream(
        &self,
        request: Request<Streaming<KeptAppendRequest>>,
    ) -> Result<Response<Self::AppendStreamStream>, Status> {
        let mut last = 0u64;
        let durable = self.durable.clone();
        // One request at a time: the next is read once this one is answered (the bench's
        // clients have one in flight each).
        let answers = request.into_inner().then(move |request| {
            let durable = durable.clone();
            let numbered = request.map(|request| {
                last += request.events.len() as u64;
                (request, last)
            });
            async move {
                let (request, last) = numbered?;
                if let Some(durable) = durable {
                    durable.append(request.encode_to_vec()).await?;
                }
                Ok(AppendStreamResponse {
                    result: Some(append_stream_response::Result::Response(answer(
                        request.events.len(),
                        last,
                    ))),
                })
            }
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
        _: Request<KeptForkRequest>,
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
    let durable = match (&args.data_dir, args.durable) {
        (Some(dir), true) => Some(Arc::new(Durable::start(dir)?)),
        _ => None,
    };
    let incoming = TcpIncoming::bind(args.listen)?.with_nodelay(Some(true));
    eprintln!("listen_addr={}", incoming.local_addr()?);
    tonic::transport::Server::builder()
        .add_service(EventStoreServer::new(Floor {
            durable,
            ..Floor::default()
        }))
        .serve_with_incoming(incoming)
        .await?;
    Ok(())
}
