//! The record frame: `[len: u32 LE][crc32c: u32 LE][body: len bytes]`, where the body is a
//! kind byte and a protobuf payload and the CRC covers the body. A torn write or a flipped
//! bit fails the CRC (or the length check) and ends the valid log there.

use std::sync::Arc;

use agentlog_proto::kept::{renamed_into, KeptEvent};
use agentlog_proto::v1::{event, AssistantDelta, Event, UserMessage};
use bytes::Bytes;
use prost::Message;

use crate::session::{ForkRecord, LeaseRecord};

pub const HEADER_LEN: usize = 8;
/// No valid record is larger: an event is at most 1 MiB, plus its envelope.
pub const MAX_BODY_LEN: usize = 4 << 20;

const KIND_EVENT: u8 = 1;
const KIND_LEASE: u8 = 2;
const KIND_TOMBSTONE: u8 = 3;
const KIND_FORK: u8 = 4;
/// An event of a fork's shared prefix made the fork's own ([`Record::Placed`]).
const KIND_PLACED: u8 = 5;
/// A session pinned or unpinned ([`Record::Pin`]).
const KIND_PIN: u8 = 6;
/// Set on every record of a multi-record append but its last: recovery keeps an append
/// only if its last record survived, so an append is all or nothing even when power is
/// cut in the middle of its write.
const CONTINUED: u8 = 0x80;

/// What the log holds: session events, lease grants (so a lease epoch is durable before
/// it is handed out and never repeats, even across crashes), the start of a fork (the
/// first record of its atomic append, carrying its state at the fork point), the events of
/// a fork's shared prefix once they are made its own, and the tombstones of deleted
/// sessions (kept for good: the segment rewrite drops a deleted session's other records,
/// never its tombstone).
#[derive(Clone, Debug, PartialEq)]
pub enum Record {
    /// An event, kept as its writer encoded it (a field this build does not know included).
    Event(KeptEvent),
    Lease(LeaseRecord),
    Fork(ForkRecord),
    /// Seq `seq` of a fork whose prefix was read through its parent, made the fork's own
    /// (before the parent's records leave the log, see `reclaim`): the event as the parent
    /// stored it, with the fork's session id. It places the event at its seq; it is no
    /// append (the fork's state and last seq do not change, and the last of a
    /// materialization's records drops the fork's base).
    Placed(CopiedEvent),
    Tombstone(Tombstone),
    /// The session was pinned or unpinned (`PinSession`): a change of its state alone.
    Pin(PinRecord),
}

/// The session's `pinned` from here on.
#[derive(Clone, PartialEq, Message)]
pub struct PinRecord {
    #[prost(string, tag = "1")]
    pub session_id: String,
    #[prost(bool, tag = "2")]
    pub pinned: bool,
}

/// The session was deleted: everything before this record about it is dead.
#[derive(Clone, PartialEq, Message)]
pub struct Tombstone {
    #[prost(string, tag = "1")]
    pub session_id: String,
    #[prost(int64, tag = "2")]
    pub deleted_unix_ms: i64,
}

/// An event placed into a fork as its parent stored it: the stored `Event` message with its
/// field 1 replaced by the fork's session id, every other byte as it was, so the record
/// decodes (and [`StoredEvent`] reads) as an event of the fork, its id, time and content the
/// parent's, without a decode and an encode per event. (Logs of release 0.1.0 hold the
/// parent's message with the fork's id as field 1 once more after it, which a decoder
/// takes over the first: they read the same.)
#[derive(Clone, Debug, PartialEq)]
pub struct CopiedEvent {
    pub session_id: Arc<str>,
    pub seq: u64,
    pub event_id: String,
    /// The parent's stored `Event` message.
    pub message: Bytes,
}

impl CopiedEvent {
    /// The event itself, decoded (for live followers of the fork).
    pub fn decode(&self) -> Result<Event, prost::DecodeError> {
        let mut event = Event::decode(&self.message[..])?;
        event.session_id = self.session_id.to_string();
        Ok(event)
    }
}

