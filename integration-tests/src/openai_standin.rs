//! A stand-in for an OpenAI-compatible chat completions server: a real HTTP server on
//! `127.0.0.1:0` that streams as the real one does (`data:` chunks of
//! `chat.completion.chunk`, tool calls in fragments by `index`, a `finish_reason`, a usage
//! chunk, `data: [DONE]`) and is as strict as the real API about what it is sent: known
//! parameters only, known roles with their own fields, every assistant `tool_calls` entry
//! answered by a `tool` message before anything else is said, no `tool` message that answers
//! nothing, arguments as a JSON string, and every assistant turn sent back as it was
//! streamed. A request that breaks a rule gets the API's 400 `invalid_request_error` and is
//! recorded in [`Standin::violations`].
//!
//! The stream is deliberately awkward, within what servers do: tool-call arguments are cut
//! into pieces in the middle of their JSON, and several calls are interleaved by `index`
//! (two fragments in one chunk, too). Replies come from a script, picked by the number of
//! assistant turns in the request, so any number of sessions can share one stand-in.
//! Faults are scripted per model and per call, or queued per turn (see `standin::script`),
//! and sent as OpenAI and the servers compatible with it send them: 429 with the
//! `x-ratelimit-*` headers and retry advice, 429 `insufficient_quota` (a billing state), 503
//! while a model loads (as llama.cpp answers), other 5xx, a stream cut mid-reply or ended
//! early, an `error` chunk after the 200 (as vLLM sends), a stream that stalls, a response
//! that never starts, and a 400 refusal. Every error carries `x-request-id` and `date`, and
//! its body `{"error": {message, type, param, code}}`.

use std::collections::HashSet;
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
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use crate::standin::{
    self, control, lock, never_answer, now_ms, Journal, Limit, ProviderClock, RateLimit,
    RecordedRequest, RetryAfter, Standin,
};

/// One scripted reply: optional text, then tool calls.
#[derive(Debug, Clone, Default)]
pub struct StandinReply {
    pub text: String,
    /// `(function name, arguments object)`; ids are `call_<turn>_<i>`.
    pub tool_calls: Vec<(String, Value)>,
    /// Pause before each content chunk, to give tests a window mid-stream.
    pub chunk_delay_ms: u64,
}

impl StandinReply {
    /// A reply with this text (empty: a reply that says nothing).
    pub fn text(text: &str) -> StandinReply {
        StandinReply {
            text: text.into(),
            ..StandinReply::default()
        }
    }

    pub fn tool(mut self, name: &str, arguments: Value) -> StandinReply {
        self.tool_calls.push((name.into(), arguments));
        self
    }

    pub fn slow(mut self, chunk_delay_ms: u64) -> StandinReply {
        self.chunk_delay_ms = chunk_delay_ms;
        self
    }
}

/// How the stand-in streams tool calls: as OpenAI does, or with one of the quirks of other
/// OpenAI-compatible servers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Dialect {
    /// Ids `call_<turn>_<i>` (unique within a session), one `index` per call.
    #[default]
    OpenAi,
    /// Ids `call_<i>`: the same ids again in every turn.
    ReusedIds,
    /// No `id` in the stream at all.
    NoIds,
    /// Every call whole in one fragment, all at `index` 0 (as Ollama sends them).
    IndexZero,
}

