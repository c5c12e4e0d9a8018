//! A runner cut off from the store stops before its lease can pass on (the real binaries,
//! a real network namespace): runner A runs in its own namespace, joined to the store by a
//! veth pair, and starts a long bash call; a second into it the link goes down (packets
//! vanish, as in a partition: no reset). Runner B, on the host, takes the session over once
//! A's lease has run out and runs the call again with the same key, which is right. The
//! property: the two runs of the call never overlap. Each run records itself from inside
//! the tool, outside the session's log: a beat (its run id and the time) every 50 ms in a
//! file of the shared workspace, so a run's last beat bounds when it was last alive (under
//! `target/`, which checkpoints leave out: the re-run first brings the workspace back to the
//! call's start, and keeps what checkpoints leave out as it was). Checked
//! at two ttls, side by side.

mod runner_support;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use agentlog_proto::v1::event::Kind;
use integration_tests::{bin_path, Store};
use runner_support::*;
use serde_json::json;
use testkit::Backing;

/// A network namespace with a veth pair to the host: the host end `10.N.M.1/30`, the
/// namespace end `.2`. Removed when dropped.
struct NetNs {
    name: String,
    host_if: String,
    host_ip: String,
}

fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("run ip");
    assert!(
        out.status.success(),
        "ip {}: {}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr)
    );
}

impl NetNs {
    fn create(n: u32) -> NetNs {
        let pid = std::process::id();
        let tag = format!("{}{n}", pid % 100_000);
        let name = format!("alpart{tag}");
        let host_if = format!("alh{tag}");
        let ns_if = format!("aln{tag}");
        let subnet = format!("10.{}.{}", 100 + n, pid % 250);
        let host_ip = format!("{subnet}.1");
        let ns_ip = format!("{subnet}.2");
        ip(&["netns", "add", &name]);
        let netns = NetNs {
            name,
            host_if,
            host_ip,
        };
        ip(&[
            "link",
            "add",
            &netns.host_if,
            "type",
            "veth",
            "peer",
            "name",
            &ns_if,
        ]);
        ip(&["link", "set", &ns_if, "netns", &netns.name]);
        ip(&[
            "addr",
            "add",
            &format!("{}/30", netns.host_ip),
            "dev",
            &netns.host_if,
        ]);
        ip(&["link", "set", &netns.host_if, "up"]);
        ip(&[
            "-n",
            &netns.name,
            "addr",
            "add",
            &format!("{ns_ip}/30"),
            "dev",
            &ns_if,
        ]);
        ip(&["-n", &netns.name, "link", "set", &ns_if, "up"]);
        ip(&["-n", &netns.name, "link", "set", "lo", "up"]);
        netns
    }

    /// Takes the link down: whatever A sends from now on goes nowhere, unanswered.
    fn cut(&self) {
        ip(&["link", "set", &self.host_if, "down"]);
    }
}

impl Drop for NetNs {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["link", "del", &self.host_if])
            .output();
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// Each run of the call: its first and last beat (Unix nanoseconds), by run id.
fn runs(workspace_root: &Path, session: &str) -> BTreeMap<String, (u128, u128)> {
    let text = std::fs::read_to_string(workspace_root.join(session).join("target/beats.txt"))
        .unwrap_or_default();
    let mut runs: BTreeMap<String, (u128, u128)> = BTreeMap::new();
    for line in text.lines() {
        let mut words = line.split_whitespace();
        let (Some(run), Some(Ok(at))) = (words.next(), words.next().map(str::parse::<u128>)) else {
            continue;
        };
        let span = runs.entry(run.to_string()).or_insert((at, at));
        span.0 = span.0.min(at);
        span.1 = span.1.max(at);
    }
    runs
}

