//! The runner with `--model openai:…` against the real event store and the strict
//! OpenAI-compatible stand-in (`integration_tests::openai_standin`): a multi-step session
//! with parallel tool calls runs to the end through a 429 with `retry-after`, 5xx, streams
//! cut or ended mid-reply and an error chunk; a refused request ends the turn with
//! `run_error`; a reply that says nothing goes back as a valid turn; servers that send no
//! call ids, the same ones every turn, or every call at index 0 still get every call run
//! once; the stand-in refuses what the API refuses; and the session is exactly-once when
//! the runner is SIGKILLed at each point of a step and at random moments.

mod runner_support;

use std::path::Path;
use std::time::Duration;

use agentlog_proto::v1::{event::Kind, Event};
use integration_tests::openai_standin::{Dialect, Fault, OpenAiStandin, StandinReply};
use integration_tests::standin::RecordedRequest;
use integration_tests::Store;
use runner_support::sigkill::{sigkill_suite, KillModel, TTL_MS};
use runner_support::*;
use serde_json::json;

/// A `runner --model openai:standin-1` process pointed at the stand-in; SIGKILLed when
/// dropped.
fn start_openai_runner(
    store: &Store,
    id: &str,
    workspace_root: &Path,
    standin: &OpenAiStandin,
    ttl_ms: u64,
) -> RunnerProc {
    let url = standin.url();
    start_runner_on_model(
        &store.url(),
        id,
        workspace_root,
        (
            "openai:standin-1",
            &[
                ("OPENAI_BASE_URL", url.as_str()),
                ("OPENAI_API_KEY", "test-key"),
            ],
        ),
        ttl_ms,
        2,
        &[],
    )
}

/// Whether the log ends in a final chat completions reply.
fn ends_in_final_reply(events: &[Event]) -> bool {
    let last = events
        .iter()
        .rev()
        .find(|e| !matches!(e.kind, Some(Kind::AssistantDelta(_))));
    matches!(last.and_then(|e| e.kind.as_ref()), Some(Kind::AssistantMessage(m)) if m.stop_reason == "stop")
}

fn result_content(events: &[Event], tool_use_id: &str) -> Option<String> {
    events.iter().find_map(|e| match &e.kind {
        Some(Kind::ToolResult(r)) if r.tool_use_id == tool_use_id => Some(r.content.clone()),
        _ => None,
    })
}

