//! The Anthropic Messages API, streaming (`POST {ANTHROPIC_BASE_URL}/v1/messages`).
//!
//! Promise: the request carries every logged reply back verbatim (thinking blocks with
//! their signatures, redacted thinking, tool_use ids and inputs), and the returned
//! `AssistantMessage` holds exactly the blocks the stream delivered, complete: a stream
//! that ends before `message_stop`, or sends an `error` event, is a transient failure,
//! never a reply.

use agentlog_proto::v1::{
    content_block::Block, AssistantMessage, ContentBlock, RedactedThinkingBlock, TextBlock,
    ThinkingBlock, ToolUseBlock, Usage,
};
use serde::Serialize;
use serde_json::{json, Map, Value};

use super::{http, FailReason, ModelError, ModelRequest, TextSink};
use crate::fold::transcript::{Form, JsonElements};
use crate::fold::{Message, UserBlock};
use agentlog_client::json::{object_to_struct, struct_to_object};

const DEFAULT_BASE_URL: &str = "https://api.anthropic.com";
const API_VERSION: &str = "2023-06-01";

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error(
        "no Anthropic API key: put it in a file named by --anthropic-api-key-file \
         (ANTHROPIC_API_KEY_FILE), or in ANTHROPIC_API_KEY, to use --model anthropic:MODEL"
    )]
    MissingKey,
}

#[derive(Debug)]
pub struct Anthropic {
    client: reqwest::Client,
    base_url: String,
    api_key: String,
    model: String,
}

impl Anthropic {
    /// With the key the runner read at start; reads `ANTHROPIC_BASE_URL`.
    pub fn new(model: &str, api_key: Option<String>) -> Result<Anthropic, ConfigError> {
        let api_key = api_key.ok_or(ConfigError::MissingKey)?;
        let base_url = std::env::var("ANTHROPIC_BASE_URL")
            .ok()
            .filter(|url| !url.is_empty())
            .unwrap_or_else(|| DEFAULT_BASE_URL.to_string());
        Ok(Anthropic {
            client: http::client(),
            base_url: base_url.trim_end_matches('/').to_string(),
            api_key,
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
        let response = http::send(
            self.client
                .post(format!("{}/v1/messages", self.base_url))
                .header("x-api-key", &self.api_key)
                .header("anthropic-version", API_VERSION)
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(request_body(&self.model, request)?),
            request.idle_timeout,
        )
        .await?;
        let mut events = http::events(response);
        let mut reply = Assembly::default();
        while let Some(event) = http::next_event(&mut events, request.idle_timeout).await? {
            let data: Value = match serde_json::from_str(&event.data) {
                Ok(data) => data,
                // `ping` and future events may carry anything; only known ones matter.
                Err(_) => continue,
            };
            if let Some(delta) = reply.apply(&data)? {
                text.send(&delta).await;
            }
            if reply.stopped {
                return Ok(reply.finish());
            }
        }
        Err(ModelError::transient(
            FailReason::Cut,
            "the stream ended before message_stop (cut mid-reply)",
        ))
    }
}

/// The Messages API's form of a message, which the fold keeps settled messages in.
pub static FORM: MessagesForm = MessagesForm;

#[derive(Debug)]
pub struct MessagesForm;

impl Form for MessagesForm {
    fn name(&self) -> &'static str {
        "anthropic-messages"
    }

    fn render(&self, message: &Message, out: &mut JsonElements) {
        match message {
            Message::User(blocks) => out.push(&MessageOut {
                role: "user",
                content: blocks.iter().filter_map(user_block).collect(),
            }),
            Message::Assistant(reply) => {
                let content: Vec<BlockOut<'_>> =
                    reply.content.iter().filter_map(assistant_block).collect();
                // The API refuses an empty assistant turn; dropping one leaves two user turns
                // side by side, which the API merges.
                if !content.is_empty() {
                    out.push(&MessageOut {
                        role: "assistant",
                        content,
                    });
                }
            }
        }
    }
}

/// A message as the Messages API takes it, borrowing from the fold's message (written
/// straight to JSON, with no tree of values in between).
#[derive(Serialize)]
struct MessageOut<'a> {
    role: &'static str,
    content: Vec<BlockOut<'a>>,
}

