//! The database schema, versioned: each migration runs once, in order, in one transaction
//! that holds an advisory lock, so replicas that start at the same moment take turns and
//! the later ones find the work done.
//!
//! - `agentlog_sessions`: one row per session. `meta` is the session's [`SessionMeta`]
//!   (prost-encoded, lease included), the single source of its state; the other columns are
//!   copies of it for the queries that filter and order sessions. Every append updates the
//!   row, so it is kept cheap: no index on the columns an append changes (`updated_unix_ms`,
//!   `version`), and a fill factor that leaves room on the page, so that the update is HOT
//!   (no new index entries). The partial index over runnable sessions serves
//!   `ClaimSession`. `ListSessions` (most recently updated first) walks the index on
//!   `updated_second` (version 3), the update time in whole seconds, computed by PostgreSQL
//!   (a generated column, so replicas of an earlier version keep it right too; adding it
//!   rewrites the table once, under the migration lock): it changes
//!   at most once a second per session, so nearly every append's update stays HOT, and
//!   the query sorts only the sessions of the seconds it reads. `first_user_text` is
//!   written once, when the session's first user message arrives (an update keeps the
//!   value it finds unless that is empty), and `meta` keeps only the title's part of it
//!   (version 4): a long first message (above about 2 KB, moved to TOAST) was otherwise
//!   written again, twice, by every append. A replica of an earlier version reads the
//!   title from `meta` and writes it back as the whole text; the trigger of version 4
//!   keeps a shorter text from replacing a longer one, so a rolling update loses none of
//!   it (the lengths come from the TOAST pointers: the check reads no text). `version`
//!   grows with every write to the session: a write names the version it was computed
//!   from and lands only if that is still the current one.
//! - `agentlog_events`: the events, prost-encoded, keyed by `(session_id, seq)`; the unique
//!   index on `(session_id, event_id)` makes dedup permanent.
//! - `agentlog_snapshots` (version 2): the kept snapshot per (session, format), derived
//!   data the store never reads; stored uncompressed (the writer chose its encoding).
//! - Deletion (version 5): a deleted session's row stays as its tombstone
//!   (`deleted_unix_ms` set, `meta` the tombstone, `last_seq` and `status` 0, no lease, no
//!   text), and a trigger keeps every later update off it, so that no replica, not even
//!   one of an earlier version during a rolling update, can write the session again (its
//!   write finds no row to update, re-reads and is refused or gives up). The text trigger
//!   of version 4 lets the tombstone clear the text. `agentlog_erasures` lists the deleted
//!   sessions whose rows (events, snapshots) are still being deleted; the tombstone and its
//!   entry are written in one statement, the rows go afterwards in bounded transactions.
//!   The index on `updated_second` holds live sessions only, so that a retention pass,
//!   which walks it from the oldest, never walks over the tombstones it left (a pass
//!   deleting 100,000 sessions otherwise walked over every tombstone of the batches
//!   before, step after step).
//! - Version 6: the live sessions are told by `deleted_unix_ms = 0` (version 5 said
//!   `last_seq > 0`: a column in an index's predicate counts as indexed, so every append,
//!   which moves `last_seq`, was a non-HOT update; measured, 1,000 updates of `last_seq`
//!   alone: 0 HOT under version 5, 1,000 under 6), and `(status, updated_second)` serves
//!   `ListSessions` with a status filter. The queries name both conditions, so that
//!   replicas of version 5 during a rolling update still find rows right (their queries
//!   then walk without the partial indexes until they are replaced).
//! - Version 7: a fork shares its parent's prefix instead of copying it. `base_session` and
//!   `base_seq` (copies of the state's fields of the same names) say that the session's
//!   seqs `1..=base_seq` are the base's rows (down the line of bases), and the partial index
//!   on `base_session` finds a session's forks when its rows are about to be erased (see
//!   `deletion::erase`). A tombstone keeps them, so that the forks of its own forks
//!   still read through it until they are materialized. Forks made before version 7 have
//!   their prefix as rows of their own and no base. A statement-level trigger refuses any
//!   deletion of events that a live session still reads through its line of bases: a
//!   replica of version 6 during a rolling update, which erases without materializing,
//!   fails its erasure (and retries it) until a replica of version 7 has materialized the
//!   forks first.
//! - Version 8: `pinned`, a copy of the state's field of the same name (`PinSession`), so
//!   that a retention pass walks past pinned sessions in its statement instead of reading
//!   them step after step. Adding a column with a constant default rewrites nothing. A
//!   replica of version 7 during a rolling update re-encodes the state without the field
//!   (prost keeps no unknown field), so an append through it unpins the session in `meta`
//!   while the column still says pinned: roll the store replicas before pinning.
//! - Version 9: `agentlog_search`, one row per event with searchable text
//!   ([`crate::search::text`]): its text (for the snippet and the check of each hit) and
//!   its distinct words as a `tsvector` (PostgreSQL's own full-text index, GIN), written in
//!   the append's statement; a fork's rows are copied from its parent's in the fork's
//!   transaction (so a search never walks a line of bases), and the erasure deletes them
//!   with the events. `agentlog_search_backfill` lists the sessions written before version
//!   9, whose rows any replica writes once, in the background (see `search`).
//!
//! [`SessionMeta`]: crate::session::SessionMeta