impl Record {
    pub fn session_id(&self) -> &str {
        match self {
            Record::Event(e) => &e.session_id,
            Record::Lease(l) => &l.session_id,
            Record::Fork(f) => &f.session_id,
            Record::Placed(c) => &c.session_id,
            Record::Tombstone(t) => &t.session_id,
            Record::Pin(p) => &p.session_id,
        }
    }

    /// An event record's session, seq and event id.
    pub fn event_place(&self) -> Option<(&str, u64, &str)> {
        match self {
            Record::Event(e) => Some((&e.session_id, e.seq, &e.event_id)),
            Record::Placed(c) => Some((&c.session_id, c.seq, &c.event_id)),
            Record::Lease(_) | Record::Fork(_) | Record::Tombstone(_) | Record::Pin(_) => None,
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
                e.encode(buf);
            }
            Record::Lease(l) => {
                buf.push(KIND_LEASE | flag);
                l.encode(buf).expect("Vec grows as needed");
            }
            Record::Fork(f) => {
                buf.push(KIND_FORK | flag);
                f.encode(buf).expect("Vec grows as needed");
            }
            Record::Placed(c) => {
                buf.push(KIND_PLACED | flag);
                renamed_into(&c.message, &c.session_id, buf);
            }
            Record::Tombstone(t) => {
                buf.push(KIND_TOMBSTONE | flag);
                t.encode(buf).expect("Vec grows as needed");
            }
            Record::Pin(p) => {
                buf.push(KIND_PIN | flag);
                p.encode(buf).expect("Vec grows as needed");
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
        KIND_EVENT => {
            Record::Event(KeptEvent::from_wire(Bytes::copy_from_slice(payload)).map_err(bad)?)
        }
        KIND_LEASE => Record::Lease(LeaseRecord::decode(payload).map_err(bad)?),
        KIND_FORK => Record::Fork(ForkRecord::decode(payload).map_err(bad)?),
        KIND_TOMBSTONE => Record::Tombstone(Tombstone::decode(payload).map_err(bad)?),
        KIND_PIN => Record::Pin(PinRecord::decode(payload).map_err(bad)?),
        KIND_PLACED => {
            let event = Event::decode(payload).map_err(bad)?;
            Record::Placed(CopiedEvent {
                session_id: event.session_id.as_str().into(),
                seq: event.seq,
                event_id: event.event_id,
                message: Bytes::copy_from_slice(payload),
            })
        }
        other => return Err(FrameError::Body(format!("unknown record kind {other}"))),
    };
    Ok(Frame {
        record,
        continued: body[0] & CONTINUED != 0,
    })
}

/// The session a framed record (header and body) belongs to, checksum verified, and
/// whether it is a tombstone (kept for good). Reads the session id without decoding the
/// rest: it is field 1 of every record kind's message, and of an event copied into a fork
/// the last field 1 (the fork's), as a decode would take it.
pub fn session_of(frame: &[u8]) -> Result<(&[u8], bool), FrameError> {
    let len = body_len(frame)?;
    let body = frame
        .get(HEADER_LEN..HEADER_LEN + len)
        .ok_or(FrameError::Truncated)?;
    let crc = u32::from_le_bytes([frame[4], frame[5], frame[6], frame[7]]);
    if crc32c::crc32c(body) != crc {
        return Err(FrameError::Checksum);
    }
    let kind = body[0] & !CONTINUED;
    if !matches!(
        kind,
        KIND_EVENT | KIND_LEASE | KIND_FORK | KIND_TOMBSTONE | KIND_PLACED | KIND_PIN
    ) {
        return Err(FrameError::Body(format!("unknown record kind {kind}")));
    }
    let (session_id, _) = place(&body[1..], matches!(kind, KIND_EVENT | KIND_PLACED))?;
    Ok((session_id, kind == KIND_TOMBSTONE))
}

/// An event record as it is on disk, checksum verified: where in its frame its body's
/// protobuf `Event` message is, and the session and seq that message names, read without
/// decoding the rest. Subscribe sends the message as it is.
#[derive(Debug, PartialEq)]
pub struct StoredEvent<'a> {
    pub session_id: &'a [u8],
    pub seq: u64,
    /// The whole `Event` message: `frame[message]`.
    pub message: std::ops::Range<usize>,
}

