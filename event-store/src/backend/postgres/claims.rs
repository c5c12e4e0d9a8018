//! ClaimSession: the oldest runnable, unleased session in the caller's scope, granted a
//! lease, waiting up to the caller's deadline for one ([`crate::queries::long_poll_claim`]).
//!
//! Promises:
//! - A claim goes to exactly one claimant: the session's row is picked with
//!   `FOR UPDATE SKIP LOCKED`, so concurrent claimants on any replica take different
//!   sessions and never queue behind each other, and its lease is written in the same
//!   transaction.
//! - A waiting claimant looks again when a session may have become claimable (a wake-up,
//!   see [`super::wake`]), when the next lease runs out, and at the latest every safety
//!   poll.

use std::sync::Arc;
use std::time::Duration;

use agentlog_proto::v1::Lease;
use tokio_util::sync::CancellationToken;

use super::connection::timed;
use super::replica::{Cached, Replica};
use super::rows::{decode_meta, Columns};
use super::schema::RUNNABLE;
use crate::clock::now_unix_ms;
use crate::queries::{long_poll_claim, ClaimAttempt};
use crate::rules;
use crate::scope::Scope;
use crate::session::lease_of;
use crate::StoreError;

impl Replica {
    pub(super) async fn claim(
        &self,
        owner: String,
        ttl_ms: u64,
        wait: Duration,
        cancel: &CancellationToken,
        scope: &Scope,
    ) -> Result<Option<Lease>, StoreError> {
        let changes = self.board.claimable();
        long_poll_claim(wait, cancel, changes, Some(self.poll_interval), || {
            self.try_claim(&owner, ttl_ms, scope)
        })
        .await
    }

    /// One attempt at a claim: the oldest runnable, unleased session in `scope`, locked
    /// with SKIP LOCKED so that concurrent claimants on any replica take different ones.
    async fn try_claim(
        &self,
        owner: &str,
        ttl_ms: u64,
        scope: &Scope,
    ) -> Result<ClaimAttempt, StoreError> {
        let mut client = self.client().await?;
        let now = now_unix_ms();
        let all = scope.is_everything();
        let prefixes: Vec<String> = scope
            .prefix_list()
            .map(<[String]>::to_vec)
            .unwrap_or_default();
        let result = timed("claim", async {
            let tx = client.transaction().await?;
            let picked = tx
                .query_opt(
                    &format!(
                        "SELECT session_id, version, meta FROM agentlog_sessions \
                         WHERE status = {RUNNABLE} AND lease_expires_unix_ms <= $1 \
                         AND ($2 OR EXISTS (SELECT 1 FROM unnest($3::text[]) p \
                         WHERE starts_with(session_id, p))) \
                         ORDER BY updated_unix_ms, session_id LIMIT 1 FOR UPDATE SKIP LOCKED"
                    ),
                    &[&now, &all, &prefixes],
                )
                .await?;
            let Some(row) = picked else {
                let next: Option<i64> = tx
                    .query_one(
                        &format!(
                            "SELECT min(lease_expires_unix_ms) FROM agentlog_sessions \
                             WHERE status = {RUNNABLE} AND lease_expires_unix_ms > $1 \
                             AND ($2 OR EXISTS (SELECT 1 FROM unnest($3::text[]) p \
                             WHERE starts_with(session_id, p)))"
                        ),
                        &[&now, &all, &prefixes],
                    )
                    .await?
                    .get(0);
                tx.commit().await?;
                return Ok(Err(next));
            };
            let session_id: String = row.get(0);
            let version: i64 = row.get(1);
            let bytes: Vec<u8> = row.get(2);
            Ok(Ok((tx, session_id, version, bytes)))
        })
        .await;
        let (tx, session_id, version, bytes) = match result {
            Ok(Ok(picked)) => picked,
            Ok(Err(next_expiry_unix_ms)) => {
                return Ok(ClaimAttempt::Nothing {
                    next_expiry_unix_ms,
                })
            }
            Err(e) => return Err(self.timed_error(e)),
        };
        let mut meta = decode_meta(bytes)?;
        if !rules::claimable(&meta, now) {
            return Ok(ClaimAttempt::Nothing {
                next_expiry_unix_ms: Some(now),
            });
        }
        let record = rules::grant(&meta, &session_id, owner.to_string(), ttl_ms, now);
        meta.apply_lease(&record);
        let columns = Columns::of(&meta);
        let written = timed("claim", async {
            let row = tx
                .query_one(
                    "UPDATE agentlog_sessions SET version = version + 1, meta = $3, \
                     lease_expires_unix_ms = $4 WHERE session_id = $1 AND version = $2 \
                     RETURNING version",
                    &[&session_id, &version, &columns.meta, &columns.lease_expires],
                )
                .await?;
            tx.commit().await?;
            Ok(row.get::<_, i64>(0))
        })
        .await;
        let version = written.map_err(|e| self.timed_error(e))?;
        let meta = Arc::new(meta);
        self.remember(
            &session_id,
            &Cached {
                version,
                meta: meta.clone(),
            },
        );
        self.changed(&session_id, &meta, now);
        Ok(ClaimAttempt::Granted(lease_of(&record)))
    }
}
