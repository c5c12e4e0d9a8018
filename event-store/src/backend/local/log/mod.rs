//! The log: append-only segment files of CRC-framed records. This is what makes an
//! acknowledgement true: a batch is acknowledged only after one `fdatasync` covers it.
//!
//! Positions are global byte offsets; a segment is named by the offset of its first byte
//! and records never span segments. On open, the log is scanned from a given position: the
//! first invalid record of the last segment (a torn or corrupt tail: power was cut before
//! its fsync finished) and everything after it are dropped, so what survives is always a
//! prefix of what was written. An invalid record in an earlier segment, which was fully
//! fsync'd before the next one was created, is real corruption and refuses the open.
//!
//! A sealed segment may be rewritten without the records of deleted sessions
//! ([`compacted`], by [`SegmentRewriter`]): the records it keeps stay at their log offsets
//! and the segment keeps its place in the offset space, so positions never change; readers
//! look a record up through the rewritten file's run map, and one reading the segment as it
//! was finishes on the file it opened.

pub mod compacted;
pub mod record;
pub mod storage;

use std::collections::BTreeMap;
use std::io;
use std::sync::{Arc, Mutex, RwLock};

use bytes::Bytes;

use compacted::{FormatError, RunMap};
pub use record::Record;
use storage::{CrashPoint, SegmentFile, Storage};

/// Roll to a new segment once the current one holds this many bytes.
pub const DEFAULT_SEGMENT_BYTES: u64 = 64 << 20;
/// Zero-fill the active segment this far ahead of the writer (see [`LogConfig`]).
pub const DEFAULT_PREALLOCATE_BYTES: u64 = 4 << 20;
/// The smallest segment the store picks by itself for a small volume.
const MIN_SIZED_SEGMENT_BYTES: u64 = 1 << 20;

impl LogConfig {
    /// The defaults, with segments sized to a volume of `volume_bytes`: a sixteenth of it,
    /// between 1 MiB and [`DEFAULT_SEGMENT_BYTES`] (in whole 64 KiB), and the zero-filled
    /// room ahead a quarter of a segment at most. A full volume comes back by rewriting
    /// segments without deleted sessions' records, one at a time, each rewrite needing
    /// room for what it keeps of one segment: with a segment a sixteenth of the volume
    /// that always fits in the reserve kept for it (a segment and a MiB, at most an eighth
    /// of the volume), whatever the volume's size. (A segment as large as the volume held
    /// the whole log, and its rewrite needed room for every live session at once.)
    pub fn for_volume(volume_bytes: u64) -> LogConfig {
        let sixteenth = (volume_bytes / 16) & !((64 << 10) - 1);
        let segment_bytes = sixteenth.clamp(MIN_SIZED_SEGMENT_BYTES, DEFAULT_SEGMENT_BYTES);
        LogConfig {
            segment_bytes,
            preallocate_bytes: DEFAULT_PREALLOCATE_BYTES.min(segment_bytes / 4),
        }
    }
}

/// How the log lays out its files.
#[derive(Clone, Copy, Debug)]
pub struct LogConfig {
    /// Roll to a new segment once the current one holds this many bytes.
    pub segment_bytes: u64,
    /// Keep the active segment written with zeros this far ahead of the last record (0:
    /// off). An `fdatasync` after a write that extends a file must also commit the new
    /// size through the filesystem journal; overwriting blocks that already exist needs
    /// no metadata, so each group commit costs one flush, not two (PostgreSQL pre-zeroes
    /// its WAL segments for the same reason). Recovery reads an all-zero tail as the end
    /// of the log.
    pub preallocate_bytes: u64,
}

#[cfg(test)]
mod sized {
    use super::*;

    #[test]
    fn segments_are_a_sixteenth_of_a_small_volume_and_64_mib_on_a_large_one() {
        let small = LogConfig::for_volume(40 << 20);
        assert_eq!(small.segment_bytes, 2560 << 10);
        assert_eq!(small.preallocate_bytes, 640 << 10);
        assert_eq!(LogConfig::for_volume(4 << 20).segment_bytes, 1 << 20);
        let large = LogConfig::for_volume(100 << 30);
        assert_eq!(large.segment_bytes, DEFAULT_SEGMENT_BYTES);
        assert_eq!(large.preallocate_bytes, DEFAULT_PREALLOCATE_BYTES);
    }
}

