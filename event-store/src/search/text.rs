//! What of an event is searchable, and what a word is: the one rule the indexes are fed by
//! and a query is matched with, so that both backends find the same events.
//!
//! Searchable: the text of a `user_message`; an `assistant_message`'s text blocks and its
//! tool calls (the tool's name and every string in its input, e.g. a bash command); a
//! `tool_result`'s output. Not deltas (the reply that follows them holds the same text),
//! thinking blocks, or the other kinds.
//!
//! A word is a run of alphanumeric characters (Unicode), lowercased; everything else
//! separates words. Words longer than [`MAX_WORD_BYTES`] are not words (hashes and blobs).

use agentlog_proto::v1::{content_block, event, Event};

/// A longer run of letters and digits is not indexed, nor matched.
pub const MAX_WORD_BYTES: usize = 255;

/// An event's searchable text and its kind's field name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Searchable {
    pub kind: &'static str,
    pub text: String,
}

/// The searchable text of `event`, if its kind has any.
pub fn searchable(event: &Event) -> Option<Searchable> {
    let (kind, text) = match event.kind.as_ref()? {
        event::Kind::UserMessage(m) => ("user_message", m.text.clone()),
        event::Kind::ToolResult(r) => ("tool_result", r.content.clone()),
        event::Kind::AssistantMessage(m) => {
            let mut text = String::new();
            for block in &m.content {
                match block.block.as_ref() {
                    Some(content_block::Block::Text(t)) => push_line(&mut text, &t.text),
                    Some(content_block::Block::ToolUse(call)) => {
                        push_line(&mut text, &call.name);
                        if let Some(input) = &call.input {
                            for value in input.fields.values() {
                                push_strings(&mut text, value);
                            }
                        }
                    }
                    _ => {}
                }
            }
            ("assistant_message", text)
        }
        _ => return None,
    };
    Some(Searchable { kind, text })
}

fn push_line(text: &mut String, line: &str) {
    if line.is_empty() {
        return;
    }
    if !text.is_empty() {
        text.push('\n');
    }
    text.push_str(line);
}

/// Every string in a JSON value (a tool's input), in order.
fn push_strings(text: &mut String, value: &prost_types::Value) {
    use prost_types::value::Kind;
    match value.kind.as_ref() {
        Some(Kind::StringValue(s)) => push_line(text, s),
        Some(Kind::ListValue(list)) => list.values.iter().for_each(|v| push_strings(text, v)),
        Some(Kind::StructValue(s)) => s.fields.values().for_each(|v| push_strings(text, v)),
        _ => {}
    }
}

/// A word of a text: where it is (byte offsets) and its lowercased form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Word {
    pub start: usize,
    pub end: usize,
    pub text: String,
}

/// The words of `text`, in order.
pub fn words(text: &str) -> impl Iterator<Item = Word> + '_ {
    Spans::new(text).map(|(start, end)| {
        let mut lowered = String::with_capacity(end - start);
        lowercase_into(&text[start..end], &mut lowered);
        Word {
            start,
            end,
            text: lowered,
        }
    })
}

/// Where the words of a text are (byte offsets, in order), for a caller that lowercases
/// each into a buffer of its own ([`lowercase_into`]) rather than allocate a [`Word`].
pub struct Spans<'a> {
    text: &'a str,
    chars: std::iter::Peekable<std::str::CharIndices<'a>>,
}

impl<'a> Spans<'a> {
    pub fn new(text: &'a str) -> Spans<'a> {
        Spans {
            text,
            chars: text.char_indices().peekable(),
        }
    }
}

impl Iterator for Spans<'_> {
    type Item = (usize, usize);

    fn next(&mut self) -> Option<(usize, usize)> {
        loop {
            let (start, _) = self.chars.find(|(_, c)| c.is_alphanumeric())?;
            let mut end = self.text.len();
            while let Some(&(i, c)) = self.chars.peek() {
                if !c.is_alphanumeric() {
                    end = i;
                    break;
                }
                self.chars.next();
            }
            if end - start <= MAX_WORD_BYTES {
                return Some((start, end));
            }
        }
    }
}

/// Appends `word` lowercased to `out` (Unicode's rule, as `str::to_lowercase`; without an
/// allocation for ASCII).
pub fn lowercase_into(word: &str, out: &mut String) {
    if word.is_ascii() {
        let start = out.len();
        out.push_str(word);
        out[start..].make_ascii_lowercase();
    } else {
        out.push_str(&word.to_lowercase());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentlog_proto::v1::{
        AssistantMessage, ContentBlock, TextBlock, ToolUseBlock, UserMessage,
    };

    fn texts(s: &str) -> Vec<String> {
        words(s).map(|w| w.text).collect()
    }

    #[test]
    fn words_are_lowercased_runs_of_letters_and_digits() {
        assert_eq!(
            texts("Ran `terraform destroy -auto-approve` in /srv/prod_2!"),
            [
                "ran",
                "terraform",
                "destroy",
                "auto",
                "approve",
                "in",
                "srv",
                "prod",
                "2"
            ]
        );
        assert_eq!(texts("Größe ÉTÉ 東京"), ["größe", "été", "東京"]);
        assert_eq!(texts(""), Vec::<String>::new());
        let long = "a".repeat(MAX_WORD_BYTES + 1);
        assert_eq!(texts(&format!("x {long} y")), ["x", "y"]);
        let w: Vec<Word> = words("ab, cd").collect();
        assert_eq!((w[1].start, w[1].end), (4, 6));
    }

    #[test]
    fn lowercasing_into_a_buffer_is_unicodes_rule() {
        // Final sigma and dotted capital I are where a character-by-character rule differs.
        for word in ["ΟΔΟΣ", "İstanbul", "MiXeD42", "ǅemal", "東京", ""] {
            let mut out = String::from("kept ");
            lowercase_into(word, &mut out);
            assert_eq!(out, format!("kept {}", word.to_lowercase()), "{word}");
        }
    }

    #[test]
    fn searchable_text_covers_messages_tool_inputs_and_outputs_not_deltas() {
        let user = Event {
            kind: Some(event::Kind::UserMessage(UserMessage { text: "hi".into() })),
            ..Default::default()
        };
        assert_eq!(searchable(&user).unwrap().kind, "user_message");
        let input = prost_types::Struct {
            fields: [(
                "command".to_string(),
                prost_types::Value {
                    kind: Some(prost_types::value::Kind::StringValue(
                        "terraform destroy".into(),
                    )),
                },
            )]
            .into(),
        };
        let reply = Event {
            kind: Some(event::Kind::AssistantMessage(AssistantMessage {
                content: vec![
                    ContentBlock {
                        block: Some(content_block::Block::Text(TextBlock {
                            text: "Sure.".into(),
                        })),
                    },
                    ContentBlock {
                        block: Some(content_block::Block::ToolUse(ToolUseBlock {
                            id: "t1".into(),
                            name: "bash".into(),
                            input: Some(input),
                        })),
                    },
                ],
                ..Default::default()
            })),
            ..Default::default()
        };
        assert_eq!(
            searchable(&reply).unwrap().text,
            "Sure.\nbash\nterraform destroy"
        );
        let delta = Event {
            kind: Some(event::Kind::AssistantDelta(Default::default())),
            ..Default::default()
        };
        assert_eq!(searchable(&delta), None);
    }
}
