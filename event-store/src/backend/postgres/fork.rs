//! ForkSession: a new session whose log starts as its parent's prefix, made in one step,
//! sharing that prefix instead of copying it.
//!
//! The parent's events `1..=at_seq` are folded into the fork's state and the settled-point
//! check ([`crate::rules::ForkPoint`], [`crate::rules::plan_fork`], the rules every backend
//! forks by), read down the parent's line of bases ([`super::rows::line_cte`]). The fork's
//! row then names the parent as its base (`base_session`, `base_seq`), and only the
//! request's new events get rows of their own: reads and dedup go down the line.
//!
//! Promises:
//! - A fork is written in one transaction that locks its parent's row live: a deletion of
//!   the parent waits for it, or it finds the tombstone and refuses, so the erasure of the
//!   parent's rows always finds the fork and gives it its prefix first (see
//!   [`super::deletion`]).
//! - A fork of a session that exists (or is being created at the same time) is refused,
//!   and writes nothing.

use std::sync::Arc;

use agentlog_proto::v1::ForkSessionResponse;

use super::connection::{timed, Timed, STATEMENT_DEADLINE};
use super::replica::{Cached, Replica};
use super::rows::{line_cte, Columns, SearchRows, READ_BATCH};
use crate::backend::{local, ForkOp};
use crate::clock::now_unix_ms;
use crate::rules;
use crate::StoreError;

impl Replica {
    pub(super) async fn fork(&self, op: ForkOp) -> Result<ForkSessionResponse, StoreError> {
        let client = self.client().await?;
        let (existing, _) = self.refresh(&client, &op.new_session_id, &[]).await?;
        rules::fork_target(Some(&existing.meta), &op.new_session_id)?;
        let (parent, _) = self.refresh(&client, &op.parent, &[]).await?;
        drop(client);
        let last_seq = rules::existing(Some(&parent.meta), &op.parent)?.last_seq;
        let mut events = op.events;
        for event in &mut events {
            if event.event_id.is_empty() {
                event.set_event_id(crate::ids::random_uuid().to_string());
            }
        }
        let now = now_unix_ms();
        let mut point = rules::ForkPoint::new(op.at_seq);
        let mut state =
            rules::ForkPrefix::new(&op.new_session_id, &op.parent, op.at_seq, &events, now);
        self.fold_prefix(&op.parent, op.at_seq, &mut point, &mut state)
            .await?;
        point.verdict(&op.parent, last_seq)?;
        let plan = rules::plan_fork(state, events, now)?;
        let Some(version) = self.write_fork(&plan, &op.parent, op.at_seq).await? else {
            return Err(rules::session_exists(&op.new_session_id));
        };
        let meta = Arc::new(plan.meta);
        self.remember(
            &op.new_session_id,
            &Cached {
                version,
                meta: meta.clone(),
            },
        );
        self.changed(&op.new_session_id, &meta, now);
        Ok(ForkSessionResponse {
            session_id: op.new_session_id,
            last_seq: meta.last_seq,
        })
    }

    /// Folds the parent's events from seq 1 into the fork's state and the settled-point
    /// check, reading the rows down the parent's line (`line_cte`): `1..=at_seq` in one
    /// streamed statement, then, only if `at_seq` is not settled, on to the next settled
    /// seq to name it in the refusal. Each event is parsed only as far as the state needs.
    async fn fold_prefix(
        &self,
        parent: &str,
        at_seq: u64,
        point: &mut rules::ForkPoint,
        state: &mut rules::ForkPrefix,
    ) -> Result<(), StoreError> {
        use futures::TryStreamExt;
        let client = self.client().await?;
        let stmt = timed(
            "fork",
            client.prepare_cached(concat!(
                line_cte!(),
                "SELECT e.body FROM line l CROSS JOIN LATERAL (\
                 SELECT seq, body FROM agentlog_events WHERE session_id = l.sid \
                 AND seq >= $2 AND seq <= least(l.hi, $3)) e ORDER BY e.seq"
            )),
        )
        .await
        .map_err(|e| self.timed_error(e))?;
        let undecodable = |e| StoreError::Internal(format!("a stored event: {e}"));
        let mut from = 1i64;
        let mut to = at_seq as i64;
        loop {
            let params: [&(dyn tokio_postgres::types::ToSql + Sync); 3] = [&parent, &from, &to];
            let rows = timed("fork", client.query_raw(&stmt, params))
                .await
                .map_err(|e| self.timed_error(e))?;
            futures::pin_mut!(rows);
            let mut read = 0;
            loop {
                let row = tokio::time::timeout(STATEMENT_DEADLINE, rows.try_next())
                    .await
                    .map_err(|_| self.timed_error(Timed::Elapsed))?
                    .map_err(|e| self.timed_error(Timed::Db(e)))?;
                let Some(row) = row else { break };
                read += 1;
                let body: &[u8] = row.get(0);
                let event = local::log::record::event_for_state(body, state.wants_text())
                    .map_err(undecodable)?;
                let done = point.apply(&event);
                if event.seq <= at_seq {
                    state.apply(&event);
                }
                if done {
                    return Ok(());
                }
            }
            if read < to - from + 1 {
                return Ok(()); // The log ends here.
            }
            from = to + 1;
            to = from + READ_BATCH - 1;
        }
    }

