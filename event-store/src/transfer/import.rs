//! Import: text in the export format, read line by line as it arrives, each session
//! recreated exactly or refused, each answered with an [`ImportResult`] once it is done.
//!
//! Promises:
//! - **Exact**: a session absent here is staged event by event as the file gives it (its
//!   seqs, event ids, times, contents) and made visible whole, in one step, only after its
//!   `end` line checked out ([`crate::backend::Staging`]): the count, the last seq and the
//!   SHA-256 of its event lines as they arrived.
//! - **Idempotent**: a session here already is compared event for event with its log
//!   here, read as the file goes; the same events, or a log here that begins with them
//!   (it went on after the export), is `UNCHANGED` and nothing is written. Any difference
//!   refuses that session (`ALREADY_EXISTS`, naming it and the first seq that differs).
//! - **One session's fault is its own**: a line that does not parse, a seq that does not
//!   follow, an event of another session, a repeated event id, a missing `end` line or a
//!   checksum that does not match refuses that session, naming the line (numbered from 1,
//!   the header line included); what was staged of it is dropped, and the next session
//!   goes on. Only a first line that is no export header refuses the whole import.
//! - **Flat memory**: at most one line, and a batch of [`STAGE_EVENTS`] events (or
//!   [`STAGE_BYTES`]), are held at a time, whatever the file's size; a line over
//!   [`MAX_LINE_BYTES`] refuses its session.
//! - A `deleted` line deletes the id here (an id never seen here is deleted too, so that it
//!   stays dead); right after a session's events it is that session deleted while it was
//!   exported, and nothing of it is imported.

use std::collections::VecDeque;
use std::sync::Arc;

use agentlog_proto::kept::KeptEvent;
use agentlog_proto::reason::Reason;
use agentlog_proto::unknown;
use agentlog_proto::v1::{ImportOutcome, ImportResult, SessionInfo};
use futures::{Stream, StreamExt};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::export::hex;
use super::format::{parse_line, End, Line};
use crate::backend::{Backend, EventRun, FramedEvents, StageError, Staging};
use crate::error::StoreError;
use crate::session::is_valid_id;
use crate::wire::MAX_EVENT_BYTES;

/// Events staged in one step, at most.
pub const STAGE_EVENTS: usize = 1000;
/// Bytes of events staged in one step, at most (about).
pub const STAGE_BYTES: usize = 2 << 20;
/// The longest line read: the JSON of the largest event (1 MiB), every byte escaped.
pub const MAX_LINE_BYTES: usize = 8 << 20;

/// Imports the text `pieces` (the concatenation of them is the export), sending a result
/// per session to `results` as each is done. Returns when the text ends, or with the error
/// that refuses the whole import (a first line that is no header, a broken stream); a
/// closed `results` (the caller went away) stops it, dropping what was staged.
pub async fn import<S>(
    backend: Arc<dyn Backend>,
    mut pieces: S,
    results: mpsc::Sender<ImportResult>,
) -> Result<(), StoreError>
where
    S: Stream<Item = Result<String, StoreError>> + Unpin + Send,
{
    let mut importer = Importer {
        backend,
        results,
        line_no: 0,
        header_seen: false,
        current: None,
        skipping: false,
    };
    let mut pending: Vec<u8> = Vec::new();
    // The rest of a line over the limit is passed over up to its newline.
    let mut overlong = false;
    let outcome = async {
        while let Some(piece) = pieces.next().await {
            let piece = piece?;
            let mut rest = piece.as_bytes();
            while let Some(newline) = rest.iter().position(|b| *b == b'\n') {
                let (head, tail) = rest.split_at(newline);
                rest = &tail[1..];
                if overlong {
                    overlong = false;
                    continue;
                }
                if pending.is_empty() {
                    importer.line(head).await?;
                } else {
                    pending.extend_from_slice(head);
                    let line = std::mem::take(&mut pending);
                    importer.line(&line).await?;
                }
            }
            if !overlong {
                pending.extend_from_slice(rest);
                if pending.len() > MAX_LINE_BYTES {
                    pending = Vec::new();
                    overlong = true;
                    importer.overlong().await?;
                }
            }
        }
        if !pending.is_empty() && !overlong {
            let line = std::mem::take(&mut pending);
            importer.line(&line).await?;
        }
        importer.finish().await
    }
    .await;
    if let Some(open) = importer.current.take() {
        open.drop_staged().await;
    }
    match outcome {
        Err(Stop::Refused(e)) => Err(e),
        Err(Stop::CallerGone) | Ok(()) => Ok(()),
    }
}

