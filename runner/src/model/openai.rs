//! OpenAI-compatible chat completions, streaming (`POST {OPENAI_BASE_URL}/chat/completions`):
//! OpenAI, vLLM, Ollama, llama.cpp server.
//!
//! Promise: each logged tool result goes back as a `tool` message right after the
//! assistant message whose `tool_calls` it answers, and a reply is returned only once the
//! stream finished (`[DONE]`, or a `finish_reason` followed by the end of the stream).
//! Tool calls are assembled from their streamed fragments (by `index` as OpenAI sends them,
//! and by id where other servers get the index wrong), in the order they were opened, and
//! each gets an id no other call of the conversation has: some servers send no ids, or the same
//! `call_0` every turn, and the log pairs a result with its call by id (`result:<id>`), so a
//! repeated id would hand a new call an old result. Unlike Anthropic's, these ids carry no
//! signature; the server only needs them consistent within a request.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap, HashSet};

use agentlog_proto::v1::{
    content_block::Block, AssistantMessage, ContentBlock, TextBlock, ToolUseBlock, Usage,
};
use serde::Serialize;
use serde_json::{json, Map, Value};

use super::{http, FailReason, ModelError, ModelRequest, TextSink};
use crate::fold::transcript::{Form, JsonElements};
use crate::fold::{tool_uses, Conversation, Message, UserBlock};
use agentlog_client::json::{object_to_struct, struct_to_object};

const DEFAULT_BASE_URL: &str = "https://api.openai.com/v1";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("OPENAI_BASE_URL {0:?} is not an http(s) URL")]
    BadBaseUrl(String),
}

#[derive(Debug)]
pub struct OpenAi {
    client: reqwest::Client,
    base_url: String,
    api_key: Option<String>,
    model: String,
}

impl OpenAi {
    /// With the key the runner read at start (optional: local servers usually need none);
    /// reads `OPENAI_BASE_URL` (default the OpenAI API).
    pub fn new(model: &str, api_key: Option<String>) -> Result<OpenAi, ConfigError> {
        let base_url = std::env::var("OPENAI_BASE_URL")
            .ok()
            .filter(|url| !url.is_empty())
            .unwrap_or_else(|| DEFAULT_BASE_URL.to_string());
        if !(base_url.starts_with("http://") || base_url.starts_with("https://")) {
            return Err(ConfigError::BadBaseUrl(base_url));
        }
        Ok(OpenAi {
            client: http::client(),
            base_url: base_url.trim_end_matches('/').to_string(),
            api_key: api_key.filter(|k| !k.is_empty()),
            model: model.to_string(),
        })
    }

    pub fn name(&self) -> &str {
        &self.model
    }

    pub(super) async fn stream_reply(
        &self,
        request: ModelRequest<'_>,
        text: &TextSink,
    ) -> Result<AssistantMessage, ModelError> {
        let mut post = self
            .client
            .post(format!("{}/chat/completions", self.base_url))
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(request_body(&self.model, request)?);
        if let Some(key) = &self.api_key {
            post = post.bearer_auth(key);
        }
        let response = http::send(post, request.idle_timeout).await?;
        let mut events = http::events(response);
        let mut reply = Assembly::default();
        let ids = CallIds::of(request.conversation);
        while let Some(event) = http::next_event(&mut events, request.idle_timeout).await? {
            if event.data.trim() == "[DONE]" {
                return Ok(reply.finish(ids));
            }
            let Ok(chunk) = serde_json::from_str::<Value>(&event.data) else {
                continue;
            };
            if let Some(delta) = reply.apply(&chunk)? {
                text.send(&delta).await;
            }
        }
        // Some servers close the stream without `[DONE]`; a finish_reason says the reply
        // was complete all the same.
        if reply.message.stop_reason.is_empty() {
            Err(ModelError::transient(
                FailReason::Cut,
                "the stream ended before the reply finished (cut mid-reply)",
            ))
        } else {
            Ok(reply.finish(ids))
        }
    }
}

