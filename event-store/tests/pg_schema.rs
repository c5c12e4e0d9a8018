//! The PostgreSQL schema across versions, on a real PostgreSQL: replicas that start at once
//! migrate once, and sessions written under the previous schema version are still listed
//! (in `ListSessions` order, page after page) and appended to after the upgrade.

use std::time::Duration;

use agentlog_proto::v1::{
    event, Durability, Event, ListSessionsRequest, SessionStatus, UserMessage,
};
use event_store::backend::postgres::{schema, NotifyMode, PgBackend, PgConfig};
use event_store::backend::AppendOp;
use event_store::backend::Backend;
use event_store::clock::now_unix_ms;
use event_store::scope::Scope;
use event_store::session::SessionMeta;
use prost::Message;
use testkit::pg::Postgres;

/// The schema version before the one that indexed `ListSessions`.
const PREVIOUS: i32 = 2;

fn config(url: &str) -> PgConfig {
    PgConfig {
        url: url.to_string(),
        ca_file: None,
        pool_size: 4,
        notify: NotifyMode::Listen,
        poll_interval: Duration::from_millis(500),
        cache_bytes: 64 << 20,
        search: true,
        retention: None,
    }
}

fn database(url: &str) -> &str {
    url.rsplit('/').next().unwrap_or_default()
}

