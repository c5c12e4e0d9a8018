//! The tool guard (`runner::tools::guard::run_calls`) against an in-memory log, with the
//! runner dying at every append of a clean run — just before the append is durable and
//! just after — and the next runner folding the log and finishing: nothing runs twice that
//! the policy does not allow, every call ends with exactly one result, and the checkpoint
//! its result names holds the workspace as the calls left it (a death between a checkpoint
//! and its result included). The bash calls run through the real sandbox helper (this
//! package's `runner` binary). And a drain: the call in hand finishes and is logged, the
//! next does not start; past the budget the call is stopped, its process tree killed, and
//! left without a result.

mod common;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

use agentlog_client::json::object_to_struct;
use agentlog_proto::v1::{
    content_block::Block, event::Kind, AssistantMessage, ContentBlock, Durability, Event,
    ToolUseBlock, UserMessage,
};
use runner::fold::{fold_log, Frontier};
use runner::session_log::InterruptSignal;
use runner::store_error::StoreError;
use runner::tools::guard::{run_calls, CallLog, CallsOutcome, GuardError, LeaseCheck};
use runner::tools::{ToolPolicy, Toolbox};
use serde_json::json;
use tokio_util::sync::CancellationToken;

/// A session's log as the store keeps it: seqs from 1, an event id logged once.
#[derive(Default)]
struct MemLog {
    events: Mutex<Vec<Event>>,
}

impl MemLog {
    fn events(&self) -> Vec<Event> {
        self.events.lock().expect("log").clone()
    }

    fn write(&self, event_id: String, kind: Kind) -> u64 {
        let mut events = self.events.lock().expect("log");
        if let Some(logged) = events.iter().find(|e| e.event_id == event_id) {
            return logged.seq;
        }
        let seq = events.len() as u64 + 1;
        events.push(Event {
            session_id: "s1".into(),
            seq,
            event_id,
            kind: Some(kind),
            ..Event::default()
        });
        seq
    }
}

/// When a runner dies: at its n-th append, before the append is durable or right after.
#[derive(Debug, Clone, Copy)]
struct Death {
    at_append: usize,
    after_durable: bool,
}

/// One runner's view of the log; it dies (its appends fail from then on) at `death`.
struct Runner<'a> {
    log: &'a MemLog,
    appends: AtomicUsize,
    death: Option<Death>,
}

impl CallLog for Runner<'_> {
    fn session_id(&self) -> &str {
        "s1"
    }

    async fn append(&self, event_id: String, kind: Kind, _: Durability) -> Result<u64, StoreError> {
        let n = self.appends.fetch_add(1, Ordering::SeqCst);
        match self.death {
            Some(d) if n > d.at_append => Err(StoreError::LeaseLost),
            Some(d) if n == d.at_append => {
                if d.after_durable {
                    self.log.write(event_id, kind);
                }
                Err(StoreError::LeaseLost)
            }
            _ => Ok(self.log.write(event_id, kind)),
        }
    }
}

/// The lease's side: `0` fires to stop the work now, `1` says the runner drains.
struct Held(CancellationToken, AtomicBool);

impl LeaseCheck for Held {
    fn has_margin(&self) -> bool {
        true
    }

    fn cancelled(&self) -> &CancellationToken {
        &self.0
    }

    fn draining(&self) -> bool {
        self.1.load(Ordering::SeqCst)
    }
}

/// A reply with two bash calls, each recording every run of itself in `runs.txt`.
fn two_calls() -> MemLog {
    calls_running("")
}

/// [`two_calls`], each call running `before` first.
fn calls_running(before: &str) -> MemLog {
    let log = MemLog::default();
    log.write(
        "user:1".into(),
        Kind::UserMessage(UserMessage {
            text: "record".into(),
        }),
    );
    let call = |id: &str| ContentBlock {
        block: Some(Block::ToolUse(ToolUseBlock {
            id: id.into(),
            name: "bash".into(),
            input: Some(object_to_struct(
                json!({"command": format!("{before}echo {id} >> runs.txt")})
                    .as_object()
                    .cloned()
                    .unwrap_or_default(),
            )),
        })),
    };
    log.write(
        "reply:0".into(),
        Kind::AssistantMessage(AssistantMessage {
            content: vec![call("t1"), call("t2")],
            stop_reason: "tool_use".into(),
            ..AssistantMessage::default()
        }),
    );
    log
}