enum Stop {
    /// The whole import is refused (or its stream broke).
    Refused(StoreError),
    /// Nobody reads the results any more.
    CallerGone,
}

impl From<StoreError> for Stop {
    fn from(e: StoreError) -> Stop {
        Stop::Refused(e)
    }
}

struct Importer {
    backend: Arc<dyn Backend>,
    results: mpsc::Sender<ImportResult>,
    line_no: u64,
    header_seen: bool,
    /// The session whose lines are being read.
    current: Option<Open>,
    /// Lines are passed over after a bad line outside any session, until the next session
    /// or deleted line (the session it belonged to cannot be told).
    skipping: bool,
}

/// A session being read.
struct Open {
    session_id: String,
    /// The number of its session line.
    line_no: u64,
    info: SessionInfo,
    next_seq: u64,
    sha: ring::digest::Context,
    mode: Mode,
}

enum Mode {
    /// Absent here: staged.
    Stage {
        staging: Box<dyn Staging>,
        batch: Vec<KeptEvent>,
        bytes: usize,
    },
    /// Here already: compared with its log here.
    Compare {
        runs: mpsc::Receiver<Result<EventRun, StoreError>>,
        /// The next events here, each in its canonical form (a field this build does not
        /// know included, wherever it was).
        ahead: VecDeque<Vec<u8>>,
        /// The first difference, if any.
        differs: Option<String>,
        _stop: tokio_util::sync::DropGuard,
    },
    /// Refused already: its lines are read to its end, and nothing more done.
    Refused(Refusal),
}

/// Why a session is refused.
struct Refusal {
    code: tonic::Code,
    reason: Option<Reason>,
    message: String,
    line: u64,
}

impl Refusal {
    fn at(line: u64, code: tonic::Code, message: String) -> Refusal {
        Refusal {
            code,
            reason: None,
            message: format!("line {line}: {message}"),
            line,
        }
    }

    fn of(error: StoreError, line: u64) -> Refusal {
        let message = if line > 0 {
            format!("line {line}: {error}")
        } else {
            error.to_string()
        };
        Refusal {
            code: error.code(),
            reason: error.reason(),
            message,
            line,
        }
    }
}

impl Open {
    async fn drop_staged(self) {
        if let Mode::Stage { staging, .. } = self.mode {
            staging.abandon().await;
        }
    }
}

impl Importer {
    async fn send(&self, result: ImportResult) -> Result<(), Stop> {
        self.results
            .send(result)
            .await
            .map_err(|_| Stop::CallerGone)
    }

    async fn refused(&self, session_id: &str, events: u64, refusal: Refusal) -> Result<(), Stop> {
        crate::metrics::sessions_imported("refused", 1);
        self.send(ImportResult {
            session_id: session_id.to_string(),
            outcome: ImportOutcome::Refused as i32,
            events,
            code: refusal.code as i32,
            reason: refusal
                .reason
                .map(|r| r.name().to_string())
                .unwrap_or_default(),
            message: refusal.message,
            line: refusal.line,
        })
        .await
    }

