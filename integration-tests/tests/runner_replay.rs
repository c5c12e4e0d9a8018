//! Replaying a recorded session against another model, with the real binaries: a store,
//! runners with two models each (the Anthropic and the OpenAI-compatible stand-ins), and
//! `agentlog replay` / `compare` as users run them.
//!
//! - A session recorded on Anthropic, replayed on OpenAI: the calls on the recorded path get
//!   the recorded results (`served_from`, no `tool_started`, the tool not run), the
//!   recording's second user turn is replayed once the first turn ends, the first call off
//!   the path runs for real in a workspace moved to the recording's at that point, and
//!   nothing of the recording changes. `compare` finds where they diverged.
//! - A session recorded on OpenAI, replayed on Anthropic from a later point: the recorded
//!   prefix, its tool calls and results, reaches the Anthropic stand-in in its own form.
//! - `--off-path stop`, a model the runner lacks, approvals, the recording deleted in the
//!   middle of a replay, and a runner killed (-9) in the middle of one.

mod runner_support;

use std::path::Path;
use std::time::Duration;

use agentlog_proto::v1::{
    event::Kind, event_store_client::EventStoreClient, DeleteSessionRequest, Event,
};
use integration_tests::anthropic_standin::{AnthropicStandin, StandinReply as AReply};
use integration_tests::openai_standin::{OpenAiStandin, StandinReply as OReply};
use integration_tests::Store;
use runner_support::{
    agentlog, history, kinds, start_runner_on_model, user_says, wait_for_log, wait_idle, RunnerProc,
};
use serde_json::{json, Value};
use tonic::transport::Channel;

const LIMIT: Duration = Duration::from_secs(60);

/// A store, both stand-ins, and a workspace root.
struct Bench {
    store: Store,
    client: EventStoreClient<Channel>,
    anthropic: AnthropicStandin,
    openai: OpenAiStandin,
    workspaces: tempfile::TempDir,
}

impl Bench {
    async fn start(anthropic: Vec<AReply>, openai: Vec<OReply>) -> Bench {
        let store = Store::start().expect("store");
        let client = store.client().await.expect("client");
        Bench {
            client,
            store,
            anthropic: AnthropicStandin::start(anthropic).await.expect("anthropic"),
            openai: OpenAiStandin::start(openai).await.expect("openai"),
            workspaces: tempfile::tempdir().expect("temp dir"),
        }
    }

    /// A runner with both models, `first` the default.
    fn runner(&self, id: &str, first: &str, extra: &[&str]) -> RunnerProc {
        let (a, o) = (self.anthropic.url(), self.openai.url());
        let second = if first == ANTHROPIC {
            OPENAI
        } else {
            ANTHROPIC
        };
        let mut flags = vec!["--model", second];
        flags.extend_from_slice(extra);
        start_runner_on_model(
            &self.store.url(),
            id,
            self.workspaces.path(),
            (
                first,
                &[
                    ("ANTHROPIC_BASE_URL", a.as_str()),
                    ("ANTHROPIC_API_KEY", "test-key"),
                    ("OPENAI_BASE_URL", o.as_str()),
                    ("OPENAI_API_KEY", "test-key"),
                ],
            ),
            2000,
            4,
            &flags,
        )
    }

    fn cli(&self, args: &[&str]) -> runner_support::CliOutput {
        agentlog(&self.store.url(), args)
    }

    fn replay(&self, args: &[&str]) -> String {
        let out = self.cli(&[&["replay"], args].concat());
        assert!(out.success, "agentlog replay: {}", out.stderr);
        out.stdout.trim().to_string()
    }

    fn file(&self, session: &str, name: &str) -> String {
        std::fs::read_to_string(self.workspaces.path().join(session).join(name)).unwrap_or_default()
    }
}

const ANTHROPIC: &str = "anthropic:standin-1";
const OPENAI: &str = "openai:standin-2";

fn bash(command: &str) -> Value {
    json!({ "command": command })
}

/// The results of a log: (tool_use_id, content, served from seq).
fn results(events: &[Event]) -> Vec<(String, String, Option<u64>)> {
    events
        .iter()
        .filter_map(|e| match &e.kind {
            Some(Kind::ToolResult(r)) => Some((
                r.tool_use_id.clone(),
                r.content.clone(),
                r.served_from.as_ref().map(|f| f.seq),
            )),
            _ => None,
        })
        .collect()
}

