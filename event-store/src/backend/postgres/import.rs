//! Imports on PostgreSQL: a session's rows are written in one transaction of its own,
//! which commits only once every event is in, so the session is visible whole or not at
//! all, on every replica.
//!
//! The transaction starts by inserting the session's row (a placeholder, invisible to
//! every other transaction until the commit), so that a write of the same id through
//! another replica waits for it instead of racing it: after the commit that write finds
//! the imported session and goes on from it; a session that exists already makes the
//! insert find it, and the import is refused (`SESSION_EXISTS`, or `SESSION_DELETED` for a
//! tombstone). The events follow in statements of up to a thousand rows, each looked up
//! first so that an event id repeated in the file is refused naming both seqs; the state
//! is folded from them as they pass ([`SessionMeta::apply_event`]), and the commit writes
//! it over the placeholder ([`crate::rules::adopt_imported`]).
//!
//! Crash points: the replica killed (or the database gone) at any moment before the
//! commit ends the connection, and PostgreSQL rolls the transaction back: nothing of the
//! session was ever visible, and nothing is left of it. A staging dropped unfinished (its
//! call cancelled) takes its connection out of the pool and closes it, which rolls back the
//! same way.

use std::sync::Arc;

use agentlog_proto::kept::KeptEvent;
use agentlog_proto::v1::{Event, SessionInfo};
use prost::Message;

use super::connection::timed;
use super::replica::{Cached, Replica};
use super::rows::{Columns, SearchRows};
use crate::backend::{StageError, Staging};
use crate::clock::now_unix_ms;
use crate::rules::{self, Deletion};
use crate::session::SessionMeta;
use crate::StoreError;

/// One import in progress: a connection of the pool, inside the import's transaction.
pub(super) struct PgStaging {
    replica: Arc<Replica>,
    /// `None` once the transaction ended.
    client: Option<deadpool_postgres::Object>,
    session_id: String,
    /// The state folded from the events staged so far.
    meta: SessionMeta,
}

impl Replica {
    pub(super) async fn begin_import(
        self: &Arc<Self>,
        session_id: &str,
    ) -> Result<PgStaging, StoreError> {
        let client = self.client().await?;
        let mut staging = PgStaging {
            replica: self.clone(),
            client: Some(client),
            session_id: session_id.to_string(),
            meta: SessionMeta::default(),
        };
        staging.run("BEGIN", &[]).await?;
        let placeholder = SessionMeta::default().encode_to_vec();
        let inserted = staging
            .query_opt(
                "INSERT INTO agentlog_sessions (session_id, version, meta, last_seq, \
                 updated_unix_ms, status, lease_expires_unix_ms, first_user_text) \
                 VALUES ($1, 1, $2, 0, 0, 0, 0, '') \
                 ON CONFLICT (session_id) DO NOTHING RETURNING version",
                &[&session_id, &placeholder],
            )
            .await?;
        if inserted.is_none() {
            staging.end().await;
            return Err(self.taken(session_id).await);
        }
        Ok(staging)
    }

    /// Why an imported id is taken here: deleted, or a session of its own.
    async fn taken(&self, session_id: &str) -> StoreError {
        let client = match self.client().await {
            Ok(client) => client,
            Err(e) => return e,
        };
        match self.refresh(&client, session_id, &[]).await {
            Ok((state, _)) => rules::imported_taken(session_id, state.meta.is_deleted()),
            Err(e) => e,
        }
    }

    /// An imported `deleted` line: a live session is deleted as DeleteSession deletes it;
    /// an id never seen here gets its tombstone row (there is nothing to erase).
    pub(super) async fn import_deletion(
        &self,
        session_id: &str,
        deleted_unix_ms: i64,
    ) -> Result<bool, StoreError> {
        let client = self.client().await?;
        let (state, _) = self.refresh(&client, session_id, &[]).await?;
        if state.version > 0 {
            if let Deletion::AlreadyDeleted = rules::delete_imported(Some(&state.meta), 0) {
                return Ok(false);
            }
            drop(client);
            self.delete_session(session_id).await?;
            return Ok(true);
        }
        let Deletion::Tombstone(tombstone) = rules::delete_imported(None, deleted_unix_ms) else {
            return Ok(false);
        };
        let inserted = timed(
            "import",
            client.query_opt(
                "INSERT INTO agentlog_sessions (session_id, version, meta, last_seq, \
                 updated_unix_ms, status, lease_expires_unix_ms, first_user_text, \
                 deleted_unix_ms) VALUES ($1, 1, $2, 0, 0, 0, 0, '', $3) \
                 ON CONFLICT (session_id) DO NOTHING RETURNING version",
                &[
                    &session_id,
                    &tombstone.encode_to_vec(),
                    &tombstone.deleted_unix_ms,
                ],
            ),
        )
        .await
        .map_err(|e| self.timed_error(e))?;
        match inserted {
            Some(row) => {
                self.remember(
                    session_id,
                    &Cached {
                        version: row.get(0),
                        meta: Arc::new(*tombstone),
                    },
                );
                Ok(true)
            }
            // Made meanwhile: delete it as it is now.
            None => {
                drop(client);
                Box::pin(self.import_deletion(session_id, deleted_unix_ms)).await
            }
        }
    }
}

