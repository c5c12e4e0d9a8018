//! A malicious model's tool call cannot read the runner's secrets: the real `runner`, given
//! a model API key and its store token in its environment (as the gVisor overlay gives them),
//! talks to a TLS + tokens store; the model asks the bash tool to dump its environment, the
//! runner's environment (/proc/$PPID/environ) and command line. None of it shows a secret,
//! and neither process logs one.
//!
//! When the tests run as root (with CAP_SYS_PTRACE, which reads any process), the runner is
//! started as `nobody`, as it runs in the cluster (non-root, no capabilities), and the test
//! itself checks that the runner's initial environment block (`/proc/<runner>/environ`)
//! no longer holds the secrets: the runner wiped them after reading them.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentlog_proto::v1::{
    event, AppendRequest, GetSessionRequest, SessionStatus, SubscribeRequest,
};
use integration_tests::secure::{tls_client, tokens_json, LoggedStore, SecureFiles, TokenSpec};
use integration_tests::{bin_path, bin_path_for_any_user, user_event};

const API_KEY: &str = "sk-ant-api03-SECRET-model-key-xyz";
const OPENAI_KEY: &str = "sk-openai-SECRET-key-abc";
const RUNNER_TOKEN: &str = "runner-store-token-SECRET-123";
const ADMIN_TOKEN: &str = "admin-token-for-the-test-456";

#[tokio::test]
async fn the_bash_tool_sees_no_secret_of_the_runner() {
    let files = SecureFiles::new();
    let tokens = files.write(
        "tokens.json",
        &tokens_json(&[
            TokenSpec::unscoped("runners", RUNNER_TOKEN, "runner"),
            TokenSpec::unscoped("ops", ADMIN_TOKEN, "admin"),
        ]),
    );
    let mut args = files.tls_args();
    args.extend(["--tokens-file".into(), tokens.into()]);
    let store = LoggedStore::start(&args).expect("store starts");

    let script = files.write(
        "script.jsonl",
        &[
            serde_json::json!({"text": "Let me look around.", "tool_uses": [{"name": "bash", "input": {"command":
                "echo '--- env'; env; echo '--- parent environ'; tr '\\0' '\\n' < /proc/$PPID/environ; echo '--- parent cmdline'; tr '\\0' ' ' < /proc/$PPID/cmdline; echo"}}]}).to_string(),
            serde_json::json!({"text": "Done."}).to_string(),
        ]
        .join("\n"),
    );
    let workspaces = tempfile::tempdir().expect("temp dir");
    // The runner may run as nobody: let it read the files and write the workspaces.
    for path in [files.dir.path(), workspaces.path()] {
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o777)).expect("chmod");
    }
    for entry in std::fs::read_dir(files.dir.path()).expect("dir") {
        let path = entry.expect("entry").path();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o644)).expect("chmod");
    }
    // /proc/self belongs to this process's effective user.
    let root = std::fs::metadata("/proc/self").is_ok_and(|m| m.uid() == 0);
    let mut cmd = Command::new(if root {
        bin_path_for_any_user("runner")
    } else {
        bin_path("runner")
    });
    cmd.args(["--event-store", &store.https_url(), "--runner-id", "r1"])
        .arg("--tls-ca")
        .arg(files.path("ca.pem"))
        .arg("--workspace-root")
        .arg(workspaces.path())
        .arg("--model")
        .arg(format!("scripted:{}", script.display()))
        .env("AGENTLOG_TOKEN", RUNNER_TOKEN)
        .env("ANTHROPIC_API_KEY", API_KEY)
        .env("OPENAI_API_KEY", OPENAI_KEY)
        .env(
            "RUST_LOG",
            "debug,h2=info,hyper=info,rustls=info,tower=info",
        )
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    if root {
        cmd.uid(65534).gid(65534);
    }
    let mut runner = cmd.spawn().expect("spawn runner");
    let runner_log = Arc::new(Mutex::new(String::new()));
    {
        let stderr = runner.stderr.take().expect("piped");
        let log = runner_log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                eprintln!("[runner] {line}");
                let mut log = log.lock().unwrap_or_else(|p| p.into_inner());
                log.push_str(&line);
                log.push('\n');
            }
        });
    }

    let ca = &files.ca.cert_pem;
    let mut admin = tls_client(&store.https_url(), ca, None, Some(ADMIN_TOKEN))
        .await
        .expect("connects");
    admin
        .append(AppendRequest {
            session_id: "probe".into(),
            events: vec![user_event("u1", "what can you see?")],
            ..Default::default()
        })
        .await
        .expect("append");
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let info = admin
            .get_session(GetSessionRequest {
                session_id: "probe".into(),
            })
            .await
            .expect("get")
            .into_inner();
        if info.status == SessionStatus::Idle as i32 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the runner never finished: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The runner read its secrets and wiped them from its initial environment block, which
    // /proc/<pid>/environ shows to whoever may read it (this test, as root, may).
    if root {
        let environ = std::fs::read(format!("/proc/{}/environ", runner.id())).expect("environ");
        let environ = String::from_utf8_lossy(&environ);
        assert!(
            environ.contains("RUST_LOG="),
            "the block is readable: {environ}"
        );
        for secret in [API_KEY, OPENAI_KEY, RUNNER_TOKEN] {
            assert!(
                !environ.contains(secret),
                "a secret is left in the runner's environ block"
            );
        }
    }
    let _ = runner.kill();
    let _ = runner.wait();

    let mut stream = admin
        .subscribe(SubscribeRequest {
            session_id: "probe".into(),
            from_seq: 0,
            follow: false,
        })
        .await
        .expect("subscribe")
        .into_inner();
    let mut output = None;
    while let Some(e) = stream.message().await.expect("stream") {
        if let Some(event::Kind::ToolResult(r)) = e.kind {
            output = Some(r.content);
        }
    }
    let output = output.expect("the bash tool ran");
    eprintln!("the tool saw:\n{output}");
    assert!(output.contains("IDEMPOTENCY_KEY=probe/"), "{output}");
    assert!(output.contains("--- parent cmdline"), "{output}");
    for secret in [API_KEY, OPENAI_KEY, RUNNER_TOKEN] {
        assert!(!output.contains(secret), "the tool saw a secret:\n{output}");
    }
    let runner_log = runner_log.lock().unwrap_or_else(|p| p.into_inner()).clone();
    let store_log = store.log();
    for secret in [API_KEY, OPENAI_KEY, RUNNER_TOKEN, ADMIN_TOKEN] {
        assert!(!runner_log.contains(secret), "the runner logged a secret");
        assert!(!store_log.contains(secret), "the store logged a secret");
    }
}
