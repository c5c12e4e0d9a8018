//! Replaying a recorded session against another model: the recording's tool results served
//! while the new model stays on the recorded path, and the recording's later user turns
//! replayed once each turn ends.
//!
//! A replay is a fork whose `session_config` names a [`Replay`]: the recording is the
//! parent's events after the fork point up to the tail it had then. Promises:
//! - A call with the same tool name and the same input (as JSON values) as the next recorded
//!   call (in log order) gets that call's recorded result, with `served_from` naming it and
//!   `workspace_checkpoint` the recording's: the tool does not run, and nothing of the
//!   parent, its workspace or the world is touched. The served checkpoint is first made the
//!   replay's own (`Checkpoints::keep_served`), so it outlives the recording.
//! - The first call off the path ends the serving for good (`fold/config.rs` reads it from
//!   the log). With `--off-path run` the workspace is first moved to the checkpoint of the
//!   last served result (lazily: once, before anything runs in it or records it), then the
//!   call and all later ones go through the guard as always (`tools/guard.rs`: approvals, the
//!   sandbox). With `stop` each open call gets an error result saying it did not run, and the
//!   turn ends with a `run_error` saying where the path was left; the replay ends there.
//! - The recording is read once per claim, on a subscription that stays open to learn of the
//!   parent's deletion: from then on nothing more is served (the rest runs off the path);
//!   the user turns already read are still replayed.
//! - Every append has a deterministic event id (`result:<tool_use_id>`, `error:<turn>`,
//!   `replay:user:<recorded seq>`), so a runner that takes over half-way writes nothing twice
//!   and serves or runs each call exactly once.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use agentlog_client::follow::{follow, Flow, FollowError, Note, Refusals};
use agentlog_client::json::struct_to_object;
use agentlog_client::refusal::is_session_deleted;
use agentlog_client::StoreClient;
use agentlog_proto::v1::{
    content_block::Block, event::Kind, Durability, Event, Replay, RunError, ServedFrom, ToolResult,
    UserMessage,
};
use serde_json::{Map, Value};
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::fold::config::{Behind, ReplayState};
use crate::fold::{CallState, PendingCall};
use crate::session_log::Appender;
use crate::store_error::StoreError;
use crate::tools::checkpoint::{CheckpointError, Checkpoints};

/// A recorded call: what was asked, and the result that answered it, if any.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordedCall {
    pub name: String,
    pub input: Map<String, Value>,
    /// The seq of its `tool_result` in the recording, and the result.
    pub result: Option<(u64, ToolResult)>,
}

/// The parts of a recording a replay uses.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Recording {
    pub session_id: String,
    /// Every call, in log order.
    pub calls: Vec<RecordedCall>,
    /// Every user message: its seq and text, in log order.
    pub users: Vec<(u64, String)>,
}

impl Recording {
    /// The recording made of `events` (the recorded session's, in seq order).
    pub fn of(session_id: &str, events: &[Event]) -> Recording {
        let mut recording = Recording {
            session_id: session_id.to_string(),
            ..Recording::default()
        };
        // Calls still waiting for their result: their id and place in `calls`.
        let mut open: Vec<(String, usize)> = Vec::new();
        for event in events {
            match &event.kind {
                Some(Kind::AssistantMessage(reply)) => {
                    for block in &reply.content {
                        if let Some(Block::ToolUse(call)) = &block.block {
                            open.push((call.id.clone(), recording.calls.len()));
                            recording.calls.push(RecordedCall {
                                name: call.name.clone(),
                                input: struct_to_object(call.input.as_ref()),
                                result: None,
                            });
                        }
                    }
                }
                Some(Kind::ToolResult(result)) => {
                    if let Some(at) = open.iter().position(|(id, _)| *id == result.tool_use_id) {
                        let (_, index) = open.remove(at);
                        recording.calls[index].result = Some((event.seq, result.clone()));
                    }
                }
                Some(Kind::UserMessage(user)) => {
                    recording.users.push((event.seq, user.text.clone()))
                }
                _ => {}
            }
        }
        recording
    }

    /// The next call on the path after the one answered at `served_through` (0: the first).
    pub fn next_call(&self, served_through: u64) -> Option<&RecordedCall> {
        if served_through == 0 {
            return self.calls.first();
        }
        let at = self.calls.iter().position(|call| {
            call.result
                .as_ref()
                .is_some_and(|(seq, _)| *seq == served_through)
        })?;
        self.calls.get(at + 1)
    }

