//! The store's volume fills up (a small tmpfs, which needs root to mount; CI runs as root,
//! elsewhere the test says it is skipped): appends are refused with RESOURCE_EXHAUSTED
//! naming the cause, reads and followers go on, health says the EventStore service is
//! NOT_SERVING; once space is freed appends resume by themselves, and a store killed and
//! restarted on the same volume holds every acknowledged event, with no gap.
//!
//! And a volume the store filled itself, with another file taking its very last bytes,
//! comes back without a restart and without anyone touching a file: sessions are deleted
//! through the API, the store reclaims their space (its reserve gives the tombstones and
//! the rewrites room), and appends resume.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use agentlog_proto::reason::Reason;
use agentlog_proto::v1::DeleteSessionRequest;
use agentlog_proto::v1::{AppendRequest, GetSessionRequest, SubscribeRequest};
use anyhow::{bail, ensure, Context, Result};
use integration_tests::{bin_path, read_log, user_event, Backing, Store};
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

const SESSION: &str = "disk-full";

/// A tmpfs mounted for the test, unmounted when dropped.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, size: &str) -> Result<Tmpfs> {
        std::fs::create_dir_all(dir)?;
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(dir)
            .status()
            .context("running mount")?;
        ensure!(status.success(), "mount -t tmpfs failed: {status}");
        Ok(Tmpfs(dir.to_path_buf()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).trim() == "0")
}

fn append(id: &str) -> AppendRequest {
    AppendRequest {
        session_id: SESSION.into(),
        events: vec![user_event(id, &"x".repeat(300))],
        ..Default::default()
    }
}

async fn store_health(store: &Store) -> Result<ServingStatus> {
    let channel = tonic::transport::Endpoint::from_shared(store.url())?
        .connect()
        .await?;
    let mut health = HealthClient::new(channel);
    let status = health
        .check(HealthCheckRequest {
            service: "agentlog.v1.EventStore".into(),
        })
        .await?
        .into_inner()
        .status;
    Ok(ServingStatus::try_from(status)?)
}

