//! A sealed segment rewritten without the records of deleted sessions: the records it keeps,
//! byte for byte, at the same log offsets as before, so that nothing that points into the
//! log (the index's positions, a reader in the middle of a catch-up) has to change.
//!
//! The file: `[magic][the kept records, one run after another][the run table][footer]`.
//! Each run is a stretch of the original segment kept whole (`logical` offset in the
//! segment and length); the footer holds the segment's original length (the next segment
//! starts there, so the log stays one continuous offset space), the number of runs, a
//! CRC32C of the table and the footer, and the magic again. The magic's first four bytes,
//! read as a record length, are far above any valid one, so a file of this form is never
//! mistaken for a plain segment.
//!
//! A rewrite reads the source segment (plain or rewritten before) a window at a time,
//! verifying each record's checksum, and has the kept ones copied into the new file in the
//! same pass (by the kernel, [`SegmentFile::copy_from`]: a rewrite's cost was the copy of
//! its bytes through this process into the page cache, 35% of the store's CPU during a
//! pass at 64 clients, bench/RESULTS.md); the file is
//! complete only once its footer is written and fsync'd, and is put in place by the caller
//! (a rename over the segment), so a crash at any moment leaves either the old segment or
//! the whole new one.

use std::io;
use std::sync::Arc;

use super::record::{self, FrameError, HEADER_LEN};
use super::storage::SegmentFile;

const MAGIC: [u8; 8] = *b"AGLOGCMP";
/// A run in the table: its offset in the original segment and its length.
const RUN_BYTES: usize = 16;
/// Original length, run count, CRC32C, magic.
const FOOTER_BYTES: usize = 8 + 4 + 4 + 8;
/// The source is read this much at a time (more for a record that is longer), in short
/// pieces of work that the caller paces (see `pause`).
const READ_WINDOW: usize = 1 << 20;

