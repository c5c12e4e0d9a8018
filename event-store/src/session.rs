//! What the store knows about one session, and the rules that derive it from the log: the
//! status (runnable, idle or waiting for a person) from the last non-delta event and the
//! approvals still pending, the title from the first user
//! message, the lease from the last lease record, and where a fork came from. Recovery and
//! the live writer apply records through the same functions, so both always agree.
//!
//! A deleted session is a tombstone ([`SessionMeta::tombstone`]): the time of its deletion
//! and nothing else (no title, no text, no lease, `last_seq` 0), kept for good so that its
//! id stays dead.

use agentlog_proto::v1::{
    event, ContentBlock, Event, ForkedFrom, Lease, SessionInfo, SessionStatus,
};
use std::collections::HashMap;

use prost::Message;

/// A lease grant, renewal or release for one session, as the rules decide on it (and as the
/// local log stores it: its fields are that record's encoding).
#[derive(Clone, PartialEq, Message)]
pub struct LeaseRecord {
    #[prost(string, tag = "1")]
    pub session_id: String,
    #[prost(string, tag = "2")]
    pub owner: String,
    #[prost(uint64, tag = "3")]
    pub epoch: u64,
    #[prost(int64, tag = "4")]
    pub expires_unix_ms: i64,
    #[prost(bool, tag = "5")]
    pub released: bool,
}

/// The start of a fork's log (`ForkSession`): the parent and the last seq taken from it,
/// and when the fork was made (its creation and last update until it gets events of its
/// own; the prefix's events keep their own times). The local log stores it as the first
/// record of the fork's atomic append, with the fork's state at `seq` (`state`): the fork
/// then shares its prefix with the parent instead of holding a copy of it
/// ([`SessionMeta::base_session`]), and recovery takes that state as it is.
#[derive(Clone, PartialEq, Message)]
pub struct ForkRecord {
    #[prost(string, tag = "1")]
    pub session_id: String,
    #[prost(string, tag = "2")]
    pub parent: String,
    #[prost(uint64, tag = "3")]
    pub seq: u64,
    #[prost(int64, tag = "4")]
    pub ts_unix_ms: i64,
    /// The fork's state at `seq` (without text, as the local index keeps states), its
    /// prefix read through `parent`; absent in a fork written with its prefix copied.
    #[prost(message, optional, tag = "5")]
    pub state: Option<SessionMeta>,
}

/// The first user message is kept up to this many bytes, for `ListSessions` queries.
const FIRST_USER_TEXT_BYTES: usize = 4096;
/// The title is the start of the first user message.
const TITLE_CHARS: usize = 80;

/// The current schema of events written by this store.
pub const SCHEMA_VERSION: u32 = 1;

#[derive(Clone, PartialEq, Message)]
pub struct SessionMeta {
    #[prost(uint64, tag = "1")]
    pub last_seq: u64,
    #[prost(int64, tag = "2")]
    pub created_unix_ms: i64,
    #[prost(int64, tag = "3")]
    pub updated_unix_ms: i64,
    #[prost(enumeration = "SessionStatus", tag = "4")]
    pub status: i32,
    #[prost(string, tag = "5")]
    pub first_user_text: String,
    /// The newest lease ever granted (kept after release or expiry: its epoch is the floor
    /// for the next grant).
    #[prost(message, optional, tag = "6")]
    pub lease: Option<LeaseRecord>,
    /// Calls with an `approval_requested` and neither a decision nor a result yet.
    #[prost(string, repeated, tag = "7")]
    pub pending_approvals: Vec<String>,
    /// A user turn arrived after the latest `interrupt`: the `interrupted` that answers it
    /// leaves that turn to work (the runner's fold says the same), so the session stays
    /// runnable.
    #[prost(bool, tag = "8")]
    pub user_since_interrupt: bool,
    /// Set if the session is a fork (`SessionInfo.forked_from`).
    #[prost(message, optional, tag = "9")]
    pub forked_from: Option<ForkedFrom>,
    /// When the session was deleted (0: it was not). A deleted session keeps nothing else.
    #[prost(int64, tag = "10")]
    pub deleted_unix_ms: i64,
    /// The seq of the user message `first_user_text` was taken from (0: none yet). Set
    /// with the text, once: the local index keeps this and not the text, which is read back
    /// from the log (so that no session's text is ever written into the index's files).
    #[prost(uint64, tag = "11")]
    pub first_user_seq: u64,
    /// The session whose log holds this one's seqs `1..=base_seq` (a fork sharing its
    /// parent's prefix, in the local log; empty: every seq is the session's own). Its seq
    /// `s` is read as the base's seq `s`, with this session's id. Kept by a tombstone until
    /// the deleted session's records are gone (its own forks may still read through it).
    #[prost(string, tag = "12")]
    pub base_session: String,
    #[prost(uint64, tag = "13")]
    pub base_seq: u64,
    /// Never deleted by retention (`PinSession`); `SessionInfo.pinned`.
    #[prost(bool, tag = "14")]
    pub pinned: bool,
    /// The `retry_at_unix_ms` of a `model_retry` that is the last event to say who has
    /// work (0: none): `ClaimSession` hands the session out no sooner. (A store of release
    /// 0.1.0 drops this field when it writes the state; the runner keeps the logged time
    /// itself, whatever the store says.)
    #[prost(int64, tag = "15")]
    pub not_before_unix_ms: i64,
    /// The recording the session replays, as its latest `session_config` naming a model
    /// says (none: it is no replay): the seqs whose user turns a runner may append to it.
    #[prost(message, optional, tag = "16")]
    pub replay: Option<ReplayRange>,
    /// The session began under a release that keeps `replay` (0.2.0 on): `replay` is whole.
    /// A state release 0.1.0 began lacks it, and its replays are taken on trust.
    #[prost(bool, tag = "17")]
    pub tracks_replay: bool,
}