impl Default for LogConfig {
    fn default() -> LogConfig {
        LogConfig {
            segment_bytes: DEFAULT_SEGMENT_BYTES,
            preallocate_bytes: DEFAULT_PREALLOCATE_BYTES,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum LogError {
    #[error("log I/O: {0}")]
    Io(#[from] io::Error),
    #[error(
        "segment {base} is corrupt at log offset {offset} ({reason}); it is not the last \
         segment, so this is not a torn write: restore the data dir from a backup"
    )]
    Corrupt {
        base: u64,
        offset: u64,
        reason: record::FrameError,
    },
    #[error("segment {base} ends at {end} but the next one starts at {next}")]
    Discontinuous { base: u64, end: u64, next: u64 },
    #[error("the index has absorbed the log up to {absorbed}, past its end at {end}")]
    IndexAhead { absorbed: u64, end: u64 },
    #[error("no record at log offset {0}")]
    NoRecord(u64),
    /// The volume has no room for the next records; nothing they depend on was written.
    #[error("no room on the log's volume: {0}")]
    NoSpace(String),
    #[error("record at log offset {offset} is unreadable: {reason}")]
    BadRecord {
        offset: u64,
        reason: record::FrameError,
    },
    #[error("segment {base}: {reason}; restore the data dir from a backup")]
    BadRewrite { base: u64, reason: FormatError },
    #[error("rewriting segment {base}: {reason}")]
    Rewrite {
        base: u64,
        reason: compacted::RewriteError,
    },
}

impl From<LogError> for crate::StoreError {
    fn from(err: LogError) -> crate::StoreError {
        crate::StoreError::Internal(err.to_string())
    }
}

/// A record's place in the log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Position {
    pub offset: u64,
    pub len: u32,
}

/// Where the log ends, and the place of its last record (none in a log without records,
/// or where it is not known): what the index records as absorbed, so that an open can
/// check that the log still holds what the index absorbed by reading one record.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LogTail {
    pub end: u64,
    pub last_record: Option<Position>,
}

/// The read side of the log, shared by the writer and every subscriber.
pub struct LogReader {
    segments: RwLock<BTreeMap<u64, Arc<Segment>>>,
    buffers: Arc<ReadBuffers>,
}

/// One segment as readers see it: its file, and for a rewritten one where its records are
/// in that file.
struct Segment {
    file: Arc<dyn SegmentFile>,
    map: Option<RunMap>,
}

impl Segment {
    /// Where in the file the `len` bytes at `offset` (from the segment's base) are; `None`
    /// if the segment no longer holds them (a deleted session's record).
    fn locate(&self, offset: u64, len: u64) -> Option<u64> {
        match &self.map {
            None => Some(offset),
            Some(map) => map.physical(offset, len),
        }
    }
}

/// Buffers that reads of runs of records are made into, kept for the next read once the
/// last user of one (a Subscribe body on its way out) drops it: a read then neither
/// allocates nor zero-fills. A buffer's bytes past the run being read are left from an
/// earlier read and are never handed out.
#[derive(Default)]
struct ReadBuffers {
    kept: Mutex<Vec<Vec<u8>>>,
}

impl ReadBuffers {
    /// Buffers kept at most, and the largest one kept: a few runs in flight at a time,
    /// without holding memory for many.
    const KEPT: usize = 8;
    const LARGEST: usize = 2 << 20;

    /// A buffer of at least `len` bytes.
    fn take(&self, len: usize) -> Vec<u8> {
        let kept = self.kept.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut buf = kept.unwrap_or_default();
        if buf.len() < len {
            buf.resize(len, 0);
        }
        buf
    }

    fn give(&self, buf: Vec<u8>) {
        if buf.capacity() == 0 || buf.capacity() > Self::LARGEST {
            return;
        }
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        if kept.len() < Self::KEPT {
            kept.push(buf);
        }
    }
}

impl LogReader {
    /// Reads and verifies the record at `pos`.
    pub fn read(&self, pos: Position) -> Result<Record, LogError> {
        let (base, segment) = {
            let segments = self.segments.read().unwrap_or_else(|p| p.into_inner());
            let (base, segment) = segments
                .range(..=pos.offset)
                .next_back()
                .ok_or(LogError::NoRecord(pos.offset))?;
            (*base, segment.clone())
        };
        let at = segment
            .locate(pos.offset - base, u64::from(pos.len))
            .ok_or(LogError::NoRecord(pos.offset))?;
        let mut frame = vec![0; pos.len as usize];
        segment.file.read_exact_at(&mut frame, at)?;
        record::decode(&frame)
            .map(|f| f.record)
            .map_err(|reason| LogError::BadRecord {
                offset: pos.offset,
                reason,
            })
    }

