//! A fork shares its parent's prefix in PostgreSQL too (`backend::postgres`'s `fork`): the
//! fork's row names its base (`base_session`, `base_seq`), only its own events get rows,
//! and its seqs `1..=base_seq` are read through the base, down a line of forks. On a real
//! PostgreSQL:
//! - Subscribe (from 1 and from inside the prefix), the title and dedup of a fork and of a
//!   fork of a fork read through their bases as if the prefix were theirs (same ids,
//!   contents, the fork's session id), on the replica that forked and on a cold one, and
//!   no row of the prefix is written again;
//! - deleting a parent first makes its forks' prefixes their own rows, then erases its
//!   rows (its text too): the forks read, dedup and append on, whole, and so does a fork of
//!   a fork whose middle is deleted;
//! - an erasure left unfinished by a replica that died (its tombstone and entry committed,
//!   no row erased) is finished by other replicas' sweeps, two at once, the forks whole;
//!   an erasure that does not materialize first (as schema version 6 erased) is refused;
//! - a fork racing its parent's deletion is either refused or whole after the erasure;
//! - a fork made before schema version 7 (its prefix copied as rows of its own) is read,
//!   appended to and kept whole by its parent's deletion after the upgrade.

mod common;

use std::time::{Duration, Instant};

use agentlog_proto::v1::{Event, SessionInfo};
use common::{op, user};
use event_store::backend::postgres::{schema, NotifyMode, PgBackend, PgConfig};
use event_store::backend::{Backend, EventRun, ForkOp};
use event_store::StoreError;
use prost::Message;
use testkit::pg::Postgres;
use tokio_util::sync::CancellationToken;

/// In the parent's events up to the fork point (so in the forks' prefixes).
const SHARED: &str = "SHARED-TEXT";
/// In the parent's events after the fork point only: gone with the parent.
const PARENT_ONLY: &str = "PARENT-ONLY";
const PREFIX: u64 = 20;

fn config(url: &str) -> PgConfig {
    PgConfig {
        url: url.to_string(),
        ca_file: None,
        pool_size: 4,
        notify: NotifyMode::Listen,
        poll_interval: Duration::from_millis(200),
        cache_bytes: 1 << 10,
        search: true,
        retention: None,
    }
}

async fn sql(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    client
}

fn fork_op(parent: &str, at_seq: u64, new: &str, events: Vec<Event>) -> ForkOp {
    ForkOp {
        parent: parent.into(),
        at_seq,
        new_session_id: new.into(),
        events: events.into_iter().map(Into::into).collect(),
    }
}

async fn read_from(store: &PgBackend, session_id: &str, from: u64) -> Vec<Event> {
    let mut rx = store.subscribe(
        session_id.to_string(),
        from,
        false,
        CancellationToken::new(),
    );
    let mut events = Vec::new();
    while let Some(item) = rx.recv().await {
        match item.and_then(EventRun::into_events) {
            Ok(run) => events.extend(run),
            Err(e) => panic!("reading session {session_id} back failed: {e}"),
        }
    }
    events
}

async fn history(store: &PgBackend, session_id: &str) -> Vec<Event> {
    read_from(store, session_id, 1).await
}

/// `events` as the session `session_id` holds them.
fn as_of(session_id: &str, events: &[Event]) -> Vec<Event> {
    events
        .iter()
        .map(|e| Event {
            session_id: session_id.into(),
            ..e.clone()
        })
        .collect()
}

