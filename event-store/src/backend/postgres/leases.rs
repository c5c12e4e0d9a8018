//! The lease calls (acquire, renew, release): a lease rule ([`crate::rules`]) run against
//! the session's state and its outcome written over the row, version-checked like every
//! write.
//!
//! Promises:
//! - Epochs never repeat: a grant is written before it is returned, and it lands only on
//!   the state it was decided against (the row still at that version), so two grants of
//!   one session on any replicas never both land on the same epoch.
//! - A refusal is decided against a state read fresh, never against the cache.

use std::sync::Arc;

use agentlog_proto::v1::Lease;

use super::connection::timed;
use super::replica::{contended, Cached, Replica, MAX_ATTEMPTS};
use super::rows::Columns;
use crate::clock::now_unix_ms;
use crate::rules;
use crate::session::{lease_of, LeaseRecord, SessionMeta};
use crate::StoreError;

impl Replica {
    pub(super) async fn acquire_lease(
        &self,
        session_id: String,
        owner: String,
        ttl_ms: u64,
    ) -> Result<Lease, StoreError> {
        self.change_session(&session_id, |meta, now| {
            let record = rules::acquire(meta, &session_id, owner.clone(), ttl_ms, now)?;
            Ok((Some(with_lease(meta, &record)), lease_of(&record)))
        })
        .await
    }

    pub(super) async fn renew_lease(
        &self,
        session_id: String,
        owner: String,
        epoch: u64,
        ttl_ms: u64,
    ) -> Result<Lease, StoreError> {
        self.change_session(&session_id, |meta, now| {
            let record = rules::renew(meta, &session_id, &owner, epoch, ttl_ms, now)?;
            Ok((Some(with_lease(meta, &record)), lease_of(&record)))
        })
        .await
    }

    pub(super) async fn release_lease(
        &self,
        session_id: String,
        owner: String,
        epoch: u64,
    ) -> Result<(), StoreError> {
        self.change_session(&session_id, |meta, now| {
            let released = rules::release(meta, &session_id, &owner, epoch, now)?;
            Ok((released.map(|record| with_lease(meta, &record)), ()))
        })
        .await
    }

    /// Runs a lease rule against the session's state and writes the outcome, re-reading
    /// and re-running while the state it used was stale. `rule` returns the new state to
    /// write (or `None`: nothing to write) and the answer.
    async fn change_session<T>(
        &self,
        session_id: &str,
        rule: impl Fn(&SessionMeta, i64) -> Result<(Option<SessionMeta>, T), StoreError>,
    ) -> Result<T, StoreError> {
        let client = self.client().await?;
        let mut state = self.cached(session_id);
        let mut fresh = false;
        for _ in 0..MAX_ATTEMPTS {
            let current = state.take();
            if let Err(e) = rules::existing(current.as_ref().map(|s| &*s.meta), session_id) {
                if fresh {
                    return Err(e);
                }
                state = Some(self.refresh(&client, session_id, &[]).await?.0);
                fresh = true;
                continue;
            }
            let current = current.expect("checked above");
            let now = now_unix_ms();
            match rule(&current.meta, now) {
                Ok((Some(meta), answer)) => {
                    if let Some(version) = self
                        .write_meta(&client, session_id, current.version, &meta)
                        .await?
                    {
                        let meta = Arc::new(meta);
                        self.remember(
                            session_id,
                            &Cached {
                                version,
                                meta: meta.clone(),
                            },
                        );
                        self.changed(session_id, &meta, now);
                        return Ok(answer);
                    }
                }
                Ok((None, answer)) if fresh => return Ok(answer),
                Err(e) if fresh => return Err(e),
                Ok(_) | Err(_) => {}
            }
            state = Some(self.refresh(&client, session_id, &[]).await?.0);
            fresh = true;
        }
        Err(contended(session_id))
    }

    /// Writes `meta` over the session's row if it is still at `version`; the new version,
    /// or `None` if someone wrote in between.
    async fn write_meta(
        &self,
        client: &deadpool_postgres::Object,
        session_id: &str,
        version: i64,
        meta: &SessionMeta,
    ) -> Result<Option<i64>, StoreError> {
        let columns = Columns::of(meta);
        let result = timed("write_session", async {
            let stmt = client
                .prepare_cached(
                    "UPDATE agentlog_sessions SET version = version + 1, meta = $3, \
                     last_seq = $4, updated_unix_ms = $5, status = $6, \
                     lease_expires_unix_ms = $7, \
                     first_user_text = CASE first_user_text WHEN '' THEN $8 \
                     ELSE first_user_text END \
                     WHERE session_id = $1 AND version = $2 RETURNING version",
                )
                .await?;
            client
                .query_opt(
                    &stmt,
                    &[
                        &session_id,
                        &version,
                        &columns.meta,
                        &columns.last_seq,
                        &columns.updated,
                        &columns.status,
                        &columns.lease_expires,
                        &columns.first_user_text,
                    ],
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

fn with_lease(meta: &SessionMeta, record: &LeaseRecord) -> SessionMeta {
    let mut meta = meta.clone();
    meta.apply_lease(record);
    meta
}
