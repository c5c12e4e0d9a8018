//! `agentlog compare A B` and the web view's compare page: two sessions side by side from
//! their fork point (a replay and its recording, two replays of one recording, or any
//! fork and its parent).
//!
//! Promise: one pure function of the two logs ([`compare`]) makes everything both show:
//! per turn (a turn starts at a user message) the models that replied, each call (tool,
//! input, and whether it was served from a recording, ran, was not run, or is still open)
//! paired with the other side's call at the same place, tokens in and out and the time the
//! turn took, and its final answer; where the two first differ (a call of another tool or
//! input, or a call only one side made); and the totals. Its JSON form is what
//! `agentlog --json compare` prints and `GET /v1/compare` answers.

use std::io::Write;

use agentlog_client::json::struct_to_object;
use agentlog_client::log::read_log;
use agentlog_client::refusal::is_session_not_found;
use agentlog_proto::v1::{
    content_block::Block, event::Kind, Event, GetSessionRequest, SessionInfo,
};
use anyhow::{bail, Context, Result};
use serde::Serialize;
use serde_json::Value;

use crate::commands::Output;
use crate::store;

/// How a call was answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum How {
    /// Its recorded result was served: the tool did not run.
    Served,
    Ran,
    /// Closed without running (denied, interrupted before it started, off a stopped replay).
    NotRun,
    /// No result yet.
    Open,
}

