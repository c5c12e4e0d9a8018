//! The guarded loop: read the log, fold it, do the one thing the frontier asks, repeat.
//!
//! Promise (SPEC §3): the model is never asked for a turn whose reply is logged, and no
//! tool runs again once its result is logged — both follow from deciding every step on the
//! fold of the log as it is *now*. `tool_started` is durable before a tool runs and
//! `tool_result` before the model sees it. Every append carries a deterministic
//! `event_id`, so an append retried after a lost acknowledgement, or repeated by a runner
//! that resumed the session, writes nothing twice:
//!
//! | event | id |
//! |---|---|
//! | reply of turn `n` | `reply:<n>` |
//! | `run_error` of turn `n` | `error:<n>` |
//! | streamed text | `delta:<n>.<epoch>.<attempt>:<i>` (the turn id is `<n>.<epoch>.<attempt>`) |
//! | `tool_started` | `started:<tool_use_id>:<attempt>` |
//! | `tool_result` | `result:<tool_use_id>` |

use std::time::Duration;

use agentlog_proto::v1::{
    event::Kind, AssistantDelta, Durability, RunError, ToolResult, ToolStarted,
};
use tokio::sync::mpsc;
use tracing::Instrument;

use crate::fold::{fold_log, CallState, Conversation, Frontier, PendingCall};
use crate::json::struct_to_object;
use crate::lease::LeaseGuard;
use crate::model::{Backoff, Model, ModelError, ModelRequest, TextSink};
use crate::session_log::{Appender, SessionLog, StoreError};
use crate::tools::{ToolSpec, Toolbox};

/// Streamed text is gathered for this long before it is appended as one delta.
const DELTA_WINDOW: Duration = Duration::from_millis(50);

/// The system prompt every model call carries.
pub const SYSTEM_PROMPT: &str = "You are an agent working in a private workspace directory. \
Use the tools to inspect and change files and to run commands there; paths are relative to \
the workspace. Finish with a short summary of what you did.";

/// What the loop needs besides the session: the model, the tools, and their settings.
#[derive(Debug)]
pub struct TurnContext {
    pub model: Model,
    pub toolbox: Toolbox,
    pub tools: Vec<ToolSpec>,
    pub max_tokens: u32,
    pub backoff: Backoff,
}

/// Why the loop ended without an error.
#[derive(Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The log ends in a final reply or a `run_error`: nothing to do.
    Idle,
    /// The runner is stopping or the lease was lost; the step in hand was abandoned.
    Stopped,
}

/// How one step ended.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    /// Its events are logged; fold again.
    Done,
    /// The lease was lost or the runner is stopping.
    Stopped,
}

#[derive(Debug, thiserror::Error)]
pub enum TurnError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the lease has too little time left to start a tool safely")]
    LeaseAtRisk,
}

/// Runs the session until it is idle or must stop.
pub async fn drive_session(
    context: &TurnContext,
    log: &mut SessionLog,
    lease: &LeaseGuard,
) -> Result<Outcome, TurnError> {
    let cancel = lease.cancelled().clone();
    loop {
        if cancel.is_cancelled() {
            return Ok(Outcome::Stopped);
        }
        let events = tokio::select! {
            _ = cancel.cancelled() => return Ok(Outcome::Stopped),
            events = log.catch_up() => events?,
        };
        let folded = tracing::info_span!("fold").in_scope(|| fold_log(events));
        let step = match folded.frontier {
            Frontier::Idle => return Ok(Outcome::Idle),
            Frontier::CallModel(conversation) => {
                call_model(context, log.appender(), lease, folded.turn, &conversation).await?
            }
            Frontier::RunTools(calls) => run_tools(context, log.appender(), lease, &calls).await?,
        };
        if step == Step::Stopped {
            return Ok(Outcome::Stopped);
        }
    }
}