fn started(events: &[Event]) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| match &e.kind {
            Some(Kind::ToolStarted(s)) => Some(s.tool_use_id.clone()),
            _ => None,
        })
        .collect()
}

fn user_texts(events: &[Event]) -> Vec<String> {
    events
        .iter()
        .filter_map(|e| match &e.kind {
            Some(Kind::UserMessage(m)) => Some(m.text.clone()),
            _ => None,
        })
        .collect()
}

/// Waits until the session's log holds `users` user messages and ends in a final reply or a
/// `run_error`.
async fn wait_done(
    client: &mut EventStoreClient<Channel>,
    session: &str,
    users: usize,
) -> Vec<Event> {
    wait_for_log(client, session, LIMIT, |events| {
        user_texts(events).len() >= users
            && events
                .iter()
                .rev()
                .find(|e| !matches!(e.kind, Some(Kind::AssistantDelta(_))))
                .is_some_and(|e| match &e.kind {
                    Some(Kind::AssistantMessage(m)) => {
                        m.stop_reason == "end_turn" || m.stop_reason == "stop"
                    }
                    Some(Kind::RunError(_)) => true,
                    _ => false,
                })
    })
    .await
}

/// Records a session on the default model: two user turns, each waited for.
async fn record(bench: &mut Bench, session: &str, turns: &[&str]) -> Vec<Event> {
    for (i, text) in turns.iter().enumerate() {
        let seq = user_says(&mut bench.client, session, text).await;
        wait_idle(&mut bench.client, session, seq, LIMIT).await;
        let _ = i;
    }
    history(&mut bench.client, session).await
}