    /// The first user message recorded after seq `after`.
    pub fn next_user(&self, after: u64) -> Option<&(u64, String)> {
        self.users.iter().find(|(seq, _)| *seq > after)
    }
}

/// The recording of a replay as this claim reads it, and whether its session is gone.
#[derive(Debug)]
pub struct RecordingFeed {
    /// `None` until read; `Some(None)` when it could not be (the session was deleted first).
    loaded: watch::Receiver<Option<Option<Arc<Recording>>>>,
    parent_gone: Arc<AtomicBool>,
    follower: JoinHandle<()>,
}

impl Drop for RecordingFeed {
    fn drop(&mut self) {
        self.follower.abort();
    }
}

impl RecordingFeed {
    /// Starts reading `replay`'s recording, and stays subscribed to learn of its deletion.
    pub fn start(client: StoreClient, replay: &Replay) -> RecordingFeed {
        let (publish, loaded) = watch::channel(None);
        let parent_gone = Arc::new(AtomicBool::new(false));
        let gone = parent_gone.clone();
        let (session_id, after, through) = (
            replay.session_id.clone(),
            replay.after_seq,
            replay.through_seq,
        );
        let follower = tokio::spawn(async move {
            let mut events: Vec<Event> = Vec::new();
            let publish = &publish;
            if through <= after {
                publish.send_replace(Some(Some(Arc::new(Recording::of(&session_id, &[])))));
            }
            let note = |note: Note<'_>| tracing::debug!(?note, "following the recording");
            let followed = follow(
                &client,
                &session_id,
                after + 1,
                Refusals::Retry,
                note,
                |event: Event| {
                    if event.seq <= through && !matches!(event.kind, Some(Kind::AssistantDelta(_)))
                    {
                        events.push(event.clone());
                    }
                    if event.seq == through {
                        let recording = Recording::of(&session_id, &std::mem::take(&mut events));
                        publish.send_replace(Some(Some(Arc::new(recording))));
                    }
                    async { Ok::<_, std::convert::Infallible>(Flow::Continue) }
                },
            )
            .await;
            if let Err(FollowError::Refused(status)) = followed {
                if is_session_deleted(&status) {
                    tracing::warn!(recording = %session_id, "the replay's recording was deleted: the rest of the replay runs off the recorded path");
                    gone.store(true, Ordering::SeqCst);
                }
            }
            // Whatever was not read by now never will be.
            publish.send_if_modified(|loaded| {
                if loaded.is_none() {
                    *loaded = Some(None);
                    true
                } else {
                    false
                }
            });
        });
        RecordingFeed {
            loaded,
            parent_gone,
            follower,
        }
    }

    /// The recording, once read; `None` if it could not be.
    pub async fn recording(&self) -> Option<Arc<Recording>> {
        let mut loaded = self.loaded.clone();
        let recording = match loaded.wait_for(Option::is_some).await {
            Ok(value) => value.clone().flatten(),
            Err(_) => None,
        };
        recording
    }

    /// Whether the recorded session was deleted: nothing more is served.
    pub fn parent_gone(&self) -> bool {
        self.parent_gone.load(Ordering::SeqCst)
    }
}

/// Where the replay leaves the recorded path, in words for the log and the model.
#[derive(Debug, Clone, PartialEq)]
pub struct OffPath {
    pub why: String,
}

/// What serving did with the open calls of the last reply.
#[derive(Debug, PartialEq)]
pub enum Serving {
    /// At least one call got its recorded result: fold again.
    Served,
    /// The first open call is off the path.
    Left(OffPath),
}

/// Whether `call` is the recorded one, as the path asks: the same tool and the same input.
fn follows_path(call: &PendingCall, recorded: &RecordedCall) -> bool {
    call.tool_use.name == recorded.name
        && struct_to_object(call.tool_use.input.as_ref()) == recorded.input
}

fn shown(name: &str, input: &Map<String, Value>) -> String {
    let mut text = format!("{name} {}", Value::Object(input.clone()));
    if text.len() > 200 {
        let mut end = 200;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push('…');
    }
    text
}

