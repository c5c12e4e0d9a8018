//! The database schema, versioned: each migration runs once, in order, in one transaction
//! that holds an advisory lock, so replicas that start at the same moment take turns and
//! the later ones find the work done.
//!
//! - `agentlog_sessions`: one row per session. `meta` is the session's [`SessionMeta`]
//!   (prost-encoded, lease included), the single source of its state; the other columns are
//!   copies of it for the queries that filter and order sessions. Every append updates the
//!   row, so it is kept cheap: no index on the columns an append changes (`updated_unix_ms`,
//!   `version`), and a fill factor that leaves room on the page, so that the update is HOT
//!   (no new index entries). The one secondary index, over runnable sessions, serves
//!   `ClaimSession`; `ListSessions` scans and sorts the sessions instead, a cost that grows
//!   with their number. `version` grows with
//!   every write to the session: a write names the version it was computed from and lands
//!   only if that is still the current one.
//! - `agentlog_events`: the events, prost-encoded, keyed by `(session_id, seq)`; the unique
//!   index on `(session_id, event_id)` makes dedup permanent.
//! - `agentlog_snapshots` (version 2): the kept snapshot per (session, format), derived
//!   data the store never reads; stored uncompressed (the writer chose its encoding).
//!
//! [`SessionMeta`]: crate::session::SessionMeta

use tokio_postgres::Client;

/// Serialises migrations across replicas (any constant unique to agentlog).
const MIGRATION_LOCK: i64 = 0x6167_656e_746c_6f67; // "agentlog"

/// Migration `i` brings the schema to version `i + 1`. Append only: never edit one that
/// has shipped.
const MIGRATIONS: &[&str] = &[
    r#"
CREATE TABLE agentlog_sessions (
    session_id text COLLATE "C" PRIMARY KEY,
    version bigint NOT NULL,
    meta bytea NOT NULL,
    last_seq bigint NOT NULL,
    updated_unix_ms bigint NOT NULL,
    status integer NOT NULL,
    lease_expires_unix_ms bigint NOT NULL,
    first_user_text text NOT NULL
) WITH (fillfactor = 50);
-- status 1: SESSION_STATUS_RUNNABLE (postgres::RUNNABLE).
CREATE INDEX agentlog_sessions_runnable ON agentlog_sessions (session_id) WHERE status = 1;
CREATE TABLE agentlog_events (
    session_id text COLLATE "C" NOT NULL,
    seq bigint NOT NULL,
    event_id text COLLATE "C" NOT NULL,
    body bytea NOT NULL,
    PRIMARY KEY (session_id, seq)
);
CREATE UNIQUE INDEX agentlog_events_event_id ON agentlog_events (session_id, event_id);
"#,
    r#"
CREATE TABLE agentlog_snapshots (
    session_id text COLLATE "C" NOT NULL,
    format text COLLATE "C" NOT NULL,
    seq bigint NOT NULL,
    data bytea NOT NULL,
    PRIMARY KEY (session_id, format)
);
ALTER TABLE agentlog_snapshots ALTER COLUMN data SET STORAGE EXTERNAL;
"#,
];

/// The schema version this build writes.
pub const VERSION: i32 = MIGRATIONS.len() as i32;

#[derive(Debug, thiserror::Error)]
pub enum SchemaError {
    #[error("the database schema is at version {found}, newer than this build knows ({VERSION}); run a newer event-store")]
    TooNew { found: i32 },
    #[error(transparent)]
    Db(#[from] tokio_postgres::Error),
}

/// Creates or migrates the schema to [`VERSION`]; safe when several replicas run it at once.
pub async fn migrate(client: &mut Client) -> Result<(), SchemaError> {
    let tx = client.transaction().await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])
        .await?;
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS agentlog_schema (version integer NOT NULL, \
         applied_unix_ms bigint NOT NULL)",
    )
    .await?;
    let found: i32 = tx
        .query_one("SELECT coalesce(max(version), 0) FROM agentlog_schema", &[])
        .await?
        .get(0);
    if found > VERSION {
        return Err(SchemaError::TooNew { found });
    }
    for (i, migration) in MIGRATIONS.iter().enumerate().skip(found as usize) {
        tx.batch_execute(migration).await?;
        tx.execute(
            "INSERT INTO agentlog_schema (version, applied_unix_ms) VALUES ($1, $2)",
            &[&(i as i32 + 1), &crate::session::now_unix_ms()],
        )
        .await?;
        tracing::info!(version = i + 1, "migrated the database schema");
    }
    tx.commit().await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_runnable_index_is_over_the_status_the_claim_queries_name() {
        let predicate = format!("WHERE status = {};", super::super::RUNNABLE);
        assert!(MIGRATIONS.iter().any(|m| m.contains(&predicate)));
    }
}
