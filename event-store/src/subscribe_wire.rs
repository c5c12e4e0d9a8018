//! Subscribe as it goes on the wire. Through the generated server every event read from
//! the log would be decoded only to be encoded again, one copy per event into tonic's
//! buffer. [`SubscribeOnWire`] takes the Subscribe calls ahead of it and answers them with
//! a body of its own: a run of history is the buffer the log was read into, each event's
//! stored `Event` message moved behind its gRPC message header in place
//! ([`FramedEvents::from_stored`], checksum verified first), handed to HTTP/2 whole; an
//! event in memory (published live) is encoded as usual. Every other call goes to the
//! generated server.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{ready, Context, Poll};

use agentlog_proto::v1::{Event, SubscribeRequest};
use bytes::{BufMut, Bytes, BytesMut};
use http_body::Frame;
use prost::Message;
use tokio::sync::mpsc;
use tonic::codec::{DecodeBuf, Decoder, Streaming};
use tonic::codegen::{http, Service};
use tonic::server::NamedService;
use tonic::Status;

use crate::backend::EventRun;
use crate::error::StoreError;
use crate::log::record::StoredEvent;
use crate::log::{LogError, ReadRun};
use crate::service::EventStoreService;
use crate::wire::MAX_DECODED_FRAME_BYTES;

const SUBSCRIBE_PATH: &str = "/agentlog.v1.EventStore/Subscribe";
/// A gRPC message's header: the compressed flag (always 0 here) and the length, big-endian.
const MESSAGE_HEADER_LEN: usize = 5;

/// Events as Subscribe sends them: consecutive gRPC messages, each an `Event`, uncompressed.
#[derive(Clone, Debug)]
pub struct FramedEvents {
    bytes: Bytes,
    count: usize,
}

impl FramedEvents {
    /// The records of `run`, which must be the session's events from `first_seq` on, one
    /// after the other: each record's checksum is verified and its session and seq
    /// checked, then its `Event` message is moved behind a gRPC message header, in the
    /// buffer it was read into. A header is 4 bytes shorter than a record's (its frame
    /// header and kind byte), so messages only ever move towards the front, over bytes
    /// already dealt with.
    pub fn from_stored(
        run: ReadRun,
        session_id: &str,
        first_seq: u64,
    ) -> Result<FramedEvents, StoreError> {
        let mut run = run;
        let (start, records) = (run.start, run.records);
        let bytes = &mut run.bytes;
        let mut framed = 0;
        for (seq, &position) in (first_seq..).zip(records) {
            let at = (position.offset - start) as usize;
            let frame = &bytes[at..at + position.len as usize];
            let stored = StoredEvent::from_frame(frame).map_err(|reason| LogError::BadRecord {
                offset: position.offset,
                reason,
            })?;
            if stored.seq != seq || stored.session_id != session_id.as_bytes() {
                return Err(StoreError::Internal(format!(
                    "index entry {session_id}/{seq} points at another record"
                )));
            }
            let message = at + stored.message.start..at + stored.message.end;
            let len = message.len();
            bytes[framed] = 0;
            bytes[framed + 1..framed + MESSAGE_HEADER_LEN]
                .copy_from_slice(&(len as u32).to_be_bytes());
            bytes.copy_within(message, framed + MESSAGE_HEADER_LEN);
            framed += MESSAGE_HEADER_LEN + len;
        }
        Ok(FramedEvents {
            count: records.len(),
            bytes: run.into_bytes(framed),
        })
    }

    /// How many events.
    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The events themselves, decoded (for callers in this process).
    pub fn decode(&self) -> Result<Vec<Event>, StoreError> {
        let undecodable =
            |what: &str| StoreError::Internal(format!("a stored event is undecodable: {what}"));
        let mut events = Vec::with_capacity(self.count);
        let mut rest = &self.bytes[..];
        while !rest.is_empty() {
            let header = rest
                .get(..MESSAGE_HEADER_LEN)
                .ok_or_else(|| undecodable("cut short"))?;
            let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
            let message = rest
                .get(MESSAGE_HEADER_LEN..MESSAGE_HEADER_LEN + len)
                .ok_or_else(|| undecodable("cut short"))?;
            events.push(Event::decode(message).map_err(|e| undecodable(&e.to_string()))?);
            rest = &rest[MESSAGE_HEADER_LEN + len..];
        }
        Ok(events)
    }
}

