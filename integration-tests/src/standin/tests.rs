//! Each stand-in started for real and called over HTTP, as the runner calls it: every fault
//! arrives as the provider sends it (status, headers, body, where a stream stops), and the
//! per-model, per-call script serves each call what was scripted for it.

use std::time::{Duration, Instant, SystemTime};

use reqwest::header::HeaderMap;
use reqwest::{Response, StatusCode};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use super::{refused_addr, FaultPlan, Limit, RateLimit, RetryAfter};
use crate::anthropic_standin::{self as anthropic, AnthropicStandin};
use crate::openai_standin::{self as openai, OpenAiStandin};

/// How long a test watches for something that must not arrive.
const QUIET: Duration = Duration::from_millis(500);

async fn anthropic_standin() -> AnthropicStandin {
    AnthropicStandin::start(vec![anthropic::StandinReply::text("one two three four")])
        .await
        .expect("start the Anthropic stand-in")
}

async fn openai_standin() -> OpenAiStandin {
    OpenAiStandin::start(vec![openai::StandinReply::text("one two three four")])
        .await
        .expect("start the OpenAI stand-in")
}

fn anthropic_body(model: &str) -> Value {
    json!({
        "model": model, "max_tokens": 100, "stream": true,
        "messages": [{"role": "user", "content": "hello"}],
    })
}

async fn ask_anthropic(standin: &AnthropicStandin, model: &str) -> Response {
    reqwest::Client::new()
        .post(format!("{}/v1/messages", standin.url()))
        .header("x-api-key", "key")
        .header("anthropic-version", "2023-06-01")
        .json(&anthropic_body(model))
        .send()
        .await
        .expect("the stand-in answers")
}

async fn ask_openai(standin: &OpenAiStandin, model: &str) -> Response {
    reqwest::Client::new()
        .post(format!("{}/chat/completions", standin.url()))
        .bearer_auth("key")
        .json(&json!({
            "model": model, "stream": true,
            "messages": [{"role": "user", "content": "hello"}],
        }))
        .send()
        .await
        .expect("the stand-in answers")
}

fn header<'a>(headers: &'a HeaderMap, name: &str) -> Option<&'a str> {
    headers
        .get(name)
        .map(|v| v.to_str().expect("an ASCII header"))
}

/// The `date` header, checked to be within a few seconds of this machine's clock shifted
/// by `skew_ms`.
fn date_of(headers: &HeaderMap, skew_ms: i64) -> SystemTime {
    let date = httpdate::parse_http_date(header(headers, "date").expect("a date header"))
        .expect("date is an HTTP date");
    let expected = super::ProviderClock::default();
    expected.set_skew_ms(skew_ms);
    let off = match date.duration_since(expected.now()) {
        Ok(ahead) => ahead,
        Err(behind) => behind.duration(),
    };
    assert!(off < Duration::from_secs(3), "date is {off:?} off");
    date
}

/// An error response: its status, that it is dated, and its JSON body.
async fn refusal(response: Response, status: u16) -> (HeaderMap, Value) {
    assert_eq!(response.status().as_u16(), status);
    assert_eq!(
        header(response.headers(), "content-type"),
        Some("application/json")
    );
    date_of(response.headers(), 0);
    let headers = response.headers().clone();
    let body = response.json().await.expect("a JSON error body");
    (headers, body)
}

/// Checks an Anthropic error body; returns its `error`.
fn anthropic_error(headers: &HeaderMap, body: &Value, kind: &str) -> Value {
    assert_eq!(body["type"], "error", "{body}");
    assert_eq!(body["error"]["type"], kind, "{body}");
    assert!(body["error"]["message"].is_string(), "{body}");
    let id = body["request_id"].as_str().expect("a request_id");
    assert!(id.starts_with("req_"), "{id}");
    assert_eq!(header(headers, "request-id"), Some(id));
    body["error"].clone()
}

fn openai_error(headers: &HeaderMap, body: &Value, kind: &str, code: Value) {
    assert_eq!(body["error"]["type"], kind, "{body}");
    assert_eq!(body["error"]["code"], code, "{body}");
    assert!(body["error"]["message"].is_string(), "{body}");
    assert!(body["error"]["param"].is_null(), "{body}");
    assert!(header(headers, "x-request-id").is_some());
}

