//! The index, in sled: sessions (status, lease, title), `event_id → seq` for dedup,
//! `(session, seq) → log position` for reads, and how far into the log it has absorbed.
//!
//! An event id that names its own event's seq (`auto-<seq>-<random>`, the form the store
//! gives an event that came without an id; see [`self_named_seq`]) is not put in
//! `event_id → seq`: dedup reads the event at that seq and compares instead, which saves
//! an index write per such event.
//!
//! sled is never on the acknowledgement path and never needs its own flush to be correct:
//! each batch of index updates carries the log offset it brings the index up to, in one
//! atomic sled batch, and on start the store replays the log from that offset. Whatever
//! sled lost in a crash is therefore re-derived from the log.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Mutex;

use prost::Message;

use crate::log::{LogError, Position, Record};
use crate::session::SessionMeta;

// Key prefixes in the one sled tree (one tree, so one batch is atomic across all of them).
// Session ids never contain 0x00, so `<session>\0<rest>` is unambiguous.
const ABSORBED: &[u8] = b"m:absorbed";
const SESSION: u8 = b's';
const POSITION: u8 = b'p';
const EVENT_ID: u8 = b'e';

#[derive(Debug, thiserror::Error)]
pub enum IndexError {
    #[error("index (sled): {0}")]
    Sled(#[from] sled::Error),
    #[error("index entry {0} is undecodable")]
    Corrupt(String),
    #[error(transparent)]
    Log(#[from] LogError),
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

#[derive(Clone)]
pub struct Index {
    db: sled::Db,
}

/// Index updates for records that are now durable in the log.
#[derive(Default)]
pub struct IndexBatch {
    batch: sled::Batch,
    touched: HashSet<String>,
    records: usize,
}

impl IndexBatch {
    /// Records a durable record at `pos`.
    pub fn add(&mut self, pos: Position, record: &Record) {
        if let Record::Event(event) = record {
            let mut value = [0u8; 12];
            value[..8].copy_from_slice(&pos.offset.to_be_bytes());
            value[8..].copy_from_slice(&pos.len.to_be_bytes());
            self.batch
                .insert(position_key(&event.session_id, event.seq), &value[..]);
            if self_named_seq(&event.event_id) != Some(event.seq) {
                self.batch.insert(
                    event_id_key(&event.session_id, &event.event_id),
                    &event.seq.to_be_bytes()[..],
                );
            }
        }
        self.records += 1;
        if !self.touched.contains(record.session_id()) {
            self.touched.insert(record.session_id().to_string());
        }
    }

    /// The sessions whose metadata this batch must also store.
    pub fn touched(&self) -> impl Iterator<Item = &String> {
        self.touched.iter()
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
pub const GENERATED_ID_PREFIX: &str = "auto-";

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
            if let Record::Event(event) = record {
                match map.get_mut(event.session_id.as_str()) {
                    Some(seqs) => seqs.push((event.seq, *pos)),
                    None => {
                        map.insert(event.session_id.clone(), vec![(event.seq, *pos)]);
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
    pub fn open(dir: &Path) -> Result<Index, IndexError> {
        let db = sled::Config::new().path(dir).open()?;
        Ok(Index { db })
    }

    /// The log offset up to which every record is in the index.
    pub fn absorbed(&self) -> Result<u64, IndexError> {
        match self.db.get(ABSORBED)? {
            None => Ok(0),
            Some(v) => {
                Ok(u64::from_be_bytes(v.as_ref().try_into().map_err(|_| {
                    IndexError::Corrupt("absorbed offset".into())
                })?))
            }
        }
    }

    /// Every session's metadata.
    pub fn load_sessions(&self) -> Result<HashMap<String, SessionMeta>, IndexError> {
        let mut sessions = HashMap::new();
        for entry in self.db.scan_prefix([SESSION]) {
            let (key, value) = entry?;
            let id = String::from_utf8(key[1..].to_vec())
                .map_err(|_| IndexError::Corrupt("session key".into()))?;
            let meta = SessionMeta::decode(value.as_ref())
                .map_err(|_| IndexError::Corrupt(format!("session {id}")))?;
            sessions.insert(id, meta);
        }
        Ok(sessions)
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
        let start = position_key(session_id, from_seq);
        let end = position_key(session_id, u64::MAX);
        let mut out = Vec::new();
        for entry in self.db.range(start..=end).take(limit) {
            let (key, value) = entry?;
            let seq = u64::from_be_bytes(
                key[key.len() - 8..]
                    .try_into()
                    .map_err(|_| IndexError::Corrupt("position key".into()))?,
            );
            if value.len() != 12 {
                return Err(IndexError::Corrupt(format!(
                    "position of {session_id}/{seq}"
                )));
            }
            let offset = u64::from_be_bytes(value[..8].try_into().expect("8 bytes"));
            let len = u32::from_be_bytes(value[8..].try_into().expect("4 bytes"));
            out.push((seq, Position { offset, len }));
        }
        Ok(out)
    }

    /// Applies `batch` and the current metadata of the sessions it touched, bringing the
    /// index up to log offset `absorbed`, atomically.
    pub fn apply(
        &self,
        mut batch: IndexBatch,
        sessions: &HashMap<String, SessionMeta>,
        absorbed: u64,
    ) -> Result<(), IndexError> {
        for id in &batch.touched {
            if let Some(meta) = sessions.get(id) {
                batch.batch.insert(session_key(id), meta.encode_to_vec());
            }
        }
        batch.batch.insert(ABSORBED, &absorbed.to_be_bytes()[..]);
        self.db.apply_batch(batch.batch)?;
        Ok(())
    }

    /// Forgets everything (the index is then rebuilt from the whole log).
    pub fn clear(&self) -> Result<(), IndexError> {
        self.db.clear()?;
        Ok(())
    }

    /// Writes sled's buffers out (a courtesy at shutdown: correctness never depends on it).
    pub fn flush(&self) -> Result<(), IndexError> {
        self.db.flush()?;
        Ok(())
    }
}

fn session_key(session_id: &str) -> Vec<u8> {
    let mut key = Vec::with_capacity(1 + session_id.len());
    key.push(SESSION);
    key.extend_from_slice(session_id.as_bytes());
    key
}

fn position_key(session_id: &str, seq: u64) -> Vec<u8> {
    let mut key = Vec::with_capacity(10 + session_id.len());
    key.push(POSITION);
    key.extend_from_slice(session_id.as_bytes());
    key.push(0);
    key.extend_from_slice(&seq.to_be_bytes());
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
