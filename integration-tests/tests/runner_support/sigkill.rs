//! The SIGKILL suite every model provider passes: a multi-step session whose bash tool
//! appends its `$IDEMPOTENCY_KEY` to a file, with the runner killed at each point of a step
//! (after `tool_started`, during the tool, after `tool_result`, mid-stream, after the reply)
//! and at random moments, restarted each time under a new id. Afterwards every tool_use has
//! exactly one result, each run of a tool had its own `tool_started` and none followed the
//! result, the model was never asked again for a turn whose reply was logged, and the
//! session finished. [`sigkill_suite!`] writes the six tests for one provider's stand-in.

use std::path::Path;
use std::time::Duration;

use agentlog_proto::v1::{Event, SessionStatus};
use integration_tests::standin::RecordedRequest;
use integration_tests::Store;

use super::*;

/// The lease TTL of the suite's runners: short, so a killed runner's session is claimed
/// again quickly.
pub const TTL_MS: u64 = 1000;

/// A model stand-in the suite can run a session against.
pub trait KillModel {
    /// A runner on this model; SIGKILLed when dropped.
    fn start_runner(&self, store: &Store, id: &str, workspace_root: &Path) -> RunnerProc;
    /// The `stop_reason` of this provider's final reply.
    fn final_stop_reason(&self) -> &'static str;
    /// How many tool calls its script makes over the whole session.
    fn scripted_calls(&self) -> usize;
    fn requests(&self) -> Vec<RecordedRequest>;
    fn violations(&self) -> Vec<String>;
}

/// Checks the finished session against the log, the workspace and the stand-in.
fn assert_resumed_exactly_once(
    events: &[Event],
    workspace_root: &Path,
    session: &str,
    model: &impl KillModel,
) {
    let starts = assert_exactly_once_ending(events, model.final_stop_reason());
    let ids = tool_use_ids(events);
    assert_eq!(ids.len(), model.scripted_calls(), "{:?}", kinds(events));
    let keys = key_counts(workspace_root, session);
    for id in ids {
        let key = format!("{session}/{id}");
        let ran = keys.get(&key).copied().unwrap_or(0);
        let started = starts.get(&id).copied().unwrap_or(0);
        assert!(
            ran <= started,
            "{key} ran {ran} times but was started {started} times"
        );
        assert!(ran >= 1 || started > 1, "{key} never completed a run");
    }
    let replies = reply_times(events);
    for request in model
        .requests()
        .iter()
        .filter(|r| r.first_user_text == session)
    {
        if let Some(&logged) = replies.get(request.turn) {
            assert!(
                request.received_unix_ms <= logged,
                "turn {} was asked for at {} after its reply was logged at {logged}",
                request.turn,
                request.received_unix_ms
            );
        }
    }
    assert_eq!(model.violations(), Vec::<String>::new());
}

/// Runs the session to the end, SIGKILLing each runner `delay` after the first event that
/// `matches` (three generations at most), then lets a last runner finish it.
pub async fn kill_at(
    model: impl KillModel,
    point: &str,
    matches: fn(&Event) -> bool,
    delay: Duration,
) {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    let workspaces = tempfile::tempdir().expect("temp dir");
    let session = format!("kill-{point}");
    user_says(&mut client, &session, &session).await;

    let mut kills = 0;
    for generation in 0..3 {
        if status(&mut client, &session).await == SessionStatus::Idle {
            break;
        }
        let from = history(&mut client, &session)
            .await
            .last()
            .map_or(0, |e| e.seq)
            + 1;
        let mut runner =
            model.start_runner(&store, &format!("{point}-{generation}"), workspaces.path());
        let watcher = tokio::spawn(kill_when(
            client.clone(),
            session.clone(),
            from,
            runner.pid(),
            matches,
            delay,
        ));
        let fired = tokio::time::timeout(Duration::from_secs(30), watcher).await;
        runner.kill9();
        if matches!(fired, Ok(Ok(true))) {
            kills += 1;
        }
    }
    assert!(kills >= 1, "the runner was never killed at {point}");
    let _survivor = model.start_runner(&store, &format!("{point}-final"), workspaces.path());
    let events = wait_idle(&mut client, &session, 0, Duration::from_secs(60)).await;
    assert_resumed_exactly_once(&events, workspaces.path(), &session, &model);
}