/// Reads a 200 stream to its end; returns its text and whether the connection ended well.
async fn read_stream(mut response: Response) -> (String, bool) {
    assert_eq!(response.status(), StatusCode::OK);
    date_of(response.headers(), 0);
    let mut text = String::new();
    loop {
        match response.chunk().await {
            Ok(Some(chunk)) => text.push_str(&String::from_utf8_lossy(&chunk)),
            Ok(None) => return (text, true),
            Err(_) => return (text, false),
        }
    }
}

/// Reads a stream until `pattern` occurs `n` times; then checks nothing more comes for
/// [`QUIET`]. Returns what came, and the response (its connection still open).
async fn read_until_stalled(mut response: Response, pattern: &str, n: usize) -> (String, Response) {
    assert_eq!(response.status(), StatusCode::OK);
    let mut text = String::new();
    while text.matches(pattern).count() < n {
        let chunk = tokio::time::timeout(Duration::from_secs(10), response.chunk())
            .await
            .expect("the stream's start comes")
            .expect("the stream is not cut")
            .expect("the stream does not end");
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    let more = tokio::time::timeout(QUIET, response.chunk()).await;
    assert!(more.is_err(), "the stream went on: {more:?}");
    assert_eq!(text.matches(pattern).count(), n, "{text}");
    (text, response)
}

/// Polls until the stand-in found `n` streams dropped.
async fn wait_dropped(dropped: impl Fn() -> Vec<i64>, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while dropped().len() < n {
        assert!(
            Instant::now() < deadline,
            "the stand-in held a closed stream"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Sends `request` on a fresh connection; asserts not a byte comes back for [`QUIET`].
async fn assert_never_starts(addr: std::net::SocketAddr, request: String) {
    let mut connection = TcpStream::connect(addr).await.expect("connect");
    connection
        .write_all(request.as_bytes())
        .await
        .expect("send the request");
    let mut buf = [0u8; 1];
    let read = tokio::time::timeout(QUIET, connection.read(&mut buf)).await;
    assert!(read.is_err(), "the response started: {read:?}");
}

fn raw_post(path: &str, headers: &str, body: &Value) -> String {
    let body = body.to_string();
    format!(
        "POST {path} HTTP/1.1\r\nhost: standin\r\n{headers}content-type: application/json\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )
}

#[tokio::test]
async fn anthropic_529_carries_each_form_of_retry_advice() {
    let standin = anthropic_standin().await;
    let target = SystemTime::now() + Duration::from_millis(7_300);
    standin.fail_model(
        "m",
        FaultPlan::Calls(vec![
            anthropic::Fault::Overloaded {
                retry_after_s: None,
            },
            anthropic::Fault::OverloadedRetryAfter(RetryAfter::Seconds(7)),
            anthropic::Fault::OverloadedRetryAfter(RetryAfter::Millis(1500)),
            anthropic::Fault::OverloadedRetryAfter(RetryAfter::Date(target)),
        ]),
    );
    let mut advice = Vec::new();
    for _ in 0..4 {
        let (headers, body) = refusal(ask_anthropic(&standin, "m").await, 529).await;
        let error = anthropic_error(&headers, &body, "overloaded_error");
        assert_eq!(error["message"], "Overloaded");
        advice.push((
            header(&headers, "retry-after").map(str::to_string),
            header(&headers, "retry-after-ms").map(str::to_string),
        ));
    }
    let date = httpdate::fmt_http_date(super::advice::ceil_to_second(target));
    assert_eq!(
        advice,
        [
            (None, None),
            (Some("7".into()), None),
            (None, Some("1500".into())),
            (Some(date), None),
        ]
    );
    let (text, whole) = read_stream(ask_anthropic(&standin, "m").await).await;
    assert!(whole && text.contains("event: message_stop"), "{text}");
    let served: Vec<String> = standin.requests().into_iter().map(|r| r.served).collect();
    assert_eq!(
        served,
        [
            "overloaded",
            "overloaded",
            "overloaded",
            "overloaded",
            "reply"
        ]
    );
}

#[tokio::test]
async fn anthropic_429_names_the_exhausted_limit_and_its_reset() {
    let standin = anthropic_standin().await;
    // The provider's clock an hour ahead: its reset is to be read against its `date`.
    let skew_ms = 3_600_000;
    standin.set_clock_skew_ms(skew_ms);
    standin.fail_model(
        "m",
        FaultPlan::Calls(vec![anthropic::Fault::RateLimit(RateLimit::new(
            Limit::InputTokens,
            Duration::from_millis(19_500),
        ))]),
    );
    let response = ask_anthropic(&standin, "m").await;
    assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
    let date = date_of(response.headers(), skew_ms);
    let headers = response.headers().clone();
    let body: Value = response.json().await.expect("JSON");
    anthropic_error(&headers, &body, "rate_limit_error");
    assert_eq!(header(&headers, "retry-after"), Some("20"));
    let limit = |name: &str, field: &str| {
        header(&headers, &format!("anthropic-ratelimit-{name}-{field}"))
            .unwrap_or_else(|| panic!("anthropic-ratelimit-{name}-{field}"))
            .to_string()
    };
    for name in ["requests", "tokens", "input-tokens", "output-tokens"] {
        let reset = humantime::parse_rfc3339(&limit(name, "reset")).expect("an RFC 3339 reset");
        let in_ms = reset
            .duration_since(date)
            .map(|d| d.as_millis() as i64)
            .unwrap_or_else(|e| -(e.duration().as_millis() as i64));
        let exhausted = matches!(name, "input-tokens" | "tokens");
        if exhausted {
            assert_eq!(limit(name, "remaining"), "0", "{name}");
            assert!(
                (19_500..=21_000).contains(&in_ms),
                "{name} resets in {in_ms} ms"
            );
        } else {
            assert_eq!(limit(name, "remaining"), limit(name, "limit"), "{name}");
            assert!((0..=1_000).contains(&in_ms), "{name} resets in {in_ms} ms");
        }
    }
    assert_eq!(limit("tokens", "limit"), limit("input-tokens", "limit"));
}

#[tokio::test]
async fn anthropic_spend_limit_and_server_errors_are_the_apis() {
    let standin = anthropic_standin().await;
    standin.fail_model(
        "m",
        FaultPlan::Calls(vec![
            anthropic::Fault::SpendLimit,
            anthropic::Fault::ServerError(500),
            anthropic::Fault::ServerError(502),
            anthropic::Fault::ServerError(504),
        ]),
    );
    let (headers, body) = refusal(ask_anthropic(&standin, "m").await, 429).await;
    let error = anthropic_error(&headers, &body, "rate_limit_error");
    assert_eq!(
        error["details"]["error_code"],
        "enforced_spend_limit_reached"
    );
    assert_eq!(header(&headers, "retry-after"), None);
    for (status, kind) in [
        (500, "api_error"),
        (502, "api_error"),
        (504, "timeout_error"),
    ] {
        let (headers, body) = refusal(ask_anthropic(&standin, "m").await, status).await;
        anthropic_error(&headers, &body, kind);
    }
}

#[tokio::test]
async fn anthropic_stream_names_the_model_asked_for_and_fails_as_scripted() {
    let standin = anthropic_standin().await;
    let (text, whole) = read_stream(ask_anthropic(&standin, "claude-x").await).await;
    assert!(whole, "{text}");
    let start = text
        .lines()
        .find_map(|line| line.strip_prefix("data: "))
        .map(|data| serde_json::from_str::<Value>(data).expect("JSON"))
        .expect("a first event");
    assert_eq!(start["type"], "message_start");
    assert_eq!(start["message"]["model"], "claude-x");

    standin.fail_model(
        "m",
        FaultPlan::Calls(vec![
            anthropic::Fault::ErrorEvent,
            anthropic::Fault::CutStream,
        ]),
    );
    let (text, whole) = read_stream(ask_anthropic(&standin, "m").await).await;
    assert!(whole, "an error event ends the stream cleanly");
    let events: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("event: "))
        .collect();
    assert_eq!(events, ["message_start", "error"]);
    let error: Value = text
        .split("event: error\ndata: ")
        .nth(1)
        .and_then(|rest| rest.lines().next())
        .map(|data| serde_json::from_str(data).expect("JSON"))
        .expect("an error event");
    assert_eq!(
        error,
        json!({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}})
    );
    let (text, whole) = read_stream(ask_anthropic(&standin, "m").await).await;
    assert!(!whole, "a cut stream is an error on the connection");
    assert!(
        text.contains("text_delta") || text.contains("thinking_delta"),
        "{text}"
    );
    assert!(!text.contains("message_stop"), "{text}");
}

#[tokio::test]
async fn anthropic_stall_sends_its_deltas_then_holds_the_connection() {
    let standin = anthropic_standin().await;
    standin.fail_model(
        "m",
        FaultPlan::Calls(vec![anthropic::Fault::Stall { deltas: 2 }]),
    );
    let (text, stalled) =
        read_until_stalled(ask_anthropic(&standin, "m").await, "\"text_delta\"", 2).await;
    assert!(text.contains("\"text\":\"one \""), "{text}");
    tokio::time::sleep(QUIET).await;
    assert!(
        standin.streams_dropped().is_empty(),
        "held while the caller waits"
    );
    drop(stalled);
    wait_dropped(|| standin.streams_dropped(), 1).await;
    assert_eq!(standin.requests()[0].served, "stall");
}

#[tokio::test]
async fn a_response_that_never_starts_sends_nothing_at_all() {
    let standin = anthropic_standin().await;
    standin.fail_model("m", FaultPlan::Always(anthropic::Fault::NeverStarts));
    let headers = "x-api-key: key\r\nanthropic-version: 2023-06-01\r\n";
    let request = raw_post("/v1/messages", headers, &anthropic_body("m"));
    assert_never_starts(standin.addr, request).await;
    assert_eq!(standin.requests()[0].served, "never_starts");

    let standin = openai_standin().await;
    standin.fail_model("m", FaultPlan::Always(openai::Fault::NeverStarts));
    let body =
        json!({"model": "m", "stream": true, "messages": [{"role": "user", "content": "hi"}]});
    let request = raw_post(
        "/v1/chat/completions",
        "authorization: Bearer key\r\n",
        &body,
    );
    assert_never_starts(standin.addr, request).await;
    assert_eq!(standin.requests()[0].served, "never_starts");
}

#[tokio::test]
async fn a_stand_in_that_stopped_listening_refuses_until_it_listens_again() {
    let refused = |addr| async move {
        let error = TcpStream::connect(addr).await.expect_err("refused");
        assert_eq!(error.kind(), std::io::ErrorKind::ConnectionRefused);
    };
    refused(refused_addr()).await;

    let standin = anthropic_standin().await;
    standin.fail_model(
        "m",
        FaultPlan::Calls(vec![anthropic::Fault::Stall { deltas: 1 }]),
    );
    let mut stalled = ask_anthropic(&standin, "m").await;
    assert_eq!(stalled.status(), StatusCode::OK);
    standin.stop_listening().await;
    refused(standin.addr).await;
    // Going down closed the stream it held.
    let ended = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match stalled.chunk().await {
                Ok(Some(_)) => continue,
                other => return other.map(|_| ()),
            }
        }
    })
    .await
    .expect("the held stream ends when the stand-in goes down");
    assert!(ended.is_err(), "cut, not finished");

    standin.listen_again().await.expect("listen again");
    let (text, whole) = read_stream(ask_anthropic(&standin, "m").await).await;
    assert!(whole && text.contains("message_stop"), "{text}");
}

