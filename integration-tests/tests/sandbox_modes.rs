//! The sandbox's flags: `--sandbox off` warns and prints a table that says so, and leaves
//! results unmarked; `--tool-network all` lets a tool reach a loopback listener (the table
//! says the network is not restricted); `--tool-read-path` opens one more directory,
//! read-only; `--tool-user` refuses root. (`require` refusing to start, and `best-effort`
//! marking results, on a node without Landlock: `sandbox_escapes`, configuration d.)

mod sandbox_support;

use std::net::TcpListener;

use integration_tests::Store;
use sandbox_support::*;

#[tokio::test(flavor = "multi_thread")]
async fn off_warns_at_start() {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    let runner = start(
        &store.url(),
        &[bash("echo ran"), done()],
        RunAs::Me,
        Options {
            args: &["--sandbox", "off"],
            env: &[],
        },
    );
    let results = run_session(&mut client, "s1").await;
    assert_eq!(results[0].content, "exit code: 0\n--- stdout ---\nran\n");
    let log = runner.log();
    assert!(log.contains("--sandbox off"), "{log}");
    assert!(
        log.contains("sandbox:   workspace only (read and write)        NO        none"),
        "{log}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn tool_network_all_reaches_loopback() {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    let listener = TcpListener::bind("127.0.0.1:0").expect("listen");
    let port = listener.local_addr().expect("addr").port();
    let command = format!("echo hi > /dev/tcp/127.0.0.1/{port} && echo sent");
    let runner = start(
        &store.url(),
        &[bash(&command), done()],
        RunAs::Me,
        Options {
            args: &["--tool-network", "all"],
            env: &[],
        },
    );
    let results = run_session(&mut client, "s1").await;
    assert!(results[0].content.contains("sent"), "{results:?}");
    listener.set_nonblocking(true).expect("nonblocking");
    assert!(listener.accept().is_ok(), "nothing arrived");
    assert!(runner.log().contains("sandbox=require"));
    assert!(
        runner.log().contains("none: --tool-network all"),
        "{}",
        runner.log()
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn tool_read_path_adds_a_read_only_directory() {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    let toolchain = tempfile::tempdir().expect("temp dir");
    std::fs::set_permissions(
        toolchain.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .expect("chmod");
    let tool = toolchain.path().join("tool.sh");
    std::fs::write(&tool, "#!/bin/sh\necho toolchain-ran\n").expect("write");
    std::fs::set_permissions(&tool, std::os::unix::fs::PermissionsExt::from_mode(0o777))
        .expect("chmod");
    let dir = toolchain.path().display().to_string();
    let command = format!("{dir}/tool.sh; echo x > {dir}/written; echo end");
    let replies = [bash(&command), done()];
    let with = start(
        &store.url(),
        &replies,
        RunAs::Me,
        Options {
            args: &["--tool-read-path", &dir],
            env: &[],
        },
    );
    let results = run_session(&mut client, "with").await;
    assert!(results[0].content.contains("toolchain-ran"), "{results:?}");
    assert!(!toolchain.path().join("written").exists(), "{results:?}");
    drop(with);

    let _without = start(&store.url(), &replies, RunAs::Me, Options::default());
    let results = run_session(&mut client, "without").await;
    assert!(
        results[0].content.contains("end") && !results[0].content.contains("toolchain-ran"),
        "{results:?}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn tools_never_run_as_root() {
    let store = Store::start().expect("store");
    let mut runner = start(
        &store.url(),
        &[done()],
        RunAs::Me,
        Options {
            args: &["--tool-user", "0"],
            env: &[],
        },
    );
    assert!(!runner.wait_exit().success());
    let log = runner.log();
    assert!(log.contains("--tool-user must not be root"), "{log}");
}
