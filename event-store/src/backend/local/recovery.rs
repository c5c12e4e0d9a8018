//! Recovery: the index and the session states brought up to the log's end by replaying
//! what the index had not absorbed (after any crash), dropping a torn tail.

use std::collections::HashMap;

use super::{OpenError, StoreConfig};
use crate::backend::local::index::{Index, IndexBatch, IndexError};
use crate::backend::local::log::{LogError, LogWriter, Record};
use crate::session::SessionMeta;

/// Recovery writes replayed records into the index in batches of this many.
const REPLAY_BATCH: usize = 10_000;

/// Recovers from the log; an index ahead of the log (a log restored from an older backup),
/// or one of an earlier layout, is rebuilt from the whole log.
pub(crate) fn open(
    config: &StoreConfig,
    index: &Index,
) -> Result<(LogWriter, HashMap<String, SessionMeta>), OpenError> {
    if !index.has_current_layout()? {
        tracing::warn!("the index has an earlier layout; rebuilding it from the whole log");
        index.clear()?;
    }
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
    let started = std::time::Instant::now();
    let log = LogWriter::open(config.log.clone(), config.log_config, from, |append| {
        for (pos, record) in append {
            if failure.is_some() {
                return;
            }
            let meta = sessions.entry(record.session_id().to_string()).or_default();
            match record {
                Record::Event(event) => {
                    if event.seq != meta.last_seq + 1 {
                        failure = Some(IndexError::SeqGap {
                            offset: pos.offset,
                            session: event.session_id.clone(),
                            seq: event.seq,
                            expected: meta.last_seq + 1,
                        });
                        return;
                    }
                    meta.apply_event(event);
                }
                Record::Lease(lease) => meta.apply_lease(lease),
                Record::Tombstone(t) => *meta = SessionMeta::tombstone(t.deleted_unix_ms),
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
