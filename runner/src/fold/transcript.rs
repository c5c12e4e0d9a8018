//! The settled part of a conversation, kept as the provider's request bytes.
//!
//! A conversation only grows at its end, and a message is settled (never changes again)
//! once the reply after it is logged. A fold given a [`Form`] writes each message in that
//! form as it settles, once, instead of keeping it as a [`Message`]: a model call then
//! copies those bytes and renders only the messages since, so a runner's work per step
//! follows the events since its last step, not the conversation's length. The bytes go into
//! the fold's snapshot as they are, so a runner that restores it decodes nothing of them.
//!
//! Promise: for any log, the request a provider builds from a conversation whose start is
//! a transcript is byte for byte the request it builds from the same conversation held
//! entirely as messages (the property tests in `fold.rs` check it for both providers).

use std::collections::HashSet;
use std::fmt;

use bytes::Bytes;

use super::{tool_uses, Message};

/// How a provider writes one message into its request's message list.
pub trait Form: Send + Sync + fmt::Debug {
    /// Names the form; a snapshot's transcript is reused only by a runner of the same form.
    fn name(&self) -> &'static str;
    /// Appends `message` to `out` as zero or more elements of the request's message array.
    fn render(&self, message: &Message, out: &mut JsonElements);
}

/// Elements of a JSON array, comma-separated, without the brackets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct JsonElements(Vec<u8>);

impl JsonElements {
    pub fn push(&mut self, element: &impl serde::Serialize) {
        if !self.0.is_empty() {
            self.0.push(b',');
        }
        serde_json::to_writer(&mut self.0, element)
            .expect("a JSON value is always written to memory");
    }

    /// Appends every element of `other`.
    pub fn extend(&mut self, other: &JsonElements) {
        if !self.0.is_empty() && !other.0.is_empty() {
            self.0.push(b',');
        }
        self.0.extend_from_slice(&other.0);
    }

    pub fn as_bytes(&self) -> &[u8] {
        &self.0
    }
}

/// The settled messages of a conversation in one provider's form.
#[derive(Clone, Default)]
pub struct Transcript {
    form: Option<&'static dyn Form>,
    /// The elements a snapshot held, in the pieces it arrived in (shared, never copied):
    /// together one run of elements, cut anywhere.
    restored: Vec<Bytes>,
    /// The elements written since.
    elements: JsonElements,
    /// Assistant messages written.
    replies: u64,
    /// The `tool_use` ids of those replies.
    call_ids: HashSet<String>,
}

impl Transcript {
    /// An empty transcript that writes messages in `form`.
    pub fn new(form: &'static dyn Form) -> Transcript {
        Transcript {
            form: Some(form),
            ..Transcript::default()
        }
    }

    /// Restores a transcript from its parts (a snapshot's: [`Transcript::to_bytes`], in
    /// pieces).
    pub(super) fn from_parts(
        form: &'static dyn Form,
        restored: Vec<Bytes>,
        replies: u64,
        call_ids: HashSet<String>,
    ) -> Transcript {
        Transcript {
            form: Some(form),
            restored,
            elements: JsonElements::default(),
            replies,
            call_ids,
        }
    }

    pub fn form(&self) -> Option<&'static dyn Form> {
        self.form
    }

    /// The form's name; empty when the transcript writes nothing.
    pub fn form_name(&self) -> &'static str {
        self.form.map_or("", |form| form.name())
    }

    /// Writes a settled message; without a form, hands it back to be kept as it is.
    pub(super) fn settle(&mut self, message: Message) -> Option<Message> {
        let Some(form) = self.form else {
            return Some(message);
        };
        if let Message::Assistant(reply) = &message {
            self.replies += 1;
            self.call_ids
                .extend(tool_uses(reply).map(|call| call.id.clone()));
        }
        form.render(&message, &mut self.elements);
        None
    }

    /// The restored elements' length and the written ones'.
    fn run_lengths(&self) -> [usize; 2] {
        let restored = self.restored.iter().map(Bytes::len).sum();
        [restored, self.elements.0.len()]
    }

    pub fn is_empty(&self) -> bool {
        self.run_lengths() == [0, 0]
    }

    /// The length of [`Transcript::write_to`]'s output.
    pub fn len(&self) -> usize {
        let [restored, written] = self.run_lengths();
        restored + written + usize::from(restored > 0 && written > 0)
    }

    /// Appends every element, comma-separated, to `out`.
    pub fn write_to(&self, out: &mut Vec<u8>) {
        let [restored, written] = self.run_lengths();
        for piece in &self.restored {
            out.extend_from_slice(piece);
        }
        if restored > 0 && written > 0 {
            out.push(b',');
        }
        out.extend_from_slice(&self.elements.0);
    }

    /// Every element, comma-separated.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.len());
        self.write_to(&mut out);
        out
    }

    /// Assistant messages written.
    pub fn replies(&self) -> u64 {
        self.replies
    }

    /// The `tool_use` ids of the replies written.
    pub fn call_ids(&self) -> &HashSet<String> {
        &self.call_ids
    }
}

impl PartialEq for Transcript {
    fn eq(&self, other: &Transcript) -> bool {
        self.form_name() == other.form_name()
            && self.to_bytes() == other.to_bytes()
            && self.replies == other.replies
            && self.call_ids == other.call_ids
    }
}

impl fmt::Debug for Transcript {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Transcript")
            .field("form", &self.form_name())
            .field("bytes", &self.len())
            .field("replies", &self.replies)
            .finish()
    }
}