/// The tool-call ids of a conversation's replies, and the turn being asked for.
struct CallIds<'a> {
    /// The ids of the replies in the conversation's transcript.
    settled: &'a HashSet<String>,
    /// The ids of its later replies, and those handed out since.
    taken: HashSet<String>,
    turn: u64,
}

impl CallIds<'_> {
    fn of(conversation: &Conversation) -> CallIds<'_> {
        let taken = conversation
            .messages
            .iter()
            .filter_map(|m| match m {
                Message::Assistant(reply) => Some(reply),
                Message::User(_) => None,
            })
            .flat_map(|reply| tool_uses(reply).map(|call| call.id.clone()))
            .collect();
        CallIds {
            settled: conversation.transcript.call_ids(),
            taken,
            turn: conversation.replies(),
        }
    }

    fn take(&mut self, id: &str) -> bool {
        !self.settled.contains(id) && self.taken.insert(id.to_string())
    }

    /// `id` if the server gave one no earlier call has, else a fresh one; taken either way.
    fn claim(&mut self, id: String, index: u64) -> String {
        if !id.is_empty() && self.take(&id) {
            return id;
        }
        let base = format!("call_agentlog_{}_{index}", self.turn);
        let mut fresh = base.clone();
        let mut n = 1;
        while !self.take(&fresh) {
            n += 1;
            fresh = format!("{base}_{n}");
        }
        fresh
    }
}

/// The chat completions form of a message, which the fold keeps settled messages in.
pub static FORM: ChatForm = ChatForm;

#[derive(Debug)]
pub struct ChatForm;

impl Form for ChatForm {
    fn name(&self) -> &'static str {
        "openai-chat"
    }

    fn render(&self, message: &Message, out: &mut JsonElements) {
        match message {
            Message::User(blocks) => {
                let mut text = Vec::new();
                for block in blocks {
                    match block {
                        UserBlock::ToolResult(result) => out.push(&ChatMessageOut {
                            role: "tool",
                            tool_call_id: Some(&result.tool_use_id),
                            // The format has no error flag; say it in the content.
                            content: Some(if result.is_error {
                                Cow::Owned(format!("[error] {}", result.content))
                            } else {
                                Cow::Borrowed(&result.content)
                            }),
                            tool_calls: Vec::new(),
                        }),
                        UserBlock::Text(t) => text.push(t.as_str()),
                    }
                }
                if !text.is_empty() {
                    out.push(&ChatMessageOut {
                        role: "user",
                        tool_call_id: None,
                        content: Some(Cow::Owned(text.join("\n\n"))),
                        tool_calls: Vec::new(),
                    });
                }
            }
            Message::Assistant(reply) => out.push(&assistant_message(reply)),
        }
    }
}

/// A message as chat completions take it, borrowing from the fold's message where it can
/// (written straight to JSON, with no tree of values in between).
#[derive(Serialize)]
struct ChatMessageOut<'a> {
    role: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    tool_call_id: Option<&'a str>,
    /// `null` only beside `tool_calls`.
    content: Option<Cow<'a, str>>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    tool_calls: Vec<CallOut<'a>>,
}

#[derive(Serialize)]
struct CallOut<'a> {
    id: &'a str,
    #[serde(rename = "type")]
    kind: &'static str,
    function: FunctionOut<'a>,
}

#[derive(Serialize)]
struct FunctionOut<'a> {
    name: &'a str,
    arguments: String,
}

