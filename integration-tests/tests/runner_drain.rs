//! SIGTERM drains a runner (the real binaries): it claims nothing more, lets the tool call
//! or model stream in hand finish and logs it, starts no new step, gives its leases back
//! and exits within `--drain-timeout` plus its 3 s margin, whatever the store does.
//!
//! - SIGTERM at random moments over many trials (during a claim long-poll, right after a
//!   claim, mid tool call, mid model stream): no call ever runs twice (the sessions' key
//!   files count the side effects; the logs hold one `tool_started` per call), no lease is
//!   left behind, and every trial exits within the bound (an idle runner within the budget,
//!   having nothing to drain).
//! - A call longer than the budget is stopped at it, its process tree killed before the
//!   runner exits, and its tool's unknown-outcome policy settles it on the next claim.
//! - The store cut off (a blackholing proxy) during the stop: an idle runner's long-poll
//!   and a busy runner's renewals hang, and both still exit within the bound; the busy
//!   one's call stops before its lease could run out.
//! - `agentlog up` on Ctrl-C drains its runner (the call in hand is logged) before it stops
//!   the store.

mod fault_support;
mod runner_support;

use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::{event::Kind, Event, GetSessionRequest, SubscribeRequest};
use fault_support::{CliProc, TcpProxy};
use integration_tests::anthropic_standin::StandinReply;
use integration_tests::{signal, Signal, Store};
use runner_support::*;
use serde_json::json;
use tokio_stream::StreamExt;
use tonic::transport::Channel;

/// The runners' drain budget in these tests (`--drain-timeout`).
const BUDGET: Duration = Duration::from_secs(2);
/// The runner's own margin past the budget (`runner::drain::EXIT_MARGIN`).
const EXIT_MARGIN: Duration = Duration::from_secs(3);
/// A loaded machine's share: signal delivery, process teardown, our 5 ms polling.
const SLACK: Duration = Duration::from_millis(1500);
/// Long, so that a lease a stopped runner failed to give back would still show.
const TTL_MS: u64 = 10_000;
const SESSIONS: usize = 4;
const STEPS: usize = 5;

fn budget_flag(budget: Duration) -> String {
    format!("{}ms", budget.as_millis())
}

