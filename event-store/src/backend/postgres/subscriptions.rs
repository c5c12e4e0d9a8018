//! Subscribe: a session's events from a seq on, read from the database in runs of at most
//! [`READ_BATCH`], then, when following, read again whenever the session may have new
//! events.
//!
//! Promises:
//! - No gap and no duplicate: events are handed out in seq order from the next one
//!   expected, and a run stops at any hole (seqs commit in order per session; a hole would
//!   be a bug, never skipped over). History and live are the same reads, so there is no
//!   switch between them to lose an event at.
//! - A follower looks again when woken (a write on this replica, or another's wake-up,
//!   see [`super::wake`]) and at the latest every safety poll (`--poll-interval-ms`), so a
//!   missed wake-up costs latency, never an event.
//! - A follower rides out an outage of the database (reading again with backoff); a
//!   one-off read reports it. A deleted session's subscription ends with its refusal as
//!   soon as its tombstone is committed, before its rows are erased.
//! - A fork's shared prefix is read down its line of bases, each event given the fork's
//!   session id.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use super::connection::{timed, Connector, Timed};
use super::replica::Replica;
use super::rows::{line_cte, READ_BATCH};
use crate::backend::{EventRun, FramedEvents};
use crate::rules;
use crate::StoreError;

impl Replica {
    pub(super) fn subscribe(
        &self,
        session_id: String,
        from_seq: u64,
        follow: bool,
        cancel: CancellationToken,
    ) -> mpsc::Receiver<Result<EventRun, StoreError>> {
        let (tx, rx) = mpsc::channel(crate::backend::QUEUED_RUNS);
        let follower = Follower {
            connector: self.connector.clone(),
            wake: self.board.follow(&session_id),
            session_id,
            next: from_seq.max(1),
            poll_interval: self.poll_interval,
        };
        let cancel = cancel.clone();
        let stop = self.tasks.clone();
        tokio::spawn(async move {
            tokio::select! {
                _ = follower.run(follow, tx) => {}
                _ = cancel.cancelled() => {}
                _ = stop.cancelled() => {}
            }
        });
        rx
    }
}

/// One subscription: reads the session's events from `next` on, in seq order with no gap,
/// and with `follow` keeps reading whenever it is woken or the safety poll comes round.
struct Follower {
    connector: Arc<Connector>,
    wake: watch::Receiver<u64>,
    session_id: String,
    next: u64,
    poll_interval: Duration,
}

impl Follower {
    async fn run(mut self, follow: bool, tx: mpsc::Sender<Result<EventRun, StoreError>>) {
        let mut backoff = Duration::from_millis(100);
        loop {
            self.wake.borrow_and_update();
            let read = self.read().await;
            let full = match read {
                Ok(rows) => {
                    backoff = Duration::from_millis(100);
                    let full = rows.len() as i64 == READ_BATCH;
                    // Seqs commit in order per session; a hole would be a bug, and is never
                    // skipped over.
                    let first = self.next;
                    let gapless = rows
                        .iter()
                        .zip(first..)
                        .take_while(|(row, seq)| row.get::<_, i64>(0) as u64 == *seq)
                        .count();
                    self.next += gapless as u64;
                    let run = FramedEvents::of_messages(
                        rows[..gapless]
                            .iter()
                            .map(|row| (row.get::<_, &[u8]>(1), row.get::<_, bool>(2))),
                        &self.session_id,
                    );
                    if !run.is_empty() && tx.send(Ok(EventRun::Framed(run))).await.is_err() {
                        return;
                    }
                    full
                }
                // A follower rides out an outage; a one-off read reports it, and a refusal
                // (the session was deleted) ends either.
                Err(e) if !follow || e.reason().is_some() => {
                    let _ = tx.send(Err(e)).await;
                    return;
                }
                Err(e) => {
                    tracing::debug!(error = %e, session_id = %self.session_id, "a follower's read failed; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = tx.closed() => return,
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(2));
                    continue;
                }
            };
            if full {
                continue;
            }
            if !follow {
                return;
            }
            tokio::select! {
                _ = self.wake.changed() => {}
                _ = tokio::time::sleep(self.poll_interval) => {}
                _ = tx.closed() => return,
            }
        }
    }

    /// The next events (rows of their seq, their body as stored, and whether it was read
    /// through a base and so must be given the fork's id), or the refusal of a deleted
    /// session: none is read once its tombstone is committed (the erasure of its rows may
    /// still be under way). A fork's shared prefix is read down its line of bases
    /// (`line_cte`).
    async fn read(&self) -> Result<Vec<tokio_postgres::Row>, StoreError> {
        let unavailable = |e: String| StoreError::Unavailable(format!("reading events: {e}"));
        let client = self
            .connector
            .pool
            .get()
            .await
            .map_err(|e| unavailable(e.to_string()))?;
        let failed = |e| match e {
            Timed::Db(e) => unavailable(e.to_string()),
            Timed::Elapsed => unavailable("the database did not answer".into()),
        };
        let rows = timed("read_events", async {
            let stmt = client
                .prepare_cached(concat!(
                    line_cte!(),
                    "SELECT e.seq, e.body, l.sid <> $1 FROM line l CROSS JOIN LATERAL (\
                     SELECT seq, body FROM agentlog_events WHERE session_id = l.sid \
                     AND seq >= $2 AND seq <= l.hi ORDER BY seq LIMIT $3) e \
                     WHERE NOT EXISTS (SELECT 1 FROM agentlog_sessions \
                     WHERE session_id = $1 AND deleted_unix_ms > 0) \
                     ORDER BY e.seq LIMIT $3"
                ))
                .await?;
            client
                .query(&stmt, &[&self.session_id, &(self.next as i64), &READ_BATCH])
                .await
        })
        .await
        .map_err(failed)?;
        if rows.is_empty() {
            let deleted = timed("read_events", async {
                let stmt = client
                    .prepare_cached(
                        "SELECT 1 FROM agentlog_sessions WHERE session_id = $1 \
                         AND deleted_unix_ms > 0",
                    )
                    .await?;
                client.query_opt(&stmt, &[&self.session_id]).await
            })
            .await
            .map_err(failed)?;
            if deleted.is_some() {
                return Err(rules::session_deleted(&self.session_id));
            }
        }
        Ok(rows)
    }
}
