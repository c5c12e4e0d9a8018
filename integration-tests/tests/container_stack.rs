//! The images users deploy, run as a cluster runs them: `deploy/compose.yaml` (the local
//! stack a newcomer starts: a store on the local backend, a runner, the web view) from the
//! images `deploy/images` builds, each container locked down (its image's non-root user, a
//! read-only root filesystem, every capability dropped, no-new-privileges, the engine's
//! default seccomp profile) on fresh named volumes. It checks what a first deploy meets:
//!
//! - the store image's default command refuses to serve off loopback without TLS and
//!   tokens, and leaves its volume as it was;
//! - the engine applied every lock-down setting, and each process runs as a non-root uid;
//! - the runner in `--sandbox require` starts and its table shows every protection held;
//! - a session sent with the CLI through the published port is worked by the runner (a bash
//!   call in its workspace on the fresh volume) and shown by the web view;
//! - the store container killed (`docker kill`) and started again on its volume has every
//!   acknowledged event back, and takes appends again.
//!
//! Needs the images from `deploy/images` (tag `AGENTLOG_IMAGE_TAG`, default `local`).

use std::net::TcpListener;
use std::process::Command;
use std::time::{Duration, Instant};

use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::AppendRequest;
use integration_tests::{bin_path, read_log, user_event};
use serde_json::Value;
use testkit::docker::{docker, repo_root, require_product_images, Project, Volume};

const PATIENCE: Duration = Duration::from_secs(120);

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

#[test]
fn the_store_image_refuses_to_serve_off_loopback_unsecured_and_leaves_its_volume_as_it_was() {
    let tag = require_product_images().expect("the product images");
    let volume = Volume::create("agentlogrefuse").expect("a volume");
    let out = Command::new("docker")
        .args(["run", "--rm", "--read-only", "--cap-drop", "ALL"])
        .args(["--security-opt", "no-new-privileges:true"])
        .args(["-v", &format!("{}:/data", volume.0)])
        .arg(format!("agentlog/event-store:{tag}"))
        .output()
        .expect("docker run");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "the default command must refuse: {stderr}"
    );
    assert!(
        stderr.contains("--tls-cert") && stderr.contains("--insecure-plaintext"),
        "the refusal says what to give: {stderr}"
    );
    let listing = docker(&[
        "run",
        "--rm",
        "-v",
        &format!("{}:/data", volume.0),
        "--entrypoint",
        "ls",
        &format!("agentlog/runner:{tag}"),
        "-A",
        "/data",
    ])
    .expect("list the volume");
    assert_eq!(listing, "", "the refused store wrote nothing to its volume");
}