fn assert_workspace_untouched(root: &Path, session: &str, file: &str, content: &str) {
    assert_eq!(
        std::fs::read_to_string(root.join(session).join(file)).unwrap_or_default(),
        content,
        "the recording's workspace is as its own calls left it"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anthropic_recording_replayed_on_openai_serves_the_path_then_runs_off_it() {
    let anthropic = vec![
        AReply::text("Writing.").tool("bash", bash("echo one > a.txt")),
        AReply::default().tool("bash", bash("cat a.txt")),
        AReply::text("done 1"),
        AReply::default().tool("bash", bash("echo two >> a.txt")),
        AReply::text("done 2"),
    ];
    let openai = vec![
        OReply::text("Same start.").tool("bash", bash("echo one > a.txt")),
        OReply::default().tool("bash", bash("cat a.txt")),
        OReply::text("done 1, replayed"),
        OReply::default().tool("bash", bash("echo three >> a.txt")),
        OReply::text("done 2, replayed"),
    ];
    let mut bench = Bench::start(anthropic, openai).await;
    let _runner = bench.runner("r1", ANTHROPIC, &[]);
    let recorded = record(&mut bench, "rec-1", &["first task", "second task"]).await;
    assert_eq!(bench.file("rec-1", "a.txt"), "one\ntwo\n");
    let recorded_results = results(&recorded);
    assert_eq!(recorded_results.len(), 3);

    let replay = bench.replay(&["rec-1", "--model", OPENAI]);
    let events = wait_done(&mut bench.client, &replay, 2).await;
    assert_eq!(user_texts(&events), vec!["first task", "second task"]);
    let got = results(&events);
    assert_eq!(got.len(), 3, "{:#?}", kinds(&events));
    // The two calls on the path: the recorded results, naming them, the tools not run.
    let recorded_seqs: Vec<u64> = recorded
        .iter()
        .filter(|e| matches!(e.kind, Some(Kind::ToolResult(_))))
        .map(|e| e.seq)
        .collect();
    assert_eq!(got[0].2, Some(recorded_seqs[0]));
    assert_eq!(got[1].2, Some(recorded_seqs[1]));
    assert_eq!(got[1].1, recorded_results[1].1, "cat a.txt as recorded");
    // Off the path: run for real, after the workspace moved to the recording's.
    assert_eq!(got[2].2, None);
    assert_eq!(started(&events), vec![got[2].0.clone()]);
    assert_eq!(bench.file(&replay, "a.txt"), "one\nthree\n");
    // Nothing of the recording changed.
    assert_eq!(history(&mut bench.client, "rec-1").await, recorded);
    assert_workspace_untouched(bench.workspaces.path(), "rec-1", "a.txt", "one\ntwo\n");
    assert!(
        bench.openai.violations().is_empty(),
        "{:?}",
        bench.openai.violations()
    );
    assert!(bench.anthropic.violations().is_empty());

    // Each reply says its model; show says it too, and marks the served results.
    let shown = bench.cli(&["show", &replay]);
    assert!(shown.success, "{}", shown.stderr);
    assert!(
        shown.stdout.contains("(reply by standin-2)"),
        "{}",
        shown.stdout
    );
    assert!(
        shown
            .stdout
            .contains(&format!("served from rec-1 seq {}", recorded_seqs[0])),
        "{}",
        shown.stdout
    );
    assert!(shown
        .stdout
        .contains(&format!("a replay of rec-1 after seq 1 on {OPENAI}")));

    let compared = bench.cli(&["--json", "compare", "rec-1", &replay]);
    assert!(compared.success, "{}", compared.stderr);
    let c: Value = serde_json::from_str(compared.stdout.trim()).expect("one JSON object");
    assert_eq!(c["fromSeq"], 1);
    assert_eq!(c["diverged"]["turn"], 2);
    assert_eq!(c["diverged"]["call"], 1);
    assert_eq!(c["totalsB"]["served"], 2);
    assert_eq!(c["totalsB"]["ran"], 1);
    assert_eq!(c["totalsA"]["ran"], 3);
    assert_eq!(c["totalsB"]["answer"], "done 2, replayed");
    assert_eq!(c["totalsB"]["models"], json!(["standin-2"]));
    assert_eq!(c["turns"][0]["calls"][0]["same"], true);
    assert_eq!(c["turns"][0]["calls"][0]["b"]["how"], "served");
    let text = bench.cli(&["compare", "rec-1", &replay]);
    assert!(
        text.stdout.contains("diverged at turn 2, call 1"),
        "{}",
        text.stdout
    );

    let batch = bench.cli(&["compare", "--batch", "-"]);
    assert!(
        !batch.success,
        "stdin is empty: nothing names a replay, so it says so"
    );
    let file = bench.workspaces.path().join("replays.txt");
    std::fs::write(&file, format!("# the replays\n{replay}\n")).expect("write the batch");
    let batch = bench.cli(&["--json", "compare", "--batch", &file.to_string_lossy()]);
    assert!(batch.success, "{}", batch.stderr);
    let lines: Vec<Value> = batch
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON lines"))
        .collect();
    assert_eq!(lines.len(), 2);
    assert_eq!(lines[0]["replay"], replay.as_str());
    assert_eq!(lines[1]["totals"]["pairs"], 1);
    assert_eq!(lines[1]["totals"]["served"], 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_openai_recording_replayed_on_anthropic_renders_the_prefix_in_anthropic_form() {
    let openai = vec![
        OReply::default().tool("bash", bash("echo x > f.txt")),
        OReply::text("wrote f"),
        OReply::default().tool("read_file", json!({"path": "f.txt"})),
        OReply::text("read f"),
    ];
    let anthropic = vec![
        AReply::default(),
        AReply::default(),
        AReply::default().tool("read_file", json!({"path": "f.txt"})),
        AReply::text("read f, on anthropic"),
    ];
    let mut bench = Bench::start(anthropic, openai).await;
    let _runner = bench.runner("r1", OPENAI, &[]);
    let recorded = record(&mut bench, "rec-2", &["write f", "now read it"]).await;
    // From the end of the first turn: its call and result are the replay's prefix.
    let at = recorded
        .iter()
        .find(|e| matches!(&e.kind, Some(Kind::AssistantMessage(m)) if m.stop_reason == "stop"))
        .map(|e| e.seq)
        .expect("the first turn's final reply");
    bench.anthropic.foreign_turns(2);
    let replay = bench.replay(&["rec-2", "--model", ANTHROPIC, "--at", &at.to_string()]);
    let events = wait_done(&mut bench.client, &replay, 2).await;
    let got = results(&events);
    assert_eq!(got.len(), 2, "{:#?}", kinds(&events));
    assert!(got[1].2.is_some(), "read_file f.txt was served: {got:?}");
    assert_eq!(got[1].1, "x\n");
    assert!(
        bench.anthropic.violations().is_empty(),
        "{:?}",
        bench.anthropic.violations()
    );
    let requests = bench.anthropic.requests();
    let first = &requests.first().expect("a request").body["messages"];
    // The OpenAI call and its result, as Anthropic blocks.
    let call_id = recorded
        .iter()
        .find_map(|e| match &e.kind {
            Some(Kind::ToolResult(r)) => Some(r.tool_use_id.clone()),
            _ => None,
        })
        .expect("a recorded call");
    assert_eq!(
        first[0]["content"][0],
        json!({"type": "text", "text": "write f"})
    );
    assert_eq!(
        first[1]["content"],
        json!([{"type": "tool_use", "id": call_id, "name": "bash", "input": {"command": "echo x > f.txt"}}])
    );
    assert_eq!(first[2]["content"][0]["type"], "tool_result");
    assert_eq!(first[2]["content"][0]["tool_use_id"], call_id.as_str());
    assert_eq!(
        first[3]["content"],
        json!([{"type": "text", "text": "wrote f"}])
    );
    assert_eq!(
        first[4]["content"],
        json!([{"type": "text", "text": "now read it"}])
    );
    // The workspace of the replay: the recording's at the fork point.
    assert_eq!(bench.file(&replay, "f.txt"), "x\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn off_path_stop_ends_the_replay_where_it_leaves_the_path_and_a_missing_model_is_named() {
    let anthropic = vec![
        AReply::default().tool("bash", bash("echo a > a.txt")),
        AReply::text("done"),
    ];
    let openai = vec![
        OReply::default().tool("bash", bash("echo b > b.txt")),
        OReply::text("never asked"),
    ];
    let mut bench = Bench::start(anthropic, openai).await;
    let _runner = bench.runner("r1", ANTHROPIC, &[]);
    record(&mut bench, "rec-3", &["go", "again"]).await;
    let replay = bench.replay(&["rec-3", "--model", OPENAI, "--off-path", "stop"]);
    let events = wait_done(&mut bench.client, &replay, 1).await;
    let got = results(&events);
    assert_eq!(got.len(), 1);
    assert!(
        got[0]
            .1
            .starts_with("not run: this replay left the recorded path"),
        "{got:?}"
    );
    assert!(started(&events).is_empty(), "nothing ran");
    let error = events.iter().rev().find_map(|e| match &e.kind {
        Some(Kind::RunError(r)) => Some(r.message.clone()),
        _ => None,
    });
    assert!(
        error
            .as_deref()
            .is_some_and(|m| m.contains("left the recorded path") && m.contains("echo a > a.txt")),
        "{error:?}"
    );
    // The replay ends there: the recording's second turn is not replayed.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        user_texts(&history(&mut bench.client, &replay).await),
        vec!["go"]
    );
    assert!(!bench.workspaces.path().join(&replay).join("b.txt").exists());

    // A model this runner lacks: the turn ends with a run_error naming it and its models.
    let out = bench.cli(&["send", "--model", "openai:nope", "hello"]);
    assert!(out.success, "{}", out.stderr);
    assert!(out.stdout.contains("openai:nope"), "{}", out.stdout);
    assert!(
        out.stdout
            .contains(&format!("it has {ANTHROPIC}, {OPENAI}")),
        "{}",
        out.stdout
    );
    // And one it has: the session runs on it.
    let out = bench.cli(&["send", "--model", OPENAI, "hello"]);
    assert!(
        out.stdout.contains("(reply by standin-2)"),
        "{}",
        out.stdout
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_served_call_needs_no_approval_and_one_off_the_path_asks() {
    let anthropic = vec![
        AReply::default().tool("bash", bash("echo a > a.txt")),
        AReply::default().tool("bash", bash("echo b > b.txt")),
        AReply::text("done"),
    ];
    let openai = vec![
        OReply::default().tool("bash", bash("echo a > a.txt")),
        OReply::default().tool("bash", bash("echo c > c.txt")),
        OReply::text("done, replayed"),
    ];
    let mut bench = Bench::start(anthropic, openai).await;
    let runner = bench.runner("r1", ANTHROPIC, &["--approve", "bash"]);
    // The recording: each call approved by a person.
    let seq = user_says(&mut bench.client, "rec-4", "go").await;
    for _ in 0..2 {
        runner_support::wait_status(
            &mut bench.client,
            "rec-4",
            agentlog_proto::v1::SessionStatus::Waiting,
            LIMIT,
        )
        .await;
        assert!(bench.cli(&["approve", "rec-4"]).success);
    }
    wait_idle(&mut bench.client, "rec-4", seq, LIMIT).await;
    let replay = bench.replay(&["rec-4", "--model", OPENAI]);
    // The first call is served without a person; the second, off the path, asks.
    runner_support::wait_status(
        &mut bench.client,
        &replay,
        agentlog_proto::v1::SessionStatus::Waiting,
        LIMIT,
    )
    .await;
    let events = history(&mut bench.client, &replay).await;
    let got = results(&events);
    assert_eq!(got.len(), 1);
    assert!(got[0].2.is_some());
    let asked: Vec<&Event> = events
        .iter()
        .filter(|e| matches!(e.kind, Some(Kind::ApprovalRequested(_))))
        .collect();
    assert_eq!(asked.len(), 1, "{:#?}", kinds(&events));
    assert!(bench.cli(&["approve", &replay]).success);
    let events = wait_done(&mut bench.client, &replay, 1).await;
    assert_eq!(results(&events).len(), 2);
    // The off-path call ran in the recording's workspace as it was after the served call.
    assert_eq!(bench.file(&replay, "a.txt"), "a\n");
    assert_eq!(bench.file(&replay, "c.txt"), "c\n");
    assert!(!bench.workspaces.path().join(&replay).join("b.txt").exists());
    drop(runner);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_recording_deleted_mid_replay_sends_the_rest_off_the_path() {
    let anthropic = vec![
        AReply::default().tool("bash", bash("echo 1 >> log.txt")),
        AReply::default().tool("bash", bash("echo 2 >> log.txt")),
        AReply::text("done"),
    ];
    let openai = vec![
        OReply::default().tool("bash", bash("echo 1 >> log.txt")),
        // The window in which the recording is deleted.
        OReply::default()
            .tool("bash", bash("echo 2 >> log.txt"))
            .slow(400),
        OReply::text("done, replayed"),
    ];
    let mut bench = Bench::start(anthropic, openai).await;
    let _runner = bench.runner("r1", ANTHROPIC, &[]);
    record(&mut bench, "rec-5", &["go"]).await;
    let replay = bench.replay(&["rec-5", "--model", OPENAI]);
    wait_for_log(&mut bench.client, &replay, LIMIT, |events| {
        !results(events).is_empty()
    })
    .await;
    bench
        .client
        .delete_session(DeleteSessionRequest {
            session_id: "rec-5".into(),
        })
        .await
        .expect("delete the recording");
    let events = wait_done(&mut bench.client, &replay, 1).await;
    let got = results(&events);
    assert_eq!(got.len(), 2, "{:#?}", kinds(&events));
    assert!(got[0].2.is_some(), "served before the deletion");
    assert_eq!(got[1].2, None, "after it, off the path");
    assert_eq!(started(&events), vec![got[1].0.clone()]);
    assert_eq!(
        bench.file(&replay, "log.txt"),
        "1\n2\n",
        "moved to the recorded checkpoint, then ran"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_killed_mid_replay_is_followed_by_one_that_serves_or_runs_each_call_once() {
    let anthropic = vec![
        AReply::default().tool("bash", bash("echo 1 >> keys.txt")),
        AReply::default().tool("bash", bash("echo 2 >> keys.txt")),
        AReply::default().tool("bash", bash("echo 3 >> keys.txt")),
        AReply::text("done"),
    ];
    let openai = vec![
        OReply::default().tool("bash", bash("echo 1 >> keys.txt")),
        OReply::default()
            .tool("bash", bash("echo 2 >> keys.txt"))
            .slow(300),
        OReply::default()
            .tool("bash", bash("echo 4 >> keys.txt"))
            .slow(300),
        OReply::text("done, replayed").slow(300),
    ];
    let mut bench = Bench::start(anthropic, openai).await;
    let mut first = bench.runner("r1", ANTHROPIC, &[]);
    record(&mut bench, "rec-6", &["go"]).await;
    let replay = bench.replay(&["rec-6", "--model", OPENAI]);
    // Killed while the model streams the reply after the first served result.
    let killed = runner_support::kill_when(
        bench.client.clone(),
        replay.clone(),
        1,
        first.pid(),
        |e| matches!(&e.kind, Some(Kind::ToolResult(r)) if r.served_from.is_some()),
        Duration::from_millis(150),
    )
    .await;
    assert!(killed);
    first.kill9();
    let _second = bench.runner("r2", ANTHROPIC, &[]);
    let events = wait_done(&mut bench.client, &replay, 1).await;
    let got = results(&events);
    assert_eq!(got.len(), 3, "{:#?}", kinds(&events));
    let mut ids: Vec<&String> = got.iter().map(|r| &r.0).collect();
    ids.dedup();
    assert_eq!(ids.len(), 3, "one result a call");
    assert_eq!(
        got.iter().map(|r| r.2.is_some()).collect::<Vec<_>>(),
        vec![true, true, false]
    );
    assert_eq!(started(&events).len(), 1, "only the call off the path ran");
    assert_eq!(bench.file(&replay, "keys.txt"), "1\n2\n4\n");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replay_all_makes_one_replay_per_session_and_compare_batch_reads_them_from_stdin() {
    let anthropic = vec![
        AReply::default().tool("bash", bash("echo a > a.txt")),
        AReply::text("done"),
    ];
    let openai = vec![
        OReply::default().tool("bash", bash("echo a > a.txt")),
        OReply::text("done, replayed"),
    ];
    let mut bench = Bench::start(anthropic, openai).await;
    let _runner = bench.runner("r1", ANTHROPIC, &[]);
    record(&mut bench, "batch-1", &["one"]).await;
    record(&mut bench, "batch-2", &["two"]).await;
    record(&mut bench, "other-3", &["three"]).await;
    let out = bench.cli(&[
        "replay", "--all", "--query", "batch", "--status", "idle", "--model", OPENAI,
    ]);
    assert!(out.success, "{}", out.stderr);
    let replays: Vec<String> = out.stdout.lines().map(str::to_string).collect();
    assert_eq!(replays.len(), 2, "{}", out.stdout);
    for replay in &replays {
        let events = wait_done(&mut bench.client, replay, 1).await;
        assert_eq!(results(&events).iter().filter(|r| r.2.is_some()).count(), 1);
    }
    // A second --all leaves the replays out: only the recordings are replayed again.
    let again = bench.cli(&["--json", "replay", "--all", "--model", OPENAI]);
    assert!(again.success, "{}", again.stderr);
    let made: Vec<Value> = again
        .stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON lines"))
        .collect();
    let mut of: Vec<&str> = made.iter().filter_map(|m| m["replayOf"].as_str()).collect();
    of.sort();
    assert_eq!(of, vec!["batch-1", "batch-2", "other-3"]);
    for m in &made {
        let id = m["sessionId"].as_str().expect("an id");
        wait_done(&mut bench.client, id, 1).await;
    }

    let mut batch = std::process::Command::new(integration_tests::bin_path("agentlog"))
        .args(["--addr", &bench.store.url(), "compare", "--batch", "-"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("agentlog compare --batch -");
    {
        use std::io::Write;
        let mut stdin = batch.stdin.take().expect("stdin");
        stdin
            .write_all(format!("{}\n", replays.join("\n")).as_bytes())
            .expect("write the ids");
    }
    let out = batch.wait_with_output().expect("its output");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.starts_with("REPLAY"), "{stdout}");
    for replay in &replays {
        assert!(stdout.contains(replay.as_str()), "{stdout}");
    }
    assert!(
        stdout.contains("2 pairs, 0 diverged; replays: 2 calls served, 0 ran"),
        "{stdout}"
    );
}