impl StoredEvent<'_> {
    /// Verifies one framed record (header and body), which must be an event.
    pub fn from_frame(frame: &[u8]) -> Result<StoredEvent<'_>, FrameError> {
        let len = body_len(frame)?;
        let body = frame
            .get(HEADER_LEN..HEADER_LEN + len)
            .ok_or(FrameError::Truncated)?;
        let crc = u32::from_le_bytes([frame[4], frame[5], frame[6], frame[7]]);
        if crc32c::crc32c(body) != crc {
            return Err(FrameError::Checksum);
        }
        if !matches!(body[0] & !CONTINUED, KIND_EVENT | KIND_PLACED) {
            return Err(FrameError::Body(format!(
                "record kind {} where an event was expected",
                body[0] & !CONTINUED
            )));
        }
        let message = HEADER_LEN + 1..HEADER_LEN + len;
        let (session_id, seq) = event_place(&frame[message.clone()])?;
        Ok(StoredEvent {
            session_id,
            seq,
            message,
        })
    }
}

/// The `session_id` (field 1) and `seq` (field 2) of an encoded `Event`, as a decode of the
/// whole message would give them (the last occurrence of a field wins); every other field
/// is only stepped over.
fn event_place(message: &[u8]) -> Result<(&[u8], u64), FrameError> {
    place(message, true)
}

/// The `session_id` (field 1) of a record's message, whatever its kind; `with_seq`: field 2
/// is an event's seq, read too.
fn place(mut message: &[u8], with_seq: bool) -> Result<(&[u8], u64), FrameError> {
    const SESSION_ID: u64 = 1;
    let seq_field = if with_seq { 2 } else { 0 };
    let bad = |what: &str| FrameError::Body(format!("undecodable event: {what}"));
    let (mut session_id, mut seq) = (&message[..0], 0);
    while !message.is_empty() {
        let key = varint(&mut message).ok_or_else(|| bad("a field key"))?;
        let (field, wire_type) = (key >> 3, key & 7);
        if field == 0
            || (field == SESSION_ID && wire_type != 2)
            || (field == seq_field && wire_type != 0)
        {
            return Err(bad(&format!("field {field} of wire type {wire_type}")));
        }
        match wire_type {
            // varint
            0 => {
                let value = varint(&mut message).ok_or_else(|| bad("a varint"))?;
                if field == seq_field {
                    seq = value;
                }
            }
            // 64-bit, 32-bit
            1 | 5 => {
                let n = if wire_type == 1 { 8 } else { 4 };
                message = message.get(n..).ok_or_else(|| bad("a fixed-size field"))?;
            }
            // length-delimited
            2 => {
                let len = varint(&mut message).ok_or_else(|| bad("a length"))?;
                let len = usize::try_from(len).map_err(|_| bad("a length"))?;
                if len > message.len() {
                    return Err(bad("a field past the end"));
                }
                let (value, rest) = message.split_at(len);
                if field == SESSION_ID {
                    session_id = value;
                }
                message = rest;
            }
            _ => return Err(bad(&format!("wire type {wire_type}"))),
        }
    }
    Ok((session_id, seq))
}

