//! Events in the proto3 JSON mapping, both ways: lowerCamelCase names, 64-bit integers as
//! strings, fields at their default left out, a `google.protobuf.Struct` as the JSON object
//! it stands for, as grpcurl prints them. The export format's event lines are written and
//! read here, and the CLI's `--json` prints the same.
//!
//! Promises:
//! - **Exact both ways.** [`event_from_json`] of what [`write_event`] wrote is the event
//!   again, field for field (a tool input's numbers included: a whole double is written as
//!   an integer, any other as the shortest form that reads back as the same double). The
//!   one exception is a Struct number that is not finite, which JSON cannot hold: it is
//!   written as `null` (no JSON reader of the store can make one).
//! - **Nothing dropped silently.** The fields of an event that this build does not know
//!   ([`crate::unknown`]) are written on the object that held them as
//!   `"unknownFields":"<base64 of their wire bytes>"` ([`write_event_keeping`]) and read
//!   back from there ([`event_from_json_keeping`]). Any other field this build does not
//!   know (a kind added by a newer store, written by its own JSON), a value of the wrong
//!   type or a 64-bit integer out of range is an error naming the field, never skipped: an
//!   import recreates a session exactly or refuses it. Either name of a field is read
//!   (`toolUseId` or `tool_use_id`), as proto3 JSON asks.
//! - Every field of every message an `Event` holds is known here: the test
//!   `every_field_of_the_protocol_is_mapped` reads the compiled descriptors and fails when
//!   a field is added to the protocol without its mapping.

use std::collections::BTreeMap;

use base64::prelude::{Engine, BASE64_STANDARD};
use prost_types::{value::Kind as ValueKind, ListValue, Struct, Value as PbValue};
use serde_json::{Map, Value};

use crate::unknown::Unknown;

use crate::v1::{
    content_block::Block, event::Kind, ApprovalDecision, ApprovalRequested, AssistantDelta,
    AssistantMessage, Budget, ContentBlock, Event, Interrupt, Interrupted, ModelRetry, OffPath,
    RedactedThinkingBlock, Replay, RunError, RunPaused, ServedFrom, SessionConfig, TextBlock,
    ThinkingBlock, ToolResult, ToolStarted, ToolUseBlock, Usage, UserMessage,
};

/// Why a JSON value is not an event.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct JsonError(pub String);

fn err(message: impl Into<String>) -> JsonError {
    JsonError(message.into())
}

/// The key under which an object's unknown fields are written.
const UNKNOWN_FIELDS: &str = "unknownFields";

/// Writes `event` as one JSON object (no newline) onto `out`.
pub fn write_event(out: &mut Vec<u8>, event: &Event) {
    write_event_keeping(out, event, &Unknown::default());
}

/// Writes `event` with the fields of it that this build does not know, `unknown`, each
/// message's on its own object.
pub fn write_event_keeping(out: &mut Vec<u8>, event: &Event, unknown: &Unknown) {
    let none = Unknown::default();
    let inner = |field: u32| unknown.child(field, 0).unwrap_or(&none);
    let mut o = Obj::open(out);
    o.str("sessionId", &event.session_id);
    o.u64("seq", event.seq);
    o.str("eventId", &event.event_id);
    o.i64("tsUnixMs", event.ts_unix_ms);
    o.u32("schemaVersion", event.schema_version);
    if let Some(kind) = &event.kind {
        let (name, number) = kind_field(kind);
        let u = inner(number);
        let write: WriteBody = match kind {
            Kind::UserMessage(m) => &|out| {
                let mut o = Obj::open(out);
                o.str("text", &m.text);
                o.close(u);
            },
            Kind::AssistantMessage(m) => &|out| write_assistant(out, m, u),
            Kind::ToolStarted(s) => &|out| {
                let mut o = Obj::open(out);
                o.str("toolUseId", &s.tool_use_id);
                o.str("idempotencyKey", &s.idempotency_key);
                o.u32("attempt", s.attempt);
                o.close(u);
            },
            Kind::ToolResult(r) => &|out| {
                let mut o = Obj::open(out);
                o.str("toolUseId", &r.tool_use_id);
                o.str("content", &r.content);
                o.bool("isError", r.is_error);
                if let Some(checkpoint) = &r.workspace_checkpoint {
                    o.key("workspaceCheckpoint");
                    write_str(o.out, checkpoint);
                }
                if let Some(from) = &r.served_from {
                    o.key("servedFrom");
                    let mut f = Obj::open(o.out);
                    f.str("sessionId", &from.session_id);
                    f.u64("seq", from.seq);
                    f.close(u.child(5, 0).unwrap_or(&none));
                }
                o.close(u);
            },
            Kind::AssistantDelta(d) => &|out| {
                let mut o = Obj::open(out);
                o.str("turnId", &d.turn_id);
                o.str("text", &d.text);
                o.close(u);
            },
            Kind::RunError(e) => &|out| {
                let mut o = Obj::open(out);
                o.str("message", &e.message);
                o.bool("retryable", e.retryable);
                o.close(u);
            },
            Kind::Interrupt(i) => &|out| {
                let mut o = Obj::open(out);
                o.str("reason", &i.reason);
                o.close(u);
            },
            Kind::Interrupted(i) => &|out| {
                let mut o = Obj::open(out);
                o.str("reason", &i.reason);
                o.close(u);
            },
            Kind::ApprovalRequested(r) => &|out| {
                let mut o = Obj::open(out);
                o.str("toolUseId", &r.tool_use_id);
                o.str("toolName", &r.tool_name);
                if let Some(input) = &r.input {
                    o.key("input");
                    write_struct(o.out, input);
                }
                o.str("reason", &r.reason);
                o.close(u);
            },
            Kind::ApprovalDecision(d) => &|out| {
                let mut o = Obj::open(out);
                o.str("toolUseId", &d.tool_use_id);
                o.bool("approved", d.approved);
                o.str("note", &d.note);
                o.close(u);
            },
            Kind::SessionConfig(c) => &|out| {
                let mut o = Obj::open(out);
                o.str("model", &c.model);
                if !c.fallback_models.is_empty() {
                    o.key("fallbackModels");
                    o.out.push(b'[');
                    for (i, model) in c.fallback_models.iter().enumerate() {
                        if i > 0 {
                            o.out.push(b',');
                        }
                        write_str(o.out, model);
                    }
                    o.out.push(b']');
                }
                if let Some(b) = &c.budget {
                    o.key("budget");
                    let mut b_ = Obj::open(o.out);
                    b_.u64("maxModelCalls", b.max_model_calls);
                    b_.u64("maxTokens", b.max_tokens);
                    b_.u64("maxSeconds", b.max_seconds);
                    b_.close(u.child(4, 0).unwrap_or(&none));
                }
                if let Some(r) = &c.replay {
                    o.key("replay");
                    let mut r_ = Obj::open(o.out);
                    r_.str("sessionId", &r.session_id);
                    r_.u64("afterSeq", r.after_seq);
                    r_.u64("throughSeq", r.through_seq);
                    if r.off_path != 0 {
                        r_.key("offPath");
                        match OffPath::try_from(r.off_path) {
                            Ok(known) => write_str(r_.out, known.as_str_name()),
                            // A value this build does not name: its number, as proto3 JSON
                            // writes an unknown enum value.
                            Err(_) => r_.out.extend_from_slice(r.off_path.to_string().as_bytes()),
                        }
                    }
                    r_.close(u.child(2, 0).unwrap_or(&none));
                }
                o.close(u);
            },
            Kind::ModelRetry(r) => &|out| {
                let mut o = Obj::open(out);
                o.u64("turn", r.turn);
                o.u32("attempt", r.attempt);
                o.str("model", &r.model);
                o.str("reason", &r.reason);
                o.str("message", &r.message);
                o.i64("retryAtUnixMs", r.retry_at_unix_ms);
                o.close(u);
            },
            Kind::RunPaused(p) => &|out| {
                let mut o = Obj::open(out);
                o.str("reason", &p.reason);
                o.str("detail", &p.detail);
                o.close(u);
            },
        };
        o.key(name);
        write(o.out);
    }
    o.close(unknown);
}