impl How {
    fn word(self) -> &'static str {
        match self {
            How::Served => "served",
            How::Ran => "ran",
            How::NotRun => "not run",
            How::Open => "open",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Call {
    pub tool: String,
    pub input: Value,
    pub how: How,
    pub is_error: bool,
}

impl Call {
    fn same_as(&self, other: &Call) -> bool {
        self.tool == other.tool && self.input == other.input
    }

    fn shown(&self) -> String {
        let input = match (self.tool.as_str(), self.input.get("command")) {
            ("bash", Some(Value::String(command))) => command.clone(),
            _ => self.input.to_string(),
        };
        format!("{} {}", self.tool, clip(&input, 60))
    }
}

/// One side of one turn.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Turn {
    pub models: Vec<String>,
    pub calls: Vec<Call>,
    pub tokens_in: u64,
    pub tokens_out: u64,
    /// From the turn's first event to its last.
    pub time_ms: i64,
    /// The text of its last reply.
    pub answer: String,
    /// The `run_error` that ended it, if one did.
    pub error: Option<String>,
}

/// Both sides of one turn, and each call paired with the other side's at its place.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct TurnPair {
    pub number: usize,
    /// The user message that began it (`None`: the fork point was inside a turn).
    pub user: Option<String>,
    pub a: Option<Turn>,
    pub b: Option<Turn>,
    pub calls: Vec<CallPair>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct CallPair {
    pub a: Option<Call>,
    pub b: Option<Call>,
    /// The same tool with the same input on both sides.
    pub same: bool,
}

/// Where the two sessions first differ.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Divergence {
    pub turn: usize,
    /// The call's place in its turn, from 1.
    pub call: usize,
    pub why: String,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Totals {
    pub models: Vec<String>,
    pub turns: usize,
    pub calls: usize,
    pub served: usize,
    pub ran: usize,
    pub tokens_in: u64,
    pub tokens_out: u64,
    pub time_ms: i64,
    /// The answer of the last turn.
    pub answer: String,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct Comparison {
    pub a: String,
    pub b: String,
    /// The last seq the two share (0: nothing).
    pub from_seq: u64,
    pub turns: Vec<TurnPair>,
    pub diverged: Option<Divergence>,
    pub totals_a: Totals,
    pub totals_b: Totals,
}

/// The last seq the sessions share: where one was forked from the other, or both from one.
pub fn fork_point(a: &SessionInfo, b: &SessionInfo) -> u64 {
    let from = |s: &SessionInfo| {
        s.forked_from
            .as_ref()
            .map(|f| (f.session_id.clone(), f.seq))
    };
    match (from(a), from(b)) {
        (_, Some((parent, seq))) if parent == a.session_id => seq,
        (Some((parent, seq)), _) if parent == b.session_id => seq,
        (Some((pa, sa)), Some((pb, sb))) if pa == pb => sa.min(sb),
        _ => 0,
    }
}

/// A session's events after `from_seq` as turns: (the user message that began each, the
/// turn).
fn turns(events: &[Event], from_seq: u64) -> Vec<(Option<String>, Turn)> {
    let mut turns: Vec<(Option<String>, Turn, i64, i64)> = Vec::new();
    let mut calls: Vec<(String, usize)> = Vec::new();
    for event in events.iter().filter(|e| e.seq > from_seq) {
        let kind = match &event.kind {
            Some(kind) => kind,
            None => continue,
        };
        if matches!(kind, Kind::AssistantDelta(_) | Kind::SessionConfig(_)) {
            continue;
        }
        if let Kind::UserMessage(user) = kind {
            turns.push((
                Some(user.text.clone()),
                Turn::default(),
                event.ts_unix_ms,
                event.ts_unix_ms,
            ));
            calls.clear();
            continue;
        }
        if turns.is_empty() {
            turns.push((None, Turn::default(), event.ts_unix_ms, event.ts_unix_ms));
        }
        let Some((_, turn, _, last)) = turns.last_mut() else {
            continue;
        };
        *last = event.ts_unix_ms;
        match kind {
            Kind::AssistantMessage(reply) => {
                if !reply.model.is_empty() && !turn.models.contains(&reply.model) {
                    turn.models.push(reply.model.clone());
                }
                if let Some(usage) = &reply.usage {
                    turn.tokens_in += usage.input_tokens;
                    turn.tokens_out += usage.output_tokens;
                }
                let text: Vec<&str> = reply
                    .content
                    .iter()
                    .filter_map(|b| match &b.block {
                        Some(Block::Text(t)) => Some(t.text.as_str()),
                        _ => None,
                    })
                    .collect();
                turn.answer = text.join("\n");
                for block in &reply.content {
                    if let Some(Block::ToolUse(call)) = &block.block {
                        calls.push((call.id.clone(), turn.calls.len()));
                        turn.calls.push(Call {
                            tool: call.name.clone(),
                            input: Value::Object(struct_to_object(call.input.as_ref())),
                            how: How::Open,
                            is_error: false,
                        });
                    }
                }
            }
            Kind::ToolStarted(started) => {
                if let Some((_, at)) = calls.iter().find(|(id, _)| *id == started.tool_use_id) {
                    turn.calls[*at].how = How::Ran;
                }
            }
            Kind::ToolResult(result) => {
                if let Some((_, at)) = calls.iter().find(|(id, _)| *id == result.tool_use_id) {
                    let call = &mut turn.calls[*at];
                    call.is_error = result.is_error;
                    call.how = match (&result.served_from, call.how) {
                        (Some(_), _) => How::Served,
                        (None, How::Ran) => How::Ran,
                        (None, _) => How::NotRun,
                    };
                }
            }
            Kind::RunError(error) => turn.error = Some(error.message.clone()),
            _ => {}
        }
    }
    turns
        .into_iter()
        .map(|(user, mut turn, first, last)| {
            turn.time_ms = (last - first).max(0);
            (user, turn)
        })
        .collect()
}

fn totals(turns: &[(Option<String>, Turn)]) -> Totals {
    let mut totals = Totals {
        turns: turns.len(),
        ..Totals::default()
    };
    for (_, turn) in turns {
        for model in &turn.models {
            if !totals.models.contains(model) {
                totals.models.push(model.clone());
            }
        }
        totals.calls += turn.calls.len();
        totals.served += turn.calls.iter().filter(|c| c.how == How::Served).count();
        totals.ran += turn.calls.iter().filter(|c| c.how == How::Ran).count();
        totals.tokens_in += turn.tokens_in;
        totals.tokens_out += turn.tokens_out;
        totals.time_ms += turn.time_ms;
    }
    totals.answer = turns
        .last()
        .map(|(_, t)| t.answer.clone())
        .unwrap_or_default();
    totals
}

/// `a` and `b` (their infos and whole logs) side by side from their fork point.
pub fn compare(a: &SessionInfo, a_log: &[Event], b: &SessionInfo, b_log: &[Event]) -> Comparison {
    let from_seq = fork_point(a, b);
    let (ta, tb) = (turns(a_log, from_seq), turns(b_log, from_seq));
    // A fork at a user message (a replay's default) shares it: its turn is the first here.
    let shared_user = a_log
        .iter()
        .find(|e| e.seq == from_seq)
        .and_then(|e| match &e.kind {
            Some(Kind::UserMessage(m)) => Some(m.text.clone()),
            _ => None,
        });
    let mut pairs = Vec::new();
    let mut diverged = None;
    for number in 0..ta.len().max(tb.len()) {
        let (ua, sa) = match ta.get(number) {
            Some((user, turn)) => (user.clone(), Some(turn.clone())),
            None => (None, None),
        };
        let (ub, sb) = match tb.get(number) {
            Some((user, turn)) => (user.clone(), Some(turn.clone())),
            None => (None, None),
        };
        let none = Vec::new();
        let ca = sa.as_ref().map_or(&none, |t| &t.calls);
        let cb = sb.as_ref().map_or(&none, |t| &t.calls);
        let mut calls = Vec::new();
        for i in 0..ca.len().max(cb.len()) {
            let (x, y) = (ca.get(i).cloned(), cb.get(i).cloned());
            let same = matches!((&x, &y), (Some(x), Some(y)) if x.same_as(y));
            if !same && diverged.is_none() {
                let said = |c: &Option<Call>| c.as_ref().map_or("nothing".to_string(), Call::shown);
                diverged = Some(Divergence {
                    turn: number + 1,
                    call: i + 1,
                    why: format!(
                        "{} called {}; {} called {}",
                        a.session_id,
                        said(&x),
                        b.session_id,
                        said(&y)
                    ),
                });
            }
            calls.push(CallPair { a: x, b: y, same });
        }
        let shared = if number == 0 {
            shared_user.clone()
        } else {
            None
        };
        pairs.push(TurnPair {
            number: number + 1,
            user: ua.or(ub).or(shared),
            a: sa,
            b: sb,
            calls,
        });
    }
    Comparison {
        a: a.session_id.clone(),
        b: b.session_id.clone(),
        from_seq,
        turns: pairs,
        diverged,
        totals_a: totals(&ta),
        totals_b: totals(&tb),
    }
}

fn clip(text: &str, chars: usize) -> String {
    let line = text.lines().next().unwrap_or("");
    if line.chars().count() <= chars && !text.contains('\n') {
        return line.to_string();
    }
    let mut clipped: String = line.chars().take(chars).collect();
    clipped.push('…');
    clipped
}

fn seconds(ms: i64) -> String {
    format!("{:.1} s", ms as f64 / 1000.0)
}

/// The comparison as text, for a terminal.
pub fn write_text(c: &Comparison, out: &mut impl Write) -> std::io::Result<()> {
    let models = |t: &Totals| {
        if t.models.is_empty() {
            "no reply".to_string()
        } else {
            t.models.join(", ")
        }
    };
    writeln!(out, "A {} ({})", c.a, models(&c.totals_a))?;
    writeln!(out, "B {} ({})", c.b, models(&c.totals_b))?;
    writeln!(out, "from seq {} on", c.from_seq)?;
    for pair in &c.turns {
        writeln!(out)?;
        match &pair.user {
            Some(user) => writeln!(out, "turn {}  you> {}", pair.number, clip(user, 70))?,
            None => writeln!(out, "turn {}", pair.number)?,
        }
        for (i, call) in pair.calls.iter().enumerate() {
            let side = |c: &Option<Call>| match c {
                Some(c) => format!("{} ({})", c.shown(), c.how.word()),
                None => "(none)".to_string(),
            };
            let mark = if call.same { ' ' } else { '≠' };
            writeln!(out, "  {mark} {:>2}  A {}", i + 1, side(&call.a))?;
            writeln!(out, "        B {}", side(&call.b))?;
        }
        for (name, turn) in [("A", &pair.a), ("B", &pair.b)] {
            match turn {
                Some(t) => {
                    writeln!(
                        out,
                        "  {name} {} · tokens {} in, {} out · {}",
                        if t.models.is_empty() {
                            "-".to_string()
                        } else {
                            t.models.join(", ")
                        },
                        t.tokens_in,
                        t.tokens_out,
                        seconds(t.time_ms)
                    )?;
                    if let Some(error) = &t.error {
                        writeln!(out, "    error: {}", clip(error, 100))?;
                    } else {
                        writeln!(out, "    answer: {}", clip(&t.answer, 100))?;
                    }
                }
                None => writeln!(out, "  {name} (no such turn)")?,
            }
        }
    }
    writeln!(out)?;
    match &c.diverged {
        Some(d) => writeln!(
            out,
            "diverged at turn {}, call {}: {}",
            d.turn, d.call, d.why
        )?,
        None => writeln!(out, "the same calls on both sides")?,
    }
    for (name, t) in [("A", &c.totals_a), ("B", &c.totals_b)] {
        writeln!(
            out,
            "{name}: {} turns, {} calls ({} served, {} ran), tokens {} in, {} out, {}",
            t.turns,
            t.calls,
            t.served,
            t.ran,
            t.tokens_in,
            t.tokens_out,
            seconds(t.time_ms)
        )?;
        writeln!(out, "   final answer: {}", clip(&t.answer, 100))?;
    }
    Ok(())
}

/// One row of `compare --batch`: a replay and its recording.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BatchRow {
    pub replay: String,
    pub recording: String,
    pub models: Vec<String>,
    pub diverged: Option<Divergence>,
    pub recording_totals: Totals,
    pub replay_totals: Totals,
}

impl BatchRow {
    /// The row of comparison `c` (A the recording, B the replay).
    pub fn of(c: &Comparison) -> BatchRow {
        BatchRow {
            replay: c.b.clone(),
            recording: c.a.clone(),
            models: c.totals_b.models.clone(),
            diverged: c.diverged.clone(),
            recording_totals: c.totals_a.clone(),
            replay_totals: c.totals_b.clone(),
        }
    }
}

/// The sums over a batch's rows.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
#[serde(rename_all = "camelCase")]
pub struct BatchTotals {
    pub pairs: usize,
    pub diverged: usize,
    pub served: usize,
    pub ran: usize,
    pub recording_tokens_in: u64,
    pub recording_tokens_out: u64,
    pub replay_tokens_in: u64,
    pub replay_tokens_out: u64,
    pub recording_time_ms: i64,
    pub replay_time_ms: i64,
}

pub fn batch_totals(rows: &[BatchRow]) -> BatchTotals {
    let mut t = BatchTotals {
        pairs: rows.len(),
        ..BatchTotals::default()
    };
    for row in rows {
        t.diverged += usize::from(row.diverged.is_some());
        t.served += row.replay_totals.served;
        t.ran += row.replay_totals.ran;
        t.recording_tokens_in += row.recording_totals.tokens_in;
        t.recording_tokens_out += row.recording_totals.tokens_out;
        t.replay_tokens_in += row.replay_totals.tokens_in;
        t.replay_tokens_out += row.replay_totals.tokens_out;
        t.recording_time_ms += row.recording_totals.time_ms;
        t.replay_time_ms += row.replay_totals.time_ms;
    }
    t
}

/// The batch as a table, for a terminal.
pub fn write_batch_text(rows: &[BatchRow], out: &mut impl Write) -> std::io::Result<()> {
    let width = rows
        .iter()
        .map(|r| r.replay.len())
        .max()
        .unwrap_or(6)
        .max(6);
    writeln!(
        out,
        "{:<width$}  {:<24}  {:>6}  {:>7}  {:>11}  {:>13}  {:>15}  DIVERGED",
        "REPLAY", "MODEL", "SERVED", "RAN", "CALLS A/B", "TOKENS A", "TOKENS B"
    )?;
    for row in rows {
        let (a, b) = (&row.recording_totals, &row.replay_totals);
        writeln!(
            out,
            "{:<width$}  {:<24}  {:>6}  {:>7}  {:>11}  {:>13}  {:>15}  {}",
            row.replay,
            clip(&row.models.join(","), 24),
            b.served,
            b.ran,
            format!("{}/{}", a.calls, b.calls),
            format!("{}/{}", a.tokens_in, a.tokens_out),
            format!("{}/{}", b.tokens_in, b.tokens_out),
            row.diverged.as_ref().map_or("-".to_string(), |d| format!(
                "turn {} call {}",
                d.turn, d.call
            )),
        )?;
    }
    let t = batch_totals(rows);
    writeln!(
        out,
        "{} pairs, {} diverged; replays: {} calls served, {} ran; tokens in/out: recordings {}/{}, replays {}/{}; time: recordings {}, replays {}",
        t.pairs,
        t.diverged,
        t.served,
        t.ran,
        t.recording_tokens_in,
        t.recording_tokens_out,
        t.replay_tokens_in,
        t.replay_tokens_out,
        seconds(t.recording_time_ms),
        seconds(t.replay_time_ms)
    )
}

/// A session's info and whole log, for a comparison.
pub async fn load(
    out: &Output,
    client: &mut store::Client,
    session: &str,
) -> Result<(SessionInfo, Vec<Event>)> {
    let info = client
        .get_session(GetSessionRequest {
            session_id: session.to_string(),
        })
        .await;
    let info = match info {
        Ok(info) => info.into_inner(),
        Err(status) if is_session_not_found(&status) => {
            bail!("there is no session {session:?}: `agentlog ls` lists them")
        }
        Err(status) => return Err(store::explain(&out.addr, "GetSession", status)),
    };
    let events = read_log(client, session)
        .await
        .map_err(|s| store::explain(&out.addr, "Subscribe", s))?;
    Ok((info, events))
}

/// `agentlog compare A B`.
pub async fn run(out: &Output, a: &str, b: &str) -> Result<()> {
    let mut client = store::connect(&out.addr).await?;
    let (a, a_log) = load(out, &mut client, a).await?;
    let (b, b_log) = load(out, &mut client, b).await?;
    let comparison = compare(&a, &a_log, &b, &b_log);
    let stdout = std::io::stdout();
    let mut stdout = stdout.lock();
    if out.json {
        writeln!(stdout, "{}", serde_json::to_string(&comparison)?)?;
    } else {
        write_text(&comparison, &mut stdout)?;
    }
    Ok(())
}

/// `agentlog compare --batch FILE|-`: each replay id (one a line; blank lines and `#`
/// comments skipped) compared with the session it was forked from.
pub async fn run_batch(out: &Output, source: &str) -> Result<()> {
    let text = if source == "-" {
        std::io::read_to_string(std::io::stdin())?
    } else {
        std::fs::read_to_string(source).with_context(|| format!("cannot read {source}"))?
    };
    let mut client = store::connect(&out.addr).await?;
    let mut rows = Vec::new();
    for (number, line) in text.lines().enumerate() {
        let id = line.trim();
        if id.is_empty() || id.starts_with('#') {
            continue;
        }
        let (replay, replay_log) = load(out, &mut client, id)
            .await
            .with_context(|| format!("{source}:{}", number + 1))?;
        let Some(parent) = replay.forked_from.clone() else {
            bail!(
                "{source}:{}: session {id} is not a replay (nor any fork): it has nothing to be \
                 compared with",
                number + 1
            );
        };
        let (recording, recording_log) = load(out, &mut client, &parent.session_id)
            .await
            .with_context(|| format!("{source}:{}: the recording of {id}", number + 1))?;
        rows.push(BatchRow::of(&compare(
            &recording,
            &recording_log,
            &replay,
            &replay_log,
        )));
    }
    if rows.is_empty() {
        bail!("{source} names no replay: give replay ids, one a line");
    }
    let stdout = std::io::stdout();
    let mut stdout = stdout.lock();
    if out.json {
        for row in &rows {
            writeln!(stdout, "{}", serde_json::to_string(row)?)?;
        }
        writeln!(
            stdout,
            "{}",
            serde_json::json!({ "totals": batch_totals(&rows) })
        )?;
    } else {
        write_batch_text(&rows, &mut stdout)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use agentlog_client::json::object_to_struct;
    use agentlog_proto::v1::{
        AssistantMessage, ContentBlock, ForkedFrom, ServedFrom, TextBlock, ToolResult, ToolStarted,
        ToolUseBlock, Usage, UserMessage,
    };
    use serde_json::json;

    use super::*;

    fn ev(seq: u64, kind: Kind) -> Event {
        Event {
            seq,
            ts_unix_ms: seq as i64 * 100,
            kind: Some(kind),
            ..Event::default()
        }
    }

    fn reply(model: &str, text: &str, call: Option<(&str, &str)>) -> Kind {
        let mut content = vec![ContentBlock {
            block: Some(Block::Text(TextBlock { text: text.into() })),
        }];
        if let Some((id, command)) = call {
            let Value::Object(input) = json!({"command": command}) else {
                unreachable!()
            };
            content.push(ContentBlock {
                block: Some(Block::ToolUse(ToolUseBlock {
                    id: id.into(),
                    name: "bash".into(),
                    input: Some(object_to_struct(input)),
                })),
            });
        }
        Kind::AssistantMessage(AssistantMessage {
            content,
            model: model.into(),
            usage: Some(Usage {
                input_tokens: 10,
                output_tokens: 5,
                ..Usage::default()
            }),
            ..AssistantMessage::default()
        })
    }

    fn result(id: &str, served: Option<u64>) -> Kind {
        Kind::ToolResult(ToolResult {
            tool_use_id: id.into(),
            served_from: served.map(|seq| ServedFrom {
                session_id: "a".into(),
                seq,
            }),
            ..ToolResult::default()
        })
    }

    fn user(text: &str) -> Kind {
        Kind::UserMessage(UserMessage { text: text.into() })
    }

    #[test]
    fn a_replay_and_its_recording_side_by_side() {
        let a_log = vec![
            ev(1, user("go")),
            ev(2, reply("m1", "", Some(("t1", "ls")))),
            ev(3, Kind::ToolStarted(ToolStarted::default())),
            ev(4, result("t1", None)),
            ev(5, reply("m1", "", Some(("t2", "cat x")))),
            ev(
                6,
                Kind::ToolStarted(ToolStarted {
                    tool_use_id: "t2".into(),
                    ..ToolStarted::default()
                }),
            ),
            ev(7, result("t2", None)),
            ev(8, reply("m1", "done A", None)),
        ];
        let b_log = vec![
            ev(1, user("go")),
            ev(2, reply("m2", "", Some(("u1", "ls")))),
            ev(3, result("u1", Some(4))),
            ev(4, reply("m2", "", Some(("u2", "pwd")))),
            ev(
                5,
                Kind::ToolStarted(ToolStarted {
                    tool_use_id: "u2".into(),
                    ..ToolStarted::default()
                }),
            ),
            ev(6, result("u2", None)),
            ev(7, reply("m2", "done B", None)),
        ];
        let a = SessionInfo {
            session_id: "a".into(),
            ..SessionInfo::default()
        };
        let b = SessionInfo {
            session_id: "b".into(),
            forked_from: Some(ForkedFrom {
                session_id: "a".into(),
                seq: 1,
            }),
            ..SessionInfo::default()
        };
        let c = compare(&a, &a_log, &b, &b_log);
        assert_eq!(c.from_seq, 1);
        assert_eq!(c.turns.len(), 1);
        assert_eq!(
            c.turns[0].user.as_deref(),
            Some("go"),
            "the shared first message"
        );
        let calls = &c.turns[0].calls;
        assert_eq!(calls.len(), 2);
        assert!(calls[0].same);
        assert_eq!(calls[0].b.as_ref().map(|c| c.how), Some(How::Served));
        assert_eq!(calls[1].b.as_ref().map(|c| c.how), Some(How::Ran));
        assert_eq!(calls[1].a.as_ref().map(|c| c.how), Some(How::Ran));
        let diverged = c.diverged.clone().expect("the second call differs");
        assert_eq!((diverged.turn, diverged.call), (1, 2));
        assert!(diverged.why.contains("bash cat x") && diverged.why.contains("bash pwd"));
        assert_eq!((c.totals_a.tokens_in, c.totals_b.tokens_out), (30, 15));
        assert_eq!((c.totals_b.served, c.totals_b.ran), (1, 1));
        assert_eq!(c.totals_b.answer, "done B");
        assert_eq!(c.totals_b.models, vec!["m2".to_string()]);
        assert_eq!(c.turns[0].a.as_ref().map(|t| t.time_ms), Some(600));
        let mut text = Vec::new();
        write_text(&c, &mut text).expect("to memory");
        let text = String::from_utf8(text).expect("utf-8");
        assert!(text.contains("diverged at turn 1, call 2"), "{text}");
        let row = BatchRow::of(&c);
        let totals = batch_totals(&[row.clone(), row]);
        assert_eq!((totals.pairs, totals.diverged, totals.served), (2, 2, 2));
    }
}