    /// Reads and verifies the records at `positions` (ascending, as an index lists them),
    /// each run of nearby records of one segment with a single read.
    pub fn read_many(
        &self,
        positions: impl IntoIterator<Item = Position>,
    ) -> Result<Vec<Record>, LogError> {
        let positions: Vec<Position> = positions.into_iter().collect();
        let mut records = Vec::with_capacity(positions.len());
        self.read_runs(&positions, |run| {
            for (frame, offset) in run.frames() {
                let record = record::decode(frame)
                    .map_err(|reason| LogError::BadRecord { offset, reason })?;
                records.push(record.record);
            }
            Ok::<_, LogError>(())
        })?;
        Ok(records)
    }

    /// Reads the records at `positions` (ascending, but for a fork's prefix made its own),
    /// each run of nearby, ascending records of one segment with a single read, and hands each run to `take` as it was read (nothing
    /// verified yet: see [`record::decode`] and [`record::StoredEvent::from_frame`]).
    pub fn read_runs<E: From<LogError>>(
        &self,
        positions: &[Position],
        mut take: impl FnMut(ReadRun) -> Result<(), E>,
    ) -> Result<(), E> {
        /// A run is read whole if it is at most this long...
        const MAX_RUN: u64 = 1 << 20;
        /// ...and no two of its records are further apart than this.
        const MAX_GAP: u64 = 64 << 10;
        let mut i = 0;
        // The positions of one segment where they are in its file, as offsets from the
        // segment's base (so a plain segment's are the log offsets themselves).
        let mut placed: Vec<Position> = Vec::new();
        while i < positions.len() {
            let (base, limit, segment) = {
                let start = positions[i].offset;
                let segments = self.segments.read().unwrap_or_else(|p| p.into_inner());
                let (base, segment) = segments
                    .range(..=start)
                    .next_back()
                    .ok_or(LogError::NoRecord(start))?;
                let limit = segments
                    .range(start + 1..)
                    .next()
                    .map_or(u64::MAX, |(next, _)| *next);
                (*base, limit, segment.clone())
            };
            placed.clear();
            let mut next = i;
            // A position before the segment's base (a fork's prefix made its own lies after
            // its newer events in the log) starts over with the segment that holds it.
            while let Some(p) = positions
                .get(next)
                .filter(|p| p.offset < limit && p.offset >= base)
            {
                let at = segment
                    .locate(p.offset - base, u64::from(p.len))
                    .ok_or(LogError::NoRecord(p.offset))?;
                placed.push(Position {
                    offset: base + at,
                    len: p.len,
                });
                next += 1;
            }
            let mut k = 0;
            while k < placed.len() {
                let start = placed[k].offset;
                let mut end = start + u64::from(placed[k].len);
                let mut j = k + 1;
                while let Some(p) = placed.get(j) {
                    let p_end = p.offset + u64::from(p.len);
                    if p.offset < end || p.offset - end > MAX_GAP || p_end - start > MAX_RUN {
                        break;
                    }
                    end = p_end;
                    j += 1;
                }
                let len = (end - start) as usize;
                let mut bytes = self.buffers.take(len);
                segment
                    .file
                    .read_exact_at(&mut bytes[..len], start - base)
                    .map_err(LogError::from)?;
                take(ReadRun {
                    bytes,
                    start,
                    records: &placed[k..j],
                    buffers: self.buffers.clone(),
                })?;
                k = j;
            }
            i = next;
        }
        Ok(())
    }

    /// Every record from `from` up to `to` (both append boundaries, `to` no later than what
    /// was made durable), in log order, handed to `absorb` one whole append at a time with
    /// its positions: how an index derived from the log (`search`) follows it. A record a
    /// rewrite dropped (a deleted session's) is not there; every other one is, at its offset.
    pub fn scan(
        &self,
        from: u64,
        to: u64,
        absorb: &mut impl FnMut(&[(Position, Record)]),
    ) -> Result<(), LogError> {
        let segments: Vec<(u64, Arc<Segment>)> = self
            .segments
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .range(..to)
            .map(|(base, segment)| (*base, segment.clone()))
            .collect();
        for (i, (base, segment)) in segments.iter().enumerate() {
            let limit = segments.get(i + 1).map_or(to, |(next, _)| *next).min(to);
            if limit <= from {
                continue;
            }
            let start = from.max(*base);
            match &segment.map {
                Some(map) => scan_rewritten(segment.file.as_ref(), map, *base, start, absorb)?,
                None => {
                    let mut bytes = vec![0; (limit - start) as usize];
                    segment.file.read_exact_at(&mut bytes, start - base)?;
                    if let Err((offset, reason)) = scan_bytes(&bytes, start, absorb) {
                        return Err(LogError::Corrupt {
                            base: *base,
                            offset,
                            reason,
                        });
                    }
                }
            }
        }
        Ok(())
    }

    fn insert(&self, base: u64, file: Arc<dyn SegmentFile>, map: Option<RunMap>) {
        self.segments
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .insert(base, Arc::new(Segment { file, map }));
    }