/// A replay's recording: `session_id`'s seqs after `after_seq` up to `through_seq`.
#[derive(Clone, PartialEq, Message)]
pub struct ReplayRange {
    #[prost(string, tag = "1")]
    pub session_id: String,
    #[prost(uint64, tag = "2")]
    pub after_seq: u64,
    #[prost(uint64, tag = "3")]
    pub through_seq: u64,
}

/// Whether `id` is a valid session id (or lease owner's): 1-128 characters of
/// `[A-Za-z0-9._:-]`, starting with a letter or digit.
pub fn is_valid_id(id: &str) -> bool {
    !id.is_empty()
        && id.len() <= crate::wire::MAX_ID_LEN
        && id.as_bytes()[0].is_ascii_alphanumeric()
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

/// Who writes an event kind. Runner-written kinds need the session's current lease; the
/// others are a person's (a turn, an interrupt, an approval decision, the session's
/// configuration).
pub fn is_runner_kind(kind: &event::Kind) -> bool {
    !matches!(
        kind,
        event::Kind::UserMessage(_)
            | event::Kind::Interrupt(_)
            | event::Kind::ApprovalDecision(_)
            | event::Kind::SessionConfig(_)
    )
}

/// The kind's name as it appears in the proto `oneof`, for error messages.
pub fn kind_name(kind: &event::Kind) -> &'static str {
    match kind {
        event::Kind::UserMessage(_) => "user_message",
        event::Kind::AssistantMessage(_) => "assistant_message",
        event::Kind::ToolStarted(_) => "tool_started",
        event::Kind::ToolResult(_) => "tool_result",
        event::Kind::AssistantDelta(_) => "assistant_delta",
        event::Kind::RunError(_) => "run_error",
        event::Kind::Interrupt(_) => "interrupt",
        event::Kind::Interrupted(_) => "interrupted",
        event::Kind::ApprovalRequested(_) => "approval_requested",
        event::Kind::ApprovalDecision(_) => "approval_decision",
        event::Kind::SessionConfig(_) => "session_config",
        event::Kind::ModelRetry(_) => "model_retry",
        event::Kind::RunPaused(_) => "run_paused",
    }
}

impl SessionMeta {
    /// The tombstone of a session deleted at `deleted_unix_ms`: the deletion time alone.
    pub fn tombstone(deleted_unix_ms: i64) -> SessionMeta {
        SessionMeta {
            deleted_unix_ms: deleted_unix_ms.max(1),
            ..SessionMeta::default()
        }
    }

    /// About what the state takes in memory with its session id, as a cache keyed by the
    /// id holds it: the entry itself and what it holds on the heap.
    pub fn cached_bytes(&self, session_id: &str) -> usize {
        let heap = self.first_user_text.capacity()
            + self.lease.as_ref().map_or(0, |l| l.owner.capacity() + 48)
            + self
                .pending_approvals
                .iter()
                .map(|a| a.capacity() + 24)
                .sum::<usize>()
            + self
                .forked_from
                .as_ref()
                .map_or(0, |f| f.session_id.capacity() + 40)
            + self.base_session.capacity()
            + self
                .replay
                .as_ref()
                .map_or(0, |r| r.session_id.capacity() + 40);
        session_id.len() + std::mem::size_of::<(String, SessionMeta)>() + 16 + heap
    }

