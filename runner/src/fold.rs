//! The fold: the one deterministic function from a session's log to what the runner does
//! next and, when that is a model call, the conversation the model is shown.
//!
//! Promise: for any sequence of events, a [`Conversation`] handed out by
//! [`FoldState::folded`] satisfies the providers' pairing rule: every `tool_use` is
//! answered, exactly once, by `tool_result` blocks at the very start of the next user
//! message, in the order of the calls, with any user text that arrived in between placed
//! after the results. Consecutive user content is merged; deltas, `run_error`s, interrupts,
//! approvals, `session_config`s and kinds this runner does not know never reach the
//! provider; assistant turns are passed through verbatim, whichever provider wrote them,
//! in the form of the model the conversation goes to. The session's model and, for a
//! replay, where it stands are folded beside the conversation ([`config`]). A conversation is only handed out when every call of the
//! last reply has its result, so an unpaired `tool_use` can never reach a provider: that
//! state is [`Frontier::RunTools`] (or [`Frontier::AnswerInterrupt`]) instead.
//!
//! The fold is incremental: [`FoldState::apply`] takes one event at a time in seq order and
//! costs O(1) amortised, so a runner that keeps its state pays per step only for the events
//! since its last step. [`fold_log`] is the same fold over a whole log at once (the tests
//! in this module check that any split of a log into a prefix and a rest folds the same).
//! A fold also travels as bytes ([`snapshot`]): restored, it folds the rest of the log the
//! same way.

pub mod config;
pub mod run;
pub mod snapshot;
pub mod transcript;

use std::collections::HashMap;

use agentlog_proto::v1::{
    content_block::Block, event::Kind, AssistantMessage, Event, ToolResult, ToolUseBlock,
};

use config::SessionConfigState;
use run::RunState;
use transcript::{Form, Transcript};

/// What an older reply's call is answered with when the log holds no result for it. Only a
/// log written outside the guarded loop can contain this (the loop never calls the model
/// while a call is open), but the provider must still receive a well-formed request.
pub const MISSING_RESULT: &str =
    "no result was recorded for this tool call; its outcome is unknown";

/// The conversation: what the Anthropic and OpenAI request builders render. Its start may
/// already be written in the provider's form (the [`Transcript`]); `messages` follow it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Conversation {
    pub transcript: Transcript,
    pub messages: Vec<Message>,
}

impl Conversation {
    /// A conversation held entirely as messages.
    pub fn of(messages: Vec<Message>) -> Conversation {
        Conversation {
            transcript: Transcript::default(),
            messages,
        }
    }

    /// The assistant messages in it.
    pub fn replies(&self) -> u64 {
        let later = self
            .messages
            .iter()
            .filter(|m| matches!(m, Message::Assistant(_)))
            .count();
        self.transcript.replies() + later as u64
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Message {
    /// Tool results (first, in call order), then user text.
    User(Vec<UserBlock>),
    /// A logged reply, exactly as the provider gave it.
    Assistant(AssistantMessage),
}

#[derive(Debug, Clone, PartialEq)]
pub enum UserBlock {
    ToolResult(ToolResult),
    Text(String),
}

/// The state of one `tool_use` of the last reply, as the log tells it.
#[derive(Debug, Clone, PartialEq)]
pub enum CallState {
    /// No `tool_started`: the call never began and simply runs.
    NotStarted,
    /// `tool_started` (highest attempt shown) without a result: the outcome is unknown.
    Interrupted { attempt: u32 },
    /// The result is logged: it is used as is and the tool never runs again.
    Finished(ToolResult),
}

/// A person's say on a call's next attempt. Only what was logged after the call's last
/// `tool_started` counts: an attempt that was interrupted needs a fresh decision.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Approval {
    /// Nobody was asked.
    #[default]
    NotAsked,
    /// `approval_requested` is logged, no decision yet.
    Pending,
    Approved,
    Denied {
        note: String,
    },
}

#[derive(Debug, Clone, PartialEq)]
pub struct PendingCall {
    pub tool_use: ToolUseBlock,
    pub state: CallState,
    pub approval: Approval,
}

/// An `interrupt` that no `interrupted` has answered yet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingInterrupt {
    /// The seq of the first unanswered `interrupt`: the answer's event ids derive from it,
    /// so every runner answering it writes the same ids.
    pub seq: u64,
    /// The reason of the latest unanswered `interrupt`.
    pub reason: String,
}

/// The one thing to do next ("act at the frontier").
#[derive(Debug, Clone, PartialEq)]
pub enum Frontier {
    /// A person asked the session to stop: close every call of the last reply that has no
    /// result (those listed, in order) and log `interrupted`. Nothing of the turn runs.
    AnswerInterrupt {
        interrupt: PendingInterrupt,
        open: Vec<PendingCall>,
    },
    /// A trailing user turn, or every result of the last reply is in: ask the model.
    CallModel(Conversation),
    /// The last reply has calls without a result. Holds every call of that reply in order,
    /// finished ones included, so the caller can walk them in order.
    RunTools(Vec<PendingCall>),
    /// A final reply, a `run_error` or an `interrupted` ends the log: nothing to do.
    Idle,
}

/// The fold of a log.
#[derive(Debug, Clone, PartialEq)]
pub struct Folded {
    pub frontier: Frontier,
    /// How many model turns the log has settled (replies, `run_error`s and `interrupted`s).
    /// The next model call is turn number `turn`; every runner folding the same log
    /// computes the same number, which makes the event ids of that turn deterministic.
    pub turn: u64,
    /// The current run: its budget's figures, the turn's retries, the row of identical
    /// calls ([`run`]).
    pub run: RunState,
}

