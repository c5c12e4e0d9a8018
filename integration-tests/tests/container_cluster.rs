//! The images users deploy, as a cluster: the shape of deploy/k8s/overlays/ha in containers
//! (testkit/containers/cluster.yaml: PostgreSQL with a synchronous standby, two store
//! replicas over it, three runners with no shared volume — each its own workspaces, new with
//! each container as a pod's emptyDir, the checkpoints in an S3-compatible server — the web
//! view, a model stand-in), each agentlog container locked down as the manifests run it (TLS
//! and tokens on the store, the runner's token and model key as files out of the tools'
//! reach, the object store's credentials in its environment, taken and wiped at start). It
//! is driven from outside only: our client and grpcurl against the published ports, docker
//! commands for the faults.
//!
//! Under continuous appends (a client writing `load:` sessions through both replicas, each
//! append retried with its event id until acknowledged) and sessions of bash calls being
//! worked (`work:` sessions, the only ones the runners' token may claim), in order:
//!
//! 1. **start**: each probe the manifests declare answers as the kubelet asks it, and each
//!    runner's start-up table shows every protection held;
//! 2. **rolling update**: each store replica, then each runner (while it runs a call), gets
//!    `docker stop -t 30` and is replaced by a container of a new image tag;
//! 3. **kills**: `docker kill` of a store replica, and of a runner in the middle of a call;
//! 4. **a cut link**: a runner in the middle of a long call is disconnected for 20 s;
//! 5. **failover**: the PostgreSQL primary is killed and the standby promoted.
//!
//! Then, across all of it: every acknowledged append is in its log at its seq (gapless);
//! every session finished; each call's side effect (a file outside the log, written once
//! per idempotency key) happened once, and no call ran twice except after a kill or a cut
//! (each run's record kept under `target/` on the runner that ran it, which checkpoints
//! leave out: the test copies each runner's workspaces before its container is replaced,
//! and at the end);
//! the cut runner's call stopped before the takeover ran it; every tool's attempts to leave
//! its workspace (secrets, the runner's /proc, signals, another workspace, the network,
//! writes elsewhere) failed; and the model saw only well-formed requests. Each scenario
//! prints what it did and what it counted. Nothing is left behind.
//!
//! A second test starts the same cluster on the last release's images and, under the same
//! load, rolls it to these images (the stores, the runners, the web view, each stopped with
//! `docker stop -t 30`) and back again (in the reverse order): every acknowledged append is
//! in its log through both replicas, every session finished, and no call ran twice. (The
//! last release's runners do not bring workspaces from the object store: a session they
//! take over goes on in the workspace they have, which these calls do not depend on.)
//!
//! Needs the images from `deploy/images` (tag `AGENTLOG_IMAGE_TAG`, default `local`), and
//! for the second test the last release's from `deploy/previous-release --images`.

use std::collections::{BTreeMap, BTreeSet};
use std::net::TcpListener;
use std::path::Path;
use std::time::{Duration, Instant};

use agentlog_proto::v1::{event::Kind, AppendRequest, Event, GetSessionRequest, SessionStatus};
use integration_tests::appender::{Acknowledged, Appender};
use integration_tests::secure::{tls_client, tokens_json, Ca, TlsClient, TokenSpec};
use integration_tests::user_event;
use serde_json::{json, Value};
use testkit::docker::{
    docker, helper_images, repo_root, require_previous_release_images, require_product_images,
    Project,
};
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_health::pb::HealthCheckRequest;

const ADMIN_TOKEN: &str = "cluster-test-admin-token-0123456789";
const RUNNER_TOKEN: &str = "cluster-test-runner-token-0123456789";
const WEB_TOKEN: &str = "cluster-test-web-token-0123456789";
const LOGIN_TOKEN: &str = "cluster-test-login-token-0123456789";
const MODEL_KEY: &str = "sk-ant-cluster-test-model-key-0123456789";
const S3_ACCESS_KEY_ID: &str = "cluster-test-s3-access-key";
const S3_SECRET_ACCESS_KEY: &str = "cluster-test-s3-secret-key-0123456789";
/// The bucket the manifests name (deploy/k8s/overlays/ha: AGENTLOG_CHECKPOINT_STORE).
const BUCKET: &str = "agentlog-checkpoints";
const PATIENCE: Duration = Duration::from_secs(180);

/// Every bash call of a work session but the first: a side effect applied once per
/// idempotency key (the `effects` file), every run's start (`target/starts`), and a tick
/// every 0.1 s while it runs (`target/ticks`), all in the session's workspace; the records of
/// runs under `target/`, which checkpoints leave out, so they stay on the runner that ran
/// the call, and a re-run there (which first brings the workspace back to where the call
/// began) keeps them. A `work:long-` session's calls run 15 s, the others' 2 s.
const EFFECT: &str = r#"key="$IDEMPOTENCY_KEY"; run="$HOSTNAME-$$"; mkdir -p target; echo "$key $run $(date +%s%N)" >> target/starts; case "$key" in work:long-*) n=150 ;; *) n=20 ;; esac; for i in $(seq "$n"); do echo "$key $run $(date +%s%N)" >> target/ticks; sleep 0.1; done; grep -qxF "$key" effects 2>/dev/null || echo "$key" >> effects; echo "applied $key""#;

