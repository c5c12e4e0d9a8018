//! What a session's log says about the model it runs on (its fallbacks and its budget too)
//! and, for a replay, how far along the recording it is: the part of the fold that
//! `session_config` events and a replay's own events make.
//!
//! Promise: a pure function of the log, applied event by event with the rest of the fold
//! (so a snapshot carries it and any split of the log folds the same). From a
//! `session_config` naming a replay on, the replay's state starts afresh:
//! - the recording's seq of the last result served (`served_from.seq`), which places the
//!   next recorded call;
//! - whether the replay left the recorded path: a call that ran (`tool_started`), asked a
//!   person (`approval_requested`) or got a result that was not served. Serving never
//!   comes back after that;
//! - whether the workspace is behind the log: the last result was served and nothing has
//!   run since, so before anything runs in the workspace (or records it) it must be moved to
//!   the checkpoint that result names;
//! - the last recorded user message replayed (by its event id,
//!   `agentlog_proto::replay::user_event_id`).

use agentlog_proto::replay::user_seq_of;
use agentlog_proto::v1::{event::Kind, Budget, Event, OffPath, Replay};

/// The session's model, its fallbacks, its budget and its replay, as the log has them so
/// far. A `session_config` that leaves a part empty keeps the earlier one.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SessionConfigState {
    /// The model the latest `session_config` that names one names (`None`: the runner's
    /// default).
    pub model: Option<String>,
    pub replay: Option<ReplayState>,
    /// The models a failing turn moves to, in order (empty: the runner's `--fallback-model`s).
    pub fallback_models: Vec<String>,
    /// The limits of each run (`None`: the runner's).
    pub budget: Option<Budget>,
    /// The checkpoint the workspace is at, as the log says.
    pub workspace: LogCheckpoint,
}

/// The checkpoint a session's log says its workspace is at: what its last `tool_result`
/// names.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub enum LogCheckpoint {
    /// No `tool_result` yet: the workspace is empty.
    #[default]
    NoneYet,
    Named(String),
    /// The last `tool_result` names none (its checkpoint could not be recorded).
    Unnamed,
}

/// Where a replay stands.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ReplayState {
    pub recording: Replay,
    /// The recording's seq of the last result served (0: none yet).
    pub served_through: u64,
    /// A call of the replay left the recorded path: nothing is served any more.
    pub left_path: bool,
    /// The last result was served and nothing ran since: the workspace must move to what it
    /// names before a tool runs in it.
    pub behind: Option<Behind>,
    /// The recording's seq of the last user message replayed (0: none).
    pub users_through: u64,
}

/// A served result the workspace has not been moved to yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Behind {
    /// The seq of the served result in the replay's own log.
    pub seq: u64,
    /// The checkpoint it names (the recording's).
    pub checkpoint: Option<String>,
}

impl ReplayState {
    /// Whether the replay ended where it left the path (`--off-path stop`).
    pub fn stopped(&self) -> bool {
        self.left_path && self.recording.off_path() == OffPath::Stop
    }
}