/// The fold of the events seen so far, kept by a runner between steps.
#[derive(Debug, Clone, Default)]
pub struct FoldState {
    /// Every message up to and including the last reply, written in the provider's form
    /// when the fold has one.
    transcript: Transcript,
    /// The settled messages the transcript does not hold (all of them without a form).
    messages: Vec<Message>,
    /// The `tool_use` blocks of the last reply.
    open_calls: Vec<ToolUseBlock>,
    /// User text since the last reply.
    user_texts: Vec<String>,
    /// Results and starts are looked up by call id wherever they sit in the log, so a user
    /// message appended between a reply and its results cannot split them apart. Entries of
    /// a reply's calls are dropped when the next reply settles them: each result is held
    /// once, so the state (and its snapshot) is as large as the conversation, not twice.
    results: HashMap<String, ToolResult>,
    attempts: HashMap<String, u32>,
    approvals: HashMap<String, Approval>,
    turn: u64,
    /// The log ends in a `run_error` or `interrupted` (with no user turn since).
    ended: bool,
    interrupt: Option<PendingInterrupt>,
    /// A user turn arrived after the latest `interrupt`: it is a new turn, not part of the
    /// interrupted one, and the session has work once the interrupt is answered.
    user_since_interrupt: bool,
    /// The seq of the latest `interrupt` applied.
    last_interrupt_seq: u64,
    /// `messages` are out in a conversation handed out by [`FoldState::take_folded`].
    lent: bool,
    /// The session's model and its replay (`session_config`).
    config: SessionConfigState,
    /// The current run ([`run`]).
    run: RunState,
}

/// Folds a session's events (in seq order) into the frontier.
pub fn fold_log(events: &[Event]) -> Folded {
    let mut state = FoldState::default();
    for event in events {
        state.apply(event);
    }
    state.folded()
}

impl FoldState {
    /// A fold that keeps settled messages in `form` (see [`transcript`]).
    pub fn rendering(form: &'static dyn Form) -> FoldState {
        FoldState {
            transcript: Transcript::new(form),
            ..FoldState::default()
        }
    }

