//! A stand-in for the Anthropic Messages API: a real HTTP server on `127.0.0.1:0` that
//! speaks the streaming protocol as the real one does (SSE `message_start` … `message_stop`,
//! thinking blocks with signatures, `input_json_delta` tool input in pieces, `ping`s) and
//! is as strict as the real one about what it is sent: every `tool_use` answered by
//! `tool_result` blocks leading the very next user message, thinking blocks sent back
//! unmodified, no empty text. A request that breaks a rule gets the API's 400
//! `invalid_request_error` and is recorded in [`Standin::violations`].
//!
//! Replies come from a script, picked (like `scripted:FILE`) by the number of assistant
//! turns in the request, so any number of sessions can share one stand-in. Faults can be
//! queued per turn: 529 overloaded, a stream cut mid-reply, an `error` event after the 200,
//! and a 400 refusal.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::Result;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::standin::{self, lock, now_ms, Journal, RecordedRequest, Standin};

/// One scripted reply: optional text, then tool calls. Every reply also carries a thinking
/// block with a signature, which must come back verbatim.
#[derive(Debug, Clone, Default)]
pub struct StandinReply {
    pub text: String,
    /// `(tool name, input object)`; ids are `toolu_<turn>_<i>`.
    pub tool_uses: Vec<(String, Value)>,
    /// Pause before each text delta, to give tests a window mid-stream.
    pub chunk_delay_ms: u64,
}

impl StandinReply {
    pub fn text(text: &str) -> StandinReply {
        StandinReply {
            text: text.into(),
            ..StandinReply::default()
        }
    }

    pub fn tool(mut self, name: &str, input: Value) -> StandinReply {
        self.tool_uses.push((name.into(), input));
        self
    }

    pub fn slow(mut self, chunk_delay_ms: u64) -> StandinReply {
        self.chunk_delay_ms = chunk_delay_ms;
        self
    }
}

/// A failure served instead of (or in the middle of) a reply.
#[derive(Debug, Clone)]
pub enum Fault {
    /// HTTP 529 `overloaded_error`, with a `retry-after` header when given (seconds).
    Overloaded { retry_after_s: Option<u64> },
    /// HTTP 200, some of the stream, then the connection is aborted.
    CutStream,
    /// HTTP 200, `message_start`, then an `error` event and the end of the stream.
    ErrorEvent,
    /// HTTP 400 `invalid_request_error`.
    BadRequest,
}

type Shared = standin::Shared<StandinReply, Fault>;

/// The running server; stops when dropped.
pub type AnthropicStandin = Standin<StandinReply, Fault>;

impl Standin<StandinReply, Fault> {
    /// Starts the server on a free port (needs a running tokio runtime).
    pub async fn start(replies: Vec<StandinReply>) -> Result<AnthropicStandin> {
        Standin::start_on(replies, SocketAddr::from(([127, 0, 0, 1], 0)), None).await
    }

    /// As [`Standin::start`], on `addr`, accepting only `api_key` when given. Also serves
    /// `GET /journal`: how many requests came, which were refused and why (for a test that
    /// runs the stand-in in a container).
    pub async fn start_on(
        replies: Vec<StandinReply>,
        addr: SocketAddr,
        api_key: Option<String>,
    ) -> Result<AnthropicStandin> {
        let mut journal = Journal::new(replies);
        journal.api_key = api_key;
        let journal: Shared = Arc::new(Mutex::new(journal));
        let app = Router::new()
            .route("/v1/messages", post(messages))
            .route("/journal", get(journal_summary))
            .with_state(journal.clone());
        Standin::serve_on(journal, app, addr).await
    }

