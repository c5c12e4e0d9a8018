//! Subscribe: the history from a seq, then every new event live, in ascending seq with no
//! gap and no duplicate across the switch.
//!
//! The subscription registers for live events *before* it reads the history, and drops
//! live events that the history already delivered. Live events come through the session's
//! ring ([`super::live`]); a subscriber that falls behind it (slow reader, stalled
//! client) is not waited for: it is told it lagged and catches up from disk, so appends and
//! other subscribers never slow down. Everything here is already durable: the writer
//! publishes only after the fsync.
//!
//! Events go to the service in runs ([`EventRun`]s, as many as are at hand), not one by
//! one: history read from the log goes out as the buffer it was read into, each stored
//! event already behind its gRPC message header ([`FramedEvents`]), so catching up costs a
//! read, a checksum and a move within that buffer per event, not a decode, an encode and a
//! channel hand-off.
//!
//! A fork that shares its parent's prefix (`SessionMeta::base_session`) has its seqs up to
//! the fork point read from its base's log, down the line of bases, each event given the
//! fork's session id (its field 1 replaced, every other byte as stored): the same bytes a
//! copied prefix would give.
//!
//! A deleted session's subscription ends with `NOT_FOUND` (`SESSION_DELETED`): at once if the
//! tombstone was there when it started, else when the tombstone is published (the hub tells
//! every follower), and a read that fails because the reclamation already took the records
//! is reported the same way.

use std::sync::Arc;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::backend::local::index::Index;
use crate::backend::local::live::{Live, RecvError};
use crate::backend::local::log::{LogReader, Position};
use crate::backend::local::published::Shared;
use crate::backend::EventRun;
use crate::backend::FramedEvents;
use crate::error::StoreError;
use crate::rules;

/// Events read from disk per blocking read while catching up.
const HISTORY_CHUNK: usize = 512;

/// What a subscription needs to read: the published state (the hub, the positions the
/// index has not absorbed, the tombstones), the index and the log.
#[derive(Clone)]
pub struct Source {
    pub shared: Arc<Shared>,
    pub index: Index,
    pub log: Arc<LogReader>,
}

/// Streams the session into `tx` until the history ends (without `follow`), the receiver
/// goes away, or `cancel` fires (shutdown).
pub async fn run(
    source: Source,
    session_id: String,
    from_seq: u64,
    follow: bool,
    tx: mpsc::Sender<Result<EventRun, StoreError>>,
    cancel: CancellationToken,
) {
    let _counted = crate::metrics::Subscriber::open();
    // Register before reading history: nothing published from now on can be missed. The
    // tombstone is looked for after registering: one published before is seen here, one
    // published after comes through the hub.
    let mut live = follow.then(|| source.shared.hub.subscribe(&session_id));
    let mut next = from_seq.max(1);
    let result = async {
        if source
            .shared
            .is_deleted(&session_id)
            .map_err(Stop::Failed)?
        {
            return Err(Stop::Failed(rules::session_deleted(&session_id)));
        }
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
                Ok(Live::Deleted) => {
                    return Err(Stop::Failed(rules::session_deleted(&session_id)));
                }
                Ok(Live::Events(events)) => {
                    let mut run = Vec::with_capacity(events.len());
                    for event in events.iter() {
                        if event.seq < next {
                            continue; // already delivered from history
                        }
                        if event.seq > next {
                            // Cannot happen while we hold the receiver, but a gap is never
                            // acceptable: fill it from disk.
                            send(&tx, EventRun::Decoded(std::mem::take(&mut run))).await?;
                            next = catch_up(&source, &session_id, next, &tx).await?;
                            if event.seq < next {
                                continue;
                            }
                        }
                        run.push(event.clone());
                        next = event.seq + 1;
                    }
                    send(&tx, EventRun::Decoded(run)).await?;
                }
                Err(RecvError::Lagged(skipped)) => {
                    tracing::debug!(
                        session_id,
                        skipped,
                        next,
                        "subscriber fell behind the live buffer; catching up from disk"
                    );
                    next = catch_up(&source, &session_id, next, &tx).await?;
                }
                Err(RecvError::Closed) => {
                    if source
                        .shared
                        .is_deleted(&session_id)
                        .map_err(Stop::Failed)?
                    {
                        return Err(Stop::Failed(rules::session_deleted(&session_id)));
                    }
                    return Ok(());
                }
            }
        }
    }
    .await;
    if let Err(Stop::Failed(mut e)) = result {
        if source.shared.is_deleted(&session_id).unwrap_or(false) {
            e = rules::session_deleted(&session_id);
        } else {
            tracing::error!(session_id, error = %e, "subscription failed");
        }
        let _ = tx.send(Err(e)).await;
    }
}

enum Stop {
    /// The receiver went away.
    Gone,
    Failed(StoreError),
}