use agentlog_proto::v1::SessionStatus;
use tokio_postgres::Client;

/// `SessionStatus::Runnable`, the status the partial index over runnable sessions is over:
/// the claim queries write it as a literal, so that they use the index.
pub(super) const RUNNABLE: i32 = SessionStatus::Runnable as i32;

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
    r#"
ALTER TABLE agentlog_sessions
    ADD COLUMN updated_second bigint GENERATED ALWAYS AS (updated_unix_ms / 1000) STORED;
CREATE INDEX agentlog_sessions_recent ON agentlog_sessions (updated_second DESC);
"#,
    r#"
CREATE FUNCTION agentlog_keep_first_user_text() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.first_user_text := OLD.first_user_text;
    RETURN NEW;
END
$$;
CREATE TRIGGER agentlog_first_user_text_kept BEFORE UPDATE ON agentlog_sessions
    FOR EACH ROW
    WHEN (octet_length(NEW.first_user_text) < octet_length(OLD.first_user_text))
    EXECUTE FUNCTION agentlog_keep_first_user_text();
"#,
    r#"
ALTER TABLE agentlog_sessions ADD COLUMN deleted_unix_ms bigint NOT NULL DEFAULT 0;
DROP TRIGGER agentlog_first_user_text_kept ON agentlog_sessions;
CREATE TRIGGER agentlog_first_user_text_kept BEFORE UPDATE ON agentlog_sessions
    FOR EACH ROW
    WHEN (octet_length(NEW.first_user_text) < octet_length(OLD.first_user_text)
        AND NEW.deleted_unix_ms = 0)
    EXECUTE FUNCTION agentlog_keep_first_user_text();
CREATE FUNCTION agentlog_keep_tombstone() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    RETURN NULL;
END
$$;
CREATE TRIGGER agentlog_tombstone_kept BEFORE UPDATE ON agentlog_sessions
    FOR EACH ROW
    WHEN (OLD.deleted_unix_ms > 0)
    EXECUTE FUNCTION agentlog_keep_tombstone();
CREATE TABLE agentlog_erasures (
    session_id text COLLATE "C" PRIMARY KEY,
    deleted_unix_ms bigint NOT NULL
);
DROP INDEX agentlog_sessions_recent;
CREATE INDEX agentlog_sessions_recent ON agentlog_sessions (updated_second DESC)
    WHERE last_seq > 0;
"#,
    r#"
DROP INDEX agentlog_sessions_recent;
CREATE INDEX agentlog_sessions_recent ON agentlog_sessions (updated_second DESC)
    WHERE deleted_unix_ms = 0;