#[derive(Serialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum BlockOut<'a> {
    Text {
        text: &'a str,
    },
    ToolUse {
        id: &'a str,
        name: &'a str,
        input: Map<String, Value>,
    },
    Thinking {
        thinking: &'a str,
        signature: &'a str,
    },
    RedactedThinking {
        data: &'a str,
    },
    ToolResult {
        tool_use_id: &'a str,
        content: &'a str,
        #[serde(skip_serializing_if = "std::ops::Not::not")]
        is_error: bool,
    },
}

/// The Messages API request body for a conversation.
pub fn request_body(model: &str, request: ModelRequest<'_>) -> Result<Vec<u8>, ModelError> {
    let tools: Vec<Value> = request
        .tools
        .iter()
        .map(|tool| {
            json!({
                "name": tool.name,
                "description": tool.description,
                "input_schema": tool.input_schema,
            })
        })
        .collect();
    let mut head = json!({
        "model": model,
        "max_tokens": request.max_tokens,
        "stream": true,
    });
    if !request.system.is_empty() {
        head["system"] = json!(request.system);
    }
    if !tools.is_empty() {
        head["tools"] = json!(tools);
    }
    super::json_body(head, &JsonElements::default(), &FORM, request.conversation)
}

fn user_block(block: &UserBlock) -> Option<BlockOut<'_>> {
    match block {
        UserBlock::ToolResult(result) => Some(BlockOut::ToolResult {
            tool_use_id: &result.tool_use_id,
            content: &result.content,
            is_error: result.is_error,
        }),
        // The API refuses empty text blocks.
        UserBlock::Text(text) if text.is_empty() => None,
        UserBlock::Text(text) => Some(BlockOut::Text { text }),
    }
}

fn assistant_block(block: &ContentBlock) -> Option<BlockOut<'_>> {
    Some(match block.block.as_ref()? {
        Block::Text(TextBlock { text }) if text.is_empty() => return None,
        Block::Text(TextBlock { text }) => BlockOut::Text { text },
        Block::ToolUse(ToolUseBlock { id, name, input }) => BlockOut::ToolUse {
            id,
            name,
            input: struct_to_object(input.as_ref()),
        },
        Block::Thinking(ThinkingBlock {
            thinking,
            signature,
        }) => BlockOut::Thinking {
            thinking,
            signature,
        },
        Block::RedactedThinking(RedactedThinkingBlock { data }) => {
            BlockOut::RedactedThinking { data }
        }
    })
}

/// A reply being assembled from stream events.
#[derive(Debug, Default)]
struct Assembly {
    message: AssistantMessage,
    blocks: Vec<Partial>,
    stopped: bool,
}

#[derive(Debug)]
enum Partial {
    Text(String),
    ToolUse {
        id: String,
        name: String,
        json: String,
    },
    Thinking {
        thinking: String,
        signature: String,
    },
    Redacted(String),
    /// A block type this runner cannot log (server tools, …): left out of the record.
    Other,
}

