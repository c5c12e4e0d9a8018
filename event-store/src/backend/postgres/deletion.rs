//! DeleteSession and the erasure of deleted sessions' rows.
//!
//! The session row becomes its tombstone (version-checked, like every write, so no append
//! planned against the state before lands after it; a trigger keeps the row from changing
//! again, see [`super::schema`]) with an entry in `agentlog_erasures`, in one statement;
//! then its events and snapshots are deleted in transactions of at most [`ERASE_BATCH`]
//! rows ([`erase`]), by the replica that deleted it, or by any replica's sweep of
//! `agentlog_erasures` ([`sweep_erasures`]) if that one stopped first. Retention deletes
//! the same way (see [`super::retention`]). What PostgreSQL keeps after that (dead tuples
//! until vacuum, WAL and backups) is the cluster's own retention (ARCHITECTURE.md).
//!
//! Before any row goes, every live fork that reads part of its prefix through a deleted
//! session gets that prefix as rows of its own ([`materialize_forks`]), so a fork never
//! reads through a session whose rows are gone.
//!
//! Crash points: a replica that stops after the tombstone leaves its entry in
//! `agentlog_erasures`, and any replica's sweep erases what is left; one that stops in the
//! middle of a materialization leaves each fork whole or untouched (one statement each);
//! one that stops between erasure batches leaves the rest for the sweep. Two erasures of
//! one session at once (a sweep beside the deleting replica) each delete what is left.

use std::sync::Arc;
use std::time::Duration;

use prost::Message;
use tokio_util::sync::CancellationToken;

use super::connection::{timed, Connector, Timed};
use super::replica::{contended, Cached, Replica, MAX_ATTEMPTS};
use crate::clock::now_unix_ms;
use crate::rules::{self, Deletion};
use crate::session::SessionMeta;
use crate::StoreError;

/// Rows one transaction of an erasure deletes at most, so that it never holds many locks
/// or writes much WAL at once.
const ERASE_BATCH: i64 = 5_000;
/// How often every replica looks for erasures left unfinished (by a replica that stopped
/// in the middle of one), and how old one must be to be taken up.
const ERASURE_SWEEP: Duration = Duration::from_secs(30);

impl Replica {
    pub(super) async fn delete_session(&self, session_id: &str) -> Result<(), StoreError> {
        for _ in 0..MAX_ATTEMPTS {
            let client = self.client().await?;
            let (state, _) = self.refresh(&client, session_id, &[]).await?;
            drop(client);
            if let Deletion::AlreadyDeleted = rules::delete(Some(&state.meta), session_id, 0)? {
                return Ok(());
            }
            if self.delete_at_version(session_id, state.version).await? {
                crate::metrics::sessions_deleted("request", 1);
                return Ok(());
            }
            // Written in between: decide again on what is there now.
        }
        Err(contended(session_id))
    }

    /// Tombstones the session if its row is still at `version` (and live), then erases its
    /// rows in the background; whether it did.
    pub(super) async fn delete_at_version(
        &self,
        session_id: &str,
        version: i64,
    ) -> Result<bool, StoreError> {
        let client = self.client().await?;
        {
            let now = now_unix_ms();
            let tombstone = SessionMeta::tombstone(now);
            let Some(version) = self
                .write_tombstone(&client, session_id, version, &tombstone)
                .await?
            else {
                return Ok(false);
            };
            let tombstone = Arc::new(tombstone);
            self.remember(
                session_id,
                &Cached {
                    version,
                    meta: tombstone.clone(),
                },
            );
            // Followers here and on every replica look again and find the tombstone.
            self.changed(session_id, &tombstone, now);
            let connector = self.connector.clone();
            let id = session_id.to_string();
            tokio::spawn(async move {
                let erased = match connector.pool.get().await {
                    Ok(client) => erase(&client, std::slice::from_ref(&id)).await,
                    Err(e) => Err(e.to_string()),
                };
                if let Err(e) = erased {
                    tracing::warn!(session_id = %id, error = %e, "erasing a deleted session's rows stopped; the sweep takes it up again");
                }
            });
            Ok(true)
        }
    }

    /// Writes the session's tombstone over its row if it is still at `version`, with its
    /// entry in `agentlog_erasures`; the new version, or `None` if someone wrote in between.
    async fn write_tombstone(
        &self,
        client: &deadpool_postgres::Object,
        session_id: &str,
        version: i64,
        tombstone: &SessionMeta,
    ) -> Result<Option<i64>, StoreError> {
        let meta = tombstone.encode_to_vec();
        let result = timed("delete_session", async {
            let stmt = client
                .prepare_cached(
                    "WITH t AS (UPDATE agentlog_sessions SET version = version + 1, meta = $3, \
                     last_seq = 0, status = 0, lease_expires_unix_ms = 0, \
                     first_user_text = '', deleted_unix_ms = $4 \
                     WHERE session_id = $1 AND version = $2 RETURNING version), \
                     e AS (INSERT INTO agentlog_erasures (session_id, deleted_unix_ms) \
                     SELECT $1, $4 FROM t ON CONFLICT (session_id) DO NOTHING) \
                     SELECT version FROM t",
                )
                .await?;
            client
                .query_opt(
                    &stmt,
                    &[&session_id, &version, &meta, &tombstone.deleted_unix_ms],
                )
                .await
        })
        .await;
        match result {
            Ok(row) => Ok(row.map(|r| r.get(0))),
            Err(e) => Err(self.timed_error(e)),
        }
    }
}

