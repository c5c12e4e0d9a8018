//! The record frame: `[len: u32 LE][crc32c: u32 LE][body: len bytes]`, where the body is a
//! kind byte and a protobuf payload and the CRC covers the body. A torn write or a flipped
//! bit fails the CRC (or the length check) and ends the valid log there.

use agentlog_proto::v1::Event;
use bytes::Bytes;
use prost::Message;

pub const HEADER_LEN: usize = 8;
/// No valid record is larger: an event is at most 1 MiB, plus its envelope.
pub const MAX_BODY_LEN: usize = 4 << 20;

const KIND_EVENT: u8 = 1;
const KIND_LEASE: u8 = 2;
/// Set on every record of a multi-record append but its last: recovery keeps an append
/// only if its last record survived, so an append is all or nothing even when power is
/// cut in the middle of its write.
const CONTINUED: u8 = 0x80;

/// What the log holds: session events, and lease grants (so a lease epoch is durable before
/// it is handed out and never repeats, even across crashes).
#[derive(Clone, Debug, PartialEq)]
pub enum Record {
    Event(Event),
    Lease(LeaseRecord),
}

/// A lease grant, renewal or release for one session.
#[derive(Clone, PartialEq, Message)]
pub struct LeaseRecord {
    #[prost(string, tag = "1")]
    pub session_id: String,
    #[prost(string, tag = "2")]
    pub owner: String,
    #[prost(uint64, tag = "3")]
    pub epoch: u64,
    #[prost(int64, tag = "4")]
    pub expires_unix_ms: i64,
    #[prost(bool, tag = "5")]
    pub released: bool,
}

impl Record {
    pub fn session_id(&self) -> &str {
        match self {
            Record::Event(e) => &e.session_id,
            Record::Lease(l) => &l.session_id,
        }
    }

    /// Appends the framed record to `buf` and returns its total length (header included).
    /// `continued`: the next record belongs to the same atomic append.
    pub fn encode_into(&self, buf: &mut Vec<u8>, continued: bool) -> usize {
        let start = buf.len();
        let flag = if continued { CONTINUED } else { 0 };
        buf.extend_from_slice(&[0; HEADER_LEN]);
        match self {
            Record::Event(e) => {
                buf.push(KIND_EVENT | flag);
                e.encode(buf).expect("Vec grows as needed");
            }
            Record::Lease(l) => {
                buf.push(KIND_LEASE | flag);
                l.encode(buf).expect("Vec grows as needed");
            }
        }
        let body_len = buf.len() - start - HEADER_LEN;
        let crc = crc32c::crc32c(&buf[start + HEADER_LEN..]);
        buf[start..start + 4].copy_from_slice(&(body_len as u32).to_le_bytes());
        buf[start + 4..start + 8].copy_from_slice(&crc.to_le_bytes());
        buf.len() - start
    }
}

/// Why bytes are not a valid record.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum FrameError {
    #[error("the record is cut short")]
    Truncated,
    #[error("record length {0} is out of range")]
    BadLength(usize),
    #[error("checksum mismatch")]
    Checksum,
    #[error("undecodable body: {0}")]
    Body(String),
    #[error("an append whose last record is missing")]
    IncompleteAppend,
}

/// A decoded record and whether the next record belongs to the same append.
#[derive(Debug, PartialEq)]
pub struct Frame {
    pub record: Record,
    pub continued: bool,
}

/// Reads the body length from a header, checking its range.
pub fn body_len(header: &[u8]) -> Result<usize, FrameError> {
    let header: [u8; HEADER_LEN] = header
        .get(..HEADER_LEN)
        .and_then(|h| h.try_into().ok())
        .ok_or(FrameError::Truncated)?;
    let len = u32::from_le_bytes([header[0], header[1], header[2], header[3]]) as usize;
    if len == 0 || len > MAX_BODY_LEN {
        return Err(FrameError::BadLength(len));
    }
    Ok(len)
}

/// Decodes one framed record (header and body) and verifies its checksum.
pub fn decode(frame: &[u8]) -> Result<Frame, FrameError> {
    let len = body_len(frame)?;
    let body = frame
        .get(HEADER_LEN..HEADER_LEN + len)
        .ok_or(FrameError::Truncated)?;
    let crc = u32::from_le_bytes([frame[4], frame[5], frame[6], frame[7]]);
    if crc32c::crc32c(body) != crc {
        return Err(FrameError::Checksum);
    }
    let payload = &body[1..];
    let bad = |e: prost::DecodeError| FrameError::Body(e.to_string());
    let record = match body[0] & !CONTINUED {
        KIND_EVENT => Record::Event(Event::decode(payload).map_err(bad)?),
        KIND_LEASE => Record::Lease(LeaseRecord::decode(payload).map_err(bad)?),
        other => return Err(FrameError::Body(format!("unknown record kind {other}"))),
    };
    Ok(Frame {
        record,
        continued: body[0] & CONTINUED != 0,
    })
}