#[tokio::test(flavor = "multi_thread")]
async fn a_session_with_parallel_calls_runs_to_the_end_through_transient_failures() {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    let standin = OpenAiStandin::start(vec![
        StandinReply::text("I will record the key and write a note.")
            .tool(
                "bash",
                json!({"command": "echo \"$IDEMPOTENCY_KEY\" >> keys.txt; echo done", "timeout_ms": 5000}),
            )
            .tool(
                "write_file",
                json!({"path": "notes/a.txt", "content": "hello, \"world\" {}"}),
            ),
        StandinReply::text("Now reading it back.")
            .tool("read_file", json!({"path": "notes/a.txt"}))
            .tool("list_files", json!({"path": "notes"})),
        StandinReply::text("All finished."),
    ])
    .await
    .expect("stand-in");
    standin.inject(
        0,
        Fault::RateLimited {
            retry_after_s: Some(1),
        },
    );
    standin.inject(0, Fault::ServerError(500));
    standin.inject(0, Fault::CutStream);
    standin.inject(1, Fault::ServerError(503));
    standin.inject(1, Fault::ErrorChunk);
    standin.inject(1, Fault::StreamEnds);
    standin.inject(2, Fault::NoDone);
    let workspaces = tempfile::tempdir().expect("temp dir");
    let mut runner = start_openai_runner(&store, "r1", workspaces.path(), &standin, 3000);

    user_says(&mut client, "s1", "please record the key").await;
    let events = wait_idle(&mut client, "s1", 0, Duration::from_secs(60)).await;

    assert_eq!(standin.violations(), Vec::<String>::new());
    assert_eq!(
        kinds(&events),
        [
            "user",
            "model_retry(openai:standin-1,rate_limited)",
            "model_retry(openai:standin-1,server_error)",
            "model_retry(openai:standin-1,cut)",
            "reply(tool_calls)",
            "started(call_0_0#1)",
            "result(call_0_0)",
            "started(call_0_1#1)",
            "result(call_0_1)",
            "model_retry(openai:standin-1,overloaded)",
            "model_retry(openai:standin-1,server_error)",
            "model_retry(openai:standin-1,cut)",
            "reply(tool_calls)",
            "started(call_1_0#1)",
            "result(call_1_0)",
            "started(call_1_1#1)",
            "result(call_1_1)",
            "reply(stop)",
        ]
    );
    assert_eq!(
        result_content(&events, "call_1_0").as_deref(),
        Some("hello, \"world\" {}"),
        "arguments cut mid-JSON were reassembled"
    );
    assert!(
        result_content(&events, "call_1_1").is_some_and(|listing| listing.contains("a.txt")),
        "{events:?}"
    );
    assert_eq!(
        std::fs::read_to_string(workspaces.path().join("s1/keys.txt"))
            .ok()
            .as_deref(),
        Some("s1/call_0_0\n")
    );
    assert!(
        events
            .iter()
            .any(|e| matches!(e.kind, Some(Kind::AssistantDelta(_)))),
        "text was streamed as deltas"
    );
    let usage = events.iter().find_map(|e| match &e.kind {
        Some(Kind::AssistantMessage(m)) => m.usage,
        _ => None,
    });
    assert_eq!(
        usage.map(|u| (u.input_tokens, u.output_tokens)),
        Some((10, 20))
    );

    let requests = standin.requests();
    let served: Vec<(usize, &str)> = requests
        .iter()
        .map(|r| (r.turn, r.served.as_str()))
        .collect();
    assert_eq!(
        served,
        [
            (0, "rate_limited"),
            (0, "server_error"),
            (0, "cut_stream"),
            (0, "reply"),
            (1, "server_error"),
            (1, "error_chunk"),
            (1, "stream_ends"),
            (1, "reply"),
            (2, "no_done"),
        ]
    );
    // `retry-after: 1` is a floor on the wait, whatever the backoff drew.
    assert!(
        requests[1].received_unix_ms - requests[0].received_unix_ms >= 1000,
        "the 429's retry-after was not honoured: {} ms",
        requests[1].received_unix_ms - requests[0].received_unix_ms
    );
    // The results went back as `tool` messages; the stand-in checked the pairing.
    let last = &requests[requests.len() - 1].body["messages"];
    let roles: Vec<&str> = last
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["role"].as_str())
        .collect();
    assert_eq!(
        roles,
        [
            "system",
            "user",
            "assistant",
            "tool",
            "tool",
            "assistant",
            "tool",
            "tool"
        ]
    );
    // The runner's default --max-tokens, under the name current servers honour.
    assert_eq!(requests[0].body["max_completion_tokens"], 8192);
    assert!(runner.terminate().success(), "runner exits 0 on SIGTERM");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_refused_request_ends_the_turn_with_run_error() {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    let standin = OpenAiStandin::start(vec![StandinReply::text("Hello again.")])
        .await
        .expect("stand-in");
    standin.inject(0, Fault::BadRequest);
    let workspaces = tempfile::tempdir().expect("temp dir");
    let _runner = start_openai_runner(&store, "r1", workspaces.path(), &standin, 3000);

    user_says(&mut client, "s2", "hi").await;
    let events = wait_idle(&mut client, "s2", 0, Duration::from_secs(30)).await;
    let logged = kinds(&events);
    assert_eq!(logged.len(), 2, "{logged:?}");
    assert!(
        logged[1].starts_with("run_error(HTTP 400")
            && logged[1].contains("invalid_request_error: the stand-in refuses this request"),
        "{logged:?}"
    );
    assert!(
        matches!(&events[1].kind, Some(Kind::RunError(e)) if !e.retryable),
        "a refusal is not retryable"
    );
    assert_eq!(standin.requests().len(), 1, "a refusal is not retried");

    // The user speaks again: the turn is asked for once more, both user turns in it.
    let again = user_says(&mut client, "s2", "again").await;
    let events = wait_idle(&mut client, "s2", again, Duration::from_secs(30)).await;
    assert!(ends_in_final_reply(&events), "{:?}", kinds(&events));
    assert_eq!(standin.violations(), Vec::<String>::new());
    let requests = standin.requests();
    let sent = requests[1].body["messages"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(sent.len(), 2, "{sent:?}");
    assert_eq!(sent[0]["role"], "system");
    assert_eq!(sent[1], json!({"role": "user", "content": "hi\n\nagain"}));
}

#[tokio::test(flavor = "multi_thread")]
async fn a_reply_that_says_nothing_goes_back_as_a_valid_turn() {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    let standin = OpenAiStandin::start(vec![
        StandinReply::text(""),
        StandinReply::text("Now I have something to say."),
    ])
    .await
    .expect("stand-in");
    let workspaces = tempfile::tempdir().expect("temp dir");
    let _runner = start_openai_runner(&store, "r1", workspaces.path(), &standin, 3000);

    user_says(&mut client, "s3", "say nothing").await;
    wait_idle(&mut client, "s3", 0, Duration::from_secs(30)).await;
    let again = user_says(&mut client, "s3", "now say something").await;
    let events = wait_idle(&mut client, "s3", again, Duration::from_secs(30)).await;
    assert_eq!(standin.violations(), Vec::<String>::new());
    assert_eq!(
        kinds(&events),
        ["user", "reply(stop)", "user", "reply(stop)"]
    );
}

/// Servers that name their calls `call_0`, `call_1`, … again in every turn, send no ids at
/// all, or put every call at index 0: each call is still assembled whole and gets an id of
/// its own in the session, so every call runs once and its result pairs with it, not with
/// an earlier call of the same name.
#[tokio::test(flavor = "multi_thread")]
async fn every_call_runs_once_whatever_the_servers_ids_and_indexes() {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    let workspaces = tempfile::tempdir().expect("temp dir");
    for (session, dialect) in [
        ("reused", Dialect::ReusedIds),
        ("missing", Dialect::NoIds),
        ("index-zero", Dialect::IndexZero),
    ] {
        let standin = OpenAiStandin::start_with(
            vec![
                StandinReply::text("First.").tool("bash", json!({"command": "echo one >> f"})),
                StandinReply::text("Second.")
                    .tool("bash", json!({"command": "echo two >> f"}))
                    .tool("bash", json!({"command": "echo three >> f"})),
                StandinReply::text("Done."),
            ],
            dialect,
        )
        .await
        .expect("stand-in");
        let _runner = start_openai_runner(&store, session, workspaces.path(), &standin, 3000);
        user_says(&mut client, session, session).await;
        let events = wait_idle(&mut client, session, 0, Duration::from_secs(30)).await;
        assert_eq!(standin.violations(), Vec::<String>::new(), "{session}");
        let ids = tool_use_ids(&events);
        let distinct: std::collections::HashSet<&String> = ids.iter().collect();
        assert_eq!((ids.len(), distinct.len()), (3, 3), "{session}: {ids:?}");
        assert!(
            ends_in_final_reply(&events),
            "{session}: {:?}",
            kinds(&events)
        );
        assert_eq!(
            std::fs::read_to_string(workspaces.path().join(session).join("f"))
                .ok()
                .as_deref(),
            Some("one\ntwo\nthree\n"),
            "{session}: every call ran once"
        );
    }
}

/// Posts `body` to the stand-in over a plain HTTP/1.1 connection; returns the status and
/// the response body.
async fn post_raw(
    standin: &OpenAiStandin,
    bearer: bool,
    body: &serde_json::Value,
) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let body = body.to_string();
    let auth = if bearer {
        "authorization: Bearer k\r\n"
    } else {
        ""
    };
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: standin\r\n{auth}content-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    let mut stream = tokio::net::TcpStream::connect(standin.addr)
        .await
        .expect("connect");
    stream.write_all(request.as_bytes()).await.expect("send");
    let mut response = String::new();
    stream.read_to_string(&mut response).await.expect("read");
    let status = response
        .split_whitespace()
        .nth(1)
        .and_then(|code| code.parse().ok())
        .unwrap_or(0);
    (status, response)
}

