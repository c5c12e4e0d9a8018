//! Deleting a session, seen from the runner (the real store, runner and model stand-in; over
//! PostgreSQL with `AGENTLOG_TEST_BACKEND=postgres`):
//!
//! - deleted during a tool call: the runner that holds it kills the call's whole process
//!   tree within about a second of the store's answer (the session's subscription ends
//!   with `SESSION_DELETED`; the lease here is long, so its timer cannot be what stops it),
//!   appends nothing more, gives no lease back, removes the workspace (following none of
//!   the links the call left there) and, through the checkpoints' GC, its checkpoints; and
//!   goes on working other sessions;
//! - deleted during a model stream: the stream is dropped within about a second;
//! - deleted while a runner waits in a claim long-poll and its lease (another owner's)
//!   runs out: the session is never handed out;
//! - deleted while no runner runs: the next runner's sweep at start removes its workspace
//!   and its checkpoints, keeps a live session's workspace and a directory whose session was
//!   never written, and keeps what a fork of it still needs: the fork, resumed, has the
//!   files of its fork point; an idle session deleted later goes by the periodic sweep;
//! - a parent deleted while its runner holds it: the fork made earlier resumes on the same
//!   runner with its workspace restored, and none of the parent's later files.

mod runner_support;

use std::path::Path;
use std::time::{Duration, Instant};

use agentlog_proto::reason::Reason;
use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::{
    event::Kind, AcquireLeaseRequest, DeleteSessionRequest, Event, ForkSessionRequest,
    SubscribeRequest,
};
use integration_tests::anthropic_standin::StandinReply;
use runner_support::*;
use serde_json::json;
use tokio_stream::StreamExt;
use tonic::transport::Channel;

/// Long: no lease timer or renewal can be what stops the work within a second.
const TTL_MS: u64 = 10_000;
/// What the runner promises: its work stops within a second of the deletion.
const PROMISE: Duration = Duration::from_secs(1);
/// A loaded machine's share: scheduling, process teardown, our 10 ms polling.
const SLACK: Duration = Duration::from_millis(1500);
/// A bound for what must happen eventually (never a claim about speed).
const BOUND: Duration = Duration::from_secs(30);

type Client = EventStoreClient<Channel>;

async fn delete(client: &mut Client, session: &str) {
    client
        .delete_session(DeleteSessionRequest {
            session_id: session.into(),
        })
        .await
        .expect("DeleteSession");
}

/// Whether a process is gone (or a zombie nobody has reaped yet: it runs nothing).
fn process_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
    }
}

fn read_pid(path: &Path) -> u32 {
    std::fs::read_to_string(path)
        .expect("pid file")
        .trim()
        .parse()
        .expect("a pid")
}

