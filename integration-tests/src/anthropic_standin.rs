//! A stand-in for the Anthropic Messages API: a real HTTP server on `127.0.0.1:0` that
//! speaks the streaming protocol as the real one does (SSE `message_start` … `message_stop`,
//! thinking blocks with signatures, `input_json_delta` tool input in pieces, `ping`s) and
//! is as strict as the real one about what it is sent: every `tool_use` answered by
//! `tool_result` blocks leading the very next user message, thinking blocks sent back
//! unmodified, no empty text. A request that breaks a rule gets the API's 400
//! `invalid_request_error` and is recorded in [`Standin::violations`].
//!
//! Replies come from a script, picked (like `scripted:FILE`) by the number of assistant
//! turns in the request, so any number of sessions can share one stand-in; `message_start`
//! names the model the request asked for. Faults are scripted per model and per call, or
//! queued per turn (see `standin::script`), and sent as the API sends them: 529
//! `overloaded_error` (with or without retry advice), 429 `rate_limit_error` with the
//! `anthropic-ratelimit-*` headers, the spend limit's 429, 500 `api_error` and 504
//! `timeout_error`, an `error` event after the 200, a stream that stalls or is cut mid-reply,
//! a response that never starts, and a 400 refusal. Every error carries `request-id` and
//! `date`, and its body the API's `{"type": "error", "error": {type, message},
//! "request_id"}`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Result;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::routing::post;
use axum::Router;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::standin::{
    self, control, lock, never_answer, now_ms, Journal, ProviderClock, RateLimit, RecordedRequest,
    RetryAfter, Standin,
};

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

/// A failure served instead of (or in the middle of) a reply. In JSON (`model-standin`'s
/// `--faults` and `/control/fail`), snake case: `"cut_stream"`, `{"server_error": 504}`,
/// `{"stall": {"deltas": 2}}`, `{"overloaded_retry_after": {"date": UNIX_MS}}`,
/// `{"rate_limit": {"exhausted": "input_tokens", "reset_ms": 20000, "retry_after":
/// {"seconds": 20}}}`.
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fault {
    /// HTTP 529 `overloaded_error`, with a `retry-after` header when given (seconds).
    Overloaded { retry_after_s: Option<u64> },
    /// HTTP 529 `overloaded_error` with this retry advice (served as `"overloaded"`).
    OverloadedRetryAfter(RetryAfter),
    /// HTTP 429 `rate_limit_error` with the `anthropic-ratelimit-*` headers and the retry
    /// advice of the [`RateLimit`] (served as `"rate_limited"`).
    RateLimit(RateLimit),
    /// HTTP 429 `rate_limit_error` with `error.details.error_code`
    /// `enforced_spend_limit_reached` and no `retry-after`: the monthly spend limit, which
    /// waiting does not lift.
    SpendLimit,
    /// HTTP 5xx with the API's body: 504 `timeout_error`, any other `api_error`.
    ServerError(u16),
    /// HTTP 200, some of the stream, then the connection is aborted.
    CutStream,
    /// HTTP 200, `message_start`, then an `error` event (`overloaded_error`) and the end of
    /// the stream.
    ErrorEvent,
    /// HTTP 200 and the reply up to its first `deltas` text deltas (up to its
    /// `message_delta`, when it has no more), then silence with the connection held open
    /// until the caller closes it.
    Stall {
        #[serde(default)]
        deltas: usize,
    },
    /// The request is read and not a byte of response follows, not even the status line,
    /// until the caller closes the connection.
    NeverStarts,
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
    /// `GET /journal` (what it saw: the requests, each one's model and what it was served,
    /// the violations) and the fault controls (`standin::control`), for a test that runs
    /// the stand-in in a container.
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
            .with_state(journal.clone())
            .merge(control::routes(journal.clone()));
        Standin::serve_on(journal, app, addr).await
    }

    /// For `ANTHROPIC_BASE_URL`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

async fn messages(State(inner): State<Shared>, headers: HeaderMap, body: Bytes) -> Response {
    match answer(&inner, &headers, &body) {
        Some(response) => response,
        None => never_answer().await,
    }
}

