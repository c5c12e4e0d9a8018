//! Which build a process is, as an operator asks it during a rollout: `--version` of every
//! binary prints `NAME VERSION (COMMIT)` with the full commit it was built from, and both
//! services export `agentlog_build_info{version,commit}` beside their other metrics.

mod telemetry_support;

use std::process::Command;

use integration_tests::bin_path;
use telemetry_support::{start_runner, start_store};

/// The commit this checkout is at, as the build saw it (`None` outside a git checkout).
fn head() -> Option<String> {
    let out = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

#[test]
fn every_binary_names_its_version_and_full_commit() {
    let version = env!("CARGO_PKG_VERSION");
    for (binary, name) in [
        ("event-store", "event-store"),
        ("runner", "runner"),
        ("agentlog", "agentlog"),
    ] {
        let out = Command::new(bin_path(binary))
            .arg("--version")
            .output()
            .expect("the binary runs");
        assert!(out.status.success(), "{binary} --version");
        let line = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let prefix = format!("{name} {version} (");
        let commit = line
            .strip_prefix(&prefix)
            .and_then(|rest| rest.strip_suffix(')'))
            .unwrap_or_else(|| panic!("{binary} --version printed {line:?}"));
        assert!(
            commit.len() == 40 && commit.bytes().all(|b| b.is_ascii_hexdigit()),
            "{binary}: {commit:?} is not a full commit hash"
        );
        if let Some(head) = head() {
            assert_eq!(commit, head, "{binary} names the commit it was built from");
        }
    }
}

#[test]
fn both_services_export_their_build() {
    let data = tempfile::tempdir().expect("temp dir");
    let store = start_store(data.path(), &[]);
    let workspaces = tempfile::tempdir().expect("temp dir");
    // The runner needs no model for this: it only has to be up.
    let runner = start_runner(&store.url(), workspaces.path(), "http://127.0.0.1:9", &[]);
    for (what, metrics) in [("store", store.scrape()), ("runner", runner.scrape())] {
        let line = metrics
            .text
            .lines()
            .find(|l| l.starts_with("agentlog_build_info{"))
            .unwrap_or_else(|| panic!("the {what} exports agentlog_build_info"));
        assert!(
            line.contains(&format!("version=\"{}\"", env!("CARGO_PKG_VERSION"))),
            "{what}: {line}"
        );
        assert!(line.contains("commit=\""), "{what}: {line}");
        assert!(line.ends_with(" 1"), "{what}: {line}");
    }
}