async fn wait_until(what: &str, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + BOUND;
    while !done() {
        assert!(Instant::now() < deadline, "{what}: not within {BOUND:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Follows the session's log from seq 1 until the stream ends; returns (once the first
/// event has come) the task that gives the events seen and the status it ended with.
async fn follow(
    client: &Client,
    session: &str,
) -> tokio::task::JoinHandle<(Vec<Event>, tonic::Status)> {
    let mut client = client.clone();
    let session = session.to_string();
    let (first, following) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let mut stream = client
            .subscribe(SubscribeRequest {
                session_id: session,
                from_seq: 1,
                follow: true,
            })
            .await
            .expect("subscribe")
            .into_inner();
        let mut events = Vec::new();
        let mut first = Some(first);
        loop {
            match stream.next().await {
                Some(Ok(event)) => {
                    events.push(event);
                    if let Some(first) = first.take() {
                        let _ = first.send(());
                    }
                }
                Some(Err(status)) => return (events, status),
                None => return (events, tonic::Status::ok("the stream ended")),
            }
        }
    });
    following
        .await
        .expect("the subscription showed the first event");
    task
}

fn checkpoint_sessions(root: &Path) -> Vec<String> {
    std::fs::read_dir(root.join(".checkpoints/sessions"))
        .map(|entries| {
            entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect()
        })
        .unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread")]
async fn a_deletion_mid_tool_call_kills_the_call_at_once_and_removes_the_workspace() {
    // Links the call leaves in its workspace point at files outside it, which must stay.
    let outside = tempfile::tempdir().expect("temp dir");
    std::fs::write(outside.path().join("keep.txt"), "not the session's").expect("write");
    let out = outside.path().display();
    // The session "victim" starts a long call; any other session's call is quick.
    let rig = Rig::start(vec![
        StandinReply::text("Starting the long job.").tool(
            "bash",
            json!({"command": format!(
                "case \"$PWD\" in */victim) ln -s {out} escape; ln -s {out}/keep.txt file_link; \
                 echo $$ > bash.pid; sleep 300 & echo $! > child.pid; echo started > marker; \
                 sleep 300;; *) echo quick;; esac"
            )}),
        ),
        StandinReply::text("Done."),
    ])
    .await;
    let runner = rig.runner("r1", TTL_MS, &[]);
    let mut client = rig.client.clone();
    let root = rig.workspaces.path();

    user_says(&mut client, "victim", "run the long job").await;
    let workspace = root.join("victim");
    wait_until("the call started", || workspace.join("marker").exists()).await;
    let (shell, child) = (
        read_pid(&workspace.join("bash.pid")),
        read_pid(&workspace.join("child.pid")),
    );
    assert!(!process_gone(shell) && !process_gone(child));
    let following = follow(&client, "victim").await;
    wait_for_log(&mut client, "victim", BOUND, |events| {
        has(events, "started")
    })
    .await;

    delete(&mut client, "victim").await;
    let answered = Instant::now();
    wait_until("the call's processes killed", || {
        process_gone(shell) && process_gone(child)
    })
    .await;
    let killed = answered.elapsed();
    eprintln!("the call's process tree was gone {killed:?} after DeleteSession answered");
    assert!(
        killed <= PROMISE + SLACK,
        "the call outlived the deletion by {killed:?}"
    );

    // Nothing was appended after the call started, and the subscription ended as deleted.
    let (events, ended) = following.await.expect("follower");
    assert_eq!(
        kinds(&events),
        ["user", "reply(tool_use)", "started(toolu_0_0#1)"]
    );
    assert_eq!(
        Reason::of(&ended),
        Some(Reason::SessionDeleted),
        "{ended:?}"
    );

    wait_until("the workspace removed", || !workspace.exists()).await;
    assert_eq!(
        std::fs::read_to_string(outside.path().join("keep.txt")).expect("kept"),
        "not the session's",
        "the removal followed no link"
    );
    wait_until("the checkpoints forgotten", || {
        !checkpoint_sessions(root).contains(&"victim".to_string())
    })
    .await;
    wait_until("the removal's leftovers cleared", || {
        std::fs::read_dir(root.join(".checkpoints/removing"))
            .map(|mut entries| entries.next().is_none())
            .unwrap_or(true)
    })
    .await;
    assert!(
        !runner.log_lines("by=\"the log's subscription\"").is_empty(),
        "the subscription's end told the runner"
    );
    assert!(!runner
        .log_lines("the session was deleted: its lease went with it")
        .is_empty());
    // Quietly: no lease given back or lost, no warning about the session at all.
    for noisy in ["lease lost", "release", "renewal failed"] {
        assert_eq!(runner.log_lines(noisy), Vec::<String>::new(), "{noisy}");
    }
    let warned: Vec<String> = runner
        .log_lines("session_id=victim")
        .into_iter()
        .filter(|line| line.contains("WARN") || line.contains("ERROR"))
        .collect();
    assert_eq!(warned, Vec::<String>::new());

    // The runner goes on working other sessions.
    user_says(&mut client, "other", "something quick").await;
    let events = wait_idle(&mut client, "other", 1, BOUND).await;
    assert_exactly_once(&events);
    assert!(root.join("other").is_dir());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_deletion_mid_model_stream_drops_the_stream_at_once() {
    // About 60 s of streaming: only dropping it ends it sooner.
    let rig = Rig::start(vec![StandinReply::text(&"word ".repeat(300)).slow(200)]).await;
    let runner = rig.runner("r1", TTL_MS, &[]);
    let mut client = rig.client.clone();

    user_says(&mut client, "talker", "talk for a long time").await;
    wait_for_log(&mut client, "talker", BOUND, |events| {
        events
            .iter()
            .any(|e| matches!(e.kind, Some(Kind::AssistantDelta(_))))
    })
    .await;
    let following = follow(&client, "talker").await;
    assert!(rig.standin.streams_dropped().is_empty());

    delete(&mut client, "talker").await;
    let answered_ms = integration_tests::standin::now_ms();
    let answered = Instant::now();
    wait_until("the model stream dropped", || {
        !rig.standin.streams_dropped().is_empty()
    })
    .await;
    let dropped =
        Duration::from_millis((rig.standin.streams_dropped()[0] - answered_ms).max(0) as u64);
    eprintln!(
        "the stand-in found the stream dropped {dropped:?} after DeleteSession answered (it \
         looks between pieces, 200 ms apart)"
    );
    assert!(
        dropped <= PROMISE + SLACK,
        "the stream outlived the deletion by {dropped:?}"
    );
    let (events, ended) = following.await.expect("follower");
    assert_eq!(kinds(&events), ["user"], "no reply was logged");
    assert_eq!(
        Reason::of(&ended),
        Some(Reason::SessionDeleted),
        "{ended:?}"
    );
    assert!(
        !runner.log_lines("by=\"the log's subscription\"").is_empty(),
        "the subscription's end told the runner"
    );
    wait_until("the runner let the session go", || {
        !runner
            .log_lines("the session was deleted: its lease went with it")
            .is_empty()
    })
    .await;
    assert!(answered.elapsed() < BOUND);
    assert_eq!(rig.standin.requests().len(), 1, "asked the model once");
}

#[tokio::test(flavor = "multi_thread")]
async fn a_session_deleted_during_a_claim_long_poll_is_never_handed_out() {
    let rig = Rig::start(vec![
        StandinReply::text("Working.").tool("bash", json!({"command": "echo ran >> ran.txt"})),
        StandinReply::text("Done."),
    ])
    .await;
    let mut client = rig.client.clone();
    // Runnable, but leased by someone else for a while: the runner's claims wait.
    user_says(&mut client, "awaited", "work on me").await;
    let lease_ttl = Duration::from_millis(1500);
    client
        .acquire_lease(AcquireLeaseRequest {
            session_id: "awaited".into(),
            owner: "someone-else".into(),
            ttl_ms: lease_ttl.as_millis() as u64,
        })
        .await
        .expect("lease");
    let leased = Instant::now();
    let runner = rig.runner("r1", TTL_MS, &[]);
    wait_until("the runner started", || {
        !runner.log_lines("runner started").is_empty()
    })
    .await;
    delete(&mut client, "awaited").await;
    // Past the lease's end, which the deletion freed anyway, the runner claims on.
    tokio::time::sleep(lease_ttl.saturating_sub(leased.elapsed())).await;
    user_says(&mut client, "next", "then me").await;
    let events = wait_idle(&mut client, "next", 1, BOUND).await;
    assert_exactly_once(&events);
    assert_eq!(
        runner.log_lines("awaited"),
        Vec::<String>::new(),
        "the deleted session was never claimed"
    );
    assert!(!rig.workspaces.path().join("awaited").exists());
    assert!(rig
        .standin
        .requests()
        .iter()
        .all(|r| r.first_user_text == "then me"));
}

/// Turns 0 and 1 make files and end; turn 2 (a fork continued) shows them.
fn files_script() -> Vec<StandinReply> {
    vec![
        StandinReply::text("Making files.").tool(
            "bash",
            json!({"command": "echo one > a.txt && mkdir -p d && echo two > d/b.txt && ln -s d/b.txt link"}),
        ),
        StandinReply::text("Made."),
        StandinReply::text("Looking.").tool(
            "bash",
            json!({"command": "case \"$PWD\" in */parent) echo late > late.txt; sleep 300;; \
                               *) cat a.txt link; ls;; esac"}),
        ),
        StandinReply::text("Looked."),
    ]
}

/// Forks `parent` at its last seq as `fork` (not resumed yet).
async fn fork_at_end(client: &mut Client, parent: &str, fork: &str) {
    let at_seq = history(client, parent)
        .await
        .last()
        .map(|e| e.seq)
        .expect("events");
    client
        .fork_session(ForkSessionRequest {
            session_id: parent.into(),
            at_seq,
            new_session_id: fork.into(),
            events: vec![],
        })
        .await
        .expect("ForkSession");
}

/// Continues the fork and checks that its call saw the files of the fork point.
async fn fork_resumes_with_its_files(client: &mut Client, root: &Path, fork: &str) {
    let seq = user_says(client, fork, "look at the files").await;
    let events = wait_idle(client, fork, seq, BOUND).await;
    assert_exactly_once(&events);
    let (content, is_error) = result_of(&events, "toolu_2_0").expect("the fork's call");
    assert!(!is_error, "{content}");
    for expected in ["one", "two", "a.txt", "d", "link"] {
        assert!(content.contains(expected), "{expected}: {content}");
    }
    assert!(!content.contains("late.txt"), "{content}");
    let workspace = root.join(fork);
    assert_eq!(
        std::fs::read_to_string(workspace.join("d/b.txt")).expect("restored"),
        "two\n"
    );
    assert!(!workspace.join("late.txt").exists());
}

#[tokio::test(flavor = "multi_thread")]
async fn the_sweep_at_start_removes_what_deleted_sessions_left_and_keeps_what_others_need() {
    let rig = Rig::start(files_script()).await;
    let mut client = rig.client.clone();
    let root = rig.workspaces.path();
    let mut first = rig.runner("r1", TTL_MS, &[]);
    user_says(&mut client, "parent", "make files").await;
    user_says(&mut client, "live", "make files").await;
    wait_idle(&mut client, "parent", 1, BOUND).await;
    wait_idle(&mut client, "live", 1, BOUND).await;
    assert!(first.terminate().success());
    fork_at_end(&mut client, "parent", "fork").await;
    std::fs::create_dir_all(root.join("never-written/sub")).expect("mkdir");
    std::fs::write(root.join("never-written/sub/f"), "not a session's").expect("write");
    assert!(checkpoint_sessions(root).contains(&"parent".to_string()));

    // Deleted while no runner runs: the next one's sweep at start finds it.
    delete(&mut client, "parent").await;
    let second = rig.runner("r2", TTL_MS, &["--sweep-every", "1s"]);
    wait_until("the deleted session's workspace removed", || {
        !root.join("parent").exists()
    })
    .await;
    wait_until("its checkpoints forgotten", || {
        !checkpoint_sessions(root).contains(&"parent".to_string())
    })
    .await;
    assert!(
        root.join(".checkpoints/sessions/fork/adopted").exists(),
        "the fork adopted what its prefix names"
    );
    assert_eq!(
        std::fs::read_to_string(root.join("live/a.txt")).expect("a live session's files"),
        "one\n"
    );
    assert_eq!(
        std::fs::read_to_string(root.join("never-written/sub/f")).expect("kept"),
        "not a session's"
    );
    wait_until("the sweep said what it removed", || {
        !second
            .log_lines("workspaces_removed=[\"parent\"]")
            .is_empty()
    })
    .await;

    fork_resumes_with_its_files(&mut client, root, "fork").await;

    // An idle session deleted while the runner runs goes by its next periodic sweep.
    delete(&mut client, "live").await;
    wait_until("the idle session's workspace removed", || {
        !root.join("live").exists()
    })
    .await;
    assert!(root.join("fork/a.txt").exists() && root.join("never-written").exists());
}

#[tokio::test(flavor = "multi_thread")]
async fn a_parent_deleted_while_its_runner_holds_it_leaves_its_fork_whole() {
    let rig = Rig::start(files_script()).await;
    let mut client = rig.client.clone();
    let root = rig.workspaces.path();
    let _runner = rig.runner("r1", TTL_MS, &[]);
    user_says(&mut client, "parent", "make files").await;
    let made = wait_idle(&mut client, "parent", 1, BOUND).await;
    fork_at_end(&mut client, "parent", "fork").await;

    // The parent goes on, into a long call, and is deleted in it.
    user_says(&mut client, "parent", "look at the files").await;
    wait_until("the parent's long call started", || {
        root.join("parent/late.txt").exists()
    })
    .await;
    assert!(made.len() > 1);
    delete(&mut client, "parent").await;
    wait_until("the parent's workspace removed", || {
        !root.join("parent").exists()
    })
    .await;
    wait_until("the parent's checkpoints forgotten", || {
        !checkpoint_sessions(root).contains(&"parent".to_string())
    })
    .await;

    fork_resumes_with_its_files(&mut client, root, "fork").await;
}