/// A failure served instead of (or in the middle of) a reply. In JSON, snake case, as the
/// Anthropic stand-in's faults (`"insufficient_quota"`, `{"unavailable": {"millis":
/// 1500}}`, `{"rate_limit": {"exhausted": "tokens", "reset_ms": 360000}}`).
#[derive(Debug, Clone, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fault {
    /// HTTP 429 `rate_limit_exceeded`, with a `retry-after` header when given (seconds).
    RateLimited { retry_after_s: Option<u64> },
    /// HTTP 429 `rate_limit_exceeded` (type `requests` or `tokens`) with the
    /// `x-ratelimit-*` headers and the retry advice of the [`RateLimit`] (served as
    /// `"rate_limited"`).
    RateLimit(RateLimit),
    /// HTTP 429 whose type and code are `insufficient_quota`: out of credit, which waiting
    /// does not change.
    InsufficientQuota,
    /// HTTP 503 `unavailable_error` "Loading model", as llama.cpp's server answers while it
    /// loads a model, with this retry advice if any.
    Unavailable(Option<RetryAfter>),
    /// HTTP 5xx `server_error` with this status.
    ServerError(u16),
    /// HTTP 200, some of the stream (into the tool-call arguments when there are calls, else
    /// into the text), then the connection is aborted.
    CutStream,
    /// HTTP 200, the same part of the stream as [`Fault::CutStream`], then a clean end: no
    /// `finish_reason`, no `[DONE]`.
    StreamEnds,
    /// HTTP 200 and the whole reply with its `finish_reason`, then the end of the stream
    /// without the usage chunk or `[DONE]`, as some servers end: a complete reply all the same.
    NoDone,
    /// HTTP 200, a first chunk, then a `data: {"error": …}` chunk and the end of the stream.
    ErrorChunk,
    /// HTTP 200 and the reply up to its first `deltas` content chunks (up to its
    /// `finish_reason`, when it has no more), then silence with the connection held open
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
pub type OpenAiStandin = Standin<StandinReply, Fault>;

impl Standin<StandinReply, Fault> {
    /// Starts the server on a free port (needs a running tokio runtime).
    pub async fn start(replies: Vec<StandinReply>) -> Result<OpenAiStandin> {
        OpenAiStandin::start_with(replies, Dialect::OpenAi).await
    }

    /// Starts a server that streams tool calls in `dialect`. It also serves `GET /journal`
    /// and the fault controls (`standin::control`).
    pub async fn start_with(replies: Vec<StandinReply>, dialect: Dialect) -> Result<OpenAiStandin> {
        let journal: Shared = Arc::new(Mutex::new(Journal::new(replies)));
        let app = Router::new()
            .route("/v1/chat/completions", post(chat_completions))
            .with_state((journal.clone(), dialect))
            .merge(control::routes(journal.clone()));
        Standin::serve(journal, app).await
    }

    /// For `OPENAI_BASE_URL` (ends in `/v1`, as real base URLs do).
    pub fn url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }
}

async fn chat_completions(
    State((inner, dialect)): State<(Shared, Dialect)>,
    headers: HeaderMap,
    body: Bytes,
) -> Response {
    match answer(&inner, dialect, &headers, &body) {
        Some(response) => response,
        None => never_answer().await,
    }
}

/// The response to a request, or `None` for one that never starts.
fn answer(inner: &Shared, dialect: Dialect, headers: &HeaderMap, body: &Bytes) -> Option<Response> {
    let received_unix_ms = now_ms();
    if let Err(message) = check_auth(headers) {
        lock(inner).violations.push(message.clone());
        return Some(error(
            StatusCode::UNAUTHORIZED,
            "invalid_request_error",
            None,
            &message,
        ));
    }
    let request: Value = match serde_json::from_slice(body) {
        Ok(request) => request,
        Err(e) => {
            let message = format!("We could not parse the JSON body of your request: {e}");
            lock(inner).violations.push(message.clone());
            return Some(error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                None,
                &message,
            ));
        }
    };
    let received = Instant::now();
    let turn = count_assistant_turns(&request);
    let model = request["model"].as_str().unwrap_or_default().to_string();
    let mut state = lock(inner);
    let call = state.faults.take_call(&model);
    let record = |state: &mut Journal<StandinReply, Fault>, served: &str| {
        state.requests.push(RecordedRequest {
            turn,
            first_user_text: first_user_text(&request),
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
            None,
            &message,
        ))
    };
    // The API's rules first; then a fault that answers before any reply, as a busy API
    // does without reading the conversation (whether or not the script has a reply);
    // then the script: the conversation must hold its replies as it gave them.
    if let Err(message) = check_content_type(headers).and_then(|()| check_request(&request)) {
        return reject(&mut state, message);
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
    if let Err(message) = check_verbatim(&state.replies, state.foreign_turns, dialect, &request) {
        return reject(&mut state, message);
    }
    let Some(reply) = state.replies.get(turn).cloned() else {
        record(&mut state, "rejected");
        return Some(error(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            None,
            &format!("the stand-in has no reply for turn {turn}"),
        ));
    };
    let usage = request["stream_options"]["include_usage"] == true;
    let (served, ending) = match fault {
        Some(Fault::CutStream) => ("cut_stream", Ending::Cut),
        Some(Fault::StreamEnds) => ("stream_ends", Ending::Ends),
        Some(Fault::NoDone) => ("no_done", Ending::NoDone),
        Some(Fault::ErrorChunk) => ("error_chunk", Ending::ErrorChunk),
        Some(Fault::Stall { deltas }) => ("stall", Ending::Stall(deltas)),
        _ => ("reply", Ending::Complete),
    };
    record(&mut state, served);
    drop(state);
    Some(stream(
        inner.clone(),
        turn,
        model,
        usage,
        dialect,
        reply,
        ending,
    ))
}

