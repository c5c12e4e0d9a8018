//! Where a session's log may be forked: the settled points `ForkSession` accepts. One rule,
//! decided by the store and offered by every client (the CLI's `fork`, the web view's "Fork
//! from here"), so that what a person is offered is what the store takes.

use crate::v1::{content_block, event, Event};

/// Where a log may be forked, event by event: a seq is a *settled point* when its event is a
/// `user_message`, a final `assistant_message`, an `interrupted`, or the `tool_result` that
/// answers the last open call of an assistant message, and no call of the log up to it is
/// left without its result. A fork at a settled point never holds a call whose outcome it
/// cannot know. The store refuses a fork anywhere else, and the CLI and the web view offer
/// only these seqs.
#[derive(Debug, Clone, Default)]
pub struct SettledPoints {
    /// Calls asked for and not answered yet, by `tool_use` id.
    open: Vec<String>,
}

impl SettledPoints {
    /// Takes in the log's next event; whether the log up to it is a settled point.
    pub fn apply(&mut self, event: &Event) -> bool {
        match &event.kind {
            Some(event::Kind::UserMessage(_) | event::Kind::Interrupted(_)) => self.open.is_empty(),
            Some(event::Kind::AssistantMessage(m)) => {
                let calls = m.content.iter().filter_map(|b| match &b.block {
                    Some(content_block::Block::ToolUse(t)) => Some(t.id.clone()),
                    _ => None,
                });
                let before = self.open.len();
                self.open.extend(calls);
                before == self.open.len() && self.open.is_empty()
            }
            Some(event::Kind::ToolResult(r)) => {
                let answered = match self.open.iter().position(|id| *id == r.tool_use_id) {
                    Some(at) => {
                        self.open.remove(at);
                        true
                    }
                    None => false,
                };
                answered && self.open.is_empty()
            }
            _ => false,
        }
    }

    /// The settled seqs of `events` (a log from seq 1, in order).
    pub fn of<'a>(events: impl IntoIterator<Item = &'a Event>) -> Vec<u64> {
        let mut points = SettledPoints::default();
        events
            .into_iter()
            .filter(|e| points.apply(e))
            .map(|e| e.seq)
            .collect()
    }
}