CREATE INDEX agentlog_sessions_by_status ON agentlog_sessions (status, updated_second DESC)
    WHERE deleted_unix_ms = 0;
"#,
    r#"
ALTER TABLE agentlog_sessions
    ADD COLUMN base_session text COLLATE "C" NOT NULL DEFAULT '',
    ADD COLUMN base_seq bigint NOT NULL DEFAULT 0;
CREATE INDEX agentlog_sessions_forks ON agentlog_sessions (base_session)
    WHERE base_session <> '';
CREATE FUNCTION agentlog_keep_shared_prefixes() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (
        WITH RECURSIVE d(session_id, deleted) AS (
            SELECT s.session_id, s.deleted_unix_ms > 0 FROM agentlog_sessions s
            WHERE s.base_session IN (SELECT DISTINCT session_id FROM erased)
                AND s.base_session <> ''
            UNION
            SELECT s.session_id, s.deleted_unix_ms > 0 FROM d
            JOIN agentlog_sessions s ON s.base_session = d.session_id
                AND s.base_session <> ''
            WHERE d.deleted
        )
        SELECT 1 FROM d WHERE NOT d.deleted
    ) THEN
        RAISE EXCEPTION 'agentlog: a live fork still reads these events through its base; they are erased once its prefix is its own';
    END IF;
    RETURN NULL;
END
$$;
CREATE TRIGGER agentlog_shared_prefixes_kept AFTER DELETE ON agentlog_events
    REFERENCING OLD TABLE AS erased FOR EACH STATEMENT
    EXECUTE FUNCTION agentlog_keep_shared_prefixes();
"#,
    // Version 8: pins (sessions that move).
    r#"
ALTER TABLE agentlog_sessions ADD COLUMN pinned boolean NOT NULL DEFAULT false;
"#,
    SEARCH,
];

/// Version 9: search. Self-contained and idempotent (`IF NOT EXISTS`), so that it
/// runs right again after a crash part-way. See the module head.
const SEARCH: &str = r#"
CREATE TABLE IF NOT EXISTS agentlog_search (
    session_id text COLLATE "C" NOT NULL,
    seq bigint NOT NULL,
    ts_unix_ms bigint NOT NULL,
    kind text NOT NULL,
    body text NOT NULL,
    words tsvector NOT NULL,
    PRIMARY KEY (session_id, seq)
);
CREATE INDEX IF NOT EXISTS agentlog_search_words ON agentlog_search USING gin (words);
CREATE INDEX IF NOT EXISTS agentlog_search_newest
    ON agentlog_search (ts_unix_ms DESC, session_id DESC, seq DESC);
CREATE TABLE IF NOT EXISTS agentlog_search_backfill (
    session_id text COLLATE "C" PRIMARY KEY
);
INSERT INTO agentlog_search_backfill (session_id)
    SELECT session_id FROM agentlog_sessions WHERE deleted_unix_ms = 0 AND last_seq > 0
    ON CONFLICT DO NOTHING;
"#;

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
    migrate_to(client, VERSION).await
}

/// Creates or migrates the schema to `target` (at most [`VERSION`]), as a build of that
/// version would: how the tests make a database of an earlier version to upgrade.
pub async fn migrate_to(client: &mut Client, target: i32) -> Result<(), SchemaError> {
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
    let wanted = MIGRATIONS.iter().take(target.clamp(0, VERSION) as usize);
    for (i, migration) in wanted.enumerate().skip(found as usize) {
        tx.batch_execute(migration).await?;
        tx.execute(
            "INSERT INTO agentlog_schema (version, applied_unix_ms) VALUES ($1, $2)",
            &[&(i as i32 + 1), &crate::clock::now_unix_ms()],
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
        let predicate = format!("WHERE status = {};", RUNNABLE);
        assert!(MIGRATIONS.iter().any(|m| m.contains(&predicate)));
    }
}
