//! `event-store --retain-idle D --archive-dir DIR` against the real binary (either backend:
//! `AGENTLOG_TEST_BACKEND`), on a clock the test moves (`AGENTLOG_TEST_CLOCK_FILE`): every
//! session retention deletes has its export, whole and fsync'd, in DIR first, also when the
//! store is killed (`kill -9`) in the middle of archiving; a pinned or leased session is
//! neither archived nor deleted; each archive imports back into a fresh store as the
//! session it was.

use std::path::Path;
use std::time::{Duration, Instant};

use agentlog_proto::reason::Reason;
use agentlog_proto::v1::{
    AcquireLeaseRequest, AppendRequest, GetSessionRequest, ImportChunk, ImportOutcome,
    PinSessionRequest,
};
use anyhow::{bail, Context, Result};
use integration_tests::{read_log, user_event, Store};
use tonic::Code;

const SESSIONS: usize = 120;
const EVENTS: usize = 10;
const HOUR_MS: i64 = 3_600_000;
const MINUTE_MS: i64 = 60_000;

fn archives(dir: &Path) -> Result<(Vec<String>, usize)> {
    let mut whole = Vec::new();
    let mut partial = 0;
    for entry in std::fs::read_dir(dir)? {
        let name = entry?.file_name().to_string_lossy().into_owned();
        if name.ends_with(".partial") {
            partial += 1;
        } else if let Some(id) = name.strip_suffix(".agentlog.jsonl") {
            whole.push(id.to_string());
        }
    }
    whole.sort();
    Ok((whole, partial))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_session_retention_deletes_is_archived_first_even_across_kill_9() -> Result<()> {
    let tmp = tempfile::tempdir()?;
    let clock = tmp.path().join("clock-offset-ms");
    std::fs::write(&clock, "0")?;
    let dir = tmp.path().join("archive");
    let clock_env = clock.display().to_string();
    let dir_arg = dir.display().to_string();
    let mut store = Store::start_with_env(
        &[
            "--retain-idle",
            "2h",
            "--retention-interval",
            "100ms",
            "--archive-dir",
            &dir_arg,
        ],
        &[("AGENTLOG_TEST_CLOCK_FILE", &clock_env)],
    )?;
    let mut client = store.client().await?;
    let text = "y".repeat(300);
    let ids: Vec<String> = (0..SESSIONS).map(|i| format!("arc-{i:03}")).collect();
    for id in &ids {
        let events = (0..EVENTS)
            .map(|e| user_event(&format!("{id}/e{e}"), &text))
            .collect();
        client
            .append(AppendRequest {
                session_id: id.clone(),
                events,
                ..Default::default()
            })
            .await?;
    }
    for id in ["arc-pinned", "arc-leased"] {
        client
            .append(AppendRequest {
                session_id: id.into(),
                events: vec![user_event("", "keep me")],
                ..Default::default()
            })
            .await?;
    }
    client
        .pin_session(PinSessionRequest {
            session_id: "arc-pinned".into(),
            pinned: true,
        })
        .await?;

    // A minute short of two hours later a runner leases one session for ten minutes; then
    // at two hours and five minutes all but two are idle past the span.
    std::fs::write(&clock, (2 * HOUR_MS - MINUTE_MS).to_string())?;
    tokio::time::sleep(Duration::from_millis(300)).await;
    client
        .acquire_lease(AcquireLeaseRequest {
            session_id: "arc-leased".into(),
            owner: "r1".into(),
            ttl_ms: 10 * MINUTE_MS as u64,
        })
        .await?;
    std::fs::write(&clock, (2 * HOUR_MS + 5 * MINUTE_MS).to_string())?;
    // Kill the store once archiving is under way (some archives written, not all).
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let (whole, _) = archives(&dir)?;
        if whole.len() >= 10 {
            break;
        }
        if Instant::now() > deadline {
            bail!("archiving never started ({} archives)", whole.len());
        }
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    store.kill9();
    let (at_kill, _) = archives(&dir)?;
    let store = store.restart()?;
    let mut client = store.client().await?;

    // Every idle session goes, each with its archive whole on disk before it went.
    let deadline = Instant::now() + Duration::from_secs(120);
    for id in &ids {
        loop {
            match client
                .get_session(GetSessionRequest {
                    session_id: id.clone(),
                })
                .await
            {
                Err(s) if Reason::of(&s) == Some(Reason::SessionDeleted) => break,
                Ok(_) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await
                }
                other => bail!("{id} was not deleted: {other:?}"),
            }
        }
    }
    let (whole, partial) = archives(&dir)?;
    assert_eq!(whole, ids, "an archive per deleted session, nothing else");
    assert_eq!(partial, 0, "no partial file left after a whole pass");
    assert!(
        at_kill.len() < SESSIONS,
        "killed after archiving had finished ({} archives)",
        at_kill.len()
    );
    for id in ["arc-pinned", "arc-leased"] {
        let kept = client
            .get_session(GetSessionRequest {
                session_id: id.into(),
            })
            .await;
        assert!(kept.is_ok(), "{id}: {kept:?}");
    }

    // Each archive imports back as the session it was.
    let fresh = Store::start()?;
    let mut back = fresh.client().await?;
    for id in &ids {
        let text = std::fs::read_to_string(dir.join(format!("{id}.agentlog.jsonl")))?;
        let mut results = back
            .import(tokio_stream::iter(vec![ImportChunk { text }]))
            .await?
            .into_inner();
        let result = results.message().await?.context("a result")?;
        assert_eq!(
            (result.session_id.as_str(), result.outcome()),
            (id.as_str(), ImportOutcome::Imported),
            "{result:?}"
        );
        let log = read_log(&mut back, id).await;
        assert_eq!(log.len(), EVENTS, "{id}");
        for (e, event) in log.iter().enumerate() {
            assert_eq!(event.event_id, format!("{id}/e{e}"));
        }
    }
    let none = back
        .get_session(GetSessionRequest {
            session_id: "arc-pinned".into(),
        })
        .await
        .expect_err("never archived");
    assert_eq!(none.code(), Code::NotFound);
    Ok(())
}
