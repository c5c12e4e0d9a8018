//! Group commit at our layer: the appends waiting on a replica are written together, in one
//! statement over arrays (one round trip, one transaction, one commit for all of them),
//! with a few such batches in flight at once so that PostgreSQL's own group commit still
//! shares WAL flushes between them.
//!
//! Every rule that can refuse an append (lease epoch, `expected_last_seq`, approvals) was
//! already applied by the caller against the session state the write names (its row
//! `version`), so a batch never carries a refusal. What the statement decides is, per
//! session, whether that state is still current: the row is still at `version` and none of
//! the new event ids exists. A session whose state moved on is left out of the write (its
//! events are not inserted) and answered "stale", so its caller re-reads and re-plans; the
//! others in the batch commit. Rows are locked in `session_id` order, so two batches that
//! share sessions (on this replica or another) wait for each other instead of
//! deadlocking.
//!
//! For a fork, "exists" covers the prefix it shares with its base: the ids of its line of
//! bases up to its `base_seq` (see [`super::rows::line_cte`]), read in the statement's one
//! snapshot, so a materialization of the prefix, seen or not, changes nothing. Only the
//! batch's forks (by their state's `forked_from`) are looked up there: the other sessions'
//! appends pay nothing for it.

use std::collections::HashMap;
use std::sync::Arc;

use agentlog_proto::kept::KeptEvent;
use tokio::sync::{mpsc, oneshot, Semaphore};
use tokio_postgres::error::SqlState;
use tokio_util::sync::CancellationToken;

use super::connection::{timed, Connector, Timed};
use super::health::Health;
use super::rows::{Columns, SearchRows};
use crate::StoreError;

/// Appends in one batch at most.
const MAX_APPENDS: usize = 256;
/// Events in one batch at most (a batch always takes at least one append, however large).
const MAX_EVENTS: usize = 2048;

/// The batch statement, with `$with` (`WITH`, or `WITH RECURSIVE` for `$line`), `$line` and `$known_in_line` (the batch's forks' lines of
/// bases and the ids found down them, or nothing), `$created` (the CTE that inserts new
/// sessions, or nothing) and `$written` (the sessions written: the ones updated, and those
/// created).
macro_rules! write_batch_statement {
    ($with:expr, $line:expr, $known_in_line:expr, $created:expr, $written:expr) => {
        concat!(
            $with,
            r#" w AS (
    SELECT session_id COLLATE "C" AS session_id, version, meta, last_seq, updated_unix_ms,
        status, lease_expires_unix_ms, first_user_text
    FROM unnest($1::text[], $2::bigint[], $3::bytea[], $4::bigint[], $5::bigint[],
        $6::integer[], $7::bigint[], $8::text[])
        AS w(session_id, version, meta, last_seq, updated_unix_ms, status,
            lease_expires_unix_ms, first_user_text)
), ev AS (
    SELECT session_id COLLATE "C" AS session_id, seq, event_id COLLATE "C" AS event_id, body
    FROM unnest($9::text[], $10::bigint[], $11::text[], $12::bytea[])
        AS ev(session_id, seq, event_id, body)
)"#,
            $line,
            r#", known AS (
    SELECT DISTINCT ev.session_id FROM ev, LATERAL (
        SELECT 1 FROM agentlog_events e
        WHERE e.session_id = ev.session_id AND e.event_id = ev.event_id OFFSET 0
    ) k"#,
            $known_in_line,
            r#"
), updated AS (
    UPDATE agentlog_sessions s SET version = s.version + 1, meta = w.meta,
        last_seq = w.last_seq, updated_unix_ms = w.updated_unix_ms, status = w.status,
        lease_expires_unix_ms = w.lease_expires_unix_ms,
        first_user_text = CASE s.first_user_text WHEN '' THEN w.first_user_text
            ELSE s.first_user_text END
    FROM w
    WHERE s.session_id = w.session_id AND s.version = w.version
        AND w.session_id NOT IN (SELECT session_id FROM known)
    RETURNING s.session_id, s.version
)"#,
            $created,
            r#", written AS (
    "#,
            $written,
            r#"
), inserted AS (
    INSERT INTO agentlog_events (session_id, seq, event_id, body)
    SELECT ev.session_id, ev.seq, ev.event_id, ev.body FROM ev JOIN written USING (session_id)
), searched AS (
    INSERT INTO agentlog_search (session_id, seq, ts_unix_ms, kind, body, words)
    SELECT x.session_id, x.seq, x.ts_unix_ms, x.kind, x.body, x.words::tsvector
    FROM unnest($13::text[], $14::bigint[], $15::bigint[], $16::text[], $17::text[],
        $18::text[]) AS x(session_id, seq, ts_unix_ms, kind, body, words)
    JOIN written ON written.session_id = x.session_id COLLATE "C"
)
SELECT session_id, version FROM written
"#
        )
    };
}

