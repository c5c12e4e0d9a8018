//! What the disk allows, and what most agent harnesses do today.
//!
//! - the raw rate: `write(batch × 300 B) + fdatasync` in a loop, on a growing file and on
//!   a zero-filled one, the floor under any durable store on this disk; and the same single
//!   record after the thread has idled as long as a request/answer round trip, which is
//!   what the disk gives an fdatasync that follows a client's answer rather than the last
//!   fdatasync;
//! - the naive baseline: one JSON line per event, `write` + `fsync`, from one process.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;

use crate::load::Appender;
use crate::EVENT_BYTES;

/// One run of the raw loop.
#[derive(Debug, Clone, Copy)]
pub struct RawRun {
    /// Records made durable per second.
    pub records_per_s: f64,
    /// Median time of one write + fdatasync.
    pub sync_ms: f64,
}

/// How the raw loop lays out its file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RawFile {
    /// Appends: every fdatasync also persists the grown file size (what a naive JSONL log
    /// pays).
    Appending,
    /// Overwrites zero-filled, synced blocks (as the store's preallocated segments do), so
    /// an fdatasync persists only the data.
    Preallocated,
}

/// One case of the raw loop.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RawCase {
    pub layout: RawFile,
    /// Records per write + fdatasync.
    pub batch: usize,
    /// How long the thread sleeps before each write (zero: back to back).
    pub idle: Duration,
}

impl RawCase {
    /// How the report names the file and its pace.
    pub fn describe(&self) -> String {
        let file = match self.layout {
            RawFile::Preallocated => "preallocated",
            RawFile::Appending => "appending",
        };
        if self.idle.is_zero() {
            file.to_string()
        } else {
            format!(
                "{file}, {} µs asleep before each write",
                self.idle.as_micros()
            )
        }
    }
}

/// The idle time of [`RawCase::idle`]'s paced case: about one append round trip at one
/// client (the answer to the client, its next request back), during which a store's
/// writer has nothing to sync.
pub const ROUND_TRIP_IDLE: Duration = Duration::from_micros(300);

const PREALLOCATED_BYTES: u64 = 16 << 20;

/// Records per second made durable by `write(batch × 300 B) + fdatasync`, for `secs`; the
/// time of each write + fdatasync excludes the idle time before it.
pub fn raw_fdatasync(dir: &Path, case: RawCase, secs: Duration) -> anyhow::Result<RawRun> {
    let RawCase {
        layout,
        batch,
        idle,
    } = case;
    let path = dir.join("raw-fdatasync.bin");
    let mut file = OpenOptions::new()
        .create(true)
        .write(true)
        .truncate(true)
        .open(&path)
        .context("open the raw fdatasync file")?;
    if layout == RawFile::Preallocated {
        let zeros = vec![0u8; 1 << 20];
        for _ in 0..PREALLOCATED_BYTES >> 20 {
            file.write_all(&zeros)?;
        }
        file.sync_all()?;
    }
    let buf = vec![b'x'; EVENT_BYTES * batch];
    let start = Instant::now();
    let mut records = 0u64;
    let mut offset = 0u64;
    let mut syncs_ms = Vec::new();
    while start.elapsed() < secs {
        if !idle.is_zero() {
            std::thread::sleep(idle);
        }
        let t = Instant::now();
        match layout {
            RawFile::Appending => file.write_all(&buf)?,
            RawFile::Preallocated => {
                if offset + buf.len() as u64 > PREALLOCATED_BYTES {
                    offset = 0;
                }
                file.write_all_at(&buf, offset)?;
                offset += buf.len() as u64;
            }
        }
        file.sync_data()?;
        syncs_ms.push(t.elapsed().as_secs_f64() * 1e3);
        records += batch as u64;
    }
    let elapsed = start.elapsed().as_secs_f64();
    drop(file);
    std::fs::remove_file(&path)?;
    Ok(RawRun {
        records_per_s: records as f64 / elapsed,
        sync_ms: crate::stats::percentile_f64(&syncs_ms, 0.5),
    })
}

/// The naive approach: append a JSON line to the session's file and fsync it, per event.
pub struct NaiveJsonl {
    file: File,
    path: PathBuf,
    seq: u64,
    text: String,
}

impl NaiveJsonl {
    pub fn create(dir: &Path, session: &str) -> anyhow::Result<NaiveJsonl> {
        let path = dir.join(format!("{session}.jsonl"));
        let file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .with_context(|| format!("open {}", path.display()))?;
        Ok(NaiveJsonl {
            file,
            path,
            seq: 0,
            text: crate::event_text(),
        })
    }
}

impl Drop for NaiveJsonl {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

impl Appender for NaiveJsonl {
    async fn append(&mut self) -> anyhow::Result<()> {
        self.seq += 1;
        let line = serde_json::json!({
            "seq": self.seq,
            "type": "user_message",
            "text": self.text,
        });
        let mut bytes = serde_json::to_vec(&line)?;
        bytes.push(b'\n');
        // Blocking file I/O, as the harnesses do it; off the async workers' backs.
        tokio::task::block_in_place(|| {
            self.file.write_all(&bytes)?;
            self.file.sync_all()
        })?;
        Ok(())
    }
}