    /// Where seq `seq` is read from when it is not the session's own: the base session, if
    /// `seq` is in the prefix the session shares with it.
    pub fn base_of(&self, seq: u64) -> Option<&str> {
        (!self.base_session.is_empty() && seq <= self.base_seq).then_some(&self.base_session)
    }

    pub fn is_deleted(&self) -> bool {
        self.deleted_unix_ms > 0
    }

    pub fn is_runnable(&self) -> bool {
        self.status() == SessionStatus::Runnable
    }

    /// Folds one event (already given its seq) into the session's state.
    pub fn apply_event(&mut self, event: &Event) {
        // A fork was created when it was made, not when the parent's first event was.
        if self.last_seq == 0 && self.forked_from.is_none() {
            self.created_unix_ms = event.ts_unix_ms;
            self.tracks_replay = true;
        }
        self.last_seq = event.seq;
        self.updated_unix_ms = self.updated_unix_ms.max(event.ts_unix_ms);
        let Some(kind) = &event.kind else { return };
        if !matches!(
            kind,
            event::Kind::AssistantDelta(_) | event::Kind::SessionConfig(_)
        ) {
            self.not_before_unix_ms = 0;
        }
        match kind {
            event::Kind::UserMessage(m) => {
                if self.first_user_seq == 0 && self.first_user_text.is_empty() {
                    self.set_first_user_text(event.seq, &m.text);
                }
                self.user_since_interrupt = true;
                self.status = self.runnable_unless_waiting();
            }
            event::Kind::ToolStarted(_) => self.status = SessionStatus::Runnable as i32,
            event::Kind::ToolResult(r) => {
                self.pending_approvals.retain(|id| *id != r.tool_use_id);
                self.status = self.runnable_unless_waiting();
            }
            event::Kind::AssistantMessage(m) => {
                let wants_tools = m.content.iter().any(|b| {
                    matches!(
                        b,
                        ContentBlock {
                            block: Some(agentlog_proto::v1::content_block::Block::ToolUse(_))
                        }
                    )
                });
                self.status = if wants_tools {
                    SessionStatus::Runnable
                } else {
                    SessionStatus::Idle
                } as i32;
            }
            event::Kind::RunError(_) => {
                self.pending_approvals.clear();
                self.status = SessionStatus::Idle as i32;
            }
            event::Kind::Interrupted(_) => {
                self.pending_approvals.clear();
                self.status = if self.user_since_interrupt {
                    SessionStatus::Runnable
                } else {
                    SessionStatus::Idle
                } as i32;
            }
            // A runner must answer an interrupt, whatever the session was doing.
            event::Kind::Interrupt(_) => {
                self.user_since_interrupt = false;
                self.status = SessionStatus::Runnable as i32;
            }
            event::Kind::ApprovalRequested(r) => {
                if !self.pending_approvals.contains(&r.tool_use_id) {
                    self.pending_approvals.push(r.tool_use_id.clone());
                }
                self.status = SessionStatus::Waiting as i32;
            }
            event::Kind::ApprovalDecision(d) => {
                self.pending_approvals.retain(|id| *id != d.tool_use_id);
                self.status = self.runnable_unless_waiting();
            }
            // A failed model call: the runner has work, but not before the logged time.
            event::Kind::ModelRetry(r) => {
                self.not_before_unix_ms = r.retry_at_unix_ms;
                self.status = self.runnable_unless_waiting();
            }
            // The loop stopped itself: it waits for a person's next turn.
            event::Kind::RunPaused(_) => self.status = SessionStatus::Waiting as i32,
            // A config naming a model starts afresh: its replay, or none.
            event::Kind::SessionConfig(c) if !c.model.is_empty() => {
                self.replay = c.replay.as_ref().map(|r| ReplayRange {
                    session_id: r.session_id.clone(),
                    after_seq: r.after_seq,
                    through_seq: r.through_seq,
                });
            }
            // Streamed text says nothing about who has work, nor does the session's model.
            event::Kind::AssistantDelta(_) | event::Kind::SessionConfig(_) => {}
        }
    }

    /// Takes `text`, the user message at `seq`, as the first one (what is kept of it).
    pub fn set_first_user_text(&mut self, seq: u64, text: &str) {
        self.first_user_text = truncate_chars_to_bytes(text, FIRST_USER_TEXT_BYTES);
        if !self.first_user_text.is_empty() {
            self.first_user_seq = seq;
        }
    }

