//! The store's durable timer, against the real `event-store` (either backend:
//! `AGENTLOG_TEST_BACKEND`): after a `model_retry`, `ClaimSession` hands the session to
//! nobody before its `retry_at_unix_ms`, and to a waiting claimant once it is due; the time
//! is the session's state, so it holds across a SIGKILL of the store and, over PostgreSQL,
//! whichever replica the claim reaches. `GetSession` and `ListSessions` show it as
//! `not_before_unix_ms`; anything but streamed text or a new configuration ends it.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::{
    event, AcquireLeaseRequest, AppendRequest, ClaimSessionRequest, Event, GetSessionRequest,
    ListSessionsRequest, ModelRetry, ReleaseLeaseRequest, UserMessage,
};
use integration_tests::{test_backend_is_postgres, Store};
use tonic::transport::Channel;

type Client = EventStoreClient<Channel>;

fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

async fn user(client: &mut Client, session: &str, id: &str) {
    client
        .append(AppendRequest {
            session_id: session.into(),
            events: vec![Event {
                event_id: id.into(),
                kind: Some(event::Kind::UserMessage(UserMessage { text: "go".into() })),
                ..Event::default()
            }],
            ..AppendRequest::default()
        })
        .await
        .expect("a user turn");
}

/// A runner's failed call of `session`, due at `retry_at`: leased, logged, let go.
async fn park(client: &mut Client, session: &str, retry_at: i64) {
    let lease = client
        .acquire_lease(AcquireLeaseRequest {
            session_id: session.into(),
            owner: "r1".into(),
            ttl_ms: 30_000,
        })
        .await
        .expect("lease")
        .into_inner();
    client
        .append(AppendRequest {
            session_id: session.into(),
            lease_epoch: Some(lease.epoch),
            events: vec![Event {
                event_id: format!("retry:{retry_at}"),
                kind: Some(event::Kind::ModelRetry(ModelRetry {
                    turn: 0,
                    attempt: 1,
                    model: "anthropic:m".into(),
                    reason: "overloaded".into(),
                    message: "HTTP 529".into(),
                    retry_at_unix_ms: retry_at,
                })),
                ..Event::default()
            }],
            ..AppendRequest::default()
        })
        .await
        .expect("model_retry");
    client
        .release_lease(ReleaseLeaseRequest {
            session_id: session.into(),
            owner: "r1".into(),
            epoch: lease.epoch,
        })
        .await
        .expect("release");
}

async fn claim(client: &mut Client, wait: Duration) -> Option<String> {
    client
        .claim_session(ClaimSessionRequest {
            owner: "r2".into(),
            ttl_ms: 30_000,
            wait_ms: wait.as_millis() as u64,
        })
        .await
        .expect("claim")
        .into_inner()
        .lease
        .map(|l| l.session_id)
}

async fn not_before(client: &mut Client, session: &str) -> i64 {
    client
        .get_session(GetSessionRequest {
            session_id: session.into(),
        })
        .await
        .expect("session")
        .into_inner()
        .not_before_unix_ms
}

#[tokio::test]
async fn a_parked_session_goes_to_nobody_before_it_is_due_and_to_a_waiting_claim_then() {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    user(&mut client, "parked", "u1").await;
    let due = now_ms() + 3_000;
    park(&mut client, "parked", due).await;
    assert_eq!(not_before(&mut client, "parked").await, due);
    let listed = client
        .list_sessions(ListSessionsRequest::default())
        .await
        .expect("list")
        .into_inner();
    assert_eq!(listed.sessions[0].not_before_unix_ms, due);

    // A healthy session is worked meanwhile.
    user(&mut client, "healthy", "h1").await;
    assert_eq!(
        claim(&mut client, Duration::from_millis(500))
            .await
            .as_deref(),
        Some("healthy")
    );
    assert_eq!(claim(&mut client, Duration::from_millis(500)).await, None);

    // A claimant waiting through the due time gets it then, and no sooner.
    let got = claim(&mut client, Duration::from_secs(10)).await;
    let at = now_ms();
    assert_eq!(got.as_deref(), Some("parked"));
    assert!(at >= due, "claimed {} ms before it was due", due - at);
    assert!(at - due < 5_000, "claimed {} ms after it was due", at - due);
}

#[tokio::test]
async fn the_timer_holds_across_a_kill_of_the_store_and_a_new_turn_ends_it() {
    let mut store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    user(&mut client, "parked", "u1").await;
    let due = now_ms() + 60_000;
    park(&mut client, "parked", due).await;
    store.kill9();
    let store = store.restart().expect("restart");
    let mut client = store.client().await.expect("client");
    assert_eq!(not_before(&mut client, "parked").await, due);
    assert_eq!(claim(&mut client, Duration::from_millis(1500)).await, None);
    // A person's new turn starts a new run: the session has work at once.
    user(&mut client, "parked", "u2").await;
    assert_eq!(not_before(&mut client, "parked").await, 0);
    assert_eq!(
        claim(&mut client, Duration::from_secs(5)).await.as_deref(),
        Some("parked")
    );
}

#[tokio::test]
async fn every_replica_keeps_the_timer() {
    if !test_backend_is_postgres() {
        return; // one replica on the local backend: the tests above
    }
    let a = Store::start().expect("store");
    let b = a.restart().expect("a second replica");
    let mut on_a = a.client().await.expect("client");
    let mut on_b = b.client().await.expect("client");
    user(&mut on_a, "parked", "u1").await;
    let due = now_ms() + 2_500;
    park(&mut on_a, "parked", due).await;
    assert_eq!(not_before(&mut on_b, "parked").await, due);
    let got = claim(&mut on_b, Duration::from_secs(10)).await;
    let at = now_ms();
    assert_eq!(got.as_deref(), Some("parked"));
    assert!(at >= due, "claimed {} ms before it was due", due - at);
}
