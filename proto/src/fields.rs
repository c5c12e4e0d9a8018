//! An encoded protobuf message walked field by field without decoding it: each field's
//! number, wire type, the bytes it spans (its key included) and, for a length-delimited
//! field, its payload. What is kept as its writer encoded it ([`crate::kept`],
//! [`crate::unknown`]) is cut and joined with this, so a field no build here knows passes
//! through byte for byte.

/// Why bytes are not a protobuf message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("not a protobuf message: {0}")]
pub struct WireError(pub &'static str);

/// The wire type of a length-delimited field (strings, bytes, messages, packed repeats).
pub const LEN: u8 = 2;
const VARINT: u8 = 0;
const FIXED64: u8 = 1;
const START_GROUP: u8 = 3;
const END_GROUP: u8 = 4;
const FIXED32: u8 = 5;

/// One field of a message, as it lies in the message's bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Field<'a> {
    pub number: u32,
    pub wire_type: u8,
    /// The whole field: its key, then its value.
    pub bytes: &'a [u8],
    /// A length-delimited field's payload (empty for any other wire type).
    pub payload: &'a [u8],
}

/// The fields of `message`, in the order they lie; an error ends the walk.
pub fn fields(message: &[u8]) -> Fields<'_> {
    Fields { rest: message }
}

/// The iterator [`fields`] returns.
pub struct Fields<'a> {
    rest: &'a [u8],
}

impl<'a> Iterator for Fields<'a> {
    type Item = Result<Field<'a>, WireError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.rest.is_empty() {
            return None;
        }
        let whole = self.rest;
        let field = next_field(&mut self.rest).map(|(number, wire_type, payload)| Field {
            number,
            wire_type,
            bytes: &whole[..whole.len() - self.rest.len()],
            payload,
        });
        if field.is_err() {
            self.rest = &[];
        }
        Some(field)
    }
}

/// Reads one field off the front of `rest`: its number, wire type and payload.
fn next_field<'a>(rest: &mut &'a [u8]) -> Result<(u32, u8, &'a [u8]), WireError> {
    let (number, wire_type) = key(rest)?;
    let mut payload: &[u8] = &[];
    match wire_type {
        VARINT => {
            varint(rest)?;
        }
        FIXED64 => skip(rest, 8)?,
        FIXED32 => skip(rest, 4)?,
        LEN => {
            let len = usize::try_from(varint(rest)?).map_err(|_| WireError("a length"))?;
            let (value, after) = split(rest, len)?;
            payload = value;
            *rest = after;
        }
        START_GROUP => loop {
            // A group (proto2's, never written by proto3) ends at its own end key.
            let at = *rest;
            let (inner, inner_type) = key(&mut { at })?;
            if inner_type == END_GROUP {
                if inner != number {
                    return Err(WireError("a group ended by another field's end"));
                }
                key(rest)?;
                break;
            }
            next_field(rest)?;
        },
        _ => return Err(WireError("a field of an unknown wire type")),
    }
    Ok((number, wire_type, payload))
}

fn key(rest: &mut &[u8]) -> Result<(u32, u8), WireError> {
    let key = varint(rest)?;
    let number = u32::try_from(key >> 3).map_err(|_| WireError("a field number"))?;
    if number == 0 {
        return Err(WireError("field number 0"));
    }
    Ok((number, (key & 7) as u8))
}

/// Reads a varint off the front of `rest`.
pub fn varint(rest: &mut &[u8]) -> Result<u64, WireError> {
    let mut value = 0u64;
    for (i, byte) in rest.iter().enumerate().take(10) {
        value |= u64::from(byte & 0x7f) << (7 * i);
        if byte & 0x80 == 0 {
            *rest = &rest[i + 1..];
            return Ok(value);
        }
    }
    Err(WireError("a varint"))
}

fn skip(rest: &mut &[u8], n: usize) -> Result<(), WireError> {
    *rest = split(rest, n)?.1;
    Ok(())
}

fn split<'a>(rest: &&'a [u8], n: usize) -> Result<(&'a [u8], &'a [u8]), WireError> {
    if n > rest.len() {
        return Err(WireError("a field past the end of its message"));
    }
    Ok(rest.split_at(n))
}

/// Appends a length-delimited field: `number`'s key, the length, then `payload`.
pub fn put_len_field(out: &mut Vec<u8>, number: u32, payload: &[u8]) {
    prost::encoding::encode_key(number, prost::encoding::WireType::LengthDelimited, out);
    prost::encoding::encode_varint(payload.len() as u64, out);
    out.extend_from_slice(payload);
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;
    use crate::v1::{event, Event, UserMessage};

    #[test]
    fn walks_every_wire_type_and_gives_each_field_its_bytes() {
        let mut message = Event {
            session_id: "s".into(),
            seq: 300,
            kind: Some(event::Kind::UserMessage(UserMessage { text: "hi".into() })),
            ..Event::default()
        }
        .encode_to_vec();
        // A fixed64 (field 7), a fixed32 (8) and a group (9) no build here knows.
        message.extend_from_slice(&[0x39, 1, 2, 3, 4, 5, 6, 7, 8]);
        message.extend_from_slice(&[0x45, 1, 2, 3, 4]);
        message.extend_from_slice(&[0x4b, 0x08, 0x01, 0x4c]);
        let walked: Vec<Field> = fields(&message).collect::<Result<_, _>>().unwrap();
        let numbers: Vec<u32> = walked.iter().map(|f| f.number).collect();
        assert_eq!(numbers, [1, 2, 10, 7, 8, 9]);
        assert_eq!(walked[0].payload, b"s");
        assert_eq!(
            walked[2].payload,
            UserMessage { text: "hi".into() }.encode_to_vec()
        );
        let joined: Vec<u8> = walked
            .iter()
            .flat_map(|f| f.bytes.iter().copied())
            .collect();
        assert_eq!(joined, message);
    }

    #[test]
    fn a_cut_message_is_an_error_not_a_panic() {
        let message = Event {
            event_id: "an id".into(),
            ..Event::default()
        }
        .encode_to_vec();
        for end in 1..message.len() {
            assert!(fields(&message[..end]).any(|f| f.is_err()), "cut at {end}");
        }
        assert!(fields(&[0x00]).any(|f| f.is_err()), "field number 0");
        assert!(fields(&[0x0e]).any(|f| f.is_err()), "wire type 6");
        assert!(
            fields(&[0x4b, 0x54]).any(|f| f.is_err()),
            "a group ended by another"
        );
    }
}