/// The error response `fault` is, and its name in the journal; `None` for a fault that
/// streams or never answers.
fn refusal(fault: &Fault, clock: &ProviderClock) -> Option<(&'static str, Response)> {
    Some(match fault {
        Fault::RateLimited { retry_after_s } => {
            let mut response = error(
                StatusCode::TOO_MANY_REQUESTS,
                "requests",
                Some("rate_limit_exceeded"),
                "Rate limit reached for requests. Please try again later.",
            );
            if let Some(seconds) = retry_after_s {
                RetryAfter::Seconds(*seconds).write(clock, response.headers_mut());
            }
            ("rate_limited", response)
        }
        Fault::RateLimit(limit) => {
            let kind = match limit.exhausted {
                Limit::Requests => "requests",
                Limit::Tokens | Limit::InputTokens | Limit::OutputTokens => "tokens",
            };
            let mut response = error(
                StatusCode::TOO_MANY_REQUESTS,
                kind,
                Some("rate_limit_exceeded"),
                &format!(
                    "Rate limit reached for {kind} per min. Please try again in {}.",
                    standin::advice::go_duration(limit.reset_in)
                ),
            );
            limit.write_openai(clock, response.headers_mut());
            ("rate_limited", response)
        }
        Fault::InsufficientQuota => (
            "insufficient_quota",
            error(
                StatusCode::TOO_MANY_REQUESTS,
                "insufficient_quota",
                Some("insufficient_quota"),
                "You exceeded your current quota, please check your plan and billing details.",
            ),
        ),
        Fault::Unavailable(advice) => {
            let body = json!({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}});
            let mut response = json_response(StatusCode::SERVICE_UNAVAILABLE, &body);
            if let Some(advice) = advice {
                advice.write(clock, response.headers_mut());
            }
            ("unavailable", response)
        }
        Fault::ServerError(status) => (
            "server_error",
            error(
                StatusCode::from_u16(*status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
                "server_error",
                None,
                "The server had an error while processing your request. Sorry about that!",
            ),
        ),
        Fault::BadRequest => (
            "bad_request",
            error(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                None,
                "the stand-in refuses this request",
            ),
        ),
        Fault::CutStream
        | Fault::StreamEnds
        | Fault::NoDone
        | Fault::ErrorChunk
        | Fault::Stall { .. }
        | Fault::NeverStarts => return None,
    })
}

/// The API's error body: `{"error": {message, type, param, code}}`.
fn error(status: StatusCode, kind: &str, code: Option<&str>, message: &str) -> Response {
    let body = json!({"error": {"message": message, "type": kind, "param": null, "code": code}});
    json_response(status, &body)
}

/// A JSON response with a fresh `x-request-id`, as OpenAI sends one.
fn json_response(status: StatusCode, body: &Value) -> Response {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let id = format!("req_standin{:016x}", NEXT.fetch_add(1, Ordering::Relaxed));
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .header("x-request-id", id)
        .body(Body::from(body.to_string()))
        .unwrap_or_default()
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> &'a str {
    headers
        .get(name)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
}