/// A kind's name in the JSON and its field number in `Event`.
fn kind_field(kind: &Kind) -> (&'static str, u32) {
    match kind {
        Kind::UserMessage(_) => ("userMessage", 10),
        Kind::AssistantMessage(_) => ("assistantMessage", 11),
        Kind::ToolStarted(_) => ("toolStarted", 12),
        Kind::ToolResult(_) => ("toolResult", 13),
        Kind::AssistantDelta(_) => ("assistantDelta", 14),
        Kind::RunError(_) => ("runError", 15),
        Kind::Interrupt(_) => ("interrupt", 16),
        Kind::Interrupted(_) => ("interrupted", 17),
        Kind::ApprovalRequested(_) => ("approvalRequested", 18),
        Kind::ApprovalDecision(_) => ("approvalDecision", 19),
        Kind::SessionConfig(_) => ("sessionConfig", 20),
        Kind::ModelRetry(_) => ("modelRetry", 21),
        Kind::RunPaused(_) => ("runPaused", 22),
    }
}

/// A content block's kind: its name in the JSON and its field number in `ContentBlock`.
fn block_field(block: &Block) -> (&'static str, u32) {
    match block {
        Block::Text(_) => ("text", 1),
        Block::ToolUse(_) => ("toolUse", 2),
        Block::Thinking(_) => ("thinking", 3),
        Block::RedactedThinking(_) => ("redactedThinking", 4),
    }
}

/// Writes a kind's body.
type WriteBody<'a> = &'a dyn Fn(&mut Vec<u8>);

/// `event` as one JSON object, as text.
pub fn event_to_string(event: &Event) -> String {
    let mut out = Vec::with_capacity(256);
    write_event(&mut out, event);
    String::from_utf8(out).expect("the writer writes UTF-8")
}

fn write_assistant(out: &mut Vec<u8>, m: &AssistantMessage, unknown: &Unknown) {
    let none = Unknown::default();
    let mut o = Obj::open(out);
    if !m.content.is_empty() {
        o.key("content");
        o.out.push(b'[');
        for (i, block) in m.content.iter().enumerate() {
            if i > 0 {
                o.out.push(b',');
            }
            let in_block = unknown.child(1, i).unwrap_or(&none);
            let mut b = Obj::open(o.out);
            if let Some(kind) = &block.block {
                let (name, number) = block_field(kind);
                let inner = in_block.child(number, 0).unwrap_or(&none);
                b.key(name);
                let mut k = Obj::open(b.out);
                match kind {
                    Block::Text(t) => k.str("text", &t.text),
                    Block::ToolUse(u) => {
                        k.str("id", &u.id);
                        k.str("name", &u.name);
                        if let Some(input) = &u.input {
                            k.key("input");
                            write_struct(k.out, input);
                        }
                    }
                    Block::Thinking(t) => {
                        k.str("thinking", &t.thinking);
                        k.str("signature", &t.signature);
                    }
                    Block::RedactedThinking(r) => k.str("data", &r.data),
                }
                k.close(inner);
            }
            b.close(in_block);
        }
        o.out.push(b']');
    }
    o.str("stopReason", &m.stop_reason);
    o.str("model", &m.model);
    if let Some(u) = &m.usage {
        o.key("usage");
        let mut u_ = Obj::open(o.out);
        u_.u64("inputTokens", u.input_tokens);
        u_.u64("outputTokens", u.output_tokens);
        u_.u64("cacheCreationInputTokens", u.cache_creation_input_tokens);
        u_.u64("cacheReadInputTokens", u.cache_read_input_tokens);
        u_.close(unknown.child(4, 0).unwrap_or(&none));
    }
    o.str("messageId", &m.message_id);
    o.close(unknown);
}

/// A JSON object being written: its fields, each with the comma before it.
struct Obj<'a> {
    out: &'a mut Vec<u8>,
    first: bool,
}

