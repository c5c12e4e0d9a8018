//! The session commands: `send`, `continue`, `resume`, `tail`, `ls`, `show`, `fork`.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use agentlog_client::log::read_log;
use agentlog_client::refusal::is_session_not_found;
use agentlog_client::retry::retry_transient;
use agentlog_proto::v1::{
    event::Kind, AppendRequest, Budget, Event, GetSessionRequest, ListSessionsRequest, RunPaused,
    SessionConfig, SessionInfo, SessionStatus, SubscribeRequest, UserMessage,
};
use anyhow::{anyhow, bail, Result};

use crate::follow::{follow, Flow};
use crate::render::{ends_turn, event_json, pause_of, session_json, status_words, Transcript};
use crate::store;

/// How long `send` waits, with no event, before it says that no runner seems to be working.
const NO_RUNNER_HINT_AFTER: Duration = Duration::from_secs(5);
/// How long an append keeps retrying a store that is unreachable (e.g. restarting).
const APPEND_PATIENCE: Duration = Duration::from_secs(15);
/// The events `ls` reads from the end of a waiting session's log to tell a pause from a
/// wait for an approval (the last one that is not streamed text decides).
const PAUSE_LOOK_BACK: u64 = 8;

/// Output settings shared by every command.
#[derive(Debug, Clone)]
pub struct Output {
    pub addr: String,
    pub json: bool,
}

/// `send`/`continue`/`resume`: appends a user turn and streams the session until it is idle.
pub async fn send(out: &Output, session: Option<String>, text: &str) -> Result<()> {
    send_on(out, session, Config::default(), text).await
}

/// What `send` sets of the session's configuration from its turn on.
#[derive(Debug, Default)]
pub struct Config {
    pub model: Option<String>,
    pub fallback_models: Vec<String>,
    pub budget: Option<Budget>,
}

impl Config {
    /// The `session_config` it makes, if it sets anything.
    fn event(self) -> Option<SessionConfig> {
        (self.model.is_some() || !self.fallback_models.is_empty() || self.budget.is_some()).then(
            || SessionConfig {
                model: self.model.unwrap_or_default(),
                fallback_models: self.fallback_models,
                budget: self.budget,
                ..SessionConfig::default()
            },
        )
    }

    /// Whether it sets a field new in release 0.2.0, which a store of 0.1.0 would drop.
    fn is_new(&self) -> bool {
        !self.fallback_models.is_empty() || self.budget.is_some()
    }
}

/// `calls=N,tokens=N,seconds=N` (any of them) as a budget.
pub fn parse_budget(text: &str) -> Result<Budget, String> {
    let mut budget = Budget::default();
    for part in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (name, value) = part
            .split_once('=')
            .ok_or_else(|| format!("{part:?} is not NAME=N (calls=, tokens= or seconds=)"))?;
        let value: u64 = value
            .trim()
            .parse()
            .map_err(|_| format!("{part:?}: {value:?} is not a whole number"))?;
        match name.trim() {
            "calls" => budget.max_model_calls = value,
            "tokens" => budget.max_tokens = value,
            "seconds" => budget.max_seconds = value,
            other => return Err(format!("{other:?} is not calls, tokens or seconds")),
        }
    }
    Ok(budget)
}