/// The stand-in is only as good as its strictness: each request here breaks one rule of the
/// API and must be refused with the API's words, and the well-formed one must be served.
#[tokio::test(flavor = "multi_thread")]
async fn the_standin_refuses_what_the_api_refuses() {
    let standin = OpenAiStandin::start(vec![
        StandinReply::text("Listing.").tool("list_files", json!({"path": "."})),
        StandinReply::text("Done."),
    ])
    .await
    .expect("stand-in");
    let user = json!({"role": "user", "content": "hi"});
    let call = json!({"id": "call_0_0", "type": "function", "function": {"name": "list_files", "arguments": "{\"path\":\".\"}"}});
    let assistant = json!({"role": "assistant", "content": "Listing.", "tool_calls": [call]});
    let answer = json!({"role": "tool", "tool_call_id": "call_0_0", "content": "a.txt"});
    let with =
        |messages: serde_json::Value| json!({"model": "m", "stream": true, "messages": messages});
    let with_call = |call: serde_json::Value| {
        with(json!([user, {"role": "assistant", "content": null, "tool_calls": [call]}, answer]))
    };
    let refused = [
        (
            with(json!([user, assistant])),
            "did not have response messages: call_0_0",
        ),
        (
            with(json!([user, assistant, user, answer])),
            "did not have response messages: call_0_0",
        ),
        (
            with(json!([user, answer])),
            "must be a response to a preceding message with 'tool_calls'",
        ),
        (
            with(json!([user, assistant, answer, answer])),
            "must be a response to a preceding message with 'tool_calls'",
        ),
        (
            with(json!([user, {"role": "model", "content": "x"}, user])),
            "Invalid value: 'model'",
        ),
        (
            with(json!([{"role": "user", "content": "hi", "tool_call_id": "x"}])),
            "('tool_call_id' was unexpected)",
        ),
        (
            with(json!([user, {"role": "assistant", "content": null}, user])),
            "expected a string, got null",
        ),
        (
            with(json!([user, {"role": "assistant", "content": "x", "tool_calls": []}, user])),
            "empty array",
        ),
        (
            with_call(
                json!({"id": "call_0_0", "type": "function", "function": {"name": "list_files", "arguments": {"path": "."}}}),
            ),
            "expected a string, but got an object",
        ),
        (
            with_call(
                json!({"id": "call_0_0", "type": "function", "function": {"name": "list_files", "arguments": "{\"path\":"}}),
            ),
            "not a JSON object",
        ),
        (
            with(
                json!([user, {"role": "assistant", "content": "Listing!", "tool_calls": [call]}, answer]),
            ),
            "is not what the model said",
        ),
        (
            json!({"model": "m", "stream": true, "messages": [user], "max_token": 5}),
            "Unrecognized request argument supplied: max_token",
        ),
        (
            json!({"model": "m", "stream": true, "messages": [user], "tools": []}),
            "[] is too short - 'tools'",
        ),
        (
            json!({"model": "m", "stream": true, "messages": []}),
            "[] is too short - 'messages'",
        ),
    ];
    for (body, words) in &refused {
        let (status, response) = post_raw(&standin, true, body).await;
        assert!(
            status == 400 && response.contains(words),
            "expected a 400 saying {words:?} for {body}, got {status}: {response}"
        );
    }
    let (status, _) = post_raw(&standin, false, &with(json!([user]))).await;
    assert_eq!(status, 401, "a request without a key");
    assert_eq!(standin.violations().len(), refused.len() + 1);

    let (status, response) =
        post_raw(&standin, true, &with(json!([user, assistant, answer]))).await;
    assert_eq!(status, 200, "{response}");
    assert!(response.contains("data: [DONE]"), "{response}");
}

