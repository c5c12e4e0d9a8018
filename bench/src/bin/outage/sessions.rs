//! The drill's sessions, seen from the store: started together, waited for until each is
//! idle or waits for a person, and how each ended, read from its log (the times are the
//! store's, `ts_unix_ms`).

use std::collections::HashSet;
use std::time::{Duration, Instant};

use agentlog_client::log::read_log;
use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::{
    content_block::Block, event::Kind, AppendRequest, Event, GetSessionRequest,
    ListSessionsRequest, SessionInfo, SessionStatus, UserMessage,
};
use anyhow::bail;
use tonic::transport::Channel;

pub type Client = EventStoreClient<Channel>;

/// The user turn each session starts with.
const ASK: &str = "check the workspace and say done";

/// How a session ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum End {
    /// Its final reply, logged at this time (unix ms).
    Done { at_unix_ms: i64 },
    /// `run_error`: the turn is over; a person sends again to go on.
    RunError,
    /// `run_paused`: it waits for a person.
    Paused,
    /// Still at work when the drill stopped waiting.
    Unsettled,
}

/// One session's log, in figures.
#[derive(Debug, Clone, Copy)]
pub struct Outcome {
    pub end: End,
    /// Its user turn's time (unix ms).
    pub asked_unix_ms: i64,
    /// `model_retry` events in its log.
    pub model_retries: usize,
}

/// Appends the user turn of every session in `ids` at once (one request each, all in flight
/// together).
pub async fn start_all(client: &Client, ids: &[String]) -> anyhow::Result<()> {
    let appends = ids.iter().map(|id| {
        let mut client = client.clone();
        async move { client.append(ask(id)).await }
    });
    for answer in futures::future::join_all(appends).await {
        answer?;
    }
    Ok(())
}

/// Runs session `id` alone: its user turn, then its whole turn until it is idle; the time
/// from the user turn to the final reply, by the store's clock.
pub async fn run_alone(client: &Client, id: &str, limit: Duration) -> anyhow::Result<Duration> {
    let mut client = client.clone();
    client.append(ask(id)).await?;
    let deadline = Instant::now() + limit;
    loop {
        let info = client
            .get_session(GetSessionRequest {
                session_id: id.to_string(),
            })
            .await?
            .into_inner();
        if info.status() == SessionStatus::Idle {
            break;
        }
        if Instant::now() > deadline {
            bail!("{id}, alone on a healthy model, is not idle within {limit:?}");
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let outcome = outcome(&read_log(&mut client, id).await?);
    match outcome.end {
        End::Done { at_unix_ms } => Ok(Duration::from_millis(
            (at_unix_ms - outcome.asked_unix_ms).max(0) as u64,
        )),
        end => bail!("{id}, alone on a healthy model, ended {end:?}"),
    }
}

/// Waits until every session of `ids` is idle or waits for a person; `false` if some are
/// not by `deadline`.
pub async fn settle(client: &Client, ids: &[String], deadline: Instant) -> anyhow::Result<bool> {
    let wanted: HashSet<&str> = ids.iter().map(String::as_str).collect();
    loop {
        let settled = list(client)
            .await?
            .iter()
            .filter(|s| wanted.contains(s.session_id.as_str()))
            .filter(|s| matches!(s.status(), SessionStatus::Idle | SessionStatus::Waiting))
            .count();
        if settled == wanted.len() {
            return Ok(true);
        }
        if Instant::now() > deadline {
            return Ok(false);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// Sessions a runner holds while they wait for a logged retry: a live lease on a session
/// whose next call is due later (the store's `not_before_unix_ms`, set by its last
/// `model_retry`). A store of 0.1.0 has no such sessions: its runners keep their retries in
/// memory.
#[derive(Debug, Clone, Copy, Default)]
pub struct Waiting {
    /// Held while their next call is due later.
    pub held: usize,
    /// Of those, held while their next call is due more than `--park-after` later: the
    /// runner should have let them go.
    pub held_past_park: usize,
}

pub async fn held_waiting(
    client: &Client,
    now_unix_ms: i64,
    park_after: Duration,
) -> anyhow::Result<Waiting> {
    let park_after = park_after.as_millis() as i64;
    let mut waiting = Waiting::default();
    for session in list(client).await? {
        let due_in = session.not_before_unix_ms - now_unix_ms;
        if session.lease.is_some() && session.not_before_unix_ms > 0 && due_in > 0 {
            waiting.held += 1;
            if due_in > park_after {
                waiting.held_past_park += 1;
            }
        }
    }
    Ok(waiting)
}

/// When the sessions of `ids` were asked and when the last of them was done, by the store's
/// clock; an error if any ended otherwise.
pub async fn span(client: &Client, ids: &[String]) -> anyhow::Result<Duration> {
    let mut asked = i64::MAX;
    let mut done = i64::MIN;
    for (id, outcome) in ids.iter().zip(outcomes(client, ids).await?) {
        let End::Done { at_unix_ms } = outcome.end else {
            bail!("{id}, on a healthy model, ended {:?}", outcome.end);
        };
        asked = asked.min(outcome.asked_unix_ms);
        done = done.max(at_unix_ms);
    }
    Ok(Duration::from_millis((done - asked).max(0) as u64))
}

/// How each session of `ids` ended.
pub async fn outcomes(client: &Client, ids: &[String]) -> anyhow::Result<Vec<Outcome>> {
    let mut client = client.clone();
    let mut outcomes = Vec::with_capacity(ids.len());
    for id in ids {
        outcomes.push(outcome(&read_log(&mut client, id).await?));
    }
    Ok(outcomes)
}

fn ask(id: &str) -> AppendRequest {
    AppendRequest {
        session_id: id.to_string(),
        events: vec![Event {
            kind: Some(Kind::UserMessage(UserMessage { text: ASK.into() })),
            ..Event::default()
        }],
        ..AppendRequest::default()
    }
}

/// Every session the store holds.
async fn list(client: &Client) -> anyhow::Result<Vec<SessionInfo>> {
    let mut client = client.clone();
    let mut sessions = Vec::new();
    let mut page_token = String::new();
    loop {
        let page = client
            .list_sessions(ListSessionsRequest {
                page_size: 1000,
                page_token,
                ..ListSessionsRequest::default()
            })
            .await?
            .into_inner();
        sessions.extend(page.sessions);
        if page.next_page_token.is_empty() {
            return Ok(sessions);
        }
        page_token = page.next_page_token;
    }
}

/// A log in figures: its last event that ends or continues a turn says how it ended.
fn outcome(log: &[Event]) -> Outcome {
    let mut outcome = Outcome {
        end: End::Unsettled,
        asked_unix_ms: 0,
        model_retries: 0,
    };
    for event in log {
        match &event.kind {
            Some(Kind::UserMessage(_)) => {
                outcome.asked_unix_ms = event.ts_unix_ms;
                outcome.end = End::Unsettled;
            }
            Some(Kind::AssistantMessage(reply)) => {
                let calls_tools = reply
                    .content
                    .iter()
                    .any(|b| matches!(b.block, Some(Block::ToolUse(_))));
                outcome.end = if calls_tools {
                    End::Unsettled
                } else {
                    End::Done {
                        at_unix_ms: event.ts_unix_ms,
                    }
                };
            }
            Some(Kind::RunError(_)) => outcome.end = End::RunError,
            Some(Kind::RunPaused(_)) => outcome.end = End::Paused,
            Some(Kind::ModelRetry(_)) => outcome.model_retries += 1,
            _ => {}
        }
    }
    outcome
}
