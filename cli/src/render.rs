//! How events look on a terminal (a transcript, text streamed as it is generated) and to
//! scripts (`--json`: one object per line, in the proto3 JSON mapping grpcurl prints, so the
//! same tools read both).

use std::collections::HashMap;
use std::io::Write;

use agentlog_client::json::struct_to_object;
use agentlog_proto::v1::{
    content_block::Block, event::Kind, AssistantMessage, Event, OffPath, RunPaused, SessionInfo,
    SessionStatus,
};
use serde_json::{json, Value};

/// Tool output lines shown in a transcript; the log keeps all of it.
const RESULT_LINES: usize = 12;

/// Renders a session's events, in seq order, as a transcript.
#[derive(Debug, Default)]
pub struct Transcript {
    /// The turn whose text is being streamed, and what of it was printed.
    streaming_turn: Option<String>,
    streamed: String,
    /// Tool names by tool_use id, to label results.
    tools: HashMap<String, String>,
    /// The model the session runs on, and its fallbacks, as its `session_config`s name them.
    model: Option<String>,
    fallbacks: Vec<String>,
    /// The models the turn's `model_retry`s name, in order: the first is the head of the
    /// turn's chain, which a turn always calls first (known even where no `session_config`
    /// named the model).
    turn_models: Vec<String>,
}

impl Transcript {
    pub fn new() -> Transcript {
        Transcript::default()
    }