/// The chat completions request body for a conversation.
pub fn request_body(model: &str, request: ModelRequest<'_>) -> Result<Vec<u8>, ModelError> {
    let mut system = JsonElements::default();
    if !request.system.is_empty() {
        system.push(&json!({"role": "system", "content": request.system}));
    }
    let tools: Vec<Value> = request
        .tools
        .iter()
        .map(|tool| {
            json!({"type": "function", "function": {
                "name": tool.name,
                "description": tool.description,
                "parameters": tool.input_schema,
            }})
        })
        .collect();
    // `max_completion_tokens`, not the older `max_tokens` that OpenAI refuses for its
    // reasoning models; vLLM honours it too, and servers that do not know it ignore it.
    let mut head = json!({
        "model": model,
        "max_completion_tokens": request.max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    if !tools.is_empty() {
        head["tools"] = json!(tools);
    }
    super::json_body(head, &system, &FORM, request.conversation)
}

/// A logged reply in chat completions form. Thinking blocks have no place in this format
/// and are left out.
fn assistant_message(reply: &AssistantMessage) -> ChatMessageOut<'_> {
    let mut text = String::new();
    let mut tool_calls = Vec::new();
    for block in &reply.content {
        match &block.block {
            Some(Block::Text(t)) => text.push_str(&t.text),
            Some(Block::ToolUse(call)) => tool_calls.push(CallOut {
                id: &call.id,
                kind: "function",
                function: FunctionOut {
                    name: &call.name,
                    arguments: Value::Object(struct_to_object(call.input.as_ref())).to_string(),
                },
            }),
            _ => {}
        }
    }
    // `content` may be null only beside `tool_calls`: a reply that said nothing (a bare
    // `stop`, or one cut by `length`) goes back as empty text, which the API accepts.
    let content = (tool_calls.is_empty() || !text.is_empty()).then_some(Cow::Owned(text));
    ChatMessageOut {
        role: "assistant",
        tool_call_id: None,
        content,
        tool_calls,
    }
}

#[derive(Debug, Default)]
struct Assembly {
    message: AssistantMessage,
    text: String,
    /// In the order the calls were opened.
    calls: BTreeMap<u64, Call>,
    /// The stream's `index` → the call its fragments continue.
    slots: HashMap<u64, u64>,
}

#[derive(Debug, Default)]
struct Call {
    id: String,
    name: String,
    arguments: String,
}

impl Assembly {
    /// Applies one chunk; returns reply text to stream on.
    fn apply(&mut self, chunk: &Value) -> Result<Option<String>, ModelError> {
        if !chunk["error"].is_null() {
            return Err(ModelError::transient(
                FailReason::ServerError,
                format!(
                    "the stream reported an error: {}",
                    http::error_message(&chunk.to_string())
                ),
            ));
        }
        if let Some(id) = chunk["id"].as_str() {
            self.message.message_id = id.to_string();
        }
        if let Some(model) = chunk["model"].as_str() {
            self.message.model = model.to_string();
        }
        if let Some(usage) = chunk.get("usage").filter(|u| u.is_object()) {
            self.message.usage = Some(Usage {
                input_tokens: usage["prompt_tokens"].as_u64().unwrap_or(0),
                output_tokens: usage["completion_tokens"].as_u64().unwrap_or(0),
                ..Usage::default()
            });
        }
        let choice = &chunk["choices"][0];
        if let Some(reason) = choice["finish_reason"].as_str() {
            self.message.stop_reason = reason.to_string();
        }
        let delta = &choice["delta"];
        for fragment in delta["tool_calls"].as_array().into_iter().flatten() {
            let id = fragment["id"].as_str().unwrap_or_default();
            let key = self.slot(fragment["index"].as_u64(), id);
            let call = self.calls.entry(key).or_default();
            // An id is never split; some servers repeat it in every fragment.
            if call.id.is_empty() {
                call.id = id.to_string();
            }
            // A name may come in pieces; older llama.cpp servers repeat it whole in every
            // fragment instead.
            if let Some(name) = fragment["function"]["name"].as_str() {
                if name != call.name {
                    call.name.push_str(name);
                }
            }
            match &fragment["function"]["arguments"] {
                Value::String(piece) => call.arguments.push_str(piece),
                // Some servers send the arguments whole, as an object.
                Value::Object(object) => call.arguments = Value::Object(object.clone()).to_string(),
                _ => {}
            }
        }
        match delta["content"].as_str() {
            Some(content) if !content.is_empty() => {
                self.text.push_str(content);
                Ok(Some(content.to_string()))
            }
            _ => Ok(None),
        }
    }

    /// The call a fragment belongs to. OpenAI gives each call its own `index`; other
    /// servers do not always: a fragment with a known id continues that call (LocalAI
    /// repeats a call under several indexes), a new id at an index already taken opens a
    /// new call (Ollama gives every call index 0), and a fragment without an index
    /// continues the latest call unless its id is new.
    fn slot(&mut self, index: Option<u64>, id: &str) -> u64 {
        let next = self.calls.last_key_value().map_or(0, |(&key, _)| key + 1);
        let known = (!id.is_empty())
            .then(|| self.calls.iter().find(|(_, call)| call.id == id))
            .flatten()
            .map(|(&key, _)| key);
        let key = match (known, index) {
            (Some(key), _) => key,
            (None, Some(index)) => match self.slots.get(&index) {
                Some(&key)
                    if id.is_empty() || self.calls.get(&key).is_none_or(|c| c.id.is_empty()) =>
                {
                    key
                }
                _ => next,
            },
            (None, None) if id.is_empty() && next > 0 => next - 1,
            (None, None) => next,
        };
        if let Some(index) = index {
            self.slots.insert(index, key);
        }
        key
    }

    fn finish(mut self, mut ids: CallIds) -> AssistantMessage {
        let mut content = Vec::new();
        if !self.text.is_empty() {
            content.push(ContentBlock {
                block: Some(Block::Text(TextBlock { text: self.text })),
            });
        }
        for (index, call) in self.calls {
            let input = match serde_json::from_str(&call.arguments) {
                Ok(Value::Object(object)) => object,
                _ => Map::new(),
            };
            let id = ids.claim(call.id, index);
            content.push(ContentBlock {
                block: Some(Block::ToolUse(ToolUseBlock {
                    id,
                    name: call.name,
                    input: Some(object_to_struct(input)),
                })),
            });
        }
        self.message.content = content;
        self.message
    }
}

#[cfg(test)]
mod tests {
    use agentlog_proto::v1::ToolResult;

    use super::*;
    use crate::fold::Conversation;

    #[test]
    fn tool_calls_assemble_from_fragments_and_render_back() {
        let chunks = [
            json!({"id":"c1","model":"m","choices":[{"index":0,"delta":{"role":"assistant","content":"Let me"}}]}),
            json!({"id":"c1","choices":[{"index":0,"delta":{"content":" check."}}]}),
            json!({"id":"c1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_a","type":"function","function":{"name":"bash","arguments":""}}]}}]}),
            json!({"id":"c1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"comm"}}]}}]}),
            json!({"id":"c1","choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"and\":\"ls\"}"}}]}}]}),
            json!({"id":"c1","choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}),
            json!({"id":"c1","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":4}}),
        ];
        let mut assembly = Assembly::default();
        let mut streamed = String::new();
        for chunk in &chunks {
            if let Some(text) = assembly.apply(chunk).expect("no error chunk") {
                streamed.push_str(&text);
            }
        }
        assert_eq!(streamed, "Let me check.");
        let reply = assembly.finish(CallIds::of(&Conversation::default()));
        assert_eq!(reply.stop_reason, "tool_calls");
        assert_eq!(reply.usage.map(|u| u.output_tokens), Some(4));

        let conversation = Conversation::of(vec![
            Message::User(vec![UserBlock::Text("hi".into())]),
            Message::Assistant(reply),
            Message::User(vec![
                UserBlock::ToolResult(ToolResult {
                    tool_use_id: "call_a".into(),
                    content: "file\n".into(),
                    is_error: false,
                    workspace_checkpoint: None,
                    served_from: None,
                }),
                UserBlock::Text("and then?".into()),
            ]),
        ]);
        let body = request_body(
            "m",
            ModelRequest {
                system: "",
                conversation: &conversation,
                tools: &[],
                max_tokens: 100,
                idle_timeout: std::time::Duration::from_secs(120),
            },
        )
        .expect("a conversation of messages only");
        let body: Value = serde_json::from_slice(&body).expect("the body is JSON");
        assert_eq!(
            body["messages"],
            json!([
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "Let me check.", "tool_calls": [
                    {"id": "call_a", "type": "function", "function": {"name": "bash", "arguments": "{\"command\":\"ls\"}"}}
                ]},
                {"role": "tool", "tool_call_id": "call_a", "content": "file\n"},
                {"role": "user", "content": "and then?"},
            ])
        );
        assert!(body.get("tools").is_none());
        assert_eq!(body["max_completion_tokens"], 100);
    }

    /// What servers other than OpenAI send: the name and id repeated in every fragment, a
    /// name in pieces, fragments without an index, arguments whole as an object, every call
    /// at index 0, one call under two indexes.
    #[test]
    fn tool_calls_assemble_from_the_fragments_other_servers_send() {
        let chunks = [
            json!({"choices":[{"delta":{"tool_calls":[{"index":0,"id":"a","function":{"name":"bash","arguments":"{\"command\":"}}]}}]}),
            json!({"choices":[{"delta":{"tool_calls":[{"index":0,"id":"a","function":{"name":"bash","arguments":"\"ls\"}"}}]}}]}),
            json!({"choices":[{"delta":{"tool_calls":[{"index":1,"id":"b","function":{"name":"read_"}}]}}]}),
            json!({"choices":[{"delta":{"tool_calls":[{"index":1,"function":{"name":"file","arguments":"{\"path\": \"x\"}"}}]}}]}),
            json!({"choices":[{"delta":{"tool_calls":[{"id":"c","function":{"name":"list_files","arguments":"{"}}]}}]}),
            json!({"choices":[{"delta":{"tool_calls":[{"function":{"arguments":"}"}}]}}]}),
            json!({"choices":[{"delta":{"tool_calls":[{"id":"d","function":{"name":"write_file","arguments":{"path":"y","content":"z"}}}]}}]}),
            json!({"choices":[{"delta":{"tool_calls":[{"index":0,"id":"e","function":{"name":"bash","arguments":"{\"command\":\"pwd\"}"}}]}}]}),
            json!({"choices":[{"delta":{"tool_calls":[{"index":7,"id":"f","function":{"name":"read_file","arguments":"{\"path\":"}}]}}]}),
            json!({"choices":[{"delta":{"tool_calls":[{"index":8,"id":"f","function":{"arguments":"\"w\"}"}}]}}]}),
            json!({"choices":[{"delta":{},"finish_reason":"tool_calls"}]}),
        ];
        let mut assembly = Assembly::default();
        for chunk in &chunks {
            assembly.apply(chunk).expect("no error chunk");
        }
        let reply = assembly.finish(CallIds::of(&Conversation::default()));
        let calls: Vec<(String, String, Value)> = tool_uses(&reply)
            .map(|call| {
                (
                    call.id.clone(),
                    call.name.clone(),
                    Value::Object(struct_to_object(call.input.as_ref())),
                )
            })
            .collect();
        assert_eq!(
            calls,
            [
                ("a".into(), "bash".into(), json!({"command": "ls"})),
                ("b".into(), "read_file".into(), json!({"path": "x"})),
                ("c".into(), "list_files".into(), json!({})),
                (
                    "d".into(),
                    "write_file".into(),
                    json!({"path": "y", "content": "z"})
                ),
                ("e".into(), "bash".into(), json!({"command": "pwd"})),
                ("f".into(), "read_file".into(), json!({"path": "w"})),
            ]
        );
    }
}
