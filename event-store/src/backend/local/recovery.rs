//! Recovery: the index brought up to the log's end by replaying what it had not absorbed
//! (after any crash), dropping a torn tail. Only the sessions of the replayed records are
//! read from the index: opening costs what the index had not absorbed, not the number of
//! sessions the store holds.
//!
//! A fork's start carries its state at the fork point, which recovery takes as it is (the
//! shared prefix is its parent's, never folded again); a materialization's placed records
//! add positions below the fork's last seq, and the last of them drops its base.
//!
//! A deleted session's records may be partly gone from the log (a reclamation cut short by
//! a crash rewrote some of its segments and not others), so its seqs may jump. Its
//! tombstone is always there, later in the log than all of them: a session whose seqs jump
//! is set aside, its later records kept in the index as dead records only (so that the
//! reclamation still finds them), and it is an error only if no tombstone follows.

use std::collections::HashMap;

use super::{OpenError, StoreConfig};
use crate::backend::local::index::{Index, IndexBatch, IndexError};
use crate::backend::local::log::{LogError, LogTail, LogWriter, Record};
use crate::session::SessionMeta;

/// Recovery writes replayed records into the index in batches of this many.
const REPLAY_BATCH: usize = 10_000;

/// Recovers from the log; an index ahead of the log (a log restored from an older backup)
/// is rebuilt from the whole log.
pub(crate) fn open(config: &StoreConfig, index: &Index) -> Result<LogWriter, OpenError> {
    match recover(config, index) {
        Err(OpenError::Log(LogError::IndexAhead { absorbed, end })) => {
            tracing::warn!(
                absorbed,
                end,
                "the index is ahead of the log (was the log restored from an older \
                 backup?); rebuilding the index from the whole log"
            );
            index.clear()?;
            recover(config, index)
        }
        other => other,
    }
}

/// Replays the log past the index's absorbed offset into the index.
fn recover(config: &StoreConfig, index: &Index) -> Result<LogWriter, OpenError> {
    let from = index.absorbed()?;
    // The states of the replayed records' sessions, read from the index as they come.
    let mut sessions: HashMap<String, SessionMeta> = HashMap::new();
    let mut read_sessions = 0u64;
    let mut batch = IndexBatch::default();
    let mut pending = 0usize;
    let mut replayed = 0u64;
    let mut failure: Option<IndexError> = None;
    // Sessions whose seqs jumped: skipped until their tombstone (see the module head).
    let mut jumped: HashMap<String, IndexError> = HashMap::new();
    let started = std::time::Instant::now();
    let log = LogWriter::open(config.log.clone(), config.log_config, from, |append| {
        for (pos, record) in append {
            if failure.is_some() {
                return;
            }
            let session_id = record.session_id();
            let tombstone = matches!(record, Record::Tombstone(_));
            if !tombstone && jumped.contains_key(session_id) {
                // Not indexed by seq, but kept track of: the reclamation must find it.
                batch.add_dead(session_id, *pos);
                continue;
            }
            if !sessions.contains_key(session_id) {
                match index.session(session_id) {
                    Ok(meta) => {
                        read_sessions += 1;
                        sessions.insert(session_id.to_string(), meta.unwrap_or_default());
                    }
                    Err(e) => {
                        failure = Some(e);
                        return;
                    }
                }
            }
            let meta = sessions.get_mut(session_id).expect("inserted above");
            if let Record::Placed(placed) = record {
                // A seq of the fork's shared prefix, made its own; the last of them drops
                // the base (its append is whole, or recovery would not see it). One that
                // fits no shared prefix is of a deleted fork whose records were partly
                // reclaimed: set aside like a jump (see the module head).
                if meta.base_session.is_empty() || placed.seq > meta.base_seq {
                    jumped.insert(
                        session_id.to_string(),
                        IndexError::SeqGap {
                            offset: pos.offset,
                            session: session_id.to_string(),
                            seq: placed.seq,
                            expected: meta.last_seq + 1,
                        },
                    );
                    batch.add_dead(session_id, *pos);
                    continue;
                }
                if placed.seq == meta.base_seq {
                    meta.base_session.clear();
                    meta.base_seq = 0;
                }
                batch.add(*pos, record);
                pending += 1;
                replayed += 1;
                continue;
            }
            if let Some((session, seq, _)) = record.event_place() {
                if seq != meta.last_seq + 1 {
                    jumped.insert(
                        session_id.to_string(),
                        IndexError::SeqGap {
                            offset: pos.offset,
                            session: session.to_string(),
                            seq,
                            expected: meta.last_seq + 1,
                        },
                    );
                    batch.add_dead(session_id, *pos);
                    continue;
                }
            }
            match record {
                Record::Event(event) => meta.apply_event(event),
                Record::Lease(lease) => meta.apply_lease(lease),
                Record::Fork(fork) => meta.apply_fork(fork),
                Record::Pin(pin) => meta.pinned = pin.pinned,
                Record::Placed(_) => {}
                Record::Tombstone(t) => {
                    jumped.remove(session_id);
                    let mut tombstone = SessionMeta::tombstone(t.deleted_unix_ms);
                    // Its forks may read through it until its records are gone.
                    tombstone.base_session = std::mem::take(&mut meta.base_session);
                    tombstone.base_seq = meta.base_seq;
                    *meta = tombstone;
                }
            }
            batch.add(*pos, record);
            pending += 1;
            replayed += 1;
        }
        // Absorbed offsets are always append boundaries.
        if pending >= REPLAY_BATCH {
            let last_record = append.last().map(|(pos, _)| *pos);
            let end = last_record.map_or(0, |pos| pos.offset + pos.len as u64);
            let full = std::mem::take(&mut batch);
            if let Err(e) = index.apply(full, &sessions, LogTail { end, last_record }) {
                failure = Some(e);
            }
            // In the index now: a rebuild of the whole log holds a batch's sessions at a
            // time, not every session.
            sessions.clear();
            pending = 0;
        }
    })?;
    if let Some(e) = failure {
        return Err(e.into());
    }
    if let Some(e) = jumped.into_values().next() {
        return Err(e.into());
    }
    if !batch.is_empty() || from != log.tail() {
        index.apply(batch, &sessions, log.tail())?;
        // So that the next open starts here even if this process is killed before the
        // writer's first flush of the index; not on a full volume (see `Index::flush`).
        let low_space = config
            .log
            .low_space()
            .map_err(|e| OpenError::DataDir("the log's volume".into(), e))?;
        if low_space.is_none() {
            index.flush()?;
        }
    }
    tracing::info!(
        from_offset = from.end,
        log_end = log.end(),
        replayed,
        sessions = read_sessions,
        elapsed_ms = started.elapsed().as_millis() as u64,
        "recovered the index from the log"
    );
    Ok(log)
}