    pub fn event(&mut self, event: &Event, out: &mut impl Write) -> std::io::Result<()> {
        match &event.kind {
            Some(Kind::UserMessage(m)) => {
                self.end_stream(out)?;
                self.turn_models.clear();
                writeln!(out, "you> {}", m.text)?;
            }
            Some(Kind::AssistantDelta(d)) => {
                if self.streaming_turn.as_deref() != Some(&d.turn_id) {
                    if !self.streamed.is_empty() {
                        // The runner was replaced mid-reply; the turn streams again.
                        writeln!(out, "\n(the reply was interrupted; it is streaming again)")?;
                    }
                    self.streaming_turn = Some(d.turn_id.clone());
                    self.streamed.clear();
                    write!(out, "agent> ")?;
                }
                write!(out, "{}", d.text)?;
                self.streamed.push_str(&d.text);
            }
            Some(Kind::AssistantMessage(m)) => self.reply(m, out)?,
            Some(Kind::ToolStarted(s)) => {
                self.end_stream(out)?;
                if s.attempt > 1 {
                    writeln!(
                        out,
                        "  ~ {} was interrupted; running it again as attempt {} with the same idempotency key {}",
                        s.tool_use_id, s.attempt, s.idempotency_key
                    )?;
                }
            }
            Some(Kind::ToolResult(r)) => {
                self.end_stream(out)?;
                let name = self
                    .tools
                    .get(&r.tool_use_id)
                    .map(String::as_str)
                    .unwrap_or("tool");
                let label = if r.is_error { "error" } else { "result" };
                match &r.served_from {
                    Some(from) => writeln!(
                        out,
                        "  <- {name} {label} (served from {} seq {}; not run):",
                        from.session_id, from.seq
                    )?,
                    None => writeln!(out, "  <- {name} {label}:")?,
                }
                let lines: Vec<&str> = r.content.lines().collect();
                for line in lines.iter().take(RESULT_LINES) {
                    writeln!(out, "     {line}")?;
                }
                if lines.len() > RESULT_LINES {
                    writeln!(
                        out,
                        "     ... {} more lines (`agentlog --json show` has all of it)",
                        lines.len() - RESULT_LINES
                    )?;
                }
            }
            Some(Kind::RunError(e)) => {
                self.end_stream(out)?;
                writeln!(out, "error> {}", e.message)?;
            }
            Some(Kind::Interrupt(i)) => {
                self.end_stream(out)?;
                writeln!(out, "you> (interrupt) {}", i.reason)?;
            }
            Some(Kind::Interrupted(i)) => {
                self.end_stream(out)?;
                writeln!(out, "(interrupted: {})", i.reason)?;
            }
            Some(Kind::ApprovalRequested(r)) => {
                self.end_stream(out)?;
                self.tools
                    .insert(r.tool_use_id.clone(), r.tool_name.clone());
                writeln!(
                    out,
                    "  ? {} [{}] waits for a person: {}\n    answer with `agentlog approve {} {}` or `agentlog deny {} {} --note WHY`",
                    r.tool_name,
                    r.tool_use_id,
                    r.reason,
                    event.session_id,
                    r.tool_use_id,
                    event.session_id,
                    r.tool_use_id
                )?;
            }
            Some(Kind::ApprovalDecision(d)) => {
                self.end_stream(out)?;
                let verdict = if d.approved { "approved" } else { "denied" };
                let note = if d.note.is_empty() {
                    String::new()
                } else {
                    format!(": {}", d.note)
                };
                writeln!(out, "  {verdict} [{}]{note}", d.tool_use_id)?;
            }
            Some(Kind::SessionConfig(c)) => {
                self.end_stream(out)?;
                if !c.model.is_empty() {
                    self.model = Some(c.model.clone());
                }
                if !c.fallback_models.is_empty() {
                    self.fallbacks = c.fallback_models.clone();
                }
                match &c.replay {
                    Some(r) => writeln!(
                        out,
                        "(a replay of {} after seq {} on {}; off the recorded path: {})",
                        r.session_id,
                        r.after_seq,
                        c.model,
                        if r.off_path() == OffPath::Stop {
                            "stop"
                        } else {
                            "run"
                        }
                    )?,
                    None if !c.model.is_empty() => {
                        writeln!(out, "(the session runs on {} from here on)", c.model)?
                    }
                    None => {}
                }
                if !c.fallback_models.is_empty() {
                    writeln!(
                        out,
                        "(when its model keeps failing, a turn falls back to {})",
                        c.fallback_models.join(", then ")
                    )?;
                }
                if let Some(b) = &c.budget {
                    writeln!(out, "(each run's budget: {})", budget_words(b))?;
                }
            }
            Some(Kind::ModelRetry(r)) => {
                self.end_stream(out)?;
                self.turn_models.push(r.model.clone());
                writeln!(out, "  ! {}", retry_words(r, &event.session_id))?;
            }
            Some(Kind::RunPaused(p)) => {
                self.end_stream(out)?;
                writeln!(out, "(paused: {})", pause_words(p, &event.session_id))?;
            }
            None => {} // a kind newer than this CLI: skipped, as the spec asks of readers
        }
        out.flush()
    }

    /// Ends a stream that no reply closed (at the end of `show`, or before the next event).
    pub fn end_stream(&mut self, out: &mut impl Write) -> std::io::Result<()> {
        if !self.streamed.is_empty() {
            writeln!(out)?;
        }
        self.streaming_turn = None;
        self.streamed.clear();
        Ok(())
    }

    fn reply(&mut self, m: &AssistantMessage, out: &mut impl Write) -> std::io::Result<()> {
        let text: Vec<&str> = m
            .content
            .iter()
            .filter_map(|b| match &b.block {
                Some(Block::Text(t)) => Some(t.text.as_str()),
                _ => None,
            })
            .collect();
        let text = text.join("\n");
        if !self.streamed.is_empty() && self.streamed == text {
            writeln!(out)?; // it was all streamed already
        } else {
            self.end_stream(out)?;
            if !text.is_empty() {
                writeln!(out, "agent> {text}")?;
            }
        }
        self.streaming_turn = None;
        self.streamed.clear();
        for block in &m.content {
            if let Some(Block::ToolUse(call)) = &block.block {
                self.tools.insert(call.id.clone(), call.name.clone());
                let input = call.input.as_ref().map(struct_json).unwrap_or(json!({}));
                let shown = match (call.name.as_str(), input.get("command")) {
                    ("bash", Some(Value::String(command))) => command.clone(),
                    _ => input.to_string(),
                };
                writeln!(out, "  -> {} [{}]: {shown}", call.name, call.id)?;
            }
        }
        if !m.model.is_empty() {
            match self.stood_in_for(&m.model) {
                Some(head) => writeln!(out, "  (reply by {}, a fallback of {head})", m.model)?,
                None => writeln!(out, "  (reply by {})", m.model)?,
            }
        }
        // The next call starts a new turn, at the head of the chain again.
        self.turn_models.clear();
        Ok(())
    }

