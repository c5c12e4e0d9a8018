//! A fold as bytes: what the runner keeps in the store (`PutSnapshot`, format [`FORMAT`])
//! so that a runner that never worked a session starts from it and folds only the events
//! after it, instead of the whole log.
//!
//! Promises:
//! - [`FoldState::from_snapshot`] of [`FoldState::to_snapshot`] is the same state: applying
//!   the rest of the log to it folds to what folding from seq 1 gives (the property test
//!   `a_fold_restored_from_a_snapshot_at_any_seq_folds_the_rest_the_same` in `fold.rs`).
//! - The encoding is protobuf (prost) with explicit tags, so it reads the same across
//!   builds; [`VERSION`] is inside the data and is bumped whenever the shape of
//!   [`FoldState`] or the meaning of a field changes. Data of another version, or data that
//!   does not decode, is refused ([`SnapshotError`]) and the caller folds from seq 1: a
//!   snapshot only ever saves time, the log stays the truth.
//! - A fold that keeps its settled messages in a provider's form
//!   ([`super::transcript`]) stores those bytes as they are, with the form's name: the data
//!   is the record (length-delimited), then the transcript's bytes. A restore keeps the
//!   transcript in the pieces it arrived in, neither copied nor decoded, and a runner of
//!   another form refuses it.

use std::collections::HashMap;

use agentlog_proto::v1::{AssistantMessage, Budget, Replay, ToolResult, ToolUseBlock};

use bytes::{Bytes, BytesMut};

use super::config::{Behind, LogCheckpoint, ReplayState, SessionConfigState};
use super::run::RunState;
use super::transcript::{Form, Transcript};
use super::{Approval, FoldState, Message, PendingInterrupt, UserBlock};

/// The snapshot format the runner writes and reads in the store.
pub const FORMAT: &str = "runner-fold";
/// The shape of [`FoldState`] this build encodes.
pub const VERSION: u32 = 6;

#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SnapshotError {
    #[error("the snapshot does not decode: {0}")]
    Undecodable(String),
    #[error("the snapshot holds fold version {found}; this runner reads version {VERSION}")]
    Version { found: u32 },
    #[error(
        "the snapshot keeps its conversation in the form {found:?}; this runner's is {expected:?}"
    )]
    Form {
        found: String,
        expected: &'static str,
    },
}

#[derive(Clone, PartialEq, prost::Message)]
struct FoldRecord {
    #[prost(uint32, tag = "1")]
    version: u32,
    #[prost(message, repeated, tag = "2")]
    messages: Vec<MessageRecord>,
    #[prost(message, repeated, tag = "3")]
    open_calls: Vec<ToolUseBlock>,
    #[prost(string, repeated, tag = "4")]
    user_texts: Vec<String>,
    /// Keyed by `tool_use_id`.
    #[prost(message, repeated, tag = "5")]
    results: Vec<ToolResult>,
    #[prost(map = "string, uint32", tag = "6")]
    attempts: HashMap<String, u32>,
    #[prost(message, repeated, tag = "7")]
    approvals: Vec<ApprovalRecord>,
    #[prost(uint64, tag = "8")]
    turn: u64,
    #[prost(bool, tag = "9")]
    ended: bool,
    #[prost(message, optional, tag = "10")]
    interrupt: Option<InterruptRecord>,
    #[prost(bool, tag = "11")]
    user_since_interrupt: bool,
    #[prost(uint64, tag = "12")]
    last_interrupt_seq: u64,
    /// The transcript's form ("" without one), its replies and call ids (its bytes follow
    /// the record).
    #[prost(string, tag = "13")]
    form: String,
    #[prost(uint64, tag = "15")]
    transcript_replies: u64,
    #[prost(string, repeated, tag = "16")]
    transcript_call_ids: Vec<String>,
    /// How many bytes follow the record: a snapshot cut short is refused.
    #[prost(uint64, tag = "17")]
    transcript_bytes: u64,
    #[prost(string, optional, tag = "18")]
    model: Option<String>,
    #[prost(message, optional, tag = "19")]
    replay: Option<ReplayRecord>,
    #[prost(message, optional, tag = "20")]
    run: Option<RunState>,
    #[prost(string, repeated, tag = "21")]
    fallback_models: Vec<String>,
    #[prost(message, optional, tag = "22")]
    budget: Option<Budget>,
    /// [`LogCheckpoint`]: no result yet (false), or the id the last one names ("": none).
    #[prost(bool, tag = "23")]
    results_seen: bool,
    #[prost(string, tag = "24")]
    workspace_checkpoint: String,
}

