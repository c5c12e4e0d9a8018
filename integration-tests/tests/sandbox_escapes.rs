//! A bash call of one session, run by the real runner (on its default flags: `--sandbox
//! require`, `--tool-network none`), tries to get out: another session's workspace (read,
//! list, write; relative and absolute paths), files outside every workspace, signals to the
//! runner and to another session's running tool, the runner's environment through /proc, a
//! TCP connection to a loopback listener. Each test asserts the effect is absent — the
//! secret not in the output, the file not written, the process still alive, the listener
//! with nothing accepted — not only that an error was printed.
//!
//! Each scenario runs twice: with the runner as this test's user (root in CI: its tools run
//! as `nobody`) and with the runner unprivileged (its tools run as the runner's own user, so
//! only the sandbox keeps the sessions apart).

mod sandbox_support;

use std::io::ErrorKind;
use std::net::{TcpListener, UdpSocket};

use integration_tests::Store;
use sandbox_support::*;
use serde_json::json;

const SECRET: &str = "s3cret-of-the-victim";
const LISTED: &str = "only-ls-would-show-this.txt";

async fn sibling_workspaces_and_outside(run_as: RunAs) {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    let outside_tmp = format!("/tmp/agentlog-sandbox-escape-{run_as:?}");
    let _ = std::fs::remove_file(&outside_tmp);
    let command = format!(
        r#"V="$(dirname "$HOME")/victim"
cat ../victim/secret.txt; cat "$V/secret.txt"; ls -la ../victim; ls "$V"; find "$V"
echo pwned > ../victim/pwned-rel; echo pwned > "$V/pwned-abs"; mkdir ../victim/newdir
mv ../victim/secret.txt stolen.txt; cp "$V/secret.txt" copied.txt; ln "$V/secret.txt" hardlink
rm -f "$V/secret.txt"; chmod 777 "$V"
echo x > ../outside-root; echo x > "$(dirname "$(dirname "$HOME")")/outside-dir"; echo x > {outside_tmp}
echo end"#
    );
    let runner = start(
        &store.url(),
        &[bash(&command), done()],
        run_as,
        Options::default(),
    );
    runner.plant("victim", "secret.txt", SECRET);
    runner.plant("victim", LISTED, "x");

    let results = run_session(&mut client, "attacker").await;
    assert_eq!(results.len(), 1, "{results:?}");
    let out = &results[0].content;
    assert!(out.contains("end"), "the command ran to its end: {out}");
    assert!(!out.contains(SECRET), "read a sibling's file: {out}");
    assert!(!out.contains(LISTED), "listed a sibling's workspace: {out}");

    let victim = runner.workspace("victim");
    assert_eq!(
        std::fs::read_to_string(victim.join("secret.txt"))
            .ok()
            .as_deref(),
        Some(SECRET),
        "the victim's file is intact"
    );
    for name in ["pwned-rel", "pwned-abs", "newdir"] {
        assert!(!victim.join(name).exists(), "{name} was written: {out}");
    }
    let attacker = runner.workspace("attacker");
    for name in ["stolen.txt", "copied.txt", "hardlink"] {
        assert!(!attacker.join(name).exists(), "{name} exists: {out}");
    }
    assert!(!runner.workspaces.join("outside-root").exists(), "{out}");
    assert!(
        !runner
            .workspaces
            .parent()
            .map(|p| p.join("outside-dir").exists())
            .unwrap_or(true),
        "{out}"
    );
    assert!(!std::path::Path::new(&outside_tmp).exists(), "{out}");
}