/// Runs the session to the end through ten runners SIGKILLed at random moments.
pub async fn kill_at_random_moments(model: impl KillModel) {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    let workspaces = tempfile::tempdir().expect("temp dir");
    let session = "kill-random".to_string();
    user_says(&mut client, &session, &session).await;
    for generation in 0..10 {
        if status(&mut client, &session).await == SessionStatus::Idle {
            break;
        }
        let mut runner =
            model.start_runner(&store, &format!("random-{generation}"), workspaces.path());
        // Long enough to claim (after the previous lease expires) and get some way in.
        let pause = 300 + fastrand::u64(0..1500);
        eprintln!("generation {generation}: SIGKILL after {pause} ms");
        tokio::time::sleep(Duration::from_millis(pause)).await;
        runner.kill9();
    }
    let _survivor = model.start_runner(&store, "random-final", workspaces.path());
    let events = wait_idle(&mut client, &session, 0, Duration::from_secs(60)).await;
    assert_resumed_exactly_once(&events, workspaces.path(), &session, &model);
}

/// The six tests of the suite, for the stand-in that `$model` (an async fn returning a
/// [`KillModel`]) starts.
#[allow(unused_macros)] // only the runner_* tests write the suite
macro_rules! sigkill_suite {
    ($model:path) => {
        #[tokio::test(flavor = "multi_thread")]
        async fn killed_after_tool_started() {
            $crate::runner_support::sigkill::kill_at(
                $model().await,
                "started",
                |e| {
                    matches!(
                        e.kind,
                        Some(::agentlog_proto::v1::event::Kind::ToolStarted(_))
                    )
                },
                ::std::time::Duration::ZERO,
            )
            .await;
        }

        #[tokio::test(flavor = "multi_thread")]
        async fn killed_during_the_tool() {
            $crate::runner_support::sigkill::kill_at(
                $model().await,
                "during",
                |e| {
                    matches!(
                        e.kind,
                        Some(::agentlog_proto::v1::event::Kind::ToolStarted(_))
                    )
                },
                ::std::time::Duration::from_millis(120),
            )
            .await;
        }

        #[tokio::test(flavor = "multi_thread")]
        async fn killed_after_tool_result() {
            $crate::runner_support::sigkill::kill_at(
                $model().await,
                "result",
                |e| {
                    matches!(
                        e.kind,
                        Some(::agentlog_proto::v1::event::Kind::ToolResult(_))
                    )
                },
                ::std::time::Duration::ZERO,
            )
            .await;
        }

        #[tokio::test(flavor = "multi_thread")]
        async fn killed_mid_stream() {
            $crate::runner_support::sigkill::kill_at(
                $model().await,
                "stream",
                |e| {
                    matches!(
                        e.kind,
                        Some(::agentlog_proto::v1::event::Kind::AssistantDelta(_))
                    )
                },
                ::std::time::Duration::ZERO,
            )
            .await;
        }

        #[tokio::test(flavor = "multi_thread")]
        async fn killed_after_the_reply() {
            $crate::runner_support::sigkill::kill_at(
                $model().await,
                "reply",
                |e| {
                    matches!(
                        e.kind,
                        Some(::agentlog_proto::v1::event::Kind::AssistantMessage(_))
                    )
                },
                ::std::time::Duration::ZERO,
            )
            .await;
        }

        #[tokio::test(flavor = "multi_thread")]
        async fn killed_at_random_moments() {
            $crate::runner_support::sigkill::kill_at_random_moments($model().await).await;
        }
    };
}
#[allow(unused_imports)] // only the runner_* tests write the suite
pub(crate) use sigkill_suite;