/// [`ReplayState`]; `behind_seq` 0 means not behind.
#[derive(Clone, PartialEq, prost::Message)]
struct ReplayRecord {
    #[prost(message, optional, tag = "1")]
    recording: Option<Replay>,
    #[prost(uint64, tag = "2")]
    served_through: u64,
    #[prost(bool, tag = "3")]
    left_path: bool,
    #[prost(uint64, tag = "4")]
    behind_seq: u64,
    #[prost(string, optional, tag = "5")]
    behind_checkpoint: Option<String>,
    #[prost(uint64, tag = "6")]
    users_through: u64,
}

#[derive(Clone, PartialEq, prost::Message)]
struct MessageRecord {
    #[prost(oneof = "MessageKind", tags = "1, 2")]
    kind: Option<MessageKind>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum MessageKind {
    #[prost(message, tag = "1")]
    User(UserRecord),
    #[prost(message, tag = "2")]
    Assistant(AssistantMessage),
}

#[derive(Clone, PartialEq, prost::Message)]
struct UserRecord {
    #[prost(message, repeated, tag = "1")]
    blocks: Vec<UserBlockRecord>,
}

#[derive(Clone, PartialEq, prost::Message)]
struct UserBlockRecord {
    #[prost(oneof = "UserBlockKind", tags = "1, 2")]
    kind: Option<UserBlockKind>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum UserBlockKind {
    #[prost(message, tag = "1")]
    ToolResult(ToolResult),
    #[prost(string, tag = "2")]
    Text(String),
}

/// `state`: 1 pending, 2 approved, 3 denied (with `note`). `Approval::NotAsked` is never
/// stored (the fold keeps no entry for it either).
#[derive(Clone, PartialEq, prost::Message)]
struct ApprovalRecord {
    #[prost(string, tag = "1")]
    tool_use_id: String,
    #[prost(uint32, tag = "2")]
    state: u32,
    #[prost(string, tag = "3")]
    note: String,
}

#[derive(Clone, PartialEq, prost::Message)]
struct InterruptRecord {
    #[prost(uint64, tag = "1")]
    seq: u64,
    #[prost(string, tag = "2")]
    reason: String,
}

impl FoldState {
    /// The fold as snapshot data; `None` while its conversation is lent out (the state is
    /// incomplete then).
    pub fn to_snapshot(&self) -> Option<Vec<u8>> {
        if self.lent {
            return None;
        }
        let record = FoldRecord {
            version: VERSION,
            messages: self
                .messages
                .iter()
                .map(|message| MessageRecord {
                    kind: Some(match message {
                        Message::User(blocks) => MessageKind::User(UserRecord {
                            blocks: blocks
                                .iter()
                                .map(|block| UserBlockRecord {
                                    kind: Some(match block {
                                        UserBlock::ToolResult(r) => {
                                            UserBlockKind::ToolResult(r.clone())
                                        }
                                        UserBlock::Text(t) => UserBlockKind::Text(t.clone()),
                                    }),
                                })
                                .collect(),
                        }),
                        Message::Assistant(reply) => MessageKind::Assistant(reply.clone()),
                    }),
                })
                .collect(),
            open_calls: self.open_calls.clone(),
            user_texts: self.user_texts.clone(),
            results: self.results.values().cloned().collect(),
            attempts: self.attempts.clone(),
            approvals: self
                .approvals
                .iter()
                .filter_map(|(id, approval)| {
                    let (state, note) = match approval {
                        Approval::NotAsked => return None,
                        Approval::Pending => (1, String::new()),
                        Approval::Approved => (2, String::new()),
                        Approval::Denied { note } => (3, note.clone()),
                    };
                    Some(ApprovalRecord {
                        tool_use_id: id.clone(),
                        state,
                        note,
                    })
                })
                .collect(),
            turn: self.turn,
            ended: self.ended,
            interrupt: self.interrupt.as_ref().map(|i| InterruptRecord {
                seq: i.seq,
                reason: i.reason.clone(),
            }),
            user_since_interrupt: self.user_since_interrupt,
            last_interrupt_seq: self.last_interrupt_seq,
            form: self.transcript.form_name().to_string(),
            transcript_replies: self.transcript.replies(),
            transcript_call_ids: self.transcript.call_ids().iter().cloned().collect(),
            transcript_bytes: self.transcript.len() as u64,
            model: self.config.model.clone(),
            replay: self.config.replay.as_ref().map(|r| ReplayRecord {
                recording: Some(r.recording.clone()),
                served_through: r.served_through,
                left_path: r.left_path,
                behind_seq: r.behind.as_ref().map_or(0, |b| b.seq),
                behind_checkpoint: r.behind.as_ref().and_then(|b| b.checkpoint.clone()),
                users_through: r.users_through,
            }),
            run: Some(self.run.clone()),
            fallback_models: self.config.fallback_models.clone(),
            budget: self.config.budget,
            results_seen: self.config.workspace != LogCheckpoint::NoneYet,
            workspace_checkpoint: match &self.config.workspace {
                LogCheckpoint::Named(id) => id.clone(),
                _ => String::new(),
            },
        };
        let mut data = prost::Message::encode_length_delimited_to_vec(&record);
        data.reserve(self.transcript.len());
        self.transcript.write_to(&mut data);
        Some(data)
    }

