//! DeleteSession and what follows it, against the real `event-store` (over PostgreSQL with
//! `AGENTLOG_TEST_BACKEND=postgres`): a deleted session answers every call naming it with
//! `NOT_FOUND`/`SESSION_DELETED`, a live subscription on it ends with that status, lists and
//! claims never show it, and nothing brings it back (a retried append with its old event
//! ids, the holder of its old epoch, a restart between the tombstone and the reclamation).
//! Deleting it again succeeds; a session that never existed is `NOT_FOUND`. And its bytes
//! leave the disk: after the reclamation no file under the data directory holds any of
//! its text (on PostgreSQL: none of its rows is left, and the tombstone holds no text).
//!
//! The local stores here reclaim 100 ms after a deletion (`--reclaim-after`) instead of
//! 30 s, in segments of 64 KiB, so that the sessions span several.

use std::time::Duration;

use agentlog_proto::reason::Reason;
use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::{
    append_stream_response, event, AcquireLeaseRequest, AppendRequest, ClaimSessionRequest,
    DeleteSessionRequest, Event, ForkSessionRequest, GetSessionRequest, GetSnapshotRequest,
    ListSessionsRequest, ReleaseLeaseRequest, RenewLeaseRequest, SnapshotChunk, SubscribeRequest,
    ToolStarted,
};
use anyhow::{ensure, Context, Result};
use integration_tests::{read_log, test_backend_is_postgres, user_event, Backing, Store};
use tonic::transport::Channel;
use tonic::{Code, Status};

/// A bound for what must happen eventually (never an assertion on speed).
const BOUND: Duration = Duration::from_secs(20);
/// The local store reclaims soon after a deletion, in small segments.
const RECLAIM_SOON: [&str; 4] = ["--reclaim-after", "100ms", "--segment-bytes", "65536"];
/// The local store does not reclaim for the length of a test.
const RECLAIM_LATER: [&str; 2] = ["--reclaim-after", "1h"];

type Client = EventStoreClient<Channel>;

/// Passes if `result` is the refusal of a deleted session.
fn deleted<T: std::fmt::Debug>(what: &str, result: Result<T, Status>) {
    let status = match result {
        Ok(value) => panic!("{what} on a deleted session answered {value:?}"),
        Err(status) => status,
    };
    assert_eq!(status.code(), Code::NotFound, "{what}: {status:?}");
    assert_eq!(
        Reason::of(&status),
        Some(Reason::SessionDeleted),
        "{what}: {status:?}"
    );
}

async fn append(client: &mut Client, session_id: &str, events: Vec<Event>) -> Result<u64> {
    Ok(client
        .append(AppendRequest {
            session_id: session_id.into(),
            events,
            ..Default::default()
        })
        .await?
        .into_inner()
        .last_seq)
}

async fn delete(client: &mut Client, session_id: &str) -> Result<(), Status> {
    client
        .delete_session(DeleteSessionRequest {
            session_id: session_id.into(),
        })
        .await
        .map(|_| ())
}

fn tool_started(event_id: &str) -> Event {
    Event {
        event_id: event_id.into(),
        kind: Some(event::Kind::ToolStarted(ToolStarted {
            tool_use_id: "t1".into(),
            idempotency_key: "k".into(),
            attempt: 1,
        })),
        ..Default::default()
    }
}

async fn acquire(client: &mut Client, session_id: &str, owner: &str, ttl_ms: u64) -> Result<u64> {
    Ok(client
        .acquire_lease(AcquireLeaseRequest {
            session_id: session_id.into(),
            owner: owner.into(),
            ttl_ms,
        })
        .await?
        .into_inner()
        .epoch)
}