    /// The base of the segment that holds log offset `offset`.
    pub fn segment_of(&self, offset: u64) -> Option<u64> {
        let segments = self.segments.read().unwrap_or_else(|p| p.into_inner());
        segments.range(..=offset).next_back().map(|(base, _)| *base)
    }

    /// The base of the active segment (the last): every segment before it is sealed.
    pub fn active_base(&self) -> u64 {
        let segments = self.segments.read().unwrap_or_else(|p| p.into_inner());
        segments.keys().next_back().copied().unwrap_or(0)
    }

    /// Bytes the segment files take (what a rewrite gives back is the difference).
    pub fn file_bytes(&self, base: u64) -> Result<u64, LogError> {
        let segment = self
            .segments
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&base)
            .cloned();
        match segment {
            Some(segment) => Ok(segment.file.size()?),
            None => Ok(0),
        }
    }
}

/// Records read with one read: the bytes from offset `start`, and where each record is in
/// them. Offsets are log offsets (for a rewritten segment: its base plus the place in its
/// file). Dropped, or once the [`Bytes`] made of it are, its buffer is kept for a later
/// read.
pub struct ReadRun<'a> {
    /// At least up to the end of the last record (what follows is left from other reads).
    pub bytes: Vec<u8>,
    pub start: u64,
    /// Ascending, each within `bytes`.
    pub records: &'a [Position],
    buffers: Arc<ReadBuffers>,
}

impl ReadRun<'_> {
    /// Where record `p` (one of `records`) is in `bytes`.
    pub fn range_of(&self, p: Position) -> std::ops::Range<usize> {
        let at = (p.offset - self.start) as usize;
        at..at + p.len as usize
    }

    /// Each record's frame, with its log offset.
    pub fn frames(&self) -> impl Iterator<Item = (&[u8], u64)> {
        self.records
            .iter()
            .map(|&p| (&self.bytes[self.range_of(p)], p.offset))
    }

    /// The first `len` bytes, shared; the buffer is kept for a later read once the last
    /// of them is dropped.
    pub fn into_bytes(mut self, len: usize) -> Bytes {
        let buf = std::mem::take(&mut self.bytes);
        assert!(len <= buf.len(), "{len} bytes of a run of {}", buf.len());
        Bytes::from_owner(KeptBuffer {
            buf,
            len,
            buffers: self.buffers.clone(),
        })
    }
}

impl Drop for ReadRun<'_> {
    fn drop(&mut self) {
        self.buffers.give(std::mem::take(&mut self.bytes));
    }
}

/// A read buffer shared as [`Bytes`], given back to [`ReadBuffers`] when dropped.
struct KeptBuffer {
    buf: Vec<u8>,
    len: usize,
    buffers: Arc<ReadBuffers>,
}

impl AsRef<[u8]> for KeptBuffer {
    fn as_ref(&self) -> &[u8] {
        &self.buf[..self.len]
    }
}

impl Drop for KeptBuffer {
    fn drop(&mut self) {
        self.buffers.give(std::mem::take(&mut self.buf));
    }
}

/// The single writer of the log. Not shared: the store's writer thread owns it.
pub struct LogWriter {
    storage: Arc<dyn Storage>,
    reader: Arc<LogReader>,
    active_base: u64,
    active: Arc<dyn SegmentFile>,
    end: u64,
    /// The active segment's file size (as a log offset): zeros between `end` and here.
    allocated: u64,
    config: LogConfig,
    buf: Vec<u8>,
    last_record: Option<Position>,
}