impl Assembly {
    /// Applies one event; returns reply text to stream on.
    fn apply(&mut self, data: &Value) -> Result<Option<String>, ModelError> {
        match data["type"].as_str().unwrap_or_default() {
            "message_start" => {
                let message = &data["message"];
                self.message.message_id = str_of(&message["id"]);
                self.message.model = str_of(&message["model"]);
                self.usage(&message["usage"]);
            }
            "content_block_start" => {
                let index = data["index"].as_u64().unwrap_or(self.blocks.len() as u64) as usize;
                let block = &data["content_block"];
                let partial = match block["type"].as_str().unwrap_or_default() {
                    "text" => Partial::Text(str_of(&block["text"])),
                    "tool_use" => Partial::ToolUse {
                        id: str_of(&block["id"]),
                        name: str_of(&block["name"]),
                        json: String::new(),
                    },
                    "thinking" => Partial::Thinking {
                        thinking: str_of(&block["thinking"]),
                        signature: str_of(&block["signature"]),
                    },
                    "redacted_thinking" => Partial::Redacted(str_of(&block["data"])),
                    _ => Partial::Other,
                };
                while self.blocks.len() < index {
                    self.blocks.push(Partial::Other);
                }
                if index < self.blocks.len() {
                    self.blocks[index] = partial;
                } else {
                    self.blocks.push(partial);
                }
            }
            "content_block_delta" => {
                let index = data["index"].as_u64().unwrap_or(0) as usize;
                let delta = &data["delta"];
                let piece = |key: &str| delta[key].as_str().unwrap_or_default();
                match (self.blocks.get_mut(index), delta["type"].as_str()) {
                    (Some(Partial::Text(text)), Some("text_delta")) => {
                        text.push_str(piece("text"));
                        return Ok(Some(piece("text").to_string()));
                    }
                    (Some(Partial::ToolUse { json, .. }), Some("input_json_delta")) => {
                        json.push_str(piece("partial_json"))
                    }
                    (Some(Partial::Thinking { thinking, .. }), Some("thinking_delta")) => {
                        thinking.push_str(piece("thinking"))
                    }
                    (Some(Partial::Thinking { signature, .. }), Some("signature_delta")) => {
                        signature.push_str(piece("signature"))
                    }
                    _ => {}
                }
            }
            "message_delta" => {
                if let Some(reason) = data["delta"]["stop_reason"].as_str() {
                    self.message.stop_reason = reason.to_string();
                }
                self.usage(&data["usage"]);
            }
            "message_stop" => self.stopped = true,
            "error" => {
                return Err(ModelError::transient(
                    FailReason::ServerError,
                    format!(
                        "the stream reported an error: {}",
                        http::error_message(&data.to_string())
                    ),
                ))
            }
            _ => {}
        }
        Ok(None)
    }

    /// Usage figures are cumulative: the latest value of each wins.
    fn usage(&mut self, usage: &Value) {
        let u = self.message.usage.get_or_insert_with(Usage::default);
        let set = |field: &mut u64, key: &str| {
            if let Some(n) = usage[key].as_u64() {
                *field = n;
            }
        };
        set(&mut u.input_tokens, "input_tokens");
        set(&mut u.output_tokens, "output_tokens");
        set(
            &mut u.cache_creation_input_tokens,
            "cache_creation_input_tokens",
        );
        set(&mut u.cache_read_input_tokens, "cache_read_input_tokens");
    }

    fn finish(mut self) -> AssistantMessage {
        self.message.content = self
            .blocks
            .into_iter()
            .filter_map(|partial| {
                let block = match partial {
                    Partial::Text(text) => Block::Text(TextBlock { text }),
                    Partial::ToolUse { id, name, json } => Block::ToolUse(ToolUseBlock {
                        id,
                        name,
                        input: Some(object_to_struct(parse_input(&json))),
                    }),
                    Partial::Thinking {
                        thinking,
                        signature,
                    } => Block::Thinking(ThinkingBlock {
                        thinking,
                        signature,
                    }),
                    Partial::Redacted(data) => {
                        Block::RedactedThinking(RedactedThinkingBlock { data })
                    }
                    Partial::Other => return None,
                };
                Some(ContentBlock { block: Some(block) })
            })
            .collect();
        self.message
    }
}

/// The tool input, parsed once its block is complete. Input that is not a JSON object (a
/// reply cut by `max_tokens`) becomes `{}`: the tool then answers with an input error the
/// model can act on.
fn parse_input(json: &str) -> Map<String, Value> {
    match serde_json::from_str(json) {
        Ok(Value::Object(object)) => object,
        _ => Map::new(),
    }
}

fn str_of(value: &Value) -> String {
    value.as_str().unwrap_or_default().to_string()
}

#[cfg(test)]
mod tests {
    use crate::model::Failure;
    use agentlog_proto::v1::ToolResult;

    use super::*;
    use crate::fold::Conversation;
    use crate::tools::Toolbox;