#[tokio::test(flavor = "multi_thread")]
async fn the_local_stack_runs_locked_down_on_fresh_volumes_and_keeps_what_it_acknowledged() {
    let tag = require_product_images().expect("the product images");
    let (store_port, web_port) = (free_port(), free_port());
    let project = Project::up(
        "agentlogstack",
        &repo_root().join("deploy/compose.yaml"),
        &[
            ("AGENTLOG_TAG", tag.clone()),
            ("AGENTLOG_STORE_PORT", store_port.to_string()),
            ("AGENTLOG_WEB_PORT", web_port.to_string()),
        ],
    )
    .expect("compose up deploy/compose.yaml");
    println!("stack: compose project {} up (images :{tag})", project.name);

    // What the engine applied, and who each process runs as.
    for service in ["event-store", "runner", "web"] {
        let id = project.container(service).expect("a container");
        let host: Value = serde_json::from_str(
            &docker(&["inspect", "--format", "{{json .HostConfig}}", &id]).expect("inspect"),
        )
        .expect("JSON");
        assert_eq!(host["ReadonlyRootfs"], true, "{service}: read-only root");
        assert_eq!(host["Privileged"], false, "{service}: not privileged");
        assert_eq!(host["CapDrop"], serde_json::json!(["ALL"]), "{service}");
        let opts = host["SecurityOpt"].to_string();
        assert!(opts.contains("no-new-privileges:true"), "{service}: {opts}");
        assert!(
            !opts.contains("seccomp"),
            "{service}: the engine's default seccomp profile: {opts}"
        );
        let deadline = Instant::now() + PATIENCE;
        let uids = loop {
            if let Ok(top) = docker(&["top", &id, "-o", "uid,pid"]) {
                break top;
            }
            assert!(
                Instant::now() < deadline,
                "{service} never ran:\n{}",
                project.logs(service)
            );
            std::thread::sleep(Duration::from_millis(250));
        };
        let uids: Vec<&str> = uids
            .lines()
            .skip(1)
            .filter_map(|l| l.split_whitespace().next())
            .collect();
        assert!(
            !uids.is_empty() && !uids.contains(&"0"),
            "{service} runs as {uids:?}"
        );
        println!(
            "  {service}: read-only, no capabilities, no-new-privileges, default seccomp, uid {}",
            uids[0]
        );
    }

    let logs = project
        .wait_for_log("runner", "runner started", PATIENCE)
        .expect("the runner starts");
    let table: Vec<&str> = logs
        .lines()
        .filter(|l| l.starts_with("sandbox: "))
        .collect();
    assert!(
        table.first().is_some_and(
            |l| l.contains("--sandbox require") && l.contains("every protection enforced")
        ),
        "the runner's table shows every protection held:\n{logs}"
    );
    println!("  runner (--sandbox require):\n{}", table.join("\n"));

    // A session through the published port, worked by the runner in the container.
    let addr = format!("http://127.0.0.1:{store_port}");
    let mut client = {
        let deadline = Instant::now() + PATIENCE;
        loop {
            match EventStoreClient::connect(addr.clone()).await {
                Ok(client) => break client,
                Err(e) => {
                    assert!(
                        Instant::now() < deadline,
                        "the store never answered: {e}\n{}",
                        project.logs("event-store")
                    );
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
            }
        }
    };
    let sent = tokio::task::spawn_blocking({
        let addr = addr.clone();
        move || {
            Command::new(bin_path("agentlog"))
                .args([
                    "--addr",
                    &addr,
                    "--json",
                    "send",
                    "--session",
                    "stack:s1",
                    "note this turn",
                ])
                .output()
                .expect("agentlog send")
        }
    })
    .await
    .expect("join");
    let stdout = String::from_utf8_lossy(&sent.stdout);
    assert!(
        sent.status.success(),
        "agentlog send: {}{}",
        stdout,
        String::from_utf8_lossy(&sent.stderr)
    );
    let events = read_log(&mut client, "stack:s1").await;
    let result = events
        .iter()
        .find_map(|e| match &e.kind {
            Some(agentlog_proto::v1::event::Kind::ToolResult(r)) => Some(r.clone()),
            _ => None,
        })
        .expect("the demo model's bash call has a result");
    assert!(
        !result.is_error,
        "the call ran in the workspace: {}",
        result.content
    );
    println!(
        "  stack:s1: {} events, its bash call ran on the fresh workspace volume",
        events.len()
    );

    let listed: Value = reqwest::get(format!("http://127.0.0.1:{web_port}/v1/sessions"))
        .await
        .expect("the web view answers")
        .json()
        .await
        .expect("JSON");
    assert!(
        listed["sessions"]
            .as_array()
            .is_some_and(|s| s.iter().any(|s| s["sessionId"] == "stack:s1")),
        "{listed}"
    );
    println!("  web: lists stack:s1 at http://127.0.0.1:{web_port}/");

    // Killed and started again on its volume: everything acknowledged is back.
    project.kill("event-store").expect("docker kill");
    project.start("event-store").expect("docker start");
    let deadline = Instant::now() + PATIENCE;
    let after = loop {
        if let Ok(mut client) = EventStoreClient::connect(addr.clone()).await {
            if let Ok(events) = agentlog_client::log::read_log(&mut client, "stack:s1").await {
                break events;
            }
        }
        assert!(
            Instant::now() < deadline,
            "the store never came back:\n{}",
            project.logs("event-store")
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert_eq!(after, events, "every acknowledged event is back, as it was");
    let mut client = EventStoreClient::connect(addr.clone())
        .await
        .expect("connect");
    let appended = client
        .append(AppendRequest {
            session_id: "stack:s1".into(),
            events: vec![user_event("again", "and once more")],
            ..Default::default()
        })
        .await
        .expect("it takes appends again")
        .into_inner();
    assert_eq!(appended.last_seq, events.len() as u64 + 1);
    println!(
        "  event-store: killed and started again on its volume, {} events back, appends go on",
        after.len()
    );
}