    async fn done(
        &self,
        session_id: &str,
        outcome: ImportOutcome,
        events: u64,
    ) -> Result<(), Stop> {
        let what = match outcome {
            ImportOutcome::Imported => "imported",
            ImportOutcome::Unchanged => "unchanged",
            ImportOutcome::Deleted => "deleted",
            _ => "refused",
        };
        crate::metrics::sessions_imported(what, 1);
        self.send(ImportResult {
            session_id: session_id.to_string(),
            outcome: outcome as i32,
            events,
            ..ImportResult::default()
        })
        .await
    }

    /// A line over [`MAX_LINE_BYTES`] (its number is the next one).
    async fn overlong(&mut self) -> Result<(), Stop> {
        self.line_no += 1;
        let refusal = Refusal::at(
            self.line_no,
            tonic::Code::ResourceExhausted,
            format!("the line is over {} MiB", MAX_LINE_BYTES >> 20),
        );
        self.bad_line(refusal).await
    }

    /// A line that cannot be taken: its session is refused, or (outside any) it is
    /// reported and the lines up to the next session are passed over.
    async fn bad_line(&mut self, refusal: Refusal) -> Result<(), Stop> {
        if !self.header_seen {
            return Err(Stop::Refused(StoreError::InvalidArgument(format!(
                "{}; an export starts with the line {{\"format\":\"agentlog-export\",\"version\":1}}",
                refusal.message
            ))));
        }
        match &mut self.current {
            Some(open) => {
                if !matches!(open.mode, Mode::Refused(_)) {
                    let mode = std::mem::replace(&mut open.mode, Mode::Refused(refusal));
                    if let Mode::Stage { staging, .. } = mode {
                        staging.abandon().await;
                    }
                }
                Ok(())
            }
            None if self.skipping => Ok(()),
            None => {
                self.skipping = true;
                self.refused("", 0, refusal).await
            }
        }
    }

    async fn line(&mut self, raw: &[u8]) -> Result<(), Stop> {
        self.line_no += 1;
        let line_no = self.line_no;
        let text = match std::str::from_utf8(raw) {
            Ok(text) => text.strip_suffix('\r').unwrap_or(text),
            Err(_) => {
                let refusal =
                    Refusal::at(line_no, tonic::Code::InvalidArgument, "not UTF-8".into());
                return self.bad_line(refusal).await;
            }
        };
        if text.trim().is_empty() && self.header_seen && self.current.is_none() {
            return Ok(());
        }
        let parsed = match parse_line(text) {
            Ok(parsed) => parsed,
            Err(e) => {
                let refusal = Refusal::at(line_no, tonic::Code::InvalidArgument, e);
                return self.bad_line(refusal).await;
            }
        };
        if !self.header_seen {
            return match parsed {
                Line::Header { .. } => {
                    self.header_seen = true;
                    Ok(())
                }
                _ => {
                    let refusal = Refusal::at(
                        line_no,
                        tonic::Code::InvalidArgument,
                        "not an agentlog export header".into(),
                    );
                    self.bad_line(refusal).await
                }
            };
        }
        match parsed {
            Line::Header { .. } => {
                let refusal = Refusal::at(
                    line_no,
                    tonic::Code::InvalidArgument,
                    "a second header line".into(),
                );
                self.bad_line(refusal).await
            }
            Line::Session(info) => {
                self.skipping = false;
                self.close_unended(line_no).await?;
                self.open(info, line_no).await
            }
            Line::Deleted {
                session_id,
                deleted_unix_ms,
            } => {
                self.skipping = false;
                if let Some(open) = self.current.take() {
                    if open.session_id == session_id {
                        // Deleted while it was exported: nothing of it is imported.
                        open.drop_staged().await;
                    } else {
                        self.current = Some(open);
                        self.close_unended(line_no).await?;
                    }
                }
                self.deleted(&session_id, deleted_unix_ms, line_no).await
            }
            Line::Event(event) => self.event(*event, raw, line_no).await,
            Line::End(end) => self.end(end, line_no).await,
        }
    }

