//! The command that ends sessions: `rm SESSION…` deletes the named sessions for good, and
//! `rm --idle-for DURATION` the sessions whose last event is older than that, that no
//! runner holds and that are not pinned.
//!
//! Promise: a session is deleted only when it is named, or when it was listed first and
//! the listing was confirmed with `--yes`. Deleting a session that is already deleted is
//! not an error (the store answers it as done). Each session's outcome is printed, and the
//! command fails if any delete failed.

use std::io::Write;
use std::time::Duration;

use agentlog_client::refusal::is_session_not_found;
use agentlog_proto::v1::{DeleteSessionRequest, SessionInfo};
use anyhow::{bail, Result};
use serde_json::json;

use crate::commands::{list_sessions, now_ms, Output};
use crate::store;

/// `rm SESSION…`.
pub async fn rm(out: &Output, sessions: &[String]) -> Result<()> {
    if sessions.is_empty() {
        bail!("name the sessions to delete (`agentlog ls` lists them), or use --idle-for");
    }
    let mut client = store::connect(&out.addr).await?;
    let mut failed = 0;
    for session in sessions {
        let deleted = client
            .delete_session(DeleteSessionRequest {
                session_id: session.clone(),
            })
            .await;
        match deleted {
            Ok(_) => report(out, session, None)?,
            Err(status) => {
                failed += 1;
                let why = if is_session_not_found(&status) {
                    format!("there is no session {session:?}")
                } else {
                    format!("{:#}", store::explain(&out.addr, "DeleteSession", status))
                };
                report(out, session, Some(&why))?;
            }
        }
    }
    if failed > 0 {
        bail!("{failed} of {} sessions were not deleted", sessions.len());
    }
    Ok(())
}

/// `rm --idle-for DURATION [--yes]`: without `--yes`, only says what it would delete.
pub async fn rm_idle(out: &Output, idle_for: Duration, yes: bool) -> Result<()> {
    let mut client = store::connect(&out.addr).await?;
    let cutoff = now_ms().saturating_sub(idle_for.as_millis() as i64);
    let all = list_sessions(out, &mut client, None, None, usize::MAX).await?;
    let idle: Vec<&SessionInfo> = all
        .iter()
        .filter(|s| s.updated_unix_ms < cutoff && s.lease.is_none() && !s.pinned)
        .collect();
    let shown = humantime::format_duration(idle_for);
    if !yes {
        let mut stdout = std::io::stdout().lock();
        for s in &idle {
            if out.json {
                writeln!(
                    stdout,
                    "{}",
                    json!({"sessionId": s.session_id, "wouldDelete": true})
                )?;
            } else {
                writeln!(stdout, "{}  {}", s.session_id, s.title)?;
            }
        }
        if !out.json {
            eprintln!(
                "{} of {} sessions have been idle for over {shown}, no runner holds them and \
                 none is pinned; add --yes to delete them",
                idle.len(),
                all.len()
            );
        }
        return Ok(());
    }
    let ids: Vec<String> = idle.iter().map(|s| s.session_id.clone()).collect();
    if ids.is_empty() {
        if !out.json {
            eprintln!("no session has been idle for over {shown}");
        }
        return Ok(());
    }
    rm(out, &ids).await
}

fn report(out: &Output, session: &str, failure: Option<&str>) -> Result<()> {
    let mut stdout = std::io::stdout().lock();
    match (out.json, failure) {
        (true, None) => writeln!(stdout, "{}", json!({"sessionId": session, "deleted": true}))?,
        (true, Some(why)) => writeln!(
            stdout,
            "{}",
            json!({"sessionId": session, "deleted": false, "error": why})
        )?,
        (false, None) => writeln!(stdout, "deleted {session}")?,
        (false, Some(why)) => eprintln!("agentlog: {session}: not deleted: {why}"),
    }
    Ok(())
}