    /// For `ANTHROPIC_BASE_URL`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

async fn messages(State(inner): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    let received_unix_ms = now_ms();
    let request: Value = match serde_json::from_slice(&body) {
        Ok(request) => request,
        Err(e) => {
            return error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                &format!("body is not JSON: {e}"),
            )
        }
    };
    let mut state = lock(&inner);
    if let Some(key) = &state.api_key {
        let sent = headers.get("x-api-key").and_then(|v| v.to_str().ok());
        if sent != Some(key.as_str()) {
            let message = "invalid x-api-key".to_string();
            state.violations.push(message.clone());
            return error(StatusCode::UNAUTHORIZED, "authentication_error", &message);
        }
    }
    let checked = check_headers(&headers).and_then(|()| check_request(&request));
    let turn = match &checked {
        Ok(turn) => *turn,
        Err(_) => count_assistant_turns(&request),
    };
    let first_user_text = first_user_text(&request);
    let record = |state: &mut Journal<StandinReply, Fault>, served: &str| {
        state.requests.push(RecordedRequest {
            turn,
            first_user_text: first_user_text.clone(),
            received_unix_ms,
            served: served.into(),
            body: request.clone(),
        })
    };
    if let Err(message) = checked.and_then(|turn| {
        check_verbatim(&state.replies, state.foreign_turns, &request).map(|()| turn)
    }) {
        state.violations.push(message.clone());
        record(&mut state, "rejected");
        return error(StatusCode::BAD_REQUEST, "invalid_request_error", &message);
    }
    if let Some(hook) = state.hook.clone() {
        (hook.0)(&request);
    }
    let fault = state.next_fault(turn);
    let Some(reply) = state.replies.get(turn).cloned() else {
        record(&mut state, "rejected");
        return error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            &format!("the stand-in has no reply for turn {turn}"),
        );
    };
    match fault {
        Some(Fault::Overloaded { retry_after_s }) => {
            record(&mut state, "overloaded");
            let mut response = error(
                StatusCode::from_u16(529).unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
                "overloaded_error",
                "Overloaded",
            );
            if let Some(seconds) = retry_after_s {
                if let Ok(value) = seconds.to_string().parse() {
                    response.headers_mut().insert("retry-after", value);
                }
            }
            response
        }
        Some(Fault::BadRequest) => {
            record(&mut state, "bad_request");
            error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "the stand-in refuses this request",
            )
        }
        Some(Fault::CutStream) => {
            record(&mut state, "cut_stream");
            drop(state);
            stream(inner.clone(), turn, reply, Ending::Cut)
        }
        Some(Fault::ErrorEvent) => {
            record(&mut state, "error_event");
            drop(state);
            stream(inner.clone(), turn, reply, Ending::ErrorEvent)
        }
        None => {
            record(&mut state, "reply");
            drop(state);
            stream(inner.clone(), turn, reply, Ending::Complete)
        }
    }
}

/// `{"requests": N, "replies": N, "violations": [...]}`: what the stand-in saw.
async fn journal_summary(State(inner): State<Shared>) -> Response {
    let state = lock(&inner);
    let replies = state
        .requests
        .iter()
        .filter(|r| r.served == "reply")
        .count();
    let body = json!({
        "requests": state.requests.len(),
        "replies": replies,
        "violations": state.violations,
    });
    Response::builder()
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap_or_default()
}

fn error(status: StatusCode, kind: &str, message: &str) -> Response {
    let body = json!({"type": "error", "error": {"type": kind, "message": message}});
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(Body::from(body.to_string()))
        .unwrap_or_default()
}

fn check_headers(headers: &HeaderMap) -> Result<(), String> {
    let header = |name: &str| {
        headers
            .get(name)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
    };
    if header("x-api-key").is_empty() {
        return Err("x-api-key header is required".into());
    }
    if header("anthropic-version") != "2023-06-01" {
        return Err(format!(
            "anthropic-version must be 2023-06-01, got {:?}",
            header("anthropic-version")
        ));
    }
    if !header("content-type").starts_with("application/json") {
        return Err("content-type must be application/json".into());
    }
    Ok(())
}

/// The API's content as a list of blocks (a string is one text block).
fn blocks(content: &Value) -> Vec<Value> {
    match content {
        Value::String(text) => vec![json!({"type": "text", "text": text})],
        Value::Array(blocks) => blocks.clone(),
        _ => Vec::new(),
    }
}

/// The messages with consecutive same-role turns merged, as the API merges them.
fn merged(request: &Value) -> Vec<(String, Vec<Value>)> {
    let mut out: Vec<(String, Vec<Value>)> = Vec::new();
    for message in request["messages"].as_array().into_iter().flatten() {
        let role = message["role"].as_str().unwrap_or_default().to_string();
        let content = blocks(&message["content"]);
        match out.last_mut() {
            Some((last, existing)) if *last == role => existing.extend(content),
            _ => out.push((role, content)),
        }
    }
    out
}