    /// The open session, refused for having no end line (`line_no`: the line that came
    /// instead).
    async fn close_unended(&mut self, line_no: u64) -> Result<(), Stop> {
        let Some(open) = self.current.take() else {
            return Ok(());
        };
        let events = open.next_seq - 1;
        let session_id = open.session_id.clone();
        let refusal = match &open.mode {
            Mode::Refused(_) => None,
            _ => Some(Refusal::at(
                line_no,
                tonic::Code::InvalidArgument,
                format!("session {session_id} has no end line (this line came before it)"),
            )),
        };
        let refusal = match (refusal, open.mode) {
            (Some(refusal), Mode::Stage { staging, .. }) => {
                staging.abandon().await;
                refusal
            }
            (Some(refusal), _) => refusal,
            (None, Mode::Refused(refusal)) => refusal,
            (None, _) => unreachable!("only a refused session has no refusal of its own here"),
        };
        self.refused(&session_id, events, refusal).await
    }

    async fn open(&mut self, info: SessionInfo, line_no: u64) -> Result<(), Stop> {
        let session_id = info.session_id.clone();
        let mode = if !is_valid_id(&session_id) {
            Mode::Refused(Refusal::at(
                line_no,
                tonic::Code::InvalidArgument,
                format!(
                    "sessionId {session_id:?} is not valid; use 1-128 characters of \
                     [A-Za-z0-9._:-] starting with a letter or digit"
                ),
            ))
        } else {
            match self.backend.get_session(&session_id).await {
                Ok(_) => {
                    let cancel = CancellationToken::new();
                    let runs = self
                        .backend
                        .subscribe(session_id.clone(), 1, false, cancel.clone());
                    Mode::Compare {
                        runs,
                        ahead: VecDeque::new(),
                        differs: None,
                        _stop: cancel.drop_guard(),
                    }
                }
                Err(e) if e.reason() == Some(Reason::SessionNotFound) => {
                    match self.backend.begin_import(&session_id).await {
                        Ok(staging) => Mode::Stage {
                            staging,
                            batch: Vec::new(),
                            bytes: 0,
                        },
                        Err(e) => Mode::Refused(Refusal::of(e, line_no)),
                    }
                }
                Err(e) if e.reason() == Some(Reason::SessionDeleted) => {
                    Mode::Refused(Refusal::of(e, line_no))
                }
                Err(e) => return Err(Stop::Refused(e)),
            }
        };
        self.current = Some(Open {
            session_id,
            line_no,
            info,
            next_seq: 1,
            sha: ring::digest::Context::new(&ring::digest::SHA256),
            mode,
        });
        Ok(())
    }

