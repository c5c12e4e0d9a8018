//! Events kept as their writer encoded them. A store built from this tree must neither drop
//! nor reorder what a newer writer sent (a field it does not know, on the `Event` or inside
//! a kind it knows), so it does not decode an appended event and encode it again: it keeps
//! the event's bytes, apart from the five fields it sets itself (`session_id`, `seq`,
//! `event_id`, `ts_unix_ms`, `schema_version`), and decodes them only to decide by.
//!
//! [`KeptEvent::encode`] writes those five fields as prost writes them, then the kept
//! bytes as they came: an event a prost writer encoded is stored exactly as prost would
//! have encoded it, and any other exactly as appended apart from the store's fields.
//!
//! The server decodes the requests that carry events into [`KeptAppendRequest`] and
//! [`KeptForkRequest`] (the generated `EventStore` server is given these types): each
//! event's bytes are a slice of the request's buffer, not a copy.

use std::ops::Deref;

use bytes::{Buf, BufMut, Bytes};
use prost::encoding::{self, DecodeContext, WireType};
use prost::{DecodeError, Message};

use crate::fields::{fields, put_len_field, WireError};
use crate::unknown::{splice, Unknown};
use crate::v1::{AppendRequest, Event, ForkSessionRequest};

/// `Event`'s fields that the store sets, and the numbers its kinds may take.
const STORE_SET: [u32; 5] = [1, 2, 3, 4, 5];
/// The field numbers of `Event` that are kinds (members of its `oneof`), known or not.
pub const KIND_NUMBERS: std::ops::RangeInclusive<u32> = 10..=999;

/// An event on its way into a log: its fields decoded, to decide by, and the bytes of all
/// but the store's five, to store.
#[derive(Debug, Clone, PartialEq)]
pub struct KeptEvent {
    event: Event,
    /// Every field but the store's five, as the writer encoded them.
    rest: Bytes,
}

impl KeptEvent {
    /// An event as a writer encoded it.
    pub fn from_wire(message: Bytes) -> Result<KeptEvent, DecodeError> {
        let event = Event::decode(message.clone())?;
        // prost has walked the same fields already, so this walk cannot fail where prost
        // did not; should it, the event is refused rather than stored in part.
        #[allow(deprecated)]
        let rest = without_store_fields(message)
            .map_err(|e| DecodeError::new(format!("an event's bytes: {e}")))?;
        Ok(KeptEvent { event, rest })
    }

    /// An event this build made (or read back from a format that names its fields), with
    /// `unknown`'s fields put back after the ones it knows.
    pub fn from_event(event: Event, unknown: &Unknown) -> Result<KeptEvent, WireError> {
        let kind_only = Event {
            kind: event.kind.clone(),
            ..Event::default()
        }
        .encode_to_vec();
        let rest = if unknown.is_empty() {
            kind_only
        } else {
            splice(&kind_only, unknown)?
        };
        Ok(KeptEvent {
            event,
            rest: rest.into(),
        })
    }

    /// An event this build made, with nothing it does not know.
    pub fn new(event: Event) -> KeptEvent {
        KeptEvent::from_event(event, &Unknown::default())
            .expect("nothing unknown is spliced in without error")
    }

    /// The decoded event.
    pub fn event(&self) -> &Event {
        &self.event
    }

    pub fn into_event(self) -> Event {
        self.event
    }

    /// The number of a kind this build does not know, when the event has no kind it knows:
    /// the kind a newer writer gave it.
    pub fn unknown_kind(&self) -> Option<u32> {
        if self.event.kind.is_some() {
            return None;
        }
        fields(&self.rest)
            .filter_map(Result::ok)
            .map(|f| f.number)
            .find(|n| KIND_NUMBERS.contains(n))
    }

    /// The fields the store sets: where the event is (its session and seq), its id, when
    /// it was appended and the schema it was written under.
    pub fn place(&mut self, session_id: &str, seq: u64, ts_unix_ms: i64, schema_version: u32) {
        session_id.clone_into(&mut self.event.session_id);
        self.event.seq = seq;
        self.event.ts_unix_ms = ts_unix_ms;
        self.event.schema_version = schema_version;
    }

    /// The event id, for one the store makes.
    pub fn set_event_id(&mut self, event_id: String) {
        self.event.event_id = event_id;
    }

    /// The session id alone (a fork's or an import's events under their new session).
    pub fn set_session_id(&mut self, session_id: &str) {
        session_id.clone_into(&mut self.event.session_id);
    }

    /// The encoded event's length.
    pub fn encoded_len(&self) -> usize {
        let e = &self.event;
        let mut len = self.rest.len();
        if !e.session_id.is_empty() {
            len += encoding::string::encoded_len(1, &e.session_id);
        }
        if e.seq != 0 {
            len += encoding::uint64::encoded_len(2, &e.seq);
        }
        if !e.event_id.is_empty() {
            len += encoding::string::encoded_len(3, &e.event_id);
        }
        if e.ts_unix_ms != 0 {
            len += encoding::int64::encoded_len(4, &e.ts_unix_ms);
        }
        if e.schema_version != 0 {
            len += encoding::uint32::encoded_len(5, &e.schema_version);
        }
        len
    }