fn check_auth(headers: &HeaderMap) -> Result<(), String> {
    match header(headers, "authorization").strip_prefix("Bearer ") {
        Some(key) if !key.trim().is_empty() => Ok(()),
        _ => Err("You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).".into()),
    }
}

fn check_content_type(headers: &HeaderMap) -> Result<(), String> {
    if header(headers, "content-type").starts_with("application/json") {
        Ok(())
    } else {
        Err("content-type must be application/json".into())
    }
}

fn count_assistant_turns(request: &Value) -> usize {
    messages(request)
        .iter()
        .filter(|m| m["role"] == "assistant")
        .count()
}

fn messages(request: &Value) -> &[Value] {
    request["messages"].as_array().map_or(&[], Vec::as_slice)
}

fn first_user_text(request: &Value) -> String {
    messages(request)
        .iter()
        .find(|m| m["role"] == "user")
        .map(|m| text_of(&m["content"]))
        .unwrap_or_default()
}

/// A content's text: the string, or its text parts joined.
fn text_of(content: &Value) -> String {
    match content {
        Value::String(text) => text.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|p| p["text"].as_str())
            .collect::<Vec<_>>()
            .join(""),
        _ => String::new(),
    }
}

/// Request parameters the API knows; anything else is refused by name.
const PARAMETERS: &[&str] = &[
    "model",
    "messages",
    "stream",
    "stream_options",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "n",
    "stop",
    "seed",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "top_logprobs",
    "response_format",
    "reasoning_effort",
    "metadata",
    "store",
    "service_tier",
];

/// The fields each role's message may carry.
fn message_fields(role: &str) -> Option<&'static [&'static str]> {
    Some(match role {
        "system" | "developer" | "user" => &["role", "content", "name"],
        "assistant" => &["role", "content", "name", "tool_calls", "refusal"],
        "tool" => &["role", "content", "tool_call_id"],
        _ => return None,
    })
}

fn unexpected_field(object: &Value, allowed: &[&str], at: &str) -> Result<(), String> {
    let extra: Vec<&String> = object
        .as_object()
        .into_iter()
        .flat_map(Map::keys)
        .filter(|k| !allowed.contains(&k.as_str()))
        .collect();
    match extra.first() {
        Some(key) => Err(format!(
            "Additional properties are not allowed ('{key}' was unexpected) - '{at}'"
        )),
        None => Ok(()),
    }
}

/// Text content: a string, or an array of `{type: "text", text}` parts.
fn check_text_content(content: &Value, at: &str) -> Result<(), String> {
    match content {
        Value::String(_) => Ok(()),
        Value::Array(parts) if !parts.is_empty() => {
            for (j, part) in parts.iter().enumerate() {
                if part["type"] != "text" || !part["text"].is_string() {
                    return Err(format!(
                        "Invalid value for '{at}.content[{j}]': expected a text part"
                    ));
                }
            }
            Ok(())
        }
        Value::Null => Err(format!(
            "Invalid value for '{at}.content': expected a string, got null."
        )),
        other => Err(format!(
            "Invalid type for '{at}.content': expected a string or an array of text parts, got {other}"
        )),
    }
}

