//! A full volume, through the storage trait: appends are refused with `RESOURCE_EXHAUSTED`
//! saying why, before anything is written; reads and followers go on; and appends resume by
//! themselves once there is room, with nothing torn or lost in the log.

mod common;

use std::time::Duration;

use agentlog_proto::reason::Reason;
use agentlog_proto::v1::Durability;
use common::{append_op, history, open_store_with, read_log};
use event_store::backend::local::log::storage::SimStorage;
use event_store::backend::local::log::LogConfig;
use event_store::backend::EventRun;
use event_store::StoreError;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

fn ids(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

/// Preallocated as in production, and not (each batch then reserves exactly its room).
const LAYOUTS: [LogConfig; 2] = [
    LogConfig {
        segment_bytes: 16 << 10,
        preallocate_bytes: 4 << 10,
    },
    LogConfig {
        segment_bytes: 16 << 10,
        preallocate_bytes: 0,
    },
];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_volume_refuses_appends_and_they_resume_once_there_is_room() {
    for layout in LAYOUTS {
        let disk = SimStorage::new();
        let dir = tempfile::tempdir().expect("temp dir");
        let index = dir.path().join("index");
        let store = open_store_with(&disk, &index, layout);
        let sync = Durability::Sync;
        store
            .append(append_op("full", &ids("before", 5), sync))
            .await
            .expect("room at first");
        let mut follower = store.subscribe("full".into(), 1, true, CancellationToken::new());
        assert_eq!(
            next_seqs(&mut follower, 5).await,
            (1..=5).collect::<Vec<_>>()
        );

        disk.set_full(true);
        // Whatever room was allocated ahead is used up first; then appends are refused.
        let mut accepted = 0;
        let refusal = loop {
            let op = append_op("full", &ids(&format!("during-{accepted}"), 20), sync);
            match store.append(op).await {
                Ok(_) => accepted += 20,
                Err(e) => break e,
            }
            assert!(accepted < 10_000, "a full volume never refused an append");
        };
        match &refusal {
            StoreError::Refused(Reason::DiskFull, why) => assert!(
                why.contains("disk is full") && why.contains("resume"),
                "the refusal says why and what to do: {why}"
            ),
            other => panic!("a full volume must refuse with RESOURCE_EXHAUSTED, got {other:?}"),
        }
        assert!(
            store.disk_full().borrow().is_some(),
            "the store says it is full"
        );
        // Reads go on.
        let last = 5 + accepted as u64;
        assert_eq!(history(&store, "full").await.len() as u64, last);
        assert_eq!(store.get_session("full").expect("exists").last_seq, last);
        assert_eq!(
            next_seqs(&mut follower, accepted).await,
            (6..=last).collect::<Vec<_>>()
        );

        disk.set_full(false);
        let resumed = store
            .append(append_op("full", &ids("after", 1), sync))
            .await
            .expect("appends resume by themselves once there is room");
        assert_eq!(resumed.seqs, vec![last + 1]);
        assert!(store.disk_full().borrow().is_none(), "room again");
        let seqs = tokio::time::timeout(Duration::from_secs(5), next_seqs(&mut follower, 1))
            .await
            .expect("the follower goes on");
        assert_eq!(seqs, vec![last + 1]);

        // Nothing torn, nothing lost: the log holds exactly what was acknowledged, and a
        // store reopened on it serves the same.
        drop(follower);
        store.close().expect("closes cleanly");
        assert_eq!(read_log(&disk).len() as u64, last + 1, "{layout:?}");
        let store = open_store_with(&disk, &index, layout);
        let events = history(&store, "full").await;
        assert_eq!(
            events.iter().map(|e| e.seq).collect::<Vec<_>>(),
            (1..=last + 1).collect::<Vec<_>>()
        );
        store.close().expect("closes cleanly");
    }
}

/// The seqs of the next `n` events a subscription delivers.
async fn next_seqs(
    follower: &mut mpsc::Receiver<Result<EventRun, StoreError>>,
    n: usize,
) -> Vec<u64> {
    let mut seqs = Vec::new();
    while seqs.len() < n {
        let run = follower.recv().await.expect("open").expect("events");
        seqs.extend(run.into_events().expect("decodes").iter().map(|e| e.seq));
    }
    seqs
}
