//! The guarded loop: catch up with the log, do the one thing the frontier asks, repeat.
//!
//! Promise: the model is never asked for a turn whose reply is logged, and no tool runs
//! again once its result is logged — both follow from deciding every step on the fold of
//! the log as it is *now*. `tool_started` is durable before a tool runs and `tool_result`
//! before the model sees it (the guarded call lives in `tools/guard.rs`). An `interrupt`
//! stops the step in hand within moments (the model stream or the tool is dropped) and is
//! answered before anything else: every open call of the turn is closed and `interrupted`
//! ends the turn. When the runner drains (`drain.rs`) no new step starts; the step in hand
//! (a started tool call, a model stream) runs to its end and is logged, unless the budget
//! runs out first (the stream is then dropped, the tool stopped). A session deleted meanwhile
//! stops at once, the same way as a lost lease (`lease.rs`). Every append carries a
//! deterministic `event_id`, so an append retried
//! after a lost acknowledgement, or repeated by a runner that resumed the session, writes
//! nothing twice:
//!
//! | event | id |
//! |---|---|
//! | reply of turn `n` | `reply:<n>` |
//! | `run_error` of turn `n` | `error:<n>` |
//! | `interrupted` answering the `interrupt` at seq `s` | `interrupted:<s>` |
//! | streamed text, retries, pauses | see `call_model.rs` |
//! | calls' events | see `tools/guard.rs` |
//! | a replay's recorded user turn, served results | see `replay.rs` |
//!
//! A session runs on the model its latest `session_config` names (the first `--model` if
//! none); one this runner lacks ends the turn with a `run_error` naming it and the runner's
//! models. What a model step does when the work keeps failing (retries from the log,
//! parking, fallback, the circuit, giving up, the budget) is `call_model.rs`'s. A replay's
//! calls are served from its recording while the model stays on the recorded path
//! (`replay.rs`), before the guard sees them.

use agentlog_proto::v1::{event::Kind, Durability, Interrupted, OffPath, RunError};
use tracing::Instrument;

use crate::call_model::{self, ModelStep, Turn};
use crate::context::TurnContext;
use crate::fold::{Conversation, Frontier, Message, PendingCall, PendingInterrupt, UserBlock};
use crate::lease::LeaseGuard;
use crate::replay::{self, RecordingFeed, Serving};
use crate::session_log::{Appender, SessionLog};
use crate::store_error::StoreError;
use crate::tools::checkpoint::{self, ForkError};
use crate::tools::guard::{self, CallsOutcome, GuardError};
use crate::tools::Toolbox;
use agentlog_client::refusal::is_session_deleted;

/// Why the loop ended without an error.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The log ends in a final reply, a `run_error` or an `interrupted`: nothing to do.
    Idle,
    /// A call waits for a person's decision: nobody needs to hold the session.
    AwaitingApproval,
    /// The next model call is due at `until` (unix ms), later than `--park-after`: the
    /// store keeps the session from every claimant until then.
    Parked { until: i64 },
    /// The runner drains (the step in hand was finished and logged first, unless the budget
    /// ran out) or the lease was lost or about to run out (the step was abandoned).
    Stopped,
}

/// How one step ended.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    /// Its events are logged, or an interrupt cut it short: catch up and fold again.
    Done,
    AwaitingApproval,
    Parked {
        until: i64,
    },
    /// The lease was lost or the runner is stopping.
    Stopped,
}