impl PgStaging {
    fn client(&self) -> Result<&deadpool_postgres::Object, StoreError> {
        self.client
            .as_ref()
            .ok_or_else(|| StoreError::Internal("the import's transaction has ended".into()))
    }

    async fn run(
        &self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<u64, StoreError> {
        let client = self.client()?;
        timed("import", client.execute(sql, params))
            .await
            .map_err(|e| self.replica.timed_error(e))
    }

    async fn query_opt(
        &self,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Option<tokio_postgres::Row>, StoreError> {
        let client = self.client()?;
        timed("import", client.query_opt(sql, params))
            .await
            .map_err(|e| self.replica.timed_error(e))
    }

    /// Ends the transaction without committing it: the connection goes (closing it rolls
    /// the transaction back), never back to the pool in the middle of one.
    async fn end(&mut self) {
        if let Some(client) = self.client.take() {
            drop(deadpool_postgres::Object::take(client));
        }
    }
}

impl Drop for PgStaging {
    fn drop(&mut self) {
        if let Some(client) = self.client.take() {
            drop(deadpool_postgres::Object::take(client));
        }
    }
}

#[tonic::async_trait]
impl Staging for PgStaging {
    async fn stage(&mut self, events: Vec<KeptEvent>) -> Result<(), StageError> {
        let mut seen: std::collections::HashMap<&str, u64> = Default::default();
        for event in &events {
            if let Some(seq) = seen.insert(&event.event_id, event.seq) {
                return Err(repeated(event, seq));
            }
        }
        let ids: Vec<&str> = events.iter().map(|e| e.event_id.as_str()).collect();
        let client = self.client()?;
        let earlier = timed(
            "import",
            client.query_opt(
                "SELECT event_id, seq FROM agentlog_events WHERE session_id = $1 \
                 AND event_id = ANY($2::text[]) LIMIT 1",
                &[&self.session_id, &ids],
            ),
        )
        .await
        .map_err(|e| self.replica.timed_error(e))?;
        if let Some(row) = earlier {
            let id: String = row.get(0);
            let seq: i64 = row.get(1);
            let event = events
                .iter()
                .find(|e| e.event_id == id)
                .expect("the statement looked these ids up");
            return Err(repeated(event, seq as u64));
        }
        let seqs: Vec<i64> = events.iter().map(|e| e.seq as i64).collect();
        let bodies: Vec<Vec<u8>> = events
            .iter()
            .map(|e| {
                let mut stored = e.clone();
                stored.set_session_id(&self.session_id);
                stored.encode_to_vec()
            })
            .collect();
        self.run(
            "INSERT INTO agentlog_events (session_id, seq, event_id, body) \
             SELECT $1, seq, event_id, body \
             FROM unnest($2::bigint[], $3::text[], $4::bytea[]) AS ev(seq, event_id, body)",
            &[&self.session_id, &seqs, &ids, &bodies],
        )
        .await?;
        // Searchable from the commit on, as an append's events are (in the same transaction).
        let mut searched = SearchRows::default();
        for event in &events {
            searched.add(&self.session_id, event);
        }
        self.run(super::search::INSERT_ROWS, &searched.params())
            .await?;
        for event in &events {
            self.meta.apply_event(event);
        }
        Ok(())
    }

    async fn commit(mut self: Box<Self>, line: SessionInfo) -> Result<(), StoreError> {
        let meta = match rules::adopt_imported(&self.meta, &line) {
            Ok(meta) => meta,
            Err(e) => {
                self.end().await;
                return Err(e);
            }
        };
        let columns = Columns::of(&meta);
        let written = self
            .run(
                "UPDATE agentlog_sessions SET version = 2, meta = $2, last_seq = $3, \
                 updated_unix_ms = $4, status = $5, lease_expires_unix_ms = 0, \
                 first_user_text = $6, pinned = $7 WHERE session_id = $1",
                &[
                    &self.session_id,
                    &columns.meta,
                    &columns.last_seq,
                    &columns.updated,
                    &columns.status,
                    &columns.first_user_text,
                    &columns.pinned,
                ],
            )
            .await;
        if let Err(e) = written {
            self.end().await;
            return Err(e);
        }
        if let Err(e) = self.run("COMMIT", &[]).await {
            self.end().await;
            return Err(e);
        }
        // Back to the pool: the transaction is over.
        self.client = None;
        let meta = Arc::new(meta);
        self.replica.remember(
            &self.session_id,
            &Cached {
                version: 2,
                meta: meta.clone(),
            },
        );
        self.replica.changed(&self.session_id, &meta, now_unix_ms());
        Ok(())
    }

    async fn abandon(mut self: Box<Self>) {
        self.end().await;
    }
}

fn repeated(event: &Event, earlier: u64) -> StageError {
    StageError::Repeated {
        seq: event.seq,
        earlier,
        event_id: event.event_id.clone(),
    }
}