impl<'a> Obj<'a> {
    fn open(out: &'a mut Vec<u8>) -> Obj<'a> {
        out.push(b'{');
        Obj { out, first: true }
    }

    fn key(&mut self, name: &str) {
        if !self.first {
            self.out.push(b',');
        }
        self.first = false;
        self.out.push(b'"');
        self.out.extend_from_slice(name.as_bytes());
        self.out.extend_from_slice(b"\":");
    }

    fn str(&mut self, name: &str, value: &str) {
        if !value.is_empty() {
            self.key(name);
            write_str(self.out, value);
        }
    }

    fn u64(&mut self, name: &str, value: u64) {
        if value != 0 {
            self.key(name);
            self.out.push(b'"');
            self.out.extend_from_slice(value.to_string().as_bytes());
            self.out.push(b'"');
        }
    }

    fn i64(&mut self, name: &str, value: i64) {
        if value != 0 {
            self.key(name);
            self.out.push(b'"');
            self.out.extend_from_slice(value.to_string().as_bytes());
            self.out.push(b'"');
        }
    }

    fn u32(&mut self, name: &str, value: u32) {
        if value != 0 {
            self.key(name);
            self.out.extend_from_slice(value.to_string().as_bytes());
        }
    }

    fn bool(&mut self, name: &str, value: bool) {
        if value {
            self.key(name);
            self.out.extend_from_slice(b"true");
        }
    }

    /// Ends the object, with the unknown fields of the message it stands for, if any.
    fn close(mut self, unknown: &Unknown) {
        if !unknown.here.is_empty() {
            self.key(UNKNOWN_FIELDS);
            self.out.push(b'"');
            self.out
                .extend_from_slice(BASE64_STANDARD.encode(&unknown.here).as_bytes());
            self.out.push(b'"');
        }
        self.out.push(b'}');
    }
}

/// A JSON string, escaped.
pub fn write_str(out: &mut Vec<u8>, value: &str) {
    serde_json::to_writer(out, value).expect("writing to a Vec cannot fail");
}

fn write_struct(out: &mut Vec<u8>, s: &Struct) {
    out.push(b'{');
    for (i, (key, value)) in s.fields.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        write_str(out, key);
        out.push(b':');
        write_value(out, value);
    }
    out.push(b'}');
}

fn write_value(out: &mut Vec<u8>, value: &PbValue) {
    match &value.kind {
        None | Some(ValueKind::NullValue(_)) => out.extend_from_slice(b"null"),
        Some(ValueKind::BoolValue(b)) => out.extend_from_slice(if *b { b"true" } else { b"false" }),
        Some(ValueKind::NumberValue(n)) => write_number(out, *n),
        Some(ValueKind::StringValue(s)) => write_str(out, s),
        Some(ValueKind::ListValue(list)) => {
            out.push(b'[');
            for (i, item) in list.values.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_value(out, item);
            }
            out.push(b']');
        }
        Some(ValueKind::StructValue(s)) => write_struct(out, s),
    }
}

fn write_number(out: &mut Vec<u8>, n: f64) {
    const EXACT: f64 = 9_007_199_254_740_992.0; // 2^53: every whole double below is exact
    if !n.is_finite() {
        out.extend_from_slice(b"null");
    } else if n.fract() == 0.0 && n.abs() <= EXACT {
        if n == 0.0 && n.is_sign_negative() {
            out.extend_from_slice(b"-0.0");
        } else {
            out.extend_from_slice((n as i64).to_string().as_bytes());
        }
    } else {
        // serde_json writes the shortest form that reads back as the same double.
        serde_json::to_writer(out, &n).expect("writing to a Vec cannot fail");
    }
}

/// The event a JSON object stands for (see the module head: exact, and strict); an event
/// with fields this build does not know is refused (see [`event_from_json_keeping`]).
pub fn event_from_json(value: &Value) -> Result<Event, JsonError> {
    let (event, unknown) = event_from_json_keeping(value)?;
    if !unknown.is_empty() {
        return Err(err(
            "the event has unknownFields: fields this build does not know, written by a newer \
             one",
        ));
    }
    Ok(event)
}