/// Writes every session of the batch whose state is still the one its write was planned
/// against; returns those written, with their new row version. The events' searchable text
/// goes into `agentlog_search` in the same statement, for the sessions written: a search
/// finds an event from its commit on. The batch's rows come in
/// `session_id` order (the caller sorts them), one per session.
///
/// Its plan is made once per connection (a generic plan: the pool's connections run with
/// `plan_cache_mode = force_generic_plan` and `enable_seqscan` off, see `Connector::new`),
/// so it must stay right however much the tables grow after it was made: the tables are
/// reached only through lookups by key (the session row by its key for each of the batch's
/// rows, and a `LATERAL … OFFSET 0` probe of the event-id index per event, which cannot
/// become a join over the whole table). A plan made while the tables were nearly empty
/// otherwise scans them whole on every call, which measured 61 ms per batch at 100,000
/// events against 0.6 ms.
///
/// The update locks the session rows in the order of the batch's rows, each found by its
/// key (a nested loop over `w`), so two batches that share sessions, on this replica or
/// another, wait for each other instead of deadlocking. (Should a plan ever lock them in
/// another order, PostgreSQL detects the deadlock and the batch is retried, see
/// [`write_batch`].) The update takes the locks itself: a `FOR UPDATE` of the rows before
/// it (how the order was kept before) read and sorted them once more and wrote one more
/// WAL record per session.
///
/// Batches that create no session use [`WRITE_BATCH`]; [`WRITE_BATCH_CREATING`] also
/// inserts the rows of the sessions not yet written (`version` 0), which costs one more
/// table write to start on every call. Both changes together cut the statement's
/// execution per append by 6–23% at 64 clients (bench/RESULTS.md).
const WRITE_BATCH: &str = write_batch_statement!(
    "WITH",
    "",
    "",
    "",
    "SELECT session_id, version FROM updated"
);

/// The lines of bases of the batch's forks (`$19`, see the module's head), and the ids of
/// the batch found down them.
macro_rules! fork_lines {
    () => {
        r#", line(session_id, sid, hi) AS (
    SELECT f.session_id COLLATE "C", s.base_session, s.base_seq
    FROM unnest($19::text[]) AS f(session_id), LATERAL (
        SELECT base_session, base_seq FROM agentlog_sessions s
        WHERE s.session_id = f.session_id COLLATE "C" AND s.base_session <> '' OFFSET 0
    ) s
    UNION ALL
    SELECT l.session_id, s.base_session, least(l.hi, s.base_seq) FROM line l
    JOIN agentlog_sessions s ON s.session_id = l.sid WHERE s.base_session <> ''
)"#
    };
}
macro_rules! known_in_fork_lines {
    () => {
        r#"
    UNION
    SELECT ev.session_id FROM line l JOIN ev ON ev.session_id = l.session_id, LATERAL (
        SELECT 1 FROM agentlog_events e
        WHERE e.session_id = l.sid AND e.event_id = ev.event_id AND e.seq <= l.hi OFFSET 0
    ) k"#
    };
}
macro_rules! created {
    () => {
        r#", created AS (
    INSERT INTO agentlog_sessions (session_id, version, meta, last_seq, updated_unix_ms,
        status, lease_expires_unix_ms, first_user_text)
    SELECT session_id, 1, meta, last_seq, updated_unix_ms, status, lease_expires_unix_ms,
        first_user_text
    FROM w WHERE version = 0
    ON CONFLICT (session_id) DO NOTHING
    RETURNING session_id, version
)"#
    };
}