/// [`send`], with the session configured from this turn on (a `session_config` before the
/// user message, in the same append). A field new in this release is sent only to a store
/// that keeps it (its responses name its release, [`agentlog_proto::release::HEADER`]).
pub async fn send_on(
    out: &Output,
    session: Option<String>,
    config: Config,
    text: &str,
) -> Result<()> {
    let session = session.unwrap_or_else(new_session_id);
    let mut client = store::connect(&out.addr).await?;
    if config.is_new() {
        let release = store::release(&mut client, &session).await;
        if !release.keeps_unknown_fields() {
            anyhow::bail!(
                "the store at {} is release {release}, which would drop --fallback-model and \
                 --budget without a word; upgrade the stores first (deploy/README.md, \
                 \"Upgrades and rollbacks\"), then send again",
                out.addr
            );
        }
    }
    let user = Kind::UserMessage(UserMessage {
        text: text.to_string(),
    });
    let mut kinds = Vec::new();
    if let Some(config) = config.event() {
        kinds.push(Kind::SessionConfig(config));
    }
    kinds.push(user);
    let seq = append_client_events(&mut client, &session, "user", kinds)
        .await
        .map_err(|status| store::explain(&out.addr, "Append", status))?;
    if out.json {
        println!(
            "{}",
            serde_json::json!({"sessionId": session, "seq": seq.to_string()})
        );
    }
    if !out.json {
        eprintln!("session {session} (follow it with `agentlog tail {session}`)");
    }

    let seen_any = Arc::new(AtomicBool::new(false));
    let hint = tokio::spawn(no_runner_hint(
        client.clone(),
        session.clone(),
        seen_any.clone(),
    ));
    let mut transcript = Transcript::new();
    let stdout = std::io::stdout();
    let result = follow(&out.addr, &session, seq + 1, |event| {
        seen_any.store(true, Ordering::SeqCst);
        print_event(out, &mut transcript, &mut stdout.lock(), event)?;
        if let Some(Kind::ApprovalRequested(_)) = &event.kind {
            // The session waits for a person: nothing more comes until someone answers.
            if !out.json {
                eprintln!(
                    "agentlog: session {session} is waiting for approval; `agentlog approve {session}` \
                     or `agentlog deny {session} --note WHY` answers it, then `agentlog tail {session}` \
                     follows the rest"
                );
            }
            return Ok(Flow::Stop);
        }
        if let Some(Kind::RunPaused(_)) = &event.kind {
            // The run stopped itself and waits for a person; the transcript said why and how
            // to go on, and nothing more comes until someone does.
            return Ok(Flow::Stop);
        }
        Ok(if ends_turn(event) {
            Flow::Stop
        } else {
            Flow::Continue
        })
    })
    .await;
    hint.abort();
    result
}

/// [`append_client_event`] with a store error explained; under `--json` prints the answer
/// (`{"sessionId", "seq"}`). Returns the seq.
pub async fn append_and_answer(
    out: &Output,
    client: &mut store::Client,
    session: &str,
    id_prefix: &str,
    kind: Kind,
) -> Result<u64> {
    let seq = append_client_event(client, session, id_prefix, kind)
        .await
        .map_err(|status| store::explain(&out.addr, "Append", status))?;
    if out.json {
        println!(
            "{}",
            serde_json::json!({"sessionId": session, "seq": seq.to_string()})
        );
    }
    Ok(seq)
}

/// Appends one client event (`user_message`, `interrupt`, `approval_decision`) to
/// `session`, riding out a store that is briefly unreachable; returns its seq, or the
/// status the store refused it with. The event id is fixed before the first attempt, so a
/// retry after a lost acknowledgement writes nothing twice.
pub async fn append_client_event(
    client: &mut store::Client,
    session: &str,
    id_prefix: &str,
    kind: Kind,
) -> Result<u64, tonic::Status> {
    append_client_events(client, session, id_prefix, vec![kind]).await
}

/// [`append_client_event`] of several events, in one atomic append; returns the last seq.
pub async fn append_client_events(
    client: &mut store::Client,
    session: &str,
    id_prefix: &str,
    kinds: Vec<Kind>,
) -> Result<u64, tonic::Status> {
    let request = AppendRequest {
        session_id: session.to_string(),
        events: kinds
            .into_iter()
            .map(|kind| Event {
                event_id: format!("{id_prefix}:{}", uuid::Uuid::new_v4().simple()),
                kind: Some(kind),
                ..Event::default()
            })
            .collect(),
        ..AppendRequest::default()
    };
    retry_transient("Append", APPEND_PATIENCE, || {
        let mut client = client.clone();
        let request = request.clone();
        async move { client.append(request).await }
    })
    .await
    .map(|response| response.into_inner().last_seq)
}

/// Says so on stderr if nothing happens for a while and no runner holds the session.
async fn no_runner_hint(mut client: store::Client, session: String, seen_any: Arc<AtomicBool>) {
    tokio::time::sleep(NO_RUNNER_HINT_AFTER).await;
    if seen_any.load(Ordering::SeqCst) {
        return;
    }
    let info = client
        .get_session(GetSessionRequest {
            session_id: session,
        })
        .await;
    if matches!(info, Ok(info) if info.get_ref().lease.is_none()) {
        eprintln!(
            "agentlog: no runner has picked the session up yet; is `agentlog up` (or a runner) running against this store?"
        );
    }
}

/// `continue TEXT`: the most recently updated session.
pub async fn continue_latest(out: &Output, text: &str) -> Result<()> {
    let mut client = store::connect(&out.addr).await?;
    let page = client
        .list_sessions(ListSessionsRequest {
            page_size: 1,
            ..ListSessionsRequest::default()
        })
        .await
        .map_err(|s| store::explain(&out.addr, "ListSessions", s))?
        .into_inner();
    let Some(latest) = page.sessions.into_iter().next() else {
        bail!("there is no session to continue yet: start one with `agentlog send TEXT`");
    };
    send(out, Some(latest.session_id), text).await
}

