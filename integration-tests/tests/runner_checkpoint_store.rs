//! Where checkpoints live (`runner --checkpoint-store`), and what a runner that takes a
//! session over finds in its workspace.
//!
//! Runners with no shared volume: checkpoints in an S3-compatible object store (moto's
//! server, a real HTTP server on a real port), each runner with a workspace root of its own.
//! One session, as an operator would meet it:
//! 1. runner A works two calls (files with modes, a symbolic link, an empty directory, a
//!    large binary file, then a deletion and a change) and is killed -9 in the middle of a
//!    third, which has already left a file behind;
//! 2. runner B, which never saw the session, takes it over: its workspace is A's as the
//!    second call left it, byte for byte (the third call's half-done file is not there), and
//!    the third call is re-run once on it (a counter outside every workspace hears each run);
//! 3. A comes back: a fork made after B's work is restored on A from the object store, and
//!    the session itself, continued on A, is first brought to B's checkpoint;
//! 4. the object store is paused while a call runs: no `tool_result` is appended until it
//!    answers again, and the call runs once; meanwhile the runner is not ready;
//! 5. deletion erases: the session deleted, what its fork still needs stays in the bucket
//!    (the fork restores whole on a third runner); the fork deleted too, nothing of either
//!    is left in the bucket.
//!
//! A runner is not ready until its store has answered: a bucket not made yet keeps it so,
//! with the reason, until the bucket is there. Drained (SIGTERM) while the store does not
//! answer, a runner waits for a call's checkpoint no longer than its drain's budget and
//! appends no result without it. A runner killed -9 in the middle of the
//! bucket's sweep holds the other runners' sweeps up no longer than its lease, and the next
//! sweep removes what the killed one left, and nothing a session still needs.

mod fork_support;
mod runner_support;

use std::time::{Duration, Instant};

use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::{event::Kind, Event, ForkSessionRequest};
use fork_support::describe;
use integration_tests::anthropic_standin::StandinReply;
use integration_tests::s3::S3Server;
use integration_tests::side_effects::Counter;
use integration_tests::Signal;
use runner_support::*;
use serde_json::json;

type Client = EventStoreClient<tonic::transport::Channel>;

const TTL_MS: u64 = 3000;
const IDLE: Duration = Duration::from_secs(90);
/// The large binary file's size.
const BIG: usize = 16 << 20;

fn script(counter: &Counter) -> Vec<StandinReply> {
    let report = counter.report();
    let stale = format!(
        "echo \"stale:$IDEMPOTENCY_KEY\" > /dev/tcp/127.0.0.1/{}",
        counter.port
    );
    vec![
        StandinReply::text("Setting up.").tool(
            "bash",
            json!({"command": format!(
                "mkdir -p src empty/inner && printf 'one\\n' > src/a.txt && chmod 640 src/a.txt \
                 && ln -s src/a.txt link && ln -s nowhere dangling \
                 && head -c {BIG} /dev/urandom > big.bin && chmod 755 big.bin \
                 && echo gone > doomed && {report}"
            )}),
        ),
        StandinReply::text("Changing.").tool(
            "bash",
            json!({"command": format!(
                "rm doomed && echo changed >> src/a.txt && chmod 700 empty && {report}"
            )}),
        ),
        StandinReply::text("A long one.").tool(
            "bash",
            json!({"command": format!(
                "if [ -e half ]; then {stale}; fi; touch half; {report}; sleep 6; echo late > late.txt"
            )}),
        ),
        StandinReply::text("Done."),
        StandinReply::text("Again.").tool(
            "bash",
            json!({"command": format!("touch again && {report} && sleep 3")}),
        ),
        StandinReply::text("Finished."),
    ]
}

fn runner(
    rig: &Rig,
    s3: &S3Server,
    id: &str,
    root: &std::path::Path,
    metrics_port: u16,
) -> RunnerProc {
    runner_on(rig, s3, &s3.url("agentlog"), id, root, metrics_port, &[])
}

