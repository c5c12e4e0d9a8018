//! The guarded call: what a call of the last reply needs next, and doing it with durable,
//! deterministic appends.
//!
//! Promise: a tool runs only after its `tool_started` is durable, and never again once its
//! `tool_result` is logged. Every `tool_result` names the checkpoint of the session's
//! workspace recorded just before it was appended (`tools/checkpoint/`), unless recording
//! failed (then it names none and the runner's log says why). A call whose `tool_started`
//! is durable runs to its end and its result is logged even when the runner begins to
//! drain; only a lease that is lost or about to run out, or a drain whose budget is spent,
//! stops it, its process tree killed before the guard returns. Once the runner drains, no
//! further call starts. A call that needs a person's yes (`runner --approve`, or the
//! `ask` unknown-outcome policy) runs only after an `approval_decision{approved}` logged
//! since its last `tool_started`; a denied call gets an error result and never runs. A call
//! with `tool_started` and no result follows its tool's [`UnknownOutcome`] policy. Every
//! append has a deterministic `event_id`, so a retry, or another runner resuming the
//! session, writes nothing twice:
//!
//! | event | id |
//! |---|---|
//! | `approval_requested` before attempt `a` | `approval:<tool_use_id>:<a>` |
//! | `tool_started` | `started:<tool_use_id>:<attempt>` |
//! | `tool_result` (run, denied, reported, or closed by an interrupt) | `result:<tool_use_id>` |

use std::future::Future;

use agentlog_client::json::struct_to_object;
use agentlog_proto::v1::{event::Kind, ApprovalRequested, Durability, ToolResult, ToolStarted};
use tokio_util::sync::CancellationToken;

use super::{ToolPolicy, Toolbox, UnknownOutcome};
use crate::fold::run::CallRow;
use crate::fold::{Approval, CallState, PendingCall};
use crate::lease::LeaseGuard;
use crate::session_log::{Appender, InterruptSignal};
use crate::store_error::StoreError;

/// Where the guard writes a session's calls: the store, through [`Appender`] (or, in this
/// module's tests, an in-memory log that dies at a chosen append).
pub trait CallLog: Sync {
    fn session_id(&self) -> &str;
    /// Appends one event with its deterministic id; an id already logged answers with its
    /// original seq and writes nothing.
    fn append(
        &self,
        event_id: String,
        kind: Kind,
        durability: Durability,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send;
}

impl CallLog for Appender {
    fn session_id(&self) -> &str {
        Appender::session_id(self)
    }

    fn append(
        &self,
        event_id: String,
        kind: Kind,
        durability: Durability,
    ) -> impl Future<Output = Result<u64, StoreError>> + Send {
        Appender::append(self, event_id, kind, durability)
    }
}

/// What the guard asks of the session's lease before and while a tool runs.
pub trait LeaseCheck: Sync {
    /// Whether there is time enough left to start a tool while the lease is surely ours.
    fn has_margin(&self) -> bool;
    /// Cancelled when the work must stop now: the lease is lost or about to run out, or
    /// the drain's budget is spent.
    fn cancelled(&self) -> &CancellationToken;
    /// Whether the runner is draining: the call in hand finishes, no other starts.
    fn draining(&self) -> bool;
    /// Whether the work stopped because the session was deleted (nothing will settle its
    /// calls: they are gone with it).
    fn session_deleted(&self) -> bool {
        false
    }
}

impl LeaseCheck for LeaseGuard {
    fn has_margin(&self) -> bool {
        LeaseGuard::has_margin(self)
    }

    fn cancelled(&self) -> &CancellationToken {
        LeaseGuard::cancelled(self)
    }

    fn draining(&self) -> bool {
        LeaseGuard::draining(self)
    }

    fn session_deleted(&self) -> bool {
        LeaseGuard::is_deleted(self)
    }
}

/// What one call of the last reply needs next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CallAction {
    /// Its result is logged: leave it alone.
    Done,
    /// Run it as this attempt.
    Run { attempt: u32 },
    /// Ask a person before running this attempt.
    RequestApproval { attempt: u32, reason: String },
    /// A person was asked and has not answered: the session waits.
    AwaitApproval,
    /// Close it with an error result and never run it.
    Refuse { message: String },
}