    fn transcript() -> Vec<Value> {
        vec![
            json!({"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","model":"claude-x","content":[],"stop_reason":null,"usage":{"input_tokens":25,"output_tokens":1}}}),
            json!({"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":"","signature":""}}),
            json!({"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"let me"}}),
            json!({"type":"content_block_delta","index":0,"delta":{"type":"signature_delta","signature":"EqQB"}}),
            json!({"type":"content_block_stop","index":0}),
            json!({"type":"ping"}),
            json!({"type":"content_block_start","index":1,"content_block":{"type":"text","text":""}}),
            json!({"type":"content_block_delta","index":1,"delta":{"type":"text_delta","text":"Hello"}}),
            json!({"type":"content_block_delta","index":1,"delta":{"type":"text_delta","text":" there"}}),
            json!({"type":"content_block_stop","index":1}),
            json!({"type":"content_block_start","index":2,"content_block":{"type":"tool_use","id":"toolu_1","name":"bash","input":{}}}),
            json!({"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta","partial_json":"{\"command\": \"ec"}}),
            json!({"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta","partial_json":"ho hi\"}"}}),
            json!({"type":"content_block_stop","index":2}),
            json!({"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},"usage":{"output_tokens":15}}),
            json!({"type":"message_stop"}),
        ]
    }

    #[test]
    fn a_stream_assembles_into_the_verbatim_reply() {
        let mut assembly = Assembly::default();
        let mut streamed = String::new();
        for event in transcript() {
            if let Some(text) = assembly.apply(&event).expect("no error event") {
                streamed.push_str(&text);
            }
        }
        assert!(assembly.stopped);
        assert_eq!(streamed, "Hello there");
        let reply = assembly.finish();
        assert_eq!(reply.message_id, "msg_1");
        assert_eq!(reply.stop_reason, "tool_use");
        assert_eq!(
            reply.usage.map(|u| (u.input_tokens, u.output_tokens)),
            Some((25, 15))
        );

        // Sent back, the reply is block for block what the stream delivered.
        let conversation = Conversation::of(vec![
            Message::User(vec![UserBlock::Text("hi".into())]),
            Message::Assistant(reply),
            Message::User(vec![UserBlock::ToolResult(ToolResult {
                tool_use_id: "toolu_1".into(),
                content: "hi\n".into(),
                is_error: true,
                workspace_checkpoint: None,
                served_from: None,
            })]),
        ]);
        let tools = Toolbox::specs();
        let body = request_body(
            "claude-x",
            ModelRequest {
                system: "be brief",
                conversation: &conversation,
                tools: &tools,
                max_tokens: 1024,
                idle_timeout: std::time::Duration::from_secs(120),
            },
        )
        .expect("a conversation of messages only");
        let body: Value = serde_json::from_slice(&body).expect("the body is JSON");
        assert_eq!(
            body["messages"][1]["content"],
            json!([
                {"type": "thinking", "thinking": "let me", "signature": "EqQB"},
                {"type": "text", "text": "Hello there"},
                {"type": "tool_use", "id": "toolu_1", "name": "bash", "input": {"command": "echo hi"}},
            ])
        );
        assert_eq!(
            body["messages"][2]["content"],
            json!([{"type": "tool_result", "tool_use_id": "toolu_1", "content": "hi\n", "is_error": true}])
        );
        assert_eq!(body["system"], "be brief");
        assert_eq!(body["stream"], true);
        assert_eq!(body["tools"][0]["name"], "bash");
        assert_eq!(
            body["tools"][0]["input_schema"]["required"],
            json!(["command"])
        );
    }

    #[test]
    fn an_error_event_is_transient() {
        let mut assembly = Assembly::default();
        let error =
            json!({"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}});
        match assembly.apply(&error) {
            Err(ModelError::Transient(Failure {
                reason: FailReason::ServerError,
                message,
                ..
            })) => {
                assert!(
                    message.contains("overloaded_error: Overloaded"),
                    "{message}"
                )
            }
            other => panic!("expected a transient error, got {other:?}"),
        }
    }
}