/// Deletes deleted sessions' events and snapshots, in transactions of at most
/// [`ERASE_BATCH`] rows, then their `agentlog_erasures` entries, once every live fork that
/// reads through them has its prefix of its own ([`materialize_forks`]). Safe to run twice
/// at once (two replicas, or a sweep beside the deleting replica): each deletes what is
/// left.
pub(super) async fn erase(
    client: &tokio_postgres::Client,
    session_ids: &[String],
) -> Result<(), String> {
    if session_ids.is_empty() {
        return Ok(());
    }
    let failed = |e: Timed| match e {
        Timed::Db(e) => e.to_string(),
        Timed::Elapsed => "the database did not answer".to_string(),
    };
    materialize_forks(client, session_ids).await?;
    // The searchable text first: the words go before anything else of the session. A
    // backfill of the session under way (`search::backfill`) holds its entry: taken first,
    // so that the rows it writes are there to delete.
    timed("erase", async {
        client
            .execute(
                "DELETE FROM agentlog_search_backfill WHERE session_id = ANY($1)",
                &[&session_ids],
            )
            .await
    })
    .await
    .map_err(failed)?;
    loop {
        let deleted = timed("erase", async {
            client
                .execute(
                    "DELETE FROM agentlog_search WHERE (session_id, seq) IN \
                     (SELECT session_id, seq FROM agentlog_search \
                     WHERE session_id = ANY($1) LIMIT $2)",
                    &[&session_ids, &ERASE_BATCH],
                )
                .await
        })
        .await
        .map_err(failed)?;
        if deleted < ERASE_BATCH as u64 {
            break;
        }
    }
    loop {
        let deleted = timed("erase", async {
            client
                .execute(
                    "DELETE FROM agentlog_events WHERE (session_id, seq) IN \
                     (SELECT session_id, seq FROM agentlog_events \
                     WHERE session_id = ANY($1) LIMIT $2)",
                    &[&session_ids, &ERASE_BATCH],
                )
                .await
        })
        .await
        .map_err(failed)?;
        if deleted < ERASE_BATCH as u64 {
            break;
        }
    }
    for statement in [
        "DELETE FROM agentlog_snapshots WHERE session_id = ANY($1)",
        "DELETE FROM agentlog_erasures WHERE session_id = ANY($1)",
    ] {
        timed("erase", async {
            client.execute(statement, &[&session_ids]).await
        })
        .await
        .map_err(failed)?;
    }
    Ok(())
}

/// Materializes the fork `$1` (see [`materialize_forks`]) in one statement: its row locked,
/// if it is still live with a base; the rows of its line up to its `base_seq` inserted as
/// its own, each body's field 1 (the head of the base's id, checked: a body that does not
/// start with it makes the statement fail, nothing written) replaced by `$2`, the fork's;
/// its base dropped. Returns the rows copied and the `base_seq` dropped (0, 0: nothing to
/// do, another replica did it).
const MATERIALIZE: &str = "WITH RECURSIVE fork AS MATERIALIZED (\
    SELECT session_id, base_session, base_seq FROM agentlog_sessions \
    WHERE session_id = $1 AND deleted_unix_ms = 0 \
    AND base_session <> '' FOR UPDATE), \
    line(sid, hi) AS (SELECT base_session, base_seq FROM fork \
    UNION ALL SELECT s.base_session, least(l.hi, s.base_seq) \
    FROM line l JOIN agentlog_sessions s ON s.session_id = l.sid \
    WHERE s.base_session <> ''), \
    copied AS (INSERT INTO agentlog_events (session_id, seq, event_id, body) \
    SELECT $1, e.seq, e.event_id, \
    CASE WHEN substring(e.body FROM 1 FOR octet_length(h.head)) = h.head \
    THEN $2::bytea || substring(e.body FROM octet_length(h.head) + 1) END \
    FROM line l CROSS JOIN LATERAL (SELECT decode('0a', 'hex') || \
    CASE WHEN octet_length(l.sid) < 128 \
    THEN set_byte(decode('00', 'hex'), 0, octet_length(l.sid)) \
    ELSE set_byte(set_byte(decode('0000', 'hex'), 0, \
    octet_length(l.sid) % 128 + 128), 1, octet_length(l.sid) / 128) END \
    || convert_to(l.sid, 'UTF8') AS head) h \
    CROSS JOIN LATERAL (SELECT seq, event_id, body FROM agentlog_events \
    WHERE session_id = l.sid AND seq <= l.hi) e RETURNING seq), \
    dropped AS (UPDATE agentlog_sessions s SET base_session = '', \
    base_seq = 0 FROM fork WHERE s.session_id = fork.session_id \
    RETURNING fork.base_seq) \
    SELECT (SELECT count(*) FROM copied), \
    coalesce((SELECT base_seq FROM dropped), 0)";

