//! What the durability tests share: a store on a simulated disk, and reading a session or
//! the whole log back.
#![allow(dead_code)]

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use agentlog_proto::kept::KeptEvent;
use agentlog_proto::v1::{event, Durability, Event, UserMessage};
use event_store::backend::local::log::storage::SimStorage;
use event_store::backend::local::log::{LogConfig, LogError, LogTail, LogWriter, Record};
use event_store::backend::local::reclaim::ReclaimConfig;
use event_store::backend::local::{Store, StoreConfig};
use event_store::backend::AppendOp;
use event_store::backend::EventRun;
use tokio_util::sync::CancellationToken;

/// The session cache of the stores these tests open: room for a few states, so that
/// crashes, recoveries and reclamations meet states read back from the index, as in a
/// store that holds many more sessions than it serves.
const CACHE_BYTES: usize = 2048;

/// Opens (and recovers) a store whose log lives on `disk` and whose index is in `index_dir`.
/// Its segments are not preallocated, so a file's length is the log's length (which the
/// property tests assert on).
pub fn open_store(disk: &SimStorage, index_dir: &Path, segment_bytes: u64) -> Store {
    try_open_store(disk, index_dir, segment_bytes).expect("the store opens and recovers")
}

/// Like [`open_store`], with the log laid out as `log_config` says (e.g. preallocated,
/// as in production).
pub fn open_store_with(disk: &SimStorage, index_dir: &Path, log_config: LogConfig) -> Store {
    try_open_store_with(disk, index_dir, log_config).expect("the store opens and recovers")
}

/// Like [`open_store`], but returns the error. sled releases its directory lock from a
/// background thread a moment after the last handle is dropped, so a reopen in the same
/// process waits (briefly) for that lock rather than failing.
pub fn try_open_store(
    disk: &SimStorage,
    index_dir: &Path,
    segment_bytes: u64,
) -> Result<Store, event_store::backend::local::OpenError> {
    let log_config = LogConfig {
        segment_bytes,
        preallocate_bytes: 0,
    };
    try_open_store_with(disk, index_dir, log_config)
}

fn try_open_store_with(
    disk: &SimStorage,
    index_dir: &Path,
    log_config: LogConfig,
) -> Result<Store, event_store::backend::local::OpenError> {
    let reclaim = ReclaimConfig::for_segments(log_config.segment_bytes);
    try_open_store_reclaiming(disk, index_dir, log_config, reclaim)
}

/// Like [`open_store_with`], reclaiming deleted sessions' space as `reclaim` says.
pub fn open_store_reclaiming(
    disk: &SimStorage,
    index_dir: &Path,
    log_config: LogConfig,
    reclaim: ReclaimConfig,
) -> Store {
    try_open_store_reclaiming(disk, index_dir, log_config, reclaim)
        .expect("the store opens and recovers")
}

fn try_open_store_reclaiming(
    disk: &SimStorage,
    index_dir: &Path,
    log_config: LogConfig,
    reclaim: ReclaimConfig,
) -> Result<Store, event_store::backend::local::OpenError> {
    try_open_store_caching(disk, index_dir, log_config, reclaim, CACHE_BYTES)
}

/// Like [`open_store`], with a session cache of `cache_bytes` (a tiny one makes the store
/// read nearly every session's state back from its index).
pub fn open_store_caching(disk: &SimStorage, index_dir: &Path, cache_bytes: usize) -> Store {
    let log_config = LogConfig {
        segment_bytes: 1 << 20,
        preallocate_bytes: 0,
    };
    let reclaim = ReclaimConfig::for_segments(log_config.segment_bytes);
    try_open_store_caching(disk, index_dir, log_config, reclaim, cache_bytes)
        .expect("the store opens and recovers")
}

fn try_open_store_caching(
    disk: &SimStorage,
    index_dir: &Path,
    log_config: LogConfig,
    reclaim: ReclaimConfig,
    session_cache_bytes: usize,
) -> Result<Store, event_store::backend::local::OpenError> {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let result = Store::open(StoreConfig {
            log: Arc::new(disk.clone()),
            index_dir: index_dir.to_path_buf(),
            snapshot_dir: index_dir.with_extension("snapshots"),
            log_config,
            retention: None,
            reclaim,
            session_cache_bytes,
            search_dir: None,
            search_commit_every: event_store::backend::local::search::COMMIT_EVERY,
        });
        match result {
            Err(e)
                if e.to_string().contains("could not acquire lock")
                    && Instant::now() < deadline =>
            {
                std::thread::sleep(Duration::from_millis(10))
            }
            other => return other,
        }
    }
}

