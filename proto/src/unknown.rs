//! The fields of an encoded `Event` that this build does not know (written by a newer
//! client or runner), found by walking its bytes against the compiled descriptors, and put
//! back into an event this build encodes. prost keeps no unknown field, so a program that
//! decodes an event and encodes it again loses them; these two functions are how the
//! store's export and import keep them instead.
//!
//! An [`Unknown`] holds a message's own unknown fields (their wire bytes, in the order they
//! came) and, for each field of it that is a message holding unknown fields in turn, that
//! field's [`Unknown`]. The well-known `google.protobuf` messages (a tool input's `Struct`)
//! are never looked into: they do not grow.
//!
//! [`splice`] puts each message's unknown fields after its known ones, so
//! `splice(encode(decode(m)), find(m))` is `m` itself whenever `m`'s unknown fields came
//! last in each of its messages (as prost writes a field new to a message declared after
//! the old ones), and otherwise the same fields, each message's in the same order.

use std::collections::HashMap;
use std::sync::OnceLock;

use prost::Message;
use prost_types::field_descriptor_proto::Type;
use prost_types::{DescriptorProto, FileDescriptorSet};

use crate::fields::{fields, put_len_field, WireError, LEN};

/// The unknown fields of one message and of the messages inside it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Unknown {
    /// This message's own unknown fields: their wire bytes, keys included, as they came.
    pub here: Vec<u8>,
    /// Fields of this message that hold unknown fields inside them.
    pub inside: Vec<Inside>,
}

/// The unknown fields inside one value of a message-typed field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inside {
    pub field: u32,
    /// Which of the field's values (0 unless the field repeats).
    pub index: usize,
    pub unknown: Unknown,
}

impl Unknown {
    pub fn is_empty(&self) -> bool {
        self.here.is_empty() && self.inside.is_empty()
    }

    /// The unknown fields inside value `index` of field `field`, if any.
    pub fn child(&self, field: u32, index: usize) -> Option<&Unknown> {
        self.inside
            .iter()
            .find(|i| i.field == field && i.index == index)
            .map(|i| &i.unknown)
    }

    /// Records `unknown` as what value `index` of field `field` holds (nothing if empty).
    pub fn put_child(&mut self, field: u32, index: usize, unknown: Unknown) {
        if !unknown.is_empty() {
            self.inside.push(Inside {
                field,
                index,
                unknown,
            });
        }
    }
}

/// The full name of the message every event is.
pub const EVENT: &str = ".agentlog.v1.Event";

/// The unknown fields of `message`, an encoded message of type `type_name` (a full name
/// with its leading dot, such as [`EVENT`]).
pub fn find(message: &[u8], type_name: &str) -> Result<Unknown, WireError> {
    let table = tables()
        .get(type_name)
        .ok_or(WireError("a message type the protocol does not have"))?;
    let mut unknown = Unknown::default();
    let mut seen: HashMap<u32, usize> = HashMap::new();
    for field in fields(message) {
        let field = field?;
        match table.get(&field.number) {
            None => unknown.here.extend_from_slice(field.bytes),
            Some(Known::Message(child)) if field.wire_type == LEN => {
                let index = seen.entry(field.number).or_default();
                unknown.put_child(field.number, *index, find(field.payload, child)?);
                *index += 1;
            }
            Some(_) => {}
        }
    }
    Ok(unknown)
}

/// `known` (a message this build encoded) with `unknown`'s fields put back: each message's
/// own after its known fields, those inside a field into that field's value (its length
/// made anew). A field `unknown` names that `known` lacks is an error.
pub fn splice(known: &[u8], unknown: &Unknown) -> Result<Vec<u8>, WireError> {
    let mut out = Vec::with_capacity(known.len() + unknown.here.len());
    splice_into(&mut out, known, unknown)?;
    Ok(out)
}

fn splice_into(out: &mut Vec<u8>, known: &[u8], unknown: &Unknown) -> Result<(), WireError> {
    if unknown.inside.is_empty() {
        out.extend_from_slice(known);
    } else {
        let mut seen: HashMap<u32, usize> = HashMap::new();
        let mut placed = 0;
        for field in fields(known) {
            let field = field?;
            let index = seen.entry(field.number).or_default();
            match unknown.child(field.number, *index) {
                Some(inner) if field.wire_type == LEN => {
                    let mut value = Vec::with_capacity(field.payload.len() + inner.here.len());
                    splice_into(&mut value, field.payload, inner)?;
                    put_len_field(out, field.number, &value);
                    placed += 1;
                }
                _ => out.extend_from_slice(field.bytes),
            }
            *index += 1;
        }
        if placed != unknown.inside.len() {
            return Err(WireError(
                "unknown fields inside a field the message does not hold",
            ));
        }
    }
    out.extend_from_slice(&unknown.here);
    Ok(())
}

/// An encoded event in the one form that [`crate::kept::KeptEvent::from_event`] makes of
/// its decoded fields and [`find`]'s: its known fields as prost encodes them, each
/// message's unknown fields after them. Two encodings of the same event (fields in another
/// order, a field given twice) have the same canonical form.
pub fn canonical_event(message: &[u8]) -> Result<Vec<u8>, WireError> {
    let event = crate::v1::Event::decode(message)
        .map_err(|_| WireError("an event that does not decode"))?;
    splice(&event.encode_to_vec(), &find(message, EVENT)?)
}