#[tokio::test(flavor = "multi_thread")]
async fn sibling_workspaces_and_outside_paths_are_out_of_reach() {
    sibling_workspaces_and_outside(RunAs::Me).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn sibling_workspaces_and_outside_paths_are_out_of_reach_unprivileged() {
    sibling_workspaces_and_outside(RunAs::Unprivileged).await;
}

async fn signals_and_proc(run_as: RunAs) {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    let command = r#"case "$IDEMPOTENCY_KEY" in
victim/*) echo $$ > pid
   # Runs until the test says the attack is over.
   for _ in $(seq 600); do [ -e attack-over ] && break; sleep 0.1; done
   echo alive > alive.txt; echo survived ;;
*) R=$(head -1 pids); T=$(tail -1 pids)
   tr '\0' '\n' < /proc/$R/environ; cat /proc/$R/cmdline; ls /proc/$R/; ls /proc
   kill -9 $R; kill -TERM $R; kill -9 $T; kill -STOP $T; pkill -9 sleep; kill -9 -1; echo after ;;
esac"#;
    let mut runner = start(
        &store.url(),
        &[bash(command), done()],
        run_as,
        Options::default(),
    );
    let victim_seq = user_says(&mut client, "victim", "go").await;
    let pid_file = runner.workspace("victim").join("pid");
    wait_for_file(&pid_file);
    let victim_pid = std::fs::read_to_string(&pid_file).expect("pid");
    runner.plant(
        "attacker",
        "pids",
        &format!("{}\n{}", runner.pid(), victim_pid.trim()),
    );

    let results = run_session(&mut client, "attacker").await;
    assert_eq!(results.len(), 1, "{results:?}");
    let out = &results[0].content;
    assert!(
        !out.contains("sk-sandbox-SECRET"),
        "read the runner's environment: {out}"
    );
    assert!(
        !out.contains("--event-store"),
        "read the runner's command line: {out}"
    );
    assert!(runner.is_running(), "the runner survived: {out}");
    runner.plant("victim", "attack-over", "");

    let victim = wait_idle(
        &mut client,
        "victim",
        victim_seq,
        std::time::Duration::from_secs(60),
    )
    .await;
    let victim_out = victim
        .iter()
        .find_map(|e| match &e.kind {
            Some(agentlog_proto::v1::event::Kind::ToolResult(r)) => Some(r.clone()),
            _ => None,
        })
        .expect("the victim's result");
    assert!(
        !victim_out.is_error && victim_out.content.contains("survived"),
        "the victim's tool was not signalled: {victim_out:?} (attacker: {out})"
    );
    assert!(runner.workspace("victim").join("alive.txt").exists());
    assert!(runner.is_running());
}

#[tokio::test(flavor = "multi_thread")]
async fn the_runner_and_other_sessions_tools_cannot_be_signalled_or_read() {
    signals_and_proc(RunAs::Me).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn the_runner_and_other_sessions_tools_cannot_be_signalled_or_read_unprivileged() {
    signals_and_proc(RunAs::Unprivileged).await;
}

async fn no_network(run_as: RunAs) {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    let listener = TcpListener::bind("127.0.0.1:0").expect("listen");
    listener.set_nonblocking(true).expect("nonblocking");
    let port = listener.local_addr().expect("addr").port();
    let udp = UdpSocket::bind(("127.0.0.1", port)).expect("udp");
    udp.set_nonblocking(true).expect("nonblocking");
    let command = format!(
        r#"python3 -c "import socket; socket.create_connection(('127.0.0.1', {port}), 3)"
echo hi > /dev/tcp/127.0.0.1/{port}
python3 -c "import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', {port}))"
python3 -c "import socket; socket.socket(socket.AF_INET6)" && echo ipv6-socket-opened
python3 -c "import socket; a, b = socket.socketpair(); a.send(b'unix-ok'); print(b.recv(9).decode())"
echo end"#
    );
    let _runner = start(
        &store.url(),
        &[bash(&command), done()],
        run_as,
        Options::default(),
    );
    let results = run_session(&mut client, "net").await;
    let out = &results[0].content;
    assert!(out.contains("end"), "{out}");
    assert!(out.contains("unix-ok"), "Unix sockets still work: {out}");
    assert!(!out.contains("ipv6-socket-opened"), "{out}");
    assert!(
        matches!(listener.accept(), Err(e) if e.kind() == ErrorKind::WouldBlock),
        "the listener accepted a connection: {out}"
    );
    let mut buf = [0u8; 16];
    assert!(
        matches!(udp.recv_from(&mut buf), Err(e) if e.kind() == ErrorKind::WouldBlock),
        "a datagram arrived: {out}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn tools_have_no_network_by_default() {
    no_network(RunAs::Me).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn tools_have_no_network_by_default_unprivileged() {
    no_network(RunAs::Unprivileged).await;
}

async fn file_tools_through_planted_links(run_as: RunAs) {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    let plant = r#"ln -s ../victim v; ln -s "$(dirname "$HOME")/victim/secret.txt" abs; ln -s /etc/passwd pw; ln -s / rootlink; ln -s /proc/self/root magic; echo planted"#;
    let calls = json!({"text": "Using the links.", "tool_uses": [
        {"name": "read_file", "input": {"path": "v/secret.txt"}},
        {"name": "read_file", "input": {"path": "abs"}},
        {"name": "read_file", "input": {"path": "pw"}},
        {"name": "read_file", "input": {"path": "magic/etc/passwd"}},
        {"name": "write_file", "input": {"path": "v/evil", "content": "x"}},
        {"name": "write_file", "input": {"path": "rootlink/tmp/agentlog-sandbox-evil", "content": "x"}},
        {"name": "edit_file", "input": {"path": "abs", "old": SECRET, "new": "gone"}},
        {"name": "list_files", "input": {"path": "v"}}
    ]});
    let runner = start(
        &store.url(),
        &[bash(plant), calls, done()],
        run_as,
        Options::default(),
    );
    runner.plant("victim", "secret.txt", SECRET);
    runner.plant("victim", LISTED, "x");
    let results = run_session(&mut client, "linker").await;
    assert_eq!(results.len(), 9, "{results:?}");
    assert!(results[0].content.contains("planted"), "{results:?}");
    for result in &results[1..] {
        assert!(result.is_error, "{result:?}");
        assert!(
            result.content.contains("outside the workspace"),
            "{result:?}"
        );
        for leaked in [SECRET, LISTED, "root:x:0"] {
            assert!(!result.content.contains(leaked), "{result:?}");
        }
    }
    let victim = runner.workspace("victim");
    assert_eq!(
        std::fs::read_to_string(victim.join("secret.txt"))
            .ok()
            .as_deref(),
        Some(SECRET)
    );
    assert!(!victim.join("evil").exists());
    assert!(!std::path::Path::new("/tmp/agentlog-sandbox-evil").exists());
}

#[tokio::test(flavor = "multi_thread")]
async fn file_tools_do_not_follow_links_planted_by_bash() {
    file_tools_through_planted_links(RunAs::Me).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn file_tools_do_not_follow_links_planted_by_bash_unprivileged() {
    file_tools_through_planted_links(RunAs::Unprivileged).await;
}
