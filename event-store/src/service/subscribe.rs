//! Subscribe as it goes on the wire. Through the generated server every event read from
//! the log would be decoded only to be encoded again, one copy per event into tonic's
//! buffer. [`SubscribeOnWire`] takes the Subscribe calls ahead of it and answers them with
//! a body of its own: a run the backend read in its wire form
//! ([`crate::backend::FramedEvents`]; the local log's history is the buffer the log was read
//! into) is handed to HTTP/2 whole; an event in memory (published live) is encoded as
//! usual. Every other call goes to the generated server.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use agentlog_proto::v1::SubscribeRequest;
use bytes::Bytes;
use http_body::Frame;
use prost::Message;
use tokio::sync::mpsc;
use tonic::codec::{DecodeBuf, Decoder, Streaming};
use tonic::codegen::{http, Service};
use tonic::server::NamedService;
use tonic::Status;

use super::EventStoreService;
use crate::backend::{EventRun, FramedEvents};
use crate::error::StoreError;
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
        let service = self.service.clone();
        Box::pin(async move {
            let runs = match subscribe_request(request).await {
                Ok(request) => service.subscribe_runs(request),
                Err(status) => Err(status),
            };
            Ok(match runs {
                Ok(runs) => {
                    let mut response = http::Response::new(tonic::body::Body::new(SubscribeBody {
                        runs,
                        stopping: service.stopping().clone(),
                        ended: false,
                    }));
                    response.headers_mut().insert(
                        http::header::CONTENT_TYPE,
                        http::HeaderValue::from_static("application/grpc"),
                    );
                    response
                }
                Err(status) => status.into_http(),
            })
        })
    }
}

/// The one request message of a Subscribe call, with the generated server's limit.
async fn subscribe_request<B>(request: http::Request<B>) -> Result<SubscribeRequest, Status>
where
    B: http_body::Body + Send + 'static,
    B::Error: Into<tonic::codegen::StdError> + Send + 'static,
{
    // The store accepts no compressed requests (nor does its generated server).
    if let Some(encoding) = request.headers().get("grpc-encoding") {
        if encoding != "identity" {
            return Err(Status::unimplemented(format!(
                "requests compressed with {encoding:?} are not accepted"
            )));
        }
    }
    let mut messages = Streaming::new_request(
        RequestDecoder,
        request.into_body(),
        None,
        Some(MAX_DECODED_FRAME_BYTES),
    );
    messages
        .message()
        .await?
        .ok_or_else(|| Status::internal("Missing request message."))
}

/// A Subscribe response's body: the subscription's runs as they come, then its status:
/// `UNAVAILABLE` when it ended because the store shuts down (so that the client subscribes
/// again, elsewhere or later), never an OK that a reader would take for the tail.
struct SubscribeBody {
    runs: mpsc::Receiver<Result<EventRun, StoreError>>,
    stopping: tokio_util::sync::CancellationToken,
    ended: bool,
}

impl http_body::Body for SubscribeBody {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        if self.ended {
            return Poll::Ready(None);
        }
        let status = match ready!(self.runs.poll_recv(cx)) {
            Some(Ok(EventRun::Framed(framed))) => {
                return Poll::Ready(Some(Ok(Frame::data(framed.into_bytes()))))
            }
            Some(Ok(EventRun::Decoded(events))) => {
                let framed = FramedEvents::encode(&events);
                return Poll::Ready(Some(Ok(Frame::data(framed.into_bytes()))));
            }
            Some(Err(e)) => Status::from(e),
            None if self.stopping.is_cancelled() => super::stopping_status("Subscribe"),
            None => Status::ok(""),
        };
        self.ended = true;
        let mut trailers = http::HeaderMap::new();
        Poll::Ready(Some(
            status
                .add_header(&mut trailers)
                .map(|()| Frame::trailers(trailers)),
        ))
    }

    fn is_end_stream(&self) -> bool {
        self.ended
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