/// Asks the model for turn `turn`, retrying transient failures, and logs the reply — or a
/// `run_error` once the provider refuses or the attempts run out.
async fn call_model(
    context: &TurnContext,
    appender: &Appender,
    lease: &LeaseGuard,
    turn: u64,
    conversation: &Conversation,
) -> Result<Step, TurnError> {
    let cancel = lease.cancelled();
    let request = ModelRequest {
        system: SYSTEM_PROMPT,
        conversation,
        tools: &context.tools,
        max_tokens: context.max_tokens,
    };
    let mut attempt = 1;
    let error = loop {
        let turn_id = format!("{turn}.{}.{attempt}", lease.epoch());
        let (sender, receiver) = mpsc::channel(256);
        let deltas =
            tokio::spawn(write_deltas(appender.clone(), turn_id, receiver).in_current_span());
        let sink = TextSink::new(sender);
        let reply = tokio::select! {
            _ = cancel.cancelled() => {
                deltas.abort();
                return Ok(Step::Stopped);
            }
            reply = context.model.stream_reply(request, &sink) => reply,
        };
        // Closing the sink lets the delta writer flush and finish.
        drop(sink);
        // The deltas land before the reply, so a reader never sees text after its turn ended.
        match deltas.await {
            Ok(Err(StoreError::LeaseLost)) => return Err(StoreError::LeaseLost.into()),
            Ok(Err(e)) => tracing::warn!(error = %e, "some streamed text was not logged"),
            Ok(Ok(())) | Err(_) => {}
        }
        match reply {
            Ok(reply) => {
                tracing::info!(turn, stop_reason = %reply.stop_reason, "model replied");
                appender
                    .append(
                        format!("reply:{turn}"),
                        Kind::AssistantMessage(reply),
                        Durability::Sync,
                    )
                    .await?;
                return Ok(Step::Done);
            }
            Err(ModelError::Refused(message)) => break (message, false),
            Err(ModelError::Transient {
                message,
                retry_after,
            }) => {
                if attempt >= context.backoff.max_attempts {
                    break (format!("gave up after {attempt} attempts: {message}"), true);
                }
                let wait = context.backoff.delay(attempt, retry_after);
                tracing::warn!(turn, attempt, %message, wait_ms = wait.as_millis() as u64, "model call failed; retrying");
                tokio::select! {
                    _ = cancel.cancelled() => return Ok(Step::Stopped),
                    _ = tokio::time::sleep(wait) => {}
                }
                crate::metrics::model_retried(&context.model);
                attempt += 1;
            }
        }
    };
    let (message, retryable) = error;
    tracing::warn!(turn, %message, retryable, "the turn failed; logging run_error");
    appender
        .append(
            format!("error:{turn}"),
            Kind::RunError(RunError { message, retryable }),
            Durability::Sync,
        )
        .await?;
    Ok(Step::Done)
}

/// Appends streamed text as `assistant_delta`s, gathered over [`DELTA_WINDOW`], buffered
/// durability: losing some in a crash costs nothing, the reply is the record.
async fn write_deltas(
    appender: Appender,
    turn_id: String,
    mut receiver: mpsc::Receiver<String>,
) -> Result<(), StoreError> {
    let mut index = 0;
    while let Some(first) = receiver.recv().await {
        let mut text = first;
        let window = tokio::time::sleep(DELTA_WINDOW);
        tokio::pin!(window);
        let mut open = true;
        while open {
            tokio::select! {
                _ = &mut window => break,
                piece = receiver.recv() => match piece {
                    Some(piece) => text.push_str(&piece),
                    None => open = false,
                },
            }
        }
        appender
            .append(
                format!("delta:{turn_id}:{index}"),
                Kind::AssistantDelta(AssistantDelta {
                    turn_id: turn_id.clone(),
                    text,
                }),
                Durability::Buffered,
            )
            .await?;
        index += 1;
        if !open {
            break;
        }
    }
    Ok(())
}

/// Walks the last reply's calls in order: a logged result is left alone, anything else runs
/// under its guard.
async fn run_tools(
    context: &TurnContext,
    appender: &Appender,
    lease: &LeaseGuard,
    calls: &[PendingCall],
) -> Result<Step, TurnError> {
    for call in calls {
        let attempt = match call.state {
            CallState::Finished(_) => continue,
            CallState::NotStarted => 1,
            CallState::Interrupted { attempt } => {
                crate::metrics::interrupted_call("rerun");
                tracing::warn!(
                    tool_use_id = %call.tool_use.id,
                    tool = %call.tool_use.name,
                    effect = ?Toolbox::effect_class(&call.tool_use.name),
                    attempt,
                    "the call was interrupted with its outcome unknown; running it again with the same idempotency key"
                );
                attempt + 1
            }
        };
        if run_tool_guarded(context, appender, lease, call, attempt).await? == Step::Stopped {
            return Ok(Step::Stopped);
        }
    }
    Ok(Step::Done)
}

/// One call: `tool_started` (durable) → run once → `tool_result` (durable).
async fn run_tool_guarded(
    context: &TurnContext,
    appender: &Appender,
    lease: &LeaseGuard,
    call: &PendingCall,
    attempt: u32,
) -> Result<Step, TurnError> {
    let id = &call.tool_use.id;
    let key = format!("{}/{id}", appender.session_id());
    if !lease.has_margin() {
        return Err(TurnError::LeaseAtRisk);
    }
    appender
        .append(
            format!("started:{id}:{attempt}"),
            Kind::ToolStarted(ToolStarted {
                tool_use_id: id.clone(),
                idempotency_key: key.clone(),
                attempt,
            }),
            Durability::Sync,
        )
        .await?;
    // The append may have waited out a pause of this process: look again before acting.
    if !lease.has_margin() {
        return Err(TurnError::LeaseAtRisk);
    }
    tracing::info!(tool_use_id = %id, tool = %call.tool_use.name, attempt, "running tool");
    let input = struct_to_object(call.tool_use.input.as_ref());
    let output = tokio::select! {
        // Dropping the run kills a bash command's process group.
        _ = lease.cancelled().cancelled() => return Ok(Step::Stopped),
        output = crate::metrics::tool_run(&call.tool_use.name, context.toolbox.run(appender.session_id(), &call.tool_use.name, input, &key)) => output,
    };
    appender
        .append(
            format!("result:{id}"),
            Kind::ToolResult(ToolResult {
                tool_use_id: id.clone(),
                content: output.content,
                is_error: output.is_error,
            }),
            Durability::Sync,
        )
        .await?;
    Ok(Step::Done)
}
