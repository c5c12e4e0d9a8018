//! Subscribe: the history from a seq, then every new event live, in ascending seq with no
//! gap and no duplicate across the switch.
//!
//! The subscription registers for live events *before* it reads the history, and drops
//! live events that the history already delivered. Live events come through a bounded
//! per-session broadcast buffer; a subscriber that falls behind it (slow reader, stalled
//! client) is not waited for: it is told it lagged and catches up from disk, so appends and
//! other subscribers never slow down. Everything here is already durable: the writer
//! publishes only after the fsync.
//!
//! Events go to the service in runs ([`WireEvent`]s, as many as are at hand), not one by
//! one: history read from the log stays in the encoding it is stored in and goes out as
//! those bytes, so catching up costs a read and a checksum per event, not a decode, an
//! encode and a channel hand-off.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use agentlog_proto::v1::Event;
use tokio::sync::{broadcast, mpsc};
use tokio_util::sync::CancellationToken;

use crate::backend::WireEvent;
use crate::error::StoreError;
use crate::index::{Index, Recent};
use crate::log::record::EncodedEvent;
use crate::log::LogReader;

/// Live batches buffered per session before a subscriber counts as lagging.
const LIVE_BUFFER_BATCHES: usize = 1024;
/// Events read from disk per blocking read while catching up.
const HISTORY_CHUNK: usize = 512;
/// Runs of events queued between a subscription and the service: enough that the next
/// chunk of history is read while the service sends the one before, few enough that a
/// stalled reader holds little memory (a run is at most one chunk).
pub const QUEUED_RUNS: usize = 4;

/// The live fan-out: one broadcast channel per session that has followers.
#[derive(Default)]
pub struct Hub {
    channels: Mutex<HashMap<String, broadcast::Sender<Arc<[Event]>>>>,
}

impl Hub {
    fn subscribe(&self, session_id: &str) -> broadcast::Receiver<Arc<[Event]>> {
        let mut channels = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        channels
            .entry(session_id.to_string())
            .or_insert_with(|| broadcast::channel(LIVE_BUFFER_BATCHES).0)
            .subscribe()
    }

    /// Hands durable events of one session (at least one, ascending) to its followers;
    /// never blocks.
    pub fn publish(&self, events: Vec<Event>) {
        let Some(first) = events.first() else { return };
        let mut channels = self.channels.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(tx) = channels.get(first.session_id.as_str()) {
            let session_id = first.session_id.clone();
            if tx.send(events.into()).is_err() {
                // Nobody follows this session any more.
                channels.remove(&session_id);
            }
        }
    }
}

/// What a subscription needs to read.
#[derive(Clone)]
pub struct Source {
    pub hub: Arc<Hub>,
    pub index: Index,
    pub recent: Arc<Recent>,
    pub log: Arc<LogReader>,
}

/// Streams the session into `tx` until the history ends (without `follow`), the receiver
/// goes away, or `cancel` fires (shutdown).
pub async fn run(
    source: Source,
    session_id: String,
    from_seq: u64,
    follow: bool,
    tx: mpsc::Sender<Result<Vec<WireEvent>, StoreError>>,
    cancel: CancellationToken,
) {
    let _counted = crate::metrics::Subscriber::open();
    // Register before reading history: nothing published from now on can be missed.
    let mut live = follow.then(|| source.hub.subscribe(&session_id));
    let mut next = from_seq.max(1);
    let result = async {
        next = catch_up(&source, &session_id, next, &tx).await?;
        let Some(live) = live.as_mut() else {
            return Ok(());
        };
        loop {
            let batch = tokio::select! {
                _ = cancel.cancelled() => return Ok(()),
                _ = tx.closed() => return Ok(()),
                batch = live.recv() => batch,
            };
            match batch {
                Ok(events) => {
                    let mut run = Vec::with_capacity(events.len());
                    for event in events.iter() {
                        if event.seq < next {
                            continue; // already delivered from history
                        }
                        if event.seq > next {
                            // Cannot happen while we hold the receiver, but a gap is never
                            // acceptable: fill it from disk.
                            send(&tx, std::mem::take(&mut run)).await?;
                            next = catch_up(&source, &session_id, next, &tx).await?;
                            if event.seq < next {
                                continue;
                            }
                        }
                        run.push(WireEvent::Decoded(event.clone()));
                        next = event.seq + 1;
                    }
                    send(&tx, run).await?;
                }
                Err(broadcast::error::RecvError::Lagged(skipped)) => {
                    tracing::debug!(
                        session_id,
                        skipped,
                        next,
                        "subscriber fell behind the live buffer; catching up from disk"
                    );
                    next = catch_up(&source, &session_id, next, &tx).await?;
                }
                Err(broadcast::error::RecvError::Closed) => return Ok(()),
            }
        }
    }
    .await;
    if let Err(Stop::Failed(e)) = result {
        tracing::error!(session_id, error = %e, "subscription failed");
        let _ = tx.send(Err(e)).await;
    }
}

enum Stop {
    /// The receiver went away.
    Gone,
    Failed(StoreError),
}

/// Hands a run of events to the service (none: nothing to do).
async fn send(
    tx: &mpsc::Sender<Result<Vec<WireEvent>, StoreError>>,
    run: Vec<WireEvent>,
) -> Result<(), Stop> {
    if run.is_empty() {
        return Ok(());
    }
    tx.send(Ok(run)).await.map_err(|_| Stop::Gone)
}

/// Sends every indexed (so durable) event from `next` on; returns the seq after the last.
async fn catch_up(
    source: &Source,
    session_id: &str,
    mut next: u64,
    tx: &mpsc::Sender<Result<Vec<WireEvent>, StoreError>>,
) -> Result<u64, Stop> {
    let _counted = crate::metrics::CatchingUp::enter();
    loop {
        let source = source.clone();
        let id = session_id.to_string();
        let chunk = tokio::task::spawn_blocking(move || read_chunk(&source, &id, next))
            .await
            .map_err(|e| Stop::Failed(StoreError::Internal(e.to_string())))?
            .map_err(Stop::Failed)?;
        let Some(last) = chunk.last() else {
            return Ok(next);
        };
        next = last.seq + 1;
        send(tx, chunk.into_iter().map(WireEvent::Encoded).collect()).await?;
    }
}

/// Reads up to one chunk of consecutive events from `from` on, as stored.
fn read_chunk(
    source: &Source,
    session_id: &str,
    from: u64,
) -> Result<Vec<EncodedEvent>, StoreError> {
    // The recent ones first, then the index: the writer forgets a recent position only
    // after the index holds it, so every durable event is in one or the other.
    let recent = source.recent.positions(session_id, from, HISTORY_CHUNK);
    let mut positions = source.index.positions(session_id, from, HISTORY_CHUNK)?;
    for (expected, (seq, _)) in (from..).zip(&positions) {
        if *seq != expected {
            return Err(StoreError::Internal(format!(
                "index of session {session_id} jumps from seq {expected} to {seq}"
            )));
        }
    }
    let mut next = from + positions.len() as u64;
    for (seq, pos) in recent {
        if positions.len() >= HISTORY_CHUNK || seq > next {
            break;
        }
        if seq == next {
            positions.push((seq, pos));
            next += 1;
        }
    }
    let events = source
        .log
        .read_many_encoded(positions.iter().map(|(_, pos)| *pos))?;
    for ((seq, _), event) in positions.into_iter().zip(&events) {
        if event.seq != seq || event.session_id != session_id.as_bytes() {
            return Err(StoreError::Internal(format!(
                "index entry {session_id}/{seq} points at another record"
            )));
        }
    }
    Ok(events)
}
