//! The index, in sled: sessions (status, lease, title), `event_id → seq` for dedup,
//! `(session, seq) → log position` for reads, and how far into the log it has absorbed.
//!
//! Positions are kept [`POSITIONS_PER_CHUNK`] to a sled entry: seqs are gapless from 1, so
//! the entry of a session's chunk `c` holds the positions of seqs `c·64 + 1 …` in order, 12
//! bytes each, and the index writes one entry per session and chunk an absorb touches
//! rather than one per event (and a read of 512 events visits 9 entries, not 512). The
//! last chunk of a session grows over several absorbs: each rewrites it with its new
//! positions after those it already held. An index of the earlier layout, one entry per
//! event, is told apart by [`POSITIONS_LAYOUT`] and rebuilt from the log on open.
//!
//! A fork that shares its parent's prefix holds positions of its own events only: the seqs
//! it reads through its base are empty positions (`len` 0) in its chunks, skipped by
//! [`Index::positions`], until a materialization places its own there. `c<parent>\0<fork>`
//! lists the forks made through a session, for the reclaimer ([`Index::children`]).
//!
//! An event id that names its own event's seq (`auto-<seq>-<random>`, the form the store
//! gives an event that came without an id; see [`self_named_seq`]) is not put in
//! `event_id → seq`: dedup reads the event at that seq and compares instead, which saves
//! an index write per such event.
//!
//! Sessions are listed from the index, not from memory: `o<status><updated, inverted><session>`
//! orders every listed session (one with events, not deleted) by status, then most recent
//! update first, then id, as `ListSessions` pages them ([`Index::listed`]); an absorb moves
//! a session's entry when its status or update time changes. The store keeps no state of
//! an idle session in memory: it reads `s<session>` when it needs it ([`Index::session`]).
//!
//! No text of a session is ever written into sled: a session's entry keeps the seq of its
//! first user message, not the message (its title and `ListSessions` text are read back
//! from the log when asked, [`Index::without_text`]). sled keeps the old versions of what it
//! overwrote or removed in its files until it happens to rewrite them, so this is what
//! makes a deleted session's text leave the disk with the log's segments. What sled may go
//! on holding of a deleted session is its id, its event ids and its records' positions.
//! A deleted session's entries are removed by [`Index::purge`] once its records are gone
//! from the log; until then `x<session>` marks it as awaiting that (with where its
//! tombstone ends in the log), so that a restart takes the work up again.
//!
//! sled is never on the acknowledgement path and never needs its own flush to be correct:
//! each batch of index updates carries the log offset it brings the index up to, in one
//! atomic sled batch, and on start the store replays the log from that offset. Whatever
//! sled lost in a crash is therefore re-derived from the log.
//!
//! sled writes its files only when the store asks ([`Index::flush`], or an absorb that
//! fills one of its buffers): its own periodic flusher is off. An I/O error stops sled for
//! good, so it must never write while the volume is full, and the writer, which knows when
//! the volume is full, is the one that decides when it writes.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;

use prost::Message;

use crate::backend::local::log::{LogError, LogTail, Position, Record};
use crate::session::SessionMeta;

// Key prefixes in the one sled tree (one tree, so one batch is atomic across all of them).
// Session ids never contain 0x00, so `<session>\0<rest>` is unambiguous.
/// `m:absorbed` → the log offset the index has absorbed up to (8 bytes), then the position
/// of the last record before it ([`POSITION_BYTES`]).
const ABSORBED: &[u8] = b"m:absorbed";
const ABSORBED_LEN: usize = 8 + POSITION_BYTES;
/// Names the layout of the entries; an index without it (or with another value) is removed
/// and rebuilt from the log ([`Index::open_current`]). "chunks-of-64": positions in chunks;
/// "no-text": sessions' entries hold no text (an index of the earlier layout, which held
/// the first user messages, goes with its files); "listed": the `o` order of sessions;
/// "shared-prefix": forks read their prefix through their parent (`c` keys, empty
/// positions for the seqs a fork does not hold).
const LAYOUT: &[u8] = b"m:positions-layout";
pub const POSITIONS_LAYOUT: &[u8] = b"chunks-of-64,no-text,listed,shared-prefix";
/// Positions per sled entry.
pub const POSITIONS_PER_CHUNK: u64 = 64;
/// Bytes of one position in a chunk: offset (8) and length (4), big-endian.
const POSITION_BYTES: usize = 12;
const SESSION: u8 = b's';
/// `o<status: 1 byte><!updated_unix_ms: 8 bytes><session>`: the listing order.
const LISTED: u8 = b'o';
/// The statuses a listed session may have (the byte of its `o` key).
pub const LISTED_STATUSES: [u8; 4] = [0, 1, 2, 3];
/// sled's page cache, in bytes: the index's hot pages (sessions' states, recent positions)
/// stay in memory, and the rest is read from its files (through the kernel's page cache),
/// so that memory does not grow with the sessions the store holds. sled's default is
/// 1 GiB; measured with 1,000,000 idle sessions (bench/RESULTS.md, "Scale with sessions"),
/// 64 MiB left the store at 433 MiB after seeding them and 16 MiB at 310 MiB.
const SLED_CACHE_BYTES: u64 = 16 << 20;
const POSITION: u8 = b'p';
const EVENT_ID: u8 = b'e';
/// A deleted session whose records may still be in the log: `x<session>` → the log offset
/// its tombstone ends at.
const ERASING: u8 = b'x';
/// A record of a deleted session that recovery found but could not index (its seqs jump,
/// see `recovery`): `d<session>\0<offset>` → its length, so that reclamation still finds it.
const DEAD: u8 = b'd';
/// A fork that read its prefix through a session when it was made: `c<session>\0<fork>`.
/// Whether it still does is the fork's state's to say ([`SessionMeta::base_session`]).
const CHILD: u8 = b'c';
/// How the id of a staging session starts: the events of a session being imported are
/// staged in a session of their own (see `import`), whose id no client can name (a session
/// id starts with a letter or digit) and which is never listed or claimed.
pub const STAGING_PREFIX: char = '~';