/// The event a JSON object stands for, and the fields of it that this build does not know
/// (each object's `unknownFields`).
pub fn event_from_json_keeping(value: &Value) -> Result<(Event, Unknown), JsonError> {
    let mut fields = Fields::of(value, "the event")?;
    let mut event = Event {
        session_id: fields.string("sessionId")?,
        seq: fields.u64("seq")?,
        event_id: fields.string("eventId")?,
        ts_unix_ms: fields.i64("tsUnixMs")?,
        schema_version: fields.u32("schemaVersion")?,
        kind: None,
    };
    let kinds: [(&str, KindReader); 13] = [
        ("userMessage", |f| {
            Ok(Kind::UserMessage(UserMessage {
                text: f.string("text")?,
            }))
        }),
        ("assistantMessage", read_assistant),
        ("toolStarted", |f| {
            Ok(Kind::ToolStarted(ToolStarted {
                tool_use_id: f.string("toolUseId")?,
                idempotency_key: f.string("idempotencyKey")?,
                attempt: f.u32("attempt")?,
            }))
        }),
        ("toolResult", |f| {
            Ok(Kind::ToolResult(ToolResult {
                tool_use_id: f.string("toolUseId")?,
                content: f.string("content")?,
                is_error: f.bool("isError")?,
                workspace_checkpoint: f.optional_string("workspaceCheckpoint")?,
                served_from: match f.take("servedFrom") {
                    None | Some(Value::Null) => None,
                    Some(value) => {
                        let mut g = Fields::of(&value, "servedFrom")?;
                        let from = ServedFrom {
                            session_id: g.string("sessionId")?,
                            seq: g.u64("seq")?,
                        };
                        f.adopt(5, 0, g.done()?);
                        Some(from)
                    }
                },
            }))
        }),
        ("assistantDelta", |f| {
            Ok(Kind::AssistantDelta(AssistantDelta {
                turn_id: f.string("turnId")?,
                text: f.string("text")?,
            }))
        }),
        ("runError", |f| {
            Ok(Kind::RunError(RunError {
                message: f.string("message")?,
                retryable: f.bool("retryable")?,
            }))
        }),
        ("interrupt", |f| {
            Ok(Kind::Interrupt(Interrupt {
                reason: f.string("reason")?,
            }))
        }),
        ("interrupted", |f| {
            Ok(Kind::Interrupted(Interrupted {
                reason: f.string("reason")?,
            }))
        }),
        ("approvalRequested", |f| {
            Ok(Kind::ApprovalRequested(ApprovalRequested {
                tool_use_id: f.string("toolUseId")?,
                tool_name: f.string("toolName")?,
                input: f.structure("input")?,
                reason: f.string("reason")?,
            }))
        }),
        ("approvalDecision", |f| {
            Ok(Kind::ApprovalDecision(ApprovalDecision {
                tool_use_id: f.string("toolUseId")?,
                approved: f.bool("approved")?,
                note: f.string("note")?,
            }))
        }),
        ("sessionConfig", |f| {
            let replay = match f.take("replay") {
                None | Some(Value::Null) => None,
                Some(value) => {
                    let mut r = Fields::of(&value, "replay")?;
                    let off_path = match r.take("offPath") {
                        None | Some(Value::Null) => 0,
                        Some(Value::String(name)) => {
                            OffPath::from_str_name(&name).ok_or_else(|| {
                                err(format!("replay: `offPath` {name:?} is not an OffPath"))
                            })? as i32
                        }
                        Some(Value::Number(n)) => n
                            .as_i64()
                            .and_then(|n| i32::try_from(n).ok())
                            .ok_or_else(|| err(format!("replay: `offPath` {n} is out of range")))?,
                        Some(other) => {
                            return Err(err(format!(
                                "replay: `offPath` must be a name, not {other}"
                            )))
                        }
                    };
                    let replay = Replay {
                        session_id: r.string("sessionId")?,
                        after_seq: r.u64("afterSeq")?,
                        through_seq: r.u64("throughSeq")?,
                        off_path,
                    };
                    f.adopt(2, 0, r.done()?);
                    Some(replay)
                }
            };
            let fallback_models = match f.take("fallbackModels") {
                None | Some(Value::Null) => Vec::new(),
                Some(Value::Array(models)) => models
                    .into_iter()
                    .map(|m| match m {
                        Value::String(m) => Ok(m),
                        other => Err(err(format!(
                            "sessionConfig: `fallbackModels` holds strings, not {other}"
                        ))),
                    })
                    .collect::<Result<_, _>>()?,
                Some(other) => {
                    return Err(err(format!(
                        "sessionConfig: `fallbackModels` must be an array, not {other}"
                    )))
                }
            };
            let budget = match f.take("budget") {
                None | Some(Value::Null) => None,
                Some(value) => {
                    let mut b = Fields::of(&value, "budget")?;
                    let budget = Budget {
                        max_model_calls: b.u64("maxModelCalls")?,
                        max_tokens: b.u64("maxTokens")?,
                        max_seconds: b.u64("maxSeconds")?,
                    };
                    f.adopt(4, 0, b.done()?);
                    Some(budget)
                }
            };
            Ok(Kind::SessionConfig(SessionConfig {
                model: f.string("model")?,
                replay,
                fallback_models,
                budget,
            }))
        }),
        ("modelRetry", |f| {
            Ok(Kind::ModelRetry(ModelRetry {
                turn: f.u64("turn")?,
                attempt: f.u32("attempt")?,
                model: f.string("model")?,
                reason: f.string("reason")?,
                message: f.string("message")?,
                retry_at_unix_ms: f.i64("retryAtUnixMs")?,
            }))
        }),
        ("runPaused", |f| {
            Ok(Kind::RunPaused(RunPaused {
                reason: f.string("reason")?,
                detail: f.string("detail")?,
            }))
        }),
    ];
    for (name, read) in kinds {
        if let Some(body) = fields.take(name) {
            if event.kind.is_some() {
                return Err(err(format!(
                    "the event has two kinds; `{name}` is the second"
                )));
            }
            let mut body = Fields::of(&body, name)?;
            let kind = read(&mut body)?;
            fields.adopt(kind_field(&kind).1, 0, body.done()?);
            event.kind = Some(kind);
        }
    }
    let unknown = fields.done()?;
    Ok((event, unknown))
}

type KindReader = fn(&mut Fields) -> Result<Kind, JsonError>;

fn read_assistant(f: &mut Fields) -> Result<Kind, JsonError> {
    let content = match f.take("content") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(blocks)) => {
            let mut content = Vec::with_capacity(blocks.len());
            for (i, block) in blocks.iter().enumerate() {
                let (block, unknown) = read_block(block)?;
                f.adopt(1, i, unknown);
                content.push(block);
            }
            content
        }
        Some(other) => {
            return Err(err(format!(
                "`assistantMessage.content` must be an array, not {other}"
            )))
        }
    };
    let usage = match f.take("usage") {
        None | Some(Value::Null) => None,
        Some(value) => {
            let mut u = Fields::of(&value, "usage")?;
            let usage = Usage {
                input_tokens: u.u64("inputTokens")?,
                output_tokens: u.u64("outputTokens")?,
                cache_creation_input_tokens: u.u64("cacheCreationInputTokens")?,
                cache_read_input_tokens: u.u64("cacheReadInputTokens")?,
            };
            f.adopt(4, 0, u.done()?);
            Some(usage)
        }
    };
    Ok(Kind::AssistantMessage(AssistantMessage {
        content,
        stop_reason: f.string("stopReason")?,
        model: f.string("model")?,
        usage,
        message_id: f.string("messageId")?,
    }))
}