/// Writes `path` until the volume has no room left.
fn fill(path: &Path) -> Result<()> {
    use std::io::Write;
    let mut file = std::fs::File::create(path)?;
    let chunk = vec![7u8; 64 << 10];
    loop {
        if let Err(e) = file.write_all(&chunk).and_then(|()| file.sync_data()) {
            ensure!(
                e.kind() == std::io::ErrorKind::StorageFull,
                "filling the volume failed otherwise: {e}"
            );
            return Ok(());
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_volume_refuses_appends_keeps_reads_and_resumes_when_space_is_freed() -> Result<()> {
    if !is_root() {
        eprintln!("SKIPPED: mounting a small tmpfs needs root (CI runs as root)");
        return Ok(());
    }
    let tmp = tempfile::tempdir()?;
    let volume = tmp.path().join("volume");
    let _tmpfs = Tmpfs::mount(&volume, "32m")?;
    let data = volume.join("data");
    let mut store = Store::start_in(&data)?;
    let mut client = store.client().await?;
    for i in 0..10 {
        client.append(append(&format!("before-{i}"))).await?;
    }
    let mut follower = client
        .subscribe(SubscribeRequest {
            session_id: SESSION.into(),
            from_seq: 1,
            follow: true,
        })
        .await?
        .into_inner();
    for seq in 1..=10 {
        let event = follower
            .message()
            .await?
            .context("the follower's stream ended")?;
        ensure!(event.seq == seq, "follower got seq {} for {seq}", event.seq);
    }
    assert_eq!(store_health(&store).await?, ServingStatus::Serving);

    let filler = volume.join("filler");
    fill(&filler)?;
    let refused = client
        .append(append("during"))
        .await
        .expect_err("an append on a full volume must be refused");
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert_eq!(Reason::of(&refused), Some(Reason::DiskFull), "{refused:?}");
    assert!(
        refused.message().contains("disk is full"),
        "the refusal names the cause: {}",
        refused.message()
    );
    // Reads go on; health says appends cannot be served.
    assert_eq!(read_log(&mut client, SESSION).await.len(), 10);
    let info = client
        .get_session(GetSessionRequest {
            session_id: SESSION.into(),
        })
        .await?
        .into_inner();
    assert_eq!(info.last_seq, 10);
    assert_eq!(store_health(&store).await?, ServingStatus::NotServing);
    assert!(store.is_running(), "a full volume must not stop the store");

    std::fs::remove_file(&filler)?;
    let deadline = Instant::now() + Duration::from_secs(10);
    let resumed = loop {
        match client.append(append("after")).await {
            Ok(response) => break response.into_inner(),
            Err(s) if s.code() == Code::ResourceExhausted && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await
            }
            Err(s) => bail!("appends did not resume once space was freed: {s:?}"),
        }
    };
    assert_eq!(resumed.seqs, vec![11]);
    let event = follower
        .message()
        .await?
        .context("the follower's stream ended")?;
    assert_eq!(event.seq, 11, "the follower carries on");
    assert_eq!(store_health(&store).await?, ServingStatus::Serving);

    // Nothing acknowledged lost, nothing torn: a store killed and restarted on the volume
    // serves seqs 1..=11.
    store.kill9();
    let store = Store::start_in(&data)?;
    let mut client = store.client().await?;
    let seqs: Vec<u64> = read_log(&mut client, SESSION)
        .await
        .iter()
        .map(|e| e.seq)
        .collect();
    assert_eq!(seqs, (1..=11).collect::<Vec<_>>());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_volume_filled_by_sessions_recovers_when_they_are_deleted_without_a_restart() -> Result<()>
{
    if !is_root() {
        eprintln!("SKIPPED: mounting a small tmpfs needs root (CI runs as root)");
        return Ok(());
    }
    let tmp = tempfile::tempdir()?;
    let volume = tmp.path().join("volume");
    let _tmpfs = Tmpfs::mount(&volume, "32m")?;
    let data = volume.join("data");
    let flags = ["--segment-bytes", "1048576", "--reclaim-after", "200ms"];
    let start = || {
        Store::start_backed(
            &bin_path("event-store"),
            Backing::Dir(data.clone()),
            "127.0.0.1:0",
            &flags,
        )
    };
    let mut store = start()?;
    let mut client = store.client().await?;
    let kept = "df-kept";
    let doomed: Vec<String> = (0..4).map(|i| format!("df-doomed-{i}")).collect();

    // The sessions fill the volume, in appends of 128 KiB, until the store refuses.
    let text = "z".repeat(16 << 10);
    let mut kept_ids = Vec::new();
    let mut round = 0;
    let refused = 'fill: loop {
        for session in doomed.iter().map(String::as_str).chain([kept]) {
            let ids: Vec<String> = (0..8).map(|k| format!("{session}-{round}-{k}")).collect();
            let request = AppendRequest {
                session_id: session.into(),
                events: ids.iter().map(|id| user_event(id, &text)).collect(),
                ..Default::default()
            };
            match client.append(request).await {
                Ok(_) if session == kept => kept_ids.extend(ids),
                Ok(_) => {}
                Err(status) => break 'fill status,
            }
        }
        round += 1;
        ensure!(round < 1000, "the volume never filled");
    };
    assert_eq!(Reason::of(&refused), Some(Reason::DiskFull), "{refused:?}");
    // Something else takes the volume's last bytes.
    fill(&volume.join("filler"))?;
    assert_eq!(store_health(&store).await?, ServingStatus::NotServing);

    for session in &doomed {
        client
            .delete_session(DeleteSessionRequest {
                session_id: session.clone(),
            })
            .await
            .with_context(|| format!("deleting {session} on a full volume"))?;
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let request = AppendRequest {
            session_id: kept.into(),
            events: vec![user_event("after", "room again")],
            ..Default::default()
        };
        match client.append(request).await {
            Ok(_) => break,
            Err(s) if s.code() == Code::ResourceExhausted && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await
            }
            Err(s) => bail!("appends did not resume after the deletions: {s:?}"),
        }
    }
    kept_ids.push("after".into());
    assert_eq!(store_health(&store).await?, ServingStatus::Serving);
    assert!(store.is_running(), "no restart");
    assert!(volume.join("filler").exists(), "nobody touched a file");
    let ids = |events: Vec<agentlog_proto::v1::Event>| -> Vec<String> {
        events.into_iter().map(|e| e.event_id).collect()
    };
    assert_eq!(ids(read_log(&mut client, kept).await), kept_ids);

    // And all of it survives a kill.
    store.kill9();
    let store = start()?;
    let mut client = store.client().await?;
    assert_eq!(ids(read_log(&mut client, kept).await), kept_ids);
    for session in &doomed {
        let gone = client
            .get_session(GetSessionRequest {
                session_id: session.clone(),
            })
            .await
            .unwrap_err();
        assert_eq!(Reason::of(&gone), Some(Reason::SessionDeleted));
    }
    Ok(())
}

/// As a new user meets it: a 40 MiB volume, the store's default settings (no segment size,
/// no reclamation delay given), 40 sessions filling it. Deleting 30 of them makes room again
/// within the default reclamation delay, whatever the segment size is next to the volume's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_small_volume_with_default_settings_recovers_when_sessions_are_deleted() -> Result<()> {
    if !is_root() {
        eprintln!("SKIPPED: mounting a small tmpfs needs root (CI runs as root)");
        return Ok(());
    }
    let tmp = tempfile::tempdir()?;
    let volume = tmp.path().join("volume");
    let _tmpfs = Tmpfs::mount(&volume, "40m")?;
    let data = volume.join("data");
    let store = Store::start_backed(
        &bin_path("event-store"),
        Backing::Dir(data.clone()),
        "127.0.0.1:0",
        &[],
    )?;
    let mut client = store.client().await?;
    let sessions: Vec<String> = (0..40).map(|i| format!("small-{i:02}")).collect();
    let text = "s".repeat(1000);
    let mut acknowledged: std::collections::HashMap<String, Vec<String>> = Default::default();
    // One after another, about 0.75 MiB each, as sessions come and go (and then again from
    // the first), until the store refuses: the log holds them in that order.
    let mut pass = 0;
    let refused = 'fill: loop {
        for session in &sessions {
            for round in 0..24 {
                let ids: Vec<String> = (0..32)
                    .map(|k| format!("{session}-{pass}-{round}-{k}"))
                    .collect();
                let request = AppendRequest {
                    session_id: session.clone(),
                    events: ids.iter().map(|id| user_event(id, &text)).collect(),
                    ..Default::default()
                };
                match client.append(request).await {
                    Ok(_) => acknowledged.entry(session.clone()).or_default().extend(ids),
                    Err(status) => break 'fill status,
                }
            }
        }
        pass += 1;
        ensure!(pass < 10, "the volume never filled");
    };
    assert_eq!(Reason::of(&refused), Some(Reason::DiskFull), "{refused:?}");
    for session in &sessions[..30] {
        client
            .delete_session(DeleteSessionRequest {
                session_id: session.clone(),
            })
            .await
            .with_context(|| format!("deleting {session} on a full volume"))?;
    }
    // The default reclamation delay is 30 s: appends resume within it and a margin.
    let kept = &sessions[30];
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let request = AppendRequest {
            session_id: kept.clone(),
            events: vec![user_event("after", "room again")],
            ..Default::default()
        };
        match client.append(request).await {
            Ok(_) => break,
            Err(s) if s.code() == Code::ResourceExhausted && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(200)).await
            }
            Err(s) => bail!("appends did not resume after 30 of 40 sessions were deleted: {s:?}"),
        }
    }
    acknowledged
        .entry(kept.clone())
        .or_default()
        .push("after".into());
    for session in &sessions[30..] {
        let ids: Vec<String> = read_log(&mut client, session)
            .await
            .into_iter()
            .map(|e| e.event_id)
            .collect();
        assert_eq!(
            &ids,
            &acknowledged.remove(session).unwrap_or_default(),
            "{session}"
        );
    }
    Ok(())
}
