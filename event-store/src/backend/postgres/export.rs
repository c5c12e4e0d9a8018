//! What `Export --all` walks: every session id, deleted ones too, in id order (the primary
//! key's), a page a statement, so that sessions made, changed or deleted meanwhile never
//! make the walk miss or repeat one.

use super::connection::timed;
use super::replica::Replica;
use crate::backend::ListedId;
use crate::scope::Scope;
use crate::StoreError;

impl Replica {
    pub(super) async fn session_ids(
        &self,
        after: &str,
        limit: usize,
        scope: &Scope,
    ) -> Result<Vec<ListedId>, StoreError> {
        let all = scope.is_everything();
        let prefixes: Vec<String> = scope
            .prefix_list()
            .map(<[String]>::to_vec)
            .unwrap_or_default();
        let client = self.client().await?;
        let rows = timed("session_ids", async {
            let stmt = client
                .prepare_cached(
                    "SELECT session_id, deleted_unix_ms FROM agentlog_sessions \
                     WHERE session_id > $1 AND (last_seq > 0 OR deleted_unix_ms > 0) \
                     AND ($2 OR EXISTS (SELECT 1 FROM unnest($3::text[]) p \
                     WHERE starts_with(session_id, p))) \
                     ORDER BY session_id LIMIT $4",
                )
                .await?;
            client
                .query(&stmt, &[&after, &all, &prefixes, &(limit as i64)])
                .await
        })
        .await
        .map_err(|e| self.timed_error(e))?;
        Ok(rows
            .iter()
            .map(|row| ListedId {
                session_id: row.get(0),
                deleted_unix_ms: row.get(1),
            })
            .collect())
    }
}