/// The API's rules for a request.
fn check_request(request: &Value) -> Result<(), String> {
    let Some(object) = request.as_object() else {
        return Err("the request body must be a JSON object".into());
    };
    if let Some(key) = object.keys().find(|k| !PARAMETERS.contains(&k.as_str())) {
        return Err(format!("Unrecognized request argument supplied: {key}"));
    }
    if request["model"].as_str().unwrap_or_default().is_empty() {
        return Err("you must provide a model parameter".into());
    }
    if request["stream"] != true {
        return Err("the stand-in only streams: stream must be true".into());
    }
    if !request["stream_options"].is_null()
        && !request["stream_options"]["include_usage"].is_boolean()
    {
        return Err("Invalid type for 'stream_options.include_usage': expected a boolean".into());
    }
    for limit in ["max_tokens", "max_completion_tokens"] {
        if !request[limit].is_null() && request[limit].as_u64().unwrap_or(0) == 0 {
            return Err(format!(
                "Invalid '{limit}': expected a positive integer, got {}",
                request[limit]
            ));
        }
    }
    if !request["n"].is_null() && request["n"] != 1 {
        return Err("the stand-in answers with one choice: n must be 1".into());
    }
    check_tools(&request["tools"])?;
    let messages = match &request["messages"] {
        Value::Array(messages) if !messages.is_empty() => messages,
        Value::Array(_) => return Err("[] is too short - 'messages'".into()),
        _ => return Err("Missing required parameter: 'messages'.".into()),
    };
    // The ids of the last assistant turn's calls that no `tool` message has answered yet.
    let mut open: Vec<String> = Vec::new();
    let mut answerable: HashSet<String> = HashSet::new();
    for (i, message) in messages.iter().enumerate() {
        let at = format!("messages[{i}]");
        let role = message["role"].as_str().unwrap_or_default();
        let Some(fields) = message_fields(role) else {
            return Err(format!(
                "Invalid value: '{role}'. Supported values are: 'system', 'assistant', 'user', 'tool', and 'developer'. - '{at}.role'"
            ));
        };
        unexpected_field(message, fields, &at)?;
        if role != "tool" && !open.is_empty() {
            return Err(format!(
                "An assistant message with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'. The following tool_dialect did not have response messages: {}",
                open.join(", ")
            ));
        }
        match role {
            "tool" => {
                let id = message["tool_call_id"].as_str().unwrap_or_default();
                if id.is_empty() {
                    return Err(format!("Missing required parameter: '{at}.tool_call_id'."));
                }
                if !answerable.remove(id) {
                    return Err(format!(
                        "Invalid parameter: messages with role 'tool' must be a response to a preceding message with 'tool_calls' ({at} answers {id:?})."
                    ));
                }
                open.retain(|open_id| open_id != id);
                check_text_content(&message["content"], &at)?;
            }
            "assistant" => {
                answerable.clear();
                let calls = check_tool_calls(&message["tool_calls"], &at)?;
                if calls.is_empty() || !message["content"].is_null() {
                    check_text_content(&message["content"], &at)?;
                }
                answerable.extend(calls.iter().cloned());
                open = calls;
            }
            _ => {
                answerable.clear();
                check_text_content(&message["content"], &at)?;
            }
        }
    }
    if !open.is_empty() {
        return Err(format!(
            "An assistant message with 'tool_calls' must be followed by tool messages responding to each 'tool_call_id'. The following tool_dialect did not have response messages: {}",
            open.join(", ")
        ));
    }
    match messages.last().and_then(|m| m["role"].as_str()) {
        Some("user" | "tool") => Ok(()),
        _ => Err(
            "the stand-in answers a turn: the last message must be a user or tool message".into(),
        ),
    }
}

/// `tools: [{type: "function", function: {name, description?, parameters?}}]`.
fn check_tools(tools: &Value) -> Result<(), String> {
    let tools = match tools {
        Value::Null => return Ok(()),
        Value::Array(tools) if tools.is_empty() => return Err("[] is too short - 'tools'".into()),
        Value::Array(tools) => tools,
        _ => return Err("Invalid type for 'tools': expected an array".into()),
    };
    for (i, tool) in tools.iter().enumerate() {
        let at = format!("tools[{i}]");
        unexpected_field(tool, &["type", "function"], &at)?;
        if tool["type"] != "function" {
            return Err(format!(
                "Invalid value for '{at}.type': expected 'function'"
            ));
        }
        let function = &tool["function"];
        unexpected_field(
            function,
            &["name", "description", "parameters", "strict"],
            &format!("{at}.function"),
        )?;
        let name = function["name"].as_str().unwrap_or_default();
        let valid = !name.is_empty()
            && name.len() <= 64
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
        if !valid {
            return Err(format!(
                "Invalid '{at}.function.name': string does not match pattern. Expected a string that matches the pattern '^[a-zA-Z0-9_-]+$'."
            ));
        }
        if !function["description"].is_null() && !function["description"].is_string() {
            return Err(format!("Invalid type for '{at}.function.description'"));
        }
        let parameters = &function["parameters"];
        if !parameters.is_null() && parameters["type"] != "object" {
            return Err(format!(
                "Invalid schema for function '{name}': schema must be a JSON Schema of 'type: \"object\"'"
            ));
        }
    }
    Ok(())
}