/// [`runner`], its checkpoints at `store` (a URL into `s3`), with `extra` arguments.
fn runner_on(
    rig: &Rig,
    s3: &S3Server,
    store: &str,
    id: &str,
    root: &std::path::Path,
    metrics_port: u16,
    extra: &[&str],
) -> RunnerProc {
    let env = s3.env();
    let mut pairs: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let standin = rig.standin.url();
    pairs.push(("ANTHROPIC_BASE_URL", &standin));
    pairs.push(("ANTHROPIC_API_KEY", "test-key"));
    let metrics = format!("127.0.0.1:{metrics_port}");
    let mut args = vec![
        "--tool-network",
        "all",
        "--checkpoint-store",
        store,
        "--metrics-listen",
        &metrics,
        "--sweep-every",
        "1s",
    ];
    args.extend_from_slice(extra);
    start_runner_on_model(
        &rig.store.url(),
        id,
        root,
        ("anthropic:standin-1", &pairs),
        TTL_MS,
        2,
        &args,
    )
}

/// The seq of the call's `tool_started`, once the log has it.
async fn started(client: &mut Client, session: &str, tool_use_id: &str) -> u64 {
    let is_it =
        |e: &Event| matches!(&e.kind, Some(Kind::ToolStarted(s)) if s.tool_use_id == tool_use_id);
    let events = wait_for_log(client, session, IDLE, |events| events.iter().any(is_it)).await;
    events.iter().find(|e| is_it(e)).expect("started").seq
}

async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + IDLE;
    while !done() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}

