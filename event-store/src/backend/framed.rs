//! Events in their wire form: consecutive gRPC messages, each an `Event`, uncompressed, as
//! Subscribe sends them. A backend that reads its events already encoded (the local log)
//! hands a run out in this form, so that the edge sends the bytes it read as they are,
//! without a decode and a re-encode per event.

use agentlog_proto::kept::{renamed_into, KeptEvent};
use agentlog_proto::v1::Event;
use bytes::{BufMut, Bytes, BytesMut};
use prost::Message;

use crate::StoreError;

/// A gRPC message's header: the compressed flag (always 0 here) and the length, big-endian.
pub const MESSAGE_HEADER_LEN: usize = 5;

/// Events as Subscribe sends them: consecutive gRPC messages, each an `Event`, uncompressed.
#[derive(Clone, Debug)]
pub struct FramedEvents {
    bytes: Bytes,
    count: usize,
}

impl FramedEvents {
    /// `bytes` must be `count` whole gRPC messages, each an encoded `Event`.
    pub(crate) fn new(bytes: Bytes, count: usize) -> FramedEvents {
        FramedEvents { bytes, count }
    }

    /// Events in memory, encoded into the same form (each as it was kept).
    pub fn encode(events: &[KeptEvent]) -> FramedEvents {
        let len = events
            .iter()
            .map(|e| MESSAGE_HEADER_LEN + e.encoded_len())
            .sum();
        let mut buf = BytesMut::with_capacity(len);
        for event in events {
            buf.put_u8(0);
            buf.put_u32(event.encoded_len() as u32);
            event.encode(&mut buf);
        }
        FramedEvents::new(buf.freeze(), events.len())
    }

    /// Stored `Event` messages, each as it was stored; one read through another session (a
    /// fork's prefix, read through its base) is given `session_id` as in [`Self::renamed`].
    pub fn of_messages<'a>(
        messages: impl IntoIterator<Item = (&'a [u8], bool)>,
        session_id: &str,
    ) -> FramedEvents {
        let mut buf = Vec::new();
        let mut count = 0;
        for (message, renamed) in messages {
            if renamed {
                push_renamed(&mut buf, message, session_id);
            } else {
                buf.push(0);
                buf.extend_from_slice(&(message.len() as u32).to_be_bytes());
                buf.extend_from_slice(message);
            }
            count += 1;
        }
        FramedEvents::new(buf.into(), count)
    }

    /// How many events.
    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// The bytes, as they go on the wire.
    pub fn into_bytes(self) -> Bytes {
        self.bytes
    }

    /// Each event's encoded `Event` message, in order (slices of the run's buffer).
    pub fn messages(&self) -> impl Iterator<Item = Result<Bytes, StoreError>> + '_ {
        let mut at = 0;
        std::iter::from_fn(move || {
            if at >= self.bytes.len() {
                return None;
            }
            let cut = || StoreError::Internal("a stored event is undecodable: cut short".into());
            let Some(header) = self.bytes.get(at..at + MESSAGE_HEADER_LEN) else {
                at = self.bytes.len();
                return Some(Err(cut()));
            };
            let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
            let start = at + MESSAGE_HEADER_LEN;
            if start + len > self.bytes.len() {
                at = self.bytes.len();
                return Some(Err(cut()));
            }
            at = start + len;
            Some(Ok(self.bytes.slice(start..start + len)))
        })
    }

    /// The same events as another session's (a fork's, read through its base): each
    /// message with its field 1 replaced by `session_id`, byte for byte otherwise.
    pub(crate) fn renamed(&self, session_id: &str) -> FramedEvents {
        let mut buf = Vec::with_capacity(self.bytes.len() + self.count * (session_id.len() + 2));
        let mut rest = &self.bytes[..];
        while rest.len() >= MESSAGE_HEADER_LEN {
            let len = u32::from_be_bytes([rest[1], rest[2], rest[3], rest[4]]) as usize;
            let Some(message) = rest.get(MESSAGE_HEADER_LEN..MESSAGE_HEADER_LEN + len) else {
                break;
            };
            push_renamed(&mut buf, message, session_id);
            rest = &rest[MESSAGE_HEADER_LEN + len..];
        }
        FramedEvents::new(buf.into(), self.count)
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

/// Appends `message` as one gRPC message, renamed to `session_id`'s.
fn push_renamed(buf: &mut Vec<u8>, message: &[u8], session_id: &str) {
    let header = buf.len();
    buf.extend_from_slice(&[0; MESSAGE_HEADER_LEN]);
    renamed_into(message, session_id, buf);
    let len = (buf.len() - header - MESSAGE_HEADER_LEN) as u32;
    buf[header + 1..header + MESSAGE_HEADER_LEN].copy_from_slice(&len.to_be_bytes());
}
