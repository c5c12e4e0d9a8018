//! The local store's reclamation under real kills: the binary is killed with SIGKILL while
//! it rewrites segments without deleted sessions' records (caught with a rewrite file on
//! disk), and at other moments, again and again, with appends to a live session between
//! the rounds. After every restart the live session holds every acknowledged event at its
//! seq, the deleted sessions stay deleted (their old event ids write nothing), and in the
//! end no file under the data directory holds their text. (The power-loss simulator cuts
//! each crash point of a pass in `event-store/tests/reclaim.rs`.)

use std::path::Path;
use std::time::{Duration, Instant};

use agentlog_proto::reason::Reason;
use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::{AppendRequest, DeleteSessionRequest, GetSessionRequest};
use anyhow::{ensure, Result};
use integration_tests::{read_log, test_backend_is_postgres, user_event, Store};
use tonic::transport::Channel;

const LIVE: &str = "rk-live";
const DOOMED: [&str; 3] = ["rk-doomed-a", "rk-doomed-b", "rk-doomed-c"];
const MARK: &str = "rk-forget-this";
const FLAGS: [&str; 4] = ["--segment-bytes", "65536", "--reclaim-after", "100ms"];

/// Appends `(event id, text)`s to session `id` in one append.
async fn append(client: &mut EventStoreClient<Channel>, id: &str, events: &[(String, String)]) {
    client
        .append(AppendRequest {
            session_id: id.into(),
            events: events.iter().map(|(e, t)| user_event(e, t)).collect(),
            ..Default::default()
        })
        .await
        .expect("append");
}

/// The live session holds exactly `acked` (event ids in seq order); the doomed ones are
/// deleted and stay so.
async fn check(client: &mut EventStoreClient<Channel>, acked: &[String]) -> Result<()> {
    let events = read_log(client, LIVE).await;
    let ids: Vec<&str> = events.iter().map(|e| e.event_id.as_str()).collect();
    ensure!(ids == acked, "the live session lost or changed events");
    ensure!(events
        .iter()
        .enumerate()
        .all(|(i, e)| e.seq == i as u64 + 1));
    for id in DOOMED {
        let got = client
            .get_session(GetSessionRequest {
                session_id: id.into(),
            })
            .await
            .unwrap_err();
        ensure!(
            Reason::of(&got) == Some(Reason::SessionDeleted),
            "{id}: {got:?}"
        );
        let again = client
            .append(AppendRequest {
                session_id: id.into(),
                events: vec![user_event(&format!("{id}-0-0"), MARK)],
                ..Default::default()
            })
            .await
            .unwrap_err();
        ensure!(
            Reason::of(&again) == Some(Reason::SessionDeleted),
            "{id}: {again:?}"
        );
    }
    Ok(())
}

/// Whether any file under `dir` holds `needle`.
fn holds(dir: &Path, needle: &[u8]) -> bool {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| {
            let path = e.path();
            if path.is_dir() {
                holds(&path, needle)
            } else {
                std::fs::read(&path).is_ok_and(|b| b.windows(needle.len()).any(|w| w == needle))
            }
        })
}

/// A segment rewrite in flight: its file is in the log directory.
fn rewriting(data_dir: &Path) -> bool {
    std::fs::read_dir(data_dir.join("log"))
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| e.file_name().to_string_lossy().ends_with(".rewrite"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kills_during_the_rewrite_lose_nothing_and_bring_nothing_back() -> Result<()> {
    if test_backend_is_postgres() {
        eprintln!("SKIPPED: the local log's reclamation");
        return Ok(());
    }
    let mut store = Store::start_with(&FLAGS)?;
    let data_dir = store.data_dir.clone();
    let mut client = store.client().await?;
    let mut acked = Vec::new();
    // About 2.4 MB in 64 KiB segments, every one of them holding doomed records.
    let pad = "p".repeat(2000);
    for i in 0..60 {
        for id in DOOMED {
            let events: Vec<(String, String)> = (0..5)
                .map(|k| (format!("{id}-{i}-{k}"), format!("{MARK} {i} {pad}")))
                .collect();
            append(&mut client, id, &events).await;
        }
        let events: Vec<(String, String)> = (0..5)
            .map(|k| (format!("live-{i}-{k}"), format!("kept {i} {pad}")))
            .collect();
        append(&mut client, LIVE, &events).await;
        acked.extend(events.into_iter().map(|(id, _)| id));
    }
    for id in DOOMED {
        client
            .delete_session(DeleteSessionRequest {
                session_id: id.into(),
            })
            .await?;
    }

    let mut caught_rewriting = 0;
    let mut rng = fastrand::Rng::with_seed(0x6b69_6c6c);
    for round in 0..6 {
        // Half the rounds wait for a rewrite file to show up, the others kill at a random
        // moment of the pass.
        let deadline = Instant::now() + Duration::from_secs(5);
        if round % 2 == 0 {
            while !rewriting(&data_dir) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_micros(200));
            }
        } else {
            tokio::time::sleep(Duration::from_millis(rng.u64(50..400))).await;
        }
        store.kill9();
        if rewriting(&data_dir) {
            caught_rewriting += 1;
        }
        store = store.restart()?;
        client = store.client().await?;
        check(&mut client, &acked).await?;
        let events: Vec<(String, String)> = (0..5)
            .map(|i| (format!("live-r{round}-{i}"), "between kills".to_string()))
            .collect();
        append(&mut client, LIVE, &events).await;
        acked.extend(events.into_iter().map(|(id, _)| id));
    }
    eprintln!("{caught_rewriting} of 6 kills landed in the middle of a segment's rewrite");
    ensure!(
        caught_rewriting > 0,
        "no kill landed during a rewrite: the test did not test what it says"
    );

    // The reclamation finishes after all that.
    let deadline = Instant::now() + Duration::from_secs(60);
    while holds(&data_dir, MARK.as_bytes()) {
        ensure!(
            Instant::now() < deadline,
            "the deleted text is still on disk"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    check(&mut client, &acked).await?;
    Ok(())
}
