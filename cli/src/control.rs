//! The commands that steer a running session: `cancel` (an `interrupt`), and `approve` /
//! `deny` (an `approval_decision` for a call that waits for a person).
//!
//! Promise: without a call id, `approve` and `deny` answer the one call the log shows
//! waiting, and refuse with a clear message when none or several wait. The store is the
//! judge of the rest: a decision for a call with no pending request is refused there
//! (reason `APPROVAL_NOT_PENDING`), and the CLI says so.

use agentlog_client::log::read_log;
use agentlog_client::refusal::{is_approval_not_pending, is_session_not_found};
use agentlog_proto::v1::{event::Kind, ApprovalDecision, Event, GetSessionRequest, Interrupt};
use anyhow::{anyhow, bail, Result};

use crate::commands::{append_and_answer, append_client_event, Output};
use crate::store;

/// `cancel SESSION [--reason R]`.
pub async fn cancel(out: &Output, session: &str, reason: &str) -> Result<()> {
    let mut client = store::connect(&out.addr).await?;
    // An interrupt would otherwise start a session of its own.
    if let Err(status) = client
        .get_session(GetSessionRequest {
            session_id: session.to_string(),
        })
        .await
    {
        if is_session_not_found(&status) {
            bail!("there is no session {session:?}: `agentlog ls` lists them");
        }
        return Err(store::explain(&out.addr, "GetSession", status));
    }
    let interrupt = Kind::Interrupt(Interrupt {
        reason: reason.to_string(),
    });
    let seq = append_and_answer(out, &mut client, session, "interrupt", interrupt).await?;
    if !out.json {
        println!(
            "interrupt sent (seq {seq}); the runner stops the session and answers with \
             `interrupted` (`agentlog tail {session}` shows it)"
        );
    }
    Ok(())
}

/// `approve SESSION [TOOL_USE_ID]` and `deny SESSION [TOOL_USE_ID] [--note N]`.
pub async fn decide(
    out: &Output,
    session: &str,
    tool_use_id: Option<String>,
    approved: bool,
    note: &str,
) -> Result<()> {
    let mut client = store::connect(&out.addr).await?;
    let tool_use_id = match tool_use_id {
        Some(id) => id,
        None => {
            let pending = pending_approvals(out, &mut client, session).await?;
            match pending.as_slice() {
                [(id, _)] => id.clone(),
                [] => bail!("session {session} has no call waiting for approval"),
                several => {
                    let list: Vec<String> = several
                        .iter()
                        .map(|(id, tool)| format!("{id} ({tool})"))
                        .collect();
                    bail!(
                        "session {session} has {} calls waiting for approval: {}; name one, e.g. \
                         `agentlog {} {session} {}`",
                        several.len(),
                        list.join(", "),
                        if approved { "approve" } else { "deny" },
                        several[0].0
                    )
                }
            }
        }
    };
    let decision = Kind::ApprovalDecision(ApprovalDecision {
        tool_use_id: tool_use_id.clone(),
        approved,
        note: note.to_string(),
    });
    let seq = append_client_event(&mut client, session, "decision", decision)
        .await
        .map_err(|status| {
            if is_approval_not_pending(&status) {
                anyhow!(
                    "call {tool_use_id} of session {session} is not waiting for approval (never \
                     asked, already decided, or already closed): {}",
                    status.message()
                )
            } else {
                store::explain(&out.addr, "Append", status)
            }
        })?;
    if out.json {
        println!(
            "{}",
            serde_json::json!({"sessionId": session, "seq": seq.to_string(), "toolUseId": tool_use_id})
        );
    } else {
        let verdict = if approved { "approved" } else { "denied" };
        println!(
            "{verdict} {tool_use_id} (seq {seq}); `agentlog tail {session}` follows the session"
        );
    }
    Ok(())
}

/// The calls the log shows waiting for a person, as (tool_use_id, tool name), oldest first:
/// requested, and neither decided nor closed by a result, an `interrupted` or a `run_error`.
async fn pending_approvals(
    out: &Output,
    client: &mut store::Client,
    session: &str,
) -> Result<Vec<(String, String)>> {
    let events = match read_log(client, session).await {
        Ok(events) => events,
        Err(status) if is_session_not_found(&status) => Vec::new(),
        Err(status) => return Err(store::explain(&out.addr, "Subscribe", status)),
    };
    if events.is_empty() {
        bail!("there is no session {session:?}: `agentlog ls` lists them");
    }
    Ok(waiting_calls(&events))
}

fn waiting_calls(events: &[Event]) -> Vec<(String, String)> {
    let mut pending: Vec<(String, String)> = Vec::new();
    for event in events {
        match &event.kind {
            Some(Kind::ApprovalRequested(r))
                if !pending.iter().any(|(id, _)| *id == r.tool_use_id) =>
            {
                pending.push((r.tool_use_id.clone(), r.tool_name.clone()));
            }
            Some(Kind::ApprovalDecision(d)) => pending.retain(|(id, _)| *id != d.tool_use_id),
            Some(Kind::ToolResult(r)) => pending.retain(|(id, _)| *id != r.tool_use_id),
            Some(Kind::Interrupted(_)) | Some(Kind::RunError(_)) => pending.clear(),
            _ => {}
        }
    }
    pending
}

#[cfg(test)]
mod tests {
    use agentlog_proto::v1::{ApprovalRequested, Interrupted, ToolResult};

    use super::*;

    fn ev(kind: Kind) -> Event {
        Event {
            kind: Some(kind),
            ..Event::default()
        }
    }

    fn request(id: &str) -> Event {
        ev(Kind::ApprovalRequested(ApprovalRequested {
            tool_use_id: id.into(),
            tool_name: "bash".into(),
            ..ApprovalRequested::default()
        }))
    }

    #[test]
    fn waiting_calls_are_those_requested_and_not_yet_answered() {
        let decided = ev(Kind::ApprovalDecision(ApprovalDecision {
            tool_use_id: "a".into(),
            approved: true,
            note: String::new(),
        }));
        let closed = ev(Kind::ToolResult(ToolResult {
            tool_use_id: "b".into(),
            ..ToolResult::default()
        }));
        let ids = |events: &[Event]| -> Vec<String> {
            waiting_calls(events)
                .into_iter()
                .map(|(id, _)| id)
                .collect()
        };
        assert_eq!(ids(&[request("a"), request("b")]), ["a", "b"]);
        assert_eq!(ids(&[request("a"), decided, request("b")]), ["b"]);
        assert_eq!(ids(&[request("b"), closed]), Vec::<String>::new());
        let interrupted = ev(Kind::Interrupted(Interrupted::default()));
        assert_eq!(ids(&[request("a"), interrupted]), Vec::<String>::new());
    }
}