/// Gives every live session that reads part of its prefix through one of the deleted
/// `session_ids` (a fork of one, or a fork of a deleted fork of one, and so on) that
/// prefix as rows of its own, before their rows are erased. Each fork in one statement,
/// so one transaction: its row locked (and still live, still with a base), the rows of its
/// line (`line_cte`) up to its `base_seq` inserted as its own, their bodies' field 1 (the
/// session id, which prost writes first) made the fork's, and its base dropped. A replica
/// killed in the middle leaves each fork whole or untouched, and the sweep of
/// `agentlog_erasures` finds the rest. A fork made after the walk cannot read through
/// these sessions: a fork's transaction locks its parent live (see `write_fork`), and a
/// live session found here reads none of them once materialized, nor does any fork of it.
async fn materialize_forks(
    client: &tokio_postgres::Client,
    session_ids: &[String],
) -> Result<(), String> {
    let failed = |e: Timed| match e {
        Timed::Db(e) => e.to_string(),
        Timed::Elapsed => "the database did not answer".to_string(),
    };
    let forks: Vec<String> = timed("erase", async {
        client
            .query(
                "WITH RECURSIVE d(session_id, deleted) AS (\
                 SELECT session_id, deleted_unix_ms > 0 FROM agentlog_sessions \
                 WHERE base_session = ANY($1) AND base_session <> '' \
                 UNION SELECT s.session_id, s.deleted_unix_ms > 0 FROM d \
                 JOIN agentlog_sessions s ON s.base_session = d.session_id \
                 AND s.base_session <> '' WHERE d.deleted) \
                 SELECT session_id FROM d WHERE NOT deleted",
                &[&session_ids],
            )
            .await
    })
    .await
    .map_err(failed)?
    .iter()
    .map(|r| r.get(0))
    .collect();
    for fork in &forks {
        let head = session_id_field(fork);
        let materialized = timed("erase", async {
            client.query_one(MATERIALIZE, &[fork, &head]).await
        })
        .await
        .map_err(failed)?;
        let (copied, expected): (i64, i64) = (materialized.get(0), materialized.get(1));
        if copied != expected {
            // Never reached while every seq of a line is stored. Should it be, the erasure
            // stops here, keeping the base's rows for a person to look at.
            tracing::error!(session_id = %fork, copied, expected, "a fork's materialized prefix is short; the erasure of its base stops");
            return Err(format!(
                "fork {fork}'s materialized prefix is short: {copied} of {expected} events"
            ));
        }
        tracing::info!(session_id = %fork, events = copied, "a fork's prefix materialized before its base's erasure");
    }
    Ok(())
}

/// The start of a stored event's body that holds `session_id` (field 1, which prost
/// writes first): the key, the length and the id.
fn session_id_field(session_id: &str) -> Vec<u8> {
    let mut head = vec![0x0a];
    prost::encoding::encode_varint(session_id.len() as u64, &mut head);
    head.extend_from_slice(session_id.as_bytes());
    head
}

/// Every [`ERASURE_SWEEP`], finishes the erasures that a replica left behind (it stopped,
/// or lost the database, in the middle of one).
pub(super) async fn sweep_erasures(connector: Arc<Connector>, stop: CancellationToken) {
    loop {
        let left: Result<Vec<String>, String> = async {
            let client = connector.pool.get().await.map_err(|e| e.to_string())?;
            let before = now_unix_ms() - ERASURE_SWEEP.as_millis() as i64;
            let rows = client
                .query(
                    "SELECT session_id FROM agentlog_erasures WHERE deleted_unix_ms < $1 \
                     ORDER BY deleted_unix_ms LIMIT 100",
                    &[&before],
                )
                .await
                .map_err(|e| e.to_string())?;
            Ok(rows.iter().map(|r| r.get(0)).collect())
        }
        .await;
        let left = left.unwrap_or_default();
        if !left.is_empty() {
            let erased = match connector.pool.get().await {
                Ok(client) => erase(&client, &left).await,
                Err(e) => Err(e.to_string()),
            };
            if let Err(e) = erased {
                tracing::debug!(error = %e, "an erasure sweep stopped; retrying later");
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(ERASURE_SWEEP) => {}
            _ = stop.cancelled() => return,
        }
    }
}