/// What a message knows of one of its fields.
enum Known {
    /// A field of a message type this module looks into (by its full name).
    Message(String),
    /// Any other field: a scalar, a string, a well-known type.
    Plain,
}

/// Every agentlog message's fields, by the message's full name, from the compiled
/// descriptors.
fn tables() -> &'static HashMap<String, HashMap<u32, Known>> {
    static TABLES: OnceLock<HashMap<String, HashMap<u32, Known>>> = OnceLock::new();
    TABLES.get_or_init(|| {
        let set = FileDescriptorSet::decode(crate::FILE_DESCRIPTOR_SET)
            .expect("the compiled descriptor set decodes");
        let mut tables = HashMap::new();
        for file in &set.file {
            let scope = format!(".{}", file.package());
            for message in &file.message_type {
                add_message(&mut tables, &scope, message);
            }
        }
        tables
    })
}

fn add_message(
    tables: &mut HashMap<String, HashMap<u32, Known>>,
    scope: &str,
    message: &DescriptorProto,
) {
    let name = format!("{scope}.{}", message.name());
    let table = message
        .field
        .iter()
        .map(|f| {
            let known = match f.r#type() {
                Type::Message if !f.type_name().starts_with(".google.protobuf.") => {
                    Known::Message(f.type_name().to_string())
                }
                _ => Known::Plain,
            };
            (f.number() as u32, known)
        })
        .collect();
    for nested in &message.nested_type {
        add_message(tables, &name, nested);
    }
    tables.insert(name, table);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::{
        content_block::Block, event, AssistantMessage, ContentBlock, Event, TextBlock, Usage,
        UserMessage,
    };

    fn reply() -> Event {
        Event {
            session_id: "s".into(),
            seq: 4,
            kind: Some(event::Kind::AssistantMessage(AssistantMessage {
                content: vec![
                    ContentBlock {
                        block: Some(Block::Text(TextBlock { text: "a".into() })),
                    },
                    ContentBlock {
                        block: Some(Block::Text(TextBlock { text: "b".into() })),
                    },
                ],
                usage: Some(Usage {
                    input_tokens: 3,
                    ..Usage::default()
                }),
                ..AssistantMessage::default()
            })),
            ..Event::default()
        }
    }

    /// `reply()` as a newer writer would encode it: a plain field of the event (1000), a
    /// field of the assistant message (6), a new kind of block as the second block's only
    /// field (7) and a field of the usage (9), each after the fields this build knows.
    fn newer_reply() -> Vec<u8> {
        let reply = reply();
        let Some(event::Kind::AssistantMessage(m)) = &reply.kind else {
            unreachable!()
        };
        let mut message = Vec::new();
        for (i, block) in m.content.iter().enumerate() {
            let mut b = block.encode_to_vec();
            if i == 1 {
                put_len_field(&mut b, 7, b"image");
            }
            put_len_field(&mut message, 1, &b);
        }
        let mut usage = m.usage.as_ref().unwrap().encode_to_vec();
        usage.extend_from_slice(&[0x48, 0x05]);
        put_len_field(&mut message, 4, &usage);
        put_len_field(&mut message, 6, b"new");
        let mut event = Event {
            kind: None,
            ..reply.clone()
        }
        .encode_to_vec();
        put_len_field(&mut event, 11, &message);
        put_len_field(&mut event, 1000, b"trace");
        event
    }

    #[test]
    fn finds_unknown_fields_at_every_depth_and_puts_them_back_byte_for_byte() {
        let newer = newer_reply();
        let decoded = Event::decode(&newer[..]).unwrap();
        assert_eq!(
            decoded,
            reply(),
            "prost reads the known fields and drops the rest"
        );
        let unknown = find(&newer, EVENT).unwrap();
        assert_eq!(unknown.here, [&[0xc2, 0x3e, 5][..], b"trace"].concat());
        let message = unknown.child(11, 0).unwrap();
        assert_eq!(message.here, [&[0x32, 3][..], b"new"].concat());
        assert!(message.child(1, 0).is_none(), "the first block has none");
        assert_eq!(
            message.child(1, 1).unwrap().here,
            [&[0x3a, 5][..], b"image"].concat()
        );
        assert_eq!(message.child(4, 0).unwrap().here, [0x48, 0x05]);
        assert_eq!(splice(&decoded.encode_to_vec(), &unknown).unwrap(), newer);
    }

    #[test]
    fn an_event_this_build_wrote_has_nothing_unknown() {
        let event = reply().encode_to_vec();
        let unknown = find(&event, EVENT).unwrap();
        assert!(unknown.is_empty());
        assert_eq!(splice(&event, &unknown).unwrap(), event);
    }

    #[test]
    fn a_struct_is_not_looked_into_and_a_missing_field_is_an_error() {
        let user = Event {
            kind: Some(event::Kind::UserMessage(UserMessage { text: "x".into() })),
            ..Event::default()
        };
        let mut unknown = Unknown::default();
        unknown.put_child(
            11,
            0,
            Unknown {
                here: vec![0x48, 1],
                inside: vec![],
            },
        );
        assert!(splice(&user.encode_to_vec(), &unknown).is_err());
        assert!(find(b"\x0a", EVENT).is_err());
    }
}