/// [`WRITE_BATCH`] for a batch with sessions to create.
const WRITE_BATCH_CREATING: &str = write_batch_statement!(
    "WITH",
    "",
    "",
    created!(),
    "SELECT session_id, version FROM updated UNION ALL SELECT session_id, version FROM created"
);

/// [`WRITE_BATCH`] for a batch with forks (whose dedup looks down their lines of bases
/// too: a statement apart, so that the other batches do not pay for it, 6% of an append
/// at one client, measured).
const WRITE_BATCH_FORKS: &str = write_batch_statement!(
    "WITH RECURSIVE",
    fork_lines!(),
    known_in_fork_lines!(),
    "",
    "SELECT session_id, version FROM updated"
);

/// [`WRITE_BATCH_CREATING`] for a batch with forks.
const WRITE_BATCH_CREATING_FORKS: &str = write_batch_statement!(
    "WITH RECURSIVE",
    fork_lines!(),
    known_in_fork_lines!(),
    created!(),
    "SELECT session_id, version FROM updated UNION ALL SELECT session_id, version FROM created"
);

/// One append's write: the session's new state and its new events (numbered), to land only
/// if the row is still at `version` (0: no row yet).
pub(super) struct Write {
    pub session_id: String,
    pub version: i64,
    pub columns: Columns,
    pub events: Vec<KeptEvent>,
    /// The new version, `None` if the state was stale, or why the batch failed.
    pub answer: oneshot::Sender<Result<Option<i64>, StoreError>>,
}

/// Batches of appends in flight at once, out of a pool of `pool_size`
/// connections: two, so that one commits while the next is written, and the appends
/// waiting meanwhile gather into large batches (a batch statement's fixed cost in
/// PostgreSQL is about that of a dozen of its rows; 2 in flight against 4 gave 0.66×
/// against 0.54× raw INSERT's rate at 64 clients, bench/RESULTS.md), leaving connections
/// for reads, leases and claims.
pub(super) fn batches_in_flight(pool_size: usize) -> usize {
    (pool_size / 4).clamp(1, 2)
}

/// Starts the batch writer: up to `in_flight` batches at once, each taking every write
/// queued when it starts (within [`MAX_APPENDS`] and [`MAX_EVENTS`]).
/// `index_search`: whether the events' searchable text is written too (off: the store runs
/// without its search index).
pub(super) fn start(
    connector: Arc<Connector>,
    health: Arc<Health>,
    in_flight: usize,
    stop: CancellationToken,
    index_search: bool,
) -> mpsc::UnboundedSender<Write> {
    let (tx, rx) = mpsc::unbounded_channel();
    tokio::spawn(run(
        connector,
        health,
        in_flight.max(1),
        rx,
        stop,
        index_search,
    ));
    tx
}

/// Writes batches until the store stops, then answers every write still queued or on its
/// way (each dropped: its caller reads `UNAVAILABLE`). A receiver merely dropped would keep
/// a write sent while it went away, and leave its caller waiting for good; `recv` after
/// `close` ends only once every send under way has put its write in.
async fn run(
    connector: Arc<Connector>,
    health: Arc<Health>,
    in_flight: usize,
    mut queue: mpsc::UnboundedReceiver<Write>,
    stop: CancellationToken,
    index_search: bool,
) {
    serve(connector, health, in_flight, &mut queue, stop, index_search).await;
    queue.close();
    while queue.recv().await.is_some() {}
}

async fn serve(
    connector: Arc<Connector>,
    health: Arc<Health>,
    in_flight: usize,
    queue: &mut mpsc::UnboundedReceiver<Write>,
    stop: CancellationToken,
    index_search: bool,
) {
    let slots = Arc::new(Semaphore::new(in_flight));
    loop {
        let first = tokio::select! {
            write = queue.recv() => match write {
                Some(write) => write,
                None => return,
            },
            _ = stop.cancelled() => return,
        };
        // While every slot is busy, more writes queue up and join this batch.
        let Ok(slot) = slots.clone().acquire_owned().await else {
            return;
        };
        let mut events = first.events.len();
        let mut batch = vec![first];
        while batch.len() < MAX_APPENDS && events < MAX_EVENTS {
            match queue.try_recv() {
                Ok(write) => {
                    events += write.events.len();
                    batch.push(write);
                }
                Err(_) => break,
            }
        }
        let connector = connector.clone();
        let health = health.clone();
        tokio::spawn(async move {
            write_batch(&connector, &health, batch, index_search).await;
            drop(slot);
        });
    }
}

