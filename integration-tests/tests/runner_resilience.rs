//! When the work keeps failing without crashing, against the real `event-store` and
//! `runner` and the model stand-ins scripting faults as the providers send them:
//! - every failed call worth another try is logged (`model_retry`) with the wait the
//!   provider asked for (`retry-after` in seconds or as an HTTP date, the rate-limit
//!   resets), and a runner killed -9 or drained during the wait hands the schedule on: the
//!   next one calls no sooner than the logged time, and the attempts go on counting;
//! - a stream that stalls or a call that never answers fails past `--model-idle-timeout`,
//!   a refused connection is `unreachable`, and each is tried again;
//! - a wait past `--park-after` lets the session go: the runner's one slot works another
//!   session meanwhile, and the parked one resumes when due (across a SIGKILL of the
//!   store too);
//! - a turn falls back to another provider mid-session, the conversation valid in its form,
//!   each tool call run once; a billing refusal moves on at once;
//! - ten sessions on a dead model with a fallback all finish, and the dead model gets a
//!   bounded number of calls (its circuit);
//! - a turn whose models keep failing past `--give-up-after` pauses the run for a person;
//! - the third identical call in a row waits for a person, and a run stops at its budget,
//!   each counted from the log across a kill -9.

mod runner_support;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::{
    event::Kind, AppendRequest, ApprovalDecision, Budget, Event, ModelRetry, SessionConfig,
    SessionStatus,
};
use integration_tests::anthropic_standin::{AnthropicStandin, Fault, StandinReply};
use integration_tests::openai_standin::{self, OpenAiStandin};
use integration_tests::side_effects::Counter;
use integration_tests::standin::{FaultPlan, Limit, RateLimit, RetryAfter};
use integration_tests::Store;
use runner_support::{
    assert_exactly_once, assert_exactly_once_ending, kinds, start_runner_on_model,
    start_runner_with, user_says, wait_for_log, wait_idle, wait_status, Rig,
};
use serde_json::json;
use tonic::transport::Channel;

type Client = EventStoreClient<Channel>;

/// The stand-in's name of the runners' default model, `anthropic:standin-1`.
const MODEL: &str = "standin-1";
const PATIENCE: Duration = Duration::from_secs(60);

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// The session's `model_retry`s, in order.
fn retries(events: &[Event]) -> Vec<(ModelRetry, i64)> {
    events
        .iter()
        .filter_map(|e| match &e.kind {
            Some(Kind::ModelRetry(r)) => Some((r.clone(), e.ts_unix_ms)),
            _ => None,
        })
        .collect()
}

fn count(events: &[Event], kind: &str) -> usize {
    kinds(events).iter().filter(|k| k.starts_with(kind)).count()
}

/// The calls the stand-in received for `model`, as (receive time, what was served).
fn calls(standin: &AnthropicStandin, model: &str) -> Vec<(i64, String)> {
    standin
        .requests_of(model)
        .into_iter()
        .map(|r| (r.received_unix_ms, r.served))
        .collect()
}

async fn configure(client: &mut Client, session: &str, config: SessionConfig) {
    client
        .append(AppendRequest {
            session_id: session.into(),
            events: vec![Event {
                kind: Some(Kind::SessionConfig(config)),
                ..Event::default()
            }],
            ..AppendRequest::default()
        })
        .await
        .expect("a session_config");
}