impl LogWriter {
    /// Opens the log, scanning every valid record from `tail.end` on (given to `absorb`
    /// one whole append at a time, with positions) and dropping a torn tail: a bad record,
    /// or an append whose last record is missing. `tail.end` must be an append boundary no
    /// later than the end of the valid log.
    ///
    /// What comes before `tail.end` is not read again when the record `tail` names is in
    /// place and whole (its checksum holds and it ends at `tail.end`): the log still holds
    /// what the index absorbed, and opening costs the records the index had not absorbed,
    /// not the size of the last segment. Otherwise the last segment is read whole, so that
    /// a log older than its index (restored from an earlier backup, or cut) is told apart
    /// from a torn tail.
    pub fn open(
        storage: Arc<dyn Storage>,
        config: LogConfig,
        tail: LogTail,
        mut absorb: impl FnMut(&[(Position, Record)]),
    ) -> Result<LogWriter, LogError> {
        let from = tail.end;
        let mut last_record = tail.last_record;
        // Every whole append read comes here (a last segment read whole includes those
        // the index absorbed already); only those from `from` on go on to `absorb`.
        let mut absorb = |append: &[(Position, Record)]| {
            last_record = append.last().map(|(pos, _)| *pos);
            // `from` is an append boundary: an append is wholly before it or not.
            if append[0].0.offset >= from {
                absorb(append)
            }
        };
        // A rewrite a crash left unfinished: the segment it was made from is still whole.
        storage.remove_rewrite(None)?;
        let mut bases = storage.list()?;
        if bases.is_empty() {
            storage.create(0)?;
            bases.push(0);
        }
        let reader = Arc::new(LogReader {
            segments: RwLock::new(BTreeMap::new()),
            buffers: Arc::default(),
        });
        let mut end = bases[0];
        let mut allocated = end;
        for (i, &base) in bases.iter().enumerate() {
            let file = storage.open(base)?;
            if base != end {
                return Err(LogError::Discontinuous {
                    base: bases[i - 1],
                    end,
                    next: base,
                });
            }
            let is_last = i + 1 == bases.len();
            let map = compacted::read_map(file.as_ref())
                .map_err(|reason| LogError::BadRewrite { base, reason })?;
            if let Some(map) = map {
                // A rewritten segment: sealed, fully fsync'd before it was put in place,
                // so any bad record in it is damage.
                end = base + map.logical_len();
                allocated = end;
                if end > from {
                    scan_rewritten(file.as_ref(), &map, base, from, &mut absorb)?;
                }
                reader.insert(base, file, Some(map));
                if is_last {
                    // Never left last by the store (only sealed segments are rewritten),
                    // but should it be: the log goes on in a new segment.
                    storage.create(end)?;
                    bases.push(end);
                    reader.insert(end, storage.open(end)?, None);
                    break;
                }
                continue;
            }
            if is_last {
                // After a crash of the process alone (SIGKILL), bytes written but never
                // fsync'd are still in the page cache and read back as valid records. They
                // are about to be indexed, served and deduplicated against, so make them
                // durable first. (Earlier segments were synced before the roll.)
                file.sync_data()?;
            }
            let len = file.size()?;
            end = base + len;
            allocated = end;
            // A last segment whose absorbed part cannot be vouched for by its last record
            // is verified whole: a bad record before `from` (which was fsync'd before the
            // index absorbed it) is damage, not a torn write.
            if end > from || is_last {
                let scan_from = if is_last && !holds_absorbed(file.as_ref(), base, len, tail)? {
                    base
                } else {
                    from.max(base)
                };
                let valid = scan_segment(file.as_ref(), base, scan_from, &mut absorb)?;
                match valid {
                    Ok(()) => {}
                    // The zero-filled room ahead of the writer: the log simply ends here.
                    Err((offset, _))
                        if is_last
                            && offset >= from
                            && zeros_from(file.as_ref(), offset - base)? =>
                    {
                        end = offset;
                    }
                    Err((offset, reason)) => {
                        // A last segment that merely ends early (an older copy of the log,
                        // or a cut) is handled below as "index ahead": the index is rebuilt.
                        let ends_early = matches!(
                            reason,
                            record::FrameError::Truncated | record::FrameError::IncompleteAppend
                        ) || zeros_from(file.as_ref(), offset - base)?;
                        if !is_last || (offset < from && !ends_early) {
                            return Err(LogError::Corrupt {
                                base,
                                offset,
                                reason,
                            });
                        }
                        tracing::warn!(
                            segment = base,
                            offset,
                            dropped_bytes = end - offset,
                            %reason,
                            "dropping a torn tail: these bytes were never acknowledged as durable"
                        );
                        file.truncate(offset - base)?;
                        end = offset;
                        allocated = offset;
                    }
                }
            }
            reader.insert(base, file, None);
        }
        if from > end {
            return Err(LogError::IndexAhead {
                absorbed: from,
                end,
            });
        }
        let active_base = *bases.last().expect("at least one segment");
        let active = storage.open(active_base)?;
        Ok(LogWriter {
            storage,
            reader,
            active_base,
            active,
            end,
            allocated,
            config,
            buf: Vec::new(),
            last_record,
        })
    }

    /// Where the log ends and its last record is: what the index records as absorbed.
    pub fn tail(&self) -> LogTail {
        LogTail {
            end: self.end,
            last_record: self.last_record,
        }
    }

    pub fn reader(&self) -> Arc<LogReader> {
        self.reader.clone()
    }

    /// The offset one past the last record.
    pub fn end(&self) -> u64 {
        self.end
    }

