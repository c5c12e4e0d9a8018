//! Retention (`--retain-idle`): every session idle past the span and holding no live lease
//! is deleted as DeleteSession deletes it ([`crate::rules::expired`] decides which), by one
//! replica at a time.
//!
//! Promises:
//! - One replica at a time: a pass runs only on the replica that holds [`RETENTION_LOCK`],
//!   an advisory lock of a connection of the pass's own, so it goes with that connection
//!   should the replica die in the middle; the others skip the pass.
//! - A session written since its step read it is left for the next pass: its tombstone is
//!   version-checked, as every write is.
//! - Appends pass between the steps: a pass deletes at most [`BATCH`] sessions a step and
//!   rests between steps so that it keeps the database busy only
//!   [`RETENTION_BUSY_SHARE`] of the time.
//! - Crash points are the deletion's (see [`super::deletion`]): a tombstone's erasure
//!   left unfinished is taken up by the sweep.

use std::sync::Arc;
use std::time::Duration;

use prost::Message;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::connection::{timed, Connector, Timed, CONNECTION_SETTINGS};
use super::deletion::erase;
use super::replica::Replica;
use super::rows::decode_meta;
use super::wake::Board;
use crate::backend::Expiring;
use crate::clock::now_unix_ms;
use crate::retention::{Retention, BATCH};
use crate::rules;
use crate::session::SessionMeta;
use crate::StoreError;

/// The share of the time a retention pass keeps the database busy: it rests between its
/// steps (measured, a pass deleting 100,000 sessions against appends at 64 clients: no
/// rest, p99 2.4x the same load alone; busy half the time, 1.52x and 1.94x; a third, 1.08x
/// and 1.44x, the pass taking 25-27 s; bench/RESULTS.md).
const RETENTION_BUSY_SHARE: f64 = 1.0 / 3.0;
/// Retention's advisory lock: the replica that holds it runs the pass, the others skip it.
pub const RETENTION_LOCK: i64 = 0x6167_656e_745f_7265; // "agent_re"

impl Replica {
    /// What a retention step would take now (as its statement reads them), each with its
    /// row version: the archive's candidates.
    pub(super) async fn expiring(
        &self,
        idle_before: i64,
        max: usize,
    ) -> Result<Vec<Expiring>, StoreError> {
        let client = self.client().await?;
        let now = now_unix_ms();
        let rows = timed(
            "retention",
            client.query(
                "SELECT session_id, version, meta FROM agentlog_sessions \
                 WHERE updated_second <= $1 AND updated_unix_ms < $2 \
                 AND deleted_unix_ms = 0 AND last_seq > 0 AND NOT pinned \
                 AND lease_expires_unix_ms <= $3 ORDER BY updated_second LIMIT $4",
                &[&(idle_before / 1000), &idle_before, &now, &(max as i64)],
            ),
        )
        .await
        .map_err(|e| self.timed_error(e))?;
        let mut expiring = Vec::with_capacity(rows.len());
        for row in &rows {
            if rules::expired(&decode_meta(row.get(2))?, idle_before, now) {
                expiring.push(Expiring {
                    session_id: row.get(0),
                    read_at: row.get(1),
                });
            }
        }
        Ok(expiring)
    }

    /// Deletes the session as DeleteSession does if its row is still at the version
    /// [`Replica::expiring`] read.
    pub(super) async fn delete_expiring(&self, expiring: &Expiring) -> Result<bool, StoreError> {
        let deleted = self
            .delete_at_version(&expiring.session_id, expiring.read_at)
            .await?;
        if deleted {
            crate::metrics::sessions_deleted("retention", 1);
        }
        Ok(deleted)
    }
}

/// Retention: every `retention.interval`, the replica that gets [`RETENTION_LOCK`] runs a
/// pass; the others skip it.
pub(super) async fn run_retention(
    connector: Arc<Connector>,
    board: Arc<Board>,
    notify: Option<mpsc::UnboundedSender<(String, bool)>>,
    retention: Retention,
    stop: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = tokio::time::sleep(retention.interval) => {}
            _ = stop.cancelled() => return,
        }
        let pass = retention_pass(&connector, &board, notify.as_ref(), retention);
        let result = tokio::select! {
            result = pass => result,
            _ = stop.cancelled() => return,
        };
        if let Err(e) = result {
            tracing::warn!(error = %e, "a retention pass stopped; the next one tries again");
        }
    }
}