async fn decide(client: &mut Client, session: &str, tool_use_id: &str, approved: bool) {
    client
        .append(AppendRequest {
            session_id: session.into(),
            events: vec![Event {
                kind: Some(Kind::ApprovalDecision(ApprovalDecision {
                    tool_use_id: tool_use_id.into(),
                    approved,
                    note: "not again".into(),
                })),
                ..Event::default()
            }],
            ..AppendRequest::default()
        })
        .await
        .expect("a decision");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_runner_killed_or_drained_during_a_wait_hands_on_the_schedule_the_providers_word_first() {
    let mut rig = Rig::start(vec![
        StandinReply::text("Recording.").tool("bash", json!({"command": "echo one"})),
        StandinReply::text("Done."),
    ])
    .await;
    // Three failures of the first call, each asking for a wait in its own way: 3 s, an
    // HTTP date (about 9 s from now; the second call comes about 3 s from now), and a
    // rate limit whose reset is 3 s away (no retry-after).
    let date = SystemTime::now() + Duration::from_secs(9);
    rig.standin.fail_model(
        MODEL,
        FaultPlan::Calls(vec![
            Fault::OverloadedRetryAfter(RetryAfter::Seconds(3)),
            Fault::OverloadedRetryAfter(RetryAfter::Date(date)),
            Fault::RateLimit(
                RateLimit::new(Limit::Tokens, Duration::from_secs(3)).retry_after(None),
            ),
        ]),
    );
    let flags = ["--park-after", "60s"];
    let mut first = rig.runner("first", 1500, &flags);
    user_says(&mut rig.client, "s", "go").await;
    wait_for_log(&mut rig.client, "s", PATIENCE, |e| {
        count(e, "model_retry") == 1
    })
    .await;
    first.kill9();
    let mut second = rig.runner("second", 1500, &flags);
    wait_for_log(&mut rig.client, "s", PATIENCE, |e| {
        count(e, "model_retry") == 2
    })
    .await;
    second.terminate();
    let _third = rig.runner("third", 1500, &flags);
    let events = wait_idle(&mut rig.client, "s", 0, PATIENCE).await;

    let logged = retries(&events);
    assert_eq!(logged.len(), 3, "{:?}", kinds(&events));
    let attempts: Vec<u32> = logged.iter().map(|(r, _)| r.attempt).collect();
    assert_eq!(
        attempts,
        [1, 2, 3],
        "the attempts go on counting across runners"
    );
    assert_eq!(logged[2].0.reason, "rate_limited");
    // Each due time is the provider's word, and no call came early.
    let date_ms = date
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    let made = calls(&rig.standin, MODEL);
    assert!(made.len() >= 4, "{made:?}");
    for (i, (retry, logged_at)) in logged.iter().enumerate() {
        let wait = retry.retry_at_unix_ms - logged_at;
        if i == 1 {
            let off = retry.retry_at_unix_ms - date_ms;
            assert!(
                (-1_000..=1_500).contains(&off),
                "retry 1: the provider named a time; the log is {off} ms off it"
            );
        } else {
            assert!(
                (2_000..=4_500).contains(&wait),
                "retry {i}: the provider asked for 3 s, the log says {wait} ms"
            );
        }
        let (next_call, _) = made[i + 1];
        assert!(
            next_call >= retry.retry_at_unix_ms,
            "call {} came {} ms before its due time",
            i + 1,
            retry.retry_at_unix_ms - next_call
        );
    }
    assert_exactly_once(&events);
}

#[tokio::test(flavor = "multi_thread")]
async fn stalls_silences_and_refused_connections_fail_the_call_and_it_is_tried_again() {
    let mut rig = Rig::start(vec![StandinReply::text("Here at last.")]).await;
    rig.standin.fail_model(
        MODEL,
        FaultPlan::Calls(vec![Fault::Stall { deltas: 2 }, Fault::NeverStarts]),
    );
    let _runner = rig.runner("r", 3000, &["--model-idle-timeout", "1s"]);
    user_says(&mut rig.client, "s", "go").await;
    wait_for_log(&mut rig.client, "s", PATIENCE, |e| {
        count(e, "model_retry") == 2
    })
    .await;
    // Then the provider is gone altogether for a while.
    rig.standin.stop_listening().await;
    wait_for_log(&mut rig.client, "s", PATIENCE, |e| {
        count(e, "model_retry") == 3
    })
    .await;
    rig.standin.listen_again().await.expect("listen again");
    let events = wait_idle(&mut rig.client, "s", 0, PATIENCE).await;
    let reasons: Vec<String> = retries(&events)
        .into_iter()
        .map(|(r, _)| r.reason)
        .collect();
    assert_eq!(
        reasons[..3],
        ["stalled", "timeout", "unreachable"],
        "{reasons:?}"
    );
    assert!(
        reasons[3..].iter().all(|r| r == "unreachable"),
        "{reasons:?}"
    );
    assert_eq!(
        kinds(&events).last().map(String::as_str),
        Some("reply(end_turn)")
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_long_wait_parks_the_session_and_its_runner_works_another_meanwhile() {
    let mut rig = Rig::start(vec![StandinReply::text("Done.")]).await;
    // The first call of all (the parked session's) asks for 8 s.
    rig.standin.fail_model(
        MODEL,
        FaultPlan::Call(0, Fault::OverloadedRetryAfter(RetryAfter::Seconds(8))),
    );
    let runner = start_runner_with(
        &rig.store.url(),
        "one-slot",
        rig.workspaces.path(),
        &rig.standin.url(),
        2000,
        1,
        &["--park-after", "1s"],
    );
    user_says(&mut rig.client, "parked", "go").await;
    let parked = wait_for_log(&mut rig.client, "parked", PATIENCE, |e| {
        count(e, "model_retry") == 1
    })
    .await;
    let due = retries(&parked)[0].0.retry_at_unix_ms;
    // The one slot is free: another session is worked while the first one waits.
    user_says(&mut rig.client, "healthy", "go").await;
    wait_idle(&mut rig.client, "healthy", 0, PATIENCE).await;
    assert!(
        now_ms() < due,
        "the healthy session finished before the parked one was due"
    );
    wait_status(&mut rig.client, "parked", SessionStatus::Runnable, PATIENCE).await;
    assert!(!runner.log_lines("parking the session").is_empty());

    // A SIGKILL of the store changes nothing of it.
    restart_store(&mut rig).await;
    let events = wait_idle(&mut rig.client, "parked", 0, PATIENCE).await;
    let made = calls(&rig.standin, MODEL);
    let parked_calls: Vec<&(i64, String)> = made.iter().filter(|(at, _)| *at >= due).collect();
    assert!(!parked_calls.is_empty());
    assert_eq!(
        made.iter()
            .filter(|(at, s)| *at < due && s == "reply")
            .count(),
        1,
        "only the healthy session's call came before the due time: {made:?}"
    );
    assert_eq!(count(&events, "reply"), 1);
}

/// SIGKILLs the rig's store and starts it again on its data (or database), on the same
/// address, so the runners reconnect.
async fn restart_store(rig: &mut Rig) {
    rig.store.kill9();
    let addr = rig.store.addr.to_string();
    rig.store = rig.store.restart_on(&addr).expect("the store again");
    rig.client = rig.store.client().await.expect("client");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_turn_falls_back_to_the_other_provider_mid_session_and_runs_each_call_once() {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    let counter = Counter::start();
    let anthropic = AnthropicStandin::start(vec![
        StandinReply::text("First step.").tool(
            "bash",
            json!({"command": format!("sleep 1; {}", counter.report())}),
        ),
        StandinReply::text("Second step.").tool(
            "bash",
            json!({"command": format!("# two\n{}", counter.report())}),
        ),
        StandinReply::text("All done."),
    ])
    .await
    .expect("anthropic stand-in");
    let openai = OpenAiStandin::start(vec![
        openai_standin::StandinReply::text("First step."),
        openai_standin::StandinReply::text("Second step, on the fallback.").tool(
            "bash",
            json!({"command": format!("# two\n{}", counter.report())}),
        ),
        openai_standin::StandinReply::text("All done, on the fallback."),
    ])
    .await
    .expect("openai stand-in");
    // The first turn is Anthropic's: the OpenAI stand-in holds it to the API's rules only.
    openai.foreign_turns(1);
    let workspaces = tempfile::tempdir().expect("temp dir");
    let _runner = start_runner_on_model(
        &store.url(),
        "r",
        workspaces.path(),
        (
            "anthropic:standin-1",
            &[
                ("ANTHROPIC_BASE_URL", &anthropic.url()),
                ("ANTHROPIC_API_KEY", "test-key"),
                ("OPENAI_BASE_URL", &openai.url()),
                ("OPENAI_API_KEY", "test-key"),
            ],
        ),
        3000,
        2,
        &[
            "--fallback-model",
            "openai:standin-2",
            "--tool-network",
            "all",
        ],
    );
    user_says(&mut client, "s", "go").await;
    // From the first call on (while its tool runs), Anthropic is overloaded for good.
    wait_for_log(&mut client, "s", PATIENCE, |e| count(e, "started") == 1).await;
    anthropic.fail_model(
        MODEL,
        FaultPlan::Always(Fault::Overloaded {
            retry_after_s: None,
        }),
    );
    let events = wait_idle(&mut client, "s", 0, PATIENCE).await;

    let replies: Vec<String> = events
        .iter()
        .filter_map(|e| match &e.kind {
            Some(Kind::AssistantMessage(m)) => Some(m.model.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(
        replies,
        [MODEL, "standin-2", "standin-2"],
        "{:?}",
        kinds(&events)
    );
    // Each turn starts at the head of the chain: two failed calls of anthropic, then the
    // fallback at once.
    let failed: Vec<(String, String, i64)> = retries(&events)
        .into_iter()
        .map(|(r, at)| (r.model, r.reason, r.retry_at_unix_ms - at))
        .collect();
    assert_eq!(failed.len(), 4, "{failed:?}");
    assert!(failed
        .iter()
        .all(|(m, r, _)| m == "anthropic:standin-1" && r == "overloaded"));
    assert!(
        failed[1].2 <= 100 && failed[3].2 <= 100,
        "moving on is due at once: {failed:?}"
    );
    assert_eq!(
        openai.violations(),
        Vec::<String>::new(),
        "a valid OpenAI request"
    );
    assert_eq!(anthropic.violations(), Vec::<String>::new());
    assert_exactly_once_ending(&events, "stop");
    assert_eq!(
        counter.counts().values().copied().collect::<Vec<_>>(),
        [1, 1]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn a_billing_refusal_moves_the_turn_on_at_once() {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    let openai = OpenAiStandin::start(vec![openai_standin::StandinReply::text("never")])
        .await
        .expect("openai stand-in");
    openai.fail_model(
        "standin-1",
        FaultPlan::Always(openai_standin::Fault::InsufficientQuota),
    );
    let anthropic = AnthropicStandin::start(vec![StandinReply::text("Answered instead.")])
        .await
        .expect("anthropic stand-in");
    let workspaces = tempfile::tempdir().expect("temp dir");
    let _runner = start_runner_on_model(
        &store.url(),
        "r",
        workspaces.path(),
        (
            "openai:standin-1",
            &[
                ("ANTHROPIC_BASE_URL", &anthropic.url()),
                ("ANTHROPIC_API_KEY", "test-key"),
                ("OPENAI_BASE_URL", &openai.url()),
                ("OPENAI_API_KEY", "test-key"),
            ],
        ),
        3000,
        2,
        &["--fallback-model", "anthropic:standin-1"],
    );
    user_says(&mut client, "s", "go").await;
    let events = wait_idle(&mut client, "s", 0, PATIENCE).await;
    assert_eq!(
        openai.calls_of("standin-1"),
        1,
        "a billing refusal is not asked again"
    );
    let logged = retries(&events);
    assert_eq!(logged.len(), 1);
    assert!(logged[0].0.message.contains("insufficient_quota"));
    assert!(logged[0].0.retry_at_unix_ms - logged[0].1 <= 100);
}

#[tokio::test(flavor = "multi_thread")]
async fn ten_sessions_on_a_dead_model_with_a_fallback_finish_and_its_circuit_bounds_its_calls() {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    let anthropic = AnthropicStandin::start(vec![StandinReply::text("never")])
        .await
        .expect("anthropic stand-in");
    anthropic.fail_model(MODEL, FaultPlan::Always(Fault::ServerError(500)));
    let openai = OpenAiStandin::start(vec![
        openai_standin::StandinReply::text("A step.").tool("read_file", json!({"path": "x"})),
        openai_standin::StandinReply::text("Done."),
    ])
    .await
    .expect("openai stand-in");
    let workspaces = tempfile::tempdir().expect("temp dir");
    let _runner = start_runner_on_model(
        &store.url(),
        "r",
        workspaces.path(),
        (
            "anthropic:standin-1",
            &[
                ("ANTHROPIC_BASE_URL", &anthropic.url()),
                ("ANTHROPIC_API_KEY", "test-key"),
                ("OPENAI_BASE_URL", &openai.url()),
                ("OPENAI_API_KEY", "test-key"),
            ],
        ),
        3000,
        10,
        &[
            "--fallback-model",
            "openai:standin-2",
            "--circuit-failures",
            "3",
        ],
    );
    let sessions: Vec<String> = (0..10).map(|i| format!("s{i}")).collect();
    for session in &sessions {
        user_says(&mut client, session, "go").await;
    }
    for session in &sessions {
        let events = wait_idle(&mut client, session, 0, PATIENCE).await;
        assert_eq!(
            count(&events, "reply"),
            2,
            "{session}: {:?}",
            kinds(&events)
        );
    }
    // Without the circuit: two failed calls per turn, two turns, ten sessions (40).
    let dead = anthropic.calls_of(MODEL);
    assert!(dead <= 14, "the dead model got {dead} calls");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_turn_whose_models_keep_failing_pauses_the_run_for_a_person() {
    let mut rig = Rig::start(vec![StandinReply::text("Back again.")]).await;
    rig.standin
        .fail_model(MODEL, FaultPlan::Always(Fault::ServerError(502)));
    let _runner = rig.runner("r", 3000, &["--give-up-after", "3s"]);
    user_says(&mut rig.client, "s", "go").await;
    wait_status(&mut rig.client, "s", SessionStatus::Waiting, PATIENCE).await;
    let events = runner_support::history(&mut rig.client, "s").await;
    let paused = events.iter().find_map(|e| match &e.kind {
        Some(Kind::RunPaused(p)) => Some(p.clone()),
        _ => None,
    });
    let paused = paused.expect("a run_paused");
    assert_eq!(paused.reason, "gave_up");
    assert!(
        paused.detail.contains("anthropic:standin-1"),
        "{}",
        paused.detail
    );
    let last_retry = retries(&events).last().map(|(r, _)| r.retry_at_unix_ms);
    let first_failure = retries(&events).first().map(|(_, at)| *at);
    assert!(
        last_retry <= first_failure.map(|t| t + 3_000),
        "no retry is due past the give-up deadline"
    );
    // A person's next turn starts a new run.
    rig.standin.clear_model(MODEL);
    let seq = user_says(&mut rig.client, "s", "try again").await;
    wait_idle(&mut rig.client, "s", seq, PATIENCE).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_third_identical_call_in_a_row_waits_for_a_person_counted_across_a_kill() {
    let counter = Counter::start();
    let same = json!({"command": counter.report()});
    let mut rig = Rig::start(vec![
        StandinReply::text("Try.").tool("bash", same.clone()),
        StandinReply::text("Again.").tool("bash", same.clone()),
        StandinReply::text("Again.").tool("bash", same.clone()),
        StandinReply::text("And again.").tool("bash", same.clone()),
        StandinReply::text("I give up on that."),
    ])
    .await;
    let flags = ["--repeat-limit", "3", "--tool-network", "all"];
    let mut first = rig.runner("first", 1500, &flags);
    user_says(&mut rig.client, "s", "go").await;
    wait_for_log(&mut rig.client, "s", PATIENCE, |e| count(e, "result") == 2).await;
    first.kill9();
    let _second = rig.runner("second", 1500, &flags);
    wait_status(&mut rig.client, "s", SessionStatus::Waiting, PATIENCE).await;
    let events = runner_support::history(&mut rig.client, "s").await;
    let asked = events.iter().find_map(|e| match &e.kind {
        Some(Kind::ApprovalRequested(r)) => Some(r.clone()),
        _ => None,
    });
    let asked = asked.expect("the third identical call waits for a person");
    assert_eq!(asked.reason, "repeated: 3 identical calls in a row");
    assert_eq!(
        counter.counts().values().sum::<usize>(),
        2,
        "it did not run"
    );
    decide(&mut rig.client, "s", &asked.tool_use_id, true).await;
    // Yes runs it once; the fourth in a row asks again, and no closes it.
    wait_for_log(&mut rig.client, "s", PATIENCE, |e| {
        count(e, "approval_requested") == 2
    })
    .await;
    assert_eq!(counter.counts().values().sum::<usize>(), 3);
    let events = runner_support::history(&mut rig.client, "s").await;
    let fourth = events
        .iter()
        .rev()
        .find_map(|e| match &e.kind {
            Some(Kind::ApprovalRequested(r)) => Some(r.clone()),
            _ => None,
        })
        .expect("asked again");
    assert_eq!(fourth.reason, "repeated: 4 identical calls in a row");
    decide(&mut rig.client, "s", &fourth.tool_use_id, false).await;
    let events = wait_idle(&mut rig.client, "s", 0, PATIENCE).await;
    assert_eq!(
        counter.counts().values().sum::<usize>(),
        3,
        "a denied call never runs"
    );
    assert_exactly_once(&events);
}

#[tokio::test(flavor = "multi_thread")]
async fn a_run_stops_at_its_budget_counted_across_a_kill_and_a_new_turn_starts_afresh() {
    // Each step's call takes a while: the kill lands in the middle of the run.
    let step = |i: usize| {
        StandinReply::text(&format!("Step {i}."))
            .tool("bash", json!({"command": format!("sleep 0.5; echo {i}")}))
    };
    let mut rig = Rig::start(vec![
        step(0),
        step(1),
        step(2),
        step(3),
        step(4),
        StandinReply::text("Done."),
    ])
    .await;
    configure(
        &mut rig.client,
        "s",
        SessionConfig {
            budget: Some(Budget {
                max_model_calls: 2,
                ..Budget::default()
            }),
            ..SessionConfig::default()
        },
    )
    .await;
    let mut first = rig.runner("first", 1500, &[]);
    user_says(&mut rig.client, "s", "go").await;
    wait_for_log(&mut rig.client, "s", PATIENCE, |e| count(e, "result") >= 1).await;
    first.kill9();
    let _second = rig.runner("second", 1500, &[]);
    wait_status(&mut rig.client, "s", SessionStatus::Waiting, PATIENCE).await;
    let events = runner_support::history(&mut rig.client, "s").await;
    assert_eq!(count(&events, "reply"), 2, "{:?}", kinds(&events));
    let paused = events.iter().find_map(|e| match &e.kind {
        Some(Kind::RunPaused(p)) => Some(p.clone()),
        _ => None,
    });
    let paused = paused.expect("paused at its budget");
    assert_eq!(paused.reason, "budget");
    assert_eq!(paused.detail, "max_model_calls 2 reached (2 replies)");
    // A new turn: a new run, a fresh budget of two more replies.
    user_says(&mut rig.client, "s", "go on").await;
    wait_for_log(&mut rig.client, "s", PATIENCE, |e| {
        count(e, "run_paused") == 2
    })
    .await;
    let events = runner_support::history(&mut rig.client, "s").await;
    assert_eq!(count(&events, "reply"), 4, "{:?}", kinds(&events));
}
