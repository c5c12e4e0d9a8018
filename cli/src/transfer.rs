//! Sessions that move, on the command line: `export` (the store's Export written to a file
//! or standard output), `import` (a file or standard input sent to the store's Import, each
//! session's outcome printed as it comes), `pin` and `unpin`.
//!
//! Promises:
//! - Memory stays flat whatever the size: the export is written piece by piece as it
//!   arrives, the import read and sent line by line as the store takes it.
//! - `export -o FILE` leaves FILE only when the export is whole: it is written beside it,
//!   fsync'd and renamed over it (a failed export leaves no FILE that looks complete).
//! - `import` prints, per session, imported, unchanged, deleted, or refused and why (the
//!   line, in the store's words), and exits non-zero if any was refused.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};

use agentlog_proto::v1::{
    ExportRequest, ImportChunk, ImportOutcome, ImportResult, PinSessionRequest,
};
use anyhow::{bail, Context, Result};
use serde_json::json;
use tokio::sync::mpsc;

use crate::commands::Output;
use crate::render::session_json;
use crate::store;

/// Import text is sent in pieces of about this size (whole lines, or pieces of a longer
/// line cut between two characters).
const PIECE_BYTES: usize = 1 << 20;
/// A piece of the export is at most one line over the store's piece size; its longest
/// line is the JSON of a 1 MiB event with every byte escaped.
const MAX_PIECE_BYTES: usize = 16 << 20;

/// `export [SESSION…|--all] [-o FILE]`.
pub async fn export(
    out: &Output,
    sessions: Vec<String>,
    all: bool,
    file: Option<PathBuf>,
) -> Result<()> {
    if sessions.is_empty() && !all {
        bail!("name the sessions to export (`agentlog ls` lists them), or use --all");
    }
    let client = store::connect(&out.addr).await?;
    let mut client = client.max_decoding_message_size(MAX_PIECE_BYTES);
    let mut pieces = client
        .export(ExportRequest {
            session_ids: sessions,
            all,
        })
        .await
        .map_err(|s| store::explain(&out.addr, "Export", s))?
        .into_inner();
    let mut sink = Sink::open(file.as_deref())?;
    while let Some(piece) = pieces
        .message()
        .await
        .map_err(|s| store::explain(&out.addr, "Export", s))?
    {
        sink.write(piece.text.as_bytes())?;
    }
    sink.finish()
}

/// Where an export goes: standard output, or a file made whole only at the end.
enum Sink {
    Stdout(std::io::BufWriter<std::io::Stdout>),
    File {
        partial: PathBuf,
        target: PathBuf,
        file: std::io::BufWriter<std::fs::File>,
    },
}

impl Sink {
    fn open(target: Option<&Path>) -> Result<Sink> {
        let Some(target) = target.filter(|t| t.as_os_str() != "-") else {
            return Ok(Sink::Stdout(std::io::BufWriter::new(std::io::stdout())));
        };
        let mut name = target
            .file_name()
            .with_context(|| format!("-o {}: name a file", target.display()))?
            .to_os_string();
        name.push(".partial");
        let partial = target.with_file_name(name);
        let file = std::fs::File::create(&partial)
            .with_context(|| format!("creating {}", partial.display()))?;
        Ok(Sink::File {
            partial,
            target: target.to_path_buf(),
            file: std::io::BufWriter::with_capacity(1 << 20, file),
        })
    }

    fn write(&mut self, bytes: &[u8]) -> Result<()> {
        match self {
            Sink::Stdout(out) => out.write_all(bytes).context("writing the export"),
            Sink::File { file, partial, .. } => file
                .write_all(bytes)
                .with_context(|| format!("writing {}", partial.display())),
        }
    }

    fn finish(self) -> Result<()> {
        match self {
            Sink::Stdout(mut out) => Ok(out.flush()?),
            Sink::File {
                partial,
                target,
                file,
            } => {
                let file = file
                    .into_inner()
                    .map_err(|e| anyhow::anyhow!("writing {}: {}", partial.display(), e.error()))?;
                file.sync_all()
                    .with_context(|| format!("syncing {}", partial.display()))?;
                std::fs::rename(&partial, &target).with_context(|| {
                    format!("renaming {} to {}", partial.display(), target.display())
                })?;
                if let Some(dir) = target.parent().filter(|d| !d.as_os_str().is_empty()) {
                    std::fs::File::open(dir).and_then(|d| d.sync_all()).ok();
                }
                Ok(())
            }
        }
    }
}