/// One pass of retention, on a connection of its own (the advisory lock is the
/// connection's: it goes with it, should this replica die in the middle): steps of at most
/// [`BATCH`] sessions, each read, decided by [`rules::expired`], tombstoned in one
/// version-checked statement (a session written since it was read is left for the next
/// pass) and erased, until no idle session is left.
async fn retention_pass(
    connector: &Connector,
    board: &Board,
    notify: Option<&mpsc::UnboundedSender<(String, bool)>>,
    retention: Retention,
) -> Result<(), String> {
    let (client, connection) = connector
        .pg_config
        .connect(connector.tls.clone())
        .await
        .map_err(|e| e.to_string())?;
    let driver = tokio::spawn(connection);
    // Planned as the pool's connections plan (see `Connector::new`).
    for setting in CONNECTION_SETTINGS {
        if let Err(e) = client.batch_execute(setting).await {
            tracing::debug!(error = %e, setting, "not set");
        }
    }
    let locked: bool = client
        .query_one("SELECT pg_try_advisory_lock($1)", &[&RETENTION_LOCK])
        .await
        .map_err(|e| e.to_string())?
        .get(0);
    if !locked {
        driver.abort();
        return Ok(());
    }
    let result = async {
        loop {
            let step_started = std::time::Instant::now();
            let now = now_unix_ms();
            let idle_before = retention.idle_before(now);
            let rows = client
                .query(
                    "SELECT session_id, version, meta FROM agentlog_sessions \
                     WHERE updated_second <= $1 AND updated_unix_ms < $2 \
                     AND deleted_unix_ms = 0 AND last_seq > 0 AND NOT pinned \
                     AND lease_expires_unix_ms <= $3 ORDER BY updated_second LIMIT $4",
                    &[&(idle_before / 1000), &idle_before, &now, &(BATCH as i64)],
                )
                .await
                .map_err(|e| e.to_string())?;
            let mut expired: Vec<(String, i64)> = Vec::with_capacity(rows.len());
            for row in &rows {
                let meta = decode_meta(row.get(2)).map_err(|e| e.to_string())?;
                if rules::expired(&meta, idle_before, now) {
                    expired.push((row.get(0), row.get(1)));
                }
            }
            if expired.is_empty() {
                return Ok(());
            }
            // Locked in session_id order, as the append batches lock them.
            expired.sort_unstable();
            let (ids, versions): (Vec<String>, Vec<i64>) = expired.into_iter().unzip();
            let tombstone = SessionMeta::tombstone(now);
            let deleted: Vec<String> = timed("retention", async {
                client
                    .query(
                        "WITH w AS (SELECT * FROM unnest($1::text[], $2::bigint[]) \
                         AS w(session_id, version)), \
                         t AS (UPDATE agentlog_sessions s SET version = s.version + 1, \
                         meta = $3, last_seq = 0, status = 0, lease_expires_unix_ms = 0, \
                         first_user_text = '', deleted_unix_ms = $4 FROM w \
                         WHERE s.session_id = w.session_id COLLATE \"C\" \
                         AND s.version = w.version RETURNING s.session_id), \
                         e AS (INSERT INTO agentlog_erasures (session_id, deleted_unix_ms) \
                         SELECT session_id, $4 FROM t ON CONFLICT (session_id) DO NOTHING) \
                         SELECT session_id FROM t",
                        &[&ids, &versions, &tombstone.encode_to_vec(), &now],
                    )
                    .await
            })
            .await
            .map_err(|e| match e {
                Timed::Db(e) => e.to_string(),
                Timed::Elapsed => "the database did not answer".to_string(),
            })?
            .iter()
            .map(|row| row.get(0))
            .collect();
            for session_id in &deleted {
                board.wake(session_id, false);
                if let Some(notify) = notify {
                    let _ = notify.send((session_id.clone(), false));
                }
            }
            crate::metrics::sessions_deleted("retention", deleted.len());
            tracing::info!(sessions = deleted.len(), "retention deleted idle sessions");
            erase(&client, &deleted).await?;
            if rows.len() < BATCH || deleted.is_empty() {
                return Ok(());
            }
            // The database's time between steps is the appends' (their commits share its
            // WAL flushes): the pass rests twice as long as each step took.
            let rest = step_started
                .elapsed()
                .mul_f64((1.0 - RETENTION_BUSY_SHARE) / RETENTION_BUSY_SHARE);
            tokio::time::sleep(rest.min(Duration::from_secs(1))).await;
        }
    }
    .await;
    let _ = client
        .execute("SELECT pg_advisory_unlock($1)", &[&RETENTION_LOCK])
        .await;
    driver.abort();
    result
}