#[tokio::test]
async fn faults_follow_the_model_and_the_call() {
    let standin = anthropic_standin().await;
    let overloaded = || anthropic::Fault::Overloaded {
        retry_after_s: None,
    };
    standin.fail_model(
        "a",
        FaultPlan::Calls(vec![anthropic::Fault::ServerError(500)]),
    );
    standin.fail_model("a", FaultPlan::Call(3, anthropic::Fault::ServerError(504)));
    standin.fail_model("dead", FaultPlan::Always(overloaded()));
    standin.fail_model(
        "busy",
        FaultPlan::Until(Instant::now() + Duration::from_millis(300), overloaded()),
    );
    // A turn's queue is for calls no model script claims.
    standin.inject(0, anthropic::Fault::ServerError(502));

    let mut statuses = Vec::new();
    for model in ["a", "dead", "a", "busy", "a", "dead", "a"] {
        statuses.push((
            model,
            ask_anthropic(&standin, model).await.status().as_u16(),
        ));
    }
    assert_eq!(
        statuses,
        [
            ("a", 500),
            ("dead", 529),
            ("a", 502),
            ("busy", 529),
            ("a", 200),
            ("dead", 529),
            ("a", 504),
        ]
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        ask_anthropic(&standin, "busy").await.status(),
        StatusCode::OK
    );
    standin.clear_model("dead");
    assert_eq!(
        ask_anthropic(&standin, "dead").await.status(),
        StatusCode::OK
    );

    assert_eq!(
        (
            standin.calls_of("a"),
            standin.calls_of("dead"),
            standin.calls_of("busy")
        ),
        (4, 3, 2)
    );
    let a: Vec<(usize, String)> = standin
        .requests_of("a")
        .into_iter()
        .map(|r| (r.call, r.served))
        .collect();
    assert_eq!(
        a,
        [
            (0, "server_error".into()),
            (1, "server_error".into()),
            (2, "reply".into()),
            (3, "server_error".into()),
        ]
    );
    let times: Vec<i64> = standin
        .requests()
        .iter()
        .map(|r| r.received_unix_ms)
        .collect();
    assert!(times.windows(2).all(|w| w[0] <= w[1]), "{times:?}");
}

