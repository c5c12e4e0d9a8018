//! Export: sessions read through the storage contract and written in the export format,
//! a piece at a time, while the store goes on serving.
//!
//! Promises:
//! - **Each session is a consistent copy.** Its session line is its `SessionInfo` at one
//!   moment, and its events are exactly seqs `1..=lastSeq` of that moment (events appended
//!   later are left to the next export): the line agrees with its events, so an import
//!   recreates the session as it was then. A session deleted while it is read gets a
//!   `deleted` line after the events read so far, and no end line.
//! - **`--all` visits every session once**: the walk is in id order
//!   ([`crate::backend::Backend::session_ids`]), so sessions made, changed or deleted
//!   meanwhile never make it miss or repeat one; deleted ids are `deleted` lines.
//! - **Flat memory**: events are read in the backend's runs and written out in pieces of
//!   about [`PIECE_BYTES`]; nothing holds a session whole.

use std::sync::Arc;

use agentlog_proto::json::write_event_keeping;
use agentlog_proto::reason::Reason;
use agentlog_proto::unknown::{self, Unknown};
use agentlog_proto::v1::{Event, SessionInfo};
use prost::Message;
use tokio_util::sync::CancellationToken;

use super::format::{deleted_line, end_line, header_line, session_line, End};
use crate::backend::{Backend, EventRun, FramedEvents};
use crate::error::StoreError;
use crate::scope::Scope;

/// The export is handed out in pieces of about this many bytes (whole lines). Small enough
/// that the allocator recycles a piece's buffer instead of asking the kernel for fresh
/// (zeroed) pages for each (measured: a fifth of the store's time with 256 KiB pieces).
pub const PIECE_BYTES: usize = 64 << 10;
/// A piece's buffer: the piece and the line that ends it, for most lines.
const PIECE_CAPACITY: usize = PIECE_BYTES + (16 << 10);
/// Ids read per step of the walk of `--all`.
const WALK: usize = 256;

/// Where an export's pieces go (the gRPC stream, an archive file).
#[tonic::async_trait]
pub trait Out: Send {
    /// Takes the next piece: whole lines, each with its newline.
    async fn write(&mut self, piece: String) -> Result<(), StoreError>;
}

/// What to export.
pub enum Which {
    /// These sessions, in this order.
    Named(Vec<String>),
    /// Every session and deleted id in the scope, in id order.
    All(Scope),
}

/// Writes the export of `which` to `out`: the header, then each session (or deleted id).
pub async fn export(
    backend: &Arc<dyn Backend>,
    which: Which,
    out: &mut dyn Out,
) -> Result<(), StoreError> {
    let mut writer = Writer::new(out);
    writer
        .line(header_line(crate::clock::now_unix_ms()).as_bytes())
        .await?;
    match which {
        Which::Named(ids) => {
            for id in ids {
                writer.session(backend, &id).await?;
            }
        }
        Which::All(scope) => {
            let mut after = String::new();
            loop {
                let page = backend.session_ids(&after, WALK, &scope).await?;
                for listed in &page {
                    if listed.deleted_unix_ms > 0 {
                        let line = deleted_line(&listed.session_id, listed.deleted_unix_ms);
                        writer.line(line.as_bytes()).await?;
                    } else {
                        writer.session(backend, &listed.session_id).await?;
                    }
                }
                match page.last() {
                    Some(last) if page.len() == WALK => after.clone_from(&last.session_id),
                    _ => break,
                }
            }
        }
    }
    writer.flush().await
}

/// Lines gathered into pieces.
struct Writer<'a> {
    out: &'a mut dyn Out,
    buf: Vec<u8>,
}