/// Folds the log and, if it has calls to run, runs them as one runner would.
async fn work(log: &MemLog, death: Option<Death>, toolbox: &Toolbox, policy: &ToolPolicy) {
    let Frontier::RunTools(calls) = fold_log(&log.events()).frontier else {
        return;
    };
    let runner = Runner {
        log,
        appends: AtomicUsize::new(0),
        death,
    };
    let lease = Held(CancellationToken::new(), AtomicBool::new(false));
    let outcome = run_calls(
        toolbox,
        policy,
        &runner,
        &lease,
        &InterruptSignal::never(),
        &calls,
        None,
    )
    .await;
    match (death, outcome) {
        (None, Ok(outcome)) => assert_eq!(outcome, CallsOutcome::Done),
        (Some(_), Err(GuardError::Store(StoreError::LeaseLost))) => {}
        (death, outcome) => panic!("a runner dying at {death:?} ended with {outcome:?}"),
    }
}

/// Runs of each call, from its `runs.txt` lines.
fn runs(root: &std::path::Path) -> HashMap<String, usize> {
    let text = std::fs::read_to_string(root.join("s1/runs.txt")).unwrap_or_default();
    let mut runs = HashMap::new();
    for line in text.lines() {
        *runs.entry(line.to_string()).or_default() += 1;
    }
    runs
}

/// For every append a clean run makes (`tool_started` and `tool_result` of each call),
/// a runner dies just before it is durable and, in a second case, just after; the next
/// runner folds the log and finishes. Each call then has exactly one result, no start
/// after it, and ran no more often than it was started — and, under `report`, at most
/// once.
#[tokio::test]
async fn a_runner_killed_at_every_append_is_finished_by_the_next_with_nothing_twice() {
    for (policy, at_most_once) in [
        (ToolPolicy::default(), false),
        (
            ToolPolicy::new(&[], &["bash=report".into()]).expect("valid policy"),
            true,
        ),
    ] {
        for at_append in 0..4 {
            for after_durable in [false, true] {
                let death = Death {
                    at_append,
                    after_durable,
                };
                let root = tempfile::tempdir().expect("temp dir");
                let toolbox = common::toolbox(root.path()).await;
                let log = two_calls();
                work(&log, Some(death), &toolbox, &policy).await;
                work(&log, None, &toolbox, &policy).await;

                let events = log.events();
                assert!(
                    matches!(fold_log(&events).frontier, Frontier::CallModel(_)),
                    "{death:?}: every call has its result"
                );
                let runs = runs(root.path());
                for id in ["t1", "t2"] {
                    let mut started = 0;
                    let mut results = 0;
                    for event in &events {
                        match &event.kind {
                            Some(Kind::ToolStarted(s)) if s.tool_use_id == id => {
                                assert_eq!(results, 0, "{death:?}: {id} started after its result");
                                started += 1;
                            }
                            Some(Kind::ToolResult(r)) if r.tool_use_id == id => results += 1,
                            _ => {}
                        }
                    }
                    let ran = runs.get(id).copied().unwrap_or(0);
                    assert_eq!(results, 1, "{death:?}: {id} has one result");
                    assert!(
                        ran <= started,
                        "{death:?}: {id} ran {ran}x, started {started}x"
                    );
                    if at_most_once {
                        assert!(ran <= 1, "{death:?}: report never runs {id} again");
                    } else {
                        assert!(ran >= 1, "{death:?}: {id} ran to a result");
                    }
                }
                // Every result names a checkpoint, and the last one is the workspace as it
                // is: right after a death between a checkpoint and its result too.
                let checkpoints: Vec<String> = events
                    .iter()
                    .filter_map(|e| match &e.kind {
                        Some(Kind::ToolResult(r)) => r.workspace_checkpoint.clone(),
                        _ => None,
                    })
                    .collect();
                assert_eq!(checkpoints.len(), 2, "{death:?}: every result names one");
                let restored = root.path().join("restored");
                let last = checkpoints.last().expect("two");
                let missing = toolbox
                    .checkpoints()
                    .materialize(last, &restored)
                    .expect("the last checkpoint restores");
                assert!(missing.is_empty(), "{death:?}: {missing:?}");
                assert_eq!(
                    std::fs::read_to_string(restored.join("runs.txt")).expect("restored"),
                    std::fs::read_to_string(root.path().join("s1/runs.txt")).expect("runs"),
                    "{death:?}: the last checkpoint holds the workspace"
                );
            }
        }
    }
}