/// The response to a request, or `None` for one that never starts.
fn answer(inner: &Shared, headers: &HeaderMap, body: &Bytes) -> Option<Response> {
    let received_unix_ms = now_ms();
    let received = Instant::now();
    let request: Value = match serde_json::from_slice(body) {
        Ok(request) => request,
        Err(e) => {
            return Some(error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                &format!("body is not JSON: {e}"),
            ))
        }
    };
    let mut state = lock(inner);
    if let Some(key) = &state.api_key {
        let sent = headers.get("x-api-key").and_then(|v| v.to_str().ok());
        if sent != Some(key.as_str()) {
            let message = "invalid x-api-key".to_string();
            state.violations.push(message.clone());
            return Some(error(
                StatusCode::UNAUTHORIZED,
                "authentication_error",
                &message,
            ));
        }
    }
    let checked = check_headers(headers).and_then(|()| check_request(&request));
    let turn = match &checked {
        Ok(turn) => *turn,
        Err(_) => count_assistant_turns(&request),
    };
    let first_user_text = first_user_text(&request);
    let model = request["model"].as_str().unwrap_or_default().to_string();
    let call = state.faults.take_call(&model);
    let record = |state: &mut Journal<StandinReply, Fault>, served: &str| {
        state.requests.push(RecordedRequest {
            turn,
            first_user_text: first_user_text.clone(),
            received_unix_ms,
            served: served.into(),
            body: request.clone(),
            model: model.clone(),
            call,
        })
    };
    let reject = |state: &mut Journal<StandinReply, Fault>, message: String| {
        state.violations.push(message.clone());
        record(state, "rejected");
        Some(error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            &message,
        ))
    };
    // The API's rules first; then a fault that answers before any reply, as a busy API
    // does without reading the conversation (whether or not the script has a reply);
    // then the script: the conversation must hold its replies as it gave them.
    if let Err(message) = checked {
        return reject(&mut state, message);
    }
    if let Some(hook) = state.hook.clone() {
        (hook.0)(&request);
    }
    let fault = state.faults.fault_for(&model, call, turn, received);
    let clock = state.clock.clone();
    if let Some(fault) = &fault {
        if let Some((served, response)) = refusal(fault, &clock) {
            record(&mut state, served);
            return Some(response);
        }
        if let Fault::NeverStarts = fault {
            record(&mut state, "never_starts");
            return None;
        }
    }
    if let Err(message) = check_verbatim(&state.replies, state.foreign_turns, &request) {
        return reject(&mut state, message);
    }
    let Some(reply) = state.replies.get(turn).cloned() else {
        record(&mut state, "rejected");
        return Some(error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            &format!("the stand-in has no reply for turn {turn}"),
        ));
    };
    let (served, ending) = match fault {
        Some(Fault::CutStream) => ("cut_stream", Ending::Cut),
        Some(Fault::ErrorEvent) => ("error_event", Ending::ErrorEvent),
        Some(Fault::Stall { deltas }) => ("stall", Ending::Stall(deltas)),
        _ => ("reply", Ending::Complete),
    };
    record(&mut state, served);
    drop(state);
    Some(stream(inner.clone(), turn, model, reply, ending))
}

