//! Old data keeps opening: a data directory written by the previous release
//! (`event-store/tests/fixtures/previous-release/`, made by its `make.sh` with that
//! release's binary) opens in this build, which answers about it exactly what that release
//! answered (every event, field for field, the sessions, the list, the snapshot); its old
//! event ids still deduplicate, and its sessions can be appended to and deleted, their
//! records reclaimed out of the old segment. (A PostgreSQL schema of the previous version
//! is migrated at start: `event-store/tests/pg_schema.rs`.)

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{ensure, Context, Result};
use integration_tests::{bin_path, grpcurl, test_backend_is_postgres, Backing, Store};
use serde_json::{json, Value};

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../event-store/tests/fixtures/previous-release")
}

fn copy_dir(from: &Path, to: &Path) -> Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_dir(&entry.path(), &target)?;
        } else {
            std::fs::copy(entry.path(), &target)?;
        }
    }
    Ok(())
}

/// What the previous release answered, as JSON values (a stream: each message).
fn expected(name: &str) -> Result<Vec<Value>> {
    let text = std::fs::read_to_string(fixture().join("expected").join(name))
        .with_context(|| format!("expected/{name}"))?;
    Ok(serde_json::Deserializer::from_str(&text)
        .into_iter::<Value>()
        .collect::<Result<_, _>>()?)
}

fn call(store: &Store, method: &str, request: Value) -> Vec<Value> {
    let out = grpcurl(
        store.addr,
        &format!("agentlog.v1.EventStore/{method}"),
        Some(&request.to_string()),
    );
    assert!(out.success, "{method}: {}", out.stderr);
    out.json_stream()
}

const SESSIONS: [&str; 4] = [
    "fixture-chat",
    "fixture-waiting",
    "fixture-interrupted",
    "fixture-ids",
];

/// The store answers about `sessions` what the previous release answered.
fn answers_as_before(store: &Store, sessions: &[&str]) -> Result<()> {
    for session in sessions {
        let events = call(
            store,
            "Subscribe",
            json!({"session_id": session, "from_seq": 1}),
        );
        ensure!(
            events == expected(&format!("{session}.events.json"))?,
            "{session}: the events read back differ from the previous release's"
        );
        let info = call(store, "GetSession", json!({ "session_id": session }));
        ensure!(
            info == expected(&format!("{session}.session.json"))?,
            "{session}: {info:?}"
        );
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_data_directory_of_the_previous_release_opens_and_reads_back_event_for_event(
) -> Result<()> {
    if test_backend_is_postgres() {
        eprintln!("SKIPPED: the local log's data directory");
        return Ok(());
    }
    let tmp = tempfile::tempdir()?;
    let data = tmp.path().join("data");
    copy_dir(&fixture().join("data"), &data)?;
    let flags = ["--reclaim-after", "100ms"];
    let start = || {
        Store::start_backed(
            &bin_path("event-store"),
            Backing::Dir(data.clone()),
            "127.0.0.1:0",
            &flags,
        )
    };
    let mut store = start()?;

    answers_as_before(&store, &SESSIONS)?;
    ensure!(call(&store, "ListSessions", json!({})) == expected("list.json")?);
    let snapshot = call(
        &store,
        "GetSnapshot",
        json!({"session_id": "fixture-chat", "format": "fold"}),
    );
    ensure!(snapshot == expected("fixture-chat.snapshot.json")?);

    // An id the previous release made still deduplicates; a new event follows on.
    let old_id = expected("fixture-ids.events.json")?[0]["eventId"].clone();
    let again = call(
        &store,
        "Append",
        json!({"session_id": "fixture-ids", "events": [{"event_id": old_id, "user_message": {"text": "message 1"}}]}),
    );
    ensure!(again[0]["seqs"] == json!(["1"]), "{again:?}");
    let next = call(
        &store,
        "Append",
        json!({"session_id": "fixture-ids", "events": [{"user_message": {"text": "message 4"}}]}),
    );
    ensure!(next[0]["lastSeq"] == json!("4"), "{next:?}");

    // A session of the old log is deleted, and its records leave the old segment.
    call(
        &store,
        "DeleteSession",
        json!({"session_id": "fixture-chat"}),
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    while holds(&data, b"quarterly report") || holds(&data, b"snapshot of fixture-chat") {
        ensure!(
            Instant::now() < deadline,
            "fixture-chat's text is still on disk"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let kept = ["fixture-waiting", "fixture-interrupted"];
    answers_as_before(&store, &kept)?;

    // And after a kill, as before.
    store.kill9();
    let store = start()?;
    answers_as_before(&store, &kept)?;
    let ids = call(
        &store,
        "Subscribe",
        json!({"session_id": "fixture-ids", "from_seq": 1}),
    );
    ensure!(ids.len() == 4, "{ids:?}");
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