    /// The model a reply by `reply_model` stood in for, if a fallback answered: the turn's
    /// head (the session's model, else the one its first retry names), unless the reply is
    /// that model's. Of the models this transcript knows, the one that answered is the one
    /// whose name fits the reply most closely (`gpt-4o-mini-…` is `openai:gpt-4o-mini`'s,
    /// not `openai:gpt-4o`'s). Unknown for a session on its runner's default model whose
    /// turn had no retry.
    fn stood_in_for(&self, reply_model: &str) -> Option<&str> {
        let head = self
            .model
            .as_deref()
            .or(self.turn_models.first().map(String::as_str))?;
        let known = std::iter::once(head)
            .chain(self.fallbacks.iter().map(String::as_str))
            .chain(self.turn_models.iter().map(String::as_str));
        let mut answered: Option<&str> = None;
        for spec in known.filter(|spec| answered_by(reply_model, spec)) {
            if answered.is_none_or(|a| model_name(spec).len() > model_name(a).len()) {
                answered = Some(spec);
            }
        }
        (answered != Some(head)).then_some(head)
    }
}

/// The model part of a `PROVIDER:MODEL` spec.
fn model_name(spec: &str) -> &str {
    spec.split_once(':').map_or(spec, |(_, name)| name)
}

/// Whether a reply naming `reply_model` came from `spec` (`PROVIDER:MODEL`, as a
/// configuration and a retry name models). A reply names the model as its provider reported
/// it: the name asked for, or a version of it (`claude-sonnet-4-5` answers as
/// `claude-sonnet-4-5-20250929`, `…-latest` as a dated name); a scripted model, by its
/// whole spec.
pub fn answered_by(reply_model: &str, spec: &str) -> bool {
    let name = model_name(spec);
    if reply_model == spec || reply_model == name {
        return true;
    }
    let base = name.strip_suffix("-latest").unwrap_or(name);
    let versioned = reply_model
        .strip_prefix(base)
        .is_some_and(|rest| rest.starts_with(['-', '@', ':']));
    versioned || reply_model.ends_with(&format!("/{name}"))
}

/// A retry in words: which model failed, why, the attempt, and when the next call is due.
pub fn retry_words(r: &agentlog_proto::v1::ModelRetry, session_id: &str) -> String {
    let why = match r.reason.as_str() {
        "circuit_open" => "is left alone for now (its circuit is open after failing in a row)",
        "overloaded" => "is overloaded",
        "rate_limited" => "is rate limited",
        "server_error" => "had a server error",
        "timeout" => "did not answer",
        "stalled" => "went silent in the middle of its reply",
        "cut" => "cut its reply short",
        "unreachable" => "could not be reached",
        other => other,
    };
    let attempt = if r.attempt > 0 {
        format!(" (attempt {})", r.attempt)
    } else {
        String::new()
    };
    let message = if r.message.is_empty() {
        String::new()
    } else {
        format!(": {}", r.message)
    };
    format!(
        "{} {why}{attempt}{message}; the next call is due {} (`agentlog cancel {session_id}` \
         stops waiting)",
        r.model,
        due_words(r.retry_at_unix_ms)
    )
}

/// A pause in words, and how to go on.
pub fn pause_words(p: &agentlog_proto::v1::RunPaused, session_id: &str) -> String {
    let why = match p.reason.as_str() {
        "budget" => "the run reached its budget",
        "gave_up" => "every model kept failing",
        other => other,
    };
    format!(
        "{why} ({}); the session waits for you: `agentlog resume {session_id} TEXT` goes on \
         with a fresh run",
        p.detail
    )
}