/// Whether `session_id` is a staging session's (see [`STAGING_PREFIX`]).
pub fn is_staging(session_id: &str) -> bool {
    session_id.starts_with(STAGING_PREFIX)
}

/// Keys one sled batch of a purge removes at most.
const PURGE_BATCH: usize = 4096;

#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    #[error("index (sled): {0}")]
    Sled(#[from] sled::Error),
    #[error("index entry {0} is undecodable")]
    Corrupt(String),
    #[error(transparent)]
    Log(#[from] LogError),
    #[error("index directory {0}: {1}")]
    Dir(String, std::io::Error),
    #[error(
        "log record at offset {offset} has seq {seq} for session {session}, expected {expected}"
    )]
    SeqGap {
        offset: u64,
        session: String,
        seq: u64,
        expected: u64,
    },
}

impl From<IndexError> for crate::StoreError {
    fn from(err: IndexError) -> crate::StoreError {
        crate::StoreError::Internal(err.to_string())
    }
}

#[derive(Clone)]
pub struct Index {
    db: sled::Db,
}

/// Index updates for records that are now durable in the log.
#[derive(Default)]
pub struct IndexBatch {
    batch: sled::Batch,
    /// Every session a record of the batch belongs to (its metadata is stored too), with
    /// the positions of its new events.
    touched: HashMap<String, NewPositions>,
    records: usize,
}

/// A session's event positions of one batch, by seq: appended events in seq order, and
/// events of a fork's shared prefix made its own ([`Record::Placed`]) at their seqs.
#[derive(Default)]
struct NewPositions {
    positions: Vec<(u64, Position)>,
    /// Whether some are placed ones (perhaps out of seq order, and among positions the
    /// chunks already hold): sorted, and merged into what the chunks hold.
    unordered: bool,
}

impl IndexBatch {
    /// Records a durable record at `pos`. A session's events come in seq order (the log's).
    pub fn add(&mut self, pos: Position, record: &Record) {
        let session_id = record.session_id();
        let new = match self.touched.get_mut(session_id) {
            Some(new) => new,
            None => self.touched.entry(session_id.to_string()).or_default(),
        };
        if let Some((session_id, seq, event_id)) = record.event_place() {
            if matches!(record, Record::Placed(_))
                || new
                    .positions
                    .last()
                    .is_some_and(|(last, _)| *last + 1 != seq)
            {
                new.unordered = true;
            }
            new.positions.push((seq, pos));
            if self_named_seq(event_id) != Some(seq) {
                self.batch
                    .insert(event_id_key(session_id, event_id), &seq.to_be_bytes()[..]);
            }
        }
        if let Record::Fork(fork) = record {
            if let Some(parent) = fork.state.as_ref().map(|s| &s.base_session) {
                if !parent.is_empty() {
                    self.batch
                        .insert(child_key(parent, &fork.session_id), &[][..]);
                }
            }
        }
        if let Record::Tombstone(t) = record {
            let end = pos.offset + u64::from(pos.len);
            self.batch
                .insert(erasing_key(&t.session_id), &end.to_be_bytes()[..]);
        }
        self.records += 1;
    }

    /// A record of a deleted session at `pos` that is not indexed by seq (recovery found
    /// the session's seqs jumping: some of its records were already reclaimed).
    pub fn add_dead(&mut self, session_id: &str, pos: Position) {
        self.batch
            .insert(dead_key(session_id, pos.offset), &pos.len.to_be_bytes()[..]);
        self.records += 1;
    }

    /// The sessions whose metadata this batch must also store.
    pub fn touched(&self) -> impl Iterator<Item = &String> {
        self.touched.keys()
    }

    pub fn is_empty(&self) -> bool {
        self.touched.is_empty()
    }

    /// Records added.
    pub fn len(&self) -> usize {
        self.records
    }
}

/// How the ids the store makes start.
const GENERATED_ID_PREFIX: &str = "auto-";

/// The id the store gives an event at `seq` appended without one: `auto-<seq>-<random>`,
/// the random part a UUID's 32 hex digits. Written into a string of its final size (an
/// id per event, on the writer's thread: `format!` started from an empty string and
/// allocated three times).
pub fn generated_id(seq: u64) -> String {
    use std::fmt::Write;
    let mut id = String::with_capacity(GENERATED_ID_PREFIX.len() + 20 + 1 + 32);
    let _ = write!(
        id,
        "{GENERATED_ID_PREFIX}{seq}-{}",
        crate::ids::random_uuid().simple()
    );
    id
}