/// Every session ListSessions shows, page after page.
async fn listed(client: &mut Client) -> Result<Vec<String>> {
    let mut ids = Vec::new();
    let mut page_token = String::new();
    loop {
        let page = client
            .list_sessions(ListSessionsRequest {
                page_size: 2,
                page_token,
                ..Default::default()
            })
            .await?
            .into_inner();
        ids.extend(page.sessions.into_iter().map(|s| s.session_id));
        if page.next_page_token.is_empty() {
            return Ok(ids);
        }
        page_token = page.next_page_token;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_session_refuses_every_call_and_vanishes_from_lists_and_claims() -> Result<()> {
    let store = Store::start()?;
    let mut client = store.client().await?;
    let (gone, kept) = ("del-gone", "del-kept");
    append(
        &mut client,
        gone,
        vec![user_event("u1", "please forget me")],
    )
    .await?;
    append(&mut client, kept, vec![user_event("k1", "keep me")]).await?;
    let epoch = acquire(&mut client, gone, "runner-a", 60_000).await?;
    append_leased(&mut client, gone, epoch, tool_started("started:t1:1")).await?;
    let chunk = SnapshotChunk {
        session_id: gone.into(),
        lease_epoch: epoch,
        seq: 2,
        format: "fold".into(),
        data: b"derived".to_vec().into(),
    };
    client
        .put_snapshot(tokio_stream::iter(vec![chunk.clone()]))
        .await?;
    let mut follower = client
        .subscribe(SubscribeRequest {
            session_id: gone.into(),
            from_seq: 1,
            follow: true,
        })
        .await?
        .into_inner();
    for seq in 1..=2 {
        let event = follower
            .message()
            .await?
            .context("the follower ended early")?;
        ensure!(event.seq == seq, "follower got seq {} for {seq}", event.seq);
    }

    delete(&mut client, gone).await?;

    // The live subscription ends with the refusal.
    let ended = tokio::time::timeout(BOUND, follower.message())
        .await
        .context("the follower was not ended")?;
    deleted("a live Subscribe", ended);

    // Every call naming it is refused.
    let get = |id: &str| GetSessionRequest {
        session_id: id.into(),
    };
    deleted("GetSession", client.get_session(get(gone)).await);
    deleted(
        "an append of a new event",
        append_events(&mut client, gone, vec![user_event("u2", "again")]).await,
    );
    deleted(
        "a retried append with the old event id",
        append_events(
            &mut client,
            gone,
            vec![user_event("u1", "please forget me")],
        )
        .await,
    );
    deleted(
        "an append under the old lease epoch",
        append_leased(&mut client, gone, epoch, tool_started("started:t1:2")).await,
    );
    let streamed = client
        .append_stream(tokio_stream::iter(vec![AppendRequest {
            session_id: gone.into(),
            events: vec![user_event("u3", "streamed")],
            ..Default::default()
        }]))
        .await?
        .into_inner()
        .message()
        .await?
        .and_then(|r| r.result)
        .context("AppendStream answered nothing")?;
    match streamed {
        append_stream_response::Result::Error(e) => deleted("AppendStream", Err::<(), _>(e.into())),
        other => panic!("AppendStream on a deleted session answered {other:?}"),
    }
    for follow in [false, true] {
        let subscribed = client
            .subscribe(SubscribeRequest {
                session_id: gone.into(),
                from_seq: 1,
                follow,
            })
            .await;
        let first = match subscribed {
            Ok(stream) => stream.into_inner().message().await,
            Err(status) => Err(status),
        };
        deleted("Subscribe", first);
    }
    deleted(
        "AcquireLease",
        client
            .acquire_lease(AcquireLeaseRequest {
                session_id: gone.into(),
                owner: "runner-b".into(),
                ttl_ms: 1000,
            })
            .await,
    );
    deleted(
        "RenewLease",
        client
            .renew_lease(RenewLeaseRequest {
                session_id: gone.into(),
                owner: "runner-a".into(),
                epoch,
                ttl_ms: 1000,
            })
            .await,
    );
    deleted(
        "ReleaseLease",
        client
            .release_lease(ReleaseLeaseRequest {
                session_id: gone.into(),
                owner: "runner-a".into(),
                epoch,
            })
            .await,
    );
    deleted(
        "PutSnapshot",
        client.put_snapshot(tokio_stream::iter(vec![chunk])).await,
    );
    let snapshot = client
        .get_snapshot(GetSnapshotRequest {
            session_id: gone.into(),
            format: "fold".into(),
        })
        .await;
    let first = match snapshot {
        Ok(stream) => stream.into_inner().message().await,
        Err(status) => Err(status),
    };
    deleted("GetSnapshot", first);

    // A fork can neither be made of it nor take its id.
    let fork = |parent: &str, new: &str| ForkSessionRequest {
        session_id: parent.into(),
        at_seq: 1,
        new_session_id: new.into(),
        events: Vec::new(),
    };
    deleted(
        "ForkSession of it",
        client.fork_session(fork(gone, "del-fork")).await,
    );
    deleted(
        "ForkSession into its id",
        client.fork_session(fork(kept, gone)).await,
    );

    // Lists and claims never show it; the other session is untouched.
    assert_eq!(listed(&mut client).await?, vec![kept.to_string()]);
    let claimed = client
        .claim_session(ClaimSessionRequest {
            owner: "runner-c".into(),
            ttl_ms: 10_000,
            wait_ms: 0,
        })
        .await?
        .into_inner()
        .lease
        .map(|l| l.session_id);
    assert_eq!(
        claimed.as_deref(),
        Some(kept),
        "only the live session is claimed"
    );
    assert_eq!(read_log(&mut client, kept).await.len(), 1);

    // Deleting it again succeeds; a session that never existed is not found.
    delete(&mut client, gone).await?;
    let never = delete(&mut client, "del-never-existed").await.unwrap_err();
    assert_eq!(never.code(), Code::NotFound);
    assert_eq!(Reason::of(&never), Some(Reason::SessionNotFound));
    deleted("GetSession", client.get_session(get(gone)).await);
    Ok(())
}

async fn append_events(
    client: &mut Client,
    session_id: &str,
    events: Vec<Event>,
) -> Result<u64, Status> {
    client
        .append(AppendRequest {
            session_id: session_id.into(),
            events,
            ..Default::default()
        })
        .await
        .map(|r| r.into_inner().last_seq)
}

async fn append_leased(
    client: &mut Client,
    session_id: &str,
    epoch: u64,
    event: Event,
) -> Result<u64, Status> {
    client
        .append(AppendRequest {
            session_id: session_id.into(),
            events: vec![event],
            lease_epoch: Some(epoch),
            ..Default::default()
        })
        .await
        .map(|r| r.into_inner().last_seq)
}

/// A claimant long-polling for a session whose lease is about to lapse never gets it once
/// it is deleted in the meantime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_long_poll_never_gets_a_session_deleted_while_it_waits() -> Result<()> {
    let store = Store::start()?;
    let mut client = store.client().await?;
    let id = "del-claimed";
    append(&mut client, id, vec![user_event("u1", "work for a runner")]).await?;
    acquire(&mut client, id, "runner-a", 1_500).await?;
    let mut claimant = client.clone();
    let claim = tokio::spawn(async move {
        claimant
            .claim_session(ClaimSessionRequest {
                owner: "runner-b".into(),
                ttl_ms: 10_000,
                wait_ms: 4_000,
            })
            .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    delete(&mut client, id).await?;
    let lease = claim.await??.into_inner().lease;
    assert_eq!(lease, None, "the long-poll handed out a deleted session");
    Ok(())
}

/// The store is killed right after the deletion (before any reclamation of its records)
/// and restarted: the session stays deleted, and its old ids and epoch still write nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_between_the_tombstone_and_the_reclamation_keeps_the_session_deleted(
) -> Result<()> {
    let mut store = Store::start_with(&RECLAIM_LATER)?;
    let mut client = store.client().await?;
    let (gone, kept) = ("del-restart", "del-restart-kept");
    append(&mut client, gone, vec![user_event("u1", "to be deleted")]).await?;
    let epoch = acquire(&mut client, gone, "runner-a", 60_000).await?;
    for i in 0..5 {
        append(
            &mut client,
            kept,
            vec![user_event(&format!("k{i}"), "kept")],
        )
        .await?;
    }
    delete(&mut client, gone).await?;
    store.kill9();

    // Restarted reclaiming soon: the deletion's reclamation is taken up again.
    let store = store.restart_with(&RECLAIM_SOON)?;
    let mut client = store.client().await?;
    deleted(
        "GetSession after a restart",
        client
            .get_session(GetSessionRequest {
                session_id: gone.into(),
            })
            .await,
    );
    deleted(
        "a retried append after a restart",
        append_events(&mut client, gone, vec![user_event("u1", "to be deleted")]).await,
    );
    deleted(
        "the old epoch after a restart",
        append_leased(&mut client, gone, epoch, tool_started("started:t1:1")).await,
    );
    let seqs: Vec<u64> = read_log(&mut client, kept)
        .await
        .iter()
        .map(|e| e.seq)
        .collect();
    assert_eq!(seqs, (1..=5).collect::<Vec<_>>());
    assert_eq!(listed(&mut client).await?, vec![kept.to_string()]);
    delete(&mut client, gone).await?;
    erased(&store, gone, "to be deleted").await?;
    Ok(())
}

/// Waits until nothing of the deleted session `id` whose text held `text` is left: no file
/// under the local store's data directory holds `text`; on PostgreSQL no event or snapshot
/// row of it is left and its row holds no text.
async fn erased(store: &Store, id: &str, text: &str) -> Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(40);
    loop {
        let left = match &store.backing {
            Backing::Dir(dir) => holding(dir, text.as_bytes()),
            Backing::Database(url, Some(pg)) => {
                let db = url.rsplit('/').next().unwrap_or_default();
                let rows = pg.psql(
                    db,
                    &format!(
                        "SELECT (SELECT count(*) FROM agentlog_events WHERE session_id = '{id}') \
                         + (SELECT count(*) FROM agentlog_snapshots WHERE session_id = '{id}') \
                         + (SELECT count(*) FROM agentlog_sessions WHERE session_id = '{id}' \
                         AND (first_user_text <> '' OR position('{text}'::bytea IN meta) > 0))"
                    ),
                )?;
                if rows == "0" {
                    Vec::new()
                } else {
                    vec![format!("{rows} rows")]
                }
            }
            Backing::Database(_, None) => anyhow::bail!("no server to look into"),
        };
        if left.is_empty() {
            return Ok(());
        }
        ensure!(
            std::time::Instant::now() < deadline,
            "{id}'s text is still on disk: {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Every file under `dir` that holds `needle`.
fn holding(dir: &std::path::Path, needle: &[u8]) -> Vec<String> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return found;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            found.extend(holding(&path, needle));
        } else if std::fs::read(&path).is_ok_and(|b| b.windows(needle.len()).any(|w| w == needle)) {
            found.push(path.display().to_string());
        }
    }
    found
}

/// A deleted session's events, title, first message and snapshot leave the disk; the live
/// session whose records shared its segments is whole.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_sessions_text_leaves_the_disk() -> Result<()> {
    let store = Store::start_with(&RECLAIM_SOON)?;
    let mut client = store.client().await?;
    let (gone, kept) = ("del-erased", "del-erased-kept");
    // Unique to this run, so that nothing else on disk can hold it by chance.
    let secret = format!("erase-me-{:016x}", fastrand::u64(..));
    for i in 0..120 {
        let text = format!("{secret} {i} {}", "x".repeat(1000));
        append(&mut client, gone, vec![user_event(&format!("g{i}"), &text)]).await?;
        let text = format!("kept {i} {}", "y".repeat(1000));
        append(&mut client, kept, vec![user_event(&format!("k{i}"), &text)]).await?;
    }
    let epoch = acquire(&mut client, gone, "runner-a", 60_000).await?;
    client
        .put_snapshot(tokio_stream::iter(vec![SnapshotChunk {
            session_id: gone.into(),
            lease_epoch: epoch,
            seq: 120,
            format: "fold".into(),
            data: format!("snapshot of {secret}").into_bytes().into(),
        }]))
        .await?;
    if let Backing::Dir(dir) = &store.backing {
        ensure!(
            !holding(dir, secret.as_bytes()).is_empty(),
            "the text is there first"
        );
    }

    delete(&mut client, gone).await?;
    erased(&store, gone, &secret).await?;
    let seqs: Vec<u64> = read_log(&mut client, kept)
        .await
        .iter()
        .map(|e| e.seq)
        .collect();
    assert_eq!(seqs, (1..=120).collect::<Vec<_>>());
    deleted(
        "GetSession after the reclamation",
        client
            .get_session(GetSessionRequest {
                session_id: gone.into(),
            })
            .await,
    );
    Ok(())
}

