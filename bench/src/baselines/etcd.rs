//! etcd, single node (its WAL is fdatasync'd before a proposal commits): `Put` per event,
//! `Range` pages to catch up, `Watch` from a revision to follow, over etcd's native gRPC
//! API. The few messages used are declared here by hand from etcd's `rpc.proto` and
//! `kv.proto` (fields not needed are left out; protobuf skips them), so the build needs no
//! `protoc`.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Context;
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::Channel;
use tonic_prost::ProstCodec;

use super::{free_port, version_of, wait_until_up, ServerProcess};
use crate::fanout::{FollowerContext, Received};
use crate::load::Appender;

/// The etcd v3 messages the bench sends and reads (package `etcdserverpb` / `mvccpb`).
mod pb {
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct ResponseHeader {
        #[prost(int64, tag = "3")]
        pub revision: i64,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct KeyValue {
        #[prost(bytes = "vec", tag = "1")]
        pub key: Vec<u8>,
        #[prost(int64, tag = "3")]
        pub mod_revision: i64,
        #[prost(bytes = "vec", tag = "5")]
        pub value: Vec<u8>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PutRequest {
        #[prost(bytes = "vec", tag = "1")]
        pub key: Vec<u8>,
        #[prost(bytes = "vec", tag = "2")]
        pub value: Vec<u8>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct PutResponse {
        #[prost(message, optional, tag = "1")]
        pub header: Option<ResponseHeader>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct RangeRequest {
        #[prost(bytes = "vec", tag = "1")]
        pub key: Vec<u8>,
        #[prost(bytes = "vec", tag = "2")]
        pub range_end: Vec<u8>,
        #[prost(int64, tag = "3")]
        pub limit: i64,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct RangeResponse {
        #[prost(message, optional, tag = "1")]
        pub header: Option<ResponseHeader>,
        #[prost(message, repeated, tag = "2")]
        pub kvs: Vec<KeyValue>,
        #[prost(bool, tag = "3")]
        pub more: bool,
    }
    /// `RequestOp` with only its `request_put` member (tag 2 of the oneof).
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct RequestOp {
        #[prost(message, optional, tag = "2")]
        pub request_put: Option<PutRequest>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct TxnRequest {
        #[prost(message, repeated, tag = "2")]
        pub success: Vec<RequestOp>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct TxnResponse {
        #[prost(message, optional, tag = "1")]
        pub header: Option<ResponseHeader>,
        #[prost(bool, tag = "2")]
        pub succeeded: bool,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct WatchCreateRequest {
        #[prost(bytes = "vec", tag = "1")]
        pub key: Vec<u8>,
        #[prost(bytes = "vec", tag = "2")]
        pub range_end: Vec<u8>,
        #[prost(int64, tag = "3")]
        pub start_revision: i64,
    }
    /// `WatchRequest` with only its `create_request` member (tag 1 of the oneof).
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct WatchRequest {
        #[prost(message, optional, tag = "1")]
        pub create_request: Option<WatchCreateRequest>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct Event {
        #[prost(int32, tag = "1")]
        pub r#type: i32,
        #[prost(message, optional, tag = "2")]
        pub kv: Option<KeyValue>,
    }
    #[derive(Clone, PartialEq, prost::Message)]
    pub struct WatchResponse {
        #[prost(message, optional, tag = "1")]
        pub header: Option<ResponseHeader>,
        #[prost(int64, tag = "2")]
        pub watch_id: i64,
        #[prost(bool, tag = "3")]
        pub created: bool,
        #[prost(bool, tag = "4")]
        pub canceled: bool,
        #[prost(message, repeated, tag = "11")]
        pub events: Vec<Event>,
    }
}

/// A thin etcd v3 client over one HTTP/2 connection.
#[derive(Clone)]
pub struct EtcdClient {
    grpc: tonic::client::Grpc<Channel>,
}

impl EtcdClient {
    pub async fn connect(url: &str) -> anyhow::Result<EtcdClient> {
        let channel = tonic::transport::Endpoint::from_shared(url.to_string())?
            .connect()
            .await?;
        Ok(EtcdClient {
            grpc: tonic::client::Grpc::new(channel),
        })
    }

    async fn unary<Req, Resp>(&mut self, path: &'static str, request: Req) -> anyhow::Result<Resp>
    where
        Req: prost::Message + Send + Sync + 'static,
        Resp: prost::Message + Default + Send + Sync + 'static,
    {
        self.grpc.ready().await?;
        let response = self
            .grpc
            .unary(
                tonic::Request::new(request),
                PathAndQuery::from_static(path),
                ProstCodec::<Req, Resp>::default(),
            )
            .await?;
        Ok(response.into_inner())
    }

    pub async fn put(&mut self, key: Vec<u8>, value: Vec<u8>) -> anyhow::Result<i64> {
        let response: pb::PutResponse = self
            .unary("/etcdserverpb.KV/Put", pb::PutRequest { key, value })
            .await?;
        Ok(response.header.map(|h| h.revision).unwrap_or(0))
    }

    pub async fn put_many(&mut self, puts: Vec<(Vec<u8>, Vec<u8>)>) -> anyhow::Result<()> {
        let request = pb::TxnRequest {
            success: puts
                .into_iter()
                .map(|(key, value)| pb::RequestOp {
                    request_put: Some(pb::PutRequest { key, value }),
                })
                .collect(),
        };
        let response: pb::TxnResponse = self.unary("/etcdserverpb.KV/Txn", request).await?;
        anyhow::ensure!(response.succeeded, "etcd refused a Txn of puts");
        Ok(())
    }

    pub async fn range(
        &mut self,
        key: Vec<u8>,
        range_end: Vec<u8>,
        limit: i64,
    ) -> anyhow::Result<pb::RangeResponse> {
        self.unary(
            "/etcdserverpb.KV/Range",
            pb::RangeRequest {
                key,
                range_end,
                limit,
            },
        )
        .await
    }

    pub async fn watch(
        &mut self,
        key: Vec<u8>,
        range_end: Vec<u8>,
        start_revision: i64,
    ) -> anyhow::Result<tonic::Streaming<pb::WatchResponse>> {
        self.grpc.ready().await?;
        let requests = tokio_stream::once(pb::WatchRequest {
            create_request: Some(pb::WatchCreateRequest {
                key,
                range_end,
                start_revision,
            }),
        })
        .chain(tokio_stream::pending());
        let response = self
            .grpc
            .streaming(
                tonic::Request::new(requests),
                PathAndQuery::from_static("/etcdserverpb.Watch/Watch"),
                ProstCodec::<pb::WatchRequest, pb::WatchResponse>::default(),
            )
            .await?;
        Ok(response.into_inner())
    }
}

use tokio_stream::StreamExt as _;

/// `<session>/` and the end of its key range.
fn prefix(session: &str) -> (Vec<u8>, Vec<u8>) {
    let start = format!("s/{session}/").into_bytes();
    let mut end = start.clone();
    if let Some(last) = end.last_mut() {
        *last += 1;
    }
    (start, end)
}

fn key(session: &str, k: u64) -> Vec<u8> {
    format!("s/{session}/{k:012}").into_bytes()
}

fn k_of(key: &[u8]) -> Option<u64> {
    let text = std::str::from_utf8(key).ok()?;
    text.rsplit('/').next()?.parse().ok()
}

pub struct Etcd {
    server: ServerProcess,
    pub url: String,
    pub version: String,
}

impl Etcd {
    pub fn pid(&self) -> u32 {
        self.server.pid()
    }

    pub async fn start(dir: &Path) -> anyhow::Result<Etcd> {
        let client_port = free_port()?;
        let peer_port = free_port()?;
        let client_url = format!("http://127.0.0.1:{client_port}");
        let peer_url = format!("http://127.0.0.1:{peer_port}");
        let mut command = Command::new("etcd");
        command
            .args(["--name", "bench", "--data-dir"])
            .arg(dir.join("etcd-data"))
            .args([
                "--listen-client-urls",
                &client_url,
                "--advertise-client-urls",
                &client_url,
                "--listen-peer-urls",
                &peer_url,
                "--initial-advertise-peer-urls",
                &peer_url,
                "--initial-cluster",
                &format!("bench={peer_url}"),
                "--quota-backend-bytes",
                "8589934592",
                "--log-level",
                "warn",
            ]);
        let mut server = ServerProcess::spawn("etcd", command, dir)?;
        let mut client = wait_until_up(&mut server, Duration::from_secs(60), || {
            let url = client_url.clone();
            async move { EtcdClient::connect(&url).await }
        })
        .await?;
        // Connected is not ready: wait until it serves a write.
        wait_until_up(&mut server, Duration::from_secs(60), || {
            let mut client = client.clone();
            async move { client.put(b"ready".to_vec(), b"1".to_vec()).await }
        })
        .await?;
        client.range(b"ready".to_vec(), vec![], 1).await?;
        Ok(Etcd {
            server,
            url: client_url,
            version: version_of("etcd", &["--version"]),
        })
    }

    pub async fn appender(&self, session: String) -> anyhow::Result<EtcdAppender> {
        Ok(EtcdAppender {
            client: EtcdClient::connect(&self.url).await?,
            session,
            k: 0,
            body: crate::event_json().into_bytes(),
        })
    }

    /// Writes `events` keys under the session, 128 puts per Txn (etcd's default
    /// `--max-txn-ops`).
    pub async fn fill(&self, session: &str, events: usize) -> anyhow::Result<()> {
        let mut client = EtcdClient::connect(&self.url).await?;
        let body = crate::event_json().into_bytes();
        let mut k = 1u64;
        while k <= events as u64 {
            let last = (k + 127).min(events as u64);
            client
                .put_many(
                    (k..=last)
                        .map(|i| (key(session, i), body.clone()))
                        .collect(),
                )
                .await?;
            k = last + 1;
        }
        Ok(())
    }

    /// Reads every key of the session with Range pages of 1000; keys per second.
    pub async fn catch_up(&self, session: &str, expected: usize) -> anyhow::Result<f64> {
        let mut client = EtcdClient::connect(&self.url).await?;
        let (mut from, end) = prefix(session);
        let start = Instant::now();
        let mut n = 0;
        loop {
            let page = client.range(from.clone(), end.clone(), 1000).await?;
            n += page.kvs.len();
            match page.kvs.last() {
                Some(last) if page.more => {
                    from = last.key.clone();
                    from.push(0);
                }
                _ => break,
            }
        }
        let secs = start.elapsed().as_secs_f64();
        anyhow::ensure!(n == expected, "read {n} keys, expected {expected}");
        Ok(n as f64 / secs)
    }

    /// Live fan-out: one Watch stream per follower, at most 100 per connection.
    pub async fn fan_out(
        &self,
        session: &str,
        followers: usize,
        events: usize,
        interval: Duration,
    ) -> anyhow::Result<Vec<f64>> {
        let mut clients = Vec::new();
        for _ in 0..followers.div_ceil(100) {
            clients.push(EtcdClient::connect(&self.url).await?);
        }
        let writer = EtcdClient::connect(&self.url).await?;
        let spawn_follower = |f: usize, ctx: FollowerContext| {
            let mut client = clients[f / 100].clone();
            let (start_key, end) = prefix(session);
            tokio::spawn(async move {
                // From revision 1: event 0 may be put before this watch exists, and
                // etcd replays it from history (the session's keys are fresh per run).
                let mut stream = client.watch(start_key, end, 1).await?;
                let mut received: Received = Vec::with_capacity(ctx.events);
                while let Some(response) = stream.message().await? {
                    let at = Instant::now();
                    for event in response.events {
                        let k = event
                            .kv
                            .as_ref()
                            .and_then(|kv| k_of(&kv.key))
                            .context("a watch event without a key")?;
                        if k == 0 {
                            let _ = ctx.ready.send(()).await;
                        } else {
                            received.push((k, at));
                        }
                    }
                    if received.len() >= ctx.events {
                        break;
                    }
                }
                anyhow::Ok(received)
            })
        };
        let append = |k: u64| {
            let mut writer = writer.clone();
            let key = key(session, k);
            async move {
                writer.put(key, crate::event_json().into_bytes()).await?;
                anyhow::Ok(())
            }
        };
        crate::fanout::measure(followers, events, interval, spawn_follower, append).await
    }
}

pub struct EtcdAppender {
    client: EtcdClient,
    session: String,
    k: u64,
    body: Vec<u8>,
}

impl Appender for EtcdAppender {
    async fn append(&mut self) -> anyhow::Result<()> {
        self.k += 1;
        self.client
            .put(key(&self.session, self.k), self.body.clone())
            .await?;
        Ok(())
    }
}