/// The seq an id of the form `auto-<seq>-<random>` names. Such an id is kept out of the
/// `event_id → seq` index when it is its event's own seq (whoever chose it), so dedup of
/// any id of this form also looks at the event at that seq.
pub fn self_named_seq(event_id: &str) -> Option<u64> {
    let rest = event_id.strip_prefix(GENERATED_ID_PREFIX)?;
    let (seq, random) = rest.split_once('-')?;
    if random.is_empty() {
        return None;
    }
    seq.parse().ok()
}

/// Where the newest durable events are, by session, until the index has absorbed them.
/// Readers look here before they look in the index, and the writer forgets these only
/// after the index holds them, so a reader never misses a durable event.
#[derive(Default)]
pub struct Recent {
    positions: Mutex<HashMap<String, Vec<(u64, Position)>>>,
}

impl Recent {
    /// Durable records at `positions` (in log order).
    pub fn add(&self, positions: &[Position], records: &[Record]) {
        let mut map = self.positions.lock().unwrap_or_else(|p| p.into_inner());
        for (pos, record) in positions.iter().zip(records) {
            if let Some((session_id, seq, _)) = record.event_place() {
                match map.get_mut(session_id) {
                    // A fork's prefix made its own comes after its newer events.
                    Some(seqs) if seqs.last().is_some_and(|(last, _)| *last >= seq) => {
                        let at = seqs.partition_point(|(s, _)| *s < seq);
                        seqs.insert(at, (seq, *pos));
                    }
                    Some(seqs) => seqs.push((seq, *pos)),
                    None => {
                        map.insert(session_id.to_string(), vec![(seq, *pos)]);
                    }
                }
            }
        }
    }

    /// Forgets everything: the index holds it now.
    pub fn clear(&self) {
        self.positions
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
    }

    /// Up to `limit` positions of the session's recent events from `from_seq` on, ascending.
    pub fn positions(&self, session_id: &str, from_seq: u64, limit: usize) -> Vec<(u64, Position)> {
        let map = self.positions.lock().unwrap_or_else(|p| p.into_inner());
        let Some(seqs) = map.get(session_id) else {
            return Vec::new();
        };
        let start = seqs.partition_point(|(seq, _)| *seq < from_seq);
        seqs[start..].iter().take(limit).copied().collect()
    }
}

impl Index {
    /// Opens sled in `dir`. sled reads at open what it wrote since its previous open (its
    /// page table's snapshot is brought up to date then, and only then), and the page table
    /// itself: the time is logged, as it is most of a restart's (bench/RESULTS.md, "Scale
    /// with sessions").
    pub fn open(dir: &Path) -> Result<Index, IndexError> {
        let started = std::time::Instant::now();
        let db = sled::Config::new()
            .path(dir)
            .flush_every_ms(None)
            .cache_capacity(SLED_CACHE_BYTES)
            .open()?;
        tracing::info!(
            elapsed_ms = started.elapsed().as_millis() as u64,
            "opened the index"
        );
        Ok(Index { db })
    }