/// PostgreSQL: a follower on another replica is ended, and that replica refuses the session
/// too (its cached state of the session is stale, the database's is not).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deletion_through_one_replica_ends_a_follower_on_another() -> Result<()> {
    if !test_backend_is_postgres() {
        eprintln!("SKIPPED: one replica only on the local backend");
        return Ok(());
    }
    let a = Store::start()?;
    let b = a.restart()?;
    let (mut on_a, mut on_b) = (a.client().await?, b.client().await?);
    let id = "del-replicas";
    append(&mut on_a, id, vec![user_event("u1", "seen on both")]).await?;
    // B learns the session (its cache holds it) and follows it.
    append(&mut on_b, id, vec![user_event("u2", "from b")]).await?;
    let mut follower = on_b
        .subscribe(SubscribeRequest {
            session_id: id.into(),
            from_seq: 1,
            follow: true,
        })
        .await?
        .into_inner();
    for seq in 1..=2 {
        let event = follower
            .message()
            .await?
            .context("the follower ended early")?;
        ensure!(event.seq == seq, "follower got seq {} for {seq}", event.seq);
    }
    delete(&mut on_a, id).await?;
    let ended = tokio::time::timeout(BOUND, follower.message())
        .await
        .context("the follower on the other replica was not ended")?;
    deleted("a live Subscribe on the other replica", ended);
    deleted(
        "an append through the other replica",
        append_events(&mut on_b, id, vec![user_event("u2", "from b")]).await,
    );
    deleted(
        "GetSession on the other replica",
        on_b.get_session(GetSessionRequest {
            session_id: id.into(),
        })
        .await,
    );
    Ok(())
}