#[tokio::test]
async fn the_control_endpoints_fail_and_heal_a_model() {
    let standin = anthropic_standin().await;
    let client = reqwest::Client::new();
    let control = |path: &str, body: Value| {
        client
            .post(format!("{}/control/{path}", standin.url()))
            .json(&body)
            .send()
    };
    let failed = control(
        "fail",
        json!({"model": "m", "fault": {"server_error": 504}, "calls": 2}),
    )
    .await
    .expect("POST /control/fail");
    assert_eq!(failed.status(), StatusCode::OK);
    let failed = control("fail", json!({"model": "n", "fault": "spend_limit"}))
        .await
        .expect("POST /control/fail");
    assert_eq!(failed.status(), StatusCode::OK);
    let wrong = control("fail", json!({"model": "m", "fault": "on_fire"}))
        .await
        .expect("POST /control/fail");
    assert_eq!(wrong.status(), StatusCode::BAD_REQUEST);

    for (model, status) in [("m", 504), ("n", 429), ("m", 504), ("m", 200), ("n", 429)] {
        assert_eq!(
            ask_anthropic(&standin, model).await.status().as_u16(),
            status
        );
    }
    let healed = control("heal", json!({"model": "n"})).await.expect("heal");
    assert_eq!(healed.status(), StatusCode::OK);
    assert_eq!(ask_anthropic(&standin, "n").await.status(), StatusCode::OK);

    let journal: Value = client
        .get(format!("{}/journal", standin.url()))
        .send()
        .await
        .expect("GET /journal")
        .json()
        .await
        .expect("JSON");
    assert_eq!(journal["requests"], 6);
    assert_eq!(journal["replies"], 2);
    assert_eq!(journal["violations"], json!([]));
    assert_eq!(journal["models"], json!({"m": 3, "n": 3}));
    let calls = journal["calls"].as_array().expect("calls");
    assert_eq!(calls[1]["model"], "n");
    assert_eq!(calls[1]["call"], 0);
    assert_eq!(calls[1]["served"], "spend_limit");
    assert!(calls[1]["received_unix_ms"].as_i64().is_some());
}