    /// Opens the index in `dir`, of this build's layout: one of another layout is removed
    /// first, files and all (so that nothing it kept lingers in sled's files), and an empty
    /// one is given the layout; the caller then rebuilds it from the log.
    pub fn open_current(dir: &Path) -> Result<Index, IndexError> {
        let discarded = dir.with_extension("discarded");
        let dir_error = |path: &Path, e| IndexError::Dir(path.display().to_string(), e);
        match std::fs::remove_dir_all(&discarded) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(dir_error(&discarded, e))
            }
            _ => {}
        }
        let index = Index::open(dir)?;
        if index.has_current_layout()? {
            return Ok(index);
        }
        tracing::warn!("the index has an earlier layout; removing it, to rebuild it from the log");
        drop(index);
        std::fs::rename(dir, &discarded).map_err(|e| dir_error(dir, e))?;
        std::fs::remove_dir_all(&discarded).map_err(|e| dir_error(&discarded, e))?;
        let index = Index::open(dir)?;
        index.has_current_layout()?;
        Ok(index)
    }

    /// The deleted sessions whose records may still be in the log, with where each one's
    /// tombstone ends.
    pub fn erasing(&self) -> Result<Vec<(String, u64)>, IndexError> {
        let mut erasing = Vec::new();
        for entry in self.db.scan_prefix([ERASING]) {
            let (key, value) = entry?;
            let id = String::from_utf8(key[1..].to_vec())
                .map_err(|_| IndexError::Corrupt("erasing key".into()))?;
            let end = u64::from_be_bytes(
                value
                    .as_ref()
                    .try_into()
                    .map_err(|_| IndexError::Corrupt(format!("erasing {id}")))?,
            );
            erasing.push((id, end));
        }
        Ok(erasing)
    }

    /// Forgets a deleted session's positions and event ids (in sled batches of at most
    /// [`PURGE_BATCH`] keys); its entry (the tombstone) stays, and so does the mark that it
    /// awaits erasure, until [`Index::erased`]. Called once its records are gone from the
    /// log and the index has absorbed its tombstone (so that nothing of it is written
    /// again). A crash in the middle leaves it marked, and a later purge finishes.
    pub fn purge_entries(&self, session_id: &str) -> Result<(), IndexError> {
        for prefix in [POSITION, EVENT_ID, DEAD, CHILD] {
            let mut start = Vec::with_capacity(2 + session_id.len());
            start.push(prefix);
            start.extend_from_slice(session_id.as_bytes());
            start.push(0);
            loop {
                let mut batch = sled::Batch::default();
                let mut keys = 0;
                for entry in self.db.scan_prefix(&start).keys().take(PURGE_BATCH) {
                    batch.remove(entry?);
                    keys += 1;
                }
                if keys == 0 {
                    break;
                }
                self.db.apply_batch(batch)?;
            }
        }
        Ok(())
    }

    /// The forks made through `session_id` (its `c` keys), whether or not they still read
    /// through it.
    pub fn children(&self, session_id: &str) -> Result<Vec<String>, IndexError> {
        let mut prefix = Vec::with_capacity(2 + session_id.len());
        prefix.push(CHILD);
        prefix.extend_from_slice(session_id.as_bytes());
        prefix.push(0);
        let mut children = Vec::new();
        for key in self.db.scan_prefix(&prefix).keys() {
            let key = key?;
            children.push(
                String::from_utf8(key[prefix.len()..].to_vec())
                    .map_err(|_| IndexError::Corrupt(format!("a fork of {session_id}")))?,
            );
        }
        Ok(children)
    }

    /// The records of a deleted session recovery could not index by seq
    /// ([`IndexBatch::add_dead`]).
    pub fn dead_positions(&self, session_id: &str) -> Result<Vec<Position>, IndexError> {
        let mut prefix = Vec::with_capacity(2 + session_id.len());
        prefix.push(DEAD);
        prefix.extend_from_slice(session_id.as_bytes());
        prefix.push(0);
        let mut positions = Vec::new();
        for entry in self.db.scan_prefix(&prefix) {
            let (key, value) = entry?;
            let bad = || IndexError::Corrupt(format!("dead record of {session_id}"));
            let offset = key[prefix.len()..].try_into().map_err(|_| bad())?;
            let len = value.as_ref().try_into().map_err(|_| bad())?;
            positions.push(Position {
                offset: u64::from_be_bytes(offset),
                len: u32::from_be_bytes(len),
            });
        }
        Ok(positions)
    }

    /// The deleted session no longer awaits erasure: its records are gone from the log and
    /// its entries from the index.
    pub fn erased(&self, session_id: &str) -> Result<(), IndexError> {
        self.db.remove(erasing_key(session_id))?;
        Ok(())
    }

    /// The log offset up to which every record is in the index, and where the last of them
    /// is (an index written before it kept that has only the offset).
    pub fn absorbed(&self) -> Result<LogTail, IndexError> {
        let Some(v) = self.db.get(ABSORBED)? else {
            return Ok(LogTail::default());
        };
        let corrupt = || IndexError::Corrupt("absorbed offset".into());
        let end = u64::from_be_bytes(v.get(..8).ok_or_else(corrupt)?.try_into().unwrap());
        let last_record = match v.len() {
            8 => None,
            ABSORBED_LEN => Some(unpack(&v[8..])),
            _ => return Err(corrupt()),
        };
        Ok(LogTail { end, last_record })
    }

    /// A session's state as the index holds it (without its first user message's text;
    /// a tombstone if it was deleted).
    pub fn session(&self, session_id: &str) -> Result<Option<SessionMeta>, IndexError> {
        match self.db.get(session_key(session_id))? {
            None => Ok(None),
            Some(value) => SessionMeta::decode(value.as_ref())
                .map(Some)
                .map_err(|_| IndexError::Corrupt(format!("session {session_id}"))),
        }
    }

    /// The listed sessions of one status in listing order (most recent update first, then
    /// by id), from just after `after` (an update time and id), as (update time, id).
    pub fn listed(
        &self,
        status: u8,
        after: Option<(i64, &str)>,
    ) -> impl Iterator<Item = Result<(i64, String), IndexError>> {
        let start = match after {
            Some((updated, id)) => {
                let mut key = listed_prefix(status, updated);
                key.extend_from_slice(id.as_bytes());
                // Just after it: ids never hold 0x00.
                key.push(0);
                key
            }
            None => vec![LISTED, status],
        };
        self.db
            .range(start..vec![LISTED, status + 1])
            .map(decode_listed)
    }

    /// The listed sessions of one status, least recently updated first.
    pub fn oldest(&self, status: u8) -> impl Iterator<Item = Result<(i64, String), IndexError>> {
        self.db
            .range(vec![LISTED, status]..vec![LISTED, status + 1])
            .rev()
            .map(decode_listed)
    }

    /// The sessions in the index with `status` (the runnable ones, at open).
    pub fn with_status(&self, status: u8) -> Result<Vec<(i64, String)>, IndexError> {
        self.listed(status, None).collect()
    }

    /// The sessions in the index after `after` in id order (staging sessions left out),
    /// with their states (without text), at most `limit`.
    pub fn sessions_after(
        &self,
        after: &str,
        limit: usize,
    ) -> Result<Vec<(String, SessionMeta)>, IndexError> {
        let mut start = session_key(after);
        start.push(0); // just after it: ids never hold 0x00
        let mut out = Vec::new();
        for entry in self.db.range(start..vec![SESSION + 1]) {
            if out.len() >= limit {
                break;
            }
            let (key, value) = entry?;
            let id = String::from_utf8(key[1..].to_vec())
                .map_err(|_| IndexError::Corrupt("session key".into()))?;
            if is_staging(&id) {
                continue;
            }
            let meta = SessionMeta::decode(value.as_ref())
                .map_err(|_| IndexError::Corrupt(format!("session {id}")))?;
            out.push((id, meta));
        }
        Ok(out)
    }

    /// The staging sessions the index holds that are neither deleted nor the base of the
    /// session they were staged for (see `import`): imports that never finished.
    pub fn unfinished_stagings(&self) -> Result<Vec<String>, IndexError> {
        let mut prefix = vec![SESSION];
        let mut tilde = [0u8; 4];
        prefix.extend_from_slice(STAGING_PREFIX.encode_utf8(&mut tilde).as_bytes());
        let mut unfinished = Vec::new();
        for entry in self.db.scan_prefix(&prefix) {
            let (key, value) = entry?;
            let id = String::from_utf8(key[1..].to_vec())
                .map_err(|_| IndexError::Corrupt("session key".into()))?;
            let meta = SessionMeta::decode(value.as_ref())
                .map_err(|_| IndexError::Corrupt(format!("session {id}")))?;
            if !meta.is_deleted() && self.children(&id)?.is_empty() {
                unfinished.push(id);
            }
        }
        Ok(unfinished)
    }

    /// The seq of an event id already in the session.
    pub fn event_seq(&self, session_id: &str, event_id: &str) -> Result<Option<u64>, IndexError> {
        match self.db.get(event_id_key(session_id, event_id))? {
            None => Ok(None),
            Some(v) => Ok(Some(u64::from_be_bytes(v.as_ref().try_into().map_err(
                |_| IndexError::Corrupt(format!("event id {event_id} of {session_id}")),
            )?))),
        }
    }

    /// Up to `limit` positions of the session's events from `from_seq` on, ascending.
    pub fn positions(
        &self,
        session_id: &str,
        from_seq: u64,
        limit: usize,
    ) -> Result<Vec<(u64, Position)>, IndexError> {
        let from_seq = from_seq.max(1);
        let start = position_key(session_id, chunk_of(from_seq));
        let end = position_key(session_id, u64::MAX);
        let mut out = Vec::new();
        for entry in self.db.range(start..=end) {
            if out.len() >= limit {
                break;
            }
            let (key, value) = entry?;
            let chunk = u64::from_be_bytes(
                key[key.len() - 8..]
                    .try_into()
                    .map_err(|_| IndexError::Corrupt("position key".into()))?,
            );
            if value.len() % POSITION_BYTES != 0
                || value.len() / POSITION_BYTES > POSITIONS_PER_CHUNK as usize
            {
                return Err(IndexError::Corrupt(format!(
                    "positions of {session_id}, chunk {chunk}"
                )));
            }
            let first = chunk * POSITIONS_PER_CHUNK + 1;
            for (seq, position) in (first..).zip(value.chunks_exact(POSITION_BYTES)) {
                if seq < from_seq {
                    continue;
                }
                if out.len() >= limit {
                    break;
                }
                let position = unpack(position);
                // A seq the session reads through its base (a fork's shared prefix).
                if position.len == 0 {
                    continue;
                }
                out.push((seq, position));
            }
        }
        Ok(out)
    }

    /// Applies `batch` and the current metadata of the sessions it touched, bringing the
    /// index up to `absorbed`, atomically. (The writer is sled's only writer, so
    /// the chunks read here to be extended cannot change before the batch is applied.)
    pub fn apply(
        &self,
        mut batch: IndexBatch,
        sessions: &HashMap<String, SessionMeta>,
        absorbed: LogTail,
    ) -> Result<(), IndexError> {
        for (id, new) in &batch.touched {
            if let Some(meta) = sessions.get(id) {
                let before = self.session(id)?;
                let listed_before = before.as_ref().and_then(|m| listed_key(id, m));
                let listed_now = listed_key(id, meta);
                if listed_before != listed_now {
                    if let Some(key) = listed_before {
                        batch.batch.remove(key);
                    }
                    if let Some(key) = listed_now {
                        batch.batch.insert(key, &[][..]);
                    }
                }
                batch
                    .batch
                    .insert(session_key(id), Index::without_text(meta).encode_to_vec());
            }
            if !new.positions.is_empty() {
                self.add_positions(&mut batch.batch, id, new)?;
            }
        }
        let mut value = absorbed.end.to_be_bytes().to_vec();
        if let Some(last) = absorbed.last_record {
            pack(last, &mut value);
        }
        batch.batch.insert(ABSORBED, value);
        self.db.apply_batch(batch.batch)?;
        Ok(())
    }

    /// A session's state as the index keeps it: without its first user message (the seq
    /// of that message says where the text is read back from).
    fn without_text(meta: &SessionMeta) -> std::borrow::Cow<'_, SessionMeta> {
        if meta.first_user_text.is_empty() {
            return std::borrow::Cow::Borrowed(meta);
        }
        let mut kept = meta.clone();
        kept.first_user_text.clear();
        std::borrow::Cow::Owned(kept)
    }

    /// Puts a session's new positions into `batch`, chunk by chunk: each chunk keeps the
    /// positions it held that they do not replace. A seq before them that the chunk does
    /// not hold (one a fork reads through its base) gets an empty position.
    fn add_positions(
        &self,
        batch: &mut sled::Batch,
        session_id: &str,
        new: &NewPositions,
    ) -> Result<(), IndexError> {
        let mut sorted;
        let positions = if new.unordered {
            sorted = new.positions.clone();
            sorted.sort_by_key(|(seq, _)| *seq);
            &sorted[..]
        } else {
            &new.positions[..]
        };
        let mut rest = positions;
        while let Some(&(first, _)) = rest.first() {
            let chunk = chunk_of(first);
            let in_chunk = rest.partition_point(|(seq, _)| chunk_of(*seq) == chunk);
            let (these, after) = rest.split_at(in_chunk);
            let key = position_key(session_id, chunk);
            let start = chunk * POSITIONS_PER_CHUNK + 1;
            // An append that starts the chunk is all it holds; anything else keeps what the
            // chunk held.
            let mut value = if first == start && !new.unordered {
                Vec::with_capacity(these.len() * POSITION_BYTES)
            } else {
                self.db.get(&key)?.map(|v| v.to_vec()).unwrap_or_default()
            };
            for &(seq, position) in these {
                let at = (seq - start) as usize * POSITION_BYTES;
                if value.len() < at + POSITION_BYTES {
                    value.resize(at + POSITION_BYTES, 0);
                }
                value[at..at + 8].copy_from_slice(&position.offset.to_be_bytes());
                value[at + 8..at + POSITION_BYTES].copy_from_slice(&position.len.to_be_bytes());
            }
            batch.insert(key, value);
            rest = after;
        }
        Ok(())
    }

    /// Whether the index's position entries have this build's layout (an empty index is
    /// given it); else [`Index::clear`] it and rebuild it from the log.
    pub fn has_current_layout(&self) -> Result<bool, IndexError> {
        if let Some(layout) = self.db.get(LAYOUT)? {
            return Ok(layout.as_ref() == POSITIONS_LAYOUT);
        }
        let empty = self.db.first()?.is_none();
        if empty {
            self.db.insert(LAYOUT, POSITIONS_LAYOUT)?;
        }
        Ok(empty)
    }

    /// Forgets everything (the index is then rebuilt from the whole log), keeping only
    /// the layout it is rebuilt in.
    pub fn clear(&self) -> Result<(), IndexError> {
        self.db.clear()?;
        self.db.insert(LAYOUT, POSITIONS_LAYOUT)?;
        Ok(())
    }

    /// Writes sled's buffers out and syncs them. Correctness never depends on it: it bounds
    /// what a restart replays from the log. Never called while the volume is full.
    pub fn flush(&self) -> Result<(), IndexError> {
        self.db.flush()?;
        Ok(())
    }
}

