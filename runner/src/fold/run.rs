//! What a session's log says about its current run: the part of the fold that the
//! decisions about failing work are taken from (`crate::resilience`), so that a runner that
//! takes the session over, after a kill -9 or a drain, takes the same ones.
//!
//! A run is what follows a `user_message`: it starts afresh with each one (its budget, its
//! retries, its row of identical calls). Promise: a pure function of the log, applied event
//! by event with the rest of the fold (so a snapshot carries it, and any split of the log
//! folds the same):
//! - the run's start (the user message's seq and store time), its model replies and their
//!   tokens (input plus output): what a budget counts;
//! - the current turn's `model_retry`s, in order (a reply, a `run_error`, an
//!   `interrupted` or a new run clears them), and when its first failed call was logged:
//!   what the schedule of the next call is made from;
//! - whether the run paused itself (`run_paused`): it waits for a person;
//! - the row of identical tool calls that ran last (same tool, same input as JSON values),
//!   ended by another call, a denied one, a user message or a call served in a replay
//!   (which does not count either).

use agentlog_proto::v1::{event::Kind, Event, ModelRetry, ToolResult, ToolUseBlock};

use super::Approval;

/// The reason of a `model_retry` that made no call (the model's circuit was open).
pub const CIRCUIT_OPEN: &str = "circuit_open";

/// The current run, as the log has it so far.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RunState {
    /// The seq of the user message that began the run (0: no user message yet).
    #[prost(uint64, tag = "1")]
    pub started_seq: u64,
    /// Its store time.
    #[prost(int64, tag = "2")]
    pub started_unix_ms: i64,
    /// The run's model replies.
    #[prost(uint64, tag = "3")]
    pub replies: u64,
    /// Input plus output tokens of the run's replies.
    #[prost(uint64, tag = "4")]
    pub tokens: u64,
    /// The session's assistant messages, every run's: the next call's `turn`.
    #[prost(uint64, tag = "5")]
    pub session_replies: u64,
    /// The current turn's `model_retry`s in this run, in log order.
    #[prost(message, repeated, tag = "6")]
    pub retries: Vec<ModelRetry>,
    /// The store time of the turn's first `model_retry` for a failed call (0: none).
    #[prost(int64, tag = "7")]
    pub first_failure_unix_ms: i64,
    /// The run paused itself (`run_paused`) and waits for a person.
    #[prost(bool, tag = "8")]
    pub paused: bool,
    /// The last row of identical calls that ran.
    #[prost(message, optional, tag = "9")]
    pub row: Option<CallRow>,
}

/// Identical calls that ran one after the other.
#[derive(Clone, PartialEq, prost::Message)]
pub struct CallRow {
    #[prost(string, tag = "1")]
    pub tool: String,
    #[prost(message, optional, tag = "2")]
    pub input: Option<prost_types::Struct>,
    #[prost(uint32, tag = "3")]
    pub count: u32,
}

impl CallRow {
    /// Whether `call` is one more of the row.
    pub fn matches(&self, call: &ToolUseBlock) -> bool {
        self.tool == call.name && self.input == call.input
    }
}

impl RunState {
    /// Applies the next event of the log. `finished`: for a `tool_result`, the call it
    /// answers and whether a person denied that call.
    pub fn apply(&mut self, event: &Event, finished: Option<(&ToolUseBlock, &Approval)>) {
        match &event.kind {
            Some(Kind::UserMessage(_)) => {
                let session_replies = self.session_replies;
                *self = RunState {
                    started_seq: event.seq,
                    started_unix_ms: event.ts_unix_ms,
                    session_replies,
                    ..RunState::default()
                };
            }
            Some(Kind::AssistantMessage(reply)) => {
                self.session_replies += 1;
                self.replies += 1;
                if let Some(usage) = &reply.usage {
                    self.tokens = self
                        .tokens
                        .saturating_add(usage.input_tokens)
                        .saturating_add(usage.output_tokens);
                }
                self.end_turn();
            }
            Some(Kind::RunError(_) | Kind::Interrupted(_)) => self.end_turn(),
            Some(Kind::ModelRetry(retry)) => {
                if retry.reason != CIRCUIT_OPEN && self.first_failure_unix_ms == 0 {
                    self.first_failure_unix_ms = event.ts_unix_ms;
                }
                self.retries.push(retry.clone());
            }
            Some(Kind::RunPaused(_)) => self.paused = true,
            Some(Kind::ToolResult(result)) => self.count_call(result, finished),
            _ => {}
        }
    }

    fn end_turn(&mut self) {
        self.retries.clear();
        self.first_failure_unix_ms = 0;
    }

    /// A call ran (or was closed): one more of the row, the start of a new one, or the row
    /// ended.
    fn count_call(&mut self, result: &ToolResult, finished: Option<(&ToolUseBlock, &Approval)>) {
        let Some((call, approval)) = finished else {
            return;
        };
        if result.served_from.is_some() || matches!(approval, Approval::Denied { .. }) {
            self.row = None;
            return;
        }
        match &mut self.row {
            Some(row) if row.matches(call) => row.count += 1,
            _ => {
                self.row = Some(CallRow {
                    tool: call.name.clone(),
                    input: call.input.clone(),
                    count: 1,
                })
            }
        }
    }