/// Serves the open calls of the last reply that follow the recorded path, in order, up to
/// the first that does not.
pub async fn serve_calls(
    checkpoints: &Arc<Checkpoints>,
    appender: &Appender,
    recording: Option<&Recording>,
    parent_gone: bool,
    state: &ReplayState,
    calls: &[PendingCall],
) -> Result<Serving, StoreError> {
    let mut served_through = state.served_through;
    let mut served = 0;
    for call in calls {
        if matches!(call.state, CallState::Finished(_)) {
            continue;
        }
        let recorded = match (recording, parent_gone) {
            (_, true) | (None, _) => Err(format!(
                "the recording (session {}) is gone",
                state.recording.session_id
            )),
            (Some(recording), false) => match recording.next_call(served_through) {
                None => Err(format!(
                    "the recording (session {}) has no more calls",
                    state.recording.session_id
                )),
                Some(next) => match &next.result {
                    Some((seq, result)) if follows_path(call, next) => Ok((*seq, result.clone())),
                    Some((seq, _)) => Err(format!(
                        "the model asked for {} where the recording (session {}) called {} \
                         (answered at seq {seq})",
                        shown(
                            &call.tool_use.name,
                            &struct_to_object(call.tool_use.input.as_ref())
                        ),
                        state.recording.session_id,
                        shown(&next.name, &next.input)
                    )),
                    None => Err(format!(
                        "the recording (session {}) has no result for its next call, {}",
                        state.recording.session_id,
                        shown(&next.name, &next.input)
                    )),
                },
            },
        };
        let (seq, result) = match recorded {
            Ok(found) => found,
            Err(why) if served == 0 => return Ok(Serving::Left(OffPath { why })),
            Err(_) => break,
        };
        if let Some(id) = &result.workspace_checkpoint {
            match keep_served(checkpoints, appender.session_id(), id).await {
                Ok(true) => {}
                Ok(false) => {
                    tracing::warn!(checkpoint = %id, "the served result's checkpoint is not in this runner's area: leaving the path would find no files")
                }
                Err(e) => {
                    tracing::warn!(error = %e, checkpoint = %id, "could not keep the served result's checkpoint")
                }
            }
        }
        let id = &call.tool_use.id;
        tracing::info!(tool_use_id = %id, tool = %call.tool_use.name, recorded_seq = seq, "serving the recorded result");
        appender
            .append(
                format!("result:{id}"),
                Kind::ToolResult(ToolResult {
                    tool_use_id: id.clone(),
                    content: result.content.clone(),
                    is_error: result.is_error,
                    workspace_checkpoint: result.workspace_checkpoint.clone(),
                    served_from: Some(ServedFrom {
                        session_id: state.recording.session_id.clone(),
                        seq,
                    }),
                }),
                Durability::Sync,
            )
            .await?;
        crate::metrics::call_served(&call.tool_use.name);
        served_through = seq;
        served += 1;
    }
    Ok(Serving::Served)
}

async fn keep_served(
    checkpoints: &Arc<Checkpoints>,
    session_id: &str,
    id: &str,
) -> Result<bool, CheckpointError> {
    checkpoints.fetch_for(session_id, id).await?;
    let this = checkpoints.clone();
    let (session_id, id) = (session_id.to_string(), id.to_string());
    tokio::task::spawn_blocking(move || this.keep_served(&session_id, &id))
        .await
        .map_err(|e| CheckpointError::Task(e.to_string()))?
}

/// `--off-path stop`: every open call gets an error result saying it did not run (naming
/// the workspace as the recording left it), then the turn ends with a `run_error`.
pub async fn stop_off_path(
    appender: &Appender,
    state: &ReplayState,
    calls: &[PendingCall],
    turn: u64,
    off: &OffPath,
) -> Result<(), StoreError> {
    let checkpoint = state.behind.as_ref().and_then(|b| b.checkpoint.clone());
    for call in calls {
        if matches!(call.state, CallState::Finished(_)) {
            continue;
        }
        let id = &call.tool_use.id;
        appender
            .append(
                format!("result:{id}"),
                Kind::ToolResult(ToolResult {
                    tool_use_id: id.clone(),
                    content: format!(
                        "not run: this replay left the recorded path here and runs nothing off \
                         it (--off-path stop): {}",
                        off.why
                    ),
                    is_error: true,
                    workspace_checkpoint: checkpoint.clone(),
                    served_from: None,
                }),
                Durability::Sync,
            )
            .await?;
    }
    tracing::info!(why = %off.why, "the replay left the recorded path; --off-path stop ends it");
    appender
        .append(
            format!("error:{turn}"),
            Kind::RunError(RunError {
                message: format!(
                    "the replay left the recorded path and stopped (--off-path stop): {}",
                    off.why
                ),
                retryable: false,
            }),
            Durability::Sync,
        )
        .await?;
    Ok(())
}