/// How a run of the calls ended.
#[derive(Debug, PartialEq, Eq)]
pub enum CallsOutcome {
    /// Every call has its result.
    Done,
    /// A call waits for a person; the session can be let go.
    AwaitingApproval,
    /// An `interrupt` arrived; the running tool was dropped (its process tree killed).
    Interrupted,
    /// The lease was lost or is about to run out, or the runner drains (the call in hand,
    /// if any, was finished and logged first, unless the budget ran out).
    Stopped,
}

#[derive(Debug, thiserror::Error)]
pub enum GuardError {
    #[error(transparent)]
    Store(#[from] StoreError),
    #[error("the lease has too little time left to start a tool safely")]
    LeaseAtRisk,
}

/// Decides what `call` needs next under `policy`.
/// Whether any of `calls` is to run again now (an interrupted call its tool's policy, or a
/// person, lets run): its workspace must first be as its `tool_started` found it.
pub fn reruns_any(calls: &[PendingCall], policy: &ToolPolicy) -> bool {
    calls
        .iter()
        .filter(|call| matches!(call.state, CallState::Interrupted { .. }))
        .any(|call| matches!(next_action(call, policy), CallAction::Run { .. }))
}

pub fn next_action(call: &PendingCall, policy: &ToolPolicy) -> CallAction {
    let tool = call.tool_use.name.as_str();
    let (attempt, uncertain) = match call.state {
        CallState::Finished(_) => return CallAction::Done,
        CallState::NotStarted => (1, None),
        CallState::Interrupted { attempt } => (attempt + 1, Some(attempt)),
    };
    match &call.approval {
        Approval::Pending => return CallAction::AwaitApproval,
        Approval::Denied { note } => {
            return CallAction::Refuse {
                message: denied_message(note),
            }
        }
        Approval::Approved => return CallAction::Run { attempt },
        Approval::NotAsked => {}
    }
    let Some(previous) = uncertain else {
        return if policy.needs_approval(tool) {
            CallAction::RequestApproval {
                attempt,
                reason: format!("the runner asks a person before every {tool} call"),
            }
        } else {
            CallAction::Run { attempt }
        };
    };
    let uncertainty = format!(
        "attempt {previous} of this {tool} call was interrupted; it may or may not have taken \
         effect"
    );
    match policy.on_unknown_outcome(tool) {
        UnknownOutcome::Report => CallAction::Refuse {
            message: format!(
                "interrupted; it may or may not have taken effect (attempt {previous} started \
                 and no result was recorded; it was not run again)"
            ),
        },
        UnknownOutcome::Ask => CallAction::RequestApproval {
            attempt,
            reason: format!("{uncertainty}. Run it again?"),
        },
        UnknownOutcome::Rerun | UnknownOutcome::RerunSameKey if policy.needs_approval(tool) => {
            CallAction::RequestApproval {
                attempt,
                reason: format!("{uncertainty}; the runner asks a person before every {tool} call"),
            }
        }
        UnknownOutcome::Rerun | UnknownOutcome::RerunSameKey => CallAction::Run { attempt },
    }
}

fn denied_message(note: &str) -> String {
    if note.is_empty() {
        "a person denied this call; it was not run".to_string()
    } else {
        format!("a person denied this call; it was not run. Their note: {note}")
    }
}

/// The error result that closes a call when an `interrupt` ends its turn.
pub fn interrupted_message(call: &PendingCall, reason: &str) -> String {
    let why = if reason.is_empty() {
        String::new()
    } else {
        format!(" ({reason})")
    };
    match call.state {
        CallState::Interrupted { attempt } => format!(
            "interrupted by the user{why} while it was running (attempt {attempt} had started); \
             it may or may not have taken effect"
        ),
        _ if call.approval == Approval::Pending => {
            format!("interrupted by the user{why} while it waited for approval; it never started")
        }
        _ => format!("interrupted by the user{why} before it started; it never ran"),
    }
}

/// Walks the last reply's calls in order and does what each needs, stopping at the first
/// that waits for a person. `row`: the run's row of identical calls so far (the fold's),
/// counted on here as calls run: the `--repeat-limit`-th identical call in a row waits for
/// a person's yes too (a call a person approved runs once).
pub async fn run_calls(
    toolbox: &Toolbox,
    policy: &ToolPolicy,
    appender: &impl CallLog,
    lease: &impl LeaseCheck,
    interrupt: &InterruptSignal,
    calls: &[PendingCall],
    row: Option<&CallRow>,
) -> Result<CallsOutcome, GuardError> {
    let mut row = row.cloned();
    for call in calls {
        let id = &call.tool_use.id;
        let mut action = next_action(call, policy);
        if let (CallAction::Run { attempt }, Approval::NotAsked) = (&action, &call.approval) {
            if let Some(n) = policy.repeats(row.as_ref(), &call.tool_use) {
                action = CallAction::RequestApproval {
                    attempt: *attempt,
                    reason: format!("repeated: {n} identical calls in a row"),
                };
            }
        }
        if matches!(call.approval, Approval::Denied { .. }) {
            // A denied call ends the row.
            row = None;
        } else if matches!(action, CallAction::Run { .. } | CallAction::Refuse { .. }) {
            match &mut row {
                Some(r) if r.matches(&call.tool_use) => r.count += 1,
                _ => {
                    row = Some(CallRow {
                        tool: call.tool_use.name.clone(),
                        input: call.tool_use.input.clone(),
                        count: 1,
                    })
                }
            }
        }
        if let CallState::Interrupted { .. } = call.state {
            match &action {
                CallAction::Run { .. } => crate::metrics::interrupted_call("rerun"),
                CallAction::Refuse { .. } => crate::metrics::interrupted_call("reported"),
                CallAction::RequestApproval { .. } => crate::metrics::interrupted_call("asked"),
                CallAction::Done | CallAction::AwaitApproval => {}
            }
        }
        if lease.draining() && !matches!(action, CallAction::Done | CallAction::AwaitApproval) {
            tracing::info!(tool_use_id = %id, "draining: the call is left for the next runner");
            return Ok(CallsOutcome::Stopped);
        }
        match action {
            CallAction::Done => {}
            CallAction::AwaitApproval => return Ok(CallsOutcome::AwaitingApproval),
            CallAction::RequestApproval { attempt, reason } => {
                tracing::info!(tool_use_id = %id, tool = %call.tool_use.name, %reason, "asking a person");
                appender
                    .append(
                        format!("approval:{id}:{attempt}"),
                        Kind::ApprovalRequested(ApprovalRequested {
                            tool_use_id: id.clone(),
                            tool_name: call.tool_use.name.clone(),
                            input: call.tool_use.input.clone(),
                            reason,
                        }),
                        Durability::Sync,
                    )
                    .await?;
                crate::metrics::approval_requested();
                return Ok(CallsOutcome::AwaitingApproval);
            }
            CallAction::Refuse { message } => {
                tracing::info!(tool_use_id = %id, %message, "closing the call without running it");
                append_result(toolbox, appender, id, message, true).await?;
            }
            CallAction::Run { attempt } => {
                let outcome =
                    run_tool_guarded(toolbox, appender, lease, interrupt, call, attempt).await?;
                if outcome != CallsOutcome::Done {
                    return Ok(outcome);
                }
            }
        }
    }
    Ok(CallsOutcome::Done)
}

/// One call: `tool_started` (durable) → run once → `tool_result` (durable).
async fn run_tool_guarded(
    toolbox: &Toolbox,
    appender: &impl CallLog,
    lease: &impl LeaseCheck,
    interrupt: &InterruptSignal,
    call: &PendingCall,
    attempt: u32,
) -> Result<CallsOutcome, GuardError> {
    let id = &call.tool_use.id;
    let key = format!("{}/{id}", appender.session_id());
    if !lease.has_margin() {
        return Err(GuardError::LeaseAtRisk);
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
        return Err(GuardError::LeaseAtRisk);
    }
    tracing::info!(tool_use_id = %id, tool = %call.tool_use.name, attempt, "running tool");
    let input = struct_to_object(call.tool_use.input.as_ref());
    // The started call runs to its end, a drain or not. When the lease is lost or about to
    // run out, or the drain's budget is spent, the run stops and returns only once the
    // tool's process tree is gone; its outcome is then unknown, for the tool's policy to
    // settle. An interrupt drops the run (which kills it too).
    let stop = lease.cancelled();
    let output = tokio::select! {
        _ = interrupt.arrived() => {
            tracing::info!(tool_use_id = %id, "interrupt: the tool was stopped");
            return Ok(CallsOutcome::Interrupted);
        }
        output = crate::metrics::tool_run(
            &call.tool_use.name,
            toolbox.run(appender.session_id(), &call.tool_use.name, input, &key, stop),
        ) => output,
    };
    let Ok(output) = output else {
        if lease.session_deleted() {
            tracing::info!(tool_use_id = %id, attempt, "the session was deleted: its call was stopped (its process tree killed)");
        } else {
            tracing::warn!(tool_use_id = %id, attempt, "the call was stopped before its end (its process tree killed); its outcome is unknown");
        }
        return Ok(CallsOutcome::Stopped);
    };
    append_result(toolbox, appender, id, output.content, output.is_error).await?;
    Ok(CallsOutcome::Done)
}

/// Closes every listed call with an error result saying it was interrupted and whether it
/// had started. A call whose real result raced in first keeps it (same event id).
pub async fn close_interrupted(
    toolbox: &Toolbox,
    appender: &impl CallLog,
    open: &[PendingCall],
    reason: &str,
) -> Result<(), StoreError> {
    for call in open {
        append_result(
            toolbox,
            appender,
            &call.tool_use.id,
            interrupted_message(call, reason),
            true,
        )
        .await?;
    }
    Ok(())
}

/// Records the workspace's checkpoint, then appends the call's result naming it (with the
/// note of a fork's restore in front, until one result has carried it).
async fn append_result(
    toolbox: &Toolbox,
    appender: &impl CallLog,
    id: &str,
    content: String,
    is_error: bool,
) -> Result<u64, StoreError> {
    let session_id = appender.session_id();
    let checkpoints = toolbox.checkpoints();
    let (workspace_checkpoint, note) = match checkpoints.record(session_id).await {
        Ok(checkpoint) => {
            tracing::debug!(
                tool_use_id = %id,
                checkpoint = %checkpoint.id,
                files_read = checkpoint.files_read,
                bytes_read = checkpoint.bytes_read,
                "recorded the workspace"
            );
            (Some(checkpoint.id), checkpoint.note)
        }
        Err(e) => {
            tracing::warn!(tool_use_id = %id, error = %e, "could not record the workspace; the result names no checkpoint");
            (None, None)
        }
    };
    let content = match &note {
        Some(note) => format!("{note}\n{content}"),
        None => content,
    };
    let seq = appender
        .append(
            format!("result:{id}"),
            Kind::ToolResult(ToolResult {
                tool_use_id: id.to_string(),
                content,
                is_error,
                workspace_checkpoint,
                served_from: None,
            }),
            Durability::Sync,
        )
        .await?;
    if note.is_some() {
        checkpoints.note_delivered(session_id).await;
    }
    Ok(seq)
}

#[cfg(test)]
mod tests {
    use agentlog_proto::v1::ToolUseBlock;