async fn write_batch(
    connector: &Connector,
    health: &Health,
    mut batch: Vec<Write>,
    index_search: bool,
) {
    // While the database is known lost (until the health probe finds it answering again,
    // within half a second of it coming back), appends are answered at once rather than
    // each waiting out the bound again, behind the batches already waiting it out.
    if !health.serving_now() {
        let error = StoreError::Unavailable(
            "the database is unreachable (it did not answer the last call or health probe); \
             retry"
                .into(),
        );
        for write in batch {
            let _ = write.answer.send(Err(error.clone()));
        }
        return;
    }
    // One write per session: a second one was planned against the same state as the first
    // (or against one the first replaces), so it would be stale; it re-reads and re-plans.
    // Sorted by session_id (stable: a session's writes keep their order), the order rows
    // are locked in.
    batch.sort_by(|a, b| a.session_id.cmp(&b.session_id));
    let mut writes: Vec<Write> = Vec::with_capacity(batch.len());
    for write in batch {
        match writes.last() {
            Some(last) if last.session_id == write.session_id => {
                let _ = write.answer.send(Ok(None));
            }
            _ => writes.push(write),
        }
    }
    let client = match connector.pool.get().await {
        Ok(client) => client,
        Err(e) => {
            health.lost();
            let error =
                StoreError::Unavailable(format!("the database is unreachable ({e}); retry"));
            for write in writes {
                let _ = write.answer.send(Err(error.clone()));
            }
            return;
        }
    };
    let mut sessions = Vec::with_capacity(writes.len());
    let mut versions = Vec::with_capacity(writes.len());
    let mut metas = Vec::with_capacity(writes.len());
    let mut last_seqs = Vec::with_capacity(writes.len());
    let mut updated = Vec::with_capacity(writes.len());
    let mut statuses = Vec::with_capacity(writes.len());
    let mut lease_expires = Vec::with_capacity(writes.len());
    let mut first_user_texts = Vec::with_capacity(writes.len());
    let mut forks = Vec::new();
    let mut event_sessions = Vec::new();
    let mut seqs = Vec::new();
    let mut event_ids = Vec::new();
    let mut bodies = Vec::new();
    let mut searched = SearchRows::default();
    for write in &writes {
        sessions.push(write.session_id.as_str());
        versions.push(write.version);
        metas.push(write.columns.meta.as_slice());
        last_seqs.push(write.columns.last_seq);
        updated.push(write.columns.updated);
        statuses.push(write.columns.status);
        lease_expires.push(write.columns.lease_expires);
        first_user_texts.push(write.columns.first_user_text.as_str());
        if write.columns.fork {
            forks.push(write.session_id.as_str());
        }
        for event in &write.events {
            event_sessions.push(write.session_id.as_str());
            seqs.push(event.seq as i64);
            event_ids.push(event.event_id.as_str());
            bodies.push(event.encode_to_vec());
            if index_search {
                searched.add(&write.session_id, event);
            }
        }
    }
    let statement = match (versions.contains(&0), forks.is_empty()) {
        (true, true) => WRITE_BATCH_CREATING,
        (false, true) => WRITE_BATCH,
        (true, false) => WRITE_BATCH_CREATING_FORKS,
        (false, false) => WRITE_BATCH_FORKS,
    };
    crate::metrics::pg_batch(writes.len());
    let result = timed("append", async {
        let stmt = client.prepare_cached(statement).await?;
        let [s0, s1, s2, s3, s4, s5] = searched.params();
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 19] = [
            &sessions,
            &versions,
            &metas,
            &last_seqs,
            &updated,
            &statuses,
            &lease_expires,
            &first_user_texts,
            &event_sessions,
            &seqs,
            &event_ids,
            &bodies,
            s0,
            s1,
            s2,
            s3,
            s4,
            s5,
            &forks,
        ];
        let taken = if forks.is_empty() { 18 } else { 19 };
        client.query(&stmt, &params[..taken]).await
    })
    .await;
    let written: HashMap<String, i64> = match result {
        Ok(rows) => rows.iter().map(|r| (r.get(0), r.get(1))).collect(),
        // Nothing of the batch committed: an event id inserted in between (by a writer that
        // had not yet committed when this statement looked), or a lock cycle with new
        // sessions created at once elsewhere. Everyone re-reads and tries again.
        Err(Timed::Db(e))
            if matches!(
                e.code(),
                Some(&SqlState::UNIQUE_VIOLATION) | Some(&SqlState::T_R_DEADLOCK_DETECTED)
            ) =>
        {
            HashMap::new()
        }
        Err(e) => {
            let error = health.timed_error(e);
            for write in writes {
                let _ = write.answer.send(Err(error.clone()));
            }
            return;
        }
    };
    for write in writes {
        let _ = write
            .answer
            .send(Ok(written.get(&write.session_id).copied()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use testkit::pg::Postgres;

    /// The plan a pooled connection makes of each batch statement (generic, without seq
    /// scans), on an empty database, as when a replica starts on a new one, and on one
    /// with sessions: the update finds each session row by its key in a nested loop over
    /// the batch's rows, so it locks them in the batch's order, and nothing else locks
    /// them.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn the_batch_statements_lock_session_rows_by_key_in_the_batch_order() {
        let pg = tokio::task::block_in_place(Postgres::start).unwrap();
        let url = tokio::task::block_in_place(|| pg.create_database()).unwrap();
        let (mut client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
            .await
            .unwrap();
        tokio::spawn(connection);
        super::super::schema::migrate(&mut client).await.unwrap();
        for setting in super::super::connection::CONNECTION_SETTINGS {
            client.batch_execute(setting).await.unwrap();
        }
        for filled in [false, true] {
            if filled {
                client
                    .batch_execute(
                        "INSERT INTO agentlog_sessions (session_id, version, meta, last_seq, \
                         updated_unix_ms, status, lease_expires_unix_ms, first_user_text) \
                         SELECT 's' || i, 1, '', 1, i, 2, 0, '' \
                         FROM generate_series(1, 5000) i; \
                         INSERT INTO agentlog_events (session_id, seq, event_id, body) \
                         SELECT 's' || i, 1, 'e' || i, '' FROM generate_series(1, 5000) i; \
                         ANALYZE; DEALLOCATE ALL",
                    )
                    .await
                    .unwrap();
            }
            for (name, statement) in [
                ("write_batch", WRITE_BATCH),
                ("write_batch_creating", WRITE_BATCH_CREATING),
            ] {
                client
                    .batch_execute(&format!(
                        "PREPARE {name} (text[], bigint[], bytea[], bigint[], bigint[], \
                         integer[], bigint[], text[], text[], bigint[], text[], bytea[], \
                         text[], bigint[], bigint[], text[], text[], text[]) \
                         AS {statement}"
                    ))
                    .await
                    .unwrap();
                let nulls = ["NULL"; 18].join(", ");
                let plan: Vec<String> = client
                    .query(&format!("EXPLAIN (COSTS OFF) EXECUTE {name}({nulls})"), &[])
                    .await
                    .unwrap()
                    .iter()
                    .map(|row| row.get::<_, String>(0).trim().to_string())
                    .collect();
                let shown = plan.join("\n");
                let update = plan
                    .iter()
                    .position(|l| l.contains("Update on agentlog_sessions"))
                    .unwrap_or_else(|| panic!("{name}: no update in\n{shown}"));
                assert_eq!(plan[update + 1], "->  Nested Loop", "{name}:\n{shown}");
                let outer: Vec<&str> = plan[update + 2].split_whitespace().collect();
                assert!(
                    outer.windows(2).any(|w| w == ["on", "w"]),
                    "{name}: the loop is not over the batch's rows:\n{shown}"
                );
                let inner = plan[update + 3..]
                    .iter()
                    .find(|l| l.contains("on agentlog_sessions s"))
                    .unwrap();
                assert!(
                    inner.starts_with("->  Index Scan using agentlog_sessions_pkey"),
                    "{name}: {inner}\n{shown}"
                );
                assert!(!shown.contains("LockRows"), "{name}:\n{shown}");
                assert!(!shown.contains("Seq Scan"), "{name}:\n{shown}");
            }
        }
    }
}