    /// The fold a snapshot holds, if it is of this build's [`VERSION`], keeps its settled
    /// messages in `form` (`None`: as messages), and is well formed. `pieces` are the data
    /// as it arrived (cut anywhere); the transcript keeps sharing them.
    pub fn from_snapshot(
        pieces: Vec<Bytes>,
        form: Option<&'static dyn Form>,
    ) -> Result<FoldState, SnapshotError> {
        FoldState::from_snapshot_in(pieces, form.as_slice())
    }

    /// [`FoldState::from_snapshot`] for a fold kept in any of `forms` (none: as messages):
    /// a runner of several models takes a session's snapshot in whichever its model uses.
    pub fn from_snapshot_in(
        pieces: Vec<Bytes>,
        forms: &[&'static dyn Form],
    ) -> Result<FoldState, SnapshotError> {
        let undecodable = |e: prost::DecodeError| SnapshotError::Undecodable(e.to_string());
        // A varint takes at most 10 bytes.
        let (head, _) = split_at(pieces.clone(), 10);
        let length = prost::encoding::decode_varint(&mut &head[..]).map_err(undecodable)?;
        let length_bytes = prost::encoding::encoded_len_varint(length);
        let end = usize::try_from(length)
            .ok()
            .and_then(|length| length.checked_add(length_bytes));
        let (record, transcript) = end
            .map(|end| split_at(pieces, end))
            .filter(|(record, _)| Some(record.len()) == end)
            .ok_or_else(|| SnapshotError::Undecodable("the record is cut short".into()))?;
        let record: FoldRecord =
            prost::Message::decode(record.slice(length_bytes..)).map_err(undecodable)?;
        if record.version != VERSION {
            return Err(SnapshotError::Version {
                found: record.version,
            });
        }
        let following: usize = transcript.iter().map(Bytes::len).sum();
        if following as u64 != record.transcript_bytes {
            return Err(SnapshotError::Undecodable(format!(
                "{following} bytes follow the record, which names {}",
                record.transcript_bytes
            )));
        }
        let form = forms
            .iter()
            .copied()
            .find(|form| form.name() == record.form);
        if form.is_none() && !(forms.is_empty() && record.form.is_empty()) {
            return Err(SnapshotError::Form {
                found: record.form,
                expected: forms.first().map_or("", |form| form.name()),
            });
        }
        let transcript = match form {
            Some(form) => Transcript::from_parts(
                form,
                transcript,
                record.transcript_replies,
                record.transcript_call_ids.into_iter().collect(),
            ),
            None => Transcript::default(),
        };
        let missing = |what: &str| SnapshotError::Undecodable(format!("{what} has no kind"));
        let mut messages = Vec::with_capacity(record.messages.len());
        for message in record.messages {
            messages.push(match message.kind.ok_or_else(|| missing("a message"))? {
                MessageKind::Assistant(reply) => Message::Assistant(reply),
                MessageKind::User(user) => {
                    let mut blocks = Vec::with_capacity(user.blocks.len());
                    for block in user.blocks {
                        blocks.push(match block.kind.ok_or_else(|| missing("a user block"))? {
                            UserBlockKind::ToolResult(r) => UserBlock::ToolResult(r),
                            UserBlockKind::Text(t) => UserBlock::Text(t),
                        });
                    }
                    Message::User(blocks)
                }
            });
        }
        let mut approvals = HashMap::with_capacity(record.approvals.len());
        for a in record.approvals {
            let approval = match a.state {
                1 => Approval::Pending,
                2 => Approval::Approved,
                3 => Approval::Denied { note: a.note },
                other => {
                    return Err(SnapshotError::Undecodable(format!(
                        "approval state {other} is not known"
                    )))
                }
            };
            approvals.insert(a.tool_use_id, approval);
        }
        Ok(FoldState {
            transcript,
            messages,
            open_calls: record.open_calls,
            user_texts: record.user_texts,
            results: record
                .results
                .into_iter()
                .map(|r| (r.tool_use_id.clone(), r))
                .collect(),
            attempts: record.attempts,
            approvals,
            turn: record.turn,
            ended: record.ended,
            interrupt: record.interrupt.map(|i| PendingInterrupt {
                seq: i.seq,
                reason: i.reason,
            }),
            user_since_interrupt: record.user_since_interrupt,
            last_interrupt_seq: record.last_interrupt_seq,
            lent: false,
            config: SessionConfigState {
                model: record.model,
                replay: record.replay.map(|r| ReplayState {
                    recording: r.recording.unwrap_or_default(),
                    served_through: r.served_through,
                    left_path: r.left_path,
                    behind: (r.behind_seq > 0).then_some(Behind {
                        seq: r.behind_seq,
                        checkpoint: r.behind_checkpoint,
                    }),
                    users_through: r.users_through,
                }),
                fallback_models: record.fallback_models,
                budget: record.budget,
                workspace: match (record.results_seen, record.workspace_checkpoint) {
                    (false, _) => LogCheckpoint::NoneYet,
                    (true, id) if id.is_empty() => LogCheckpoint::Unnamed,
                    (true, id) => LogCheckpoint::Named(id),
                },
            },
            run: record.run.unwrap_or_default(),
        })
    }
}

/// The first `at` bytes of `pieces` (copied: a record is small) and the pieces after them
/// (shared); fewer bytes when the pieces hold fewer.
fn split_at(pieces: Vec<Bytes>, at: usize) -> (Bytes, Vec<Bytes>) {
    let mut head = BytesMut::new();
    let mut rest = Vec::new();
    for piece in pieces {
        let need = at - head.len();
        if need == 0 {
            rest.push(piece);
        } else if piece.len() <= need {
            head.extend_from_slice(&piece);
        } else {
            head.extend_from_slice(&piece[..need]);
            rest.push(piece.slice(need..));
        }
    }
    (head.freeze(), rest)
}