    /// Makes sure records of up to `bytes` bytes in all can be written next: rolls to a new
    /// segment first if they would not fit the active one, and allocates (and zero-fills,
    /// see [`LogConfig`]) the room ahead. A full volume is [`LogError::NoSpace`]; nothing a
    /// record depends on was written then (a partly zero-filled tail is still just the end
    /// of the log), so the writer may refuse this batch and try again later. Any other error
    /// is fatal as ever.
    pub fn reserve(&mut self, bytes: u64) -> Result<(), LogError> {
        if let Some(reason) = self.storage.low_space()? {
            return Err(LogError::NoSpace(reason));
        }
        self.reserve_in_headroom(bytes)
    }

    /// [`LogWriter::reserve`] without asking whether the volume is running out of room: for
    /// the few bytes of a tombstone, which go into the room kept free for the index even when
    /// appends are refused (a deletion is how space comes back).
    pub fn reserve_in_headroom(&mut self, bytes: u64) -> Result<(), LogError> {
        let active_len = self.end - self.active_base;
        if active_len > 0 && active_len + bytes > self.config.segment_bytes {
            self.roll()?;
        }
        // The batch is encoded into one buffer: grown once, not doubling as it fills.
        self.buf.clear();
        self.buf.reserve(bytes as usize);
        self.preallocate(self.end + bytes)
    }

    /// Writes `records` as one contiguous write (not yet durable: see [`LogWriter::sync`])
    /// and returns their positions. Each item says whether the next record belongs to the
    /// same atomic append (recovery keeps an append only if its last record survived).
    pub fn write<'a>(
        &mut self,
        records: impl IntoIterator<Item = (&'a Record, bool)>,
    ) -> Result<Vec<Position>, LogError> {
        self.buf.clear();
        let records = records.into_iter();
        let mut lens = Vec::with_capacity(records.size_hint().0);
        for (record, continued) in records {
            lens.push(record.encode_into(&mut self.buf, continued) as u32);
        }
        if self.buf.is_empty() {
            return Ok(Vec::new());
        }
        let active_len = self.end - self.active_base;
        if active_len > 0 && active_len + self.buf.len() as u64 > self.config.segment_bytes {
            self.roll()?;
        }
        if self.config.preallocate_bytes > 0 {
            // Already done by `reserve` unless the batch outgrew what was reserved.
            self.preallocate(self.end + self.buf.len() as u64)?;
        }
        self.active
            .write_all_at(&self.buf, self.end - self.active_base)?;
        let mut offset = self.end;
        let positions: Vec<Position> = lens
            .into_iter()
            .map(|len| {
                let pos = Position { offset, len };
                offset += len as u64;
                pos
            })
            .collect();
        self.end = offset;
        self.last_record = positions.last().copied();
        Ok(positions)
    }

    /// A moment where a crash may cut the writer ([`Storage::crash_point`]).
    pub fn crash_point(&self, point: CrashPoint) -> Result<(), LogError> {
        Ok(self.storage.crash_point(point)?)
    }

    /// `fdatasync` of the active segment: every record written so far is durable after it.
    /// (Earlier segments were synced before the roll that closed them.)
    pub fn sync(&self) -> Result<(), LogError> {
        // Only for measuring what durability costs (the bench's "ceiling"); a build with
        // this feature acknowledges what is not durable and must never be deployed.
        #[cfg(feature = "unsafe-skip-fsync")]
        return Ok(());
        #[cfg(not(feature = "unsafe-skip-fsync"))]
        Ok(self.active.sync_data()?)
    }

    /// Makes sure the active segment has blocks up to `needed`: with preallocation on,
    /// zero-filled up to it and a step beyond (or just up to it, when the volume has no
    /// room for the step), so the coming writes overwrite existing blocks. The zeros become
    /// durable with the next sync; until then a crash merely leaves a shorter file.
    fn preallocate(&mut self, needed: u64) -> Result<(), LogError> {
        if needed <= self.allocated {
            return Ok(());
        }
        if self.config.preallocate_bytes == 0 {
            // Blocks only (the file's size stays the log's length); reserved again for
            // each batch, which costs little next to its fsync.
            let from = self.end - self.active_base;
            return self
                .active
                .allocate(from, needed - self.end)
                .map_err(no_space);
        }
        let segment_end = self.active_base + self.config.segment_bytes;
        let step = needed.max((self.allocated + self.config.preallocate_bytes).min(segment_end));
        match self.zero_fill(step) {
            Err(LogError::NoSpace(_)) if step > needed => self.zero_fill(needed),
            other => other,
        }
    }

    fn zero_fill(&mut self, target: u64) -> Result<(), LogError> {
        static ZEROS: [u8; 64 << 10] = [0; 64 << 10];
        let from = self.allocated - self.active_base;
        self.active
            .allocate(from, target - self.allocated)
            .map_err(no_space)?;
        let mut at = self.allocated;
        while at < target {
            let n = ZEROS.len().min((target - at) as usize);
            self.active
                .write_all_at(&ZEROS[..n], at - self.active_base)
                .map_err(no_space)?;
            at += n as u64;
        }
        self.allocated = target;
        Ok(())
    }