#[tokio::test]
async fn openai_429s_say_which_limit_and_whether_waiting_helps() {
    let standin = openai_standin().await;
    standin.fail_model(
        "gpt",
        FaultPlan::Calls(vec![
            openai::Fault::RateLimit(
                RateLimit::new(Limit::Tokens, Duration::from_secs(360))
                    .retry_after(Some(RetryAfter::Millis(250))),
            ),
            openai::Fault::RateLimit(RateLimit::new(Limit::Requests, Duration::from_millis(20))),
            openai::Fault::InsufficientQuota,
        ]),
    );
    let (headers, body) = refusal(ask_openai(&standin, "gpt").await, 429).await;
    openai_error(&headers, &body, "tokens", json!("rate_limit_exceeded"));
    let fields = |headers: &HeaderMap| {
        [
            "x-ratelimit-limit-requests",
            "x-ratelimit-remaining-requests",
            "x-ratelimit-reset-requests",
            "x-ratelimit-limit-tokens",
            "x-ratelimit-remaining-tokens",
            "x-ratelimit-reset-tokens",
            "retry-after",
            "retry-after-ms",
        ]
        .map(|name| header(headers, name).map(str::to_string))
    };
    let some = |s: &str| Some(s.to_string());
    assert_eq!(
        fields(&headers),
        [
            some("500"),
            some("500"),
            some("0s"),
            some("30000"),
            some("0"),
            some("6m0s"),
            None,
            some("250")
        ]
    );
    let (headers, body) = refusal(ask_openai(&standin, "gpt").await, 429).await;
    openai_error(&headers, &body, "requests", json!("rate_limit_exceeded"));
    assert_eq!(
        fields(&headers),
        [
            some("500"),
            some("0"),
            some("20ms"),
            some("30000"),
            some("30000"),
            some("0s"),
            some("1"),
            None
        ]
    );
    let (headers, body) = refusal(ask_openai(&standin, "gpt").await, 429).await;
    openai_error(
        &headers,
        &body,
        "insufficient_quota",
        json!("insufficient_quota"),
    );
    assert_eq!(header(&headers, "retry-after"), None);
    let served: Vec<String> = standin.requests().into_iter().map(|r| r.served).collect();
    assert_eq!(
        served,
        ["rate_limited", "rate_limited", "insufficient_quota"]
    );
}