    /// The form settled messages are kept in, if any.
    pub fn form(&self) -> Option<&'static dyn Form> {
        self.transcript.form()
    }

    fn settle(&mut self, message: Message) {
        if let Some(message) = self.transcript.settle(message) {
            self.messages.push(message);
        }
    }

    /// The session's model and, for a replay, where it stands.
    pub fn config(&self) -> &SessionConfigState {
        &self.config
    }

    /// The current run ([`run`]).
    pub fn run(&self) -> &RunState {
        &self.run
    }

    /// Applies the next event of the log.
    pub fn apply(&mut self, event: &Event) {
        self.config.apply(event);
        let finished = match &event.kind {
            Some(Kind::ToolResult(result)) => self
                .open_calls
                .iter()
                .find(|call| call.id == result.tool_use_id)
                .filter(|_| !self.results.contains_key(&result.tool_use_id))
                .map(|call| {
                    let approval = self.approvals.get(&call.id).unwrap_or(&Approval::NotAsked);
                    (call, approval)
                }),
            _ => None,
        };
        self.run.apply(event, finished);
        match &event.kind {
            Some(Kind::UserMessage(user)) => {
                self.user_texts.push(user.text.clone());
                self.ended = false;
                self.user_since_interrupt = true;
            }
            Some(Kind::AssistantMessage(reply)) => {
                if let Some(user) = self.user_message() {
                    self.settle(Message::User(user));
                }
                self.user_texts.clear();
                // The settled calls' results now live in `messages` alone: nothing asks
                // about those calls again, so the lookups keep only the open reply's.
                for call in std::mem::take(&mut self.open_calls) {
                    self.results.remove(&call.id);
                    self.attempts.remove(&call.id);
                    self.approvals.remove(&call.id);
                }
                self.open_calls = tool_uses(reply).cloned().collect();
                self.settle(Message::Assistant(reply.clone()));
                self.turn += 1;
                self.ended = false;
            }
            Some(Kind::RunError(_)) => {
                self.turn += 1;
                self.ended = true;
            }
            // The run waits for a person: nothing to do until a user message.
            Some(Kind::RunPaused(_)) => self.ended = true,
            Some(Kind::ToolStarted(started)) => {
                let attempt = self
                    .attempts
                    .entry(started.tool_use_id.clone())
                    .or_insert(0);
                *attempt = (*attempt).max(started.attempt);
                self.approvals.remove(&started.tool_use_id);
                self.ended = false;
            }
            Some(Kind::ToolResult(result)) => {
                // The first logged result is the one the model sees; a duplicate changes nothing.
                self.results
                    .entry(result.tool_use_id.clone())
                    .or_insert_with(|| result.clone());
                self.ended = false;
            }
            Some(Kind::Interrupt(interrupt)) => {
                match &mut self.interrupt {
                    Some(pending) => pending.reason.clone_from(&interrupt.reason),
                    None => {
                        self.interrupt = Some(PendingInterrupt {
                            seq: event.seq,
                            reason: interrupt.reason.clone(),
                        })
                    }
                }
                self.user_since_interrupt = false;
                self.last_interrupt_seq = self.last_interrupt_seq.max(event.seq);
            }
            Some(Kind::Interrupted(_)) => {
                self.interrupt = None;
                self.turn += 1;
                self.ended = !self.user_since_interrupt;
            }
            Some(Kind::ApprovalRequested(request)) => {
                self.approvals
                    .insert(request.tool_use_id.clone(), Approval::Pending);
            }
            Some(Kind::ApprovalDecision(decision)) => {
                let approval = if decision.approved {
                    Approval::Approved
                } else {
                    Approval::Denied {
                        note: decision.note.clone(),
                    }
                };
                self.approvals
                    .insert(decision.tool_use_id.clone(), approval);
            }
            Some(Kind::AssistantDelta(_) | Kind::SessionConfig(_) | Kind::ModelRetry(_)) | None => {
            }
        }
    }

    /// The calls of the open turn that were started and have no result (their outcome is
    /// unknown: each is re-run, reported or asked about), unless an interrupt closes them.
    pub fn dangling_calls(&self) -> Vec<PendingCall> {
        if self.interrupt.is_some() {
            return Vec::new();
        }
        self.open_calls
            .iter()
            .filter(|call| !self.results.contains_key(&call.id))
            .filter_map(|call| {
                let attempt = *self.attempts.get(&call.id)?;
                Some(PendingCall {
                    tool_use: call.clone(),
                    state: CallState::Interrupted { attempt },
                    approval: self.approvals.get(&call.id).cloned().unwrap_or_default(),
                })
            })
            .collect()
    }

    /// The seq of the latest `interrupt` this fold has seen (0: none).
    pub fn last_interrupt_seq(&self) -> u64 {
        self.last_interrupt_seq
    }

    /// What to do next, given everything applied so far.
    pub fn folded(&self) -> Folded {
        let calls = || -> Vec<PendingCall> {
            self.open_calls
                .iter()
                .map(|call| PendingCall {
                    tool_use: call.clone(),
                    state: match (self.results.get(&call.id), self.attempts.get(&call.id)) {
                        (Some(result), _) => CallState::Finished(result.clone()),
                        (None, Some(&attempt)) => CallState::Interrupted { attempt },
                        (None, None) => CallState::NotStarted,
                    },
                    approval: self.approvals.get(&call.id).cloned().unwrap_or_default(),
                })
                .collect()
        };
        let unanswered = self
            .open_calls
            .iter()
            .any(|call| !self.results.contains_key(&call.id));
        let frontier = if let Some(interrupt) = &self.interrupt {
            Frontier::AnswerInterrupt {
                interrupt: interrupt.clone(),
                open: calls()
                    .into_iter()
                    .filter(|call| !matches!(call.state, CallState::Finished(_)))
                    .collect(),
            }
        } else if unanswered {
            Frontier::RunTools(calls())
        } else if self.ended {
            Frontier::Idle
        } else if let Some(user) = self.user_message() {
            let mut messages = self.messages.clone();
            messages.push(Message::User(user));
            Frontier::CallModel(Conversation {
                transcript: self.transcript.clone(),
                messages,
            })
        } else {
            Frontier::Idle
        };
        Folded {
            frontier,
            turn: self.turn,
            run: self.run.clone(),
        }
    }

    /// [`FoldState::folded`], except that a conversation to send takes this state's
    /// messages instead of a copy of them (a long session's history is not copied for each
    /// model call). Until [`FoldState::give_back`] returns them, the state is lent: no event
    /// may be applied and it must not be kept.
    pub fn take_folded(&mut self) -> Folded {
        let history = std::mem::take(&mut self.messages);
        let transcript = std::mem::take(&mut self.transcript);
        let mut folded = self.folded();
        match &mut folded.frontier {
            Frontier::CallModel(conversation) => {
                // Folded over no history, the conversation is the trailing user message alone.
                let mut messages = history;
                messages.append(&mut conversation.messages);
                conversation.messages = messages;
                conversation.transcript = transcript;
                self.lent = true;
            }
            _ => {
                self.messages = history;
                self.transcript = transcript;
            }
        }
        folded
    }

    /// Takes back the history of a conversation from [`FoldState::take_folded`].
    pub fn give_back(&mut self, conversation: Conversation) {
        let mut messages = conversation.messages;
        // The trailing user message was made from this state, which still holds its parts.
        messages.pop();
        self.messages = messages;
        self.transcript = conversation.transcript;
        self.lent = false;
    }

    /// Whether a conversation taken by [`FoldState::take_folded`] is still out.
    pub fn is_lent(&self) -> bool {
        self.lent
    }

    /// The user message that follows the last reply: its calls' results first, in call
    /// order, then the text. `None` when there is nothing to say.
    fn user_message(&self) -> Option<Vec<UserBlock>> {
        let mut blocks: Vec<UserBlock> = self
            .open_calls
            .iter()
            .map(|call| {
                UserBlock::ToolResult(match self.results.get(&call.id) {
                    Some(result) => result.clone(),
                    None => ToolResult {
                        tool_use_id: call.id.clone(),
                        content: MISSING_RESULT.to_string(),
                        is_error: true,
                        workspace_checkpoint: None,
                        served_from: None,
                    },
                })
            })
            .collect();
        blocks.extend(self.user_texts.iter().cloned().map(UserBlock::Text));
        (!blocks.is_empty()).then_some(blocks)
    }
}

