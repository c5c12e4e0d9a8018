//! Dedup is permanent for every kind of event id: one the store made (it names its own seq
//! and is checked against the log rather than indexed), one a client chose in that same
//! form, and any other; in the window before the index absorbs them, after a clean restart,
//! and with the index rebuilt from the log.

mod common;

use agentlog_proto::v1::Durability;
use common::{append_op, history, open_store, user_event};
use event_store::backend::local::log::storage::SimStorage;
use event_store::backend::local::Store;
use event_store::backend::AppendOp;

async fn append_ids(store: &Store, ids: &[&str]) -> Vec<u64> {
    let ids: Vec<String> = ids.iter().map(|s| s.to_string()).collect();
    store
        .append(append_op("dedup", &ids, Durability::Sync))
        .await
        .expect("append")
        .seqs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_kind_of_event_id_is_deduplicated_for_good() {
    let disk = SimStorage::new();
    let dir = tempfile::tempdir().expect("temp dir");
    let index = dir.path().join("index");
    let store = open_store(&disk, &index, 1 << 20);
    let made = store
        .append(AppendOp {
            session_id: "dedup".into(),
            events: vec![user_event(""), user_event("")]
                .into_iter()
                .map(Into::into)
                .collect(),
            expected_last_seq: None,
            lease_epoch: None,
            durability: Durability::Sync,
        })
        .await
        .expect("append without ids");
    assert_eq!(made.seqs, vec![1, 2]);
    let events = history(&store, "dedup").await;
    let generated: Vec<String> = events.iter().map(|e| e.event_id.clone()).collect();
    assert!(generated[0].starts_with("auto-1-") && generated[1].starts_with("auto-2-"));
    assert_ne!(generated[0], generated[1]);
    // A client id in the same form that lands on its own seq, and one that does not.
    assert_eq!(
        append_ids(&store, &["auto-3-mine", "auto-9-x", "plain"]).await,
        [3, 4, 5]
    );

    let all: Vec<&str> = vec![
        &generated[0],
        &generated[1],
        "auto-3-mine",
        "auto-9-x",
        "plain",
    ];
    let expected = vec![1, 2, 3, 4, 5];
    // Before the index has absorbed them, after a clean restart, and with the index rebuilt.
    assert_eq!(append_ids(&store, &all).await, expected);
    // The same form with another random part, or naming another seq, is a new event.
    assert_eq!(append_ids(&store, &["auto-1-other"]).await, [6]);
    store.close().expect("close");
    let store = open_store(&disk, &index, 1 << 20);
    assert_eq!(append_ids(&store, &all).await, expected);
    store.close().expect("close");
    std::fs::remove_dir_all(&index).expect("remove the index");
    let store = open_store(&disk, &index, 1 << 20);
    assert_eq!(append_ids(&store, &all).await, expected);
    assert_eq!(
        history(&store, "dedup").await.len(),
        6,
        "nothing was written twice"
    );
    store.close().expect("close");
}