// ---------------------------------------------------------------------------------------
// Exactly-once under SIGKILL
// ---------------------------------------------------------------------------------------

/// Three steps, each recording its key from bash; the middle one with two calls at once.
fn kill_script() -> Vec<StandinReply> {
    let record = json!({"command": "sleep 0.3; echo \"$IDEMPOTENCY_KEY\" >> keys.txt"});
    let mut replies: Vec<StandinReply> = (0..3)
        .map(|i| {
            let reply = StandinReply::text(&format!(
                "Step {i}: I am recording the idempotency key in the file now."
            ))
            .slow(10)
            .tool("bash", record.clone());
            if i == 1 {
                reply.tool("bash", record.clone())
            } else {
                reply
            }
        })
        .collect();
    replies.push(StandinReply::text("Every step is done and the keys are recorded.").slow(10));
    replies
}

impl KillModel for OpenAiStandin {
    fn start_runner(&self, store: &Store, id: &str, workspace_root: &Path) -> RunnerProc {
        start_openai_runner(store, id, workspace_root, self, TTL_MS)
    }

    fn final_stop_reason(&self) -> &'static str {
        "stop"
    }

    fn scripted_calls(&self) -> usize {
        4
    }

    fn requests(&self) -> Vec<RecordedRequest> {
        OpenAiStandin::requests(self)
    }

    fn violations(&self) -> Vec<String> {
        OpenAiStandin::violations(self)
    }
}

async fn kill_standin() -> OpenAiStandin {
    OpenAiStandin::start(kill_script()).await.expect("stand-in")
}

sigkill_suite!(kill_standin);