    /// Writes the encoded event: the store's five fields as prost writes them (field 1
    /// first, which the stores read without decoding), then the rest as it came.
    pub fn encode(&self, buf: &mut impl BufMut) {
        let e = &self.event;
        if !e.session_id.is_empty() {
            encoding::string::encode(1, &e.session_id, buf);
        }
        if e.seq != 0 {
            encoding::uint64::encode(2, &e.seq, buf);
        }
        if !e.event_id.is_empty() {
            encoding::string::encode(3, &e.event_id, buf);
        }
        if e.ts_unix_ms != 0 {
            encoding::int64::encode(4, &e.ts_unix_ms, buf);
        }
        if e.schema_version != 0 {
            encoding::uint32::encode(5, &e.schema_version, buf);
        }
        buf.put_slice(&self.rest);
    }

    pub fn encode_to_vec(&self) -> Vec<u8> {
        let mut buf = Vec::with_capacity(self.encoded_len());
        self.encode(&mut buf);
        buf
    }
}

impl From<Event> for KeptEvent {
    fn from(event: Event) -> KeptEvent {
        KeptEvent::new(event)
    }
}

impl Deref for KeptEvent {
    type Target = Event;

    fn deref(&self) -> &Event {
        &self.event
    }
}

/// Writes the encoded event `message` as an event of `session_id`: its field 1 replaced,
/// every other field as it was (a fork's or an import's event, stored under another
/// session). A message that does not walk is written as it is, then `session_id` as field
/// 1 once more, which a decoder takes over the first.
pub fn renamed_into(message: &[u8], session_id: &str, out: &mut Vec<u8>) {
    const SESSION_ID: u32 = 1;
    out.reserve(message.len() + session_id.len() + 2);
    let start = out.len();
    put_len_field(out, SESSION_ID, session_id.as_bytes());
    for field in fields(message) {
        match field {
            Ok(field) if field.number == SESSION_ID => {}
            Ok(field) => out.extend_from_slice(field.bytes),
            Err(_) => {
                out.truncate(start);
                out.extend_from_slice(message);
                put_len_field(out, SESSION_ID, session_id.as_bytes());
                return;
            }
        }
    }
}

/// `message` without the fields the store sets: a slice of it when they all come first (as
/// every encoder that writes fields in number order puts them), else the others joined.
fn without_store_fields(message: Bytes) -> Result<Bytes, WireError> {
    let mut first_other = None;
    let mut scattered = false;
    let mut at = 0;
    for field in fields(&message) {
        let field = field?;
        let own = STORE_SET.contains(&field.number);
        match first_other {
            None if !own => first_other = Some(at),
            Some(_) if own => scattered = true,
            _ => {}
        }
        at += field.bytes.len();
    }
    if !scattered {
        return Ok(message.slice(first_other.unwrap_or(message.len())..));
    }
    let mut rest = Vec::with_capacity(message.len());
    for field in fields(&message) {
        let field = field?;
        if !STORE_SET.contains(&field.number) {
            rest.extend_from_slice(field.bytes);
        }
    }
    Ok(rest.into())
}

/// A request that carries events in one repeated field.
pub trait CarriesEvents: Message + Default {
    /// The number of its `repeated Event` field.
    const EVENTS: u32;
}

impl CarriesEvents for AppendRequest {
    const EVENTS: u32 = 2;
}

impl CarriesEvents for ForkSessionRequest {
    const EVENTS: u32 = 4;
}

/// A request as the server decodes it: its events kept ([`KeptEvent`]), every other field
/// in `request` (whose own `events` stays empty).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Kept<R> {
    pub request: R,
    pub events: Vec<KeptEvent>,
}

/// `Append`'s and `AppendStream`'s request, as the server decodes it.
pub type KeptAppendRequest = Kept<AppendRequest>;
/// `ForkSession`'s request, as the server decodes it.
pub type KeptForkRequest = Kept<ForkSessionRequest>;

impl<R: CarriesEvents> Kept<R> {
    /// The request's encoded length, its events as they are kept.
    pub fn encoded_len(&self) -> usize {
        self.request.encoded_len()
            + self
                .events
                .iter()
                .map(|e| {
                    let len = e.encoded_len();
                    encoding::key_len(R::EVENTS) + encoding::encoded_len_varint(len as u64) + len
                })
                .sum::<usize>()
    }
}