/// The `tool_use` blocks of a reply, in order.
pub fn tool_uses(reply: &AssistantMessage) -> impl Iterator<Item = &ToolUseBlock> {
    reply.content.iter().filter_map(|block| match &block.block {
        Some(Block::ToolUse(tool_use)) => Some(tool_use),
        _ => None,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use agentlog_proto::v1::{
        ApprovalDecision, ApprovalRequested, AssistantDelta, ContentBlock, Interrupt, Interrupted,
        RunError, TextBlock, ThinkingBlock, ToolStarted, UserMessage,
    };
    use proptest::prelude::*;

    use bytes::Bytes;

    use super::*;
    use crate::model::{anthropic, openai, ModelRequest};

    fn event(kind: Kind) -> Event {
        Event {
            kind: Some(kind),
            ..Event::default()
        }
    }

    fn user(text: &str) -> Event {
        event(Kind::UserMessage(UserMessage { text: text.into() }))
    }

    fn reply(calls: &[&str], text: &str) -> Event {
        let mut content = vec![ContentBlock {
            block: Some(Block::Thinking(ThinkingBlock {
                thinking: "hmm".into(),
                signature: "sig".into(),
            })),
        }];
        if !text.is_empty() {
            content.push(ContentBlock {
                block: Some(Block::Text(TextBlock { text: text.into() })),
            });
        }
        content.extend(calls.iter().map(|id| ContentBlock {
            block: Some(Block::ToolUse(ToolUseBlock {
                id: id.to_string(),
                name: "bash".into(),
                input: None,
            })),
        }));
        event(Kind::AssistantMessage(AssistantMessage {
            content,
            stop_reason: if calls.is_empty() {
                "end_turn"
            } else {
                "tool_use"
            }
            .into(),
            ..AssistantMessage::default()
        }))
    }

    fn started(id: &str, attempt: u32) -> Event {
        event(Kind::ToolStarted(ToolStarted {
            tool_use_id: id.into(),
            idempotency_key: format!("s/{id}"),
            attempt,
        }))
    }

    fn result(id: &str) -> Event {
        event(Kind::ToolResult(ToolResult {
            tool_use_id: id.into(),
            content: format!("out {id}"),
            is_error: false,
            workspace_checkpoint: None,
            served_from: None,
        }))
    }

    fn delta(text: &str) -> Event {
        event(Kind::AssistantDelta(AssistantDelta {
            turn_id: "0".into(),
            text: text.into(),
        }))
    }

    fn run_error() -> Event {
        event(Kind::RunError(RunError {
            message: "refused".into(),
            retryable: false,
        }))
    }

    fn unknown() -> Event {
        Event::default()
    }

    fn conversation(events: &[Event]) -> Conversation {
        match fold_log(events).frontier {
            Frontier::CallModel(conversation) => conversation,
            other => panic!("expected CallModel, got {other:?}"),
        }
    }

    /// The provider's rules, checked on a conversation about to be sent.
    fn assert_paired(conversation: &Conversation) {
        let messages = &conversation.messages;
        assert!(
            matches!(messages.last(), Some(Message::User(_))),
            "a request ends with a user message"
        );
        let mut answered = HashSet::new();
        for (i, message) in messages.iter().enumerate() {
            match message {
                Message::Assistant(reply) => {
                    let calls: Vec<&str> = tool_uses(reply).map(|c| c.id.as_str()).collect();
                    if calls.is_empty() {
                        continue;
                    }
                    let Some(Message::User(next)) = messages.get(i + 1) else {
                        panic!("tool_use {calls:?} not followed by a user message");
                    };
                    let leading: Vec<&str> = next
                        .iter()
                        .map_while(|block| match block {
                            UserBlock::ToolResult(r) => Some(r.tool_use_id.as_str()),
                            UserBlock::Text(_) => None,
                        })
                        .collect();
                    assert_eq!(
                        leading, calls,
                        "results lead the next message, in call order"
                    );
                }
                Message::User(blocks) => {
                    let prev_calls: Vec<&str> = match i.checked_sub(1).map(|p| &messages[p]) {
                        Some(Message::Assistant(reply)) => {
                            tool_uses(reply).map(|c| c.id.as_str()).collect()
                        }
                        _ => Vec::new(),
                    };
                    let results: Vec<&str> = blocks
                        .iter()
                        .filter_map(|block| match block {
                            UserBlock::ToolResult(r) => Some(r.tool_use_id.as_str()),
                            UserBlock::Text(_) => None,
                        })
                        .collect();
                    assert_eq!(results, prev_calls, "no stray or duplicate results");
                    for id in results {
                        assert!(answered.insert(id.to_string()), "{id} answered twice");
                    }
                    if let Some(Message::User(_)) = messages.get(i + 1) {
                        panic!("consecutive user messages are merged");
                    }
                }
            }
        }
    }

    #[test]
    fn empty_log_is_idle() {
        assert_eq!(fold_log(&[]).frontier, Frontier::Idle);
        assert_eq!(fold_log(&[delta("x"), unknown()]).frontier, Frontier::Idle);
    }

    #[test]
    fn trailing_user_turn_calls_the_model() {
        let c = conversation(&[user("hi")]);
        assert_eq!(
            c.messages,
            vec![Message::User(vec![UserBlock::Text("hi".into())])]
        );
    }

    #[test]
    fn consecutive_user_messages_are_merged() {
        let c = conversation(&[user("a"), delta("zz"), unknown(), user("b")]);
        assert_eq!(
            c.messages,
            vec![Message::User(vec![
                UserBlock::Text("a".into()),
                UserBlock::Text("b".into())
            ])]
        );
    }

    #[test]
    fn final_reply_is_idle_and_counts_a_turn() {
        let folded = fold_log(&[user("hi"), delta("he"), reply(&[], "hello")]);
        assert_eq!(folded.frontier, Frontier::Idle);
        assert_eq!(folded.turn, 1);
    }

    #[test]
    fn user_text_between_a_call_and_its_result_goes_after_the_result() {
        let events = [
            user("go"),
            reply(&["t1", "t2"], "running"),
            started("t1", 1),
            user("also this"),
            result("t1"),
            started("t2", 1),
            result("t2"),
        ];
        let c = conversation(&events);
        assert_paired(&c);
        let Message::User(last) = &c.messages[2] else {
            panic!("third message is the user's");
        };
        assert_eq!(last.len(), 3);
        assert_eq!(last[2], UserBlock::Text("also this".into()));
    }

    #[test]
    fn assistant_turns_are_verbatim() {
        let events = [user("go"), reply(&["t1"], "x"), result("t1")];
        let c = conversation(&events);
        let Some(Kind::AssistantMessage(logged)) = &events[1].kind else {
            unreachable!()
        };
        assert_eq!(c.messages[1], Message::Assistant(logged.clone()));
    }

    #[test]
    fn open_calls_report_their_state_in_order() {
        let events = [
            user("go"),
            reply(&["a", "b", "c"], ""),
            started("a", 1),
            result("a"),
            started("b", 1),
            started("b", 2),
            user("hurry"),
        ];
        let Frontier::RunTools(calls) = fold_log(&events).frontier else {
            panic!("expected RunTools");
        };
        let states: Vec<_> = calls
            .iter()
            .map(|c| (c.tool_use.id.as_str(), c.state.clone()))
            .collect();
        assert_eq!(
            states,
            vec![
                (
                    "a",
                    CallState::Finished(ToolResult {
                        tool_use_id: "a".into(),
                        content: "out a".into(),
                        workspace_checkpoint: None,
                        served_from: None,
                        is_error: false
                    })
                ),
                ("b", CallState::Interrupted { attempt: 2 }),
                ("c", CallState::NotStarted),
            ]
        );
    }

    #[test]
    fn duplicate_results_are_sent_once() {
        let events = [user("go"), reply(&["a"], ""), result("a"), result("a")];
        assert_paired(&conversation(&events));
    }

    #[test]
    fn run_error_ends_the_turn_until_the_user_speaks() {
        let events = vec![user("go"), run_error()];
        let folded = fold_log(&events);
        assert_eq!(folded.frontier, Frontier::Idle);
        assert_eq!(folded.turn, 1);
        let mut events = events;
        events.push(user("again"));
        let c = conversation(&events);
        assert_eq!(
            c.messages.len(),
            1,
            "the two user turns merge around the error"
        );
    }

    #[test]
    fn an_older_call_without_result_is_answered_with_an_error() {
        let events = [
            user("go"),
            reply(&["a"], ""),
            reply(&[], "done"),
            user("more"),
        ];
        let c = conversation(&events);
        assert_paired(&c);
        assert!(c.messages.iter().any(|m| matches!(m,
            Message::User(blocks) if blocks.iter().any(|b| matches!(b,
                UserBlock::ToolResult(r) if r.is_error && r.content == MISSING_RESULT)))));
    }

    fn interrupt(seq: u64, reason: &str) -> Event {
        Event {
            seq,
            ..event(Kind::Interrupt(Interrupt {
                reason: reason.into(),
            }))
        }
    }

    fn interrupted() -> Event {
        event(Kind::Interrupted(Interrupted::default()))
    }

    #[test]
    fn an_interrupt_closes_the_open_calls_and_ends_the_turn() {
        let mut events = vec![
            user("go"),
            reply(&["a", "b", "c"], ""),
            started("a", 1),
            result("a"),
            started("b", 1),
            interrupt(6, "stop"),
            interrupt(7, "really"),
        ];
        let Frontier::AnswerInterrupt { interrupt, open } = fold_log(&events).frontier else {
            panic!("an interrupt is answered first");
        };
        assert_eq!(
            interrupt.seq, 6,
            "the first unanswered interrupt names the answer"
        );
        assert_eq!(interrupt.reason, "really");
        let open: Vec<_> = open
            .iter()
            .map(|c| (c.tool_use.id.as_str(), c.state.clone()))
            .collect();
        assert_eq!(
            open,
            [
                ("b", CallState::Interrupted { attempt: 1 }),
                ("c", CallState::NotStarted)
            ]
        );
        events.extend([result("b"), result("c"), interrupted()]);
        let folded = fold_log(&events);
        assert_eq!(folded.frontier, Frontier::Idle);
        assert_eq!(folded.turn, 2, "the interrupted turn is settled");
        events.push(user("next"));
        let c = conversation(&events);
        assert_paired(&c);
    }

    #[test]
    fn interrupting_an_idle_session_only_asks_for_the_answer() {
        let mut events = vec![user("hi"), reply(&[], "hello"), interrupt(3, "")];
        assert!(matches!(
            fold_log(&events).frontier,
            Frontier::AnswerInterrupt { ref open, .. } if open.is_empty()
        ));
        events.push(interrupted());
        assert_eq!(fold_log(&events).frontier, Frontier::Idle);
    }

    #[test]
    fn a_user_turn_after_the_interrupt_is_worked_once_it_is_answered() {
        let events = [user("a"), interrupt(2, ""), user("b"), interrupted()];
        let c = conversation(&events);
        assert_eq!(
            c.messages,
            vec![Message::User(vec![
                UserBlock::Text("a".into()),
                UserBlock::Text("b".into())
            ])]
        );
        let before = [user("a"), user("b"), interrupt(3, ""), interrupted()];
        assert_eq!(fold_log(&before).frontier, Frontier::Idle);
    }

    #[test]
    fn an_approval_counts_only_for_the_attempt_after_it() {
        let request = |id: &str| {
            event(Kind::ApprovalRequested(ApprovalRequested {
                tool_use_id: id.into(),
                ..ApprovalRequested::default()
            }))
        };
        let decide = |id: &str, approved: bool| {
            event(Kind::ApprovalDecision(ApprovalDecision {
                tool_use_id: id.into(),
                approved,
                note: "n".into(),
            }))
        };
        let approval_of = |events: &[Event]| match fold_log(events).frontier {
            Frontier::RunTools(calls) => calls[0].approval.clone(),
            other => panic!("expected RunTools, got {other:?}"),
        };
        let mut events = vec![user("go"), reply(&["a"], ""), request("a")];
        assert_eq!(approval_of(&events), Approval::Pending);
        events.push(decide("a", true));
        assert_eq!(approval_of(&events), Approval::Approved);
        events.push(started("a", 1));
        assert_eq!(
            approval_of(&events),
            Approval::NotAsked,
            "a re-run asks again"
        );
        events.extend([request("a"), decide("a", false)]);
        assert_eq!(approval_of(&events), Approval::Denied { note: "n".into() });
    }

    fn fold_state(events: &[Event]) -> FoldState {
        let mut state = FoldState::default();
        for event in events {
            state.apply(event);
        }
        state
    }

    #[test]
    fn a_settled_call_is_held_only_in_the_conversation() {
        let mut events = vec![user("go")];
        for call in ["a", "b", "c"] {
            events.extend([reply(&[call], ""), started(call, 1), result(call)]);
        }
        events.push(reply(&[], "done"));
        let state = fold_state(&events);
        assert!(
            state.results.is_empty() && state.attempts.is_empty() && state.approvals.is_empty(),
            "every call is settled by the reply after it"
        );
        // A late copy of a settled result is not sent again, and the calls are paired.
        events.extend([result("a"), user("more")]);
        let c = conversation(&events);
        assert_paired(&c);
        assert_eq!(c.messages.len(), 9);
    }

    #[test]
    fn a_snapshot_of_another_version_or_garbage_is_refused() {
        let events = [user("go"), reply(&["a"], "r"), started("a", 1)];
        let data = fold_state(&events).to_snapshot().unwrap();
        assert!(FoldState::from_snapshot(vec![data.clone().into()], None).is_ok());
        assert!(matches!(
            FoldState::from_snapshot(vec![b"\xff\xff\xff not a fold"[..].into()], None),
            Err(snapshot::SnapshotError::Undecodable(_))
        ));
        // After the record's length (one byte here), the version is field 1 (varint): a
        // record that says version 99.
        assert_eq!(&data[1..3], &[0x08, snapshot::VERSION as u8]);
        let mut other = data.clone();
        other[2] = 99;
        assert_eq!(
            FoldState::from_snapshot(vec![other.into()], None).err(),
            Some(snapshot::SnapshotError::Version { found: 99 })
        );
        assert!(
            FoldState::from_snapshot(vec![Bytes::new()], None).is_err(),
            "an empty record is version 0"
        );
        // A transcript is reused only in its own form.
        let mut formed = FoldState::rendering(&anthropic::FORM);
        for event in &events {
            formed.apply(event);
        }
        let data = formed.to_snapshot().unwrap();
        assert!(
            FoldState::from_snapshot(vec![data.clone().into()], Some(&anthropic::FORM)).is_ok()
        );
        assert_eq!(
            FoldState::from_snapshot(vec![data.clone().into()], Some(&openai::FORM)).err(),
            Some(snapshot::SnapshotError::Form {
                found: "anthropic-messages".into(),
                expected: "openai-chat",
            })
        );
        assert!(FoldState::from_snapshot(vec![data.clone().into()], None).is_err());
        // A runner of several models takes it in whichever of their forms it is kept in.
        let either: [&'static dyn Form; 2] = [&openai::FORM, &anthropic::FORM];
        let restored = FoldState::from_snapshot_in(vec![data.clone().into()], &either)
            .expect("one of the runner's forms");
        assert_eq!(
            restored.form().map(|f| f.name()),
            Some("anthropic-messages")
        );
        let cut = data[..data.len() - 1].to_vec();
        assert!(matches!(
            FoldState::from_snapshot(vec![cut.into()], Some(&anthropic::FORM)),
            Err(snapshot::SnapshotError::Undecodable(_))
        ));
    }

    /// The request a provider builds for a conversation, as JSON bytes.
    fn body(form: &dyn Form, conversation: &Conversation) -> Vec<u8> {
        let request = ModelRequest {
            system: "sys",
            conversation,
            tools: &[],
            max_tokens: 10,
            idle_timeout: std::time::Duration::from_secs(120),
        };
        match form.name() {
            "anthropic-messages" => anthropic::request_body("m", request),
            _ => openai::request_body("m", request),
        }
        .expect("the conversation is in the provider's form")
    }

    /// A simulated log writer: the guarded loop (driven by the fold itself), clients
    /// appending user turns at any moment, and crashes that cut a step short.
    #[derive(Debug, Clone)]
    enum Step {
        User,
        Reply { calls: usize },
        RefuseTurn,
        StartTool,
        FinishTool,
        Delta,
        Unknown,
        Interrupt,
        AnswerInterrupt,
        RequestApproval,
        Decide { approved: bool },
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            2 => Just(Step::User),
            3 => (0usize..4).prop_map(|calls| Step::Reply { calls }),
            1 => Just(Step::RefuseTurn),
            3 => Just(Step::StartTool),
            3 => Just(Step::FinishTool),
            1 => Just(Step::Delta),
            1 => Just(Step::Unknown),
            1 => Just(Step::Interrupt),
            2 => Just(Step::AnswerInterrupt),
            1 => Just(Step::RequestApproval),
            1 => any::<bool>().prop_map(|approved| Step::Decide { approved }),
        ]
    }

    /// Applies the step if the log's frontier allows it (a runner only ever writes what the
    /// frontier asks for), so the result is a log the system can actually produce.
    fn apply(events: &mut Vec<Event>, step: &Step, counter: &mut usize) {
        let frontier = fold_log(events).frontier;
        match (step, &frontier) {
            (Step::User, _) => events.push(user(&format!("u{counter}"))),
            (Step::Reply { calls }, Frontier::CallModel(_)) => {
                let ids: Vec<String> = (0..*calls).map(|i| format!("t{counter}_{i}")).collect();
                let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
                events.push(reply(&ids, "r"));
            }
            (Step::RefuseTurn, Frontier::CallModel(_)) => events.push(run_error()),
            (Step::StartTool | Step::FinishTool, Frontier::RunTools(calls)) => {
                if let Some(call) = calls
                    .iter()
                    .find(|c| !matches!(c.state, CallState::Finished(_)))
                {
                    let id = call.tool_use.id.clone();
                    let attempt = match call.state {
                        CallState::Interrupted { attempt } => attempt + 1,
                        _ => 1,
                    };
                    events.push(started(&id, attempt));
                    if matches!(step, Step::FinishTool) {
                        events.push(result(&id));
                    }
                }
            }
            (Step::Delta, _) => events.push(delta("d")),
            (Step::Unknown, _) => events.push(unknown()),
            (Step::Interrupt, _) => events.push(event(Kind::Interrupt(Interrupt {
                reason: format!("i{counter}"),
            }))),
            (Step::AnswerInterrupt, Frontier::AnswerInterrupt { interrupt, open }) => {
                for call in open {
                    events.push(result(&call.tool_use.id));
                }
                events.push(event(Kind::Interrupted(Interrupted {
                    reason: interrupt.reason.clone(),
                })));
            }
            (Step::RequestApproval | Step::Decide { .. }, Frontier::RunTools(calls)) => {
                if let Some(call) = calls
                    .iter()
                    .find(|c| !matches!(c.state, CallState::Finished(_)))
                {
                    let id = call.tool_use.id.clone();
                    match (step, &call.approval) {
                        (Step::RequestApproval, Approval::NotAsked) => {
                            events.push(event(Kind::ApprovalRequested(ApprovalRequested {
                                tool_use_id: id,
                                ..ApprovalRequested::default()
                            })))
                        }
                        (Step::Decide { approved }, Approval::Pending) => {
                            events.push(event(Kind::ApprovalDecision(ApprovalDecision {
                                tool_use_id: id,
                                approved: *approved,
                                note: String::new(),
                            })))
                        }
                        _ => {}
                    }
                }
            }
            _ => {}
        }
        for (i, event) in events.iter_mut().enumerate() {
            event.seq = i as u64 + 1;
        }
        *counter += 1;
    }

    proptest! {
        #[test]
        fn any_valid_log_folds_to_a_paired_request(steps in proptest::collection::vec(step(), 0..60)) {
            let mut events = Vec::new();
            let mut counter = 0;
            for step in &steps {
                apply(&mut events, step, &mut counter);
                let folded = fold_log(&events);
                prop_assert_eq!(&folded, &fold_log(&events), "the fold is deterministic");
                match folded.frontier {
                    Frontier::CallModel(c) => assert_paired(&c),
                    Frontier::RunTools(calls) => {
                        prop_assert!(calls.iter().any(|c| !matches!(c.state, CallState::Finished(_))));
                    }
                    Frontier::AnswerInterrupt { open, .. } => {
                        prop_assert!(open.iter().all(|c| !matches!(c.state, CallState::Finished(_))));
                    }
                    Frontier::Idle => {}
                }
            }
            // Resuming from any prefix (the state a runner kept) and applying the rest
            // folds to the same thing as folding the whole log from seq 1.
            let whole = fold_log(&events);
            for split in 0..=events.len() {
                let mut state = FoldState::default();
                for event in &events[..split] {
                    state.apply(event);
                }
                let taken = state.take_folded();
                prop_assert_eq!(&taken, &fold_log(&events[..split]));
                if let Frontier::CallModel(conversation) = taken.frontier {
                    state.give_back(conversation);
                }
                prop_assert!(!state.is_lent());
                for event in &events[split..] {
                    state.apply(event);
                }
                prop_assert_eq!(&state.folded(), &whole);
            }
        }

        /// A runner that never worked the session starts from a snapshot taken at any seq
        /// (encoded, stored, decoded) and folds the rest: the same frontier and the same
        /// conversation as folding the whole log from seq 1.
        #[test]
        fn a_fold_restored_from_a_snapshot_at_any_seq_folds_the_rest_the_same(
            steps in proptest::collection::vec(step(), 0..60)
        ) {
            let mut events = Vec::new();
            let mut counter = 0;
            for step in &steps {
                apply(&mut events, step, &mut counter);
            }
            let whole = fold_log(&events);
            let mut state = FoldState::default();
            for split in 0..=events.len() {
                if split > 0 {
                    state.apply(&events[split - 1]);
                }
                let data = state.to_snapshot().expect("not lent");
                let mut restored = FoldState::from_snapshot(vec![data.clone().into()], None).expect("a fresh snapshot decodes");
                prop_assert_eq!(&restored.folded(), &fold_log(&events[..split]));
                let taken = restored.take_folded();
                if let Frontier::CallModel(conversation) = taken.frontier {
                    prop_assert!(restored.to_snapshot().is_none(), "no snapshot while lent");
                    restored.give_back(conversation);
                }
                for event in &events[split..] {
                    restored.apply(event);
                }
                prop_assert_eq!(&restored.folded(), &whole);
                prop_assert_eq!(restored.last_interrupt_seq(), fold_state(&events).last_interrupt_seq());
            }
        }

        /// A fold that keeps its settled messages in a provider's form, started from seq 1
        /// or from its snapshot at any seq, hands out conversations from which the provider
        /// builds byte for byte the request it builds from the conversation held as messages.
        #[test]
        fn a_transcript_renders_the_request_the_messages_render(
            steps in proptest::collection::vec(step(), 0..40),
            openai_form in any::<bool>(),
            cut in 1usize..64,
        ) {
            let form: &'static dyn Form = if openai_form { &openai::FORM } else { &anthropic::FORM };
            let mut events = Vec::new();
            let mut counter = 0;
            for step in &steps {
                apply(&mut events, step, &mut counter);
            }
            let whole = fold_state(&events);
            let mut formed = FoldState::rendering(form);
            let mut plain = FoldState::default();
            for split in 0..=events.len() {
                if split > 0 {
                    formed.apply(&events[split - 1]);
                    plain.apply(&events[split - 1]);
                }
                let data = formed.to_snapshot().expect("not lent");
                // As it arrives: in pieces, cut anywhere (here every `cut` bytes).
                let pieces: Vec<Bytes> = data.chunks(cut).map(Bytes::copy_from_slice).collect();
                let mut restored = FoldState::from_snapshot(pieces, Some(form)).expect("decodes");
                for event in &events[split..] {
                    restored.apply(event);
                }
                for (fold, plain) in [(&formed, &plain), (&restored, &whole)] {
                    match (fold.clone().take_folded().frontier, plain.clone().take_folded().frontier) {
                        (Frontier::CallModel(formed), Frontier::CallModel(plain)) => {
                            prop_assert!(plain.transcript.is_empty());
                            prop_assert_eq!(formed.replies(), plain.replies());
                            prop_assert_eq!(body(form, &formed), body(form, &plain));
                        }
                        (formed, plain) => prop_assert_eq!(
                            std::mem::discriminant(&formed),
                            std::mem::discriminant(&plain)
                        ),
                    }
                }
            }
        }

        /// Even a log no runner would write (results before their calls, strays,
        /// duplicates, replies while calls are open) never yields an unpaired request.
        #[test]
        fn any_log_at_all_never_yields_an_unpaired_request(
            picks in proptest::collection::vec((0u8..7, 0usize..4, 0usize..3), 0..40)
        ) {
            let ids = ["a", "b", "c", "d"];
            let events: Vec<Event> = picks
                .iter()
                .map(|&(kind, id, n)| match kind {
                    0 => user("u"),
                    1 => reply(&ids[id..(id + n).min(ids.len())], "r"),
                    2 => started(ids[id], n as u32 + 1),
                    3 => result(ids[id]),
                    4 => delta("d"),
                    5 => run_error(),
                    _ => unknown(),
                })
                .collect();
            if let Frontier::CallModel(c) = fold_log(&events).frontier {
                // A call id reused by two replies is answered after each of them; the
                // per-message rule still holds, so only check within messages.
                let mut seen = HashSet::new();
                for m in &c.messages {
                    if let Message::User(blocks) = m {
                        seen.clear();
                        for b in blocks {
                            if let UserBlock::ToolResult(r) = b {
                                prop_assert!(seen.insert(r.tool_use_id.clone()));
                            }
                        }
                    }
                }
                prop_assert!(matches!(c.messages.last(), Some(Message::User(_))));
                for (i, m) in c.messages.iter().enumerate() {
                    if let Message::Assistant(reply) = m {
                        let calls: Vec<&str> = tool_uses(reply).map(|c| c.id.as_str()).collect();
                        if calls.is_empty() { continue; }
                        let Some(Message::User(next)) = c.messages.get(i + 1) else {
                            return Err(TestCaseError::fail("call not followed by results"));
                        };
                        let leading: Vec<&str> = next.iter().take(calls.len()).filter_map(|b| match b {
                            UserBlock::ToolResult(r) => Some(r.tool_use_id.as_str()),
                            UserBlock::Text(_) => None,
                        }).collect();
                        prop_assert_eq!(leading, calls);
                    }
                }
            }
        }
    }
}
