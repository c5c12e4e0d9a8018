//! `ListSessions` on the local backend, whose sessions live in the index and not in memory:
//! with a session cache of a few states, every page is walked from the index's listing
//! and merged with the sessions changed since its last absorb. Paging through must give
//! every listed session exactly once, in the order the contract says (most recent update
//! first, then by id), with the right titles; status filters and a query must find what
//! they ask for; and all of it must read the same after a restart.

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use agentlog_proto::v1::{
    content_block, event, AssistantMessage, ContentBlock, Durability, Event, ListSessionsRequest,
    SessionStatus, TextBlock, UserMessage,
};
use common::open_store_caching;
use event_store::backend::local::log::storage::SimStorage;
use event_store::backend::local::Store;
use event_store::backend::AppendOp;
use event_store::scope::Scope;

const SESSIONS: usize = 120;
/// Room for a state or two: nearly every state is read back from the index.
const CACHE_BYTES: usize = 1024;

fn user(text: &str) -> Event {
    Event {
        kind: Some(event::Kind::UserMessage(UserMessage { text: text.into() })),
        ..Default::default()
    }
}

fn final_answer() -> Event {
    Event {
        kind: Some(event::Kind::AssistantMessage(AssistantMessage {
            content: vec![ContentBlock {
                block: Some(content_block::Block::Text(TextBlock {
                    text: "done".into(),
                })),
            }],
            stop_reason: "end_turn".into(),
            ..Default::default()
        })),
        ..Default::default()
    }
}

fn op(session_id: &str, events: Vec<Event>, lease_epoch: Option<u64>) -> AppendOp {
    AppendOp {
        session_id: session_id.into(),
        events: events
            .into_iter()
            .map(agentlog_proto::kept::KeptEvent::new)
            .collect(),
        expected_last_seq: None,
        lease_epoch,
        durability: Durability::Sync,
    }
}

fn id(i: usize) -> String {
    format!("s-{i:03}")
}

fn title(i: usize) -> String {
    if i % 40 == 7 {
        format!("find the needle {i}")
    } else {
        format!("question {i}")
    }
}

/// Every page of the request, in order: (session id, status, title, update time).
fn all_pages(store: &Store, mut req: ListSessionsRequest) -> Vec<(String, i32, String, i64)> {
    let mut out = Vec::new();
    loop {
        let page = store
            .list_sessions(&req, &Scope::everything())
            .expect("a page");
        out.extend(
            page.sessions
                .into_iter()
                .map(|s| (s.session_id, s.status, s.title, s.updated_unix_ms)),
        );
        if page.next_page_token.is_empty() {
            return out;
        }
        req.page_token = page.next_page_token;
    }
}