/// Where a rewritten segment's records are in its file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RunMap {
    /// Bytes of log the segment covers (the original segment's length).
    logical_len: u64,
    /// Ascending and disjoint.
    runs: Vec<Run>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Run {
    /// Offset in the original segment.
    logical: u64,
    /// Offset in the rewritten file.
    physical: u64,
    len: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum FormatError {
    #[error("I/O: {0}")]
    Io(#[from] io::Error),
    #[error("a rewritten segment's table is damaged: {0}")]
    Damaged(&'static str),
}

impl RunMap {
    /// Bytes of log the segment covers.
    pub fn logical_len(&self) -> u64 {
        self.logical_len
    }

    /// Where the `len` bytes at `offset` of the original segment are in the file, if it
    /// kept them (a record of a deleted session is nowhere).
    pub fn physical(&self, offset: u64, len: u64) -> Option<u64> {
        let at = self.runs.partition_point(|r| r.logical <= offset);
        let run = self.runs.get(at.checked_sub(1)?)?;
        (offset + len <= run.logical + run.len).then(|| run.physical + (offset - run.logical))
    }

    /// The kept stretches: (offset in the original segment, offset in the file, length).
    pub fn runs(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        self.runs.iter().map(|r| (r.logical, r.physical, r.len))
    }

    /// Bytes of records the file holds.
    pub fn kept_bytes(&self) -> u64 {
        self.runs.iter().map(|r| r.len).sum()
    }
}

/// The file's run map if it is a rewritten segment, `None` if it is a plain one.
pub fn read_map(file: &dyn SegmentFile) -> Result<Option<RunMap>, FormatError> {
    let size = file.size()?;
    if size < (MAGIC.len() + FOOTER_BYTES) as u64 {
        return Ok(None);
    }
    let mut magic = [0u8; 8];
    file.read_exact_at(&mut magic, 0)?;
    if magic != MAGIC {
        return Ok(None);
    }
    let mut footer = [0u8; FOOTER_BYTES];
    file.read_exact_at(&mut footer, size - FOOTER_BYTES as u64)?;
    if footer[16..] != MAGIC {
        return Err(FormatError::Damaged("no footer"));
    }
    let logical_len = u64::from_le_bytes(footer[..8].try_into().expect("8 bytes"));
    let count = u32::from_le_bytes(footer[8..12].try_into().expect("4 bytes")) as u64;
    let crc = u32::from_le_bytes(footer[12..16].try_into().expect("4 bytes"));
    let table_len = count
        .checked_mul(RUN_BYTES as u64)
        .filter(|len| *len + ((MAGIC.len() + FOOTER_BYTES) as u64) <= size)
        .ok_or(FormatError::Damaged("run table larger than the file"))?;
    let table_at = size - FOOTER_BYTES as u64 - table_len;
    let mut table = vec![0u8; table_len as usize];
    file.read_exact_at(&mut table, table_at)?;
    if crc32c::crc32c_append(crc32c::crc32c(&table), &footer[..12]) != crc {
        return Err(FormatError::Damaged("checksum mismatch"));
    }
    let mut runs = Vec::with_capacity(count as usize);
    let mut physical = MAGIC.len() as u64;
    let mut logical_end = 0;
    for entry in table.chunks_exact(RUN_BYTES) {
        let logical = u64::from_le_bytes(entry[..8].try_into().expect("8 bytes"));
        let len = u64::from_le_bytes(entry[8..].try_into().expect("8 bytes"));
        if logical < logical_end || len == 0 || logical + len > logical_len {
            return Err(FormatError::Damaged("runs out of order"));
        }
        runs.push(Run {
            logical,
            physical,
            len,
        });
        physical += len;
        logical_end = logical + len;
    }
    if physical != table_at {
        return Err(FormatError::Damaged("runs do not fill the file"));
    }
    Ok(Some(RunMap { logical_len, runs }))
}

/// What a rewrite kept and dropped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rewrite {
    pub map: RunMap,
    pub dropped_records: usize,
    pub dropped_bytes: u64,
}

/// The stretches of `source` that hold records: the whole file for a plain segment of
/// `len` bytes, its runs for a rewritten one (offset in the segment, offset in the file,
/// length).
pub fn stretches(map: Option<&RunMap>, len: u64) -> Vec<(u64, u64, u64)> {
    match map {
        Some(map) => map.runs().collect(),
        None => vec![(0, 0, len)],
    }
}

/// Writes into `out` the records of `source` (laid out as `map` says, `None`: plain, of
/// `len` bytes) whose session `dead` does not name, each checksum verified on the way;
/// tombstones are always kept. Returns `None` if no record is dropped (what was written
/// to `out` is then of no use). When this returns `Some`, `out` is written whole but not
/// yet fsync'd: that, and putting it in place, is the caller's. `pause` is called after
/// each window of the source (a few MiB) is dealt with: the caller paces the rewrite there,
/// and an error from it stops the rewrite.
pub fn rewrite(
    source: &dyn SegmentFile,
    map: Option<&RunMap>,
    len: u64,
    out: &Arc<dyn SegmentFile>,
    dead: impl Fn(&[u8]) -> bool,
    pause: &mut dyn FnMut() -> io::Result<()>,
) -> Result<Option<Rewrite>, RewriteError> {
    let mut kept: Vec<(u64, u64)> = Vec::new();
    let mut dropped_records = 0usize;
    let mut dropped_bytes = 0u64;
    out.write_all_at(&MAGIC, 0)?;
    let mut written = MAGIC.len() as u64;
    let mut window = Vec::new();
    // Stretches of the source (offset in its file, length) to copy, as the scan finds them.
    let mut copies: Vec<(u64, u64)> = Vec::new();
    for (logical_start, physical_start, stretch_len) in stretches(map, len) {
        let mut done = 0u64; // bytes of the stretch dealt with
        let mut window_len = READ_WINDOW;
        while done < stretch_len {
            let want = window_len.min((stretch_len - done) as usize);
            window.resize(want, 0);
            source.read_exact_at(&mut window, physical_start + done)?;
            let more = done + (want as u64) < stretch_len;
            let mut at = 0usize;
            window_len = READ_WINDOW;
            while at < window.len() {
                let offset = logical_start + done + at as u64;
                let frame = &window[at..];
                let body = match record::body_len(frame) {
                    Ok(body) if HEADER_LEN + body <= frame.len() => body,
                    // Cut by the window: read on from this record (in a window that holds it).
                    Ok(body) if more => {
                        window_len = window_len.max(HEADER_LEN + body);
                        break;
                    }
                    Err(FrameError::Truncated) if more && at > 0 => break,
                    Ok(_) => return Err(RewriteError::Bad(offset, FrameError::Truncated)),
                    Err(e) => return Err(RewriteError::Bad(offset, e)),
                };
                let total = HEADER_LEN + body;
                let (session, keep_always) = record::session_of(&frame[..total])
                    .map_err(|e| RewriteError::Bad(offset, e))?;
                if !keep_always && dead(session) {
                    dropped_records += 1;
                    dropped_bytes += total as u64;
                } else {
                    match kept.last_mut() {
                        Some((start, run_len)) if *start + *run_len == offset => {
                            *run_len += total as u64
                        }
                        _ => kept.push((offset, total as u64)),
                    }
                    let from = physical_start + done + at as u64;
                    match copies.last_mut() {
                        Some((start, copy_len)) if *start + *copy_len == from => {
                            *copy_len += total as u64
                        }
                        _ => copies.push((from, total as u64)),
                    }
                }
                at += total;
            }
            done += at as u64;
            // What this window keeps goes out (read once more by the kernel, from the page
            // cache, without passing through this process), and on to the disk.
            let window_written = written;
            for (from, copy_len) in copies.drain(..) {
                out.copy_from(source, from, copy_len, written)?;
                written += copy_len;
            }
            out.start_writeback(window_written, written - window_written)?;
            pause()?;
        }
    }
    if dropped_records == 0 {
        return Ok(None);
    }
    let original_len = map.map_or(len, RunMap::logical_len);
    let mut tail = Vec::new();
    let mut runs = Vec::with_capacity(kept.len());
    let mut physical = MAGIC.len() as u64;
    let mut table = Vec::with_capacity(kept.len() * RUN_BYTES);
    for (logical, run_len) in kept {
        table.extend_from_slice(&logical.to_le_bytes());
        table.extend_from_slice(&run_len.to_le_bytes());
        runs.push(Run {
            logical,
            physical,
            len: run_len,
        });
        physical += run_len;
    }
    let mut footer = Vec::with_capacity(FOOTER_BYTES);
    footer.extend_from_slice(&original_len.to_le_bytes());
    footer.extend_from_slice(&(runs.len() as u32).to_le_bytes());
    let crc = crc32c::crc32c_append(crc32c::crc32c(&table), &footer);
    footer.extend_from_slice(&crc.to_le_bytes());
    footer.extend_from_slice(&MAGIC);
    tail.extend_from_slice(&table);
    tail.extend_from_slice(&footer);
    out.write_all_at(&tail, written)?;
    Ok(Some(Rewrite {
        map: RunMap {
            logical_len: original_len,
            runs,
        },
        dropped_records,
        dropped_bytes,
    }))
}

#[derive(Debug, thiserror::Error)]
pub enum RewriteError {
    #[error("I/O: {0}")]
    Io(#[from] io::Error),
    #[error(
        "the record at offset {0} of the segment is unreadable ({1}); the segment is left as it is"
    )]
    Bad(u64, FrameError),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::local::log::record::{Record, Tombstone};
    use crate::backend::local::log::storage::{SimStorage, Storage};
    use crate::session::LeaseRecord;
    use agentlog_proto::v1::{event, Event, UserMessage};

    fn event(session: &str, seq: u64, text: &str) -> Record {
        Record::Event(
            Event {
                session_id: session.into(),
                seq,
                kind: Some(event::Kind::UserMessage(UserMessage { text: text.into() })),
                ..Event::default()
            }
            .into(),
        )
    }

    /// A record's offset, length and bytes.
    type Placed = (u64, u64, Vec<u8>);

    fn go_on() -> io::Result<()> {
        Ok(())
    }

    /// A plain segment of `records` (each its own append): the file and where each is.
    fn segment(records: &[Record]) -> (Arc<dyn SegmentFile>, Vec<Placed>) {
        let storage = SimStorage::new();
        let file = storage.create(0).unwrap();
        let mut bytes = Vec::new();
        let mut placed = Vec::new();
        for r in records {
            let at = bytes.len();
            r.encode_into(&mut bytes, false);
            placed.push((at as u64, (bytes.len() - at) as u64, bytes[at..].to_vec()));
        }
        file.write_all_at(&bytes, 0).unwrap();
        (file, placed)
    }

    /// A plain segment rewritten whole into a new file without the records of `dead`.
    fn rewrite_without(
        source: &dyn SegmentFile,
        dead: &[u8],
    ) -> (Arc<dyn SegmentFile>, Option<Rewrite>) {
        let out = SimStorage::new().create(1).unwrap();
        let len = source.size().unwrap();
        let rewritten = rewrite(source, None, len, &out, |s| s == dead, &mut go_on).unwrap();
        (out, rewritten)
    }

    #[test]
    fn a_rewrite_keeps_the_live_records_at_their_offsets_and_drops_the_dead_ones() {
        let records = vec![
            event("dead", 1, "secret one"),
            event("live", 1, "kept one"),
            event("live", 2, "kept two"),
            Record::Lease(LeaseRecord {
                session_id: "dead".into(),
                epoch: 1,
                ..LeaseRecord::default()
            }),
            event("dead", 2, &"x".repeat(5000)),
            event("live", 3, "kept three"),
            Record::Tombstone(Tombstone {
                session_id: "dead".into(),
                deleted_unix_ms: 7,
            }),
        ];
        let (source, placed) = segment(&records);
        let len = source.size().unwrap();
        let (out, rewrite) = rewrite_without(source.as_ref(), b"dead");
        let rewrite = rewrite.expect("something was dropped");
        assert_eq!(rewrite.dropped_records, 3);
        let map = read_map(out.as_ref())
            .unwrap()
            .expect("a rewritten segment");
        assert_eq!(map, rewrite.map);
        assert_eq!(map.logical_len(), len);
        for (i, (offset, rec_len, bytes)) in placed.iter().enumerate() {
            let dead = matches!(i, 0 | 3 | 4);
            match map.physical(*offset, *rec_len) {
                None => assert!(dead, "record {i} was dropped"),
                Some(at) => {
                    assert!(!dead, "record {i} of a dead session was kept");
                    let mut read = vec![0; *rec_len as usize];
                    out.read_exact_at(&mut read, at).unwrap();
                    assert_eq!(&read, bytes, "record {i}");
                }
            }
        }
        let all: Vec<u8> = {
            let mut v = vec![0; out.size().unwrap() as usize];
            out.read_exact_at(&mut v, 0).unwrap();
            v
        };
        assert!(
            !all.windows(6).any(|w| w == b"secret"),
            "a dead payload is left"
        );

        // Rewritten again, with nothing more to drop: left alone; with more: a map of the map.
        let storage2 = SimStorage::new();
        let again = storage2.create(2).unwrap();
        assert_eq!(
            super::rewrite(
                out.as_ref(),
                Some(&map),
                0,
                &again,
                |s| s == b"dead",
                &mut go_on
            )
            .unwrap(),
            None
        );
        let twice = super::rewrite(
            out.as_ref(),
            Some(&map),
            0,
            &again,
            |s| s == b"live",
            &mut go_on,
        )
        .unwrap()
        .expect("the live records dropped now");
        assert_eq!(twice.map.logical_len(), len);
        assert_eq!(
            twice.map.kept_bytes(),
            placed[6].1,
            "only the tombstone is left"
        );
        assert_eq!(twice.map.physical(placed[6].0, placed[6].1), Some(8));
    }

    #[test]
    fn records_longer_than_a_read_window_are_kept_whole() {
        let big = "b".repeat(READ_WINDOW + 5000);
        let records = vec![
            event("live", 1, "small"),
            event("dead", 1, &big),
            event("live", 2, &big),
            event("live", 3, "small again"),
        ];
        let (source, placed) = segment(&records);
        let (out, rewrite) = rewrite_without(source.as_ref(), b"dead");
        let rewrite = rewrite.expect("one dropped");
        assert_eq!(rewrite.dropped_records, 1);
        for (offset, rec_len, bytes) in [&placed[0], &placed[2], &placed[3]] {
            let at = rewrite.map.physical(*offset, *rec_len).expect("kept");
            let mut read = vec![0; *rec_len as usize];
            out.read_exact_at(&mut read, at).unwrap();
            assert_eq!(&read, bytes);
        }
    }

    #[test]
    fn a_plain_segment_is_not_taken_for_a_rewritten_one_and_damage_is_found() {
        let (plain, _) = segment(&[event("a", 1, "hello")]);
        assert_eq!(read_map(plain.as_ref()).unwrap(), None);
        let (source, _) = segment(&[event("a", 1, "one"), event("b", 1, "two")]);
        let (out, rewritten) = rewrite_without(source.as_ref(), b"a");
        rewritten.unwrap();
        let size = out.size().unwrap();
        for at in size - FOOTER_BYTES as u64 - RUN_BYTES as u64..size - 8 {
            let mut byte = [0u8];
            out.read_exact_at(&mut byte, at).unwrap();
            out.write_all_at(&[byte[0] ^ 1], at).unwrap();
            assert!(read_map(out.as_ref()).is_err(), "a flipped byte at {at}");
            out.write_all_at(&byte, at).unwrap();
        }
        // A damaged record in the source stops the rewrite.
        source.write_all_at(&[0xff], 12).unwrap();
        let out2 = SimStorage::new().create(2).unwrap();
        let len = source.size().unwrap();
        assert!(matches!(
            rewrite(source.as_ref(), None, len, &out2, |s| s == b"a", &mut go_on),
            Err(RewriteError::Bad(0, _))
        ));
    }
}