/// Hands a run of events to the service (none: nothing to do).
async fn send(tx: &mpsc::Sender<Result<EventRun, StoreError>>, run: EventRun) -> Result<(), Stop> {
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
    tx: &mpsc::Sender<Result<EventRun, StoreError>>,
) -> Result<u64, Stop> {
    let _counted = crate::metrics::CatchingUp::enter();
    loop {
        let source = source.clone();
        let id = session_id.to_string();
        let (pieces, after) = tokio::task::spawn_blocking(move || read_chunk(&source, &id, next))
            .await
            .map_err(|e| Stop::Failed(StoreError::Internal(e.to_string())))?
            .map_err(Stop::Failed)?;
        if pieces.is_empty() {
            return Ok(next);
        }
        next = after;
        for piece in pieces {
            send(tx, EventRun::Framed(piece)).await?;
        }
    }
}

/// Reads up to one chunk of consecutive events from `from` on, in their wire form (a piece
/// per read); returns them and the seq after the last. A fork's seqs that it shares with
/// its base are read from the base's log (down the line of bases), given the fork's id.
fn read_chunk(
    source: &Source,
    session_id: &str,
    from: u64,
) -> Result<(Vec<FramedEvents>, u64), StoreError> {
    let (pieces, next, owner) = read_up_to(source, session_id, from, u64::MAX)?;
    if owner == session_id {
        return Ok((pieces, next));
    }
    Ok((pieces.iter().map(|p| p.renamed(session_id)).collect(), next))
}

/// [`read_chunk`] of the session's seqs up to `up_to`, as they are stored: with the id of
/// the session whose log holds them (returned too).
pub(crate) fn read_up_to(
    source: &Source,
    session_id: &str,
    from: u64,
    up_to: u64,
) -> Result<(Vec<FramedEvents>, u64, String), StoreError> {
    let mut tries = 0;
    loop {
        let meta = source.shared.get(session_id)?;
        let Some((base, base_seq)) = meta
            .as_ref()
            .and_then(|m| Some((m.base_of(from)?.to_string(), m.base_seq)))
        else {
            let (pieces, next) = read_own(source, session_id, from, up_to)?;
            return Ok((pieces, next, session_id.to_string()));
        };
        let read = read_up_to(source, &base, from, up_to.min(base_seq)).and_then(|read| {
            if read.1 > from {
                Ok(read)
            } else {
                Err(StoreError::Internal(format!(
                    "{session_id}/{from} is not in the log of {base}, its base"
                )))
            }
        });
        match read {
            Ok(read) => return Ok(read),
            // The prefix was made the fork's own, and the base's records left the log,
            // between the look at the fork's state and the read: read again.
            Err(e) => {
                tries += 1;
                let now = source.shared.get(session_id)?;
                if tries > 2 || now.as_ref().map(|m| &m.base_session) == Some(&base) {
                    return Err(e);
                }
            }
        }
    }
}

/// The session's own events from `from` on, up to `up_to`.
fn read_own(
    source: &Source,
    session_id: &str,
    from: u64,
    up_to: u64,
) -> Result<(Vec<FramedEvents>, u64), StoreError> {
    if from > up_to {
        return Ok((Vec::new(), from));
    }
    let limit = usize::try_from(up_to - from + 1).map_or(HISTORY_CHUNK, |n| n.min(HISTORY_CHUNK));
    // The recent ones first, then the index: the writer forgets a recent position only
    // after the index holds it, so every durable event is in one or the other. (Either may
    // hold the newer seqs: a fork's prefix made its own is recent after its newer events.)
    let recent = source.shared.recent.positions(session_id, from, limit);
    let indexed = source.index.positions(session_id, from, limit)?;
    let mut positions: Vec<Position> = Vec::with_capacity(limit);
    let (mut recent, mut indexed) = (
        recent.into_iter().peekable(),
        indexed.into_iter().peekable(),
    );
    let mut next = from;
    while positions.len() < limit {
        while recent.next_if(|(seq, _)| *seq < next).is_some() {}
        while indexed.next_if(|(seq, _)| *seq < next).is_some() {}
        let found = match (recent.peek().copied(), indexed.peek().copied()) {
            (Some((seq, position)), _) if seq == next => position,
            (_, Some((seq, position))) if seq == next => position,
            (_, Some((seq, _))) => {
                return Err(StoreError::Internal(format!(
                    "index of session {session_id} jumps from seq {next} to {seq}"
                )));
            }
            _ => break,
        };
        positions.push(found);
        next += 1;
    }
    let mut pieces = Vec::new();
    let mut seq = from;
    source.log.read_runs(&positions, |run| {
        let count = run.records.len() as u64;
        pieces.push(super::framed::from_stored(run, session_id, seq)?);
        seq += count;
        Ok::<_, StoreError>(())
    })?;
    Ok((pieces, next))
}

/// Where the session's event `seq` is in the log (in the log of its base, for a seq of a
/// fork's shared prefix), if it is durable.
pub fn position_of(
    source: &Source,
    session_id: &str,
    seq: u64,
) -> Result<Option<Position>, StoreError> {
    let mut session = session_id.to_string();
    while let Some(base) = source
        .shared
        .get(&session)?
        .and_then(|m| m.base_of(seq).map(str::to_string))
    {
        session = base;
    }
    let recent = source.shared.recent.positions(&session, seq, 1);
    if let Some(&(s, position)) = recent.first() {
        if s == seq {
            return Ok(Some(position));
        }
    }
    Ok(source
        .index
        .positions(&session, seq, 1)?
        .into_iter()
        .find(|(s, _)| *s == seq)
        .map(|(_, position)| position))
}