    use super::*;

    fn call(tool: &str, state: CallState, approval: Approval) -> PendingCall {
        PendingCall {
            tool_use: ToolUseBlock {
                id: "t1".into(),
                name: tool.into(),
                input: None,
            },
            state,
            approval,
        }
    }

    fn policy(approve: &[&str], unknown: &[&str]) -> ToolPolicy {
        let approve: Vec<String> = approve.iter().map(|s| s.to_string()).collect();
        let unknown: Vec<String> = unknown.iter().map(|s| s.to_string()).collect();
        ToolPolicy::new(&approve, &unknown).expect("valid policy")
    }

    #[test]
    fn a_call_that_never_started_runs_unless_it_needs_a_yes() {
        let fresh = call("bash", CallState::NotStarted, Approval::NotAsked);
        assert_eq!(
            next_action(&fresh, &policy(&[], &[])),
            CallAction::Run { attempt: 1 }
        );
        assert!(matches!(
            next_action(&fresh, &policy(&["bash"], &[])),
            CallAction::RequestApproval { attempt: 1, .. }
        ));
        let approved = call("bash", CallState::NotStarted, Approval::Approved);
        assert_eq!(
            next_action(&approved, &policy(&["bash"], &[])),
            CallAction::Run { attempt: 1 }
        );
        let pending = call("bash", CallState::NotStarted, Approval::Pending);
        assert_eq!(
            next_action(&pending, &policy(&["bash"], &[])),
            CallAction::AwaitApproval
        );
    }