/// What a stored `Event` message says that a session's state needs ([`SessionMeta`]'s
/// rules): its seq, event id, time and kind, decoding only what the kind requires. A user
/// message's text is read only if `want_text`, and a streamed delta's never; any other kind
/// is decoded whole.
///
/// [`SessionMeta`]: crate::session::SessionMeta
pub fn event_for_state(message: &[u8], want_text: bool) -> Result<Event, FrameError> {
    const USER_MESSAGE: u64 = 10;
    const ASSISTANT_DELTA: u64 = 14;
    let bad = |what: &str| FrameError::Body(format!("undecodable event: {what}"));
    let mut event = Event::default();
    let mut rest = message;
    while !rest.is_empty() {
        let key = varint(&mut rest).ok_or_else(|| bad("a field key"))?;
        let (field, wire_type) = (key >> 3, key & 7);
        match wire_type {
            0 => {
                let value = varint(&mut rest).ok_or_else(|| bad("a varint"))?;
                match field {
                    2 => event.seq = value,
                    4 => event.ts_unix_ms = value as i64,
                    5 => event.schema_version = value as u32,
                    _ => {}
                }
            }
            1 | 5 => {
                let n = if wire_type == 1 { 8 } else { 4 };
                rest = rest.get(n..).ok_or_else(|| bad("a fixed-size field"))?;
            }
            2 => {
                let len = varint(&mut rest).ok_or_else(|| bad("a length"))?;
                let len = usize::try_from(len).map_err(|_| bad("a length"))?;
                if len > rest.len() {
                    return Err(bad("a field past the end"));
                }
                let (value, after) = rest.split_at(len);
                match field {
                    3 => {
                        event.event_id = String::from_utf8(value.to_vec())
                            .map_err(|_| bad("an event id that is not UTF-8"))?
                    }
                    USER_MESSAGE if want_text => {
                        let m = UserMessage::decode(value).map_err(|e| bad(&e.to_string()))?;
                        event.kind = Some(event::Kind::UserMessage(m));
                    }
                    USER_MESSAGE => {
                        event.kind = Some(event::Kind::UserMessage(UserMessage::default()))
                    }
                    ASSISTANT_DELTA => {
                        event.kind = Some(event::Kind::AssistantDelta(AssistantDelta::default()))
                    }
                    // Every other kind the state reads (a session_config's, 20, it does not).
                    11..=19 | 21 | 22 => {
                        let whole = Event::decode(message).map_err(|e| bad(&e.to_string()))?;
                        return Ok(whole);
                    }
                    _ => {}
                }
                rest = after;
            }
            _ => return Err(bad(&format!("wire type {wire_type}"))),
        }
    }
    Ok(event)
}