/// An event record's body as it is on disk: the protobuf encoding of its [`Event`],
/// checksum verified, with the session and seq it names read without decoding the rest.
/// Subscribe sends these bytes as they are.
#[derive(Clone, Debug)]
pub struct EncodedEvent {
    pub session_id: Bytes,
    pub seq: u64,
    /// One whole `Event` message.
    pub bytes: Bytes,
}

/// The fields of an encoded [`Event`] that place it; decoding skips the others.
#[derive(Clone, PartialEq, Message)]
struct EventPlace {
    #[prost(bytes = "bytes", tag = "1")]
    session_id: Bytes,
    #[prost(uint64, tag = "2")]
    seq: u64,
}

impl EncodedEvent {
    /// Verifies one framed record (header and body), which must be an event.
    pub fn from_frame(frame: &Bytes) -> Result<EncodedEvent, FrameError> {
        let len = body_len(frame)?;
        let body = frame
            .get(HEADER_LEN..HEADER_LEN + len)
            .ok_or(FrameError::Truncated)?;
        let crc = u32::from_le_bytes([frame[4], frame[5], frame[6], frame[7]]);
        if crc32c::crc32c(body) != crc {
            return Err(FrameError::Checksum);
        }
        if body[0] & !CONTINUED != KIND_EVENT {
            return Err(FrameError::Body(format!(
                "record kind {} where an event was expected",
                body[0] & !CONTINUED
            )));
        }
        let bytes = frame.slice(HEADER_LEN + 1..HEADER_LEN + len);
        let place =
            EventPlace::decode(bytes.clone()).map_err(|e| FrameError::Body(e.to_string()))?;
        Ok(EncodedEvent {
            session_id: place.session_id,
            seq: place.seq,
            bytes,
        })
    }

    /// The event itself.
    pub fn decode(&self) -> Result<Event, prost::DecodeError> {
        Event::decode(self.bytes.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentlog_proto::v1::{event, UserMessage};

    fn sample() -> Record {
        Record::Event(Event {
            session_id: "s1".into(),
            seq: 7,
            event_id: "e7".into(),
            ts_unix_ms: 1,
            schema_version: 1,
            kind: Some(event::Kind::UserMessage(UserMessage { text: "hi".into() })),
        })
    }

    #[test]
    fn round_trips() {
        for continued in [false, true] {
            let mut buf = Vec::new();
            let n = sample().encode_into(&mut buf, continued);
            assert_eq!(n, buf.len());
            assert_eq!(
                decode(&buf),
                Ok(Frame {
                    record: sample(),
                    continued
                })
            );
        }
    }

    #[test]
    fn any_flipped_bit_is_detected() {
        let mut buf = Vec::new();
        sample().encode_into(&mut buf, false);
        for i in 0..buf.len() {
            for bit in 0..8 {
                let mut bad = buf.clone();
                bad[i] ^= 1 << bit;
                assert!(
                    decode(&bad).is_err(),
                    "flip at byte {i} bit {bit} went unnoticed"
                );
            }
        }
    }

    #[test]
    fn any_cut_is_detected() {
        let mut buf = Vec::new();
        sample().encode_into(&mut buf, false);
        for cut in 0..buf.len() {
            assert!(decode(&buf[..cut]).is_err());
        }
    }

    #[test]
    fn an_encoded_event_is_the_event_message_and_is_verified() {
        let Record::Event(event) = sample() else {
            unreachable!("sample is an event")
        };
        for continued in [false, true] {
            let mut buf = Vec::new();
            sample().encode_into(&mut buf, continued);
            let encoded = EncodedEvent::from_frame(&Bytes::from(buf.clone())).expect("valid");
            assert_eq!((&encoded.session_id[..], encoded.seq), (&b"s1"[..], 7));
            assert_eq!(encoded.decode(), Ok(event.clone()));
            assert_eq!(encoded.bytes, event.encode_to_vec());
            for i in 0..buf.len() {
                let mut bad = buf.clone();
                bad[i] ^= 0x10;
                assert!(EncodedEvent::from_frame(&Bytes::from(bad)).is_err());
            }
        }
        let mut lease = Vec::new();
        Record::Lease(LeaseRecord::default()).encode_into(&mut lease, false);
        assert!(EncodedEvent::from_frame(&Bytes::from(lease)).is_err());
    }
}
