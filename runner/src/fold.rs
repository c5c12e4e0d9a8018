//! The fold: the one pure, deterministic function from a session's log to what the runner
//! does next and, when that is a model call, the conversation the model is shown.
//!
//! Promise: for any sequence of events, a [`Conversation`] handed out by [`fold_log`]
//! satisfies the providers' pairing rule (SPEC §3): every `tool_use` is answered, exactly
//! once, by `tool_result` blocks at the very start of the next user message, in the order
//! of the calls, with any user text that arrived in between placed after the results.
//! Consecutive user content is merged; deltas, `run_error`s and kinds this runner does not
//! know are skipped; assistant turns are passed through verbatim. A conversation is only
//! handed out when every call of the last reply has its result, so an unpaired `tool_use`
//! can never reach a provider: that state is [`Frontier::RunTools`] instead.

use std::collections::HashMap;

use agentlog_proto::v1::{
    content_block::Block, event::Kind, AssistantMessage, Event, ToolResult, ToolUseBlock,
};

/// What an older reply's call is answered with when the log holds no result for it. Only a
/// log written outside the guarded loop can contain this (the loop never calls the model
/// while a call is open), but the provider must still receive a well-formed request.
pub const MISSING_RESULT: &str =
    "no result was recorded for this tool call; its outcome is unknown";

/// The provider-neutral conversation: what the Anthropic and OpenAI request builders render.
#[derive(Debug, Clone, PartialEq)]
pub struct Conversation {
    pub messages: Vec<Message>,
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

#[derive(Debug, Clone, PartialEq)]
pub struct PendingCall {
    pub tool_use: ToolUseBlock,
    pub state: CallState,
}

/// The one thing to do next (SPEC §3, "act at the frontier").
#[derive(Debug, Clone, PartialEq)]
pub enum Frontier {
    /// A trailing user turn, or every result of the last reply is in: ask the model.
    CallModel(Conversation),
    /// The last reply has calls without a result. Holds every call of that reply in order,
    /// finished ones included, so the caller can walk them in order.
    RunTools(Vec<PendingCall>),
    /// A final reply or a `run_error` ends the log: nothing to do.
    Idle,
}

/// The fold of a whole log.
#[derive(Debug, Clone, PartialEq)]
pub struct Folded {
    pub frontier: Frontier,
    /// How many model turns the log has settled (replies plus `run_error`s). The next model
    /// call is turn number `turn`; every runner folding the same log computes the same
    /// number, which makes the event ids of that turn deterministic.
    pub turn: u64,
}

/// Folds a session's events (in seq order) into the frontier.
pub fn fold_log(events: &[Event]) -> Folded {
    // Results and starts are looked up by call id wherever they sit in the log, so a user
    // message appended between a reply and its results cannot split them apart.
    let mut results: HashMap<&str, &ToolResult> = HashMap::new();
    let mut attempts: HashMap<&str, u32> = HashMap::new();
    for event in events {
        match &event.kind {
            Some(Kind::ToolResult(result)) => {
                // The first logged result is the one the model sees; a duplicate changes nothing.
                results.entry(result.tool_use_id.as_str()).or_insert(result);
            }
            Some(Kind::ToolStarted(started)) => {
                let attempt = attempts.entry(started.tool_use_id.as_str()).or_insert(0);
                *attempt = (*attempt).max(started.attempt);
            }
            _ => {}
        }
    }

    let mut messages = Vec::new();
    let mut open_calls: Vec<&ToolUseBlock> = Vec::new();
    let mut user_texts: Vec<&str> = Vec::new();
    let mut turn = 0;
    let mut ends_in_run_error = false;
    for event in events {
        match &event.kind {
            Some(Kind::UserMessage(user)) => {
                user_texts.push(&user.text);
                ends_in_run_error = false;
            }
            Some(Kind::AssistantMessage(reply)) => {
                if let Some(user) = user_message(&open_calls, &user_texts, &results) {
                    messages.push(Message::User(user));
                }
                user_texts.clear();
                open_calls = tool_uses(reply).collect();
                messages.push(Message::Assistant(reply.clone()));
                turn += 1;
                ends_in_run_error = false;
            }
            Some(Kind::RunError(_)) => {
                turn += 1;
                ends_in_run_error = true;
            }
            Some(Kind::ToolStarted(_)) | Some(Kind::ToolResult(_)) => ends_in_run_error = false,
            // Interrupts and approvals are answered by the loop in `turn.rs`; the
            // conversation the provider sees is made of turns, calls and results only.
            Some(Kind::Interrupt(_))
            | Some(Kind::Interrupted(_))
            | Some(Kind::ApprovalRequested(_))
            | Some(Kind::ApprovalDecision(_))
            | Some(Kind::AssistantDelta(_))
            | None => {}
        }
    }

    let frontier = if open_calls
        .iter()
        .any(|call| !results.contains_key(call.id.as_str()))
    {
        Frontier::RunTools(
            open_calls
                .iter()
                .map(|call| PendingCall {
                    tool_use: (*call).clone(),
                    state: match (
                        results.get(call.id.as_str()),
                        attempts.get(call.id.as_str()),
                    ) {
                        (Some(result), _) => CallState::Finished((*result).clone()),
                        (None, Some(&attempt)) => CallState::Interrupted { attempt },
                        (None, None) => CallState::NotStarted,
                    },
                })
                .collect(),
        )
    } else if ends_in_run_error {
        Frontier::Idle
    } else if let Some(user) = user_message(&open_calls, &user_texts, &results) {
        messages.push(Message::User(user));
        Frontier::CallModel(Conversation { messages })
    } else {
        Frontier::Idle
    };
    Folded { frontier, turn }
}

/// The `tool_use` blocks of a reply, in order.
pub fn tool_uses(reply: &AssistantMessage) -> impl Iterator<Item = &ToolUseBlock> {
    reply.content.iter().filter_map(|block| match &block.block {
        Some(Block::ToolUse(tool_use)) => Some(tool_use),
        _ => None,
    })
}

/// The user message that follows a reply: its calls' results first, in call order, then the
/// text. `None` when there is nothing to say.
fn user_message(
    open_calls: &[&ToolUseBlock],
    texts: &[&str],
    results: &HashMap<&str, &ToolResult>,
) -> Option<Vec<UserBlock>> {
    let mut blocks: Vec<UserBlock> = open_calls
        .iter()
        .map(|call| {
            UserBlock::ToolResult(match results.get(call.id.as_str()) {
                Some(result) => (*result).clone(),
                None => ToolResult {
                    tool_use_id: call.id.clone(),
                    content: MISSING_RESULT.to_string(),
                    is_error: true,
                },
            })
        })
        .collect();
    blocks.extend(texts.iter().map(|text| UserBlock::Text(text.to_string())));
    (!blocks.is_empty()).then_some(blocks)
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use agentlog_proto::v1::{
        AssistantDelta, ContentBlock, RunError, TextBlock, ThinkingBlock, ToolStarted, UserMessage,
    };
    use proptest::prelude::*;

    use super::*;

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
            _ => {}
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
                    Frontier::Idle => {}
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