/// `STEPS` steps, each streamed slowly (about half a second) and then a bash call that
/// records its key after a short sleep; then a final reply.
fn script() -> Vec<StandinReply> {
    let mut replies: Vec<StandinReply> = (0..STEPS)
        .map(|i| {
            StandinReply::text(&format!(
                "Step {i}: I record the key of this call in the session's file, then go on \
                 with the next step of the plan."
            ))
            .slow(30)
            .tool(
                "bash",
                json!({"command": "sleep 0.25; echo \"$IDEMPOTENCY_KEY\" >> keys.txt"}),
            )
        })
        .collect();
    replies.push(StandinReply::text("Every step is done and every key is recorded.").slow(30));
    replies
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Moment {
    ClaimPoll,
    AfterClaim,
    ToolCall,
    ModelStream,
}

fn session(i: usize) -> String {
    format!("drain-{i}")
}

/// Resolves with the first event after each session's current tail that `matches`.
async fn first_new_event(
    client: &EventStoreClient<Channel>,
    matches: fn(&Event) -> bool,
) -> tokio::sync::mpsc::Receiver<Event> {
    let (tx, rx) = tokio::sync::mpsc::channel(1);
    for i in 0..SESSIONS {
        let mut client = client.clone();
        let from_seq = client
            .get_session(GetSessionRequest {
                session_id: session(i),
            })
            .await
            .map_or(0, |info| info.into_inner().last_seq)
            + 1;
        let tx = tx.clone();
        tokio::spawn(async move {
            let Ok(events) = client
                .subscribe(SubscribeRequest {
                    session_id: session(i),
                    from_seq,
                    follow: true,
                })
                .await
            else {
                return;
            };
            let mut events = events.into_inner();
            while let Some(Ok(event)) = events.next().await {
                if matches(&event) {
                    let _ = tx.try_send(event);
                    return;
                }
            }
        });
    }
    rx
}

/// Waits until the runner's log has more than `seen` lines containing `needle` (and not
/// `unless`).
async fn wait_log(runner: &RunnerProc, needle: &str, unless: &str, seen: usize) {
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let found = runner
            .log_lines(needle)
            .iter()
            .filter(|l| unless.is_empty() || !l.contains(unless))
            .count();
        if found > seen {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "runner {} never logged {needle:?}: {:#?}",
            runner.id,
            runner.last_lines(10)
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// No session's live lease belongs to `owner`.
async fn assert_no_lease_of(client: &mut EventStoreClient<Channel>, owner: &str, what: &str) {
    for i in 0..SESSIONS {
        let info = client
            .get_session(GetSessionRequest {
                session_id: session(i),
            })
            .await
            .map(|r| r.into_inner());
        if let Ok(info) = info {
            assert!(
                info.lease.as_ref().is_none_or(|l| l.owner != owner),
                "{what}: {owner} kept the lease of {}: {:?}",
                session(i),
                info.lease
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn sigterm_at_random_moments_reruns_nothing_and_exits_within_the_bound() {
    let mut rig = Rig::start(script()).await;
    let budget = budget_flag(BUDGET);
    let flags = ["--drain-timeout", budget.as_str()];
    // Three trials of each moment: the claim long-polls first, with nothing to claim.
    let mut plan = vec![Moment::ClaimPoll; 3];
    for _ in 0..3 {
        plan.extend([Moment::AfterClaim, Moment::ToolCall, Moment::ModelStream]);
    }
    let mut exits: HashMap<Moment, Vec<Duration>> = HashMap::new();
    for (n, moment) in plan.into_iter().enumerate() {
        if n == 3 {
            for i in 0..SESSIONS {
                user_says(&mut rig.client, &session(i), &session(i)).await;
            }
        }
        let id = format!("trial-{n}");
        let mut runner = rig.runner(&id, TTL_MS, &flags);
        match moment {
            Moment::ClaimPoll => {
                wait_log(&runner, "runner started", "", 0).await;
                tokio::time::sleep(Duration::from_millis(fastrand::u64(100..1900))).await;
            }
            Moment::AfterClaim => {
                wait_log(&runner, "claimed", "claiming", 0).await;
                tokio::time::sleep(Duration::from_millis(fastrand::u64(0..30))).await;
            }
            Moment::ToolCall => {
                wait_log(&runner, "running tool", "", 0).await;
                tokio::time::sleep(Duration::from_millis(fastrand::u64(0..200))).await;
            }
            Moment::ModelStream => {
                let mut delta = first_new_event(&rig.client, |e| {
                    matches!(e.kind, Some(Kind::AssistantDelta(_)))
                })
                .await;
                tokio::time::timeout(Duration::from_secs(30), delta.recv())
                    .await
                    .expect("a model stream within 30 s");
            }
        }
        let (status, took) =
            tokio::task::block_in_place(|| runner.terminate_timed(Duration::from_secs(60)));
        assert!(status.success(), "trial {n} ({moment:?}): exit {status}");
        let bound = match moment {
            // Nothing to drain: a long-poll in flight must not hold the exit.
            Moment::ClaimPoll => BUDGET,
            _ => BUDGET + EXIT_MARGIN + SLACK,
        };
        assert!(
            took <= bound,
            "trial {n} ({moment:?}): exited {took:?} after SIGTERM (bound {bound:?}): {:#?}",
            runner.last_lines(12)
        );
        assert_no_lease_of(&mut rig.client, &id, &format!("trial {n} ({moment:?})")).await;
        exits.entry(moment).or_default().push(took);
    }

    let _finisher = rig.runner("finisher", TTL_MS, &[]);
    let mut key_total = 0;
    for i in 0..SESSIONS {
        let events = wait_idle(&mut rig.client, &session(i), 0, Duration::from_secs(90)).await;
        let starts = assert_exactly_once(&events);
        for (call, n) in &starts {
            assert_eq!(
                *n,
                1,
                "{}: {call} started {n} times: {:?}",
                session(i),
                kinds(&events)
            );
        }
        assert_eq!(starts.len(), STEPS, "{}: {:?}", session(i), kinds(&events));
        let keys = key_counts(rig.workspaces.path(), &session(i));
        for id in tool_use_ids(&events) {
            let key = format!("{}/{id}", session(i));
            assert_eq!(keys.get(&key), Some(&1), "{key} ran once: {keys:?}");
        }
        key_total += keys.len();
    }
    assert_eq!(rig.standin.violations(), Vec::<String>::new());
    let shown: Vec<String> = exits
        .iter()
        .map(|(moment, took)| {
            let ms: Vec<u128> = took.iter().map(Duration::as_millis).collect();
            format!("{moment:?} {ms:?} ms")
        })
        .collect();
    println!(
        "DRAIN trials: {}; {key_total} side effects, each once",
        shown.join(", ")
    );
}

/// Unix time in nanoseconds.
fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// The beats `beats.txt` holds in `workspace_root/session`: one line per beat, nanoseconds.
fn beats(workspace_root: &Path, session: &str) -> Vec<u128> {
    std::fs::read_to_string(workspace_root.join(session).join("beats.txt"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().last()?.parse().ok())
        .collect()
}

/// A bash call that beats every 50 ms for about `seconds`, then records its key.
fn beating(seconds: u32) -> serde_json::Value {
    let beats = seconds * 20;
    json!({"command": format!(
        "for i in $(seq {beats}); do date +%s%N >> beats.txt; sleep 0.05; done; \
         echo \"$IDEMPOTENCY_KEY\" >> keys.txt"
    )})
}

#[tokio::test(flavor = "multi_thread")]
async fn a_call_longer_than_the_budget_is_stopped_at_it_and_its_policy_applies() {
    const SESSION: &str = "over-budget";
    let mut rig = Rig::start(vec![
        StandinReply::text("A long call.").tool("bash", beating(8)),
        StandinReply::text("Noted."),
    ])
    .await;
    let budget = Duration::from_secs(1);
    let flag = budget_flag(budget);
    let mut runner = rig.runner("long", TTL_MS, &["--drain-timeout", &flag]);
    user_says(&mut rig.client, SESSION, "go").await;
    wait_log(&runner, "running tool", "", 0).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let signalled = now_ns();
    let (status, took) =
        tokio::task::block_in_place(|| runner.terminate_timed(Duration::from_secs(60)));
    let exited = now_ns();
    assert!(status.success(), "exit {status}");
    assert!(
        took >= budget - Duration::from_millis(100),
        "the call had its budget: exited {took:?} after SIGTERM"
    );
    assert!(
        took <= budget + EXIT_MARGIN + SLACK,
        "exited {took:?} after SIGTERM (budget {budget:?}): {:#?}",
        runner.last_lines(12)
    );
    let ran = beats(rig.workspaces.path(), SESSION);
    let last = *ran.last().expect("the call beat");
    assert!(
        last >= signalled + 800_000_000,
        "the call ran on during the budget"
    );
    assert!(
        last <= exited,
        "the call's processes were gone before the runner exited"
    );
    let events = history(&mut rig.client, SESSION).await;
    assert_eq!(
        kinds(&events),
        vec!["user", "reply(tool_use)", "started(toolu_0_0#1)"],
        "stopped at the budget: started, no result"
    );
    assert_no_lease_of_session(&mut rig.client, SESSION, "long").await;

    // The next runner applies bash's policy as configured: report, never run again.
    let _next = rig.runner("next", TTL_MS, &["--on-unknown-outcome", "bash=report"]);
    let events = wait_idle(&mut rig.client, SESSION, 0, Duration::from_secs(30)).await;
    let (content, is_error) = result_of(&events, "toolu_0_0").expect("a result");
    assert!(
        is_error && content.contains("may or may not have taken effect"),
        "{content}"
    );
    assert_eq!(assert_exactly_once(&events).get("toolu_0_0"), Some(&1));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        beats(rig.workspaces.path(), SESSION).len(),
        ran.len(),
        "never run again"
    );
}

async fn assert_no_lease_of_session(
    client: &mut EventStoreClient<Channel>,
    session: &str,
    owner: &str,
) {
    let info = client
        .get_session(GetSessionRequest {
            session_id: session.into(),
        })
        .await
        .expect("the session")
        .into_inner();
    assert!(
        info.lease.as_ref().is_none_or(|l| l.owner != owner),
        "{owner} kept its lease: {:?}",
        info.lease
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn runners_cut_off_from_the_store_exit_within_the_bound() {
    const SESSION: &str = "cut-during-stop";
    const CUT_TTL_MS: u64 = 3000;
    let store = Store::start().expect("store");
    let proxy = TcpProxy::start(store.addr).await;
    let standin = integration_tests::anthropic_standin::AnthropicStandin::start(vec![
        StandinReply::text("A long call.").tool("bash", beating(10)),
        StandinReply::text("Noted."),
    ])
    .await
    .expect("stand-in");
    let workspaces = tempfile::tempdir().expect("temp dir");
    let mut client = store.client().await.expect("client");
    let budget = Duration::from_secs(5);
    let flag = budget_flag(budget);
    let flags = ["--drain-timeout", flag.as_str()];
    let start = |id: &str| {
        start_runner_with(
            &proxy.url(),
            id,
            workspaces.path(),
            &standin.url(),
            CUT_TTL_MS,
            2,
            &flags,
        )
    };
    let mut busy = start("busy");
    user_says(&mut client, SESSION, "go").await;
    wait_log(&busy, "running tool", "", 0).await;
    // The only session is held: this one long-polls for nothing.
    let mut idle = start("idle");
    wait_log(&idle, "runner started", "", 0).await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    proxy.set_blackhole(true);
    let cut = now_ns();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (idle_exit, busy_exit) = tokio::task::block_in_place(|| {
        std::thread::scope(|scope| {
            let idle = scope.spawn(|| idle.terminate_timed(Duration::from_secs(60)));
            let busy = scope.spawn(|| busy.terminate_timed(Duration::from_secs(60)));
            (
                idle.join().expect("idle runner"),
                busy.join().expect("busy runner"),
            )
        })
    });
    assert!(idle_exit.0.success() && busy_exit.0.success());
    assert!(
        idle_exit.1 <= BUDGET,
        "an idle runner has nothing to drain: it exited {:?} after SIGTERM, its long-poll \
         hanging on the cut connection held it",
        idle_exit.1
    );
    assert!(
        busy_exit.1 <= budget + EXIT_MARGIN + SLACK,
        "the busy runner exited {:?} after SIGTERM (budget {budget:?})",
        busy_exit.1
    );
    // Its last renewal was sent before the cut: the call stopped before the lease could end.
    let last = *beats(workspaces.path(), SESSION)
        .last()
        .expect("the call beat");
    assert!(
        last < cut + u128::from(CUT_TTL_MS) * 1_000_000,
        "the call beat {} ms after the cut, past the lease",
        (last - cut) / 1_000_000
    );
    println!(
        "CUT-OFF STOP: idle runner exited in {:?}, busy in {:?}; its call's last beat {} ms after the cut (ttl {CUT_TTL_MS} ms)",
        idle_exit.1,
        busy_exit.1,
        (last.saturating_sub(cut)) / 1_000_000
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn agentlog_up_drains_its_runner_on_ctrl_c_before_stopping_the_store() {
    const SESSION: &str = "up-drain";
    let tmp = tempfile::tempdir().expect("temp dir");
    let data = tmp.path().join(".agentlog");
    let script = tmp.path().join("slow.jsonl");
    std::fs::write(
        &script,
        format!(
            "{}\n{}\n",
            json!({"text": "One slow step.", "tool_uses": [{"name": "bash", "input": {"command": "sleep 1.5; echo \"$IDEMPOTENCY_KEY\" >> keys.txt"}}]}),
            json!({"text": "Done."})
        ),
    )
    .expect("write the script");
    let model = format!("scripted:{}", script.display());
    let data_arg = data.display().to_string();
    let mut up = CliProc::spawn(&[
        "up",
        "--data-dir",
        &data_arg,
        "--listen",
        "127.0.0.1:0",
        "--model",
        &model,
    ]);
    up.wait_for("agentlog is up at ", Duration::from_secs(60));
    let url = up
        .stdout()
        .split("agentlog is up at ")
        .nth(1)
        .and_then(|rest| rest.split_whitespace().next())
        .expect("the ready line names the address")
        .to_string();
    let mut client = EventStoreClient::connect(url).await.expect("connect");
    user_says(&mut client, SESSION, "go").await;
    wait_for_log(&mut client, SESSION, Duration::from_secs(30), |events| {
        has(events, "started(toolu_0_0#1)")
    })
    .await;
    drop(client);
    signal(up.pid(), Signal::SIGINT);
    let status = tokio::task::block_in_place(|| up.wait_exit(Duration::from_secs(60)));
    assert!(status.success(), "up exits 0: {}", up.stderr());
    assert!(up.stderr().contains("stopped cleanly"), "{}", up.stderr());

    // What the stopped store kept: the drained call's result, and the key written once.
    let store = Store::start_in(&data.join("store")).expect("the store on up's data");
    let mut client = store.client().await.expect("client");
    let events = history(&mut client, SESSION).await;
    let (content, is_error) = result_of(&events, "toolu_0_0").expect("the drained call's result");
    assert!(!is_error, "{content}");
    let keys = key_counts(&data.join("workspaces"), SESSION);
    assert_eq!(
        keys.get(&format!("{SESSION}/toolu_0_0")),
        Some(&1),
        "{keys:?}"
    );
}