fn check_listing(store: &Store, idle: &HashSet<String>) {
    let listed = all_pages(
        store,
        ListSessionsRequest {
            page_size: 7,
            ..Default::default()
        },
    );
    let ids: Vec<&str> = listed.iter().map(|(id, ..)| id.as_str()).collect();
    let unique: HashSet<&str> = ids.iter().copied().collect();
    assert_eq!(unique.len(), ids.len(), "a session listed twice: {ids:?}");
    assert_eq!(ids.len(), SESSIONS, "every session, once");
    for pair in listed.windows(2) {
        let (a, b) = (&pair[0], &pair[1]);
        assert!(
            a.3 > b.3 || (a.3 == b.3 && a.0 < b.0),
            "out of order: {a:?} before {b:?}"
        );
    }
    for (session, status, title_text, _) in &listed {
        let i: usize = session[2..].parse().unwrap();
        assert_eq!(*title_text, title(i), "the title of {session}");
        let expected = if idle.contains(session) {
            SessionStatus::Idle
        } else {
            SessionStatus::Runnable
        };
        assert_eq!(*status, expected as i32, "the status of {session}");
    }

    let idle_listed = all_pages(
        store,
        ListSessionsRequest {
            page_size: 3,
            status: SessionStatus::Idle as i32,
            ..Default::default()
        },
    );
    let idle_ids: HashSet<String> = idle_listed.into_iter().map(|(id, ..)| id).collect();
    assert_eq!(&idle_ids, idle);
    let runnable = all_pages(
        store,
        ListSessionsRequest {
            page_size: 50,
            status: SessionStatus::Runnable as i32,
            ..Default::default()
        },
    );
    assert_eq!(runnable.len(), SESSIONS - idle.len());

    let needles = all_pages(
        store,
        ListSessionsRequest {
            page_size: 50,
            query: "NEEDLE".into(),
            ..Default::default()
        },
    );
    let mut found: Vec<String> = needles.into_iter().map(|(id, ..)| id).collect();
    found.sort();
    assert_eq!(found, vec![id(7), id(47), id(87)]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn pages_walk_the_index_and_the_unabsorbed_changes_alike_and_survive_a_restart() {
    let disk = SimStorage::new();
    let dir = tempfile::tempdir().unwrap();
    let index_dir = dir.path().join("index");
    let store = open_store_caching(&disk, &index_dir, CACHE_BYTES);
    for i in 0..SESSIONS {
        store
            .append(op(&id(i), vec![user(&title(i))], None))
            .await
            .expect("append");
    }
    // Past the index's lag: the next op is followed by an absorb of all of the above.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut idle = HashSet::new();
    for i in (0..SESSIONS).step_by(11) {
        let session = id(i);
        let lease = store
            .acquire_lease(session.clone(), "runner".into(), 60_000)
            .await
            .expect("lease");
        store
            .append(op(&session, vec![final_answer()], Some(lease.epoch)))
            .await
            .expect("answer");
        idle.insert(session);
    }
    // Some of these are not absorbed yet: their places in the index are stale.
    check_listing(&store, &idle);
    tokio::time::sleep(Duration::from_millis(300)).await;
    store
        .append(op(&id(1), vec![user("and more")], None))
        .await
        .expect("append");
    tokio::time::sleep(Duration::from_millis(300)).await;
    check_listing(&store, &idle);
    let info = store.get_session(&id(5)).expect("get");
    assert_eq!(info.title, title(5), "read back from the log");

    store.close().expect("close");
    let store = open_store_caching(&disk, &index_dir, CACHE_BYTES);
    check_listing(&store, &idle);
}

/// A query reads each session it walks past, so one call walks at most `QUERY_SCAN` of
/// them: its page ends there, short, with a token that goes on from there, and paging on
/// finds every match once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_query_walks_a_bounded_stretch_per_call_and_pages_through_the_rest() {
    let disk = SimStorage::new();
    let dir = tempfile::tempdir().unwrap();
    let store = open_store_caching(&disk, &dir.path().join("index"), CACHE_BYTES);
    let count = event_store::queries::QUERY_SCAN + 500;
    let appends = (0..count).map(|i| {
        let text = if i == 3 || i == count - 3 {
            format!("the needle {i}")
        } else {
            format!("hay {i}")
        };
        store.append(op(&format!("q-{i:05}"), vec![user(&text)], None))
    });
    for result in futures::future::join_all(appends).await {
        result.expect("append");
    }
    // All in the index: an op past the index's lag is followed by an absorb, which the op's
    // answer does not wait for. Until it is done, the sessions it takes in are listed from
    // memory, which the budget does not bound, so the first call is looked at only once the
    // index has them all (a loaded machine may take seconds over it).
    tokio::time::sleep(Duration::from_millis(300)).await;
    store
        .append(op("q-00000", vec![user("more hay")], None))
        .await
        .expect("append");
    let needles = ListSessionsRequest {
        page_size: 50,
        query: "needle".into(),
        ..Default::default()
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    let first = loop {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let page = store
            .list_sessions(&needles, &Scope::everything())
            .expect("a page");
        if !page.next_page_token.is_empty() || Instant::now() > deadline {
            break page;
        }
    };
    assert!(
        !first.next_page_token.is_empty(),
        "the first call stops at its budget with a token: {first:?}"
    );
    let all = all_pages(&store, needles);
    let mut ids: Vec<String> = all.into_iter().map(|(id, ..)| id).collect();
    ids.sort();
    assert_eq!(
        ids,
        vec![format!("q-{:05}", 3), format!("q-{:05}", count - 3)]
    );
}