/// The first call of every work session: each way out of the workspace, tried; one line a
/// try, `refused: …` or `ESCAPED: …`.
const PROBES: &str = r#"try() { if eval "$2" >/dev/null 2>&1; then echo "ESCAPED: $1"; else echo "refused: $1"; fi; }
try store-token 'cat /run/secrets/agentlog/store/token'
try model-key 'cat /run/secrets/agentlog/model/anthropic-api-key'
try object-store-credentials 'env | grep AWS_'
try runner-environ 'cat /proc/1/environ'
try runner-cmdline-mem 'head -c 16 /proc/1/mem'
try signal-runner 'kill -0 1'
try list-workspaces 'ls /workspaces'
try read-other-workspace 'cat /workspaces/victim/secret'
try write-other-workspace 'echo x > /workspaces/victim/pwned'
try write-tmp 'echo x > /tmp/escaped'
try write-root 'echo x > /escaped'
try tcp-model 'exec 3<>/dev/tcp/model/8080'
try tcp-store 'exec 3<>/dev/tcp/event-store/50051'
try tcp-dns-by-ip 'exec 3<>/dev/tcp/127.0.0.11/53'
echo probes done"#;

const PROBE_NAMES: [&str; 14] = [
    "store-token",
    "model-key",
    "object-store-credentials",
    "runner-environ",
    "runner-cmdline-mem",
    "signal-runner",
    "list-workspaces",
    "read-other-workspace",
    "write-other-workspace",
    "write-tmp",
    "write-root",
    "tcp-model",
    "tcp-store",
    "tcp-dns-by-ip",
];

const CALLS_PER_SESSION: usize = 4;

fn script() -> String {
    let bash = |command: &str| json!([{"name": "bash", "input": {"command": command}}]);
    let mut lines = vec![json!({"text": "First, the ways out.", "tool_uses": bash(PROBES)})];
    for i in 1..CALLS_PER_SESSION {
        // Each step's command names its step: three identical calls in a row would wait for
        // a person (the runner's --repeat-limit).
        let effect = format!("# step {i}\n{EFFECT}");
        lines.push(json!({"text": format!("Step {i}."), "tool_uses": bash(&effect)}));
    }
    lines.push(json!({"text": "All steps done."}));
    lines.iter().map(|l| format!("{l}\n")).collect()
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Writes `files` (path under `dir` → contents), readable by the containers' users.
fn write_secrets(dir: &Path, files: &[(&str, String)]) {
    use std::os::unix::fs::PermissionsExt;
    for (path, contents) in files {
        let path = dir.join(path);
        let parent = path.parent().expect("a parent");
        std::fs::create_dir_all(parent).expect("mkdir");
        std::fs::set_permissions(parent, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        std::fs::write(&path, contents).expect("write a secret");
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o444)).expect("chmod");
    }
}

struct Cluster {
    project: Project,
    _secrets: tempfile::TempDir,
    /// Copies of the runners' workspaces, one directory a copy ([`Cluster::keep_workspaces`]).
    copies: tempfile::TempDir,
    copies_made: std::sync::atomic::AtomicUsize,
    ca_pem: String,
    tag: String,
    next_tag: String,
    store_ports: [u16; 2],
    web_port: u16,
    model_port: u16,
}

impl Cluster {
    /// The cluster on the product images, and a second tag of them for its rolling update.
    fn start() -> Cluster {
        let tag = require_product_images().expect("the product images");
        let next_tag = format!("{tag}-next");
        for image in ["event-store", "runner", "web"] {
            docker(&[
                "tag",
                &format!("agentlog/{image}:{tag}"),
                &format!("agentlog/{image}:{next_tag}"),
            ])
            .expect("tag the next release");
        }
        Cluster::start_from(tag, next_tag)
    }