fn decode_listed(
    entry: sled::Result<(sled::IVec, sled::IVec)>,
) -> Result<(i64, String), IndexError> {
    let (key, _) = entry?;
    let bad = || IndexError::Corrupt("listed key".into());
    let inverted = key.get(2..10).ok_or_else(bad)?;
    let inverted = u64::from_be_bytes(inverted.try_into().map_err(|_| bad())?);
    let id = String::from_utf8(key[10..].to_vec()).map_err(|_| bad())?;
    Ok((uninvert(inverted), id))
}

/// An update time as the listing order wants it: most recent first, so inverted, and
/// with the sign bit flipped so that bytes compare as the numbers do.
fn invert(updated_unix_ms: i64) -> u64 {
    !((updated_unix_ms as u64) ^ (1 << 63))
}

fn uninvert(inverted: u64) -> i64 {
    ((!inverted) ^ (1 << 63)) as i64
}

fn listed_prefix(status: u8, updated_unix_ms: i64) -> Vec<u8> {
    let mut key = Vec::with_capacity(10 + 64);
    key.push(LISTED);
    key.push(status);
    key.extend_from_slice(&invert(updated_unix_ms).to_be_bytes());
    key
}

/// The session's `o` key, if it is listed (it has events and was not deleted).
fn listed_key(session_id: &str, meta: &SessionMeta) -> Option<Vec<u8>> {
    if meta.last_seq == 0 || meta.is_deleted() || is_staging(session_id) {
        return None;
    }
    let status = u8::try_from(meta.status).ok()?;
    let mut key = listed_prefix(status, meta.updated_unix_ms);
    key.extend_from_slice(session_id.as_bytes());
    Some(key)
}