/// The parent `p` (30 user messages, ids `p0…`), the fork `f` of it at seq 20 with one new
/// event (`f-new`, seq 21), and the fork `g` of `f` at seq 21 with one (`g-new`, seq 22);
/// another session's events between them all. Returns p's, f's and g's logs.
async fn make_line(store: &PgBackend) -> (Vec<Event>, Vec<Event>, Vec<Event>) {
    for i in 0..30u64 {
        let text = if i < PREFIX {
            format!("{SHARED} {i}")
        } else {
            format!("{PARENT_ONLY} {i}")
        };
        store
            .append(op("p", vec![user(&format!("p{i}"), &text)]))
            .await
            .unwrap();
        store
            .append(op("other", vec![user(&format!("o{i}"), "other")]))
            .await
            .unwrap();
    }
    let made = store
        .fork(fork_op("p", PREFIX, "f", vec![user("f-new", "f's own")]))
        .await
        .unwrap();
    assert_eq!(made.last_seq, PREFIX + 1);
    let made = store
        .fork(fork_op(
            "f",
            PREFIX + 1,
            "g",
            vec![user("g-new", "g's own")],
        ))
        .await
        .unwrap();
    assert_eq!(made.last_seq, PREFIX + 2);
    let p = history(store, "p").await;
    let f = history(store, "f").await;
    let g = history(store, "g").await;
    assert_eq!(p.len(), 30);
    let mut want_f = as_of("f", &p[..PREFIX as usize]);
    assert_eq!(
        f[..PREFIX as usize],
        want_f[..],
        "f's prefix is p's, as f's"
    );
    assert_eq!(f.len(), PREFIX as usize + 1);
    assert_eq!(f[PREFIX as usize].event_id, "f-new");
    want_f.push(f[PREFIX as usize].clone());
    assert_eq!(
        g[..=PREFIX as usize],
        as_of("g", &want_f)[..],
        "g's prefix is f's"
    );
    assert_eq!(g.len(), PREFIX as usize + 2);
    assert_eq!(g[PREFIX as usize + 1].event_id, "g-new");
    (p, f, g)
}

async fn rows_of(client: &tokio_postgres::Client, session_id: &str) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM agentlog_events WHERE session_id = $1",
            &[&session_id],
        )
        .await
        .unwrap()
        .get(0)
}

async fn base_of(client: &tokio_postgres::Client, session_id: &str) -> (String, i64) {
    let row = client
        .query_one(
            "SELECT base_session, base_seq FROM agentlog_sessions WHERE session_id = $1",
            &[&session_id],
        )
        .await
        .unwrap();
    (row.get(0), row.get(1))
}

/// Waits until no erasure is left, and checks that nothing of `gone` is left.
async fn erased(client: &tokio_postgres::Client, gone: &[&str]) {
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        let left: i64 = client
            .query_one("SELECT count(*) FROM agentlog_erasures", &[])
            .await
            .unwrap()
            .get(0);
        if left == 0 {
            break;
        }
        assert!(Instant::now() < deadline, "the erasure never finished");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for session_id in gone {
        assert_eq!(rows_of(client, session_id).await, 0, "{session_id}'s rows");
    }
}

/// What is left anywhere in `agentlog_events` of `text`.
async fn rows_holding(client: &tokio_postgres::Client, text: &str) -> i64 {
    client
        .query_one(
            "SELECT count(*) FROM agentlog_events WHERE position($1::bytea IN body) > 0",
            &[&text.as_bytes()],
        )
        .await
        .unwrap()
        .get(0)
}

/// Appends `events` to `session_id` and returns the seqs answered and the last seq.
async fn append(store: &PgBackend, session_id: &str, events: Vec<Event>) -> (Vec<u64>, u64) {
    let answer = store.append(op(session_id, events)).await.unwrap();
    (answer.seqs, answer.last_seq)
}

