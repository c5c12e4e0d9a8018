//! `agentlog rm` as a user runs it: named sessions are deleted for good (a name that never
//! was is reported, and the command fails, after deleting the rest); `--idle-for` lists the
//! sessions idle for longer than that that no runner holds and that are not pinned, and
//! deletes nothing without `--yes`, then exactly those with it.

use std::process::{Command, Stdio};
use std::time::Duration;

use agentlog_client::refusal::is_session_deleted;
use agentlog_proto::v1::{AcquireLeaseRequest, AppendRequest, GetSessionRequest};
use integration_tests::{bin_path, user_event, Store};

fn agentlog(store: &Store, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(bin_path("agentlog"))
        .args(["--addr", &store.url()])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run agentlog");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

async fn write(store: &Store, session: &str) {
    let mut client = store.client().await.expect("connect");
    client
        .append(AppendRequest {
            session_id: session.into(),
            events: vec![user_event("u1", &format!("hello from {session}"))],
            ..AppendRequest::default()
        })
        .await
        .expect("append");
}

/// Whether the store answers the session as deleted (else it must still be there).
async fn deleted(store: &Store, session: &str) -> bool {
    let mut client = store.client().await.expect("connect");
    match client
        .get_session(GetSessionRequest {
            session_id: session.into(),
        })
        .await
    {
        Ok(_) => false,
        Err(status) if is_session_deleted(&status) => true,
        Err(status) => panic!("GetSession {session}: {status}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn rm_deletes_the_named_sessions_and_reports_the_ones_that_never_were() {
    let store = Store::start().expect("store");
    write(&store, "rm-a").await;
    write(&store, "rm-b").await;
    write(&store, "rm-kept").await;

    let (ok, stdout, stderr) = agentlog(&store, &["rm", "rm-a", "rm-never", "rm-b"]);
    assert!(!ok, "a session that never was fails the command");
    assert!(
        stdout.contains("deleted rm-a") && stdout.contains("deleted rm-b"),
        "{stdout}"
    );
    assert!(
        stderr.contains("rm-never") && stderr.contains("no session"),
        "{stderr}"
    );
    assert!(deleted(&store, "rm-a").await && deleted(&store, "rm-b").await);
    assert!(!deleted(&store, "rm-kept").await);

    // Deleting again is done already; --json says so per session.
    let (ok, stdout, _) = agentlog(&store, &["--json", "rm", "rm-a"]);
    assert!(ok);
    let line: serde_json::Value = serde_json::from_str(stdout.trim()).expect("one JSON line");
    assert_eq!(
        line,
        serde_json::json!({"sessionId": "rm-a", "deleted": true})
    );

    // The other commands say what happened to it.
    let (ok, _, stderr) = agentlog(&store, &["show", "rm-a"]);
    assert!(!ok && stderr.contains("deleted"), "{stderr}");
}

#[tokio::test(flavor = "multi_thread")]
async fn rm_idle_for_lists_first_and_deletes_only_with_yes() {
    let store = Store::start().expect("store");
    write(&store, "idle-old").await;
    write(&store, "idle-held").await;
    write(&store, "idle-pinned").await;
    let (ok, stdout, stderr) = agentlog(&store, &["pin", "idle-pinned"]);
    assert!(
        ok && stdout.starts_with("pinned idle-pinned"),
        "{stdout}{stderr}"
    );
    let (ok, stdout, _) = agentlog(&store, &["show", "idle-pinned"]);
    assert!(ok && stdout.starts_with("pinned"), "{stdout}");
    let mut client = store.client().await.expect("connect");
    client
        .acquire_lease(AcquireLeaseRequest {
            session_id: "idle-held".into(),
            owner: "a-runner".into(),
            ttl_ms: 600_000,
        })
        .await
        .expect("lease");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    write(&store, "idle-fresh").await;

    let (ok, stdout, stderr) = agentlog(&store, &["rm", "--idle-for", "1s"]);
    assert!(ok, "{stderr}");
    assert_eq!(
        stdout.lines().count(),
        1,
        "only the old unheld session: {stdout}"
    );
    assert!(
        stdout.starts_with("idle-old  hello from idle-old"),
        "{stdout}"
    );
    assert!(stderr.contains("add --yes"), "{stderr}");
    assert!(
        !deleted(&store, "idle-old").await,
        "nothing deleted without --yes"
    );

    let (ok, stdout, stderr) = agentlog(&store, &["rm", "--idle-for", "1s", "--yes"]);
    assert!(ok, "{stderr}");
    assert_eq!(stdout.trim(), "deleted idle-old");
    assert!(deleted(&store, "idle-old").await);
    assert!(!deleted(&store, "idle-held").await, "a held session stays");
    assert!(
        !deleted(&store, "idle-pinned").await,
        "a pinned session stays"
    );
    assert!(
        !deleted(&store, "idle-fresh").await,
        "a recent session stays"
    );

    let (ok, _, stderr) = agentlog(&store, &["rm", "--idle-for", "soon"]);
    assert!(!ok && stderr.contains("--idle-for"), "{stderr}");
}