fn session_key(session_id: &str) -> Vec<u8> {
    let mut key = Vec::with_capacity(1 + session_id.len());
    key.push(SESSION);
    key.extend_from_slice(session_id.as_bytes());
    key
}

/// The chunk of positions a seq (from 1) is in.
fn chunk_of(seq: u64) -> u64 {
    (seq - 1) / POSITIONS_PER_CHUNK
}

fn position_key(session_id: &str, chunk: u64) -> Vec<u8> {
    let mut key = Vec::with_capacity(10 + session_id.len());
    key.push(POSITION);
    key.extend_from_slice(session_id.as_bytes());
    key.push(0);
    key.extend_from_slice(&chunk.to_be_bytes());
    key
}

fn pack(position: Position, into: &mut Vec<u8>) {
    into.extend_from_slice(&position.offset.to_be_bytes());
    into.extend_from_slice(&position.len.to_be_bytes());
}

fn unpack(position: &[u8]) -> Position {
    let offset = u64::from_be_bytes(position[..8].try_into().expect("8 bytes"));
    let len = u32::from_be_bytes(position[8..].try_into().expect("4 bytes"));
    Position { offset, len }
}

fn dead_key(session_id: &str, offset: u64) -> Vec<u8> {
    let mut key = Vec::with_capacity(10 + session_id.len());
    key.push(DEAD);
    key.extend_from_slice(session_id.as_bytes());
    key.push(0);
    key.extend_from_slice(&offset.to_be_bytes());
    key
}