    /// Runnable, unless a call still awaits a person: then the session keeps waiting (a new
    /// user turn is folded in when the turn goes on; only an interrupt wakes a runner).
    fn runnable_unless_waiting(&self) -> i32 {
        if self.pending_approvals.is_empty() {
            SessionStatus::Runnable as i32
        } else {
            SessionStatus::Waiting as i32
        }
    }

    pub fn apply_lease(&mut self, lease: &LeaseRecord) {
        self.lease = Some(lease.clone());
    }

    /// Starts a fork's state: its state at the fork point if the record carries it, else
    /// the start of one whose copied prefix follows.
    pub fn apply_fork(&mut self, fork: &ForkRecord) {
        if let Some(state) = &fork.state {
            *self = state.clone();
            return;
        }
        self.tracks_replay = true;
        self.forked_from = Some(ForkedFrom {
            session_id: fork.parent.clone(),
            seq: fork.seq,
        });
        self.created_unix_ms = fork.ts_unix_ms;
        self.updated_unix_ms = self.updated_unix_ms.max(fork.ts_unix_ms);
    }

    /// The lease, if one is live at `now_ms`.
    pub fn live_lease(&self, now_ms: i64) -> Option<&LeaseRecord> {
        self.lease
            .as_ref()
            .filter(|l| !l.released && l.expires_unix_ms > now_ms)
    }

    /// The epoch the next grant gets.
    pub fn next_epoch(&self) -> u64 {
        self.lease.as_ref().map_or(0, |l| l.epoch) + 1
    }

    pub fn title(&self) -> String {
        self.first_user_text[..self.title_len()].to_string()
    }

    /// The bytes of `first_user_text` the title takes: all of it, or its first
    /// [`TITLE_CHARS`] characters. The state keeps no more than that where the backend keeps
    /// the whole text beside it (the PostgreSQL backend's `first_user_text` column), and
    /// since it is not empty, no later user message takes its place.
    pub fn title_len(&self) -> usize {
        self.first_user_text
            .char_indices()
            .nth(TITLE_CHARS)
            .map_or(self.first_user_text.len(), |(end, _)| end)
    }

    pub fn info(&self, session_id: &str, now_ms: i64) -> SessionInfo {
        SessionInfo {
            session_id: session_id.to_string(),
            last_seq: self.last_seq,
            created_unix_ms: self.created_unix_ms,
            updated_unix_ms: self.updated_unix_ms,
            status: self.status,
            lease: self.live_lease(now_ms).map(lease_of),
            title: self.title(),
            forked_from: self.forked_from.clone(),
            pinned: self.pinned,
            not_before_unix_ms: self.not_before_unix_ms,
        }
    }

    /// When a claim may take the session, as far as time goes: once its live lease, if
    /// any, has run out, and not before a `model_retry`'s due time (0: at once).
    pub fn claimable_from(&self) -> i64 {
        let lease = self
            .lease
            .as_ref()
            .filter(|l| !l.released)
            .map_or(0, |l| l.expires_unix_ms);
        lease.max(self.not_before_unix_ms)
    }
}

pub fn lease_of(record: &LeaseRecord) -> Lease {
    Lease {
        session_id: record.session_id.clone(),
        owner: record.owner.clone(),
        epoch: record.epoch,
        expires_unix_ms: record.expires_unix_ms,
    }
}