impl<'a> Writer<'a> {
    fn new(out: &'a mut dyn Out) -> Writer<'a> {
        Writer {
            out,
            buf: Vec::with_capacity(PIECE_CAPACITY),
        }
    }

    async fn line(&mut self, line: &[u8]) -> Result<(), StoreError> {
        self.buf.extend_from_slice(line);
        self.flush_if_full().await
    }

    async fn flush_if_full(&mut self) -> Result<(), StoreError> {
        if self.buf.len() >= PIECE_BYTES {
            self.flush().await?;
        }
        Ok(())
    }

    async fn flush(&mut self) -> Result<(), StoreError> {
        if self.buf.is_empty() {
            return Ok(());
        }
        let bytes = std::mem::replace(&mut self.buf, Vec::with_capacity(PIECE_CAPACITY));
        let piece = String::from_utf8(bytes)
            .map_err(|_| StoreError::Internal("an export piece is not UTF-8".into()))?;
        self.out.write(piece).await
    }

    /// One session: its line, its events `1..=last_seq` of the moment its line was read,
    /// and its end line (a `deleted` line instead if it is deleted, before or meanwhile).
    async fn session(
        &mut self,
        backend: &Arc<dyn Backend>,
        session_id: &str,
    ) -> Result<(), StoreError> {
        let info: SessionInfo = match backend.get_session(session_id).await {
            Ok(info) => info,
            Err(e) if e.reason() == Some(Reason::SessionDeleted) => {
                return self.line(deleted_line(session_id, 0).as_bytes()).await;
            }
            Err(e) => return Err(e),
        };
        let mut line = Vec::with_capacity(256);
        session_line(&info, &mut line);
        self.line(&line).await?;
        let mut sha = ring::digest::Context::new(&ring::digest::SHA256);
        let mut next = 1u64;
        let cancel = CancellationToken::new();
        let _stop = cancel.clone().drop_guard();
        let mut runs = backend.subscribe(session_id.to_string(), 1, false, cancel);
        let mut scratch = Event::default();
        'read: while next <= info.last_seq {
            let run = match runs.recv().await {
                Some(Ok(run)) => run,
                Some(Err(e)) if e.reason() == Some(Reason::SessionDeleted) => {
                    return self.line(deleted_line(session_id, 0).as_bytes()).await;
                }
                Some(Err(e)) => return Err(e),
                None => break,
            };
            // A stored event is decoded into the one `Event` kept for the purpose (its
            // strings' buffers reused), its fields this build does not know found in its
            // bytes, rendered with them, and hashed as written.
            let mut render =
                |writer: &mut Self, event: &Event, unknown: &Unknown| -> Result<bool, StoreError> {
                    if event.seq != next {
                        return Err(StoreError::Internal(format!(
                            "the log of {session_id} gave seq {} where {next} was next",
                            event.seq
                        )));
                    }
                    let start = writer.buf.len();
                    write_event_keeping(&mut writer.buf, event, unknown);
                    writer.buf.push(b'\n');
                    sha.update(&writer.buf[start..]);
                    next += 1;
                    Ok(next > info.last_seq)
                };
            let framed = match run {
                EventRun::Decoded(events) => FramedEvents::encode(&events),
                EventRun::Framed(framed) => framed,
            };
            for message in framed.messages() {
                let message = message?;
                let undecodable = |e: String| {
                    StoreError::Internal(format!("a stored event of {session_id}: {e}"))
                };
                scratch.clear();
                scratch
                    .merge(&message[..])
                    .map_err(|e| undecodable(e.to_string()))?;
                let unknown = unknown::find(&message, unknown::EVENT)
                    .map_err(|e| undecodable(e.to_string()))?;
                if render(self, &scratch, &unknown)? {
                    break 'read;
                }
                self.flush_if_full().await?;
            }
        }
        if next <= info.last_seq {
            return Err(StoreError::Internal(format!(
                "the log of {session_id} ended at seq {}, before its last seq {}",
                next - 1,
                info.last_seq
            )));
        }
        crate::metrics::session_exported();
        let end = End {
            session_id: session_id.to_string(),
            last_seq: info.last_seq,
            events: info.last_seq,
            sha256: hex(sha.finish().as_ref()),
        };
        self.line(end_line(&end).as_bytes()).await
    }
}

/// Lowercase hex.
pub fn hex(bytes: &[u8]) -> String {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    let mut out = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        out.push(DIGITS[(b >> 4) as usize] as char);
        out.push(DIGITS[(b & 15) as usize] as char);
    }
    out
}