fn child_key(session_id: &str, child: &str) -> Vec<u8> {
    let mut key = Vec::with_capacity(2 + session_id.len() + child.len());
    key.push(CHILD);
    key.extend_from_slice(session_id.as_bytes());
    key.push(0);
    key.extend_from_slice(child.as_bytes());
    key
}

fn erasing_key(session_id: &str) -> Vec<u8> {
    let mut key = Vec::with_capacity(1 + session_id.len());
    key.push(ERASING);
    key.extend_from_slice(session_id.as_bytes());
    key
}

fn event_id_key(session_id: &str, event_id: &str) -> Vec<u8> {
    let mut key = Vec::with_capacity(2 + session_id.len() + event_id.len());
    key.push(EVENT_ID);
    key.extend_from_slice(session_id.as_bytes());
    key.push(0);
    key.extend_from_slice(event_id.as_bytes());
    key
}

#[cfg(test)]
mod tests {
    use agentlog_proto::v1::Event;

    use super::*;

    fn event(session_id: &str, seq: u64) -> Record {
        Record::Event(
            Event {
                session_id: session_id.into(),
                seq,
                event_id: format!("auto-{seq}-x"),
                ..Default::default()
            }
            .into(),
        )
    }

    /// A log ending at `end`, its last record the second half of it.
    fn tail(end: u64) -> LogTail {
        let last_record = (end > 0).then(|| Position {
            offset: end / 2,
            len: (end - end / 2) as u32,
        });
        LogTail { end, last_record }
    }

    /// A made-up position for `seq` of session `s`, distinct for every pair.
    fn position(s: u64, seq: u64) -> Position {
        Position {
            offset: s * 1_000_000 + seq * 10,
            len: (seq % 97) as u32 + 1,
        }
    }