/// The error response `fault` is, and its name in the journal; `None` for a fault that
/// streams or never answers.
fn refusal(fault: &Fault, clock: &ProviderClock) -> Option<(&'static str, Response)> {
    let overloaded = || {
        error(
            StatusCode::from_u16(529).unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
            "overloaded_error",
            "Overloaded",
        )
    };
    let (served, response) = match fault {
        Fault::Overloaded { retry_after_s } => {
            let mut response = overloaded();
            if let Some(seconds) = retry_after_s {
                RetryAfter::Seconds(*seconds).write(clock, response.headers_mut());
            }
            ("overloaded", response)
        }
        Fault::OverloadedRetryAfter(advice) => {
            let mut response = overloaded();
            advice.write(clock, response.headers_mut());
            ("overloaded", response)
        }
        Fault::RateLimit(limit) => {
            let mut response = error(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                "This request would exceed the rate limit for your organization. Please reduce the prompt length or the maximum tokens requested, or try again later.",
            );
            limit.write_anthropic(clock, response.headers_mut());
            ("rate_limited", response)
        }
        Fault::SpendLimit => {
            let body = json!({
                "type": "error",
                "error": {
                    "type": "rate_limit_error",
                    "message": "You have reached your specified API usage limits. You will regain access on the first day of next month at 00:00 UTC.",
                    "details": {"error_code": "enforced_spend_limit_reached"},
                },
                "request_id": request_id(),
            });
            (
                "spend_limit",
                json_response(StatusCode::TOO_MANY_REQUESTS, &body),
            )
        }
        Fault::ServerError(status) => {
            let status = StatusCode::from_u16(*status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
            let response = match status.as_u16() {
                504 => error(status, "timeout_error", "Request timed out"),
                _ => error(status, "api_error", "Internal server error"),
            };
            ("server_error", response)
        }
        Fault::BadRequest => (
            "bad_request",
            error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                "the stand-in refuses this request",
            ),
        ),
        Fault::CutStream | Fault::ErrorEvent | Fault::Stall { .. } | Fault::NeverStarts => {
            return None
        }
    };
    Some((served, response))
}

/// The API's error: `{"type": "error", "error": {type, message}, "request_id"}`.
fn error(status: StatusCode, kind: &str, message: &str) -> Response {
    let body = json!({
        "type": "error",
        "error": {"type": kind, "message": message},
        "request_id": request_id(),
    });
    json_response(status, &body)
}

/// A JSON response with the `request-id` its body names, as the API sends one.
fn json_response(status: StatusCode, body: &Value) -> Response {
    let id = body["request_id"].as_str().unwrap_or_default();
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .header("request-id", id)
        .body(Body::from(body.to_string()))
        .unwrap_or_default()
}

/// A fresh `req_…` id.
fn request_id() -> String {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    format!("req_standin{:016}", NEXT.fetch_add(1, Ordering::Relaxed))
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
    /// Hold the connection, silent, after this many text deltas.
    Stall(usize),
}

fn sse(event: &str, data: Value) -> Bytes {
    Bytes::from(format!("event: {event}\ndata: {data}\n\n"))
}

/// Streams the reply as the real API does, as from `model`.
fn stream(
    journal: Shared,
    turn: usize,
    model: String,
    reply: StandinReply,
    ending: Ending,
) -> Response {
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
        // A stalled stream sends nothing more; it ends when its caller closes the connection.
        let hold = || {
            let (tx, journal) = (tx.clone(), journal.clone());
            async move {
                tx.closed().await;
                lock(&journal).streams_dropped.push(now_ms());
            }
        };
        let id = format!("msg_standin_{turn}_{}", now_ms());
        let start = json!({"type": "message_start", "message": {"id": id, "type": "message", "role": "assistant", "model": model, "content": [], "stop_reason": null, "stop_sequence": null, "usage": {"input_tokens": 10 + turn, "output_tokens": 1}}});
        if !send(sse("message_start", start)).await {
            return;
        }
        if let Ending::ErrorEvent = ending {
            send(sse("error", json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}))).await;
            return;
        }
        let content = reply_content(turn, &reply);
        let mut text_deltas = 0;
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
                if data["delta"]["type"] == "text_delta" {
                    if let Ending::Stall(deltas) = ending {
                        if text_deltas == deltas {
                            return hold().await;
                        }
                    }
                    text_deltas += 1;
                }
                if name == "content_block_delta" && reply.chunk_delay_ms > 0 {
                    tokio::time::sleep(Duration::from_millis(reply.chunk_delay_ms)).await;
                }
                if !send(sse(name, data)).await {
                    return;
                }
                // A cut comes in the middle of the first text (or the first block).
                if matches!(ending, Ending::Cut) && index + 1 == content.len().min(2) && n == 1 {
                    standin::cut_connection(&tx).await;
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
        if let Ending::Stall(_) = ending {
            return hold().await;
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