/// A budget in words.
pub fn budget_words(b: &agentlog_proto::v1::Budget) -> String {
    let part = |n: u64, what: &str| {
        if n == 0 {
            format!("the runner's {what}")
        } else {
            format!("{n} {what}")
        }
    };
    format!(
        "{}, {}, {}",
        part(b.max_model_calls, "model calls"),
        part(b.max_tokens, "tokens"),
        part(b.max_seconds, "seconds")
    )
}

/// When `at_unix_ms` is, from now: `now`, `in 40s (at 2025-06-01T14:05:03Z)`.
pub fn due_words(at_unix_ms: i64) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    due_words_at(at_unix_ms, now)
}

/// [`due_words`] as seen at `now_unix_ms`.
pub fn due_words_at(at_unix_ms: i64, now_unix_ms: i64) -> String {
    let left = at_unix_ms - now_unix_ms;
    if left <= 0 {
        return "now".into();
    }
    let left = std::time::Duration::from_secs((left as u64).div_ceil(1000));
    let clock = humantime::format_rfc3339_seconds(
        std::time::UNIX_EPOCH + std::time::Duration::from_millis(at_unix_ms as u64),
    );
    format!("in {} (at {clock})", humantime::format_duration(left))
}

/// A session's status as `ls` says it: the store's (`runnable`, `idle`, `waiting`), or in
/// its place `parked` (runnable, but no runner takes it up before its next model call is
/// due) or `paused` (waiting after a `run_paused`, given as `pause`, not for an approval);
/// with the words that say until when, or why and how to go on.
pub fn status_words(
    s: &SessionInfo,
    pause: Option<&RunPaused>,
    now_unix_ms: i64,
) -> (&'static str, Option<String>) {
    match s.status() {
        SessionStatus::Runnable if s.not_before_unix_ms > now_unix_ms => (
            "parked",
            Some(format!(
                "parked: the next model call is due {} (`agentlog cancel {}` stops waiting)",
                due_words_at(s.not_before_unix_ms, now_unix_ms),
                s.session_id
            )),
        ),
        SessionStatus::Runnable => ("runnable", None),
        SessionStatus::Idle => ("idle", None),
        SessionStatus::Waiting => match pause {
            Some(p) => (
                "paused",
                Some(format!("paused: {}", pause_words(p, &s.session_id))),
            ),
            None => ("waiting", None),
        },
        SessionStatus::Unspecified => ("?", None),
    }
}

/// The pause a waiting session waits on: its last event, unless streamed text, if it is a
/// `run_paused` (`events`: the end of its log, in seq order). `None` means it waits for an
/// approval.
pub fn pause_of(events: &[Event]) -> Option<&RunPaused> {
    match events
        .iter()
        .rev()
        .find(|e| !matches!(e.kind, Some(Kind::AssistantDelta(_))))?
        .kind
        .as_ref()?
    {
        Kind::RunPaused(p) => Some(p),
        _ => None,
    }
}

/// Whether this event ends a turn: the session is idle after it.
pub fn ends_turn(event: &Event) -> bool {
    match &event.kind {
        Some(Kind::AssistantMessage(m)) => !m
            .content
            .iter()
            .any(|b| matches!(b.block, Some(Block::ToolUse(_)))),
        Some(Kind::RunError(_)) | Some(Kind::Interrupted(_)) => true,
        _ => false,
    }
}