impl<R: CarriesEvents> Message for Kept<R> {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        self.request.encode_raw(buf);
        for event in &self.events {
            encoding::encode_key(R::EVENTS, WireType::LengthDelimited, buf);
            encoding::encode_varint(event.encoded_len() as u64, buf);
            event.encode(buf);
        }
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        if tag != R::EVENTS {
            return self.request.merge_field(tag, wire_type, buf, ctx);
        }
        let mut message = Bytes::new();
        encoding::bytes::merge(wire_type, &mut message, buf, ctx)?;
        self.events.push(KeptEvent::from_wire(message)?);
        Ok(())
    }

    fn encoded_len(&self) -> usize {
        Kept::encoded_len(self)
    }

    fn clear(&mut self) {
        self.request.clear();
        self.events.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::unknown::{find, EVENT};
    use crate::v1::{event, UserMessage};

    fn user(text: &str) -> Event {
        Event {
            event_id: "e1".into(),
            kind: Some(event::Kind::UserMessage(UserMessage { text: text.into() })),
            ..Event::default()
        }
    }

    #[test]
    fn a_prost_encoded_event_is_stored_as_prost_would_encode_it() {
        let mut kept = KeptEvent::from_wire(user("hi").encode_to_vec().into()).unwrap();
        kept.place("s1", 7, 1_700_000_000_000, 1);
        let mut expected = user("hi");
        expected.session_id = "s1".into();
        expected.seq = 7;
        expected.ts_unix_ms = 1_700_000_000_000;
        expected.schema_version = 1;
        assert_eq!(kept.encode_to_vec(), expected.encode_to_vec());
        assert_eq!(kept.encoded_len(), expected.encoded_len());
        assert_eq!(kept.event(), &expected);
        assert_eq!(
            KeptEvent::new(expected.clone()).encode_to_vec(),
            expected.encode_to_vec()
        );
    }

    #[test]
    fn what_a_newer_writer_added_is_kept_as_it_came_and_the_store_fields_are_its_own() {
        let mut message = Event {
            seq: 99,
            session_id: "ignored".into(),
            ..Event::default()
        }
        .encode_to_vec();
        put_len_field(&mut message, 1000, b"trace");
        message.extend_from_slice(&user("hi").encode_to_vec());
        // A seq after the other fields too: the store's own wins wherever it was.
        message.extend_from_slice(&[0x10, 0x05]);
        let mut kept = KeptEvent::from_wire(message.into()).unwrap();
        kept.place("s1", 3, 10, 1);
        let stored = kept.encode_to_vec();
        let decoded = Event::decode(&stored[..]).unwrap();
        assert_eq!((decoded.session_id.as_str(), decoded.seq), ("s1", 3));
        assert_eq!(decoded.kind, user("hi").kind);
        let unknown = find(&stored, EVENT).unwrap();
        assert_eq!(unknown.here, [&[0xc2, 0x3e, 5][..], b"trace"].concat());
    }

    #[test]
    fn a_renamed_event_is_the_same_bytes_under_another_session() {
        let mut kept = KeptEvent::from_wire(user("hi").encode_to_vec().into()).unwrap();
        kept.place("parent", 3, 10, 1);
        let mut renamed = Vec::new();
        renamed_into(&kept.encode_to_vec(), "fork-1", &mut renamed);
        kept.set_session_id("fork-1");
        assert_eq!(renamed, kept.encode_to_vec());
    }

    #[test]
    fn an_unknown_kind_is_named_and_a_known_one_is_not() {
        let mut message = Vec::new();
        put_len_field(&mut message, 3, b"e1");
        put_len_field(&mut message, 42, b"");
        let kept = KeptEvent::from_wire(message.into()).unwrap();
        assert_eq!(kept.unknown_kind(), Some(42));
        let known = KeptEvent::from_wire(user("x").encode_to_vec().into()).unwrap();
        assert_eq!(known.unknown_kind(), None);
        let none = KeptEvent::from_wire(Bytes::new()).unwrap();
        assert_eq!(none.unknown_kind(), None);
    }

    #[test]
    fn a_request_decodes_with_its_events_kept_and_its_other_fields_as_prost_reads_them() {
        let mut newer = user("hi").encode_to_vec();
        put_len_field(&mut newer, 1000, b"trace");
        let mut request = AppendRequest {
            session_id: "s1".into(),
            lease_epoch: Some(4),
            ..AppendRequest::default()
        }
        .encode_to_vec();
        put_len_field(&mut request, 2, &newer);
        put_len_field(&mut request, 2, &user("again").encode_to_vec());
        let kept = KeptAppendRequest::decode(Bytes::from(request.clone())).unwrap();
        assert_eq!(kept.request.session_id, "s1");
        assert_eq!(kept.request.lease_epoch, Some(4));
        assert!(kept.request.events.is_empty());
        assert_eq!(kept.events.len(), 2);
        assert_eq!(kept.events[0].encode_to_vec(), newer);
        assert_eq!(kept.encode_to_vec(), request);
        assert_eq!(Message::encoded_len(&kept), request.len());
    }
}