    /// The turn's failed calls so far (a `model_retry` of an open circuit made none).
    pub fn failed_calls(&self) -> u32 {
        self.retries
            .iter()
            .filter(|r| r.reason != CIRCUIT_OPEN)
            .count() as u32
    }

    /// When the next call of the turn may be made, as the log says (0: at once).
    pub fn due_unix_ms(&self) -> i64 {
        self.retries.last().map_or(0, |r| r.retry_at_unix_ms)
    }
}

#[cfg(test)]
mod tests {
    use agentlog_proto::v1::{AssistantMessage, RunPaused, ServedFrom, Usage, UserMessage};

    use super::*;

    fn event(seq: u64, ts: i64, kind: Kind) -> Event {
        Event {
            seq,
            ts_unix_ms: ts,
            kind: Some(kind),
            ..Event::default()
        }
    }

    fn retry(model: &str, reason: &str, at: i64) -> Kind {
        Kind::ModelRetry(ModelRetry {
            model: model.into(),
            reason: reason.into(),
            retry_at_unix_ms: at,
            ..ModelRetry::default()
        })
    }

    fn call(input: &str) -> ToolUseBlock {
        let input = prost_types::Struct {
            fields: [(
                "command".to_string(),
                prost_types::Value {
                    kind: Some(prost_types::value::Kind::StringValue(input.into())),
                },
            )]
            .into(),
        };
        ToolUseBlock {
            id: "t".into(),
            name: "bash".into(),
            input: Some(input),
        }
    }

    fn result(served: bool) -> Event {
        event(
            0,
            0,
            Kind::ToolResult(ToolResult {
                served_from: served.then(ServedFrom::default),
                ..ToolResult::default()
            }),
        )
    }

    #[test]
    fn a_run_counts_replies_tokens_and_the_turns_failures_and_starts_afresh() {
        let mut run = RunState::default();
        run.apply(
            &event(1, 100, Kind::UserMessage(UserMessage::default())),
            None,
        );
        run.apply(&event(2, 150, retry("a:m", "overloaded", 900)), None);
        run.apply(&event(3, 160, retry("a:m", CIRCUIT_OPEN, 990)), None);
        assert_eq!((run.failed_calls(), run.due_unix_ms()), (1, 990));
        assert_eq!(run.first_failure_unix_ms, 150);
        let reply = AssistantMessage {
            usage: Some(Usage {
                input_tokens: 10,
                output_tokens: 5,
                ..Usage::default()
            }),
            ..AssistantMessage::default()
        };
        run.apply(&event(4, 200, Kind::AssistantMessage(reply.clone())), None);
        assert_eq!((run.replies, run.tokens, run.session_replies), (1, 15, 1));
        assert_eq!((run.failed_calls(), run.due_unix_ms()), (0, 0));
        run.apply(&event(5, 300, Kind::RunPaused(RunPaused::default())), None);
        assert!(run.paused);
        run.apply(
            &event(6, 400, Kind::UserMessage(UserMessage::default())),
            None,
        );
        assert_eq!(
            (
                run.started_seq,
                run.started_unix_ms,
                run.replies,
                run.paused
            ),
            (6, 400, 0, false)
        );
        assert_eq!(run.session_replies, 1, "the session's replies go on");
    }

    #[test]
    fn a_row_counts_identical_calls_and_ends_at_another_a_denial_or_a_served_one() {
        let mut run = RunState::default();
        let ls = call("ls");
        for _ in 0..2 {
            run.apply(&result(false), Some((&ls, &Approval::NotAsked)));
        }
        assert_eq!(run.row.as_ref().map(|r| r.count), Some(2));
        assert!(run.row.as_ref().is_some_and(|r| r.matches(&ls)));
        let pwd = call("pwd");
        run.apply(&result(false), Some((&pwd, &Approval::Approved)));
        assert_eq!(
            run.row.as_ref().map(|r| (r.count, r.matches(&pwd))),
            Some((1, true))
        );
        run.apply(
            &result(false),
            Some((
                &pwd,
                &Approval::Denied {
                    note: String::new(),
                },
            )),
        );
        assert_eq!(run.row, None, "a denied call ends the row");
        run.apply(&result(false), Some((&pwd, &Approval::NotAsked)));
        run.apply(&result(true), Some((&pwd, &Approval::NotAsked)));
        assert_eq!(run.row, None, "a served call ends it and does not count");
        run.apply(&result(false), Some((&pwd, &Approval::NotAsked)));
        run.apply(
            &event(9, 0, Kind::UserMessage(UserMessage::default())),
            None,
        );
        assert_eq!(run.row, None, "a user message ends it");
    }
}
