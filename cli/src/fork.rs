//! `agentlog fork SESSION [--at SEQ] [TEXT]` and the web view's "Fork from here": where a
//! fork is made and what it starts with, decided once for both.
//!
//! Promise: `--at` defaults to the session's last settled point (the store's own rule,
//! `agentlog_proto::settled::SettledPoints`). With TEXT, a fork at a `user_message` is made
//! just before it, with TEXT in its place (edit and resend); at any other point TEXT is the
//! fork's next message. The store is the judge of the point: a refusal is passed on, with
//! the nearest settled seqs it names.

use agentlog_client::log::read_log;
use agentlog_proto::settled::SettledPoints;
use agentlog_proto::v1::{event::Kind, Event, ForkSessionRequest, UserMessage};

use crate::store;

/// Why a fork was not even asked for.
#[derive(Debug, thiserror::Error)]
pub enum ForkError {
    #[error("there is no session {0:?}: `agentlog ls` lists them")]
    NoSession(String),
    #[error("session {0} has no settled point yet (no call may be left without its result); wait for its turn to end, or name one with --at")]
    NothingSettled(String),
    #[error("seq {0} is the session's first message: there is nothing to fork before it; `agentlog send TEXT` starts a new session")]
    FirstMessage(u64),
    #[error("text: say something")]
    EmptyText,
    #[error("{what}: {status}")]
    Store {
        what: &'static str,
        status: tonic::Status,
    },
}

/// The `ForkSession` request for forking `session` (whose log is `events`) at `at` (default:
/// its last settled point), with `text` as described in the module head.
pub fn request(
    session: &str,
    events: &[Event],
    at: Option<u64>,
    text: Option<&str>,
) -> Result<ForkSessionRequest, ForkError> {
    if events.is_empty() {
        return Err(ForkError::NoSession(session.to_string()));
    }
    let at = match at {
        Some(at) => at,
        None => *SettledPoints::of(events)
            .last()
            .ok_or_else(|| ForkError::NothingSettled(session.to_string()))?,
    };
    let Some(text) = text else {
        return Ok(ForkSessionRequest {
            session_id: session.to_string(),
            at_seq: at,
            ..ForkSessionRequest::default()
        });
    };
    if text.trim().is_empty() {
        return Err(ForkError::EmptyText);
    }
    let replaces = events
        .iter()
        .find(|e| e.seq == at)
        .is_some_and(|e| matches!(e.kind, Some(Kind::UserMessage(_))));
    let at_seq = if replaces {
        if at <= 1 {
            return Err(ForkError::FirstMessage(at));
        }
        at - 1
    } else {
        at
    };
    Ok(ForkSessionRequest {
        session_id: session.to_string(),
        at_seq,
        new_session_id: String::new(),
        events: vec![Event {
            event_id: format!("user:{}", uuid::Uuid::new_v4().simple()),
            kind: Some(Kind::UserMessage(UserMessage {
                text: text.to_string(),
            })),
            ..Event::default()
        }],
    })
}

/// Forks `session` as [`request`] says; returns the fork's id and last seq.
pub async fn fork(
    client: &mut store::Client,
    session: &str,
    at: Option<u64>,
    text: Option<&str>,
) -> Result<(String, u64), ForkError> {
    let events = read_log(client, session)
        .await
        .map_err(|status| ForkError::Store {
            what: "Subscribe",
            status,
        })?;
    let request = request(session, &events, at, text)?;
    let made = client
        .fork_session(request)
        .await
        .map_err(|status| ForkError::Store {
            what: "ForkSession",
            status,
        })?
        .into_inner();
    Ok((made.session_id, made.last_seq))
}

#[cfg(test)]
mod tests {
    use agentlog_proto::v1::{AssistantMessage, Interrupted};

    use super::*;

    fn log() -> Vec<Event> {
        let kinds = [
            Kind::UserMessage(UserMessage { text: "one".into() }),
            Kind::AssistantMessage(AssistantMessage::default()),
            Kind::UserMessage(UserMessage { text: "two".into() }),
            Kind::Interrupted(Interrupted::default()),
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
    fn at_defaults_to_the_last_settled_point() {
        let plain = request("s", &log(), None, None).expect("request");
        assert_eq!((plain.at_seq, plain.events.len()), (4, 0));
        assert!(matches!(
            request("s", &log()[..0], None, None),
            Err(ForkError::NoSession(_))
        ));
    }

    #[test]
    fn text_replaces_the_user_message_at_the_point_or_follows_any_other() {
        let edit = request("s", &log(), Some(3), Some("two, edited")).expect("request");
        assert_eq!(edit.at_seq, 2);
        assert!(matches!(
            &edit.events[0].kind,
            Some(Kind::UserMessage(m)) if m.text == "two, edited"
        ));
        let follows = request("s", &log(), Some(2), Some("then")).expect("request");
        assert_eq!(follows.at_seq, 2);
        let last = request("s", &log(), None, Some("and now")).expect("request");
        assert_eq!((last.at_seq, last.events.len()), (4, 1));
        assert!(matches!(
            request("s", &log(), Some(1), Some("x")),
            Err(ForkError::FirstMessage(1))
        ));
        assert!(matches!(
            request("s", &log(), None, Some(" ")),
            Err(ForkError::EmptyText)
        ));
    }
}