    /// Writes a planned fork in one transaction: the parent's row is locked and must still
    /// be live (a deletion of the parent waits for this transaction, or this one finds the
    /// tombstone and refuses: so the erasure of the parent's rows always finds the fork and
    /// materializes its prefix first, see [`super::deletion`]); then the fork's row, naming the
    /// parent as its base (a session that exists, or is being created by an append or
    /// another fork, refuses it); then the request's new events. The prefix is not written:
    /// the row's `base_session` and `base_seq` columns name it (the state in `meta` does
    /// not: they change, when the prefix is materialized, without a new version).
    /// `None` if the session exists.
    async fn write_fork(
        &self,
        plan: &rules::ForkPlan,
        parent: &str,
        at_seq: u64,
    ) -> Result<Option<i64>, StoreError> {
        let mut client = self.client().await?;
        let columns = Columns::of(&plan.meta);
        let session_id = plan.record.session_id.as_str();
        let tx = timed("fork", client.transaction())
            .await
            .map_err(|e| self.timed_error(e))?;
        let live = timed(
            "fork",
            tx.query_opt(
                "SELECT 1 FROM agentlog_sessions WHERE session_id = $1 \
                 AND deleted_unix_ms = 0 FOR SHARE",
                &[&parent],
            ),
        )
        .await
        .map_err(|e| self.timed_error(e))?;
        if live.is_none() {
            return Err(rules::session_deleted(parent));
        }
        let created = timed(
            "fork",
            tx.query_opt(
                "INSERT INTO agentlog_sessions (session_id, version, meta, last_seq, \
                 updated_unix_ms, status, lease_expires_unix_ms, first_user_text, \
                 base_session, base_seq) \
                 VALUES ($1, 1, $2, $3, $4, $5, $6, $7, $8, $9) \
                 ON CONFLICT (session_id) DO NOTHING RETURNING version",
                &[
                    &session_id,
                    &columns.meta,
                    &columns.last_seq,
                    &columns.updated,
                    &columns.status,
                    &columns.lease_expires,
                    &columns.first_user_text,
                    &parent,
                    &(at_seq as i64),
                ],
            ),
        )
        .await
        .map_err(|e| self.timed_error(e))?;
        let Some(created) = created else {
            return Ok(None);
        };
        if !plan.fresh.is_empty() {
            let seqs: Vec<i64> = plan.fresh.iter().map(|e| e.seq as i64).collect();
            let ids: Vec<&str> = plan.fresh.iter().map(|e| e.event_id.as_str()).collect();
            let bodies: Vec<Vec<u8>> = plan.fresh.iter().map(|e| e.encode_to_vec()).collect();
            timed(
                "fork",
                tx.execute(
                    "INSERT INTO agentlog_events (session_id, seq, event_id, body) \
                     SELECT $1, seq, event_id, body \
                     FROM unnest($2::bigint[], $3::text[], $4::bytea[]) AS ev(seq, event_id, body)",
                    &[&session_id, &seqs, &ids, &bodies],
                ),
            )
            .await
            .map_err(|e| self.timed_error(e))?;
        }
        if self.search {
            // The fork's searchable text: its parent's up to the fork point (the parent's
            // rows hold its whole log, its own prefix included), then its new events'.
            let mut rows = SearchRows::default();
            plan.fresh.iter().for_each(|e| rows.add(session_id, e));
            timed(
                "fork",
                tx.execute(
                    "INSERT INTO agentlog_search (session_id, seq, ts_unix_ms, kind, body, words) \
                     SELECT $1::text, seq, ts_unix_ms, kind, body, words FROM agentlog_search \
                     WHERE session_id = $2::text AND seq <= $3::bigint \
                     UNION ALL \
                     SELECT $1::text, seq, ts_unix_ms, kind, body, words::tsvector \
                     FROM unnest($4::bigint[], $5::bigint[], $6::text[], $7::text[], $8::text[]) \
                     AS x(seq, ts_unix_ms, kind, body, words)",
                    &[
                        &session_id,
                        &parent,
                        &(at_seq as i64),
                        &rows.seqs,
                        &rows.times,
                        &rows.kinds,
                        &rows.bodies,
                        &rows.words,
                    ],
                ),
            )
            .await
            .map_err(|e| self.timed_error(e))?;
        }
        timed("fork", tx.commit())
            .await
            .map_err(|e| self.timed_error(e))?;
        Ok(Some(created.get(0)))
    }
}