/// A content block and the fields of it that this build does not know.
fn read_block(value: &Value) -> Result<(ContentBlock, Unknown), JsonError> {
    let mut f = Fields::of(value, "a content block")?;
    let mut block = None;
    let readers: [(&str, BlockReader); 4] = [
        ("text", |b| {
            Ok(Block::Text(TextBlock {
                text: b.string("text")?,
            }))
        }),
        ("toolUse", |b| {
            Ok(Block::ToolUse(ToolUseBlock {
                id: b.string("id")?,
                name: b.string("name")?,
                input: b.structure("input")?,
            }))
        }),
        ("thinking", |b| {
            Ok(Block::Thinking(ThinkingBlock {
                thinking: b.string("thinking")?,
                signature: b.string("signature")?,
            }))
        }),
        ("redactedThinking", |b| {
            Ok(Block::RedactedThinking(RedactedThinkingBlock {
                data: b.string("data")?,
            }))
        }),
    ];
    for (name, read) in readers {
        if let Some(v) = f.take(name) {
            if block.is_some() {
                return Err(err(format!(
                    "a content block has two kinds; `{name}` is the second"
                )));
            }
            let mut body = Fields::of(&v, name)?;
            let kind = read(&mut body)?;
            f.adopt(block_field(&kind).1, 0, body.done()?);
            block = Some(kind);
        }
    }
    let unknown = f.done()?;
    Ok((ContentBlock { block }, unknown))
}

type BlockReader = fn(&mut Fields) -> Result<Block, JsonError>;

/// The fields of a JSON object, by their lowerCamelCase names, taken one by one; what is
/// left at the end is an unknown field.
struct Fields {
    what: String,
    fields: BTreeMap<String, Value>,
    /// The unknown fields of the messages inside this one, as they are read.
    inside: Unknown,
}

impl Fields {
    fn of(value: &Value, what: &str) -> Result<Fields, JsonError> {
        let Value::Object(object) = value else {
            return Err(err(format!("{what} must be a JSON object, not {value}")));
        };
        let mut fields = BTreeMap::new();
        for (key, value) in object {
            if fields.insert(camel(key), value.clone()).is_some() {
                return Err(err(format!("{what} names the field `{key}` twice")));
            }
        }
        Ok(Fields {
            what: what.to_string(),
            fields,
            inside: Unknown::default(),
        })
    }

    /// Records what value `index` of field `field` held that this build does not know.
    fn adopt(&mut self, field: u32, index: usize, unknown: Unknown) {
        self.inside.put_child(field, index, unknown);
    }

    fn take(&mut self, name: &str) -> Option<Value> {
        self.fields.remove(name)
    }

    fn string(&mut self, name: &str) -> Result<String, JsonError> {
        Ok(self.optional_string(name)?.unwrap_or_default())
    }

    fn optional_string(&mut self, name: &str) -> Result<Option<String>, JsonError> {
        match self.take(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(other) => Err(self.wrong(name, "a string", &other)),
        }
    }

    fn bool(&mut self, name: &str) -> Result<bool, JsonError> {
        match self.take(name) {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(b),
            Some(other) => Err(self.wrong(name, "true or false", &other)),
        }
    }

    fn integer(&mut self, name: &str) -> Result<Option<i128>, JsonError> {
        match self.take(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => s
                .parse::<i128>()
                .map(Some)
                .map_err(|_| self.wrong(name, "an integer", &Value::String(s.clone()))),
            Some(Value::Number(n)) => n
                .as_i64()
                .map(i128::from)
                .or_else(|| n.as_u64().map(i128::from))
                .map(Some)
                .ok_or_else(|| self.wrong(name, "an integer", &Value::Number(n.clone()))),
            Some(other) => Err(self.wrong(name, "an integer", &other)),
        }
    }

    fn u64(&mut self, name: &str) -> Result<u64, JsonError> {
        self.ranged(name)
    }

    fn i64(&mut self, name: &str) -> Result<i64, JsonError> {
        self.ranged(name)
    }

    fn u32(&mut self, name: &str) -> Result<u32, JsonError> {
        self.ranged(name)
    }

    fn ranged<T: TryFrom<i128> + Default>(&mut self, name: &str) -> Result<T, JsonError> {
        match self.integer(name)? {
            None => Ok(T::default()),
            Some(n) => T::try_from(n).map_err(|_| {
                err(format!(
                    "{}: `{name}` is {n}, out of its type's range",
                    self.what
                ))
            }),
        }
    }

    fn structure(&mut self, name: &str) -> Result<Option<Struct>, JsonError> {
        match self.take(name) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Object(object)) => Ok(Some(json_to_struct(object))),
            Some(other) => Err(self.wrong(name, "a JSON object", &other)),
        }
    }

    fn wrong(&self, name: &str, wanted: &str, found: &Value) -> JsonError {
        let mut shown = found.to_string();
        if shown.len() > 40 {
            let mut end = 40;
            while !shown.is_char_boundary(end) {
                end -= 1;
            }
            shown.truncate(end);
            shown.push('…');
        }
        err(format!(
            "{}: `{name}` must be {wanted}, not {shown}",
            self.what
        ))
    }

    /// Every field was taken but `unknownFields`: the object's unknown fields, and those
    /// inside it. Anything else left is a field this build does not know by name.
    fn done(mut self) -> Result<Unknown, JsonError> {
        let mut unknown = std::mem::take(&mut self.inside);
        match self.take(UNKNOWN_FIELDS) {
            None | Some(Value::Null) => {}
            Some(Value::String(encoded)) => {
                unknown.here = BASE64_STANDARD.decode(encoded.as_bytes()).map_err(|e| {
                    err(format!(
                        "{}: `{UNKNOWN_FIELDS}` is not base64: {e}",
                        self.what
                    ))
                })?;
                crate::fields::fields(&unknown.here)
                    .try_for_each(|f| f.map(|_| ()))
                    .map_err(|e| err(format!("{}: `{UNKNOWN_FIELDS}`: {e}", self.what)))?;
            }
            Some(other) => return Err(self.wrong(UNKNOWN_FIELDS, "a base64 string", &other)),
        }
        match self.fields.keys().next() {
            None => Ok(unknown),
            Some(unknown) => Err(err(format!(
                "{} has a field this store does not know: `{unknown}` (exported by a newer \
                 store?)",
                self.what
            ))),
        }
    }
}