    async fn event(&mut self, mut event: KeptEvent, raw: &[u8], line_no: u64) -> Result<(), Stop> {
        let Some(open) = self.current.as_mut() else {
            let refusal = Refusal::at(
                line_no,
                tonic::Code::InvalidArgument,
                "an event outside any session (no session line before it)".into(),
            );
            return self.bad_line(refusal).await;
        };
        if matches!(open.mode, Mode::Refused(_)) {
            return Ok(());
        }
        let problem = if !event.session_id.is_empty() && event.session_id != open.session_id {
            Some((
                tonic::Code::InvalidArgument,
                format!(
                    "the event names session {:?}, not {}",
                    event.session_id, open.session_id
                ),
            ))
        } else if event.seq != open.next_seq {
            Some((
                tonic::Code::InvalidArgument,
                format!(
                    "seq {} where {} was next (a seq gap)",
                    event.seq, open.next_seq
                ),
            ))
        } else if event.event_id.is_empty() {
            Some((
                tonic::Code::InvalidArgument,
                "the event has no eventId".into(),
            ))
        } else if event.encoded_len() > MAX_EVENT_BYTES {
            Some((
                tonic::Code::ResourceExhausted,
                format!("the event is over the limit of {MAX_EVENT_BYTES} bytes (1 MiB)"),
            ))
        } else {
            None
        };
        if let Some((code, message)) = problem {
            return self.bad_line(Refusal::at(line_no, code, message)).await;
        }
        event.set_session_id(&open.session_id);
        open.sha.update(raw);
        open.sha.update(b"\n");
        open.next_seq += 1;
        let session_line = open.line_no;
        let failed = match &mut open.mode {
            Mode::Stage {
                staging,
                batch,
                bytes,
            } => {
                *bytes += raw.len();
                batch.push(event);
                if batch.len() >= STAGE_EVENTS || *bytes >= STAGE_BYTES {
                    *bytes = 0;
                    let events = std::mem::take(batch);
                    staged(staging.stage(events).await, session_line)
                } else {
                    None
                }
            }
            Mode::Compare {
                runs,
                ahead,
                differs,
                ..
            } => {
                if differs.is_none() {
                    match next_here(runs, ahead).await {
                        Ok(Some(here)) if here == event.encode_to_vec() => {}
                        Ok(Some(_)) => {
                            *differs = Some(format!("its event of seq {} differs", event.seq))
                        }
                        Ok(None) => {
                            *differs = Some(format!(
                                "this store holds only {} of its events",
                                event.seq - 1
                            ))
                        }
                        Err(e) => return Err(Stop::Refused(e)),
                    }
                }
                None
            }
            Mode::Refused(_) => None,
        };
        match failed {
            Some(refusal) => self.bad_line(refusal).await,
            None => Ok(()),
        }
    }

    async fn end(&mut self, end: End, line_no: u64) -> Result<(), Stop> {
        let Some(open) = self.current.take() else {
            let refusal = Refusal::at(
                line_no,
                tonic::Code::InvalidArgument,
                format!("an end line of {} outside any session", end.session_id),
            );
            return self.bad_line(refusal).await;
        };
        let Open {
            session_id,
            line_no: session_line,
            info,
            next_seq,
            sha,
            mode,
        } = open;
        let events = next_seq - 1;
        let sha256 = hex(sha.finish().as_ref());
        let problem = if end.session_id != session_id {
            Some(format!(
                "the end line names session {:?}, not {session_id}",
                end.session_id
            ))
        } else if end.events != events || end.last_seq != events {
            Some(format!(
                "the end line says {} events up to seq {}, but the session has {events}",
                end.events, end.last_seq
            ))
        } else if end.sha256 != sha256 {
            Some(format!(
                "the checksum does not match: the end line says sha256 {}, the event lines \
                 have {sha256}",
                end.sha256
            ))
        } else {
            None
        };
        let refusal = |message: String| Refusal::at(line_no, tonic::Code::InvalidArgument, message);
        match (problem, mode) {
            (_, Mode::Refused(refusal)) => self.refused(&session_id, events, refusal).await,
            (Some(problem), Mode::Stage { staging, .. }) => {
                staging.abandon().await;
                self.refused(&session_id, events, refusal(problem)).await
            }
            (Some(problem), Mode::Compare { .. }) => {
                self.refused(&session_id, events, refusal(problem)).await
            }
            (
                None,
                Mode::Stage {
                    mut staging, batch, ..
                },
            ) => {
                if !batch.is_empty() {
                    if let Some(refusal) = staged(staging.stage(batch).await, session_line) {
                        staging.abandon().await;
                        return self.refused(&session_id, events, refusal).await;
                    }
                }
                match staging.commit(info).await {
                    Ok(()) => {
                        self.done(&session_id, ImportOutcome::Imported, events)
                            .await
                    }
                    Err(e) => {
                        let line = if e.code() == tonic::Code::InvalidArgument {
                            session_line
                        } else {
                            0
                        };
                        self.refused(&session_id, events, Refusal::of(e, line))
                            .await
                    }
                }
            }
            (None, Mode::Compare { differs, .. }) => match differs {
                None => {
                    self.done(&session_id, ImportOutcome::Unchanged, events)
                        .await
                }
                Some(detail) => {
                    let e = crate::rules::imported_differs(&session_id, &detail);
                    self.refused(&session_id, events, Refusal::of(e, 0)).await
                }
            },
        }
    }