fn count_assistant_turns(request: &Value) -> usize {
    request["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|m| m["role"] == "assistant")
        .count()
}

fn first_user_text(request: &Value) -> String {
    merged(request)
        .first()
        .and_then(|(_, blocks)| blocks.iter().find(|b| b["type"] == "text"))
        .and_then(|b| b["text"].as_str())
        .unwrap_or_default()
        .to_string()
}

/// The API's rules; returns the turn being asked for.
fn check_request(request: &Value) -> Result<usize, String> {
    if request["model"].as_str().unwrap_or_default().is_empty() {
        return Err("model: Field required".into());
    }
    if request["max_tokens"].as_u64().unwrap_or(0) == 0 {
        return Err("max_tokens: Field required".into());
    }
    if request["stream"] != true {
        return Err("the stand-in only streams: stream must be true".into());
    }
    for tool in request["tools"].as_array().into_iter().flatten() {
        if tool["name"].as_str().unwrap_or_default().is_empty()
            || tool["input_schema"]["type"] != "object"
        {
            return Err(format!(
                "tools: each tool needs a name and an object input_schema: {tool}"
            ));
        }
    }
    let messages = merged(request);
    match messages.first() {
        None => return Err("messages: at least one message is required".into()),
        Some((role, _)) if role != "user" => {
            return Err("messages: first message must use the \"user\" role".into())
        }
        _ => {}
    }
    if messages.last().map(|(role, _)| role.as_str()) != Some("user") {
        return Err("messages: the final message must use the \"user\" role".into());
    }
    for (i, (role, content)) in messages.iter().enumerate() {
        if role != "user" && role != "assistant" {
            return Err(format!("messages.{i}.role: unexpected role {role:?}"));
        }
        if content.is_empty() {
            return Err(format!(
                "messages.{i}: all messages must have non-empty content"
            ));
        }
        for block in content {
            if block["type"] == "text" && block["text"].as_str().unwrap_or_default().is_empty() {
                return Err(format!(
                    "messages.{i}: text content blocks must be non-empty"
                ));
            }
        }
        let calls: Vec<&str> = content
            .iter()
            .filter(|b| b["type"] == "tool_use")
            .map(|b| b["id"].as_str().unwrap_or_default())
            .collect();
        let answered_calls: Vec<&str> = match i.checked_sub(1).map(|p| &messages[p]) {
            Some((prev_role, prev)) if prev_role == "assistant" => prev
                .iter()
                .filter(|b| b["type"] == "tool_use")
                .map(|b| b["id"].as_str().unwrap_or_default())
                .collect(),
            _ => Vec::new(),
        };
        let results: Vec<&str> = content
            .iter()
            .filter(|b| b["type"] == "tool_result")
            .map(|b| b["tool_use_id"].as_str().unwrap_or_default())
            .collect();
        if role == "assistant" {
            if !results.is_empty() {
                return Err(format!(
                    "messages.{i}: tool_result blocks are only allowed in user messages"
                ));
            }
            if !calls.is_empty() && i + 1 >= messages.len() {
                return Err(format!("messages.{i}: tool_use ids were found without tool_result blocks immediately after: {}", calls.join(", ")));
            }
            continue;
        }
        let leading: Vec<&str> = content
            .iter()
            .take_while(|b| b["type"] == "tool_result")
            .map(|b| b["tool_use_id"].as_str().unwrap_or_default())
            .collect();
        if leading != answered_calls || results != answered_calls {
            return Err(format!(
                "messages.{i}: tool_use ids were found without tool_result blocks immediately after: expected results for {answered_calls:?} first, in order, got {results:?} (leading {leading:?})"
            ));
        }
        for block in content.iter().filter(|b| b["type"] == "tool_result") {
            if !block["content"].is_string() && !block["content"].is_array() {
                return Err(format!(
                    "messages.{i}: tool_result content must be a string or blocks"
                ));
            }
        }
    }
    Ok(count_assistant_turns(request))
}

/// Assistant turns must be sent back exactly as streamed (thinking signatures included).
fn check_verbatim(replies: &[StandinReply], foreign: usize, request: &Value) -> Result<(), String> {
    let assistants = request["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|m| m["role"] == "assistant");
    for (turn, message) in assistants.enumerate().skip(foreign) {
        let Some(reply) = replies.get(turn) else {
            return Err(format!(
                "assistant turn {turn} was never produced by the stand-in"
            ));
        };
        let expected = reply_content(turn, reply);
        if blocks(&message["content"]) != expected {
            return Err(format!(
                "messages: assistant turn {turn} was modified: thinking blocks in the latest assistant message cannot be modified; sent {} expected {}",
                message["content"],
                Value::Array(expected)
            ));
        }
    }
    Ok(())
}

/// What the stand-in's reply for `turn` is, block for block.
fn reply_content(turn: usize, reply: &StandinReply) -> Vec<Value> {
    let mut content = vec![
        json!({"type": "thinking", "thinking": format!("Planning turn {turn}."), "signature": signature(turn)}),
    ];
    if !reply.text.is_empty() {
        content.push(json!({"type": "text", "text": reply.text}));
    }
    for (i, (name, input)) in reply.tool_uses.iter().enumerate() {
        content.push(json!({"type": "tool_use", "id": format!("toolu_{turn}_{i}"), "name": name, "input": input}));
    }
    content
}

fn signature(turn: usize) -> String {
    format!("EqQBCgIYAhIM{turn:04}sigsigsig")
}

#[derive(Clone, Copy)]
enum Ending {
    Complete,
    Cut,
    ErrorEvent,
}

fn sse(event: &str, data: Value) -> Bytes {
    Bytes::from(format!("event: {event}\ndata: {data}\n\n"))
}

/// Streams the reply as the real API does.
fn stream(journal: Shared, turn: usize, reply: StandinReply, ending: Ending) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(64);
    tokio::spawn(async move {
        let dropped = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let send = |bytes: Bytes| {
            let (tx, journal, dropped) = (tx.clone(), journal.clone(), dropped.clone());
            async move {
                let sent = tx.send(Ok(bytes)).await.is_ok();
                if !sent && !dropped.swap(true, std::sync::atomic::Ordering::SeqCst) {
                    lock(&journal).streams_dropped.push(now_ms());
                }
                sent
            }
        };
        let id = format!("msg_standin_{turn}_{}", now_ms());
        let start = json!({"type": "message_start", "message": {"id": id, "type": "message", "role": "assistant", "model": "standin", "content": [], "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": 10 + turn, "output_tokens": 1}}});
        if !send(sse("message_start", start)).await {
            return;
        }
        if let Ending::ErrorEvent = ending {
            send(sse("error", json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}))).await;
            return;
        }
        let content = reply_content(turn, &reply);
        for (index, block) in content.iter().enumerate() {
            let events: Vec<(&str, Value)> = match block["type"].as_str() {
                Some("thinking") => vec![
                    (
                        "content_block_start",
                        json!({"type": "content_block_start", "index": index, "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
                    ),
                    (
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": index, "delta": {"type": "thinking_delta", "thinking": block["thinking"]}}),
                    ),
                    (
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": index, "delta": {"type": "signature_delta", "signature": block["signature"]}}),
                    ),
                    ("ping", json!({"type": "ping"})),
                ],
                Some("text") => {
                    let text = block["text"].as_str().unwrap_or_default();
                    let mut events = vec![(
                        "content_block_start",
                        json!({"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": ""}}),
                    )];
                    for piece in text.split_inclusive(' ') {
                        events.push(("content_block_delta", json!({"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": piece}})));
                    }
                    events
                }
                _ => {
                    let input = block["input"].to_string();
                    let middle = input
                        .char_indices()
                        .nth(input.chars().count() / 2)
                        .map_or(0, |(i, _)| i);
                    vec![
                        (
                            "content_block_start",
                            json!({"type": "content_block_start", "index": index, "content_block": {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}}),
                        ),
                        (
                            "content_block_delta",
                            json!({"type": "content_block_delta", "index": index, "delta": {"type": "input_json_delta", "partial_json": &input[..middle]}}),
                        ),
                        (
                            "content_block_delta",
                            json!({"type": "content_block_delta", "index": index, "delta": {"type": "input_json_delta", "partial_json": &input[middle..]}}),
                        ),
                    ]
                }
            };
            for (n, (name, data)) in events.into_iter().enumerate() {
                if name == "content_block_delta" && reply.chunk_delay_ms > 0 {
                    tokio::time::sleep(Duration::from_millis(reply.chunk_delay_ms)).await;
                }
                if !send(sse(name, data)).await {
                    return;
                }
                // A cut comes in the middle of the first text (or the first block).
                if matches!(ending, Ending::Cut) && index + 1 == content.len().min(2) && n == 1 {
                    let _ = tx
                        .send(Err(std::io::Error::other(
                            "connection reset by the stand-in",
                        )))
                        .await;
                    return;
                }
            }
            if !send(sse(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": index}),
            ))
            .await
            {
                return;
            }
        }
        let stop_reason = if reply.tool_uses.is_empty() {
            "end_turn"
        } else {
            "tool_use"
        };
        send(sse("message_delta", json!({"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": null}, "usage": {"output_tokens": 20}}))).await;
        send(sse("message_stop", json!({"type": "message_stop"}))).await;
    });
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .body(Body::from_stream(ReceiverStream::new(rx)))
        .unwrap_or_default()
}
