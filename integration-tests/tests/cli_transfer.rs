//! `agentlog export` and `agentlog import` as a user runs them: an export to a file is
//! imported into another store and each session is reported; importing it again reports
//! them unchanged; a damaged file is reported session by session, naming the line, and the
//! command fails; `export` with nothing to export says what to give.

use std::process::{Command, Stdio};

use agentlog_proto::v1::AppendRequest;
use integration_tests::{bin_path, read_log, user_event, Store};

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

#[tokio::test(flavor = "multi_thread")]
async fn export_to_a_file_and_import_it_elsewhere() {
    let source = Store::start().expect("store");
    let mut client = source.client().await.expect("connect");
    for id in ["cli-a", "cli-b"] {
        client
            .append(AppendRequest {
                session_id: id.into(),
                events: vec![user_event("u1", "hello"), user_event("u2", "again")],
                ..AppendRequest::default()
            })
            .await
            .expect("append");
    }
    let tmp = tempfile::tempdir().expect("temp dir");
    let file = tmp.path().join("all.jsonl");
    let file_arg = file.display().to_string();
    let (ok, _, stderr) = agentlog(&source, &["export", "--all", "-o", &file_arg]);
    assert!(ok, "{stderr}");
    let text = std::fs::read_to_string(&file).expect("the export");
    assert_eq!(text.lines().count(), 1 + 2 * 4, "{text}");
    assert!(!tmp.path().join("all.jsonl.partial").exists());
    let (ok, stdout, _) = agentlog(&source, &["export", "cli-b"]);
    assert!(
        ok && stdout.contains("\"cli-b\"") && !stdout.contains("\"cli-a\""),
        "{stdout}"
    );
    let (ok, _, stderr) = agentlog(&source, &["export"]);
    assert!(!ok && stderr.contains("--all"), "{stderr}");

    let target = Store::start().expect("store");
    let (ok, stdout, stderr) = agentlog(&target, &["import", &file_arg]);
    assert!(ok, "{stderr}");
    assert_eq!(
        stdout,
        "imported cli-a (2 events)\nimported cli-b (2 events)\n"
    );
    assert!(
        stderr.contains("2 imported, 0 unchanged, 0 deleted, 0 refused"),
        "{stderr}"
    );
    let mut back = target.client().await.expect("connect");
    assert_eq!(
        read_log(&mut back, "cli-a").await,
        read_log(&mut client, "cli-a").await
    );
    let (ok, stdout, _) = agentlog(&target, &["--json", "import", &file_arg]);
    assert!(ok);
    for line in stdout.lines() {
        let result: serde_json::Value = serde_json::from_str(line).expect("JSON");
        assert_eq!(result["outcome"], "IMPORT_OUTCOME_UNCHANGED", "{line}");
    }

    // A damaged copy: cli-a's second event changed, its checksum not.
    let damaged = tmp.path().join("damaged.jsonl");
    std::fs::write(&damaged, text.replacen("\"again\"", "\"AGAIN\"", 1)).expect("write");
    let fresh = Store::start().expect("store");
    let (ok, stdout, stderr) = agentlog(&fresh, &["import", &damaged.display().to_string()]);
    assert!(!ok, "a refused session fails the command");
    assert!(stdout.contains("refused cli-a: line 5:"), "{stdout}");
    assert!(stdout.contains("checksum"), "{stdout}");
    assert!(stdout.contains("imported cli-b (2 events)"), "{stdout}");
    assert!(
        stderr.contains("1 of the export's sessions were refused"),
        "{stderr}"
    );
}
