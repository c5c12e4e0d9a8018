//! The PostgreSQL schema across versions, on a real PostgreSQL: replicas that start at once
//! migrate once, and sessions written under the previous schema version are still listed
//! (in `ListSessions` order, page after page) and appended to after the upgrade.

use std::time::Duration;

use agentlog_proto::v1::{
    event, Durability, Event, ListSessionsRequest, SessionStatus, UserMessage,
};
use event_store::backend::Backend;
use event_store::postgres::{schema, NotifyMode, PgBackend, PgConfig};
use event_store::scope::Scope;
use event_store::session::{now_unix_ms, SessionMeta};
use event_store::AppendOp;
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
            events: vec![user("again", "and again")],
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