    /// The cluster on the images of `tag`; `next_tag` names the ones it is updated to.
    fn start_from(tag: String, next_tag: String) -> Cluster {
        let helpers = helper_images().expect("the helper images");
        let ca = Ca::new("agentlog cluster test CA");
        let store_cert = ca.server_cert_for(&["event-store", "store-a", "store-b"]);
        let pg_cert = ca.server_cert_for(&["pg-primary", "pg-standby"]);
        let web_cert = ca.server_cert();
        let tokens = tokens_json(&[
            TokenSpec::unscoped("ops", ADMIN_TOKEN, "admin"),
            TokenSpec::scoped("runners", RUNNER_TOKEN, "runner", &["work:"]),
            TokenSpec::scoped("web", WEB_TOKEN, "client", &["work:"]),
        ]);
        let secrets = tempfile::tempdir().expect("a temp dir");
        write_secrets(
            secrets.path(),
            &[
                ("event-store-tls/tls.crt", store_cert.cert_pem.clone()),
                ("event-store-tls/tls.key", store_cert.key_pem.clone()),
                ("event-store-tokens/tokens.json", tokens),
                ("agentlog-db-ca/ca.crt", ca.cert_pem.clone()),
                ("event-store-ca/ca.crt", ca.cert_pem.clone()),
                ("runner-store-token/token", RUNNER_TOKEN.into()),
                ("model-api/anthropic-api-key", MODEL_KEY.into()),
                ("web-tls/tls.crt", web_cert.cert_pem.clone()),
                ("web-tls/tls.key", web_cert.key_pem.clone()),
                ("web-store-token/token", WEB_TOKEN.into()),
                ("web-login/login-token", LOGIN_TOKEN.into()),
                ("postgres-tls/server.crt", pg_cert.cert_pem.clone()),
                ("postgres-tls/server.key", pg_cert.key_pem.clone()),
                ("standin/script.jsonl", script()),
                ("standin/anthropic-api-key", MODEL_KEY.into()),
            ],
        );
        let store_ports = [free_port(), free_port()];
        let health_ports = [free_port(), free_port()];
        let (web_port, model_port, s3_port) = (free_port(), free_port(), free_port());
        let env = [
            ("AGENTLOG_TAG", tag.clone()),
            ("PG_IMAGE", helpers.postgres.clone()),
            ("STANDIN_IMAGE", helpers.model_standin.clone()),
            ("S3_IMAGE", helpers.s3.clone()),
            ("S3_PORT", s3_port.to_string()),
            ("S3_ACCESS_KEY_ID", S3_ACCESS_KEY_ID.into()),
            ("S3_SECRET_ACCESS_KEY", S3_SECRET_ACCESS_KEY.into()),
            ("SECRETS", secrets.path().display().to_string()),
            ("PG_PASSWORD", "app-password-for-the-test".into()),
            (
                "PG_REPLICATION_PASSWORD",
                "replication-password-for-the-test".into(),
            ),
            ("STORE_A_PORT", store_ports[0].to_string()),
            ("STORE_A_HEALTH_PORT", health_ports[0].to_string()),
            ("STORE_B_PORT", store_ports[1].to_string()),
            ("STORE_B_HEALTH_PORT", health_ports[1].to_string()),
            ("WEB_PORT", web_port.to_string()),
            ("MODEL_PORT", model_port.to_string()),
        ];
        let file = repo_root().join("testkit/containers/cluster.yaml");
        let project = Project::up("agentlogcluster", &file, &env).expect("compose up");
        // The operator's bucket; until it is there the runners are not ready.
        testkit::s3::make_bucket(s3_port, BUCKET, PATIENCE).expect("the bucket");
        println!(
            "cluster: compose project {} up (images :{tag}), bucket {BUCKET} made",
            project.name
        );
        Cluster {
            project,
            _secrets: secrets,
            copies: tempfile::tempdir().expect("a temp dir"),
            copies_made: Default::default(),
            ca_pem: ca.cert_pem,
            tag,
            next_tag,
            store_ports,
            web_port,
            model_port,
        }
    }

    async fn client(&self, replica: usize) -> TlsClient {
        let url = format!("https://localhost:{}", self.store_ports[replica]);
        let deadline = Instant::now() + PATIENCE;
        loop {
            match tls_client(&url, &self.ca_pem, None, Some(ADMIN_TOKEN)).await {
                Ok(client) => return client,
                Err(e) if Instant::now() < deadline => {
                    let _ = e;
                    tokio::time::sleep(Duration::from_millis(250)).await;
                }
                Err(e) => panic!("store replica {replica} never answered at {url}: {e}"),
            }
        }
    }