/// `import FILE|-`.
pub async fn import(out: &Output, file: &Path) -> Result<()> {
    let reader: Box<dyn BufRead + Send> = if file.as_os_str() == "-" {
        Box::new(std::io::BufReader::new(std::io::stdin()))
    } else {
        let opened =
            std::fs::File::open(file).with_context(|| format!("opening {}", file.display()))?;
        Box::new(std::io::BufReader::with_capacity(1 << 20, opened))
    };
    let (tx, rx) = mpsc::channel::<ImportChunk>(4);
    let reading = tokio::task::spawn_blocking(move || read_pieces(reader, tx));
    let mut client = store::connect(&out.addr).await?;
    let mut results = client
        .import(tokio_stream::wrappers::ReceiverStream::new(rx))
        .await
        .map_err(|s| store::explain(&out.addr, "Import", s))?
        .into_inner();
    let mut counts = [0usize; 5];
    let mut refused = 0;
    loop {
        let result = match results.message().await {
            Ok(Some(result)) => result,
            Ok(None) => break,
            Err(status) => {
                // A failure reading the file says more than the stream's end.
                if let Ok(Err(e)) = reading.await {
                    return Err(e);
                }
                return Err(store::explain(&out.addr, "Import", status));
            }
        };
        if result.outcome() == ImportOutcome::Refused {
            refused += 1;
        }
        counts[result.outcome as usize % 5] += 1;
        report(out, &result)?;
    }
    reading.await.context("reading the import")??;
    if !out.json {
        eprintln!(
            "{} imported, {} unchanged, {} deleted, {} refused",
            counts[ImportOutcome::Imported as usize],
            counts[ImportOutcome::Unchanged as usize],
            counts[ImportOutcome::Deleted as usize],
            refused
        );
    }
    if refused > 0 {
        bail!("{refused} of the export's sessions were refused (see above); the others went on");
    }
    Ok(())
}

/// Reads the text a line at a time and sends it in pieces of about [`PIECE_BYTES`] (a
/// longer line in pieces cut between two characters). Bytes that are not UTF-8 are sent as
/// U+FFFD: the store then finds the session's checksum wrong and refuses it, naming the
/// line.
fn read_pieces(mut reader: Box<dyn BufRead + Send>, tx: mpsc::Sender<ImportChunk>) -> Result<()> {
    let mut piece = String::with_capacity(PIECE_BYTES + 4096);
    let mut line = Vec::new();
    let send = |text: String| tx.blocking_send(ImportChunk { text }).is_ok();
    loop {
        line.clear();
        let read = reader
            .read_until(b'\n', &mut line)
            .context("reading the export")?;
        if read == 0 {
            break;
        }
        piece.push_str(&String::from_utf8_lossy(&line));
        while piece.len() >= PIECE_BYTES {
            let mut cut = PIECE_BYTES;
            while !piece.is_char_boundary(cut) {
                cut -= 1;
            }
            let rest = piece.split_off(cut);
            if !send(std::mem::replace(&mut piece, rest)) {
                return Ok(()); // The store ended the call; its status says why.
            }
        }
    }
    if !piece.is_empty() {
        send(piece);
    }
    Ok(())
}

fn report(out: &Output, result: &ImportResult) -> Result<()> {
    let mut stdout = std::io::stdout().lock();
    let id = if result.session_id.is_empty() {
        "(no session)"
    } else {
        result.session_id.as_str()
    };
    if out.json {
        let mut value = json!({
            "sessionId": result.session_id,
            "outcome": result.outcome().as_str_name(),
            "events": result.events.to_string(),
        });
        if result.outcome() == ImportOutcome::Refused {
            value["code"] = json!(format!("{:?}", tonic::Code::from_i32(result.code)));
            value["reason"] = json!(result.reason);
            value["message"] = json!(result.message);
            value["line"] = json!(result.line.to_string());
        }
        writeln!(stdout, "{value}")?;
        return Ok(());
    }
    match result.outcome() {
        ImportOutcome::Imported => writeln!(stdout, "imported {id} ({} events)", result.events)?,
        ImportOutcome::Unchanged => writeln!(stdout, "unchanged {id}")?,
        ImportOutcome::Deleted => writeln!(stdout, "deleted {id}")?,
        _ => writeln!(stdout, "refused {id}: {}", result.message)?,
    }
    Ok(())
}

/// `pin SESSION` / `unpin SESSION`.
pub async fn pin(out: &Output, session: &str, pinned: bool) -> Result<()> {
    let mut client = store::connect(&out.addr).await?;
    let info = client
        .pin_session(PinSessionRequest {
            session_id: session.to_string(),
            pinned,
        })
        .await
        .map_err(|s| store::explain(&out.addr, "PinSession", s))?
        .into_inner();
    let mut stdout = std::io::stdout().lock();
    if out.json {
        writeln!(stdout, "{}", session_json(&info))?;
    } else if pinned {
        writeln!(stdout, "pinned {session}: retention never deletes it")?;
    } else {
        writeln!(stdout, "unpinned {session}")?;
    }
    Ok(())
}
