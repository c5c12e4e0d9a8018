//! PutSnapshot and GetSnapshot: the kept snapshot per (session, format), in
//! `agentlog_snapshots`.
//!
//! Promises:
//! - A snapshot is derived data the store never reads: it is kept only for the session's
//!   live lease holder and a seq within the log ([`crate::rules::check_snapshot`]), and
//!   lands only while the session row is at the version that check was made against.
//! - A newer seq replaces an older one, never the reverse.
//! - A deleted session's snapshot is never handed out (the tombstone is read in the same
//!   statement) and goes with its erasure (see [`super::deletion`]).

use super::connection::timed;
use super::replica::{contended, Replica, MAX_ATTEMPTS};
use crate::backend::{Snapshot, SnapshotRead};
use crate::clock::now_unix_ms;
use crate::rules;
use crate::StoreError;

impl Replica {
    pub(super) async fn put_snapshot(
        &self,
        snapshot: Snapshot,
        lease_epoch: u64,
    ) -> Result<u64, StoreError> {
        // Lands only while the session row is at the version the lease was checked against,
        // and only over an older snapshot; says which of the three happened.
        const PUT: &str = "WITH s AS (SELECT 1 FROM agentlog_sessions \
             WHERE session_id = $1 AND version = $2), \
             put AS (INSERT INTO agentlog_snapshots (session_id, format, seq, data) \
             SELECT $1, $3, $4, $5 FROM s ON CONFLICT (session_id, format) DO UPDATE \
             SET seq = excluded.seq, data = excluded.data \
             WHERE agentlog_snapshots.seq <= excluded.seq RETURNING seq) \
             SELECT (SELECT count(*) FROM s), (SELECT seq FROM put), \
             (SELECT seq FROM agentlog_snapshots WHERE session_id = $1 AND format = $3)";
        let client = self.client().await?;
        let seq = snapshot.seq as i64;
        for _ in 0..MAX_ATTEMPTS {
            let (state, _) = self.refresh(&client, &snapshot.session_id, &[]).await?;
            let meta = rules::existing(Some(&state.meta), &snapshot.session_id)?;
            rules::check_snapshot(
                meta,
                &snapshot.session_id,
                lease_epoch,
                snapshot.seq,
                now_unix_ms(),
            )?;
            let row = timed("put_snapshot", async {
                let statement = client.prepare_cached(PUT).await?;
                client
                    .query_one(
                        &statement,
                        &[
                            &snapshot.session_id,
                            &state.version,
                            &snapshot.format,
                            &seq,
                            &snapshot.data,
                        ],
                    )
                    .await
            })
            .await
            .map_err(|e| self.timed_error(e))?;
            let (matched, put, kept): (i64, Option<i64>, Option<i64>) =
                (row.get(0), row.get(1), row.get(2));
            if matched == 0 {
                continue; // The session changed since it was read: check again.
            }
            return Ok(put.or(kept).unwrap_or(seq) as u64);
        }
        Err(contended(&snapshot.session_id))
    }

    pub(super) async fn get_snapshot(
        &self,
        session_id: &str,
        format: &str,
    ) -> Result<Option<SnapshotRead>, StoreError> {
        let client = self.client().await?;
        // The snapshot and whether the session was deleted, as of one moment.
        let row = timed("get_snapshot", async {
            let statement = client
                .prepare_cached(
                    "SELECT (SELECT deleted_unix_ms FROM agentlog_sessions \
                     WHERE session_id = $1), seq, data FROM agentlog_snapshots \
                     RIGHT JOIN (SELECT 1) one ON session_id = $1 AND format = $2",
                )
                .await?;
            client.query_one(&statement, &[&session_id, &format]).await
        })
        .await
        .map_err(|e| self.timed_error(e))?;
        if row
            .get::<_, Option<i64>>(0)
            .is_some_and(|deleted| deleted > 0)
        {
            return Err(rules::session_deleted(session_id));
        }
        let seq: Option<i64> = row.get(1);
        let data: Option<Vec<u8>> = row.get(2);
        let (Some(seq), Some(data)) = (seq, data) else {
            return Ok(None);
        };
        Ok(Some(SnapshotRead {
            seq: seq as u64,
            pieces: Box::pin(futures::stream::once(std::future::ready(Ok(
                bytes::Bytes::from(data),
            )))),
        }))
    }
}