#[tokio::test]
async fn openai_5xx_are_dated_json_errors() {
    let standin = openai_standin().await;
    let back_at = SystemTime::now() + Duration::from_secs(30);
    standin.fail_model(
        "local",
        FaultPlan::Calls(vec![
            openai::Fault::Unavailable(Some(RetryAfter::Date(back_at))),
            openai::Fault::Unavailable(None),
            openai::Fault::ServerError(502),
            openai::Fault::ServerError(504),
        ]),
    );
    let (headers, body) = refusal(ask_openai(&standin, "local").await, 503).await;
    assert_eq!(
        body,
        json!({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}})
    );
    let retry = httpdate::parse_http_date(header(&headers, "retry-after").expect("retry-after"))
        .expect("an HTTP date");
    assert_eq!(retry, super::advice::ceil_to_second(back_at));
    let (headers, _) = refusal(ask_openai(&standin, "local").await, 503).await;
    assert_eq!(header(&headers, "retry-after"), None);
    for status in [502, 504] {
        let (headers, body) = refusal(ask_openai(&standin, "local").await, status).await;
        openai_error(&headers, &body, "server_error", Value::Null);
    }
}

#[tokio::test]
async fn openai_streams_fail_after_the_200_as_scripted() {
    let standin = openai_standin().await;
    standin.fail_model(
        "m",
        FaultPlan::Calls(vec![
            openai::Fault::ErrorChunk,
            openai::Fault::CutStream,
            openai::Fault::Stall { deltas: 1 },
        ]),
    );
    let (text, whole) = read_stream(ask_openai(&standin, "m").await).await;
    assert!(whole);
    let last = text
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .next_back()
        .map(|data| serde_json::from_str::<Value>(data).expect("JSON"))
        .expect("chunks");
    assert_eq!(last["error"]["type"], "server_error", "{text}");
    assert!(!text.contains("[DONE]"));

    let (text, whole) = read_stream(ask_openai(&standin, "m").await).await;
    assert!(!whole, "a cut stream is an error on the connection");
    assert!(text.contains("\"content\":\"one \""), "{text}");
    assert!(!text.contains("finish_reason\":\"stop") && !text.contains("[DONE]"));

    let (text, stalled) =
        read_until_stalled(ask_openai(&standin, "m").await, "\"content\":\"", 2).await;
    // The role chunk's empty content, then one piece of text.
    assert!(text.contains("\"content\":\"one \""), "{text}");
    assert!(standin.streams_dropped().is_empty());
    drop(stalled);
    wait_dropped(|| standin.streams_dropped(), 1).await;
    let (text, whole) = read_stream(ask_openai(&standin, "m").await).await;
    assert!(whole && text.ends_with("data: [DONE]\n\n"), "{text}");
    assert_eq!(standin.requests()[3].model, "m");
}