/// `resume SESSION TEXT`: a session that must already exist.
pub async fn resume(out: &Output, session: String, text: &str) -> Result<()> {
    let mut client = store::connect(&out.addr).await?;
    match client
        .get_session(GetSessionRequest {
            session_id: session.clone(),
        })
        .await
    {
        Ok(_) => send(out, Some(session), text).await,
        Err(status) if is_session_not_found(&status) => Err(anyhow!(
            "there is no session {session:?}: `agentlog ls` lists them, `agentlog send TEXT` starts one"
        )),
        Err(status) => Err(store::explain(&out.addr, "GetSession", status)),
    }
}

/// `tail SESSION [--from N]`: follows forever (until Ctrl-C), reconnecting as needed.
pub async fn tail(out: &Output, session: &str, from: u64) -> Result<()> {
    // Fail fast on a store that is not there at all; later outages are ridden out.
    store::connect(&out.addr).await?;
    let mut transcript = Transcript::new();
    let stdout = std::io::stdout();
    follow(&out.addr, session, from, |event| {
        print_event(out, &mut transcript, &mut stdout.lock(), event)?;
        Ok(Flow::Continue)
    })
    .await
}

/// `show SESSION`: the whole transcript as it is now.
pub async fn show(out: &Output, session: &str) -> Result<()> {
    let mut client = store::connect(&out.addr).await?;
    let info = client
        .get_session(GetSessionRequest {
            session_id: session.to_string(),
        })
        .await;
    if let Err(status) = info {
        if is_session_not_found(&status) {
            bail!("there is no session {session:?}: `agentlog ls` lists them");
        }
        return Err(store::explain(&out.addr, "GetSession", status));
    }
    let events = read_log(&mut client, session)
        .await
        .map_err(|s| store::explain(&out.addr, "Subscribe", s))?;
    let stdout = std::io::stdout();
    let mut stdout = stdout.lock();
    if let (false, Ok(info)) = (out.json, &info) {
        if let Some(from) = &info.get_ref().forked_from {
            writeln!(stdout, "forked from {} at {}", from.session_id, from.seq)?;
        }
        if info.get_ref().pinned {
            writeln!(stdout, "pinned (retention never deletes it)")?;
        }
    }
    if out.json {
        for event in &events {
            writeln!(stdout, "{}", event_json(event))?;
        }
        return Ok(());
    }
    // The reply is the record: streamed text is shown only for a reply still being written.
    let last_record = events
        .iter()
        .rposition(|e| !matches!(e.kind, Some(Kind::AssistantDelta(_))));
    let mut transcript = Transcript::new();
    for (i, event) in events.iter().enumerate() {
        let superseded =
            matches!(event.kind, Some(Kind::AssistantDelta(_))) && Some(i) < last_record;
        if !superseded {
            transcript.event(event, &mut stdout)?;
        }
    }
    if last_record.map_or(!events.is_empty(), |i| i + 1 < events.len()) {
        transcript.end_stream(&mut stdout)?;
        writeln!(stdout, "(the reply is still being written)")?;
    }
    Ok(())
}

/// `fork SESSION [--at SEQ] [TEXT]`: prints the new session's id (the `ForkSession` answer,
/// `{"sessionId", "lastSeq"}`, under `--json`).
pub async fn fork(out: &Output, session: &str, at: Option<u64>, text: Option<&str>) -> Result<()> {
    let mut client = store::connect(&out.addr).await?;
    let (made, last_seq) = match crate::fork::fork(&mut client, session, at, text).await {
        Ok(made) => made,
        Err(crate::fork::ForkError::Store { what, status }) => {
            return Err(store::explain(&out.addr, what, status))
        }
        Err(e) => return Err(e.into()),
    };
    if out.json {
        println!(
            "{}",
            serde_json::json!({"sessionId": made, "lastSeq": last_seq.to_string()})
        );
    } else {
        println!("{made}");
    }
    Ok(())
}