/// Takes one base-128 varint off the front of `bytes`.
fn varint(bytes: &mut &[u8]) -> Option<u64> {
    let mut value = 0u64;
    for (i, &byte) in bytes.iter().enumerate().take(10) {
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            *bytes = &bytes[i + 1..];
            return Some(value);
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentlog_proto::v1::{event, UserMessage};

    fn sample() -> Record {
        Record::Event(
            Event {
                session_id: "s1".into(),
                seq: 7,
                event_id: "e7".into(),
                ts_unix_ms: 1,
                schema_version: 1,
                kind: Some(event::Kind::UserMessage(UserMessage { text: "hi".into() })),
            }
            .into(),
        )
    }

    #[test]
    fn round_trips() {
        let fork = Record::Fork(ForkRecord {
            session_id: "f".into(),
            parent: "s1".into(),
            seq: 7,
            ts_unix_ms: 9,
            state: Some(crate::session::SessionMeta {
                last_seq: 7,
                base_session: "s1".into(),
                base_seq: 7,
                ..Default::default()
            }),
        });
        let tombstone = Record::Tombstone(Tombstone {
            session_id: "s1".into(),
            deleted_unix_ms: 1_700_000_000_000,
        });
        let pin = Record::Pin(PinRecord {
            session_id: "s1".into(),
            pinned: true,
        });
        for record in [sample(), fork, tombstone, pin] {
            for continued in [false, true] {
                let mut buf = Vec::new();
                let n = record.encode_into(&mut buf, continued);
                assert_eq!(n, buf.len());
                assert_eq!(
                    decode(&buf),
                    Ok(Frame {
                        record: record.clone(),
                        continued
                    })
                );
            }
        }
    }

    #[test]
    fn a_placed_event_reads_back_as_the_forks_whole() {
        let Record::Event(original) = sample() else {
            unreachable!()
        };
        let copied = Record::Placed(CopiedEvent {
            session_id: "fork-1".into(),
            seq: original.seq,
            event_id: original.event_id.clone(),
            message: Bytes::from(original.encode_to_vec()),
        });
        let mut buf = Vec::new();
        copied.encode_into(&mut buf, false);
        let expected = Event {
            session_id: "fork-1".into(),
            ..original.event().clone()
        };
        let Ok(Frame {
            record: Record::Placed(placed),
            ..
        }) = decode(&buf)
        else {
            panic!("a placed event decodes as one")
        };
        assert_eq!(placed.decode(), Ok(expected));
        assert_eq!((placed.seq, placed.event_id.as_str()), (7, "e7"));
        let stored = StoredEvent::from_frame(&buf).expect("an event");
        assert_eq!((stored.session_id, stored.seq), (&b"fork-1"[..], 7));
        let message = &original.encode_to_vec();
        let state = event_for_state(message, false).expect("decodes");
        assert_eq!(
            (state.seq, state.event_id.as_str(), state.ts_unix_ms),
            (7, "e7", 1)
        );
        assert!(matches!(state.kind, Some(event::Kind::UserMessage(ref m)) if m.text.is_empty()));
        let with_text = event_for_state(message, true).expect("decodes");
        assert_eq!(
            with_text,
            Event {
                session_id: String::new(),
                ..original.into_event()
            }
        );
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
    fn a_stored_event_is_the_event_message_and_is_verified() {
        let Record::Event(event) = sample() else {
            unreachable!("sample is an event")
        };
        for continued in [false, true] {
            let mut buf = Vec::new();
            sample().encode_into(&mut buf, continued);
            let stored = StoredEvent::from_frame(&buf).expect("valid");
            assert_eq!((stored.session_id, stored.seq), (&b"s1"[..], 7));
            assert_eq!(&buf[stored.message.clone()], &event.encode_to_vec()[..]);
            for i in 0..buf.len() {
                let mut bad = buf.clone();
                bad[i] ^= 0x10;
                assert!(StoredEvent::from_frame(&bad).is_err());
            }
        }
        let mut lease = Vec::new();
        Record::Lease(LeaseRecord::default()).encode_into(&mut lease, false);
        assert!(StoredEvent::from_frame(&lease).is_err());
    }

    proptest::proptest! {
        /// The session and seq read without decoding are those of the event, whatever
        /// its other fields hold (the kind's text among them).
        #[test]
        fn the_place_of_a_stored_event_is_the_events(
            session_id in "[a-z0-9-]{0,40}",
            seq in proptest::prelude::any::<u64>(),
            event_id in ".{0,20}",
            ts_unix_ms in proptest::prelude::any::<i64>(),
            text in ".{0,300}",
        ) {
            let event = Event {
                session_id: session_id.clone(),
                seq,
                event_id,
                ts_unix_ms,
                schema_version: 1,
                kind: Some(event::Kind::UserMessage(UserMessage { text })),
            };
            let mut buf = Vec::new();
            Record::Event(event.clone().into()).encode_into(&mut buf, false);
            let stored = StoredEvent::from_frame(&buf).expect("valid");
            proptest::prop_assert_eq!(stored.session_id, session_id.as_bytes());
            proptest::prop_assert_eq!(stored.seq, seq);
            proptest::prop_assert_eq!(
                Event::decode(&buf[stored.message]).expect("decodes"),
                event
            );
        }
    }
}