fn truncate_chars_to_bytes(text: &str, max: usize) -> String {
    if text.len() <= max {
        return text.to_string();
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text[..end].to_string()
}

/// Gives back states of a cache of them that takes `bytes` ([`SessionMeta::cached_bytes`])
/// past its `budget`, in the map's order, until it takes at most three quarters of the
/// budget (so that it does not do so at every insert); returns what it takes then, which
/// is also the store's `agentlog_store_session_cache_bytes`.
pub fn shrink_cache<V>(
    states: &mut HashMap<String, V>,
    bytes: usize,
    budget: usize,
    meta: impl Fn(&V) -> &SessionMeta,
) -> usize {
    let mut bytes = bytes;
    if bytes > budget {
        let target = budget / 4 * 3;
        states.retain(|id, state| {
            if bytes <= target {
                return true;
            }
            bytes -= meta(state).cached_bytes(id).min(bytes);
            false
        });
    }
    crate::metrics::session_cache_bytes(bytes);
    bytes
}

/// Events for the unit tests of the session rules here and in `rules.rs`.
#[cfg(test)]
pub(crate) mod test_events {
    use agentlog_proto::v1::{event, ApprovalDecision, ApprovalRequested, Event, UserMessage};

    pub fn ev(seq: u64, kind: event::Kind) -> Event {
        Event {
            seq,
            kind: Some(kind),
            ..Event::default()
        }
    }
    pub fn user(text: &str) -> event::Kind {
        event::Kind::UserMessage(UserMessage { text: text.into() })
    }
    pub fn request(id: &str) -> event::Kind {
        event::Kind::ApprovalRequested(ApprovalRequested {
            tool_use_id: id.into(),
            ..ApprovalRequested::default()
        })
    }
    pub fn decision(id: &str) -> event::Kind {
        event::Kind::ApprovalDecision(ApprovalDecision {
            tool_use_id: id.into(),
            approved: true,
            note: String::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::test_events::*;
    use super::*;
    use agentlog_proto::v1::{Interrupt, Interrupted};

    fn status_after(kinds: Vec<event::Kind>) -> SessionStatus {
        let mut meta = SessionMeta::default();
        for (i, kind) in kinds.into_iter().enumerate() {
            meta.apply_event(&ev(i as u64 + 1, kind));
        }
        meta.status()
    }

    fn retry_until(at: i64) -> event::Kind {
        event::Kind::ModelRetry(agentlog_proto::v1::ModelRetry {
            retry_at_unix_ms: at,
            ..Default::default()
        })
    }

    #[test]
    fn a_model_retry_is_runnable_not_before_its_time_and_a_pause_waits_for_a_person() {
        use SessionStatus::*;
        let mut meta = SessionMeta::default();
        meta.apply_event(&ev(1, user("go")));
        meta.apply_event(&ev(2, retry_until(5_000)));
        assert_eq!((meta.status(), meta.not_before_unix_ms), (Runnable, 5_000));
        assert_eq!(meta.info("s", 0).not_before_unix_ms, 5_000);
        assert!(!crate::rules::claimable(&meta, 4_999));
        assert!(crate::rules::claimable(&meta, 5_000));
        assert_eq!(meta.claimable_from(), 5_000);
        // Streamed text and a new configuration say nothing about it; anything else ends it.
        meta.apply_event(&ev(
            3,
            event::Kind::AssistantDelta(agentlog_proto::v1::AssistantDelta::default()),
        ));
        meta.apply_event(&ev(
            4,
            event::Kind::SessionConfig(agentlog_proto::v1::SessionConfig::default()),
        ));
        assert_eq!(meta.not_before_unix_ms, 5_000);
        meta.apply_event(&ev(5, user("never mind")));
        assert_eq!((meta.status(), meta.not_before_unix_ms), (Runnable, 0));
        let paused = event::Kind::RunPaused(agentlog_proto::v1::RunPaused::default());
        assert_eq!(status_after(vec![user("go"), paused.clone()]), Waiting);
        assert_eq!(
            status_after(vec![user("go"), paused.clone(), user("go on")]),
            Runnable
        );
        assert_eq!(
            status_after(vec![
                user("go"),
                paused,
                event::Kind::Interrupt(Interrupt::default())
            ]),
            Runnable,
            "a runner answers an interrupt"
        );
    }

    #[test]
    fn a_pending_approval_makes_the_session_wait_until_every_call_is_decided() {
        use SessionStatus::*;
        assert_eq!(status_after(vec![user("go"), request("a")]), Waiting);
        assert_eq!(
            status_after(vec![user("go"), request("a"), request("b"), decision("a")]),
            Waiting
        );
        assert_eq!(
            status_after(vec![user("go"), request("a"), decision("a")]),
            Runnable
        );
        // A new user turn does not wake a runner while a call awaits a person.
        assert_eq!(
            status_after(vec![user("go"), request("a"), user("also")]),
            Waiting
        );
    }

    #[test]
    fn an_interrupt_wakes_a_runner_and_interrupted_ends_the_wait() {
        use SessionStatus::*;
        let interrupt = || event::Kind::Interrupt(Interrupt::default());
        let interrupted = || event::Kind::Interrupted(Interrupted::default());
        assert_eq!(
            status_after(vec![user("go"), request("a"), interrupt()]),
            Runnable
        );
        assert_eq!(
            status_after(vec![user("go"), request("a"), interrupt(), interrupted()]),
            Idle
        );
        assert_eq!(status_after(vec![user("go"), interrupt()]), Runnable);
        // A user turn sent between the interrupt and its answer is work for after it.
        assert_eq!(
            status_after(vec![user("go"), interrupt(), user("next"), interrupted()]),
            Runnable
        );
        assert_eq!(
            status_after(vec![user("go"), user("next"), interrupt(), interrupted()]),
            Idle
        );
    }
}
