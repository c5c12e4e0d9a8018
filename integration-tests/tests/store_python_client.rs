//! A client that is not tonic: Python's `grpcio` from PyPI (installed here when missing)
//! streams 50,000 small appends at full speed on one AppendStream, reading the answers only
//! after a second, against each backend (`python/append_stream.py`). It respects HTTP/2 flow
//! control and waits for nothing else, so the store's reading falls behind and the frames
//! wait unread within the stream's window: the store must hold it back by flow control
//! alone, never hang up (as h2's guard against floods of small DATA frames did, with
//! GOAWAY ENHANCE_YOUR_CALM, before the windows were sized for it; see ARCHITECTURE.md,
//! "Flow control, not hang-ups"). Every answer arrives, in order, and the log holds every
//! append once.

use std::path::{Path, PathBuf};
use std::process::Command;

use integration_tests::pg;
use integration_tests::{bin_path, read_log, Backing, Store};

const APPENDS: usize = 50_000;

/// grpcio and grpcio-tools, installed from PyPI if missing (one installer at a time).
fn ensure_grpcio() {
    let present = || {
        Command::new("python3")
            .args(["-c", "import grpc, grpc_tools"])
            .status()
            .is_ok_and(|s| s.success())
    };
    if present() {
        return;
    }
    let lock = std::fs::File::create(std::env::temp_dir().join("agentlog-pip.lock"))
        .expect("create the pip lock file");
    let _lock = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
        .expect("lock the pip lock file");
    if present() {
        return;
    }
    let out = Command::new("python3")
        .args([
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            "grpcio==1.85.3",
            "grpcio-tools==1.85.1",
        ])
        .output()
        .expect("run pip (Python 3 with pip is needed)");
    assert!(
        out.status.success(),
        "pip install grpcio grpcio-tools: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn repo_path(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

async fn streams_every_append_once(store: Store) {
    ensure_grpcio();
    let session = "py-stream";
    let out = tokio::task::spawn_blocking({
        let addr = store.addr.to_string();
        move || {
            Command::new("python3")
                .arg(repo_path("python/append_stream.py"))
                .arg("--proto-dir")
                .arg(repo_path("../proto"))
                .args(["--addr", &addr, "--session", session])
                .args(["--count", &APPENDS.to_string(), "--read-after", "1"])
                .output()
                .expect("run python3")
        }
    })
    .await
    .unwrap();
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "the grpcio client: {said}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let mut client = store.client().await.unwrap();
    let log = read_log(&mut client, session).await;
    assert_eq!(log.len(), APPENDS, "every append is in the log once");
    for (i, event) in log.iter().enumerate() {
        assert_eq!(event.seq, i as u64 + 1);
        assert_eq!(event.event_id, format!("e{i}"), "in the order sent");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpcio_client_streams_at_full_speed_on_the_local_backend() {
    let dir = tempfile::tempdir().unwrap();
    streams_every_append_once(Store::start_in(dir.path()).unwrap()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpcio_client_streams_at_full_speed_on_postgres() {
    let server = tokio::task::block_in_place(pg::shared).unwrap();
    let url = server.create_database().unwrap();
    let store = Store::start_backed(
        &bin_path("event-store"),
        Backing::Database(url, Some(server)),
        "127.0.0.1:0",
        &[],
    )
    .unwrap();
    streams_every_append_once(store).await;
}