    /// Asks each probe its container's labels declare (`io.agentlog.probe.*`: `grpc PORT
    /// [SERVICE]`, `tcp PORT` or `http PORT PATH`) the way the kubelet asks it, until each one
    /// passes.
    async fn wait_probes(&self, service: &str) {
        let id = self.project.container(service).expect("a container");
        let labels: Value = serde_json::from_str(
            &docker(&["inspect", "--format", "{{json .Config.Labels}}", &id]).expect("inspect"),
        )
        .expect("labels as JSON");
        let deadline = Instant::now() + PATIENCE;
        for (name, probe) in labels.as_object().expect("labels").iter() {
            let Some(kind) = name.strip_prefix("io.agentlog.probe.") else {
                continue;
            };
            let probe = probe.as_str().expect("a string label");
            let words: Vec<&str> = probe.split_whitespace().collect();
            let host_port = self.published(service, words[1]);
            loop {
                let ok = match words[0] {
                    "grpc" => grpc_probe(&host_port, words.get(2).copied().unwrap_or("")).await,
                    "tcp" => std::net::TcpStream::connect(format!("127.0.0.1:{host_port}")).is_ok(),
                    // The kubelet's httpGet: a status from 200 to 399 passes.
                    "http" => reqwest::get(format!("http://127.0.0.1:{host_port}{}", words[2]))
                        .await
                        .is_ok_and(|r| (200..400).contains(&r.status().as_u16())),
                    other => panic!("{service}: probe {probe:?} of an unknown kind {other}"),
                };
                if ok {
                    println!("  {service}: {kind} probe ({probe}) passes");
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "{service}: the {kind} probe ({probe}) never passed; logs:\n{}",
                    self.project.logs(service)
                );
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
        }
    }

    /// The host port `service`'s container `port` is published on.
    fn published(&self, service: &str, port: &str) -> String {
        let id = self.project.container(service).expect("a container");
        let published = docker(&["port", &id, &format!("{port}/tcp")])
            .unwrap_or_else(|e| panic!("{service}'s port {port} is not published: {e}"));
        published
            .lines()
            .next()
            .and_then(|l| l.rsplit(':').next())
            .expect("a host port")
            .to_string()
    }

    /// Waits for a runner's start-up table and checks every protection is held; then puts
    /// another workspace beside its own (`victim`), for the probes to try.
    fn wait_runner(&self, service: &str) -> String {
        let logs = self
            .project
            .wait_for_log(service, "runner started", PATIENCE)
            .expect("the runner starts");
        let table: Vec<&str> = logs
            .lines()
            .filter(|l| l.starts_with("sandbox: "))
            .collect();
        assert!(
            table.first().is_some_and(
                |l| l.contains("--sandbox require") && l.contains("every protection enforced")
            ),
            "{service}: its start-up table does not show every protection held:\n{logs}"
        );
        self.exec_in(
            service,
            "mkdir -p /workspaces/victim && echo victim-secret > /workspaces/victim/secret",
        );
        table.join("\n")
    }

    fn exec_in(&self, service: &str, command: &str) -> String {
        self.project
            .exec(service, &["bash", "-c", command])
            .expect("docker exec in a runner")
    }

    /// Copies `service`'s workspaces (running or stopped, before its container is replaced
    /// with new ones) out of the container, where [`Cluster::records`] reads them.
    fn keep_workspaces(&self, service: &str) {
        let id = self.project.container(service).expect("a container");
        let n = self
            .copies_made
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let copy = self.copies.path().join(format!("{n}-{service}"));
        docker(&[
            "cp",
            &format!("{id}:/workspaces"),
            &copy.display().to_string(),
        ])
        .expect("docker cp of a runner's workspaces");
    }

    /// Every copy of `work:*/FILE` kept so far: the workspace's name (its session's) and the
    /// file, a pair for each copy of a workspace.
    fn records(&self, file: &str) -> Vec<(String, String)> {
        let mut texts = Vec::new();
        for copy in std::fs::read_dir(self.copies.path()).expect("the copies") {
            let copy = copy.expect("a copy").path();
            for workspace in std::fs::read_dir(&copy).expect("a copy's workspaces") {
                let workspace = workspace.expect("a workspace").path();
                let name = workspace
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default();
                if let (true, Ok(text)) = (
                    name.starts_with("work:"),
                    std::fs::read_to_string(workspace.join(file)),
                ) {
                    texts.push((name, text));
                }
            }
        }
        texts
    }

    /// Copies the live runners' workspaces, for [`Cluster::records`].
    fn keep_every_runners_workspaces(&self) {
        for runner in RUNNERS {
            self.keep_workspaces(runner);
        }
    }
}

const RUNNERS: [&str; 3] = ["runner-1", "runner-2", "runner-3"];

/// A gRPC health check, as the kubelet's `grpc` probe makes it: SERVING passes.
async fn grpc_probe(host_port: &str, service: &str) -> bool {
    let Ok(endpoint) =
        tonic::transport::Endpoint::from_shared(format!("http://127.0.0.1:{host_port}"))
    else {
        return false;
    };
    let Ok(Ok(channel)) = tokio::time::timeout(Duration::from_secs(2), endpoint.connect()).await
    else {
        return false;
    };
    let request = HealthCheckRequest {
        service: service.into(),
    };
    match tokio::time::timeout(
        Duration::from_secs(2),
        HealthClient::new(channel).check(request),
    )
    .await
    {
        Ok(Ok(answer)) => answer.into_inner().status == ServingStatus::Serving as i32,
        _ => false,
    }
}

async fn start_session(client: &mut TlsClient, session: &str) {
    client
        .append(AppendRequest {
            session_id: session.into(),
            events: vec![user_event("ask", "Probe the sandbox, then do the steps.")],
            ..Default::default()
        })
        .await
        .expect("start a work session");
}

async fn log(client: &mut TlsClient, session: &str) -> Vec<Event> {
    agentlog_client::log::read_log(client, session)
        .await
        .expect("read a log")
}

/// Starts work sessions named `work:NAME-<n>` (pushed to `started`) until `runner` holds
/// one of them with a call started and not answered, and returns that session: the other
/// runners may claim a round first, so another round starts while it holds none.
async fn work_until_held(
    client: &mut TlsClient,
    name: &str,
    runner: &str,
    started: &mut Vec<String>,
) -> String {
    let deadline = Instant::now() + PATIENCE;
    let mut next_round = Instant::now();
    loop {
        if Instant::now() >= next_round {
            let first = started.len();
            for i in first..first + 3 {
                let session = format!("work:{name}-{i}");
                start_session(client, &session).await;
                started.push(session);
            }
            next_round = Instant::now() + Duration::from_secs(8);
        }
        for session in started.iter() {
            let info = client
                .get_session(GetSessionRequest {
                    session_id: session.clone(),
                })
                .await
                .expect("get a session")
                .into_inner();
            let held = info.lease.as_ref().is_some_and(|l| l.owner == runner);
            if !held {
                continue;
            }
            let events = log(client, session).await;
            let last = events
                .iter()
                .rev()
                .find(|e| !matches!(e.kind, Some(Kind::AssistantDelta(_))));
            // The probes' call is quick; wait for an effect call.
            let calls_done = events
                .iter()
                .filter(|e| matches!(e.kind, Some(Kind::ToolResult(_))))
                .count();
            if calls_done >= 1
                && matches!(
                    last.and_then(|e| e.kind.as_ref()),
                    Some(Kind::ToolStarted(_))
                )
            {
                return session.clone();
            }
        }
        assert!(
            Instant::now() < deadline,
            "{runner} never held one of {started:?} in the middle of a call"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn wait_idle(client: &mut TlsClient, sessions: &[String]) {
    let deadline = Instant::now() + PATIENCE;
    for session in sessions {
        loop {
            let info = client
                .get_session(GetSessionRequest {
                    session_id: session.clone(),
                })
                .await
                .expect("get a session")
                .into_inner();
            if info.status == SessionStatus::Idle as i32 {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "{session} never finished: {info:?}"
            );
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
}

fn batch(name: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("work:{name}-{i}")).collect()
}

async fn start_batch(client: &mut TlsClient, sessions: &[String]) {
    for session in sessions {
        start_session(client, session).await;
    }
}

/// `key → runs` from a workspace file of `key run …` lines.
fn runs_by_key(text: &str) -> BTreeMap<String, BTreeSet<String>> {
    let mut runs: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        if let (Some(key), Some(run)) = (words.next(), words.next()) {
            runs.entry(key.into()).or_default().insert(run.into());
        }
    }
    runs
}

/// Every acknowledged append is in its log at its seq, gapless, read through each replica.
async fn assert_acknowledged_kept(cluster: &Cluster, acked: &Acknowledged) {
    for replica in 0..2 {
        let mut client = cluster.client(replica).await;
        for (session, ids) in acked {
            let events = log(&mut client, session).await;
            integration_tests::assert_log_holds(session, &events, ids);
        }
    }
    let total: usize = acked.values().map(BTreeMap::len).sum();
    println!(
        "acknowledged appends: {total}, every one in its log at its seq through each replica (0 lost)"
    );
}

/// Each effect call of the work sessions applied its side effect once, and ran more than once
/// only in a session whose runner was killed or cut (not one of `graceful`): read from every
/// copy of the runners' workspaces ([`Cluster::records`]), the live ones copied now. A
/// workspace may be on several runners (each that worked the session has a copy, the older
/// ones behind): in none is an effect applied twice, and together they hold every one.
fn assert_each_effect_once(cluster: &Cluster, all_work: &[String], graceful: &[String]) {
    cluster.keep_every_runners_workspaces();
    let mut applied = BTreeSet::new();
    for (_, copy) in cluster.records("effects") {
        let mut seen = BTreeSet::new();
        for key in copy.lines().map(str::trim) {
            assert!(seen.insert(key), "{key}: its effect applied twice:\n{copy}");
            applied.insert(key.to_string());
        }
    }
    let runs = runs_by_key(&concat(cluster.records("target/starts")));
    let expected_calls = all_work.len() * (CALLS_PER_SESSION - 1);
    assert_eq!(applied.len(), expected_calls, "every effect call applied");
    let reruns: Vec<(&String, usize)> = runs
        .iter()
        .filter(|(_, r)| r.len() > 1)
        .map(|(k, r)| (k, r.len()))
        .collect();
    for (key, _) in &reruns {
        assert!(
            !graceful.iter().any(|s| key.starts_with(&format!("{s}/"))),
            "{key} ran twice although its runner was only stopped gracefully"
        );
    }
    println!(
        "calls: {expected_calls}, effects applied once each; runs: {}, re-runs (same key, after a kill or a cut): {}",
        runs.values().map(BTreeSet::len).sum::<usize>(),
        reruns.len()
    );
}

fn concat(copies: Vec<(String, String)>) -> String {
    copies.into_iter().map(|(_, text)| text).collect()
}

/// The workspaces followed their sessions from runner to runner with no shared volume: for
/// each work session one copy of its workspace holds every call's effect (the runner of its
/// last call found the earlier calls' work there), though some sessions ran calls on more
/// than one runner; and what moved went through the object store (the runners' metrics).
async fn assert_workspaces_follow_sessions(cluster: &Cluster, all_work: &[String]) {
    let copies = cluster.records("effects");
    let runs = runs_by_key(&concat(cluster.records("target/starts")));
    let mut moved = 0;
    for session in all_work {
        let mine = format!("{session}/");
        let keys: BTreeSet<&str> = copies
            .iter()
            .flat_map(|(_, text)| text.lines().map(str::trim))
            .filter(|key| key.starts_with(&mine))
            .collect();
        assert_eq!(keys.len(), CALLS_PER_SESSION - 1, "{session}: {keys:?}");
        let whole = copies.iter().any(|(name, text)| {
            name == session && keys.iter().all(|k| text.lines().any(|l| l.trim() == *k))
        });
        let its: Vec<&String> = copies
            .iter()
            .filter(|(name, _)| name == session)
            .map(|(_, text)| text)
            .collect();
        assert!(
            whole,
            "{session}: no copy of its workspace holds every call's effect: {its:?}"
        );
        // A run is `$HOSTNAME-$$`: the container, then the process.
        let hosts: BTreeSet<&str> = runs
            .iter()
            .filter(|(key, _)| key.starts_with(&mine))
            .flat_map(|(_, runs)| runs.iter().filter_map(|r| r.rsplit_once('-')).map(|r| r.0))
            .collect();
        if hosts.len() > 1 {
            moved += 1;
        }
    }
    assert!(moved >= 1, "no session ran calls on more than one runner");
    let mut bytes = BTreeMap::<&str, u64>::new();
    for runner in RUNNERS {
        let port = cluster.published(runner, "9464");
        let metrics = reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
            .await
            .expect("a runner's metrics")
            .text()
            .await
            .expect("text");
        for direction in ["uploaded", "fetched"] {
            let needle = format!("{{direction=\"{direction}\"}} ");
            let n: u64 = metrics
                .lines()
                .filter(|l| l.starts_with("agentlog_runner_checkpoint_store_bytes"))
                .filter_map(|l| l.split_once(&needle).map(|(_, n)| n))
                .filter_map(|n| n.trim().parse::<u64>().ok())
                .sum();
            *bytes.entry(direction).or_default() += n;
        }
    }
    assert!(
        bytes.values().all(|&n| n > 0),
        "the live runners moved no checkpoint through the object store: {bytes:?}"
    );
    println!(
        "workspaces: {moved} of {} sessions ran calls on more than one runner; each session's \
         calls' effects together in one workspace; the live runners uploaded {} and fetched {} \
         bytes of checkpoints",
        all_work.len(),
        bytes["uploaded"],
        bytes["fetched"]
    );
}

/// The model saw only requests the API would accept.
async fn assert_model_requests_well_formed(cluster: &Cluster) {
    let journal: Value = reqwest::get(format!("http://127.0.0.1:{}/journal", cluster.model_port))
        .await
        .expect("the stand-in's journal")
        .json()
        .await
        .expect("JSON");
    assert_eq!(journal["violations"], json!([]), "{journal}");
    println!("model: {} requests, none refused", journal["requests"]);
}

/// Whether `tag` names the last release's images (`deploy/previous-release --images`).
fn is_previous_release(tag: &str) -> bool {
    std::env::var(testkit::previous::VERSION_ENV).is_ok_and(|v| v == tag)
}

/// A rolling update of `services`, one at a time in that order, to the images of `tag`,
/// under the appender's load: each gets `docker stop -t 30` (a runner while it runs a call
/// of a session it holds) and is replaced by a container of `tag`, which passes its probes
/// (a runner: shows its start-up table) before the next one goes. Returns the work sessions
/// it started (their runners were only ever stopped gracefully).
async fn rolling_update(
    cluster: &Cluster,
    appender: &Appender,
    tag: &str,
    services: &[&str],
) -> Vec<String> {
    let project = &cluster.project;
    let next = [("AGENTLOG_TAG", tag.to_string())];
    let mut admin = cluster.client(0).await;
    let mut started = Vec::new();
    for &service in services {
        if service.starts_with("runner-") {
            let mut sessions = Vec::new();
            let name = format!("drain-{service}-to-{tag}");
            let held = work_until_held(&mut admin, &name, service, &mut sessions).await;
            started.extend(sessions);
            let stopped = Instant::now();
            project.stop(service, 30).expect("docker stop -t 30");
            println!(
                "  {service}: stopped (SIGTERM) in the middle of a call of {held}, exited in {:.1} s",
                stopped.elapsed().as_secs_f64()
            );
            // Its workspaces go with the container: the runs they record are kept first.
            cluster.keep_workspaces(service);
            project.replace(service, &next).expect("the replacement");
            cluster.wait_runner(service);
            // The last release's runner has no /ready.
            if !is_previous_release(tag) {
                cluster.wait_probes(service).await;
            }
        } else {
            let before = appender.count();
            let stopped = Instant::now();
            project.stop(service, 30).expect("docker stop -t 30");
            println!(
                "  {service}: stopped (SIGTERM) in {:.1} s",
                stopped.elapsed().as_secs_f64()
            );
            project.replace(service, &next).expect("the replacement");
            cluster.wait_probes(service).await;
            if service.starts_with("store-") {
                appender.wait_more(20, PATIENCE).await;
                let after = appender.count();
                println!(
                    "  {service}: appends acknowledged meanwhile {}, retried {}",
                    after.0 - before.0,
                    after.1 - before.1
                );
                admin = cluster.client(0).await;
            }
        }
        let id = project.container(service).expect("a container");
        let image = docker(&["inspect", "--format", "{{.Config.Image}}", &id]).expect("inspect");
        let component = if service.starts_with("store-") {
            "event-store"
        } else {
            service.trim_end_matches(|c: char| c == '-' || c.is_ascii_digit())
        };
        assert_eq!(
            image,
            format!("agentlog/{component}:{tag}"),
            "{service}'s image"
        );
        println!("  {service}: replaced by {image}");
    }
    started
}

#[tokio::test(flavor = "multi_thread")]
async fn a_cluster_of_the_shipped_images_loses_nothing_and_runs_no_call_twice() {
    let cluster = Cluster::start();
    let project = &cluster.project;

    // ---- 1. start ----
    println!("1. start: the probes the manifests declare, as the kubelet asks them");
    for service in ["store-a", "store-b", "web"] {
        cluster.wait_probes(service).await;
    }
    for runner in RUNNERS {
        let table = cluster.wait_runner(runner);
        println!("  {runner} (--sandbox require) started:\n{table}");
        cluster.wait_probes(runner).await;
    }

    let mut admin = cluster.client(0).await;
    let appender = Appender::start(vec![cluster.client(0).await, cluster.client(1).await]);
    appender.wait_more(20, PATIENCE).await;
    let mut all_work: Vec<String> = Vec::new();
    let mut graceful: Vec<String> = Vec::new();

    // ---- 2. rolling update ----
    println!("2. rolling update to :{} under load", cluster.next_tag);
    let first = batch("roll", 6);
    start_batch(&mut admin, &first).await;
    all_work.extend(first.iter().cloned());
    graceful.extend(first.iter().cloned());
    let rolled = rolling_update(
        &cluster,
        &appender,
        &cluster.next_tag,
        &["store-a", "store-b", "runner-1", "runner-2", "runner-3"],
    )
    .await;
    all_work.extend(rolled.iter().cloned());
    graceful.extend(rolled.iter().cloned());
    admin = cluster.client(0).await;
    wait_idle(&mut admin, &all_work).await;
    println!("  every session finished ({})", all_work.len());

    // ---- 3. kills ----
    println!("3. kills");
    let before = appender.count();
    project.kill("store-b").expect("docker kill");
    appender.wait_more(40, PATIENCE).await;
    let after = appender.count();
    println!(
        "  store-b killed: the other replica took {} appends meanwhile ({} retried)",
        after.0 - before.0,
        after.1 - before.1
    );
    project.start("store-b").expect("docker start");
    cluster.wait_probes("store-b").await;
    println!("  store-b started again");
    let mut killed = Vec::new();
    let held = work_until_held(&mut admin, "kill", "runner-2", &mut killed).await;
    all_work.extend(killed.iter().cloned());
    project.kill("runner-2").expect("docker kill");
    println!("  runner-2 killed in the middle of a call of {held}");
    wait_idle(&mut admin, &killed).await;
    println!("  its sessions were taken over and finished");
    project.start("runner-2").expect("docker start");
    cluster.wait_runner("runner-2");

    // ---- 4. a cut link ----
    println!("4. runner-3 cut off for 20 s in the middle of a long call");
    let mut long = Vec::new();
    let cut = work_until_held(&mut admin, "long", "runner-3", &mut long).await;
    all_work.extend(long.iter().cloned());
    project
        .disconnect("runner-3")
        .expect("docker network disconnect");
    tokio::time::sleep(Duration::from_secs(20)).await;
    project
        .reconnect("runner-3")
        .expect("docker network connect");
    println!("  runner-3 reconnected; {cut} was in its call when cut");
    wait_idle(&mut admin, &long).await;

    // ---- 5. failover ----
    println!("5. the PostgreSQL primary killed, the standby promoted");
    let before = appender.count();
    project.kill("pg-primary").expect("docker kill");
    project
        .exec(
            "pg-standby",
            &[
                "/usr/lib/postgresql/15/bin/pg_ctl",
                "promote",
                "-w",
                "-D",
                "/var/lib/postgresql/data",
            ],
        )
        .expect("promote the standby");
    appender.wait_more(40, PATIENCE).await;
    let after = appender.count();
    println!(
        "  appends acknowledged after the failover: {} ({} retried meanwhile)",
        after.0 - before.0,
        after.1 - before.1
    );
    let acked = appender.finish().await;

    // ---- what was counted ----
    assert_acknowledged_kept(&cluster, &acked).await;
    let mut admin = cluster.client(1).await;
    wait_idle(&mut admin, &all_work).await;
    assert_each_effect_once(&cluster, &all_work, &graceful);
    assert_workspaces_follow_sessions(&cluster, &all_work).await;
    let ticks = concat(cluster.records("target/ticks"));

    // The cut call: each run's ticks end before the next run's begin.
    let mut by_run: BTreeMap<(String, String), (u128, u128)> = BTreeMap::new();
    for line in ticks.lines() {
        let words: Vec<&str> = line.split_whitespace().collect();
        if words.len() != 3 || !words[0].starts_with(&format!("{cut}/")) {
            continue;
        }
        let t: u128 = words[2].parse().expect("a tick time");
        let span = by_run
            .entry((words[0].into(), words[1].into()))
            .or_insert((t, t));
        span.0 = span.0.min(t);
        span.1 = span.1.max(t);
    }
    let mut by_key: BTreeMap<String, Vec<(u128, u128)>> = BTreeMap::new();
    for ((key, _), span) in by_run {
        by_key.entry(key).or_default().push(span);
    }
    let mut overlaps_checked = 0;
    for (key, mut spans) in by_key {
        spans.sort();
        for pair in spans.windows(2) {
            assert!(
                pair[0].1 < pair[1].0,
                "{key}: two runs overlapped: one ticked until {} ns, the next from {} ns",
                pair[0].1,
                pair[1].0
            );
            println!(
                "  {key}: the cut run's last tick {:.1} s before the takeover's first",
                (pair[1].0 - pair[0].1) as f64 / 1e9
            );
            overlaps_checked += 1;
        }
    }
    assert!(
        overlaps_checked >= 1,
        "the cut call was never run again by another runner"
    );

    // The probes: every way out refused, in every work session, and nothing reached.
    for session in &all_work {
        let events = log(&mut admin, session).await;
        let probe_result = events
            .iter()
            .find_map(|e| match &e.kind {
                Some(Kind::ToolResult(r)) if r.content.contains("probes done") => {
                    Some(r.content.clone())
                }
                _ => None,
            })
            .unwrap_or_else(|| panic!("{session}: no probe result"));
        for name in PROBE_NAMES {
            assert!(
                probe_result.contains(&format!("refused: {name}\n")),
                "{session}: {name} was not refused:\n{probe_result}"
            );
        }
        for secret in [
            RUNNER_TOKEN,
            MODEL_KEY,
            S3_ACCESS_KEY_ID,
            S3_SECRET_ACCESS_KEY,
            "victim-secret",
        ] {
            assert!(!probe_result.contains(secret), "{session}: a secret leaked");
        }
    }
    for runner in RUNNERS {
        assert_eq!(
            cluster.exec_in(
                runner,
                "ls /workspaces/victim; ls /tmp/escaped 2>&1 || true"
            ),
            "secret\nls: cannot access '/tmp/escaped': No such file or directory",
            "{runner}"
        );
    }
    println!(
        "sandbox: {} probes refused in each of {} sessions",
        PROBE_NAMES.len(),
        all_work.len()
    );

    assert_model_requests_well_formed(&cluster).await;

    // The web view, over TLS, behind its login, with its own (scoped) store token.
    let web = reqwest::Client::builder()
        .add_root_certificate(
            reqwest::Certificate::from_pem(cluster.ca_pem.as_bytes()).expect("CA"),
        )
        .build()
        .expect("a client");
    let url = format!(
        "https://localhost:{}/v1/sessions?limit=200",
        cluster.web_port
    );
    assert_eq!(web.get(&url).send().await.expect("GET").status(), 401);
    let listed: Value = web
        .get(&url)
        .bearer_auth(LOGIN_TOKEN)
        .send()
        .await
        .expect("GET with the login token")
        .json()
        .await
        .expect("JSON");
    let ids: BTreeSet<&str> = listed["sessions"]
        .as_array()
        .map(|a| a.iter().filter_map(|s| s["sessionId"].as_str()).collect())
        .unwrap_or_default();
    assert!(
        all_work.iter().all(|s| ids.contains(s.as_str())),
        "{listed}"
    );
    assert!(
        !ids.iter().any(|s| s.starts_with("load:")),
        "the web view's token sees work: only"
    );
    println!(
        "web: {} sessions listed over HTTPS behind the login, none outside its scope",
        ids.len()
    );

    for image in ["event-store", "runner", "web"] {
        let _ = docker(&["rmi", &format!("agentlog/{image}:{}", cluster.next_tag)]);
    }
    let _ = &cluster.tag;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_rolling_update_from_the_last_release_and_a_rollback_lose_nothing_and_run_no_call_twice()
{
    let from = require_previous_release_images().expect("the last release's images");
    let to = require_product_images().expect("the product images");
    let cluster = Cluster::start_from(from.clone(), to.clone());

    println!("1. start on the last release's images (:{from})");
    for service in ["store-a", "store-b", "web"] {
        cluster.wait_probes(service).await;
    }
    for runner in ["runner-1", "runner-2", "runner-3"] {
        cluster.wait_runner(runner);
    }
    let mut admin = cluster.client(0).await;
    let appender = Appender::start(vec![cluster.client(0).await, cluster.client(1).await]);
    appender.wait_more(20, PATIENCE).await;
    let mut all_work = batch("before-the-update", 6);
    start_batch(&mut admin, &all_work).await;

    println!("2. rolling update to :{to} under load: the stores, the runners, the web view");
    let rolled = rolling_update(
        &cluster,
        &appender,
        &to,
        &[
            "store-a", "store-b", "runner-1", "runner-2", "runner-3", "web",
        ],
    )
    .await;
    all_work.extend(rolled);
    let mut admin = cluster.client(0).await;
    wait_idle(&mut admin, &all_work).await;
    println!("  every session finished ({})", all_work.len());

    println!("3. rollback to :{from} under load: the web view, the runners, the stores");
    let before_rollback = batch("before-the-rollback", 6);
    start_batch(&mut admin, &before_rollback).await;
    all_work.extend(before_rollback);
    let rolled = rolling_update(
        &cluster,
        &appender,
        &from,
        &[
            "web", "runner-1", "runner-2", "runner-3", "store-a", "store-b",
        ],
    )
    .await;
    all_work.extend(rolled);
    let acked = appender.finish().await;

    // ---- what was counted: every process was stopped gracefully, so no call ran twice ----
    assert_acknowledged_kept(&cluster, &acked).await;
    let mut admin = cluster.client(0).await;
    wait_idle(&mut admin, &all_work).await;
    println!("every session finished ({})", all_work.len());
    assert_each_effect_once(&cluster, &all_work, &all_work);
    assert_model_requests_well_formed(&cluster).await;
}