    async fn deleted(
        &mut self,
        session_id: &str,
        deleted_unix_ms: i64,
        line_no: u64,
    ) -> Result<(), Stop> {
        if !is_valid_id(session_id) {
            let refusal = Refusal::at(
                line_no,
                tonic::Code::InvalidArgument,
                format!("sessionId {session_id:?} is not valid"),
            );
            return self.refused(session_id, 0, refusal).await;
        }
        let when = if deleted_unix_ms > 0 {
            deleted_unix_ms
        } else {
            crate::clock::now_unix_ms()
        };
        match self.backend.import_deletion(session_id, when).await {
            Ok(true) => self.done(session_id, ImportOutcome::Deleted, 0).await,
            Ok(false) => self.done(session_id, ImportOutcome::Unchanged, 0).await,
            Err(e) => self.refused(session_id, 0, Refusal::of(e, line_no)).await,
        }
    }

    async fn finish(&mut self) -> Result<(), Stop> {
        if !self.header_seen {
            return Err(Stop::Refused(StoreError::InvalidArgument(
                "the import is empty: an export starts with the line \
                 {\"format\":\"agentlog-export\",\"version\":1}"
                    .into(),
            )));
        }
        let Some(open) = self.current.take() else {
            return Ok(());
        };
        let events = open.next_seq - 1;
        let session_id = open.session_id.clone();
        let refusal = match open.mode {
            Mode::Refused(refusal) => refusal,
            Mode::Stage { staging, .. } => {
                staging.abandon().await;
                Refusal::at(
                    self.line_no,
                    tonic::Code::InvalidArgument,
                    format!("the export ends before the end line of session {session_id}"),
                )
            }
            Mode::Compare { .. } => Refusal::at(
                self.line_no,
                tonic::Code::InvalidArgument,
                format!("the export ends before the end line of session {session_id}"),
            ),
        };
        self.refused(&session_id, events, refusal).await
    }
}

/// A staging step's failure as the session's refusal, naming the line of the event at
/// fault (`session_line` + its seq).
fn staged(result: Result<(), StageError>, session_line: u64) -> Option<Refusal> {
    match result {
        Ok(()) => None,
        Err(StageError::Repeated {
            seq,
            earlier,
            event_id,
        }) => Some(Refusal::at(
            session_line + seq,
            tonic::Code::InvalidArgument,
            format!(
                "the event of seq {seq} repeats the eventId {event_id:?} of seq {earlier} \
                 (line {})",
                session_line + earlier
            ),
        )),
        Err(StageError::Store(e)) => Some(Refusal::of(e, 0)),
    }
}

/// The next event of the session's log here, if it has one, in its canonical form
/// ([`unknown::canonical_event`]), as an imported event is made.
async fn next_here(
    runs: &mut mpsc::Receiver<Result<EventRun, StoreError>>,
    ahead: &mut VecDeque<Vec<u8>>,
) -> Result<Option<Vec<u8>>, StoreError> {
    loop {
        if let Some(event) = ahead.pop_front() {
            return Ok(Some(event));
        }
        let framed = match runs.recv().await {
            None => return Ok(None),
            Some(run) => match run? {
                EventRun::Decoded(events) => FramedEvents::encode(&events),
                EventRun::Framed(framed) => framed,
            },
        };
        for message in framed.messages() {
            let canonical = unknown::canonical_event(&message?)
                .map_err(|e| StoreError::Internal(format!("a stored event: {e}")))?;
            ahead.push_back(canonical);
        }
    }
}
