//! `scripted:FILE`: replies read from a file, for demos and tests.
//!
//! The file holds one reply per line, as JSON (blank lines and lines starting with `#` are
//! skipped):
//!
//! ```text
//! # reply 0: look around
//! {"text": "Let me look.", "tool_uses": [{"name": "bash", "input": {"command": "ls"}}]}
//! # reply 1: done; stream the text slowly, 20 ms per chunk
//! {"text": "All done.", "chunk_delay_ms": 20}
//! ```
//!
//! Promise: the reply is chosen by the number of assistant turns already in the
//! conversation (reply 0 answers the first user turn), so a resumed session gets exactly
//! the reply it would have got without the interruption. Its runner folds the conversation
//! in the Anthropic form (as if the request were to be sent), so a session's fold and
//! snapshots cost what they cost with a model behind HTTP. The tool_use ids are
//! `toolu_<reply>_<call>`, unique within a session. A conversation past the last line is
//! refused, which ends the turn with a `run_error`.

use std::path::PathBuf;
use std::time::Duration;

use agentlog_proto::v1::{
    content_block::Block, AssistantMessage, ContentBlock, TextBlock, ToolUseBlock, Usage,
};
use serde::Deserialize;
use serde_json::{Map, Value};

use super::{ModelError, ModelRequest, TextSink};
use agentlog_client::json::object_to_struct;

/// How many characters of text each streamed chunk carries.
const CHUNK_CHARS: usize = 8;

#[derive(Debug, thiserror::Error)]
pub enum ScriptError {
    #[error("cannot read the script {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}:{line}: not a scripted reply ({source}); expected {{\"text\": …, \"tool_uses\": [{{\"name\": …, \"input\": {{…}}}}]}}")]
    Parse {
        path: PathBuf,
        line: usize,
        source: serde_json::Error,
    },
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScriptedReply {
    #[serde(default)]
    text: String,
    #[serde(default)]
    tool_uses: Vec<ScriptedCall>,
    #[serde(default)]
    chunk_delay_ms: u64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct ScriptedCall {
    name: String,
    #[serde(default)]
    input: Map<String, Value>,
}

#[derive(Debug)]
pub struct Scripted {
    path: PathBuf,
    /// `scripted:FILE`, as `--model` named it: what its replies give as their model.
    name: String,
    replies: Vec<ScriptedReply>,
}

impl Scripted {
    /// Reads and checks the whole script up front, so a bad line fails at start-up.
    pub fn load(path: &str) -> Result<Scripted, ScriptError> {
        let path = PathBuf::from(path);
        let text = std::fs::read_to_string(&path).map_err(|source| ScriptError::Read {
            path: path.clone(),
            source,
        })?;
        let mut replies = Vec::new();
        for (number, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            replies.push(
                serde_json::from_str(line).map_err(|source| ScriptError::Parse {
                    path: path.clone(),
                    line: number + 1,
                    source,
                })?,
            );
        }
        Ok(Scripted {
            name: format!("scripted:{}", path.display()),
            path,
            replies,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub(super) async fn stream_reply(
        &self,
        request: ModelRequest<'_>,
        text: &TextSink,
    ) -> Result<AssistantMessage, ModelError> {
        let index = request.conversation.replies() as usize;
        let reply = self.replies.get(index).ok_or_else(|| {
            ModelError::Refused(format!(
                "the script {} has {} replies and none for turn {index}",
                self.path.display(),
                self.replies.len()
            ))
        })?;
        let chars: Vec<char> = reply.text.chars().collect();
        for chunk in chars.chunks(CHUNK_CHARS) {
            if reply.chunk_delay_ms > 0 {
                tokio::time::sleep(Duration::from_millis(reply.chunk_delay_ms)).await;
            }
            text.send(&chunk.iter().collect::<String>()).await;
        }
        let mut content = Vec::new();
        if !reply.text.is_empty() {
            content.push(ContentBlock {
                block: Some(Block::Text(TextBlock {
                    text: reply.text.clone(),
                })),
            });
        }
        for (i, call) in reply.tool_uses.iter().enumerate() {
            content.push(ContentBlock {
                block: Some(Block::ToolUse(ToolUseBlock {
                    id: format!("toolu_{index}_{i}"),
                    name: call.name.clone(),
                    input: Some(object_to_struct(call.input.clone())),
                })),
            });
        }
        Ok(AssistantMessage {
            content,
            stop_reason: if reply.tool_uses.is_empty() {
                "end_turn"
            } else {
                "tool_use"
            }
            .into(),
            model: self.name.clone(),
            usage: Some(Usage::default()),
            message_id: format!("scripted_{index}"),
        })
    }
}

#[cfg(test)]
mod tests {
    use tokio::sync::mpsc;

    use super::*;
    use crate::fold::{Conversation, Message, UserBlock};

    fn script(text: &str) -> (tempfile::NamedTempFile, Result<Scripted, ScriptError>) {
        let file = tempfile::NamedTempFile::new().expect("temp file");
        std::fs::write(file.path(), text).expect("write script");
        let loaded = Scripted::load(&file.path().to_string_lossy());
        (file, loaded)
    }

    fn request(conversation: &Conversation) -> ModelRequest<'_> {
        ModelRequest {
            system: "",
            conversation,
            tools: &[],
            max_tokens: 1,
            idle_timeout: std::time::Duration::from_secs(120),
        }
    }

    #[tokio::test]
    async fn replies_follow_the_number_of_assistant_turns() {
        let (_file, scripted) = script(
            "# demo\n{\"text\": \"Let me look around.\", \"tool_uses\": [{\"name\": \"bash\", \"input\": {\"command\": \"ls\"}}]}\n\n{\"text\": \"done\"}\n",
        );
        let scripted = scripted.expect("valid script");
        let mut conversation =
            Conversation::of(vec![Message::User(vec![UserBlock::Text("hi".into())])]);
        let (tx, mut rx) = mpsc::channel(64);
        let first = scripted
            .stream_reply(request(&conversation), &TextSink::new(tx))
            .await
            .expect("reply 0");
        let mut streamed = String::new();
        while let Ok(piece) = rx.try_recv() {
            streamed.push_str(&piece);
        }
        assert_eq!(streamed, "Let me look around.");
        assert_eq!(first.stop_reason, "tool_use");
        assert!(matches!(&first.content[1].block,
            Some(Block::ToolUse(call)) if call.id == "toolu_0_0" && call.name == "bash"));

        conversation
            .messages
            .push(Message::Assistant(first.clone()));
        conversation
            .messages
            .push(Message::User(vec![UserBlock::Text("ok".into())]));
        let second = scripted
            .stream_reply(request(&conversation), &TextSink::default())
            .await
            .expect("reply 1");
        assert_eq!(second.stop_reason, "end_turn");

        conversation.messages.push(Message::Assistant(second));
        conversation
            .messages
            .push(Message::User(vec![UserBlock::Text("more".into())]));
        let past_the_end = scripted
            .stream_reply(request(&conversation), &TextSink::default())
            .await;
        assert!(
            matches!(past_the_end, Err(ModelError::Refused(m)) if m.contains("none for turn 2"))
        );
    }

    #[test]
    fn a_bad_line_is_reported_with_its_number() {
        let (_file, scripted) = script("{\"text\": \"ok\"}\n{\"txet\": 1}\n");
        let message = scripted.err().map(|e| e.to_string()).unwrap_or_default();
        assert!(message.contains(":2: not a scripted reply"), "{message}");
    }
}