/// The name of an event's kind as its field in the `Event.kind` oneof (`user_message`, …);
/// `None` for a kind newer than this program.
pub fn kind_name(event: &Event) -> Option<&'static str> {
    Some(match event.kind.as_ref()? {
        Kind::UserMessage(_) => "user_message",
        Kind::AssistantMessage(_) => "assistant_message",
        Kind::ToolStarted(_) => "tool_started",
        Kind::ToolResult(_) => "tool_result",
        Kind::AssistantDelta(_) => "assistant_delta",
        Kind::RunError(_) => "run_error",
        Kind::Interrupt(_) => "interrupt",
        Kind::Interrupted(_) => "interrupted",
        Kind::ApprovalRequested(_) => "approval_requested",
        Kind::ApprovalDecision(_) => "approval_decision",
        Kind::SessionConfig(_) => "session_config",
        Kind::ModelRetry(_) => "model_retry",
        Kind::RunPaused(_) => "run_paused",
    })
}

/// A session's summary in the proto3 JSON mapping, as `ls --json` and the web view give it.
pub fn session_json(s: &SessionInfo) -> Value {
    let lease = s.lease.as_ref().map(|l| {
        json!({"owner": l.owner, "epoch": l.epoch.to_string(),
            "expiresUnixMs": l.expires_unix_ms.to_string()})
    });
    json!({
        "sessionId": s.session_id,
        "lastSeq": s.last_seq.to_string(),
        "createdUnixMs": s.created_unix_ms.to_string(),
        "updatedUnixMs": s.updated_unix_ms.to_string(),
        "status": s.status().as_str_name(),
        "lease": lease,
        "title": s.title,
        "forkedFrom": s.forked_from.as_ref().map(|f| json!({
            "sessionId": f.session_id, "seq": f.seq.to_string()
        })),
        "pinned": s.pinned,
        "notBeforeUnixMs": s.not_before_unix_ms.to_string(),
    })
}

/// A search hit in the proto3 JSON mapping (as grpcurl prints `SearchHit`).
pub fn hit_json(hit: &agentlog_proto::v1::SearchHit) -> Value {
    json!({
        "sessionId": hit.session_id,
        "seq": hit.seq.to_string(),
        "kind": hit.kind,
        "snippet": hit.snippet,
        "tsUnixMs": hit.ts_unix_ms.to_string(),
    })
}

/// An event in the proto3 JSON mapping (lowerCamelCase names, 64-bit integers as strings,
/// default values left out), as grpcurl prints it: the protocol's own mapping
/// (`agentlog_proto::json`), which the export format writes too.
pub fn event_json(event: &Event) -> Value {
    serde_json::from_str(&agentlog_proto::json::event_to_string(event))
        .expect("the protocol's JSON mapping writes JSON")
}