/// Moves the workspace to the served result the log says it is behind, if it is: before
/// anything runs in it or records it, once the replay left the path.
pub async fn catch_up_workspace(
    checkpoints: &Arc<Checkpoints>,
    session_id: &str,
    behind: &Behind,
) -> Result<(), CheckpointError> {
    let report = checkpoints
        .move_to_served(session_id, behind.seq, behind.checkpoint.clone())
        .await?;
    if let Some(report) = report {
        tracing::info!(%report, "moved the replay's workspace to the recording's");
    }
    Ok(())
}

/// Appends the recording's next user message, if there is one: returns whether it did.
pub async fn replay_next_user(
    appender: &Appender,
    recording: Option<&Recording>,
    state: &ReplayState,
) -> Result<bool, StoreError> {
    let after = state.users_through.max(state.recording.after_seq);
    let Some((seq, text)) = recording.and_then(|r| r.next_user(after)) else {
        return Ok(false);
    };
    tracing::info!(
        recorded_seq = seq,
        "replaying the recording's next user message"
    );
    appender
        .append(
            agentlog_proto::replay::user_event_id(*seq),
            Kind::UserMessage(UserMessage { text: text.clone() }),
            Durability::Sync,
        )
        .await?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use agentlog_proto::v1::{AssistantMessage, ContentBlock, ToolUseBlock};
    use serde_json::json;

    use super::*;
    use agentlog_client::json::object_to_struct;

    fn ev(seq: u64, kind: Kind) -> Event {
        Event {
            seq,
            kind: Some(kind),
            ..Event::default()
        }
    }

    fn call(id: &str, name: &str, input: Value) -> ContentBlock {
        let Value::Object(input) = input else {
            panic!("an object")
        };
        ContentBlock {
            block: Some(Block::ToolUse(ToolUseBlock {
                id: id.into(),
                name: name.into(),
                input: Some(object_to_struct(input)),
            })),
        }
    }

    fn result(id: &str, content: &str) -> Kind {
        Kind::ToolResult(ToolResult {
            tool_use_id: id.into(),
            content: content.into(),
            ..ToolResult::default()
        })
    }

    #[test]
    fn a_recording_lists_its_calls_in_log_order_with_their_results_and_user_turns() {
        let events = vec![
            ev(
                2,
                Kind::AssistantMessage(AssistantMessage {
                    content: vec![
                        call("a", "bash", json!({"command": "ls"})),
                        call("b", "read_file", json!({"path": "x"})),
                    ],
                    ..AssistantMessage::default()
                }),
            ),
            ev(3, Kind::ToolStarted(Default::default())),
            ev(4, result("a", "x\n")),
            ev(
                5,
                Kind::UserMessage(UserMessage {
                    text: "also".into(),
                }),
            ),
            ev(6, result("b", "hello")),
            ev(
                7,
                Kind::AssistantMessage(AssistantMessage {
                    content: vec![call("c", "bash", json!({"command": "pwd"}))],
                    ..AssistantMessage::default()
                }),
            ),
        ];
        let recording = Recording::of("p", &events);
        let results: Vec<Option<u64>> = recording
            .calls
            .iter()
            .map(|c| c.result.as_ref().map(|(seq, _)| *seq))
            .collect();
        assert_eq!(results, vec![Some(4), Some(6), None]);
        assert_eq!(
            recording.next_call(0).map(|c| c.name.as_str()),
            Some("bash")
        );
        assert_eq!(
            recording.next_call(4).map(|c| c.name.as_str()),
            Some("read_file")
        );
        assert_eq!(
            recording.next_call(6).map(|c| &c.input),
            Some(&{
                let Value::Object(o) = json!({"command": "pwd"}) else {
                    unreachable!()
                };
                o
            })
        );
        assert_eq!(recording.next_call(99), None);
        assert_eq!(recording.next_user(1), Some(&(5, "also".to_string())));
        assert_eq!(recording.next_user(5), None);
    }
}
