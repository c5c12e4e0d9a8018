//! Search where a user looks, against the real binaries (over PostgreSQL with
//! `AGENTLOG_TEST_BACKEND=postgres`): `agentlog search QUERY` (one hit a line; `--json`:
//! each in the proto3 JSON mapping), `GET /v1/search?q=` on `agentlog web` (and its 400
//! for a bad query, saying why); and a session deleted by `agentlog rm` or by
//! `--retain-idle` is found no more, as one deleted by DeleteSession.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use agentlog_proto::v1::AppendRequest;
use integration_tests::{bin_path, user_event, Store};
use serde_json::Value;

/// Bounds a wait for something that must happen; never a claim about speed.
const PATIENCE: Duration = Duration::from_secs(30);

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

async fn write(store: &Store, session: &str, text: &str) {
    let mut client = store.client().await.expect("connect");
    client
        .append(AppendRequest {
            session_id: session.into(),
            events: vec![user_event("", text)],
            ..AppendRequest::default()
        })
        .await
        .expect("append");
}

/// The hits of `agentlog search QUERY --json`, as (session, seq).
fn searched(store: &Store, query: &str) -> Vec<(String, String)> {
    let (ok, out, err) = agentlog(store, &["--json", "search", query]);
    assert!(ok, "agentlog search failed: {err}");
    out.lines()
        .map(|line| {
            let hit: Value = serde_json::from_str(line).expect("a JSON line");
            (
                hit["sessionId"].as_str().unwrap_or_default().to_string(),
                hit["seq"].as_str().unwrap_or_default().to_string(),
            )
        })
        .collect()
}

/// Waits until `agentlog search QUERY` finds exactly `want`.
fn eventually(store: &Store, query: &str, want: &[(&str, &str)]) {
    let want: Vec<(String, String)> = want
        .iter()
        .map(|(s, q)| (s.to_string(), q.to_string()))
        .collect();
    let deadline = Instant::now() + PATIENCE;
    loop {
        let got = searched(store, query);
        if got == want {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{query:?} finds {got:?}, not {want:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn agentlog_search_prints_hits_and_forgets_what_agentlog_rm_deleted() {
    let store = Store::start().expect("store");
    write(&store, "cli-a", "which session ran terraform destroy").await;
    write(&store, "cli-b", "terraform plan only").await;
    eventually(&store, "terraform", &[("cli-b", "1"), ("cli-a", "1")]);

    let (ok, out, _) = agentlog(&store, &["--json", "search", "terraform destroy"]);
    assert!(ok);
    let hit: Value = serde_json::from_str(out.trim()).expect("one JSON line");
    assert_eq!(hit["sessionId"], "cli-a");
    assert_eq!(hit["seq"], "1");
    assert_eq!(hit["kind"], "user_message");
    assert_eq!(hit["snippet"], "which session ran terraform destroy");
    assert!(hit["tsUnixMs"]
        .as_str()
        .is_some_and(|t| t.parse::<i64>().is_ok()));

    let (ok, out, _) = agentlog(&store, &["search", "destroy"]);
    assert!(ok);
    assert!(out.starts_with("cli-a  #1  user_message  "), "{out}");
    assert!(
        out.trim_end()
            .ends_with("which session ran terraform destroy"),
        "{out}"
    );
    let (ok, out, _) = agentlog(&store, &["search", "nowhere"]);
    assert!(ok);
    assert_eq!(out.trim(), "nothing found for \"nowhere\"");

    let (ok, _, err) = agentlog(&store, &["search", "\"unclosed"]);
    assert!(!ok, "a bad query fails the command");
    assert!(err.contains("not closed"), "{err}");

    let (ok, _, err) = agentlog(&store, &["rm", "cli-a"]);
    assert!(ok, "{err}");
    assert_eq!(
        searched(&store, "terraform"),
        [("cli-b".to_string(), "1".to_string())]
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn retention_deletes_from_the_search_as_delete_session_does() {
    let tmp = tempfile::tempdir().expect("tmp");
    let clock = tmp.path().join("clock-offset-ms");
    std::fs::write(&clock, "0").expect("clock");
    let clock_env = clock.display().to_string();
    let store = Store::start_with_env(
        &["--retain-idle", "2h", "--retention-interval", "200ms"],
        &[("AGENTLOG_TEST_CLOCK_FILE", &clock_env)],
    )
    .expect("store");
    write(&store, "ret-old", "narwhalword from long ago").await;
    eventually(&store, "narwhalword", &[("ret-old", "1")]);
    std::fs::write(&clock, (3 * 3_600_000).to_string()).expect("clock");
    // The store reads its clock file every 100 ms: the next session is written on the
    // moved clock.
    tokio::time::sleep(Duration::from_millis(400)).await;
    write(&store, "ret-new", "narwhalword today").await;
    eventually(&store, "narwhalword", &[("ret-new", "1")]);
}

/// A running `agentlog web` against a store.
struct Web {
    child: Child,
    addr: SocketAddr,
}

impl Web {
    fn start(store: &Store) -> Web {
        let mut child = Command::new(bin_path("agentlog"))
            .args(["--addr", &store.url(), "web", "--listen", "127.0.0.1:0"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn agentlog web");
        let stderr = child.stderr.take().expect("piped stderr");
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut tx = Some(tx);
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                let addr = line
                    .split("listen_addr=")
                    .nth(1)
                    .and_then(|rest| rest.split_whitespace().next())
                    .and_then(|a| a.parse::<SocketAddr>().ok());
                if let (Some(addr), Some(tx)) = (addr, tx.take()) {
                    let _ = tx.send(addr);
                }
            }
        });
        let addr = rx
            .recv_timeout(PATIENCE)
            .expect("agentlog web logs its listen address");
        Web { child, addr }
    }
}

impl Drop for Web {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn get_v1_search_answers_json_and_a_bad_query_is_400_saying_why() {
    let store = Store::start().expect("store");
    let web = Web::start(&store);
    write(&store, "web-a", "the flaky test, again").await;
    eventually(&store, "flaky", &[("web-a", "1")]);
    let http = reqwest::Client::new();
    let get = |query: &str| {
        let request = http
            .get(format!("http://{}/v1/search", web.addr))
            .query(&[("q", query)]);
        async move {
            let response = request.send().await.expect("GET /v1/search");
            let status = response.status().as_u16();
            (status, response.json::<Value>().await.expect("JSON"))
        }
    };
    let (status, body) = get("\"flaky test\"").await;
    assert_eq!(status, 200, "{body}");
    let hits = body["hits"].as_array().expect("hits");
    assert_eq!(hits.len(), 1);
    assert_eq!(hits[0]["sessionId"], "web-a");
    assert_eq!(hits[0]["kind"], "user_message");
    assert_eq!(body["nextPageToken"], "");

    let (status, body) = get("   ").await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("empty"),
        "{body}"
    );
    let (status, body) = get(&"x".repeat(1100)).await;
    assert_eq!(status, 400, "{body}");
    assert!(
        body["error"]["message"]
            .as_str()
            .unwrap_or("")
            .contains("1024"),
        "{body}"
    );
}