/// A field name in lowerCamelCase (proto3 JSON readers take the proto name too).
fn camel(name: &str) -> String {
    if !name.contains('_') {
        return name.to_string();
    }
    let mut out = String::with_capacity(name.len());
    let mut upper = false;
    for c in name.chars() {
        if c == '_' {
            upper = true;
        } else if upper {
            out.extend(c.to_uppercase());
            upper = false;
        } else {
            out.push(c);
        }
    }
    out
}

fn json_to_struct(object: Map<String, Value>) -> Struct {
    Struct {
        fields: object
            .into_iter()
            .map(|(key, value)| (key, json_to_value(value)))
            .collect(),
    }
}

fn json_to_value(value: Value) -> PbValue {
    let kind = match value {
        Value::Null => ValueKind::NullValue(0),
        Value::Bool(b) => ValueKind::BoolValue(b),
        // Struct numbers are doubles (integers beyond 2^53 lose precision, as in protobuf's
        // own JSON mapping).
        Value::Number(n) => ValueKind::NumberValue(n.as_f64().unwrap_or(0.0)),
        Value::String(s) => ValueKind::StringValue(s),
        Value::Array(items) => ValueKind::ListValue(ListValue {
            values: items.into_iter().map(json_to_value).collect(),
        }),
        Value::Object(object) => ValueKind::StructValue(json_to_struct(object)),
    };
    PbValue { kind: Some(kind) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use prost::Message;
    use prost_types::FileDescriptorSet;

    fn every_kind() -> Vec<Event> {
        let input = json_to_struct(
            serde_json::json!({
                "command": "echo \"hi\" \u{1F600}\n",
                "timeout_ms": 5000,
                "ratio": 0.1,
                "neg": -3,
                "big": 1e300,
                "tiny": 5e-324,
                "flags": [true, false, null, {"deep": [1, 2.5]}],
                "empty": {}
            })
            .as_object()
            .cloned()
            .expect("an object"),
        );
        let kinds = vec![
            Kind::UserMessage(UserMessage {
                text: "hi\u{0}\t\"there\"\\ é".into(),
            }),
            Kind::AssistantMessage(AssistantMessage {
                content: vec![
                    ContentBlock {
                        block: Some(Block::Thinking(ThinkingBlock {
                            thinking: "hmm".into(),
                            signature: "sig==".into(),
                        })),
                    },
                    ContentBlock {
                        block: Some(Block::RedactedThinking(RedactedThinkingBlock {
                            data: "xyz".into(),
                        })),
                    },
                    ContentBlock {
                        block: Some(Block::Text(TextBlock {
                            text: "I'll run it".into(),
                        })),
                    },
                    ContentBlock {
                        block: Some(Block::ToolUse(ToolUseBlock {
                            id: "toolu_1".into(),
                            name: "bash".into(),
                            input: Some(input.clone()),
                        })),
                    },
                    ContentBlock { block: None },
                ],
                stop_reason: "tool_use".into(),
                model: "scripted:demo".into(),
                usage: Some(Usage {
                    input_tokens: u64::MAX,
                    output_tokens: 7,
                    cache_creation_input_tokens: 0,
                    cache_read_input_tokens: 3,
                }),
                message_id: "msg_1".into(),
            }),
            Kind::AssistantMessage(AssistantMessage::default()),
            Kind::ToolStarted(ToolStarted {
                tool_use_id: "toolu_1".into(),
                idempotency_key: "s/toolu_1".into(),
                attempt: 2,
            }),
            Kind::ToolResult(ToolResult {
                tool_use_id: "toolu_1".into(),
                content: "ok\n".into(),
                is_error: true,
                workspace_checkpoint: Some(String::new()),
                served_from: None,
            }),
            Kind::ToolResult(ToolResult {
                workspace_checkpoint: Some("abc".into()),
                ..ToolResult::default()
            }),
            Kind::AssistantDelta(AssistantDelta {
                turn_id: "1.1.1".into(),
                text: "Hel".into(),
            }),
            Kind::RunError(RunError {
                message: "refused".into(),
                retryable: true,
            }),
            Kind::Interrupt(Interrupt {
                reason: "stop".into(),
            }),
            Kind::Interrupted(Interrupted { reason: "".into() }),
            Kind::ApprovalRequested(ApprovalRequested {
                tool_use_id: "toolu_2".into(),
                tool_name: "bash".into(),
                input: Some(input),
                reason: "needs a yes".into(),
            }),
            Kind::ApprovalDecision(ApprovalDecision {
                tool_use_id: "toolu_2".into(),
                approved: true,
                note: "fine".into(),
            }),
            Kind::ToolResult(ToolResult {
                tool_use_id: "toolu_3".into(),
                content: "served".into(),
                served_from: Some(ServedFrom {
                    session_id: "acme:s-0".into(),
                    seq: 9,
                }),
                ..ToolResult::default()
            }),
            Kind::SessionConfig(SessionConfig {
                model: "openai:gpt".into(),
                replay: Some(Replay {
                    session_id: "acme:s-0".into(),
                    after_seq: 1,
                    through_seq: 20,
                    off_path: OffPath::Stop as i32,
                }),
                ..SessionConfig::default()
            }),
            Kind::SessionConfig(SessionConfig {
                model: "anthropic:claude".into(),
                replay: Some(Replay::default()),
                ..SessionConfig::default()
            }),
            Kind::SessionConfig(SessionConfig {
                fallback_models: vec!["openai:gpt".into(), "anthropic:other".into()],
                budget: Some(Budget {
                    max_model_calls: 4,
                    max_tokens: u64::MAX,
                    max_seconds: 0,
                }),
                ..SessionConfig::default()
            }),
            Kind::ModelRetry(ModelRetry {
                turn: 3,
                attempt: 2,
                model: "anthropic:claude".into(),
                reason: "overloaded".into(),
                message: "HTTP 529".into(),
                retry_at_unix_ms: 1_700_000_000_000,
            }),
            Kind::RunPaused(RunPaused {
                reason: "budget".into(),
                detail: "max_model_calls 4 reached (4 replies)".into(),
            }),
        ];
        let mut events: Vec<Event> = kinds
            .into_iter()
            .enumerate()
            .map(|(i, kind)| Event {
                session_id: "acme:s-1".into(),
                seq: i as u64 + 1,
                event_id: format!("e{i}"),
                ts_unix_ms: -5 + i as i64,
                schema_version: 1,
                kind: Some(kind),
            })
            .collect();
        events.push(Event::default());
        events.push(Event {
            seq: u64::MAX,
            ts_unix_ms: i64::MIN,
            schema_version: u32::MAX,
            ..Event::default()
        });
        events
    }

    #[test]
    fn every_event_reads_back_exactly() {
        for event in every_kind() {
            let text = event_to_string(&event);
            let value: Value = serde_json::from_str(&text).expect("valid JSON");
            let back = event_from_json(&value).unwrap_or_else(|e| panic!("{text}: {e}"));
            assert_eq!(back, event, "{text}");
            assert_eq!(back.encode_to_vec(), event.encode_to_vec());
        }
    }

    #[test]
    fn it_is_the_mapping_grpcurl_prints() {
        let event = &every_kind()[0];
        let value: Value = serde_json::from_str(&event_to_string(event)).expect("JSON");
        assert_eq!(
            value,
            serde_json::json!({"sessionId": "acme:s-1", "seq": "1", "eventId": "e0",
                "tsUnixMs": "-5", "schemaVersion": 1,
                "userMessage": {"text": "hi\u{0}\t\"there\"\\ é"}})
        );
        let call = &every_kind()[1];
        let text = event_to_string(call);
        assert!(text.contains(r#""timeout_ms":5000"#), "{text}");
        assert!(
            text.contains(r#""inputTokens":"18446744073709551615""#),
            "{text}"
        );
    }

    #[test]
    fn proto_names_are_read_too_and_unknown_fields_refused() {
        let value = serde_json::json!({"session_id": "s", "seq": 3, "event_id": "x",
            "tool_result": {"tool_use_id": "t", "is_error": true}});
        let event = event_from_json(&value).expect("reads");
        assert_eq!((event.session_id.as_str(), event.seq), ("s", 3));
        assert!(matches!(event.kind, Some(Kind::ToolResult(ref r)) if r.is_error));
        for (bad, says) in [
            (
                serde_json::json!({"seq": "1", "sessionSettings": {"model": "m"}}),
                "sessionSettings",
            ),
            (serde_json::json!({"seq": "x"}), "`seq` must be an integer"),
            (serde_json::json!({"seq": "-1"}), "out of its type's range"),
            (
                serde_json::json!({"userMessage": {"text": 5}}),
                "`text` must be a string",
            ),
            (
                serde_json::json!({"userMessage": {}, "interrupt": {}}),
                "two kinds",
            ),
            (
                serde_json::json!({"toolStarted": {"attempt": 4294967296u64}}),
                "range",
            ),
            (serde_json::json!([1]), "must be a JSON object"),
        ] {
            let e = event_from_json(&bad).expect_err("refused");
            assert!(e.0.contains(says), "{bad}: {e}");
        }
    }

    /// Fails when a field is added to the protocol (a kind to `Event`, a field to a kind)
    /// without its mapping here: every field of every message reachable from `Event`,
    /// with its JSON name, must be one this module writes and reads.
    #[test]
    fn every_field_of_the_protocol_is_mapped() {
        let set = FileDescriptorSet::decode(crate::FILE_DESCRIPTOR_SET).expect("descriptors");
        let messages: BTreeMap<String, &prost_types::DescriptorProto> = set
            .file
            .iter()
            .filter(|f| f.package() == "agentlog.v1")
            .flat_map(|f| f.message_type.iter())
            .map(|m| (m.name().to_string(), m))
            .collect();
        let mapped: BTreeMap<&str, &[&str]> = BTreeMap::from([
            (
                "Event",
                &[
                    "sessionId",
                    "seq",
                    "eventId",
                    "tsUnixMs",
                    "schemaVersion",
                    "userMessage",
                    "assistantMessage",
                    "toolStarted",
                    "toolResult",
                    "assistantDelta",
                    "runError",
                    "interrupt",
                    "interrupted",
                    "approvalRequested",
                    "approvalDecision",
                    "sessionConfig",
                    "modelRetry",
                    "runPaused",
                ][..],
            ),
            ("UserMessage", &["text"][..]),
            (
                "AssistantMessage",
                &["content", "stopReason", "model", "usage", "messageId"][..],
            ),
            (
                "ContentBlock",
                &["text", "toolUse", "thinking", "redactedThinking"][..],
            ),
            ("TextBlock", &["text"][..]),
            ("ToolUseBlock", &["id", "name", "input"][..]),
            ("ThinkingBlock", &["thinking", "signature"][..]),
            ("RedactedThinkingBlock", &["data"][..]),
            (
                "Usage",
                &[
                    "inputTokens",
                    "outputTokens",
                    "cacheCreationInputTokens",
                    "cacheReadInputTokens",
                ][..],
            ),
            (
                "ToolStarted",
                &["toolUseId", "idempotencyKey", "attempt"][..],
            ),
            (
                "ToolResult",
                &[
                    "toolUseId",
                    "content",
                    "isError",
                    "workspaceCheckpoint",
                    "servedFrom",
                ][..],
            ),
            ("ServedFrom", &["sessionId", "seq"][..]),
            (
                "SessionConfig",
                &["model", "replay", "fallbackModels", "budget"][..],
            ),
            ("Budget", &["maxModelCalls", "maxTokens", "maxSeconds"][..]),
            (
                "ModelRetry",
                &[
                    "turn",
                    "attempt",
                    "model",
                    "reason",
                    "message",
                    "retryAtUnixMs",
                ][..],
            ),
            ("RunPaused", &["reason", "detail"][..]),
            (
                "Replay",
                &["sessionId", "afterSeq", "throughSeq", "offPath"][..],
            ),
            ("AssistantDelta", &["turnId", "text"][..]),
            ("RunError", &["message", "retryable"][..]),
            ("Interrupt", &["reason"][..]),
            ("Interrupted", &["reason"][..]),
            (
                "ApprovalRequested",
                &["toolUseId", "toolName", "input", "reason"][..],
            ),
            ("ApprovalDecision", &["toolUseId", "approved", "note"][..]),
        ]);
        let mut todo = vec!["Event".to_string()];
        let mut seen = std::collections::BTreeSet::new();
        while let Some(name) = todo.pop() {
            if !seen.insert(name.clone()) {
                continue;
            }
            let message = messages[&name];
            let known = mapped.get(name.as_str()).unwrap_or_else(|| {
                panic!("message {name} is reachable from Event but has no JSON mapping here")
            });
            for field in &message.field {
                assert!(
                    known.contains(&field.json_name()),
                    "{name}.{} has no JSON mapping in proto/src/json.rs",
                    field.json_name()
                );
                let type_name = field.type_name().trim_start_matches(".agentlog.v1.");
                if messages.contains_key(type_name) {
                    todo.push(type_name.to_string());
                }
            }
        }
    }

    /// The field numbers this module walks into for unknown fields are the protocol's.
    #[test]
    fn the_kinds_and_blocks_have_their_field_numbers() {
        let set = FileDescriptorSet::decode(crate::FILE_DESCRIPTOR_SET).expect("descriptors");
        let number = |message: &str, json: &str| {
            set.file
                .iter()
                .flat_map(|f| f.message_type.iter())
                .find(|m| m.name() == message)
                .and_then(|m| m.field.iter().find(|f| f.json_name() == json))
                .map(|f| f.number() as u32)
                .unwrap_or_else(|| panic!("{message}.{json} is not in the protocol"))
        };
        for kind in every_kind().into_iter().filter_map(|e| e.kind) {
            let (name, n) = kind_field(&kind);
            assert_eq!(number("Event", name), n, "{name}");
        }
        for block in [
            Block::Text(TextBlock::default()),
            Block::ToolUse(ToolUseBlock::default()),
            Block::Thinking(ThinkingBlock::default()),
            Block::RedactedThinking(RedactedThinkingBlock::default()),
        ] {
            let (name, n) = block_field(&block);
            assert_eq!(number("ContentBlock", name), n, "{name}");
        }
        assert_eq!(number("AssistantMessage", "content"), 1);
        assert_eq!(number("AssistantMessage", "usage"), 4);
        assert_eq!(number("ToolResult", "servedFrom"), 5);
        assert_eq!(number("SessionConfig", "replay"), 2);
        assert_eq!(number("SessionConfig", "budget"), 4);
    }

    /// A newer writer's event: what this build does not know, at every depth, is written as
    /// `unknownFields` on the object that held it and put back where it was.
    #[test]
    fn unknown_fields_are_written_where_they_were_and_read_back_byte_for_byte() {
        use crate::fields::put_len_field;
        let mut block = ContentBlock::default().encode_to_vec();
        put_len_field(&mut block, 9, b"an image block");
        let mut text = ContentBlock {
            block: Some(Block::Text(TextBlock { text: "hi".into() })),
        }
        .encode_to_vec();
        // Inside the text block's own message (field 1 of the ContentBlock).
        let mut inner = TextBlock { text: "hi".into() }.encode_to_vec();
        inner.extend_from_slice(&[0x10, 0x01]);
        text.clear();
        put_len_field(&mut text, 1, &inner);
        let mut message = Vec::new();
        put_len_field(&mut message, 1, &text);
        put_len_field(&mut message, 1, &block);
        put_len_field(&mut message, 3, b"newer-model");
        put_len_field(&mut message, 6, b"new field");
        let mut newer = Event {
            session_id: "s".into(),
            seq: 2,
            event_id: "reply:0".into(),
            ..Event::default()
        }
        .encode_to_vec();
        put_len_field(&mut newer, 11, &message);
        put_len_field(&mut newer, 1000, b"trace");

        let event = Event::decode(&newer[..]).unwrap();
        let unknown = crate::unknown::find(&newer, crate::unknown::EVENT).unwrap();
        let mut out = Vec::new();
        write_event_keeping(&mut out, &event, &unknown);
        let value: Value = serde_json::from_slice(&out).unwrap();
        let b64 = |bytes: &[u8]| Value::String(BASE64_STANDARD.encode(bytes));
        assert_eq!(
            value["unknownFields"],
            b64(&[0xc2, 0x3e, 5, b't', b'r', b'a', b'c', b'e'])
        );
        let reply = &value["assistantMessage"];
        assert_eq!(
            reply["unknownFields"],
            b64(&[&[0x32, 9][..], b"new field"].concat())
        );
        assert_eq!(
            reply["content"][0]["text"]["unknownFields"],
            b64(&[0x10, 0x01])
        );
        assert_eq!(
            reply["content"][1]["unknownFields"],
            b64(&[&[0x4a, 14][..], b"an image block"].concat())
        );
        assert!(
            event_from_json(&value).is_err(),
            "the plain reader refuses them"
        );
        let (read, read_unknown) = event_from_json_keeping(&value).unwrap();
        assert_eq!(read, event);
        assert_eq!(read_unknown, unknown);
        let again = crate::unknown::splice(&read.encode_to_vec(), &read_unknown).unwrap();
        assert_eq!(again, newer);

        let bad = serde_json::json!({"userMessage": {"text": "x", "unknownFields": "%%%"}});
        let e = event_from_json_keeping(&bad).expect_err("not base64");
        assert!(e.0.contains("not base64"), "{e}");
        let cut = serde_json::json!({"unknownFields": BASE64_STANDARD.encode([0x0a, 0x05])});
        assert!(
            event_from_json_keeping(&cut).is_err(),
            "not a protobuf field"
        );
    }
}