/// `GET /ready` of a runner's metrics listener: the status and the body (waiting for the
/// listener to be bound).
async fn readiness(port: u16) -> (u16, String) {
    let url = format!("http://127.0.0.1:{port}/ready");
    let deadline = Instant::now() + IDLE;
    let response = loop {
        match reqwest::get(&url).await {
            Ok(response) => break response,
            Err(e) => assert!(Instant::now() < deadline, "GET {url}: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    (
        response.status().as_u16(),
        response.text().await.unwrap_or_default(),
    )
}

async fn store_up(port: u16) -> String {
    let text = reqwest::get(format!("http://127.0.0.1:{port}/metrics"))
        .await
        .expect("GET /metrics")
        .text()
        .await
        .expect("metrics");
    text.lines()
        .find(|l| l.starts_with("agentlog_runner_checkpoint_store_up "))
        .unwrap_or("no agentlog_runner_checkpoint_store_up")
        .to_string()
}

fn results(events: &[Event]) -> usize {
    events
        .iter()
        .filter(|e| matches!(e.kind, Some(Kind::ToolResult(_))))
        .count()
}

#[tokio::test(flavor = "multi_thread")]
async fn runners_with_no_shared_volume_take_over_fork_and_wait_out_the_object_store() {
    let counter = Counter::start();
    let s3 = S3Server::start("agentlog-test").expect("moto_server");
    let rig = Rig::start(script(&counter)).await;
    let (root_a, root_b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let mut client = rig.client.clone();

    // 1. A works the first two calls and is killed -9 in the third, after its first step.
    let mut a = runner(&rig, &s3, "ra", root_a.path(), free_port());
    user_says(&mut client, "s", "build").await;
    let third = started(&mut client, "s", "toolu_2_0").await;
    wait_until("the third call's report", || counter.counts().len() == 3).await;
    a.kill9();
    let at_kill = describe(&root_a.path().join("s"), &["half"]);
    assert!(at_kill.contains_key("big.bin") && !at_kill.contains_key("doomed"));

    // 2. B takes over on a root of its own.
    let mut b = runner(&rig, &s3, "rb", root_b.path(), free_port());
    let events = wait_idle(&mut client, "s", third, IDLE).await;
    assert_exactly_once_ending(&events, "end_turn");
    let keys = counter.counts();
    assert!(
        !keys.keys().any(|k| k.starts_with("stale:")),
        "the re-run found the killed attempt's file: {keys:?}"
    );
    let runs: Vec<usize> = keys.values().copied().collect();
    assert_eq!(runs, vec![1, 1, 2], "{keys:?}");
    let on_b = root_b.path().join("s");
    let mut after_b = describe(&on_b, &["half", "late.txt"]);
    assert_eq!(
        after_b, at_kill,
        "B's workspace is not A's as the second call left it"
    );
    assert!(on_b.join("late.txt").exists() && on_b.join("half").exists());
    after_b = describe(&on_b, &[]);
    let stored = s3.list("agentlog/").expect("list");
    let big_objects = stored
        .iter()
        .filter(|(_, size)| *size as usize == BIG)
        .count();
    assert_eq!(big_objects, 1, "the large file is stored once: {stored:?}");
    b.kill9();

    // 3. A again: a fork after B's work is restored from the object store ...
    let fork_seq = events
        .iter()
        .filter(|e| matches!(e.kind, Some(Kind::ToolResult(_))))
        .map(|e| e.seq)
        .max()
        .expect("a result");
    let port = free_port();
    a = runner(&rig, &s3, "ra", root_a.path(), port);
    client
        .fork_session(ForkSessionRequest {
            session_id: "s".into(),
            at_seq: fork_seq,
            new_session_id: "f".into(),
            events: vec![],
        })
        .await
        .expect("fork");
    wait_idle(&mut client, "f", 0, IDLE).await;
    assert_eq!(describe(&root_a.path().join("f"), &[]), after_b);

    // ... and the session, continued there, first comes to B's checkpoint; 4. the object
    // store pauses while its call runs.
    let before = history(&mut client, "s").await;
    user_says(&mut client, "s", "again").await;
    let again_started = started(&mut client, "s", "toolu_4_0").await;
    s3.pause();
    // The call's 3 s, then the checkpoint's first request unanswered for 5 s.
    tokio::time::sleep(Duration::from_secs(12)).await;
    let paused = history(&mut client, "s").await;
    assert_eq!(
        results(&paused),
        results(&before),
        "a result was appended while the object store was paused"
    );
    assert!(
        !a.log_lines("does not answer").is_empty(),
        "the runner did not say the store is down"
    );
    let (status, why) = readiness(port).await;
    assert_eq!(status, 503, "{why}");
    assert!(why.contains("does not answer"), "{why}");
    assert_eq!(
        store_up(port).await,
        "agentlog_runner_checkpoint_store_up 0"
    );
    s3.resume();
    let events = wait_idle(&mut client, "s", again_started, IDLE).await;
    assert_exactly_once_ending(&events, "end_turn");
    let on_a = describe(&root_a.path().join("s"), &["again"]);
    assert_eq!(
        on_a, after_b,
        "A did not bring the session to B's checkpoint"
    );
    let again: Vec<usize> = counter
        .counts()
        .into_iter()
        .filter(|(k, _)| k.ends_with("toolu_4_0"))
        .map(|(_, n)| n)
        .collect();
    assert_eq!(again, vec![1]);
    assert_eq!(readiness(port).await.0, 200);
    assert_eq!(
        store_up(port).await,
        "agentlog_runner_checkpoint_store_up 1"
    );

    // 5. The session deleted: its fork's checkpoints stay, its own refs go.
    assert!(!objects(&s3, "sessions/s/refs/").is_empty());
    assert!(!objects(&s3, "blobs/").is_empty());
    delete(&mut client, "s").await;
    wait_until("the session's refs to leave the bucket", || {
        objects(&s3, "sessions/s/").is_empty()
    })
    .await;
    drop(a);
    let root_c = tempfile::tempdir().unwrap();
    let _c = runner(&rig, &s3, "rc", root_c.path(), free_port());
    let asked = user_says(&mut client, "f", "go on").await;
    let after_f = wait_idle(&mut client, "f", asked, IDLE).await;
    assert_exactly_once_ending(&after_f, "end_turn");
    assert_eq!(
        describe(&root_c.path().join("f"), &["again"]),
        after_b,
        "the fork's files did not outlive its parent"
    );
    // The fork deleted too: nothing of either is left.
    delete(&mut client, "f").await;
    wait_until("the bucket to be empty of both", || {
        objects(&s3, "")
            .iter()
            .all(|key| key.starts_with("agentlog/gc/"))
    })
    .await;
}

async fn delete(client: &mut Client, session: &str) {
    client
        .delete_session(agentlog_proto::v1::DeleteSessionRequest {
            session_id: session.into(),
        })
        .await
        .expect("delete");
}

/// The keys under `agentlog/<under>`.
fn objects(s3: &S3Server, under: &str) -> Vec<String> {
    s3.list(&format!("agentlog/{under}"))
        .expect("list")
        .into_iter()
        .map(|(key, _)| key)
        .collect()
}

/// With the local checkpoint area (the default `file://`, one workspace root shared by both
/// runners) too, a dangling call is re-run on the workspace as its `tool_started` found it:
/// the killed attempt's file is gone, its change undone, and what checkpoints leave out
/// (`node_modules/`) is kept as it was.
#[tokio::test(flavor = "multi_thread")]
async fn a_dangling_call_reruns_on_the_workspace_its_start_found_with_the_local_area_too() {
    let counter = Counter::start();
    let report = counter.report();
    let stale = format!(
        "echo \"stale:$IDEMPOTENCY_KEY\" > /dev/tcp/127.0.0.1/{}",
        counter.port
    );
    let rig = Rig::start(vec![
        StandinReply::text("Setting up.").tool(
            "bash",
            json!({"command": format!("echo one > a.txt && mkdir -p node_modules && {report}")}),
        ),
        StandinReply::text("A long one.").tool(
            "bash",
            json!({"command": format!(
                "if [ -e half ] || [ \"$(cat a.txt)\" != one ]; then {stale}; fi; \
                 touch half; echo two > a.txt; echo x >> node_modules/runs; {report}; \
                 [ \"$(wc -l < node_modules/runs)\" -ge 2 ] || sleep 300"
            )}),
        ),
        StandinReply::text("Done."),
    ])
    .await;
    let mut client = rig.client.clone();
    let mut a = rig.runner("ra", TTL_MS, &["--tool-network", "all"]);
    user_says(&mut client, "s", "go").await;
    let second = started(&mut client, "s", "toolu_1_0").await;
    wait_until("the second call's report", || counter.counts().len() == 2).await;
    a.kill9();
    let _b = rig.runner("rb", TTL_MS, &["--tool-network", "all"]);
    let events = wait_idle(&mut client, "s", second, IDLE).await;
    assert_exactly_once_ending(&events, "end_turn");
    let keys = counter.counts();
    assert!(
        !keys.keys().any(|k| k.starts_with("stale:")),
        "the re-run found the killed attempt's work: {keys:?}"
    );
    assert_eq!(keys.values().copied().collect::<Vec<_>>(), vec![1, 2]);
    let workspace = rig.workspaces.path().join("s");
    assert_eq!(
        std::fs::read_to_string(workspace.join("node_modules/runs")).unwrap(),
        "x\nx\n"
    );
    assert_eq!(
        std::fs::read_to_string(workspace.join("a.txt")).unwrap(),
        "two\n"
    );
}

/// A runner whose bucket is not there is not ready, saying why, and is ready once the bucket
/// is made, with no restart: a rolling update stops at a misconfigured store, before any
/// call needs it.
#[tokio::test(flavor = "multi_thread")]
async fn a_runner_is_ready_only_once_its_bucket_answers() {
    let s3 = S3Server::start("agentlog-test").expect("moto_server");
    let rig = Rig::start(Vec::new()).await;
    let root = tempfile::tempdir().unwrap();
    let port = free_port();
    let _runner = runner_on(
        &rig,
        &s3,
        "s3://made-later/agentlog",
        "r",
        root.path(),
        port,
        &[],
    );
    for _ in 0..3 {
        let (status, why) = readiness(port).await;
        assert_eq!(status, 503, "{why}");
        assert!(
            why.contains("s3://made-later/agentlog has not answered yet"),
            "{why}"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    integration_tests::s3::make_bucket(s3.port, "made-later", Duration::from_secs(10))
        .expect("make the bucket");
    let deadline = Instant::now() + IDLE;
    loop {
        let (status, why) = readiness(port).await;
        if status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "never ready: {why}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert_eq!(
        store_up(port).await,
        "agentlog_runner_checkpoint_store_up 1"
    );
}

/// The bucket's sweep, killed -9 in its middle (the runner frozen while `gc/state` says a
/// sweep runs, then killed): another runner's sweeps wait until the killed one's lease ends
/// and no longer, then the deleted session's objects leave the bucket and the live
/// session's all stay.
#[tokio::test(flavor = "multi_thread")]
async fn a_sweep_killed_midway_holds_the_bucket_up_no_longer_than_its_lease() {
    const ROUNDS: usize = 6;
    let counter = Counter::start();
    let report = counter.report();
    let mut script = vec![
        StandinReply::text("Keeping.").tool(
            "bash",
            json!({"command": format!("echo kept > keep.txt && {report}")}),
        ),
        StandinReply::text("Kept."),
    ];
    for _ in 0..ROUNDS {
        script.push(StandinReply::text("Making garbage.").tool(
            "bash",
            json!({"command": format!("head -c 100000 /dev/urandom > gone.bin && {report}")}),
        ));
        script.push(StandinReply::text("Made."));
    }
    let s3 = S3Server::start("agentlog-test").expect("moto_server");
    let bucket = s3.client().expect("a client of the bucket");
    let rig = Rig::start(script).await;
    let mut client = rig.client.clone();
    let root_a = tempfile::tempdir().unwrap();
    let mut a = runner(&rig, &s3, "ra", root_a.path(), free_port());
    let asked = user_says(&mut client, "keep", "keep").await;
    wait_idle(&mut client, "keep", asked, IDLE).await;
    let kept_blobs = objects(&s3, "blobs/");

    // A sweep after each deletion, until one is caught in its middle: A frozen (SIGSTOP)
    // while `gc/state` says it runs, and still says so with A frozen.
    let mut caught = None;
    for round in 0..ROUNDS {
        let gone = format!("gone-{round}");
        let asked = user_says(&mut client, &gone, "make garbage").await;
        wait_idle(&mut client, &gone, asked, IDLE).await;
        a.signal(Signal::SIGSTOP);
        delete(&mut client, &gone).await;
        a.signal(Signal::SIGCONT);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if !sweep_state(&bucket).await.running() {
                continue;
            }
            a.signal(Signal::SIGSTOP);
            let state = sweep_state(&bucket).await;
            if state.running() && !objects(&s3, &format!("sessions/{gone}/")).is_empty() {
                caught = Some((gone.clone(), state));
            } else {
                a.signal(Signal::SIGCONT);
            }
            break;
        }
        if caught.is_some() {
            break;
        }
    }
    let (gone, at_kill) = caught.expect("no sweep caught in its middle");
    a.kill9();
    println!("killed in the middle of a sweep: {at_kill:?}, {gone}'s refs still there");

    // B sweeps every second: nothing while A's lease holds, then all of it.
    let root_b = tempfile::tempdir().unwrap();
    let _b = runner(&rig, &s3, "rb", root_b.path(), free_port());
    while now_ms() + 1000 < at_kill.until_ms {
        assert_eq!(
            sweep_state(&bucket).await,
            at_kill,
            "a sweep ran inside the killed one's lease"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let deadline = Instant::now() + IDLE;
    loop {
        let state = sweep_state(&bucket).await;
        let sessions = objects(&s3, "sessions/");
        if state.generation > at_kill.generation
            && !state.running()
            && sessions
                .iter()
                .all(|key| key.starts_with("agentlog/sessions/keep/"))
            && objects(&s3, "blobs/") == kept_blobs
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the sweeps after the lease never finished the job: {state:?}, {sessions:?}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(
        objects(&s3, "sessions/keep/refs/").len() == 1,
        "the live session's ref is gone"
    );
}

/// `gc/state` as the sweep keeps it (`generation N` and, while one runs, `until MS`).
#[derive(Debug, PartialEq, Eq)]
struct SweepState {
    generation: u64,
    until_ms: i64,
}

impl SweepState {
    fn running(&self) -> bool {
        self.until_ms > now_ms()
    }
}

async fn sweep_state(bucket: &integration_tests::s3::Bucket) -> SweepState {
    let text = bucket
        .text("agentlog/gc/state")
        .await
        .expect("GET gc/state")
        .unwrap_or_default();
    let words: Vec<&str> = text.split_whitespace().collect();
    let after = |word: &str| {
        words
            .windows(2)
            .find(|w| w[0] == word)
            .and_then(|w| w[1].parse::<i64>().ok())
            .unwrap_or(0)
    };
    SweepState {
        generation: after("generation") as u64,
        until_ms: after("until"),
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// SIGTERM while the object store does not answer and a finished call's checkpoint waits
/// for it: the drain gives up at `--drain-timeout` (the runner exits within 3 s past it)
/// without appending the result, whose checkpoint is not stored; the next runner, once the
/// store answers, takes the call up under its policy and the session ends once.
#[tokio::test(flavor = "multi_thread")]
async fn a_drain_waits_for_a_store_that_does_not_answer_no_longer_than_its_budget() {
    let counter = Counter::start();
    let report = counter.report();
    let s3 = S3Server::start("agentlog-test").expect("moto_server");
    let rig = Rig::start(vec![
        StandinReply::text("Writing.").tool(
            "bash",
            json!({"command": format!("echo x > f && {report} && sleep 1")}),
        ),
        StandinReply::text("Done."),
    ])
    .await;
    let mut client = rig.client.clone();
    let root_a = tempfile::tempdir().unwrap();
    let mut a = runner_on(
        &rig,
        &s3,
        &s3.url("agentlog"),
        "ra",
        root_a.path(),
        free_port(),
        &["--drain-timeout", "2s"],
    );
    user_says(&mut client, "s", "write").await;
    let call = started(&mut client, "s", "toolu_0_0").await;
    wait_until("the call's report", || counter.counts().len() == 1).await;
    s3.pause();
    // The call ends (1 s) and its checkpoint waits for the store.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let (status, took) = tokio::task::block_in_place(|| a.terminate_timed(Duration::from_secs(30)));
    assert!(status.success(), "exit {status}");
    assert!(
        took <= Duration::from_secs(2 + 3 + 1),
        "exited {took:?} after SIGTERM (--drain-timeout 2s): {:#?}",
        a.last_lines(12)
    );
    assert_eq!(
        results(&history(&mut client, "s").await),
        0,
        "a result was appended without its checkpoint stored"
    );
    s3.resume();
    let root_b = tempfile::tempdir().unwrap();
    let _b = runner(&rig, &s3, "rb", root_b.path(), free_port());
    let events = wait_idle(&mut client, "s", call, IDLE).await;
    assert_exactly_once_ending(&events, "end_turn");
    println!(
        "drained in {took:?} with the store paused; the call's runs: {:?}",
        counter.counts()
    );
}