    /// Seals the active segment if it holds any record (a new, empty one takes its place),
    /// so that it can be rewritten; returns the active segment's base. A full volume is
    /// [`LogError::NoSpace`], with nothing changed but the cut of the zero-filled room.
    pub fn seal(&mut self) -> Result<u64, LogError> {
        if self.end > self.active_base {
            self.roll()?;
        }
        Ok(self.active_base)
    }

    /// Frees the volume's reserve (see [`Storage::keep_reserve`]) for a deletion or a new
    /// segment that found no room; the bytes it freed.
    pub fn release_reserve(&self) -> Result<u64, LogError> {
        Ok(self.storage.release_reserve()?)
    }

    /// What rewrites sealed segments (it shares this log's reader and storage).
    pub fn rewriter(&self) -> SegmentRewriter {
        SegmentRewriter {
            storage: self.storage.clone(),
            reader: self.reader.clone(),
        }
    }

    fn roll(&mut self) -> Result<(), LogError> {
        // The closed segment ends exactly at its last record (its zero-filled room is cut
        // off), so the next segment's base is where this one ends, durably.
        self.active.sync_data()?;
        self.active.truncate(self.end - self.active_base)?;
        self.allocated = self.end;
        // No room for a new file: nothing changed but the cut, which a retry repeats.
        let file = self.storage.create(self.end).map_err(no_space)?;
        self.reader.insert(self.end, file.clone(), None);
        self.active_base = self.end;
        self.allocated = self.end;
        self.active = file;
        Ok(())
    }
}

/// A full volume as [`LogError::NoSpace`]; every other error as it is.
fn no_space(e: impl Into<LogError>) -> LogError {
    match e.into() {
        LogError::Io(e) if e.kind() == io::ErrorKind::StorageFull => {
            LogError::NoSpace(e.to_string())
        }
        other => other,
    }
}

/// What a segment's rewrite changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Rewritten {
    /// Bytes the segment's file took before, and takes now.
    pub file_bytes_before: u64,
    pub file_bytes_after: u64,
    /// Records dropped, and their bytes.
    pub dropped_records: usize,
    pub dropped_bytes: u64,
}

/// Rewrites sealed segments without the records of deleted sessions, while the writer
/// appends and readers read (see [`compacted`]).
pub struct SegmentRewriter {
    storage: Arc<dyn Storage>,
    reader: Arc<LogReader>,
}

impl SegmentRewriter {
    /// Rewrites segment `base`, which must be sealed, without the records of the sessions
    /// `dead` names: the new file is written beside it, fsync'd, renamed over it (the
    /// directory fsync'd) and then read from; a reader in the middle of the old file goes on
    /// reading it. `None` if the segment holds no such record (nothing changes).
    /// `pause` is called between the pieces of the work (see [`compacted::rewrite`]).
    pub fn rewrite(
        &self,
        base: u64,
        dead: impl Fn(&[u8]) -> bool,
        pause: &mut dyn FnMut() -> io::Result<()>,
    ) -> Result<Option<Rewritten>, LogError> {
        let segment = {
            let segments = self
                .reader
                .segments
                .read()
                .unwrap_or_else(|p| p.into_inner());
            let sealed = segments.range(base + 1..).next().is_some();
            match segments.get(&base) {
                Some(segment) if sealed => segment.clone(),
                _ => return Ok(None),
            }
        };
        let before = segment.file.size()?;
        let out = self.storage.create_rewrite(base).map_err(no_space)?;
        let written = compacted::rewrite(
            segment.file.as_ref(),
            segment.map.as_ref(),
            before,
            &out,
            dead,
            pause,
        );
        let written = match written {
            Ok(Some(written)) => written,
            Ok(None) => {
                self.storage.remove_rewrite(Some(base))?;
                return Ok(None);
            }
            Err(reason) => {
                let _ = self.storage.remove_rewrite(Some(base));
                return Err(match reason {
                    compacted::RewriteError::Io(e) => no_space(e),
                    reason => LogError::Rewrite { base, reason },
                });
            }
        };
        self.storage.crash_point(CrashPoint::RewriteWritten)?;
        out.sync_data()?;
        self.storage.crash_point(CrashPoint::RewriteSynced)?;
        self.storage.install_rewrite(base)?;
        let after = out.size()?;
        self.reader.insert(base, out, Some(written.map));
        Ok(Some(Rewritten {
            file_bytes_before: before,
            file_bytes_after: after,
            dropped_records: written.dropped_records,
            dropped_bytes: written.dropped_bytes,
        }))
    }

