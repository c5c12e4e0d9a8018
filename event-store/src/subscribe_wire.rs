//! Subscribe as it goes on the wire. Through the generated server every event read from
//! the log would be decoded only to be encoded again; [`SubscribeOnWire`] takes the
//! Subscribe calls ahead of it and sends a stored event's bytes as they are (the body of
//! its log record is one `Event` message, checksum verified when read), and an event in
//! memory (published live) encoded as usual. Every other call goes to the generated server.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use agentlog_proto::v1::SubscribeRequest;
use bytes::BufMut;
use prost::Message;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::codegen::{http, Service};
use tonic::server::{NamedService, ServerStreamingService};
use tonic::Status;

use crate::backend::WireEvent;
use crate::service::{EventStoreService, WireStream};
use crate::wire::MAX_DECODED_FRAME_BYTES;

const SUBSCRIBE_PATH: &str = "/agentlog.v1.EventStore/Subscribe";

/// The generated server `S` with Subscribe answered from stored bytes.
#[derive(Clone)]
pub struct SubscribeOnWire<S> {
    inner: S,
    service: Arc<EventStoreService>,
}

impl<S> SubscribeOnWire<S> {
    /// `service` must be the one `inner` serves, so that Subscribe keeps its meaning.
    pub fn new(inner: S, service: EventStoreService) -> SubscribeOnWire<S> {
        SubscribeOnWire {
            inner,
            service: Arc::new(service),
        }
    }
}

impl<S: NamedService> NamedService for SubscribeOnWire<S> {
    const NAME: &'static str = S::NAME;
}

impl<S, B> Service<http::Request<B>> for SubscribeOnWire<S>
where
    S: Service<http::Request<B>, Response = http::Response<tonic::body::Body>, Error = Infallible>,
    S::Future: Send + 'static,
    B: http_body::Body + Send + 'static,
    B::Error: Into<tonic::codegen::StdError> + Send + 'static,
{
    type Response = http::Response<tonic::body::Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        if request.uri().path() != SUBSCRIBE_PATH {
            return Box::pin(self.inner.call(request));
        }
        let method = Subscribe(self.service.clone());
        Box::pin(async move {
            // The same limits as the generated server's (see `EventStoreService::into_server`).
            let mut grpc = tonic::server::Grpc::new(WireCodec).apply_max_message_size_config(
                Some(MAX_DECODED_FRAME_BYTES),
                Some(MAX_DECODED_FRAME_BYTES),
            );
            Ok(grpc.server_streaming(method, request).await)
        })
    }
}

struct Subscribe(Arc<EventStoreService>);

impl ServerStreamingService<SubscribeRequest> for Subscribe {
    type Response = WireEvent;
    type ResponseStream = WireStream;
    type Future = Pin<Box<dyn Future<Output = Result<tonic::Response<WireStream>, Status>> + Send>>;

    fn call(&mut self, request: tonic::Request<SubscribeRequest>) -> Self::Future {
        let service = self.0.clone();
        Box::pin(async move { service.subscribe_on_wire(request) })
    }
}

/// Sends [`WireEvent`]s, reads a `SubscribeRequest`.
struct WireCodec;

impl Codec for WireCodec {
    type Encode = WireEvent;
    type Decode = SubscribeRequest;
    type Encoder = WireEncoder;
    type Decoder = RequestDecoder;

    fn encoder(&mut self) -> WireEncoder {
        WireEncoder
    }

    fn decoder(&mut self) -> RequestDecoder {
        RequestDecoder
    }
}

struct WireEncoder;

impl Encoder for WireEncoder {
    type Item = WireEvent;
    type Error = Status;

    fn encode(&mut self, item: WireEvent, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        match item {
            WireEvent::Encoded(stored) => dst.put_slice(&stored.bytes),
            WireEvent::Decoded(event) => event
                .encode(dst)
                .map_err(|e| Status::internal(format!("encoding event {}: {e}", event.seq)))?,
        }
        Ok(())
    }
}

struct RequestDecoder;

impl Decoder for RequestDecoder {
    type Item = SubscribeRequest;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<SubscribeRequest>, Status> {
        SubscribeRequest::decode(src)
            .map(Some)
            .map_err(|e| Status::internal(e.to_string()))
    }
}