async fn info(store: &PgBackend, session_id: &str) -> SessionInfo {
    store.get_session(session_id).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn forks_read_and_dedup_their_prefix_through_their_bases_without_copying_it() {
    let pg = tokio::task::block_in_place(Postgres::start).unwrap();
    let url = tokio::task::block_in_place(|| pg.create_database()).unwrap();
    let store = PgBackend::open(config(&url)).await.unwrap();
    let client = sql(&url).await;
    let (p, f, g) = make_line(&store).await;

    // Only the forks' own events have rows; their bases are named.
    assert_eq!(rows_of(&client, "f").await, 1);
    assert_eq!(rows_of(&client, "g").await, 1);
    assert_eq!(base_of(&client, "f").await, ("p".into(), PREFIX as i64));
    assert_eq!(base_of(&client, "g").await, ("f".into(), PREFIX as i64 + 1));

    // From inside the prefix, and across the fork point.
    assert_eq!(read_from(&store, "g", 7).await, g[6..]);
    assert_eq!(
        read_from(&store, "f", PREFIX).await,
        f[PREFIX as usize - 1..]
    );
    assert_eq!(info(&store, "g").await.title, format!("{SHARED} 0"));

    // A prefix id is answered with its seq and writes nothing, on this replica and on a
    // cold one (whose first write meets the ids in the batch statement, then re-reads).
    let cold = PgBackend::open(config(&url)).await.unwrap();
    for replica in [&store, &cold] {
        assert_eq!(
            append(replica, "f", vec![user("p3", "again")]).await,
            (vec![4], PREFIX + 1)
        );
        assert_eq!(
            append(
                replica,
                "g",
                vec![user("p3", "again"), user("f-new", "again")]
            )
            .await,
            (vec![4, PREFIX + 1], PREFIX + 2)
        );
    }
    assert_eq!(rows_of(&client, "f").await, 1);
    assert_eq!(rows_of(&client, "g").await, 1);
    // A new event after a prefix id: numbered after the fork's own.
    assert_eq!(
        append(&cold, "g", vec![user("p5", "dup"), user("g-2", "new")]).await,
        (vec![6, PREFIX + 3], PREFIX + 3)
    );
    assert_eq!(history(&store, "g").await.len(), PREFIX as usize + 3);
    // A fork inside a fork's prefix reads through both.
    store.fork(fork_op("g", 5, "h", vec![])).await.unwrap();
    assert_eq!(history(&cold, "h").await, as_of("h", &p[..5]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deleting_a_parent_then_the_middle_of_a_line_leaves_the_forks_whole() {
    let pg = tokio::task::block_in_place(Postgres::start).unwrap();
    let url = tokio::task::block_in_place(|| pg.create_database()).unwrap();
    let store = PgBackend::open(config(&url)).await.unwrap();
    let client = sql(&url).await;
    let (_, f, g) = make_line(&store).await;

    store.delete_session("p").await.unwrap();
    erased(&client, &["p"]).await;
    assert_eq!(
        rows_holding(&client, PARENT_ONLY).await,
        0,
        "p's own text is gone"
    );
    // f holds its prefix now; g still reads through f.
    assert_eq!(rows_of(&client, "f").await, PREFIX as i64 + 1);
    assert_eq!(base_of(&client, "f").await, (String::new(), 0));
    assert_eq!(base_of(&client, "g").await, ("f".into(), PREFIX as i64 + 1));
    let cold = PgBackend::open(config(&url)).await.unwrap();
    for replica in [&store, &cold] {
        assert_eq!(history(replica, "f").await, f);
        assert_eq!(history(replica, "g").await, g);
    }
    assert_eq!(
        append(&cold, "f", vec![user("p3", "again"), user("f-2", "new")]).await,
        (vec![4, PREFIX + 2], PREFIX + 2)
    );
    assert_eq!(
        append(&cold, "g", vec![user("p3", "again")]).await,
        (vec![4], PREFIX + 2)
    );

    // The middle of the line: g gets its whole prefix (f's and p's part) before f goes.
    store.delete_session("f").await.unwrap();
    erased(&client, &["f", "p"]).await;
    assert_eq!(rows_of(&client, "g").await, PREFIX as i64 + 2);
    assert_eq!(base_of(&client, "g").await, (String::new(), 0));
    assert_eq!(history(&cold, "g").await, g);
    assert_eq!(
        append(
            &store,
            "g",
            vec![user("f-new", "again"), user("g-2", "new")]
        )
        .await,
        (vec![PREFIX + 1, PREFIX + 3], PREFIX + 3)
    );
    assert_eq!(
        rows_holding(&client, "f-2").await,
        0,
        "f's own event is gone"
    );
}

/// The state a replica killed right after a deletion leaves: the tombstones and their
/// `agentlog_erasures` entries committed (as `write_tombstone` writes them, in one
/// statement), no row erased, no fork materialized; the entries old enough for the sweep.
async fn deleted_by_a_dead_replica(client: &tokio_postgres::Client, session_ids: &[&str]) {
    let dead_since = event_store::clock::now_unix_ms() - 120_000;
    let tombstone = event_store::session::SessionMeta::tombstone(dead_since).encode_to_vec();
    for session_id in session_ids {
        client
            .execute(
                "WITH t AS (UPDATE agentlog_sessions SET version = version + 1, meta = $2, \
                 last_seq = 0, status = 0, lease_expires_unix_ms = 0, first_user_text = '', \
                 deleted_unix_ms = $3 WHERE session_id = $1 RETURNING session_id) \
                 INSERT INTO agentlog_erasures (session_id, deleted_unix_ms) \
                 SELECT session_id, $3 FROM t",
                &[session_id, &tombstone, &dead_since],
            )
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_erasure_a_dead_replica_left_is_finished_by_two_others_at_once_forks_whole() {
    let pg = tokio::task::block_in_place(Postgres::start).unwrap();
    let url = tokio::task::block_in_place(|| pg.create_database()).unwrap();
    let client = sql(&url).await;
    let (f, g) = {
        let store = PgBackend::open(config(&url)).await.unwrap();
        let (_, f, g) = make_line(&store).await;
        for i in 0..5 {
            store
                .fork(fork_op("p", PREFIX, &format!("k{i}"), vec![]))
                .await
                .unwrap();
        }
        (f, g)
    };
    // The dead replica deleted p and f; two replicas start, and their sweeps take them up.
    deleted_by_a_dead_replica(&client, &["p", "f"]).await;
    // An erasure that does not materialize first (a replica of schema version 6, during a
    // rolling update) is refused, and takes nothing.
    for session_id in ["p", "f"] {
        let refused = client
            .execute(
                "DELETE FROM agentlog_events WHERE session_id = $1",
                &[&session_id],
            )
            .await;
        let refused = refused.expect_err("rows erased under live forks");
        let message = refused.as_db_error().map(|e| e.message().to_string());
        assert!(
            message.as_deref().is_some_and(|m| m.contains("live fork")),
            "{session_id}: {refused:?}"
        );
    }
    assert_eq!(rows_of(&client, "p").await, 30);
    let (a, b) = tokio::join!(PgBackend::open(config(&url)), PgBackend::open(config(&url)));
    let (a, b) = (a.unwrap(), b.unwrap());
    erased(&client, &["p", "f"]).await;
    assert_eq!(rows_holding(&client, PARENT_ONLY).await, 0);
    assert_eq!(history(&a, "g").await, g);
    assert_eq!(rows_of(&client, "g").await, PREFIX as i64 + 2);
    for i in 0..5 {
        let k = format!("k{i}");
        assert_eq!(history(&b, &k).await, as_of(&k, &f[..PREFIX as usize]));
        assert_eq!(
            rows_of(&client, &k).await,
            PREFIX as i64,
            "{k} got its prefix once"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fork_racing_its_parents_deletion_is_refused_or_whole() {
    let pg = tokio::task::block_in_place(Postgres::start).unwrap();
    let url = tokio::task::block_in_place(|| pg.create_database()).unwrap();
    let store = PgBackend::open(config(&url)).await.unwrap();
    let other = PgBackend::open(config(&url)).await.unwrap();
    let client = sql(&url).await;
    let mut made = 0;
    for round in 0..12 {
        let parent = format!("p{round}");
        let events: Vec<Event> = (0..50)
            .map(|i| user(&format!("{parent}-{i}"), &format!("{SHARED} {i}")))
            .collect();
        store.append(op(&parent, events)).await.unwrap();
        let want = history(&store, &parent).await;
        let fork = format!("f{round}");
        // Started a little apart, so that each ordering happens in some round.
        let (forked, deleted) =
            tokio::join!(store.fork(fork_op(&parent, 50, &fork, vec![])), async {
                tokio::time::sleep(Duration::from_millis(round * 2)).await;
                other.delete_session(&parent).await
            });
        deleted.unwrap();
        erased(&client, &[&parent]).await;
        match forked {
            Ok(_) => {
                made += 1;
                assert_eq!(history(&other, &fork).await, as_of(&fork, &want));
                assert_eq!(rows_of(&client, &fork).await, 50);
            }
            Err(StoreError::Refused(..)) => {
                assert_eq!(rows_of(&client, &fork).await, 0);
            }
            Err(e) => panic!("the fork failed otherwise: {e}"),
        }
    }
    eprintln!("{made} of 12 forks were made before their parent's deletion");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fork_copied_before_version_7_is_kept_whole_after_the_upgrade() {
    let pg = tokio::task::block_in_place(Postgres::start).unwrap();
    let url = tokio::task::block_in_place(|| pg.create_database()).unwrap();
    let mut client = sql(&url).await;
    schema::migrate_to(&mut client, 6).await.unwrap();
    // Version 6 wrote a fork as rows of its own: the parent's, re-encoded with its id.
    let parent: Vec<Event> = (1..=10u64)
        .map(|seq| Event {
            session_id: "old-p".into(),
            seq,
            ts_unix_ms: 1_000 + seq as i64,
            ..user(&format!("e{seq}"), &format!("{SHARED} {seq}"))
        })
        .collect();
    let meta = |session_id: &str| {
        let mut meta = event_store::session::SessionMeta::default();
        for event in &parent {
            meta.apply_event(&Event {
                session_id: session_id.into(),
                ..event.clone()
            });
        }
        meta
    };
    for session_id in ["old-p", "old-f"] {
        let meta = meta(session_id);
        client
            .execute(
                "INSERT INTO agentlog_sessions (session_id, version, meta, last_seq, \
                 updated_unix_ms, status, lease_expires_unix_ms, first_user_text) \
                 VALUES ($1, 1, $2, 10, $3, $4, 0, $5)",
                &[
                    &session_id,
                    &meta.encode_to_vec(),
                    &meta.updated_unix_ms,
                    &meta.status,
                    &meta.first_user_text,
                ],
            )
            .await
            .unwrap();
        for event in as_of(session_id, &parent) {
            client
                .execute(
                    "INSERT INTO agentlog_events (session_id, seq, event_id, body) \
                     VALUES ($1, $2, $3, $4)",
                    &[
                        &session_id,
                        &(event.seq as i64),
                        &event.event_id,
                        &event.encode_to_vec(),
                    ],
                )
                .await
                .unwrap();
        }
    }
    let store = PgBackend::open(config(&url)).await.unwrap();
    let version: i32 = client
        .query_one("SELECT max(version) FROM agentlog_schema", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(version, schema::VERSION);
    assert_eq!(base_of(&client, "old-f").await, (String::new(), 0));
    assert_eq!(history(&store, "old-f").await, as_of("old-f", &parent));
    // A fork of the old fork shares its (copied) prefix.
    store
        .fork(fork_op("old-f", 10, "new-f", vec![]))
        .await
        .unwrap();
    assert_eq!(rows_of(&client, "new-f").await, 0);
    store.delete_session("old-p").await.unwrap();
    erased(&client, &["old-p"]).await;
    assert_eq!(history(&store, "old-f").await, as_of("old-f", &parent));
    assert_eq!(history(&store, "new-f").await, as_of("new-f", &parent));
    assert_eq!(
        append(
            &store,
            "old-f",
            vec![user("e3", "again"), user("e11", "new")]
        )
        .await,
        (vec![3, 11], 11)
    );
}