    #[test]
    fn a_generated_id_names_its_seq_and_is_unlike_any_other() {
        for seq in [1, 42, u64::MAX] {
            let id = generated_id(seq);
            assert_eq!(self_named_seq(&id), Some(seq));
            let random = id.rsplit('-').next().unwrap();
            assert_eq!(random.len(), 32, "{id}");
            assert!(random
                .chars()
                .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));
            assert_ne!(generated_id(seq), id);
        }
    }

    #[test]
    fn positions_read_back_across_chunks_and_absorbs() {
        let dir = tempfile::tempdir().unwrap();
        let index = Index::open(dir.path()).unwrap();
        assert!(index.has_current_layout().unwrap());
        // Absorbs of many sizes, two sessions interleaved: chunks filled in one go, in
        // several, and left partly filled in between.
        let sessions = ["s-a", "s-b"];
        let mut last = [0u64; 2];
        let mut end = 0;
        for (round, size) in [1u64, 63, 2, 130, 64, 5, 59, 200].into_iter().enumerate() {
            let mut batch = IndexBatch::default();
            for _ in 0..size {
                for (s, id) in sessions.iter().enumerate() {
                    if s == 1 && round % 3 == 0 {
                        continue;
                    }
                    last[s] += 1;
                    batch.add(position(s as u64, last[s]), &event(id, last[s]));
                }
            }
            end += 1;
            index.apply(batch, &HashMap::new(), tail(end)).unwrap();
            for (s, id) in sessions.iter().enumerate() {
                for from in [1, 2, 63, 64, 65, 66, 127, 128, 129, last[s], last[s] + 1] {
                    for limit in [1, 7, 64, 512] {
                        let want: Vec<(u64, Position)> = (from.max(1)..=last[s])
                            .take(limit)
                            .map(|seq| (seq, position(s as u64, seq)))
                            .collect();
                        assert_eq!(index.positions(id, from, limit).unwrap(), want);
                    }
                }
            }
        }
        assert_eq!(index.absorbed().unwrap(), tail(end));
        assert!(index.positions("s-none", 1, 10).unwrap().is_empty());
    }

    #[test]
    fn no_text_goes_into_the_index_and_a_purge_leaves_the_tombstone_alone() {
        use crate::backend::local::log::record::Tombstone;
        use agentlog_proto::v1::{event, UserMessage};
        let dir = tempfile::tempdir().unwrap();
        let index = Index::open_current(dir.path()).unwrap();
        let first = Event {
            session_id: "s-a".into(),
            seq: 1,
            event_id: "u1".into(),
            kind: Some(event::Kind::UserMessage(UserMessage {
                text: "TEXT-OF-A-SESSION".into(),
            })),
            ..Default::default()
        };
        let mut meta = SessionMeta::default();
        meta.apply_event(&first);
        let sessions: HashMap<String, SessionMeta> = [("s-a".to_string(), meta)].into();
        let mut batch = IndexBatch::default();
        batch.add(position(0, 1), &Record::Event(first.into()));
        index.apply(batch, &sessions, tail(1)).unwrap();
        let loaded = index.session("s-a").unwrap().unwrap();
        assert_eq!(loaded.first_user_text, "", "the text is not in the index");
        assert_eq!(loaded.first_user_seq, 1, "where it is read back from");
        index.flush().unwrap();
        for entry in std::fs::read_dir(dir.path()).unwrap().flatten() {
            if let Ok(bytes) = std::fs::read(entry.path()) {
                assert!(!bytes.windows(17).any(|w| w == b"TEXT-OF-A-SESSION"));
            }
        }

        let tombstone = SessionMeta::tombstone(5);
        let sessions: HashMap<String, SessionMeta> = [("s-a".to_string(), tombstone)].into();
        let mut batch = IndexBatch::default();
        let record = Record::Tombstone(Tombstone {
            session_id: "s-a".into(),
            deleted_unix_ms: 5,
        });
        batch.add(
            Position {
                offset: 40,
                len: 20,
            },
            &record,
        );
        batch.add_dead("s-a", Position { offset: 30, len: 9 });
        index.apply(batch, &sessions, tail(60)).unwrap();
        assert_eq!(index.erasing().unwrap(), vec![("s-a".to_string(), 60)]);
        assert_eq!(index.dead_positions("s-a").unwrap().len(), 1);
        index.purge_entries("s-a").unwrap();
        assert!(index.positions("s-a", 1, 10).unwrap().is_empty());
        assert_eq!(index.event_seq("s-a", "u1").unwrap(), None);
        assert!(index.dead_positions("s-a").unwrap().is_empty());
        assert_eq!(index.erasing().unwrap().len(), 1, "marked until erased");
        index.erased("s-a").unwrap();
        assert!(index.erasing().unwrap().is_empty());
        assert!(index.session("s-a").unwrap().unwrap().is_deleted());
        assert!(
            index.listed(2, None).next().is_none() && index.listed(1, None).next().is_none(),
            "a deleted session is not listed"
        );
    }

    #[test]
    fn sessions_are_listed_by_status_then_most_recent_first_and_move_when_they_change() {
        use crate::backend::local::log::record::Tombstone;
        let dir = tempfile::tempdir().unwrap();
        let index = Index::open(dir.path()).unwrap();
        let mut sessions: HashMap<String, SessionMeta> = HashMap::new();
        let mut offset = 0;
        let mut absorb = |sessions: &HashMap<String, SessionMeta>, ids: &[&str]| {
            let mut batch = IndexBatch::default();
            for id in ids {
                let record = Record::Tombstone(Tombstone {
                    session_id: id.to_string(),
                    deleted_unix_ms: 0,
                });
                batch.add(position(offset, 1), &record);
                offset += 1;
            }
            index.apply(batch, sessions, tail(offset)).unwrap();
        };
        for (id, updated, status) in [("a", -5, 2), ("b", 7, 2), ("c", 7, 2), ("d", 3, 1)] {
            let meta = SessionMeta {
                last_seq: 1,
                updated_unix_ms: updated,
                status,
                ..SessionMeta::default()
            };
            sessions.insert(id.into(), meta);
        }
        absorb(&sessions, &["a", "b", "c", "d"]);
        let listed = |status, after| -> Vec<(i64, String)> {
            index.listed(status, after).map(Result::unwrap).collect()
        };
        let pairs = |items: &[(i64, &str)]| -> Vec<(i64, String)> {
            items.iter().map(|(t, id)| (*t, id.to_string())).collect()
        };
        assert_eq!(listed(2, None), pairs(&[(7, "b"), (7, "c"), (-5, "a")]));
        assert_eq!(listed(2, Some((7, "b"))), pairs(&[(7, "c"), (-5, "a")]));
        assert_eq!(listed(1, None), pairs(&[(3, "d")]));
        let oldest: Vec<_> = index.oldest(2).map(Result::unwrap).collect();
        assert_eq!(oldest, pairs(&[(-5, "a"), (7, "c"), (7, "b")]));
        // "a" is updated and becomes runnable; "c" is deleted.
        let a = sessions.get_mut("a").unwrap();
        a.updated_unix_ms = 9;
        a.status = 1;
        sessions.insert("c".into(), SessionMeta::tombstone(1));
        absorb(&sessions, &["a", "c"]);
        assert_eq!(listed(2, None), pairs(&[(7, "b")]));
        assert_eq!(listed(1, None), pairs(&[(9, "a"), (3, "d")]));
    }

    #[test]
    fn an_index_of_an_earlier_layout_goes_with_its_files() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("index");
        {
            let index = Index::open(&path).unwrap();
            index.db.insert(LAYOUT, &b"chunks-of-64"[..]).unwrap();
            index
                .db
                .insert(session_key("s-a"), &b"OLD-TEXT"[..])
                .unwrap();
            index.flush().unwrap();
        }
        let index = Index::open_current(&path).unwrap();
        assert!(index.has_current_layout().unwrap());
        assert!(index.session("s-a").unwrap().is_none());
        assert!(!path.with_extension("discarded").exists());
    }

    #[test]
    fn an_index_of_the_earlier_layout_is_told_apart_and_cleared() {
        let dir = tempfile::tempdir().unwrap();
        let index = Index::open(dir.path()).unwrap();
        // One position per entry, keyed by seq, and no layout key: the earlier layout.
        index
            .db
            .insert(position_key("s-a", 1), &[0u8; POSITION_BYTES][..])
            .unwrap();
        index.db.insert(ABSORBED, &7u64.to_be_bytes()[..]).unwrap();
        assert!(!index.has_current_layout().unwrap());
        assert!(!index.has_current_layout().unwrap(), "nothing was changed");
        index.clear().unwrap();
        assert!(index.has_current_layout().unwrap());
        assert_eq!(index.absorbed().unwrap(), LogTail::default());
        assert!(index.positions("s-a", 1, 10).unwrap().is_empty());
    }
}
