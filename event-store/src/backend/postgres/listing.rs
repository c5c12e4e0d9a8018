//! GetSession and ListSessions: a session's info, and the listing, most recently updated
//! first, with its filters (status, scope, text) and paging ([`crate::queries`]).
//!
//! Promises:
//! - A page costs the page: the listing walks the index on `updated_second` (or on
//!   `(status, updated_second)` for a rare status) in order from the page token on, so a
//!   later page starts its walk where the previous one ended (see [`super::schema`]).
//! - A `query` walks at most [`crate::queries::QUERY_SCAN`] sessions per page, matching
//!   the text on each, and a page that ends where the walk stopped carries a token to go
//!   on from there.
//! - Deleted sessions are never listed; GetSession answers a deleted one with its refusal.

use agentlog_proto::v1::{ListSessionsRequest, ListSessionsResponse, SessionInfo};

use super::connection::timed;
use super::replica::Replica;
use super::rows::decode_meta;
use crate::clock::now_unix_ms;
use crate::queries::{self, ListQuery};
use crate::rules;
use crate::scope::Scope;
use crate::StoreError;

impl Replica {
    pub(super) async fn get_session(&self, session_id: &str) -> Result<SessionInfo, StoreError> {
        let client = self.client().await?;
        let (state, _) = self.refresh(&client, session_id, &[]).await?;
        let meta = rules::existing(Some(&state.meta), session_id)?;
        Ok(meta.info(session_id, now_unix_ms()))
    }

    pub(super) async fn list_sessions(
        &self,
        req: &ListSessionsRequest,
        scope: &Scope,
    ) -> Result<ListSessionsResponse, StoreError> {
        let query = ListQuery::parse(req)?;
        let all = scope.is_everything();
        let prefixes: Vec<String> = scope
            .prefix_list()
            .map(<[String]>::to_vec)
            .unwrap_or_default();
        let (after_t, after_id) = match &query.after {
            Some((t, id)) => (Some(*t), id.clone()),
            None => (None, String::new()),
        };
        // The bound on the indexed `updated_second` (the same division PostgreSQL computes
        // it with), so that a later page starts its index walk where the previous ended.
        let after_second = after_t.map_or(i64::MAX, |t| t / 1000);
        let client = self.client().await?;
        if !query.text.is_empty() {
            return self
                .list_by_text(
                    &client,
                    &query,
                    (all, &prefixes),
                    (after_t, &after_id, after_second),
                )
                .await;
        }
        let limit = query.page_size as i64 + 1;
        // A statement per status filter, the status written into it, so that the planner
        // (which plans once for every call, `force_generic_plan`) knows how rare it is: a
        // rare status walks the (status, update time) index, a common one the update
        // time's; either way in order, so a page costs the page.
        let status = query.status as i32;
        let status_filter = if status == 0 {
            "$3 = 0".to_string()
        } else {
            format!("$3 = {status} AND status = {status}")
        };
        let sql = format!(
            "SELECT session_id, meta FROM agentlog_sessions \
             WHERE deleted_unix_ms = 0 AND last_seq > 0 \
             AND ($1 OR EXISTS (SELECT 1 FROM unnest($2::text[]) p \
             WHERE starts_with(session_id, p))) \
             AND {status_filter} \
             AND updated_second <= $7 \
             AND ($4::bigint IS NULL OR updated_unix_ms < $4 \
             OR (updated_unix_ms = $4 AND session_id > $5)) \
             ORDER BY updated_second DESC, updated_unix_ms DESC, session_id \
             LIMIT $6"
        );
        let rows = timed("list_sessions", async {
            let stmt = client.prepare_cached(&sql).await?;
            client
                .query(
                    &stmt,
                    &[
                        &all,
                        &prefixes,
                        &(query.status as i32),
                        &after_t,
                        &after_id,
                        &limit,
                        &after_second,
                    ],
                )
                .await
        })
        .await
        .map_err(|e| self.timed_error(e))?;
        let now = now_unix_ms();
        let mut sessions = Vec::with_capacity(rows.len());
        for row in &rows {
            let id: String = row.get(0);
            let meta = decode_meta(row.get(1))?;
            sessions.push((meta.updated_unix_ms, id.clone(), meta.info(&id, now)));
        }
        // Already in ListSessions order (the query's ORDER BY).
        Ok(query.page(sessions))
    }

    /// `ListSessions` with a `query`: walks at most [`queries::QUERY_SCAN`] sessions of the
    /// listing from the page token on (the text is matched on each), and a page that ends
    /// where the walk stopped carries a token to go on from there.
    async fn list_by_text(
        &self,
        client: &deadpool_postgres::Object,
        query: &ListQuery,
        (all, prefixes): (bool, &[String]),
        (after_t, after_id, after_second): (Option<i64>, &str, i64),
    ) -> Result<ListSessionsResponse, StoreError> {
        let walk = queries::QUERY_SCAN as i64;
        let rows = timed("list_sessions", async {
            let stmt = client
                .prepare_cached(
                    "WITH walked AS MATERIALIZED (\
                     SELECT session_id, meta, updated_second, updated_unix_ms, \
                     (strpos(lower(session_id), $4) > 0 \
                     OR strpos(lower(first_user_text), $4) > 0) AS hit \
                     FROM agentlog_sessions WHERE deleted_unix_ms = 0 AND last_seq > 0 \
                     AND ($1 OR EXISTS (SELECT 1 FROM unnest($2::text[]) p \
                     WHERE starts_with(session_id, p))) \
                     AND ($3 = 0 OR status = $3) \
                     AND updated_second <= $8 \
                     AND ($5::bigint IS NULL OR updated_unix_ms < $5 \
                     OR (updated_unix_ms = $5 AND session_id > $6)) \
                     ORDER BY updated_second DESC, updated_unix_ms DESC, session_id \
                     LIMIT $7) \
                     SELECT session_id, CASE WHEN hit THEN meta END, hit, updated_unix_ms \
                     FROM walked \
                     ORDER BY updated_second DESC, updated_unix_ms DESC, session_id",
                )
                .await?;
            client
                .query(
                    &stmt,
                    &[
                        &all,
                        &prefixes,
                        &(query.status as i32),
                        &query.text,
                        &after_t,
                        &after_id,
                        &walk,
                        &after_second,
                    ],
                )
                .await
        })
        .await
        .map_err(|e| self.timed_error(e))?;
        let now = now_unix_ms();
        let mut sessions = Vec::new();
        for row in &rows {
            if !row.get::<_, bool>(2) {
                continue;
            }
            let id: String = row.get(0);
            let meta = decode_meta(row.get(1))?;
            sessions.push((meta.updated_unix_ms, id.clone(), meta.info(&id, now)));
            if sessions.len() > query.page_size {
                break;
            }
        }
        let looked_to = (rows.len() as i64 >= walk).then(|| {
            let last = rows.last().expect("walked");
            (last.get::<_, i64>(3), last.get::<_, String>(0))
        });
        Ok(query.page_through(sessions, looked_to))
    }
}