/// A user message whose text is its own id (so a misplaced event is easy to spot).
pub fn user_event(event_id: &str) -> Event {
    Event {
        event_id: event_id.to_string(),
        kind: Some(event::Kind::UserMessage(UserMessage {
            text: event_id.to_string(),
        })),
        ..Default::default()
    }
}

pub fn append_op(session_id: &str, ids: &[String], durability: Durability) -> AppendOp {
    AppendOp {
        session_id: session_id.to_string(),
        events: ids
            .iter()
            .map(|id| KeptEvent::new(user_event(id)))
            .collect(),
        expected_last_seq: None,
        lease_epoch: None,
        durability,
    }
}

/// The whole session as Subscribe (without follow) returns it.
pub async fn history(store: &Store, session_id: &str) -> Vec<Event> {
    let mut rx = store.subscribe(session_id.to_string(), 0, false, CancellationToken::new());
    let mut events = Vec::new();
    while let Some(item) = rx.recv().await {
        let run = item.and_then(EventRun::into_events);
        match run {
            Ok(run) => events.extend(run),
            Err(e) => panic!("reading session {session_id} back failed: {e}"),
        }
    }
    events
}

/// Like [`read_log`], or its error: for a caller that asks again while a store runs.
pub fn try_read_log(disk: &SimStorage) -> Result<Vec<Record>, LogError> {
    Ok(try_read_appends(disk)?.into_iter().flatten().collect())
}

/// Every valid record of the log on `disk`, in log order, as recovery sees them.
pub fn read_log(disk: &SimStorage) -> Vec<Record> {
    read_appends(disk).into_iter().flatten().collect()
}

/// The log's records grouped by the atomic append they were written in, with the log
/// offset each group ends at. Read from a snapshot of `disk`: opening the log repairs it,
/// and a store may be writing to `disk` meanwhile.
pub fn read_appends(disk: &SimStorage) -> Vec<Vec<Record>> {
    try_read_appends(disk).expect("the log is readable")
}

fn try_read_appends(disk: &SimStorage) -> Result<Vec<Vec<Record>>, LogError> {
    let mut appends = Vec::new();
    LogWriter::open(
        Arc::new(disk.snapshot()),
        LogConfig {
            segment_bytes: u64::MAX,
            preallocate_bytes: 0,
        },
        LogTail::default(),
        |append| appends.push(append.iter().map(|(_, r)| r.clone()).collect()),
    )?;
    Ok(appends)
}

/// The log offset each append of [`read_appends`] ends at, with the number of records up
/// to and including it.
pub fn append_ends(appends: &[Vec<Record>]) -> Vec<(u64, usize)> {
    let mut end = 0u64;
    let mut count = 0usize;
    let mut buf = Vec::new();
    appends
        .iter()
        .map(|append| {
            for (i, record) in append.iter().enumerate() {
                buf.clear();
                end += record.encode_into(&mut buf, i + 1 < append.len()) as u64;
            }
            count += append.len();
            (end, count)
        })
        .collect()
}

/// Reclamation as soon as anything is dead, looking every 20 ms.
pub fn reclaim_now() -> ReclaimConfig {
    ReclaimConfig {
        after: Duration::from_millis(1),
        dead_bytes: 1,
        check_every: Duration::from_millis(20),
        busy_share: 1.0,
    }
}

/// Reclamation held off for the length of any test.
pub fn held() -> ReclaimConfig {
    ReclaimConfig {
        after: Duration::from_secs(3600),
        dead_bytes: u64::MAX,
        check_every: Duration::from_secs(3600),
        busy_share: 1.0,
    }
}

/// A user message with this id and text.
pub fn user(id: &str, text: &str) -> Event {
    Event {
        event_id: id.into(),
        kind: Some(event::Kind::UserMessage(UserMessage { text: text.into() })),
        ..Event::default()
    }
}

/// A synced append of `events`, without conditions.
pub fn op(session_id: &str, events: Vec<Event>) -> AppendOp {
    AppendOp {
        session_id: session_id.into(),
        events: events.into_iter().map(KeptEvent::new).collect(),
        expected_last_seq: None,
        lease_epoch: None,
        durability: Durability::Sync,
    }
}

/// The files under `dir` (recursively) that hold `needle`.
pub fn in_files(dir: &Path, needle: &[u8]) -> Vec<String> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return found;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            found.extend(in_files(&path, needle));
        } else if let Ok(bytes) = std::fs::read(&path) {
            if bytes.windows(needle.len()).any(|w| w == needle) {
                found.push(path.display().to_string());
            }
        }
    }
    found
}