fn started_and_results(events: &[Event], id: &str) -> (usize, usize) {
    let started = events
        .iter()
        .filter(|e| matches!(&e.kind, Some(Kind::ToolStarted(s)) if s.tool_use_id == id))
        .count();
    let results = events
        .iter()
        .filter(|e| matches!(&e.kind, Some(Kind::ToolResult(r)) if r.tool_use_id == id))
        .count();
    (started, results)
}

/// The drain begins while the first call runs: it runs to its end and its result is
/// logged; the second call never starts. With the budget spent mid-call instead, the call
/// is stopped, its process tree killed before the guard returns, and has no result (its
/// tool's unknown-outcome policy settles it on the next claim).
#[tokio::test]
async fn a_drain_finishes_the_call_in_hand_and_starts_no_other() {
    let root = tempfile::tempdir().expect("temp dir");
    let toolbox = common::toolbox(root.path()).await;
    let policy = ToolPolicy::default();
    let log = calls_running("sleep 0.6; ");
    let Frontier::RunTools(calls) = fold_log(&log.events()).frontier else {
        panic!("two calls to run");
    };
    let runner = Runner {
        log: &log,
        appends: AtomicUsize::new(0),
        death: None,
    };
    let lease = std::sync::Arc::new(Held(CancellationToken::new(), AtomicBool::new(false)));
    let draining = lease.clone();
    tokio::spawn(async move {
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        draining.1.store(true, Ordering::SeqCst);
    });
    let outcome = run_calls(
        &toolbox,
        &policy,
        &runner,
        lease.as_ref(),
        &InterruptSignal::never(),
        &calls,
        None,
    )
    .await;
    assert_eq!(outcome.ok(), Some(CallsOutcome::Stopped));
    let events = log.events();
    assert_eq!(
        started_and_results(&events, "t1"),
        (1, 1),
        "t1 ran to its result"
    );
    assert_eq!(
        started_and_results(&events, "t2"),
        (0, 0),
        "t2 never started"
    );
    assert_eq!(runs(root.path()).get("t1"), Some(&1));

    // The budget runs out mid-call.
    let root = tempfile::tempdir().expect("temp dir");
    let toolbox = common::toolbox(root.path()).await;
    let log = calls_running("sleep 0.6; ");
    let runner = Runner {
        log: &log,
        appends: AtomicUsize::new(0),
        death: None,
    };
    let lease = Held(CancellationToken::new(), AtomicBool::new(true));
    let stop = lease.0.clone();
    tokio::spawn(async move {
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
        stop.cancel();
    });
    let Frontier::RunTools(calls) = fold_log(&log.events()).frontier else {
        panic!("two calls to run");
    };
    // Started before the drain began: the guard runs it (then the budget ends).
    lease.1.store(false, Ordering::SeqCst);
    let outcome = run_calls(
        &toolbox,
        &policy,
        &runner,
        &lease,
        &InterruptSignal::never(),
        &calls,
        None,
    )
    .await;
    assert_eq!(outcome.ok(), Some(CallsOutcome::Stopped));
    let events = log.events();
    assert_eq!(
        started_and_results(&events, "t1"),
        (1, 0),
        "stopped: no result"
    );
    assert_eq!(started_and_results(&events, "t2"), (0, 0));
    tokio::time::sleep(std::time::Duration::from_millis(800)).await;
    assert_eq!(
        runs(root.path()).get("t1"),
        None,
        "killed before its side effect"
    );
}