/// An assistant message's `tool_calls` (absent, or a non-empty array of well-formed calls);
/// returns their ids.
fn check_tool_calls(calls: &Value, at: &str) -> Result<Vec<String>, String> {
    let calls = match calls {
        Value::Null => return Ok(Vec::new()),
        Value::Array(calls) if calls.is_empty() => {
            return Err(format!(
                "Invalid '{at}.tool_calls': empty array. Expected an array with minimum length 1, but got an empty array instead."
            ))
        }
        Value::Array(calls) => calls,
        _ => return Err(format!("Invalid type for '{at}.tool_calls': expected an array")),
    };
    let mut ids = Vec::new();
    for (j, call) in calls.iter().enumerate() {
        let at = format!("{at}.tool_calls[{j}]");
        unexpected_field(call, &["id", "type", "function"], &at)?;
        let id = call["id"].as_str().unwrap_or_default();
        if id.is_empty() {
            return Err(format!("Missing required parameter: '{at}.id'."));
        }
        if ids.iter().any(|seen| seen == id) {
            return Err(format!("Duplicate value for '{at}.id': {id:?}"));
        }
        if call["type"] != "function" {
            return Err(format!(
                "Invalid value for '{at}.type': expected 'function'"
            ));
        }
        unexpected_field(
            &call["function"],
            &["name", "arguments"],
            &format!("{at}.function"),
        )?;
        if call["function"]["name"]
            .as_str()
            .unwrap_or_default()
            .is_empty()
        {
            return Err(format!("Missing required parameter: '{at}.function.name'."));
        }
        let Some(arguments) = call["function"]["arguments"].as_str() else {
            return Err(format!(
                "Invalid type for '{at}.function.arguments': expected a string, but got {}.",
                match &call["function"]["arguments"] {
                    Value::Object(_) => "an object",
                    Value::Array(_) => "an array",
                    Value::Null => "null",
                    _ => "a scalar",
                }
            ));
        };
        // OpenAI passes the string through; vLLM and llama.cpp parse it for the chat
        // template, and refuse what is not a JSON object.
        if !matches!(
            serde_json::from_str::<Value>(arguments),
            Ok(Value::Object(_))
        ) {
            return Err(format!(
                "Invalid '{at}.function.arguments': not a JSON object: {arguments:?}"
            ));
        }
        ids.push(id.to_string());
    }
    Ok(ids)
}

/// Assistant turns must come back as they were streamed: the same text, the same calls
/// (names, and arguments that parse to the same JSON, integers still integers; and the ids,
/// when the stand-in gave unique ones).
fn check_verbatim(
    replies: &[StandinReply],
    foreign: usize,
    dialect: Dialect,
    request: &Value,
) -> Result<(), String> {
    let assistants = messages(request)
        .iter()
        .filter(|m| m["role"] == "assistant");
    for (turn, message) in assistants.enumerate().skip(foreign) {
        let Some(reply) = replies.get(turn) else {
            return Err(format!(
                "assistant turn {turn} was never produced by the stand-in"
            ));
        };
        let sent_calls: Vec<(String, String, Value)> = message["tool_calls"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|call| {
                let function = &call["function"];
                (
                    match dialect {
                        Dialect::OpenAi | Dialect::IndexZero => {
                            call["id"].as_str().unwrap_or_default().to_string()
                        }
                        Dialect::ReusedIds | Dialect::NoIds => String::new(),
                    },
                    function["name"].as_str().unwrap_or_default().to_string(),
                    function["arguments"]
                        .as_str()
                        .and_then(|a| serde_json::from_str(a).ok())
                        .unwrap_or(Value::Null),
                )
            })
            .collect();
        let expected_calls: Vec<(String, String, Value)> = reply
            .tool_calls
            .iter()
            .enumerate()
            .map(|(i, (name, arguments))| {
                let id = match dialect {
                    Dialect::OpenAi | Dialect::IndexZero => {
                        call_id(dialect, turn, i).unwrap_or_default()
                    }
                    Dialect::ReusedIds | Dialect::NoIds => String::new(),
                };
                (id, name.clone(), arguments.clone())
            })
            .collect();
        if text_of(&message["content"]) != reply.text || sent_calls != expected_calls {
            return Err(format!(
                "messages: assistant turn {turn} is not what the model said: sent {message}, expected text {:?} and calls {expected_calls:?}",
                reply.text
            ));
        }
    }
    Ok(())
}