fn user(event_id: &str, text: &str) -> Event {
    Event {
        event_id: event_id.into(),
        kind: Some(event::Kind::UserMessage(UserMessage { text: text.into() })),
        ..Event::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_replicas_starting_at_once_migrate_once() {
    let pg = tokio::task::block_in_place(Postgres::start).unwrap();
    let url = tokio::task::block_in_place(|| pg.create_database()).unwrap();
    let opened = futures::future::join_all((0..3).map(|_| PgBackend::open(config(&url)))).await;
    for backend in &opened {
        assert!(
            backend.is_ok(),
            "a replica failed to start: {:?}",
            backend.as_ref().err()
        );
    }
    let applied = tokio::task::block_in_place(|| {
        pg.psql(
            database(&url),
            "SELECT string_agg(version::text, ',' ORDER BY version) FROM agentlog_schema",
        )
    })
    .unwrap();
    let expected: Vec<String> = (1..=schema::VERSION).map(|v| v.to_string()).collect();
    assert_eq!(applied, expected.join(","));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sessions_of_the_previous_schema_version_are_listed_and_appended_to_after_the_upgrade() {
    let pg = tokio::task::block_in_place(Postgres::start).unwrap();
    let url = tokio::task::block_in_place(|| pg.create_database()).unwrap();
    let (mut client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    schema::migrate_to(&mut client, PREVIOUS).await.unwrap();

    // 250 sessions as the previous version wrote them (its columns, the state prost-encoded),
    // five of them updated in each millisecond used, so that ties are broken by session id,
    // and spread over 25 seconds a day ago.
    let base = now_unix_ms() - 86_400_000;
    let mut expected = Vec::new();
    for i in 0..250i64 {
        let session_id = format!("old-{i:03}");
        let updated = base + (i * 37 % 50) * 500;
        let status = if i % 3 == 0 {
            SessionStatus::Idle
        } else {
            SessionStatus::Runnable
        };
        let text = format!("hello number {i}");
        let meta = SessionMeta {
            last_seq: 1,
            created_unix_ms: updated,
            updated_unix_ms: updated,
            status: status as i32,
            first_user_text: text.clone(),
            user_since_interrupt: true,
            ..SessionMeta::default()
        };
        let mut event = user(&format!("{session_id}-1"), &text);
        event.seq = 1;
        event.ts_unix_ms = updated;
        client
            .execute(
                "INSERT INTO agentlog_sessions (session_id, version, meta, last_seq, \
                 updated_unix_ms, status, lease_expires_unix_ms, first_user_text) \
                 VALUES ($1, 1, $2, 1, $3, $4, 0, $5)",
                &[
                    &session_id,
                    &meta.encode_to_vec(),
                    &updated,
                    &(status as i32),
                    &text,
                ],
            )
            .await
            .unwrap();
        client
            .execute(
                "INSERT INTO agentlog_events (session_id, seq, event_id, body) \
                 VALUES ($1, 1, $2, $3)",
                &[&session_id, &event.event_id, &event.encode_to_vec()],
            )
            .await
            .unwrap();
        expected.push((updated, session_id, status));
    }
    // ListSessions' order: most recently updated first, then by session id.
    expected.sort_by(|a, b| b.0.cmp(&a.0).then_with(|| a.1.cmp(&b.1)));

    let backend = PgBackend::open(config(&url)).await.unwrap();
    let everything = Scope::everything();
    let list_all = |status: SessionStatus| {
        let backend = &backend;
        let everything = &everything;
        async move {
            let mut ids = Vec::new();
            let mut token = String::new();
            loop {
                let page = backend
                    .list_sessions(
                        &ListSessionsRequest {
                            page_size: 40,
                            page_token: token,
                            status: status as i32,
                            ..ListSessionsRequest::default()
                        },
                        everything,
                    )
                    .await
                    .unwrap();
                assert!(page.sessions.len() <= 40);
                ids.extend(page.sessions.into_iter().map(|s| s.session_id));
                if page.next_page_token.is_empty() {
                    return ids;
                }
                token = page.next_page_token;
            }
        }
    };
    let ids = |status: Option<SessionStatus>| -> Vec<String> {
        expected
            .iter()
            .filter(|(_, _, s)| status.is_none_or(|wanted| *s == wanted))
            .map(|(_, id, _)| id.clone())
            .collect()
    };
    assert_eq!(list_all(SessionStatus::Unspecified).await, ids(None));
    assert_eq!(
        list_all(SessionStatus::Runnable).await,
        ids(Some(SessionStatus::Runnable))
    );

    // An old session takes its next seq, keeps its title, and heads the list.
    let appended = backend
        .append(AppendOp {
            session_id: "old-007".into(),
            events: vec![user("again", "and again")]
                .into_iter()
                .map(Into::into)
                .collect(),
            expected_last_seq: Some(1),
            lease_epoch: None,
            durability: Durability::Sync,
        })
        .await
        .unwrap();
    assert_eq!(appended.seqs, vec![2]);
    let info = backend.get_session("old-007").await.unwrap();
    assert_eq!((info.last_seq, info.title.as_str()), (2, "hello number 7"));
    let mut after = ids(None);
    after.retain(|id| id != "old-007");
    after.insert(0, "old-007".into());
    assert_eq!(list_all(SessionStatus::Unspecified).await, after);
}

/// A long first user message (agents' first turns often are) is written to the session row
/// once: the appends after it add nothing to the row's TOAST, the state in `meta` keeps the
/// title only, and the whole text stays queryable. A write as a replica of the previous
/// version makes it (the title from `meta` written back as the whole text, as during a
/// rolling update) leaves the whole text in place.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_long_first_message_is_written_once_and_survives_a_replica_of_the_previous_version() {
    let pg = tokio::task::block_in_place(Postgres::start).unwrap();
    let url = tokio::task::block_in_place(|| pg.create_database()).unwrap();
    let db = database(&url).to_string();
    let sql = |query: &str| tokio::task::block_in_place(|| pg.psql(&db, query)).unwrap();
    let backend = PgBackend::open(config(&url)).await.unwrap();

    // 4,000 letters that do not compress, so that PostgreSQL moves the text to TOAST, and
    // a word at the end that only a query over the whole text finds.
    let mut x = 0x2545_f491_u32;
    let mut text: String = (0..4000)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            char::from(b'a' + (x % 26) as u8)
        })
        .collect();
    text.push_str(" needle");
    let append = |event: Event| {
        backend.append(AppendOp {
            session_id: "long".into(),
            events: vec![event].into_iter().map(Into::into).collect(),
            expected_last_seq: None,
            lease_epoch: None,
            durability: Durability::Sync,
        })
    };
    append(user("first", &text)).await.unwrap();
    let toast_size = || {
        sql("SELECT pg_relation_size(reltoastrelid) FROM pg_class \
             WHERE relname = 'agentlog_sessions'")
    };
    let before = toast_size();
    for i in 0..100 {
        append(user(&format!("turn-{i}"), "and again"))
            .await
            .unwrap();
    }
    assert_eq!(
        toast_size(),
        before,
        "appends wrote the first message again"
    );
    assert!(
        sql("SELECT octet_length(meta) FROM agentlog_sessions")
            .parse::<usize>()
            .unwrap()
            < 400
    );

    let title: String = text.chars().take(80).collect();
    assert_eq!(
        found(&backend, "needle").await,
        vec![("long".to_string(), title.clone())]
    );

    // A replica of the previous version decodes the state, takes its title as the text,
    // and writes both back.
    sql(&format!(
        "UPDATE agentlog_sessions SET version = version + 1, first_user_text = '{title}'"
    ));
    assert_eq!(
        sql("SELECT octet_length(first_user_text) FROM agentlog_sessions"),
        text.len().to_string()
    );
    append(user("after", "once more")).await.unwrap();
    assert_eq!(
        found(&backend, "needle").await,
        vec![("long".to_string(), title)]
    );
    let info = backend.get_session("long").await.unwrap();
    assert_eq!(info.last_seq, 102);
}

/// The sessions `ListSessions` finds for `query`, with their titles.
async fn found(backend: &PgBackend, query: &str) -> Vec<(String, String)> {
    let request = ListSessionsRequest {
        query: query.into(),
        ..ListSessionsRequest::default()
    };
    backend
        .list_sessions(&request, &Scope::everything())
        .await
        .unwrap()
        .sessions
        .into_iter()
        .map(|s| (s.session_id, s.title))
        .collect()
}

/// A database of schema version 4 (the last before deletion) migrates at start: its
/// sessions read back as they were written, event for event, and can be deleted; the
/// tombstone keeps no text (the version 4 trigger that keeps the longest text lets it go)
/// and the session's rows go. A replica of version 4 still running beside the upgraded ones
/// (a rolling update) can write the tombstoned session no more: its update finds no row.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_schema_4_database_migrates_and_its_sessions_read_back_and_can_be_deleted() {
    let pg = tokio::task::block_in_place(Postgres::start).unwrap();
    let url = tokio::task::block_in_place(|| pg.create_database()).unwrap();
    let db = database(&url).to_string();
    let sql = |query: &str| tokio::task::block_in_place(|| pg.psql(&db, query)).unwrap();
    let (mut client, connection) = tokio_postgres::connect(&url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    schema::migrate_to(&mut client, 4).await.unwrap();

    // Two sessions as version 4 wrote them: the state in `meta` with the title only, the
    // whole first message in its column, the events prost-encoded.
    let now = now_unix_ms();
    let mut written: Vec<(String, Vec<Event>)> = Vec::new();
    for (s, text) in [("v4-a", "the first message of a"), ("v4-b", "b's words")] {
        let mut meta = SessionMeta::default();
        let mut events = Vec::new();
        for seq in 1..=3u64 {
            let mut event = user(&format!("{s}-{seq}"), &format!("{text} #{seq}"));
            event.session_id = s.into();
            event.seq = seq;
            event.ts_unix_ms = now + seq as i64;
            event.schema_version = 1;
            meta.apply_event(&event);
            client
                .execute(
                    "INSERT INTO agentlog_events (session_id, seq, event_id, body) \
                     VALUES ($1, $2, $3, $4)",
                    &[&s, &(seq as i64), &event.event_id, &event.encode_to_vec()],
                )
                .await
                .unwrap();
            events.push(event);
        }
        client
            .execute(
                "INSERT INTO agentlog_sessions (session_id, version, meta, last_seq, \
                 updated_unix_ms, status, lease_expires_unix_ms, first_user_text) \
                 VALUES ($1, 3, $2, 3, $3, $4, 0, $5)",
                &[
                    &s,
                    &meta.encode_to_vec(),
                    &meta.updated_unix_ms,
                    &meta.status,
                    &meta.first_user_text,
                ],
            )
            .await
            .unwrap();
        written.push((s.to_string(), events));
    }

    let backend = PgBackend::open(config(&url)).await.unwrap();
    assert_eq!(
        sql("SELECT max(version) FROM agentlog_schema"),
        schema::VERSION.to_string()
    );
    for (s, events) in &written {
        assert_eq!(
            &read(&backend, s).await,
            events,
            "{s} reads back event for event"
        );
        let info = backend.get_session(s).await.unwrap();
        assert_eq!((info.last_seq, info.title), (3, text_of(&events[0])));
    }

    backend.delete_session("v4-a").await.unwrap();
    let gone = backend.get_session("v4-a").await.unwrap_err();
    assert_eq!(
        gone.reason(),
        Some(agentlog_proto::reason::Reason::SessionDeleted)
    );
    assert_eq!(
        sql(
            "SELECT first_user_text, last_seq, deleted_unix_ms > 0 FROM agentlog_sessions \
             WHERE session_id = 'v4-a'"
        ),
        "|0|t"
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while sql("SELECT count(*) FROM agentlog_events WHERE session_id = 'v4-a'") != "0" {
        assert!(
            std::time::Instant::now() < deadline,
            "the rows were not erased"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(sql("SELECT count(*) FROM agentlog_erasures"), "0");
    assert_eq!(
        &read(&backend, "v4-b").await,
        &written[1].1,
        "the other is whole"
    );

    // A replica of version 4: its append's update of the row it read, and its insert of a
    // row it believes missing, both land nowhere.
    let updated = sql(
        "WITH u AS (UPDATE agentlog_sessions SET version = version + 1, last_seq = 1, \
         status = 1 WHERE session_id = 'v4-a' RETURNING 1) SELECT count(*) FROM u",
    );
    assert_eq!(updated, "0", "an earlier replica rewrote a tombstone");
    sql(
        "INSERT INTO agentlog_sessions (session_id, version, meta, last_seq, updated_unix_ms, \
         status, lease_expires_unix_ms, first_user_text) VALUES ('v4-a', 1, '', 1, 0, 1, 0, 'x') \
         ON CONFLICT (session_id) DO NOTHING",
    );
    let gone = backend.get_session("v4-a").await.unwrap_err();
    assert_eq!(
        gone.reason(),
        Some(agentlog_proto::reason::Reason::SessionDeleted)
    );
}

/// The whole session as Subscribe (without follow) returns it.
async fn read(backend: &PgBackend, session_id: &str) -> Vec<Event> {
    let mut rx = backend.subscribe(
        session_id.into(),
        1,
        false,
        tokio_util::sync::CancellationToken::new(),
    );
    let mut events = Vec::new();
    while let Some(run) = rx.recv().await {
        events.extend(run.unwrap().into_events().unwrap());
    }
    events
}

/// A user message's text.
fn text_of(event: &Event) -> String {
    match &event.kind {
        Some(event::Kind::UserMessage(m)) => m.text.clone(),
        _ => String::new(),
    }
}