    /// The storage it rewrites on (for the crash points after the rewrites).
    pub fn storage(&self) -> &Arc<dyn Storage> {
        &self.storage
    }
}

/// Scans a rewritten segment's records from log offset `from` on, as [`scan_segment`]
/// does; any bad record is damage (the file was fsync'd whole before it was put in place).
fn scan_rewritten(
    file: &dyn SegmentFile,
    map: &RunMap,
    base: u64,
    from: u64,
    absorb: &mut impl FnMut(&[(Position, Record)]),
) -> Result<(), LogError> {
    let from_rel = from.saturating_sub(base);
    for (logical, physical, len) in map.runs() {
        if logical + len <= from_rel {
            continue;
        }
        // `from` is an append boundary, and runs hold whole appends.
        let skip = from_rel.saturating_sub(logical);
        let mut bytes = vec![0; (len - skip) as usize];
        file.read_exact_at(&mut bytes, physical + skip)?;
        let start = base + logical + skip;
        if let Err((offset, reason)) = scan_bytes(&bytes, start, absorb) {
            return Err(LogError::Corrupt {
                base,
                offset,
                reason,
            });
        }
    }
    Ok(())
}

/// Scans `file` from log offset `from`, verifying every record and giving them to `absorb`,
/// one whole append at a time. Returns the offset and reason of the first invalid record,
/// or of the start of an append cut short, if any.
#[allow(clippy::type_complexity)]
fn scan_segment(
    file: &dyn SegmentFile,
    base: u64,
    from: u64,
    absorb: &mut impl FnMut(&[(Position, Record)]),
) -> Result<Result<(), (u64, record::FrameError)>, LogError> {
    let len = file.size()?;
    let mut bytes = vec![0; (len - (from - base)) as usize];
    file.read_exact_at(&mut bytes, from - base)?;
    Ok(scan_bytes(&bytes, from, absorb))
}

/// [`scan_segment`] over `bytes`, which are the log from offset `from`.
fn scan_bytes(
    bytes: &[u8],
    from: u64,
    absorb: &mut impl FnMut(&[(Position, Record)]),
) -> Result<(), (u64, record::FrameError)> {
    let mut at = 0usize;
    // The records of the append being read, held back until its last record is seen.
    let mut append: Vec<(Position, Record)> = Vec::new();
    while at < bytes.len() {
        let offset = from + at as u64;
        let frame = &bytes[at..];
        let invalid = |reason| {
            let start = append.first().map_or(offset, |(pos, _)| pos.offset);
            Err((start, reason))
        };
        let body = match record::body_len(frame) {
            Ok(body) => body,
            Err(reason) => return invalid(reason),
        };
        let total = record::HEADER_LEN + body;
        let frame = match record::decode(frame) {
            Ok(frame) => frame,
            Err(reason) => return invalid(reason),
        };
        let pos = Position {
            offset,
            len: total as u32,
        };
        append.push((pos, frame.record));
        if !frame.continued {
            absorb(&append);
            append.clear();
        }
        at += total;
    }
    match append.first() {
        Some((pos, _)) => Err((pos.offset, record::FrameError::IncompleteAppend)),
        None => Ok(()),
    }
}

/// Whether the last segment (`file`, from log offset `base`, `len` bytes) holds the record
/// `tail` names, whole and ending at `tail.end`.
fn holds_absorbed(
    file: &dyn SegmentFile,
    base: u64,
    len: u64,
    tail: LogTail,
) -> Result<bool, LogError> {
    let Some(last) = tail.last_record else {
        return Ok(false);
    };
    if last.offset < base || last.offset + last.len as u64 != tail.end || tail.end > base + len {
        return Ok(false);
    }
    let mut frame = vec![0; last.len as usize];
    file.read_exact_at(&mut frame, last.offset - base)?;
    Ok(
        record::body_len(&frame).is_ok_and(|body| record::HEADER_LEN + body == frame.len())
            && record::decode(&frame).is_ok_and(|decoded| !decoded.continued),
    )
}

/// Whether every byte of `file` from `offset` (relative to the file) on is zero.
fn zeros_from(file: &dyn SegmentFile, offset: u64) -> Result<bool, LogError> {
    let len = file.size()?;
    let mut buf = vec![0u8; 64 << 10];
    let mut at = offset;
    while at < len {
        let n = buf.len().min((len - at) as usize);
        file.read_exact_at(&mut buf[..n], at)?;
        if buf[..n].iter().any(|&b| b != 0) {
            return Ok(false);
        }
        at += n as u64;
    }
    Ok(true)
}