/// The id the stand-in gives call `i` of `turn`, if any.
fn call_id(dialect: Dialect, turn: usize, i: usize) -> Option<String> {
    match dialect {
        Dialect::OpenAi | Dialect::IndexZero => Some(format!("call_{turn}_{i}")),
        Dialect::ReusedIds => Some(format!("call_{i}")),
        Dialect::NoIds => None,
    }
}

#[derive(Clone, Copy)]
enum Ending {
    Complete,
    Cut,
    Ends,
    NoDone,
    ErrorChunk,
    /// Hold the connection, silent, after this many content chunks.
    Stall(usize),
}

/// What one chunk carries in `choices[0]`.
enum Piece {
    Delta(Value),
    Finish(&'static str),
}

/// The reply as the stream's deltas, in the order they are sent: the role, the text in
/// pieces, then the calls interleaved by index with their arguments cut mid-JSON (or, in
/// [`Dialect::IndexZero`], each whole at index 0).
fn pieces(turn: usize, dialect: Dialect, reply: &StandinReply) -> Vec<Piece> {
    let mut pieces = vec![Piece::Delta(
        json!({"role": "assistant", "content": "", "refusal": null}),
    )];
    for text in reply.text.split_inclusive(' ') {
        pieces.push(Piece::Delta(json!({"content": text})));
    }
    if dialect == Dialect::IndexZero {
        for (i, (name, arguments)) in reply.tool_calls.iter().enumerate() {
            pieces.push(Piece::Delta(json!({"tool_calls": [{
                "index": 0, "id": call_id(dialect, turn, i), "type": "function",
                "function": {"name": name, "arguments": arguments.to_string()},
            }]})));
        }
        return finished(pieces, reply);
    }
    // Each call's arguments in three pieces, cut at a third and two thirds of the text.
    let arguments: Vec<Vec<String>> = reply
        .tool_calls
        .iter()
        .map(|(_, arguments)| thirds(&arguments.to_string()))
        .collect();
    let mut opened = 0;
    for round in 0..3 {
        // Round 0 opens the calls one by one, each followed by its first piece; later rounds
        // send every call's next piece in one chunk, highest index first.
        if round == 0 {
            for (i, (name, _)) in reply.tool_calls.iter().enumerate() {
                let mut opening = json!({
                    "index": i, "type": "function",
                    "function": {"name": name, "arguments": ""},
                });
                if let Some(id) = call_id(dialect, turn, i) {
                    opening["id"] = json!(id);
                }
                pieces.push(Piece::Delta(json!({ "tool_calls": [opening] })));
                pieces.push(Piece::Delta(json!({"tool_calls": [{
                    "index": i, "function": {"arguments": arguments[i][0]},
                }]})));
                opened += 1;
            }
        } else if opened > 0 {
            let fragments: Vec<Value> = (0..opened)
                .rev()
                .map(|i| json!({"index": i, "function": {"arguments": arguments[i][round]}}))
                .collect();
            pieces.push(Piece::Delta(json!({"tool_calls": fragments})));
        }
    }
    finished(pieces, reply)
}

/// The pieces with the `finish_reason` chunk after them.
fn finished(mut pieces: Vec<Piece>, reply: &StandinReply) -> Vec<Piece> {
    pieces.push(Piece::Finish(if reply.tool_calls.is_empty() {
        "stop"
    } else {
        "tool_calls"
    }));
    pieces
}

/// `text` in three pieces at character boundaries.
fn thirds(text: &str) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let (a, b) = (chars.len() / 3, 2 * chars.len() / 3);
    vec![
        chars[..a].iter().collect(),
        chars[a..b].iter().collect(),
        chars[b..].iter().collect(),
    ]
}

