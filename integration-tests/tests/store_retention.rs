//! `event-store --retain-idle` against the real binary (over PostgreSQL with
//! `AGENTLOG_TEST_BACKEND=postgres`), on a clock the test moves: the store honours the
//! test-only `AGENTLOG_TEST_CLOCK_FILE` (its clock runs that many milliseconds ahead of the
//! system's), so a session goes idle for hours in a moment. Retention deletes exactly the
//! sessions whose last event is older than the span, that hold no live lease and that are
//! not pinned, as DeleteSession would; the others stay until they qualify.

use std::path::Path;
use std::time::{Duration, Instant};

use agentlog_proto::reason::Reason;
use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::{
    AcquireLeaseRequest, AppendRequest, GetSessionRequest, PinSessionRequest,
};
use anyhow::{bail, Result};
use integration_tests::{user_event, Store};
use tonic::transport::Channel;
use tonic::Code;

const HOUR_MS: i64 = 3_600_000;
const MINUTE_MS: i64 = 60_000;

/// Moves the store's clock to `offset_ms` ahead of the system's, and waits for the store to
/// have read it (it re-reads the file every 100 ms).
async fn set_clock(file: &Path, offset_ms: i64) -> Result<()> {
    std::fs::write(file, offset_ms.to_string())?;
    tokio::time::sleep(Duration::from_millis(400)).await;
    Ok(())
}

async fn user_message(client: &mut EventStoreClient<Channel>, id: &str) -> Result<()> {
    client
        .append(AppendRequest {
            session_id: id.into(),
            events: vec![user_event("", "hello")],
            ..Default::default()
        })
        .await?;
    Ok(())
}

/// Whether the session is there (`false`: deleted; anything else fails the test).
async fn exists(client: &mut EventStoreClient<Channel>, id: &str) -> Result<bool> {
    match client
        .get_session(GetSessionRequest {
            session_id: id.into(),
        })
        .await
    {
        Ok(_) => Ok(true),
        Err(s) if s.code() == Code::NotFound && Reason::of(&s) == Some(Reason::SessionDeleted) => {
            Ok(false)
        }
        Err(s) => bail!("GetSession({id}): {s:?}"),
    }
}

/// Waits until retention has deleted `id`.
async fn deleted_by_retention(client: &mut EventStoreClient<Channel>, id: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(30);
    while exists(client, id).await? {
        if Instant::now() > deadline {
            bail!("retention never deleted {id}");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retention_deletes_idle_sessions_without_a_live_lease_on_a_moved_clock() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let clock = tmp.path().join("clock-offset-ms");
    std::fs::write(&clock, "0")?;
    let clock_env = clock.display().to_string();
    let store = Store::start_with_env(
        &["--retain-idle", "2h", "--retention-interval", "200ms"],
        &[("AGENTLOG_TEST_CLOCK_FILE", &clock_env)],
    )?;
    let mut client = store.client().await?;
    let (old, leased, fresh, pinned) = ("ret-old", "ret-leased", "ret-fresh", "ret-pinned");
    user_message(&mut client, old).await?;
    user_message(&mut client, leased).await?;
    user_message(&mut client, pinned).await?;
    let pin = |pinned: bool| PinSessionRequest {
        session_id: "ret-pinned".into(),
        pinned,
    };
    let info = client.pin_session(pin(true)).await?.into_inner();
    assert!(info.pinned, "{info:?}");

    // 1h59m later: nothing is idle for 2h yet. A runner takes a lease on one session
    // (10 minutes), and a new session starts.
    set_clock(&clock, 2 * HOUR_MS - MINUTE_MS).await?;
    client
        .acquire_lease(AcquireLeaseRequest {
            session_id: leased.into(),
            owner: "runner-a".into(),
            ttl_ms: 10 * MINUTE_MS as u64,
        })
        .await?;
    user_message(&mut client, fresh).await?;
    tokio::time::sleep(Duration::from_millis(600)).await;
    for id in [old, leased, fresh] {
        assert!(exists(&mut client, id).await?, "{id} was deleted too early");
    }

    // 2h1m: the first session is idle past the span and goes; the leased one is as idle
    // but its lease is live, and the new one is idle 2 minutes.
    set_clock(&clock, 2 * HOUR_MS + MINUTE_MS).await?;
    deleted_by_retention(&mut client, old).await?;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(exists(&mut client, leased).await?, "a live lease keeps it");
    assert!(exists(&mut client, fresh).await?, "idle for minutes only");
    assert!(exists(&mut client, pinned).await?, "a pin keeps it");
    let again = client
        .append(AppendRequest {
            session_id: old.into(),
            events: vec![user_event("", "back?")],
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(
        Reason::of(&again),
        Some(Reason::SessionDeleted),
        "{again:?}"
    );

    // 3h: the lease ran out, so the leased session goes too; the new one stays, and so
    // does the pinned one, until it is unpinned.
    set_clock(&clock, 3 * HOUR_MS).await?;
    deleted_by_retention(&mut client, leased).await?;
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(exists(&mut client, fresh).await?, "idle for an hour only");
    assert!(exists(&mut client, pinned).await?, "a pin keeps it");
    assert!(!client.pin_session(pin(false)).await?.into_inner().pinned);
    deleted_by_retention(&mut client, pinned).await?;
    Ok(())
}
