//! `agentlog replay SESSION --model P:M [--at SEQ] [--off-path run|stop]` and
//! `agentlog replay --all [--query Q] [--status S] --model P:M`: a recorded session replayed
//! against another model.
//!
//! Promise: a replay is one `ForkSession` of the recording at `--at` (default: its first
//! user message) whose new events are a `session_config` naming the model and the recording
//! (the recording's events after `--at`, up to its tail now) and, when the fork point ends a
//! turn, the recording's next user message, so that a runner has work. The runners do the
//! rest (`runner/src/replay.rs`). The recording is only read, never written.

use agentlog_client::log::read_log;
use agentlog_proto::v1::{
    content_block::Block, event::Kind, Event, ForkSessionRequest, OffPath, Replay, SessionConfig,
    SessionStatus, UserMessage,
};
use anyhow::{anyhow, bail, Result};

use crate::commands::{list_sessions, Output};
use crate::store;

/// What `--off-path` takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OffPathArg {
    /// The call off the recorded path and all later ones run for real.
    Run,
    /// The call off the path is not run and the replay ends there.
    Stop,
}

/// Why a session cannot be replayed as asked.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    #[error("there is no session {0:?}: `agentlog ls` lists them")]
    NoSession(String),
    #[error("session {0} has no user message to replay from")]
    NoUserMessage(String),
    #[error("session {0} is itself a replay; replay its recording instead")]
    IsReplay(String),
    #[error("--at {at}: session {session} has nothing to replay after it (no later user message)")]
    NothingAfter { session: String, at: u64 },
    #[error("--at {at}: session {session}'s log ends at seq {last}")]
    OutsideLog { session: String, at: u64, last: u64 },
    #[error(
        "--model {0:?} is not PROVIDER:MODEL (anthropic:MODEL, openai:MODEL or scripted:FILE)"
    )]
    BadModel(String),
}

/// The `ForkSession` request that replays `session` (whose log is `events`).
pub fn request(
    session: &str,
    events: &[Event],
    model: &str,
    at: Option<u64>,
    off_path: OffPathArg,
) -> Result<ForkSessionRequest, ReplayError> {
    if !model
        .split_once(':')
        .is_some_and(|(p, m)| !p.is_empty() && !m.is_empty())
    {
        return Err(ReplayError::BadModel(model.to_string()));
    }
    let Some(last) = events.last().map(|e| e.seq) else {
        return Err(ReplayError::NoSession(session.to_string()));
    };
    if events
        .iter()
        .any(|e| matches!(&e.kind, Some(Kind::SessionConfig(c)) if c.replay.is_some()))
    {
        return Err(ReplayError::IsReplay(session.to_string()));
    }
    let at = match at {
        Some(at) if at == 0 || at > last => {
            return Err(ReplayError::OutsideLog {
                session: session.to_string(),
                at,
                last,
            })
        }
        Some(at) => at,
        None => events
            .iter()
            .find(|e| matches!(e.kind, Some(Kind::UserMessage(_))))
            .map(|e| e.seq)
            .ok_or_else(|| ReplayError::NoUserMessage(session.to_string()))?,
    };
    let mut fresh = vec![Event {
        event_id: "replay:config".to_string(),
        kind: Some(Kind::SessionConfig(SessionConfig {
            model: model.to_string(),
            replay: Some(Replay {
                session_id: session.to_string(),
                after_seq: at,
                through_seq: last,
                off_path: match off_path {
                    OffPathArg::Run => OffPath::Run,
                    OffPathArg::Stop => OffPath::Stop,
                } as i32,
            }),
            ..SessionConfig::default()
        })),
        ..Event::default()
    }];
    // A fork point that ends a turn leaves the fork idle: its next turn starts it.
    let ends_turn = events
        .iter()
        .find(|e| e.seq == at)
        .is_some_and(|e| match &e.kind {
            Some(Kind::AssistantMessage(m)) => !m
                .content
                .iter()
                .any(|b| matches!(b.block, Some(Block::ToolUse(_)))),
            Some(Kind::Interrupted(_) | Kind::RunError(_)) => true,
            _ => false,
        });
    if ends_turn {
        let (seq, text) = events
            .iter()
            .filter(|e| e.seq > at)
            .find_map(|e| match &e.kind {
                Some(Kind::UserMessage(m)) => Some((e.seq, m.text.clone())),
                _ => None,
            })
            .ok_or_else(|| ReplayError::NothingAfter {
                session: session.to_string(),
                at,
            })?;
        fresh.push(Event {
            event_id: agentlog_proto::replay::user_event_id(seq),
            kind: Some(Kind::UserMessage(UserMessage { text })),
            ..Event::default()
        });
    }
    Ok(ForkSessionRequest {
        session_id: session.to_string(),
        at_seq: at,
        new_session_id: String::new(),
        events: fresh,
    })
}