impl SessionConfigState {
    /// Applies the next event of the log.
    pub fn apply(&mut self, event: &Event) {
        match &event.kind {
            Some(Kind::SessionConfig(config)) => {
                // A config that names a model starts afresh (its replay, or none); one that
                // only sets fallbacks or a budget changes those alone.
                if !config.model.is_empty() {
                    self.model = Some(config.model.clone());
                    self.replay = config.replay.clone().map(|recording| ReplayState {
                        recording,
                        ..ReplayState::default()
                    });
                }
                if !config.fallback_models.is_empty() {
                    self.fallback_models.clone_from(&config.fallback_models);
                }
                if config.budget.is_some() {
                    self.budget = config.budget;
                }
            }
            Some(Kind::ToolResult(result)) => {
                self.workspace = match &result.workspace_checkpoint {
                    Some(id) => LogCheckpoint::Named(id.clone()),
                    None => LogCheckpoint::Unnamed,
                };
                if let Some(replay) = &mut self.replay {
                    match &result.served_from {
                        Some(from) => {
                            replay.served_through = replay.served_through.max(from.seq);
                            replay.behind = Some(Behind {
                                seq: event.seq,
                                checkpoint: result.workspace_checkpoint.clone(),
                            });
                        }
                        None => {
                            replay.left_path = true;
                            replay.behind = None;
                        }
                    }
                }
            }
            Some(Kind::ToolStarted(_)) => {
                if let Some(replay) = &mut self.replay {
                    replay.left_path = true;
                    replay.behind = None;
                }
            }
            Some(Kind::ApprovalRequested(_)) => {
                if let Some(replay) = &mut self.replay {
                    replay.left_path = true;
                }
            }
            Some(Kind::UserMessage(_)) => {
                if let (Some(replay), Some(seq)) = (&mut self.replay, user_seq_of(&event.event_id))
                {
                    replay.users_through = replay.users_through.max(seq);
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use agentlog_proto::v1::{
        ApprovalRequested, ServedFrom, SessionConfig, ToolResult, ToolStarted, UserMessage,
    };

    use super::*;

    fn ev(seq: u64, id: &str, kind: Kind) -> Event {
        Event {
            seq,
            event_id: id.into(),
            kind: Some(kind),
            ..Event::default()
        }
    }

    fn served(from: u64, checkpoint: &str) -> Kind {
        Kind::ToolResult(ToolResult {
            served_from: Some(ServedFrom {
                session_id: "p".into(),
                seq: from,
            }),
            workspace_checkpoint: Some(checkpoint.into()),
            ..ToolResult::default()
        })
    }

    fn config(off_path: OffPath) -> Kind {
        Kind::SessionConfig(SessionConfig {
            model: "openai:m".into(),
            replay: Some(Replay {
                session_id: "p".into(),
                after_seq: 1,
                through_seq: 20,
                off_path: off_path as i32,
            }),
            ..SessionConfig::default()
        })
    }

    #[test]
    fn the_workspace_is_at_what_the_last_result_names() {
        let mut state = SessionConfigState::default();
        assert_eq!(state.workspace, LogCheckpoint::NoneYet);
        let result = |checkpoint: Option<&str>| {
            Kind::ToolResult(ToolResult {
                workspace_checkpoint: checkpoint.map(str::to_string),
                ..ToolResult::default()
            })
        };
        state.apply(&ev(1, "result:a", result(Some("c1"))));
        assert_eq!(state.workspace, LogCheckpoint::Named("c1".into()));
        state.apply(&ev(
            2,
            "started:b",
            Kind::ToolStarted(ToolStarted::default()),
        ));
        assert_eq!(state.workspace, LogCheckpoint::Named("c1".into()));
        state.apply(&ev(3, "result:b", result(None)));
        assert_eq!(state.workspace, LogCheckpoint::Unnamed);
        state.apply(&ev(4, "result:c", result(Some("c3"))));
        assert_eq!(state.workspace, LogCheckpoint::Named("c3".into()));
    }

    #[test]
    fn a_replay_serves_until_a_call_leaves_the_path_and_the_workspace_follows_lazily() {
        let mut state = SessionConfigState::default();
        // A result before the replay began (the prefix) counts for nothing but the
        // workspace's checkpoint.
        state.apply(&ev(1, "r0", served(3, "c0")));
        assert_eq!(
            state,
            SessionConfigState {
                workspace: LogCheckpoint::Named("c0".into()),
                ..SessionConfigState::default()
            }
        );
        state.apply(&ev(2, "cfg", config(OffPath::Run)));
        assert_eq!(state.model.as_deref(), Some("openai:m"));
        state.apply(&ev(3, "result:a", served(5, "c1")));
        state.apply(&ev(4, "result:b", served(7, "c2")));
        let replay = state.replay.clone().expect("a replay");
        assert_eq!((replay.served_through, replay.left_path), (7, false));
        assert_eq!(
            replay.behind,
            Some(Behind {
                seq: 4,
                checkpoint: Some("c2".into())
            })
        );
        state.apply(&ev(5, "user:x", Kind::UserMessage(UserMessage::default())));
        state.apply(&ev(
            6,
            &agentlog_proto::replay::user_event_id(9),
            Kind::UserMessage(UserMessage::default()),
        ));
        assert_eq!(state.replay.as_ref().map(|r| r.users_through), Some(9));
        // Asking a person leaves the path; the workspace moves only before the call runs.
        state.apply(&ev(
            7,
            "approval:c:1",
            Kind::ApprovalRequested(ApprovalRequested::default()),
        ));
        let replay = state.replay.clone().expect("a replay");
        assert!(replay.left_path && replay.behind.is_some() && !replay.stopped());
        state.apply(&ev(
            8,
            "started:c:1",
            Kind::ToolStarted(ToolStarted::default()),
        ));
        assert_eq!(state.replay.as_ref().and_then(|r| r.behind.clone()), None);
    }

    #[test]
    fn a_snapshot_keeps_the_model_and_where_the_replay_stands() {
        let mut fold = crate::fold::FoldState::default();
        for event in [
            ev(1, "cfg", config(OffPath::Stop)),
            ev(2, "result:a", served(5, "c1")),
            ev(
                3,
                &agentlog_proto::replay::user_event_id(7),
                Kind::UserMessage(UserMessage::default()),
            ),
        ] {
            fold.apply(&event);
        }
        let data = fold.to_snapshot().expect("not lent");
        let restored =
            crate::fold::FoldState::from_snapshot(vec![data.into()], None).expect("decodes");
        assert_eq!(restored.config(), fold.config());
        let replay = restored.config().replay.clone().expect("a replay");
        assert_eq!((replay.served_through, replay.users_through), (5, 7));
        assert_eq!(replay.behind.map(|b| b.seq), Some(2));
    }

    #[test]
    fn a_result_not_served_ends_the_serving_and_stop_ends_the_replay() {
        let mut state = SessionConfigState::default();
        state.apply(&ev(1, "cfg", config(OffPath::Stop)));
        state.apply(&ev(2, "result:a", served(5, "c1")));
        state.apply(&ev(3, "result:b", Kind::ToolResult(ToolResult::default())));
        let replay = state.replay.clone().expect("a replay");
        assert!(replay.left_path && replay.stopped());
        assert_eq!(replay.behind, None);
        // A later config without a replay ends it.
        state.apply(&ev(
            4,
            "cfg2",
            Kind::SessionConfig(SessionConfig {
                model: "anthropic:x".into(),
                ..SessionConfig::default()
            }),
        ));
        assert_eq!(state.replay, None);
    }
}
