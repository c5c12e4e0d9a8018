//! The `agentlog` CLI as a user runs it: `up` on a fresh data dir → `send` → `tail` →
//! `ls` → `show` → `continue` → `resume` → Ctrl-C; `tail` across store SIGKILLs and
//! restarts; and `agentlog demo` (a runner SIGKILLed mid-tool, each side effect once).

mod fault_support;

use std::time::Duration;

use agentlog_proto::v1::{AppendRequest, GetSessionRequest};
use fault_support::{agentlog, CliProc, Faults};
use integration_tests::{poll_until, user_event, Store};

fn text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn ok(args: &[&str]) -> String {
    let out = agentlog(args);
    assert!(
        out.status.success(),
        "agentlog {args:?} failed:\n{}",
        text(&out)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread")]
async fn up_send_tail_ls_show_on_a_fresh_data_dir() {
    let tmp = tempfile::tempdir().expect("temp dir");
    let data = tmp.path().join(".agentlog");
    let data_arg = data.display().to_string();
    let mut up = CliProc::spawn(&["up", "--data-dir", &data_arg, "--listen", "127.0.0.1:0"]);
    up.wait_for("agentlog is up at ", Duration::from_secs(60));
    let url = up
        .stdout()
        .split("agentlog is up at ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .expect("the ready line names the address")
        .to_string();
    // `up` shows the runner's table of the tool sandbox's protections.
    up.wait_for("resource limits", Duration::from_secs(10));
    for row in [
        "workspace only (read and write)",
        "the runner's secrets",
        "network egress",
    ] {
        assert!(up.stdout().contains(row), "no row {row:?}: {}", up.stdout());
    }
    assert!(
        up.stderr().contains("built-in scripted demo model"),
        "up announces the demo model: {}",
        up.stderr()
    );

    let sent = ok(&[
        "--addr",
        &url,
        "send",
        "--session",
        "cli-1",
        "hello agentlog",
    ]);
    for expected in [
        "Turn 1",
        "-> bash [toolu_0_0]",
        "<- bash result",
        "Done: turn 1",
    ] {
        assert!(sent.contains(expected), "send shows {expected:?}:\n{sent}");
    }

    let mut client = agentlog_proto::v1::event_store_client::EventStoreClient::connect(url.clone())
        .await
        .expect("connect");
    let last = client
        .get_session(GetSessionRequest {
            session_id: "cli-1".into(),
        })
        .await
        .expect("the session exists")
        .into_inner()
        .last_seq as usize;
    let tail = CliProc::spawn(&["--json", "--addr", &url, "tail", "cli-1"]);
    poll_until(
        "tail shows the whole session",
        Duration::from_secs(30),
        || (tail.lines().len() >= last).then_some(()),
    );
    let followed = tail.lines();
    drop(tail);
    let fresh = ok(&["--json", "--addr", &url, "show", "cli-1"]);
    assert_eq!(followed.join("\n") + "\n", fresh, "tail and show agree");

    let listed = ok(&["--addr", &url, "ls"]);
    assert!(
        listed.contains("cli-1") && listed.contains("idle") && listed.contains("hello agentlog"),
        "{listed}"
    );
    assert!(ok(&["--addr", &url, "ls", "--query", "HELLO"]).contains("cli-1"));
    assert!(!ok(&["--addr", &url, "ls", "--status", "runnable"]).contains("cli-1"));

    let shown = ok(&["--addr", &url, "show", "cli-1"]);
    for expected in [
        "you> hello agentlog",
        "agent> Turn 1",
        "agent> Done: turn 1",
    ] {
        assert!(shown.contains(expected), "show has {expected:?}:\n{shown}");
    }

    assert!(ok(&["--addr", &url, "continue", "and again"]).contains("Done: turn 2"));
    assert!(ok(&["--addr", &url, "resume", "cli-1", "once more"]).contains("Done: turn 3"));
    let missing = agentlog(&["--addr", &url, "resume", "no-such-session", "hi"]);
    assert!(!missing.status.success());
    assert!(text(&missing).contains("agentlog ls"), "{}", text(&missing));

    let journal = std::fs::read_to_string(data.join("workspaces/cli-1/journal.txt"))
        .expect("the demo model's tool calls wrote the journal");
    assert_eq!(
        journal.lines().count(),
        3,
        "one journal line per turn:\n{journal}"
    );

    let status = up.terminate();
    assert!(status.success(), "up exits 0 on SIGTERM: {}", up.stderr());
    assert!(up.stderr().contains("stopped cleanly"), "{}", up.stderr());
    let gone = agentlog(&["--addr", &url, "ls"]);
    assert!(!gone.status.success(), "the store stopped with up");
    assert!(
        text(&gone).contains("start one with `agentlog up`"),
        "the error says what to fix: {}",
        text(&gone)
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn tail_rides_out_store_restarts() {
    let data = tempfile::tempdir().expect("temp dir");
    let mut store = Store::start_in(data.path()).expect("store");
    let listen = store.addr.to_string();
    let url = store.url();
    let faults = Faults::default();
    let session = "restart-me";
    let mut appended = 0;
    let append = |client: &mut agentlog_proto::v1::event_store_client::EventStoreClient<
        tonic::transport::Channel,
    >,
                  from: usize| {
        let mut client = client.clone();
        async move {
            client
                .append(AppendRequest {
                    session_id: session.into(),
                    events: (from..from + 5)
                        .map(|i| user_event(&format!("u{i}"), &format!("message {i}")))
                        .collect(),
                    ..AppendRequest::default()
                })
                .await
                .expect("append");
        }
    };
    let mut client = store.client().await.expect("client");
    append(&mut client, appended).await;
    appended += 5;
    let tail = CliProc::spawn(&["--json", "--addr", &url, "tail", session]);
    for _ in 0..2 {
        poll_until("tail catches up", Duration::from_secs(30), || {
            (tail.lines().len() >= appended).then_some(())
        });
        store.kill9();
        faults.add("store_sigkill");
        tokio::time::sleep(Duration::from_millis(500)).await;
        store = Store::start_on(data.path(), &listen).expect("restart the store");
        client = store.client().await.expect("client");
        append(&mut client, appended).await;
        appended += 5;
    }
    poll_until("tail shows every event", Duration::from_secs(30), || {
        (tail.lines().len() >= appended).then_some(())
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let followed = tail.lines();
    let stderr = tail.stderr();
    drop(tail);
    let fresh = ok(&["--json", "--addr", &url, "show", session]);
    assert_eq!(
        followed.join("\n") + "\n",
        fresh,
        "tail showed every event once, across the restarts"
    );
    assert!(stderr.contains("reconnected"), "{stderr}");
    faults.report(
        "tail_rides_out_store_restarts",
        &format!("{appended} events shown once each across the restarts"),
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn the_demo_kills_a_runner_mid_tool_and_applies_each_side_effect_once() {
    let out = agentlog(&["demo"]);
    let printed = text(&out);
    assert!(out.status.success(), "agentlog demo failed:\n{printed}");
    assert!(printed.contains("SIGKILL runner-1"), "{printed}");
    assert!(
        printed.contains("every side effect was applied exactly once"),
        "{printed}"
    );
    println!("FAULTS the_demo: runner_sigkill=1 -> each side effect applied once");
}