/// Events in memory as gRPC messages.
fn encode(events: &[Event]) -> Bytes {
    let len = events
        .iter()
        .map(|e| MESSAGE_HEADER_LEN + e.encoded_len())
        .sum();
    let mut buf = BytesMut::with_capacity(len);
    for event in events {
        buf.put_u8(0);
        buf.put_u32(event.encoded_len() as u32);
        event
            .encode(&mut buf)
            .expect("the buffer was sized for the events");
    }
    buf.freeze()
}

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
                return Poll::Ready(Some(Ok(Frame::data(framed.bytes))))
            }
            Some(Ok(EventRun::Decoded(events))) => {
                return Poll::Ready(Some(Ok(Frame::data(encode(&events)))))
            }
            Some(Err(e)) => Status::from(e),
            None if self.stopping.is_cancelled() => Status::unavailable(
                "the store is shutting down; subscribe again from the next seq (it reconnects \
                 to another replica or to this one once it is back)",
            ),
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

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;
    use std::sync::Arc;

    use agentlog_proto::v1::{event, UserMessage};

    use super::*;
    use crate::log::record::LeaseRecord;
    use crate::log::storage::FsStorage;
    use crate::log::{LogConfig, LogReader, LogWriter, Position, Record};

    fn event(session_id: &str, seq: u64, text: &str) -> Event {
        Event {
            session_id: session_id.into(),
            seq,
            event_id: format!("e{seq}"),
            ts_unix_ms: 1_700_000_000_000 + seq as i64,
            schema_version: 1,
            kind: Some(event::Kind::UserMessage(UserMessage { text: text.into() })),
        }
    }

    /// A log in `dir` holding session `s`'s events 7, 8, 9 (texts of several sizes) with a
    /// lease record and another session's event between them: the events, the log's reader
    /// and the positions of `s`'s events.
    fn stored(dir: &std::path::Path) -> (Vec<Event>, Arc<LogReader>, Vec<Position>) {
        let ours = vec![
            event("s", 7, "short"),
            event("s", 8, &"a longer text ".repeat(40)),
            event("s", 9, ""),
        ];
        let records = [
            Record::Event(ours[0].clone()),
            Record::Lease(LeaseRecord {
                session_id: "s".into(),
                owner: "runner".into(),
                epoch: 3,
                ..Default::default()
            }),
            Record::Event(ours[1].clone()),
            Record::Event(event("other", 8, "not ours")),
            Record::Event(ours[2].clone()),
        ];
        let storage = Arc::new(FsStorage::open_dir(dir).unwrap());
        let mut log = LogWriter::open(storage, LogConfig::default(), 0, |_| {}).unwrap();
        let positions = log
            .write(records.iter().map(|r| (r, false)))
            .unwrap()
            .into_iter()
            .enumerate()
            .filter(|(i, _)| [0, 2, 4].contains(i))
            .map(|(_, p)| p)
            .collect();
        (ours, log.reader(), positions)
    }

    /// The events at `positions` framed, as a subscription reads them.
    fn framed(
        log: &LogReader,
        positions: &[Position],
        session_id: &str,
        first_seq: u64,
    ) -> Result<(Vec<u8>, usize), StoreError> {
        let (mut bytes, mut count) = (Vec::new(), 0);
        let mut seq = first_seq;
        log.read_runs(positions, |run| {
            let n = run.records.len() as u64;
            let framed = FramedEvents::from_stored(run, session_id, seq)?;
            assert_eq!(framed.decode()?.len(), framed.len());
            bytes.extend_from_slice(&framed.bytes);
            count += framed.len();
            seq += n;
            Ok::<_, StoreError>(())
        })?;
        Ok((bytes, count))
    }

    #[test]
    fn stored_events_go_out_as_one_grpc_message_each() {
        let dir = tempfile::tempdir().unwrap();
        let (events, log, positions) = stored(dir.path());
        // Each message: flag 0 (uncompressed), its length, the event's own encoding.
        let mut expected = Vec::new();
        for event in &events {
            expected.push(0);
            expected.extend_from_slice(&(event.encoded_len() as u32).to_be_bytes());
            expected.extend_from_slice(&event.encode_to_vec());
        }
        // Read again and again: the buffers a read leaves behind are used for the next.
        for _ in 0..3 {
            assert_eq!(framed(&log, &positions, "s", 7), Ok((expected.clone(), 3)));
        }
        // Events in memory go out in the same form.
        assert_eq!(encode(&events), expected);
    }

    #[test]
    fn a_damaged_or_misplaced_record_is_never_framed() {
        let dir = tempfile::tempdir().unwrap();
        let (_, log, positions) = stored(dir.path());
        let segment = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(dir.path().join(format!("{:020}.seg", 0)))
            .unwrap();
        for p in &positions {
            for at in p.offset..p.offset + u64::from(p.len) {
                let mut byte = [0];
                segment.read_exact_at(&mut byte, at).unwrap();
                segment.write_all_at(&[byte[0] ^ 0x04], at).unwrap();
                assert!(
                    framed(&log, &positions, "s", 7).is_err(),
                    "a flipped bit at offset {at} went unnoticed"
                );
                segment.write_all_at(&byte, at).unwrap();
            }
        }
        assert!(framed(&log, &positions, "s", 7).is_ok(), "all restored");
        assert!(framed(&log, &positions, "s", 6).is_err(), "seqs shifted");
        assert!(framed(&log, &positions, "t", 7).is_err(), "another session");
        let lease = Position {
            offset: positions[0].offset + u64::from(positions[0].len),
            len: (positions[1].offset - positions[0].offset) as u32 - positions[0].len,
        };
        assert!(
            framed(&log, &[positions[0], lease], "s", 7).is_err(),
            "a lease record"
        );
    }
}