fn sse(data: &Value) -> Bytes {
    Bytes::from(format!("data: {data}\n\n"))
}

/// Streams the reply as the real API does.
fn stream(
    journal: Shared,
    turn: usize,
    model: String,
    usage: bool,
    dialect: Dialect,
    reply: StandinReply,
    ending: Ending,
) -> Response {
    let (tx, rx) = mpsc::channel::<Result<Bytes, std::io::Error>>(64);
    tokio::spawn(async move {
        let id = format!("chatcmpl-standin-{turn}-{}", now_ms());
        let created = now_ms() / 1000;
        let chunk = |choices: Value, usage_value: Value| {
            let mut chunk = json!({
                "id": id, "object": "chat.completion.chunk", "created": created,
                "model": model, "system_fingerprint": "fp_standin", "choices": choices,
            });
            if usage {
                chunk["usage"] = usage_value;
            }
            chunk
        };
        // A stalled stream sends nothing more; it ends when its caller closes the connection.
        let hold = || {
            let (tx, journal) = (tx.clone(), journal.clone());
            async move {
                tx.closed().await;
                lock(&journal).streams_dropped.push(now_ms());
            }
        };
        let pieces = pieces(turn, dialect, &reply);
        let mut content_chunks = 0;
        // The cut comes after the first piece of arguments when there are calls, else
        // after the first piece of text.
        let cut_at = pieces
            .iter()
            .position(|p| matches!(p, Piece::Delta(d) if d["tool_calls"][0]["function"]["arguments"].as_str().is_some_and(|a| !a.is_empty())))
            .unwrap_or(1);
        for (n, piece) in pieces.iter().enumerate() {
            if let Ending::Stall(deltas) = ending {
                let content = matches!(piece, Piece::Delta(d) if d["content"].as_str().is_some_and(|c| !c.is_empty()));
                if (content && content_chunks == deltas) || matches!(piece, Piece::Finish(_)) {
                    return hold().await;
                }
                content_chunks += usize::from(content);
            }
            if n > 0 && reply.chunk_delay_ms > 0 {
                tokio::time::sleep(Duration::from_millis(reply.chunk_delay_ms)).await;
            }
            let choice = match piece {
                Piece::Delta(delta) => {
                    json!({"index": 0, "delta": delta, "logprobs": null, "finish_reason": null})
                }
                Piece::Finish(reason) => {
                    json!({"index": 0, "delta": {}, "logprobs": null, "finish_reason": reason})
                }
            };
            if tx
                .send(Ok(sse(&chunk(json!([choice]), Value::Null))))
                .await
                .is_err()
            {
                return;
            }
            match ending {
                Ending::Ends if n == cut_at => return,
                Ending::Cut if n == cut_at => {
                    standin::cut_connection(&tx).await;
                    return;
                }
                // vLLM's way of failing after the 200: an error chunk, then the end.
                Ending::ErrorChunk if n == 1 => {
                    let error = json!({"error": {"message": "The model is overloaded; try again later.", "type": "server_error", "param": null, "code": 503}});
                    let _ = tx.send(Ok(sse(&error))).await;
                    return;
                }
                _ => {}
            }
        }
        if let Ending::NoDone = ending {
            return;
        }
        if usage {
            let figures = json!({"prompt_tokens": 10 + turn, "completion_tokens": 20, "total_tokens": 30 + turn});
            if tx.send(Ok(sse(&chunk(json!([]), figures)))).await.is_err() {
                return;
            }
        }
        let _ = tx.send(Ok(Bytes::from("data: [DONE]\n\n"))).await;
    });
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .body(Body::from_stream(ReceiverStream::new(rx)))
        .unwrap_or_default()
}