/// One trial at `ttl_ms`, on a store of its own: returns (A's last beat, B's first beat)
/// in ms after the cut.
async fn partition_trial(n: u32, ttl_ms: u64, script: &Path, workspaces: &Path) -> (i128, i128) {
    let data = tempfile::tempdir().expect("temp dir");
    // Reachable from the namespace (its veth peer) and from the host's loopback.
    let store = Store::start_backed(
        &bin_path("event-store"),
        Backing::Dir(data.path().to_path_buf()),
        "0.0.0.0:0",
        &["--insecure-plaintext", "--allow-unauthenticated"],
    )
    .expect("store");
    let port = store.addr.port();
    let session = format!("partition-{ttl_ms}");
    let netns = NetNs::create(n);
    let model_spec = format!("scripted:{}", script.display());
    let model = (model_spec.as_str(), &[][..]);
    let mut a = start_runner_in_netns(
        &netns.name,
        &format!("http://{}:{port}", netns.host_ip),
        &format!("a-{ttl_ms}"),
        workspaces,
        model,
        ttl_ms,
        1,
        &[],
    );
    let mut client = store.client().await.expect("client");
    user_says(&mut client, &session, &session).await;
    wait_for_log(&mut client, &session, Duration::from_secs(60), |events| {
        has(events, "started(toolu_0_0#1)")
    })
    .await;
    // A second into the call, the link goes down.
    tokio::time::sleep(Duration::from_secs(1)).await;
    netns.cut();
    let cut = now_ns();
    let _b = start_runner_on_model(
        &format!("http://127.0.0.1:{port}"),
        &format!("b-{ttl_ms}"),
        workspaces,
        model,
        ttl_ms,
        1,
        &[],
    );
    let events = wait_idle(&mut client, &session, 0, Duration::from_secs(90)).await;
    let starts = assert_exactly_once(&events);
    assert_eq!(
        starts.get("toolu_0_0"),
        Some(&2),
        "A's attempt, then B's: {:?}",
        kinds(&events)
    );
    let keys: Vec<&str> = events
        .iter()
        .filter_map(|e| match &e.kind {
            Some(Kind::ToolStarted(s)) => Some(s.idempotency_key.as_str()),
            _ => None,
        })
        .collect();
    assert!(
        keys.windows(2).all(|k| k[0] == k[1]),
        "the same key: {keys:?}"
    );

    let mut spans: Vec<(u128, u128)> = runs(workspaces, &session).into_values().collect();
    spans.sort();
    assert_eq!(spans.len(), 2, "two runs of the call: {spans:?}");
    for pair in spans.windows(2) {
        assert!(
            pair[0].1 < pair[1].0,
            "ttl {ttl_ms} ms: the runs overlapped: one beat until {} ms after the cut, the next \
             began {} ms after it",
            (pair[0].1 as i128 - cut as i128) / 1_000_000,
            (pair[1].0 as i128 - cut as i128) / 1_000_000
        );
    }
    assert!(
        !a.log_lines("stopping work before the lease can run out")
            .is_empty(),
        "A stopped on its own clock: {:#?}",
        a.last_lines(10)
    );
    a.kill9();
    (
        (spans[0].1 as i128 - cut as i128) / 1_000_000,
        (spans[1].0 as i128 - cut as i128) / 1_000_000,
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn a_runner_cut_off_stops_its_call_before_another_can_run_it() {
    let workspaces = tempfile::tempdir().expect("temp dir");
    let script = workspaces.path().join("partition.jsonl");
    let call = "mkdir -p target; run=$(date +%s%N)$RANDOM; for i in $(seq 80); do echo \"$run $(date +%s%N)\" >> target/beats.txt; sleep 0.05; done; echo \"$IDEMPOTENCY_KEY\" >> keys.txt";
    std::fs::write(
        &script,
        format!(
            "{}\n{}\n",
            json!({"text": "A long call.", "tool_uses": [{"name": "bash", "input": {"command": call}}]}),
            json!({"text": "Done."})
        ),
    )
    .expect("write the script");

    let (short, long) = tokio::join!(
        partition_trial(1, 1500, &script, workspaces.path()),
        partition_trial(2, 3000, &script, workspaces.path()),
    );
    println!(
        "PARTITION: ttl 1500 ms: A's last beat {} ms after the cut, B's first {} ms; ttl 3000 ms: \
         {} ms, {} ms",
        short.0, short.1, long.0, long.1
    );
}