/// Replays `session`; returns the replay's id.
pub async fn replay_one(
    out: &Output,
    client: &mut store::Client,
    session: &str,
    model: &str,
    at: Option<u64>,
    off_path: OffPathArg,
) -> Result<String> {
    let events = read_log(client, session)
        .await
        .map_err(|s| store::explain(&out.addr, "Subscribe", s))?;
    let request = request(session, &events, model, at, off_path)?;
    let made = client
        .fork_session(request)
        .await
        .map_err(|s| store::explain(&out.addr, "ForkSession", s))?
        .into_inner();
    Ok(made.session_id)
}

fn print(out: &Output, recording: &str, replay: &str) {
    if out.json {
        println!(
            "{}",
            serde_json::json!({"sessionId": replay, "replayOf": recording})
        );
    } else {
        println!("{replay}");
    }
}

/// `agentlog replay SESSION …`.
pub async fn replay(
    out: &Output,
    session: &str,
    model: &str,
    at: Option<u64>,
    off_path: OffPathArg,
) -> Result<()> {
    let mut client = store::connect(&out.addr).await?;
    let made = replay_one(out, &mut client, session, model, at, off_path).await?;
    print(out, session, &made);
    Ok(())
}

/// `agentlog replay --all …`: one replay per matching session (replays themselves are left
/// out); prints each new id as it is made. Fails at the end if any session could not be
/// replayed, naming each on stderr.
pub async fn replay_all(
    out: &Output,
    query: Option<&str>,
    status: Option<SessionStatus>,
    model: &str,
    off_path: OffPathArg,
) -> Result<()> {
    let mut client = store::connect(&out.addr).await?;
    let sessions = list_sessions(out, &mut client, query, status, usize::MAX).await?;
    if sessions.is_empty() {
        bail!("no session matches; `agentlog ls` lists them");
    }
    let mut failed = 0;
    for info in sessions {
        match replay_one(out, &mut client, &info.session_id, model, None, off_path).await {
            Ok(made) => print(out, &info.session_id, &made),
            Err(e) if matches!(e.downcast_ref(), Some(ReplayError::IsReplay(_))) => {}
            Err(e) => {
                failed += 1;
                eprintln!("agentlog: {}: {e:#}", info.session_id);
            }
        }
    }
    if failed > 0 {
        return Err(anyhow!("{failed} sessions could not be replayed (above)"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use agentlog_proto::v1::{AssistantMessage, TextBlock};

    use super::*;

    fn log() -> Vec<Event> {
        let kinds = [
            Kind::UserMessage(UserMessage { text: "one".into() }),
            Kind::AssistantMessage(AssistantMessage {
                content: vec![agentlog_proto::v1::ContentBlock {
                    block: Some(Block::Text(TextBlock { text: "ok".into() })),
                }],
                ..AssistantMessage::default()
            }),
            Kind::UserMessage(UserMessage { text: "two".into() }),
            Kind::AssistantMessage(AssistantMessage::default()),
        ];
        kinds
            .into_iter()
            .enumerate()
            .map(|(i, kind)| Event {
                seq: i as u64 + 1,
                kind: Some(kind),
                ..Event::default()
            })
            .collect()
    }

    #[test]
    fn a_replay_forks_at_the_first_user_message_and_names_its_recording() {
        let made = request("s", &log(), "openai:m", None, OffPathArg::Stop).expect("request");
        assert_eq!(made.at_seq, 1);
        assert_eq!(made.events.len(), 1);
        let Some(Kind::SessionConfig(config)) = &made.events[0].kind else {
            panic!("a session_config first");
        };
        assert_eq!(config.model, "openai:m");
        let replay = config.replay.clone().expect("a replay");
        assert_eq!(
            (
                replay.session_id.as_str(),
                replay.after_seq,
                replay.through_seq
            ),
            ("s", 1, 4)
        );
        assert_eq!(replay.off_path(), OffPath::Stop);
    }

    #[test]
    fn a_fork_point_that_ends_a_turn_starts_the_next_recorded_one() {
        let made = request("s", &log(), "openai:m", Some(2), OffPathArg::Run).expect("request");
        assert_eq!(made.events.len(), 2);
        assert_eq!(made.events[1].event_id, "replay:user:3");
        assert!(matches!(
            request("s", &log(), "openai:m", Some(4), OffPathArg::Run),
            Err(ReplayError::NothingAfter { at: 4, .. })
        ));
        assert!(matches!(
            request("s", &log(), "gpt", None, OffPathArg::Run),
            Err(ReplayError::BadModel(_))
        ));
        assert!(matches!(
            request("s", &log(), "openai:m", Some(9), OffPathArg::Run),
            Err(ReplayError::OutsideLog { last: 4, .. })
        ));
        let mut replayed = log();
        replayed.push(Event {
            seq: 5,
            kind: request("s", &log(), "openai:m", None, OffPathArg::Run)
                .expect("request")
                .events[0]
                .kind
                .clone(),
            ..Event::default()
        });
        assert!(matches!(
            request("r", &replayed, "openai:m", None, OffPathArg::Run),
            Err(ReplayError::IsReplay(_))
        ));
    }
}