/// Up to `limit` sessions matching `query` and `status`, most recently updated first, read
/// page after page.
pub async fn list_sessions(
    out: &Output,
    client: &mut store::Client,
    query: Option<&str>,
    status: Option<SessionStatus>,
    limit: usize,
) -> Result<Vec<SessionInfo>> {
    let mut sessions: Vec<SessionInfo> = Vec::new();
    let mut page_token = String::new();
    while sessions.len() < limit {
        let page = client
            .list_sessions(ListSessionsRequest {
                page_size: (limit - sessions.len()).min(1000) as u32,
                page_token: page_token.clone(),
                query: query.unwrap_or_default().to_string(),
                status: status.unwrap_or(SessionStatus::Unspecified) as i32,
            })
            .await
            .map_err(|s| store::explain(&out.addr, "ListSessions", s))?
            .into_inner();
        sessions.extend(page.sessions);
        if page.next_page_token.is_empty() {
            break;
        }
        page_token = page.next_page_token;
    }
    sessions.truncate(limit);
    Ok(sessions)
}

/// `ls`: sessions, most recently updated first; a parked session says when it is due, a
/// paused one why it stopped and how to go on (a second line under its row). `--json` is
/// each `SessionInfo` in the proto3 JSON mapping.
pub async fn ls(
    out: &Output,
    query: Option<String>,
    status: Option<SessionStatus>,
    limit: usize,
) -> Result<()> {
    let mut client = store::connect(&out.addr).await?;
    let sessions = list_sessions(out, &mut client, query.as_deref(), status, limit).await?;
    let stdout = std::io::stdout();
    let mut stdout = stdout.lock();
    if out.json {
        for s in &sessions {
            writeln!(stdout, "{}", session_json(s))?;
        }
        return Ok(());
    }
    if sessions.is_empty() {
        writeln!(
            stdout,
            "no sessions{}; start one with `agentlog send TEXT`",
            if query.is_some() || status.is_some() {
                " match"
            } else {
                " yet"
            }
        )?;
        return Ok(());
    }
    let width = sessions
        .iter()
        .map(|s| s.session_id.len())
        .max()
        .unwrap_or(7)
        .max(7);
    writeln!(
        stdout,
        "{:<width$}  {:<8}  {:>6}  {:<10}  {:<14}  TITLE",
        "SESSION", "STATUS", "EVENTS", "UPDATED", "RUNNER"
    )?;
    let now = now_ms();
    for s in &sessions {
        let pause = match s.status() {
            SessionStatus::Waiting => last_pause(&mut client, s).await,
            _ => None,
        };
        let (status, words) = status_words(s, pause.as_ref(), now);
        let runner = s.lease.as_ref().map_or("-", |l| l.owner.as_str());
        let title: String = s
            .title
            .lines()
            .next()
            .unwrap_or("")
            .chars()
            .take(60)
            .collect();
        writeln!(
            stdout,
            "{:<width$}  {:<8}  {:>6}  {:<10}  {:<14}  {title}",
            s.session_id,
            status,
            s.last_seq,
            ago(now - s.updated_unix_ms),
            runner
        )?;
        if let Some(words) = words {
            writeln!(stdout, "{:<width$}    {words}", "")?;
        }
    }
    Ok(())
}

/// The pause a waiting session waits on, read from the last few events of its log (`ls` has
/// only the session's summary, whose status is the same for a pause and for a call that
/// waits for an approval). A session that cannot be read now is shown as waiting.
async fn last_pause(client: &mut store::Client, s: &SessionInfo) -> Option<RunPaused> {
    let mut stream = client
        .subscribe(SubscribeRequest {
            session_id: s.session_id.clone(),
            from_seq: s.last_seq.saturating_sub(PAUSE_LOOK_BACK - 1).max(1),
            follow: false,
        })
        .await
        .ok()?
        .into_inner();
    let mut events = Vec::new();
    while let Ok(Some(event)) = stream.message().await {
        events.push(event);
    }
    pause_of(&events).cloned()
}

fn print_event(
    out: &Output,
    transcript: &mut Transcript,
    stdout: &mut impl Write,
    event: &Event,
) -> Result<()> {
    if out.json {
        writeln!(stdout, "{}", event_json(event))?;
        stdout.flush()?;
    } else {
        transcript.event(event, stdout)?;
    }
    Ok(())
}

/// A fresh session id: `s-` and 12 hex digits.
fn new_session_id() -> String {
    let id = uuid::Uuid::new_v4().simple().to_string();
    format!("s-{}", &id[..12])
}

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

pub fn ago(ms: i64) -> String {
    let s = (ms / 1000).max(0);
    match s {
        0..=59 => format!("{s}s ago"),
        60..=3599 => format!("{}m ago", s / 60),
        3600..=86_399 => format!("{}h ago", s / 3600),
        _ => format!("{}d ago", s / 86_400),
    }
}
