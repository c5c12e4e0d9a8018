//! Recovery: the index and the session states brought up to the log's end by replaying
//! what the index had not absorbed (after any crash), dropping a torn tail; then each
//! session's first user message read back from the log (the index keeps its seq, not its
//! text).
//!
//! A deleted session's records may be partly gone from the log (a reclamation cut short by
//! a crash rewrote some of its segments and not others), so its seqs may jump. Its
//! tombstone is always there, later in the log than all of them: a session whose seqs jump
//! is set aside, its later records kept in the index as dead records only (so that the
//! reclamation still finds them), and it is an error only if no tombstone follows.

use std::collections::HashMap;

use agentlog_proto::v1::event;

use super::{OpenError, StoreConfig};
use crate::backend::local::index::{Index, IndexBatch, IndexError};
use crate::backend::local::log::{LogError, LogReader, LogWriter, Record};
use crate::session::SessionMeta;

/// Recovery writes replayed records into the index in batches of this many.
const REPLAY_BATCH: usize = 10_000;

/// Recovers from the log; an index ahead of the log (a log restored from an older backup)
/// is rebuilt from the whole log.
pub(crate) fn open(
    config: &StoreConfig,
    index: &Index,
) -> Result<(LogWriter, HashMap<String, SessionMeta>), OpenError> {
    let (log, mut sessions) = match recover(config, index) {
        Err(OpenError::Log(LogError::IndexAhead { absorbed, end })) => {
            tracing::warn!(
                absorbed,
                end,
                "the index is ahead of the log (was the log restored from an older \
                 backup?); rebuilding the index from the whole log"
            );
            index.clear()?;
            recover(config, index)?
        }
        other => other?,
    };
    read_first_messages(index, &log.reader(), &mut sessions)?;
    Ok((log, sessions))
}

/// Replays the log past the index's absorbed offset into the index and the session map.
fn recover(
    config: &StoreConfig,
    index: &Index,
) -> Result<(LogWriter, HashMap<String, SessionMeta>), OpenError> {
    let from = index.absorbed()?;
    let mut sessions = index.load_sessions()?;
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
            let meta = sessions.entry(session_id.to_string()).or_default();
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
                // What the log is read into: never a copy (it decodes as an event).
                Record::Copied(copied) => match copied.decode() {
                    Ok(event) => meta.apply_event(&event),
                    Err(e) => {
                        failure = Some(IndexError::Corrupt(format!("a copied event: {e}")));
                        return;
                    }
                },
                Record::Tombstone(t) => {
                    jumped.remove(session_id);
                    *meta = SessionMeta::tombstone(t.deleted_unix_ms);
                }
            }
            batch.add(*pos, record);
            pending += 1;
            replayed += 1;
        }
        // Absorbed offsets are always append boundaries.
        if pending >= REPLAY_BATCH {
            let end = append
                .last()
                .map_or(0, |(pos, _)| pos.offset + pos.len as u64);
            let full = std::mem::take(&mut batch);
            if let Err(e) = index.apply(full, &sessions, end) {
                failure = Some(e);
            }
            pending = 0;
        }
    })?;
    if let Some(e) = failure {
        return Err(e.into());
    }
    if let Some(e) = jumped.into_values().next() {
        return Err(e.into());
    }
    if !batch.is_empty() || from != log.end() {
        index.apply(batch, &sessions, log.end())?;
    }
    tracing::info!(
        from_offset = from,
        log_end = log.end(),
        replayed,
        sessions = sessions.len(),
        elapsed_ms = started.elapsed().as_millis() as u64,
        "recovered the index from the log"
    );
    Ok((log, sessions))
}

/// Reads each live session's first user message back from the log (the index keeps only
/// its seq): one read per session at open.
fn read_first_messages(
    index: &Index,
    log: &LogReader,
    sessions: &mut HashMap<String, SessionMeta>,
) -> Result<(), OpenError> {
    for (session_id, meta) in sessions.iter_mut() {
        if meta.is_deleted() || meta.first_user_seq == 0 || !meta.first_user_text.is_empty() {
            continue;
        }
        let seq = meta.first_user_seq;
        let position = index
            .positions(session_id, seq, 1)?
            .into_iter()
            .find(|(s, _)| *s == seq)
            .map(|(_, pos)| pos)
            .ok_or_else(|| IndexError::Corrupt(format!("no position of {session_id}/{seq}")))?;
        match log.read(position).map_err(IndexError::from)? {
            Record::Event(event) => {
                if let Some(event::Kind::UserMessage(m)) = &event.kind {
                    meta.set_first_user_text(seq, &m.text);
                }
            }
            _ => {
                return Err(
                    IndexError::Corrupt(format!("{session_id}/{seq} is not an event")).into(),
                )
            }
        }
    }
    Ok(())
}