    #[test]
    fn a_denied_call_never_runs_and_carries_the_note() {
        let denied = call(
            "bash",
            CallState::NotStarted,
            Approval::Denied {
                note: "not on prod".into(),
            },
        );
        let CallAction::Refuse { message } = next_action(&denied, &policy(&["bash"], &[])) else {
            panic!("a denied call is refused");
        };
        assert!(message.contains("not on prod"), "{message}");
    }

    #[test]
    fn a_finished_call_is_left_alone_whatever_the_policy() {
        let finished = call(
            "bash",
            CallState::Finished(ToolResult::default()),
            Approval::Pending,
        );
        assert_eq!(
            next_action(&finished, &policy(&["bash"], &["bash=ask"])),
            CallAction::Done
        );
    }

    #[test]
    fn an_unknown_outcome_follows_the_tools_policy() {
        let interrupted = |tool: &str| {
            call(
                tool,
                CallState::Interrupted { attempt: 2 },
                Approval::NotAsked,
            )
        };
        // Registry defaults: bash re-runs with the same key, reads re-run.
        assert_eq!(
            next_action(&interrupted("bash"), &policy(&[], &[])),
            CallAction::Run { attempt: 3 }
        );
        assert_eq!(
            next_action(&interrupted("read_file"), &policy(&[], &[])),
            CallAction::Run { attempt: 3 }
        );
        let CallAction::Refuse { message } =
            next_action(&interrupted("bash"), &policy(&[], &["bash=report"]))
        else {
            panic!("report never re-runs");
        };
        assert!(message.contains("may or may not have taken effect"));
        let CallAction::RequestApproval { attempt, reason } =
            next_action(&interrupted("edit_file"), &policy(&[], &["edit_file=ask"]))
        else {
            panic!("ask asks a person");
        };
        assert_eq!(attempt, 3);
        assert!(reason.contains("attempt 2") && reason.contains("may or may not"));
        // A tool that needs a yes asks again before a re-run.
        assert!(matches!(
            next_action(&interrupted("bash"), &policy(&["bash"], &[])),
            CallAction::RequestApproval { attempt: 3, .. }
        ));
        let approved = call(
            "bash",
            CallState::Interrupted { attempt: 2 },
            Approval::Approved,
        );
        assert_eq!(
            next_action(&approved, &policy(&["bash"], &["bash=ask"])),
            CallAction::Run { attempt: 3 }
        );
    }

    #[test]
    fn the_interrupt_answer_says_whether_the_call_had_started() {
        let started = call(
            "bash",
            CallState::Interrupted { attempt: 1 },
            Approval::NotAsked,
        );
        let message = interrupted_message(&started, "stop");
        assert!(message.contains("while it was running") && message.contains("(stop)"));
        let waiting = call("bash", CallState::NotStarted, Approval::Pending);
        assert!(interrupted_message(&waiting, "").contains("waited for approval"));
        let fresh = call("bash", CallState::NotStarted, Approval::NotAsked);
        assert!(interrupted_message(&fresh, "").contains("never ran"));
    }
}