#[derive(Debug, thiserror::Error)]
pub enum TurnError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the lease has too little time left to start a tool safely")]
    LeaseAtRisk,
    #[error("could not restore the fork's workspace: {0}")]
    Fork(#[from] ForkError),
    #[error("could not move the replay's workspace to the recording's: {0}")]
    Move(#[from] checkpoint::CheckpointError),
}

impl TurnError {
    /// Whether the store refused because the session was deleted.
    pub fn is_session_deleted(&self) -> bool {
        match self {
            TurnError::Store(StoreError::SessionDeleted) => true,
            TurnError::Fork(ForkError::Store(status)) => is_session_deleted(status),
            _ => false,
        }
    }
}

impl From<GuardError> for TurnError {
    fn from(error: GuardError) -> TurnError {
        match error {
            GuardError::Store(e) => TurnError::Store(e),
            GuardError::LeaseAtRisk => TurnError::LeaseAtRisk,
        }
    }
}

/// Runs the session until it is idle or must stop.
pub async fn drive_session(
    context: &TurnContext,
    log: &mut SessionLog,
    lease: &LeaseGuard,
) -> Result<Outcome, TurnError> {
    let cancel = lease.cancelled().clone();
    if let Some(fork) = log.forked_from().cloned() {
        // Before any tool runs in it: the fork's workspace as it was at the fork point.
        let checkpoints = context.toolbox.checkpoints();
        tokio::select! {
            _ = cancel.cancelled() => return Ok(Outcome::Stopped),
            prepared = checkpoint::prepare_fork(checkpoints, log.client(), log.appender().session_id(), &fork) => prepared?,
        }
    }
    // A replay's recording, read once per claim (and again if a new config names another).
    let mut feed: Option<(agentlog_proto::v1::Replay, RecordingFeed)> = None;
    // The workspace is brought to the log's checkpoint once per claim, before any step.
    let mut brought = false;
    loop {
        // No new step once the runner drains.
        if cancel.is_cancelled() || lease.draining() {
            return Ok(Outcome::Stopped);
        }
        tokio::select! {
            _ = cancel.cancelled() => return Ok(Outcome::Stopped),
            _ = lease.drain_begun() => return Ok(Outcome::Stopped),
            fold = log.catch_up().instrument(tracing::info_span!("fold")) => { fold?; }
        };
        let config = log.config().clone();
        // A replay's workspace follows its served results instead (`replay.rs`), until it
        // has left the recorded path and caught up with them.
        let served_moves_it = config
            .replay
            .as_ref()
            .is_some_and(|r| !r.left_path || r.behind.is_some());
        if !brought && !served_moves_it {
            brought = true;
            let checkpoints = context.toolbox.checkpoints();
            let session_id = log.appender().session_id();
            let rerun = guard::reruns_any(&log.dangling_calls(), &context.policy);
            let report = tokio::select! {
                _ = cancel.cancelled() => return Ok(Outcome::Stopped),
                _ = lease.drain_begun() => return Ok(Outcome::Stopped),
                report = checkpoints.bring_to_log(session_id, &config.workspace, rerun) => report?,
            };
            if let Some(report) = report {
                tracing::info!(%report, "the workspace as the log says");
            }
        }
        let plan = call_model::plan(
            context,
            log.appender(),
            log.run(),
            &config,
            crate::call_model::now_ms(),
        );
        if let Ok(plan) = &plan {
            // The one fold renders the conversation in the form of the model it is sent to.
            log.ensure_form(plan.model(context).form()).await?;
        }
        let folded = log.take_folded();
        let replay = config.replay.as_ref();
        if let Some(replay) = replay {
            if feed.as_ref().map(|(recording, _)| recording) != Some(&replay.recording) {
                let started = RecordingFeed::start(log.client().clone(), &replay.recording);
                feed = Some((replay.recording.clone(), started));
            }
        }
        let interrupt = log.interrupt_signal();
        let appender = log.appender().clone();
        let appender = &appender;
        let checkpoints = context.toolbox.checkpoints();
        let step = match folded.frontier {
            Frontier::Idle => {
                let Some(replay) = replay.filter(|r| !r.stopped()) else {
                    return Ok(Outcome::Idle);
                };
                let Some(recording) = wait_recording(&feed, lease).await else {
                    return Ok(Outcome::Stopped);
                };
                if !replay::replay_next_user(appender, recording.as_deref(), replay).await? {
                    return Ok(Outcome::Idle);
                }
                Step::Done
            }
            Frontier::AnswerInterrupt {
                interrupt: pending,
                open,
            } => {
                if let Some(behind) = replay.and_then(|r| r.behind.as_ref()) {
                    let session_id = appender.session_id();
                    replay::catch_up_workspace(checkpoints, session_id, behind).await?;
                }
                answer_interrupt(&context.toolbox, appender, &pending, &open).await?
            }
            Frontier::CallModel(conversation) => {
                let stopped =
                    replay.is_some_and(|r| r.stopped()) && answers_calls_only(&conversation);
                let step = match (plan, stopped) {
                    (_, true) => {
                        log.give_back(conversation);
                        end_turn(
                            appender,
                            folded.turn,
                            "the replay left the recorded path and stopped (--off-path stop); \
                             the results above say where"
                                .to_string(),
                        )
                        .await
                    }
                    (Err(missing), false) => {
                        log.give_back(conversation);
                        end_turn(appender, folded.turn, missing.to_string()).await
                    }
                    (Ok(plan), false) => {
                        let turn = Turn {
                            number: folded.turn,
                            run: &folded.run,
                            conversation: &conversation,
                        };
                        let step =
                            call_model::step(context, appender, lease, &interrupt, turn, plan)
                                .await;
                        log.give_back(conversation);
                        match step? {
                            ModelStep::Done => Ok(Step::Done),
                            ModelStep::Parked { until } => Ok(Step::Parked { until }),
                            ModelStep::Stopped => Ok(Step::Stopped),
                        }
                    }
                };
                step?
            }
            Frontier::RunTools(calls) => {
                if let Some(replay) = replay {
                    let stop = replay.recording.off_path() == OffPath::Stop;
                    let left = if replay.left_path {
                        replay.stopped().then(|| replay::OffPath {
                            why: "this replay stopped where it left the recorded path".into(),
                        })
                    } else {
                        let Some(recording) = wait_recording(&feed, lease).await else {
                            return Ok(Outcome::Stopped);
                        };
                        let gone = feed.as_ref().is_none_or(|(_, feed)| feed.parent_gone());
                        match replay::serve_calls(
                            checkpoints,
                            appender,
                            recording.as_deref(),
                            gone,
                            replay,
                            &calls,
                        )
                        .await?
                        {
                            Serving::Served => continue,
                            Serving::Left(off) => {
                                tracing::info!(why = %off.why, "the replay left the recorded path");
                                stop.then_some(off)
                            }
                        }
                    };
                    if let Some(off) = left {
                        replay::stop_off_path(appender, replay, &calls, folded.turn, &off).await?;
                        continue;
                    }
                    if let Some(behind) = &replay.behind {
                        let session_id = appender.session_id();
                        replay::catch_up_workspace(checkpoints, session_id, behind).await?;
                    }
                }
                match guard::run_calls(
                    &context.toolbox,
                    &context.policy,
                    appender,
                    lease,
                    &interrupt,
                    &calls,
                    folded.run.row.as_ref(),
                )
                .await?
                {
                    CallsOutcome::Done | CallsOutcome::Interrupted => Step::Done,
                    CallsOutcome::AwaitingApproval => Step::AwaitingApproval,
                    CallsOutcome::Stopped => Step::Stopped,
                }
            }
        };
        match step {
            Step::Done => {}
            Step::AwaitingApproval => return Ok(Outcome::AwaitingApproval),
            Step::Parked { until } => return Ok(Outcome::Parked { until }),
            Step::Stopped => return Ok(Outcome::Stopped),
        }
    }
}

/// The replay's recording once read (`Some(None)`: it could not be), unless the work must
/// stop first (`None`): a store that cannot be reached must not hold a lease past its end.
async fn wait_recording(
    feed: &Option<(agentlog_proto::v1::Replay, RecordingFeed)>,
    lease: &LeaseGuard,
) -> Option<Option<std::sync::Arc<replay::Recording>>> {
    let Some((_, feed)) = feed else {
        return Some(None);
    };
    tokio::select! {
        _ = lease.cancelled().cancelled() => None,
        _ = lease.drain_begun() => None,
        recording = feed.recording() => Some(recording),
    }
}

/// Whether the conversation ends in tool results alone: nobody spoke since the calls.
fn answers_calls_only(conversation: &Conversation) -> bool {
    match conversation.messages.last() {
        Some(Message::User(blocks)) => blocks
            .iter()
            .all(|block| matches!(block, UserBlock::ToolResult(_))),
        _ => false,
    }
}

/// Ends turn `turn` with a `run_error` saying `message`, without asking the model.
async fn end_turn(appender: &Appender, turn: u64, message: String) -> Result<Step, TurnError> {
    tracing::warn!(turn, %message, "ending the turn with run_error");
    appender
        .append(
            format!("error:{turn}"),
            Kind::RunError(RunError {
                message,
                retryable: false,
            }),
            Durability::Sync,
        )
        .await?;
    Ok(Step::Done)
}

/// Ends the interrupted turn: every open call gets an error result, then `interrupted`.
/// Both are deterministic, so a runner that takes over half-way finishes the same answer.
async fn answer_interrupt(
    toolbox: &Toolbox,
    appender: &Appender,
    interrupt: &PendingInterrupt,
    open: &[PendingCall],
) -> Result<Step, TurnError> {
    tracing::info!(seq = interrupt.seq, open_calls = open.len(), reason = %interrupt.reason, "answering an interrupt");
    guard::close_interrupted(toolbox, appender, open, &interrupt.reason).await?;
    appender
        .append(
            format!("interrupted:{}", interrupt.seq),
            Kind::Interrupted(Interrupted {
                reason: interrupt.reason.clone(),
            }),
            Durability::Sync,
        )
        .await?;
    Ok(Step::Done)
}