/// A `google.protobuf.Struct` as the JSON object it stands for.
pub fn struct_json(s: &prost_types::Struct) -> Value {
    Value::Object(struct_to_object(Some(s)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use agentlog_proto::v1::{
        AssistantDelta, ContentBlock, ModelRetry, SessionConfig, TextBlock, UserMessage,
    };

    fn ev(seq: u64, kind: Kind) -> Event {
        Event {
            session_id: "s1".into(),
            seq,
            kind: Some(kind),
            ..Event::default()
        }
    }

    fn reply(text: &str) -> Kind {
        Kind::AssistantMessage(AssistantMessage {
            content: vec![ContentBlock {
                block: Some(Block::Text(TextBlock { text: text.into() })),
            }],
            stop_reason: "end_turn".into(),
            ..AssistantMessage::default()
        })
    }

    fn reply_by(model: &str, text: &str) -> Kind {
        let Kind::AssistantMessage(mut m) = reply(text) else {
            unreachable!("reply makes an assistant_message")
        };
        m.model = model.into();
        Kind::AssistantMessage(m)
    }

    fn retry(model: &str, attempt: u32) -> Kind {
        Kind::ModelRetry(ModelRetry {
            turn: 0,
            attempt,
            model: model.into(),
            reason: "overloaded".into(),
            message: "HTTP 529".into(),
            retry_at_unix_ms: 0,
        })
    }

    fn user(text: &str) -> Kind {
        Kind::UserMessage(UserMessage { text: text.into() })
    }

    fn delta(turn: &str, text: &str) -> Kind {
        Kind::AssistantDelta(AssistantDelta {
            turn_id: turn.into(),
            text: text.into(),
        })
    }

    fn render(events: &[Event]) -> String {
        let mut out = Vec::new();
        let mut t = Transcript::new();
        for e in events {
            t.event(e, &mut out).expect("write to a Vec");
        }
        t.end_stream(&mut out).expect("write to a Vec");
        String::from_utf8(out).expect("utf-8")
    }

    #[test]
    fn streamed_text_is_not_printed_again_with_the_reply() {
        let out = render(&[
            ev(1, Kind::UserMessage(UserMessage { text: "hi".into() })),
            ev(2, delta("0.1.1", "Hel")),
            ev(3, delta("0.1.1", "lo")),
            ev(4, reply("Hello")),
        ]);
        assert_eq!(out, "you> hi\nagent> Hello\n");
    }

    #[test]
    fn a_restarted_stream_is_marked_and_the_reply_shown_whole() {
        let out = render(&[
            ev(1, delta("0.1.1", "Hel")),
            ev(2, delta("0.2.1", "Hello")),
            ev(3, reply("Hello")),
        ]);
        assert_eq!(
            out,
            "agent> Hel\n(the reply was interrupted; it is streaming again)\nagent> Hello\n"
        );
    }

    #[test]
    fn a_reply_by_a_fallback_names_the_model_it_stood_in_for() {
        let config = Kind::SessionConfig(SessionConfig {
            model: "anthropic:big".into(),
            fallback_models: vec!["openai:small".into()],
            ..SessionConfig::default()
        });
        // Replies name the model as the provider reports it: a dated version of the name.
        let out = render(&[
            ev(1, config),
            ev(2, user("hi")),
            ev(3, reply_by("big-20250929", "Hello")),
            ev(4, user("again")),
            ev(5, reply_by("small-2024-07-18", "Hello again")),
        ]);
        assert!(out.contains("  (reply by big-20250929)\n"), "{out}");
        assert!(
            out.contains("  (reply by small-2024-07-18, a fallback of anthropic:big)\n"),
            "{out}"
        );
        assert!(
            out.contains("(when its model keeps failing, a turn falls back to openai:small)"),
            "{out}"
        );
    }

    #[test]
    fn the_closest_name_tells_which_model_answered() {
        let config = Kind::SessionConfig(SessionConfig {
            model: "openai:gpt-4o".into(),
            fallback_models: vec!["openai:gpt-4o-mini".into()],
            ..SessionConfig::default()
        });
        let out = render(&[
            ev(1, config),
            ev(2, user("hi")),
            ev(3, reply_by("gpt-4o-mini-2024-07-18", "Hello")),
            ev(4, user("again")),
            ev(5, reply_by("gpt-4o-2024-08-06", "Hello again")),
        ]);
        assert!(
            out.contains("  (reply by gpt-4o-mini-2024-07-18, a fallback of openai:gpt-4o)\n"),
            "{out}"
        );
        assert!(out.ends_with("  (reply by gpt-4o-2024-08-06)\n"), "{out}");
    }

    #[test]
    fn without_a_configured_model_the_turns_first_retry_names_the_one_stood_in_for() {
        let out = render(&[
            ev(1, user("hi")),
            ev(2, retry("anthropic:big", 1)),
            ev(3, retry("anthropic:big", 2)),
            ev(4, reply_by("small", "Hello")),
            ev(5, user("again")),
            // A turn with no retry: nothing says which model it was meant for.
            ev(6, reply_by("small", "Hello again")),
            ev(7, user("once more")),
            ev(8, retry("anthropic:big", 1)),
            ev(9, reply_by("big", "Hello once more")),
        ]);
        assert!(
            out.contains("  (reply by small, a fallback of anthropic:big)\n"),
            "{out}"
        );
        assert!(
            out.contains("agent> Hello again\n  (reply by small)\n"),
            "{out}"
        );
        assert!(
            out.ends_with("agent> Hello once more\n  (reply by big)\n"),
            "{out}"
        );
        assert!(
            out.contains(
                "  ! anthropic:big is overloaded (attempt 2): HTTP 529; the next call is due now"
            ),
            "{out}"
        );
    }

    #[test]
    fn a_reply_is_its_models_under_the_name_its_provider_gives() {
        for (reply, spec) in [
            ("claude-sonnet-4-5-20250929", "anthropic:claude-sonnet-4-5"),
            (
                "claude-3-5-sonnet-20241022",
                "anthropic:claude-3-5-sonnet-latest",
            ),
            ("gpt-4o-2024-08-06", "openai:gpt-4o"),
            ("llama3", "openai:llama3"),
            ("/models/llama3", "openai:llama3"),
            ("scripted:/tmp/demo.jsonl", "scripted:/tmp/demo.jsonl"),
        ] {
            assert!(answered_by(reply, spec), "{reply} is {spec}'s");
        }
        for (reply, spec) in [
            ("gpt-4o-mini-2024-07-18", "anthropic:claude-sonnet-4-5"),
            ("claude-haiku-4-5-20251001", "anthropic:claude-sonnet-4-5"),
            ("scripted:/tmp/b.jsonl", "scripted:/tmp/a.jsonl"),
        ] {
            assert!(!answered_by(reply, spec), "{reply} is not {spec}'s");
        }
    }

    fn info(status: SessionStatus, not_before_unix_ms: i64) -> SessionInfo {
        SessionInfo {
            session_id: "s1".into(),
            status: status as i32,
            not_before_unix_ms,
            ..SessionInfo::default()
        }
    }

    #[test]
    fn ls_says_parked_until_when_and_paused_why() {
        let now = 1_750_000_000_000;
        let due = now + 12 * 60_000 + 3_000;
        let (status, words) = status_words(&info(SessionStatus::Runnable, due), None, now);
        assert_eq!(status, "parked");
        assert_eq!(
            words.as_deref(),
            Some(
                "parked: the next model call is due in 12m 3s (at 2025-06-15T15:18:43Z) \
                 (`agentlog cancel s1` stops waiting)"
            )
        );
        // Due already: a runner may take it up now.
        assert_eq!(
            status_words(&info(SessionStatus::Runnable, now - 1), None, now),
            ("runnable", None)
        );

        let paused = ev(
            9,
            Kind::RunPaused(RunPaused {
                reason: "budget".into(),
                detail: "max_model_calls 4 reached (4 replies)".into(),
            }),
        );
        let pause = pause_of(std::slice::from_ref(&paused));
        let (status, words) = status_words(&info(SessionStatus::Waiting, 0), pause, now);
        assert_eq!(status, "paused");
        assert_eq!(
            words.as_deref(),
            Some(
                "paused: the run reached its budget (max_model_calls 4 reached (4 replies)); \
                 the session waits for you: `agentlog resume s1 TEXT` goes on with a fresh run"
            )
        );
        // A call that waits for an approval is waiting, not paused.
        let asked = ev(
            9,
            Kind::ApprovalRequested(agentlog_proto::v1::ApprovalRequested::default()),
        );
        let pause = pause_of(std::slice::from_ref(&asked));
        assert_eq!(pause, None);
        assert_eq!(
            status_words(&info(SessionStatus::Waiting, 0), pause, now),
            ("waiting", None)
        );
        // Streamed text after the pause does not hide it.
        let events = [paused, ev(10, delta("t", "x"))];
        assert!(pause_of(&events).is_some());
    }

    #[test]
    fn json_follows_the_proto3_mapping() {
        let value = event_json(&ev(7, Kind::UserMessage(UserMessage { text: "hi".into() })));
        assert_eq!(
            value,
            json!({"sessionId": "s1", "seq": "7", "userMessage": {"text": "hi"}})
        );
        assert!(ends_turn(&ev(8, reply("done"))));
    }
}
