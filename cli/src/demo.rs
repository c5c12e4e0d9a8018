//! `agentlog demo`: the point of the system in half a minute. A scripted session makes
//! three bash calls, each with a side effect (its `$IDEMPOTENCY_KEY` appended to a ledger
//! file); the runner is SIGKILLed in the middle of the second call; a new runner takes the
//! session over, re-runs only the interrupted call (same key, attempt 2), and finishes.
//! The evidence printed at the end comes from the log and the workspace, not from the
//! processes' word.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use agentlog_client::log::read_log;
use agentlog_proto::v1::{content_block::Block, event::Kind, Event};
use anyhow::{bail, Context, Result};
use nix::sys::signal::Signal;
use tokio::sync::mpsc;

use crate::follow::{follow, Flow};
use crate::render::{ends_turn, Transcript};
use crate::stack::{start_runner, start_store, LogView, RUNNER_STOP_GRACE, STORE_STOP_GRACE};
use crate::store;

const SESSION: &str = "demo";
const STEPS: usize = 3;
/// The call the first runner is killed in, and how long into it.
const KILL_IN: &str = "toolu_1_0";
const KILL_AFTER: Duration = Duration::from_millis(400);
const LEASE_TTL_MS: &str = "1500";

/// A side effect that honours its idempotency key, as the runner asks of downstreams: a
/// re-run with the same key finds it applied and does nothing.
const LEDGER_COMMAND: &str = "sleep 1; if grep -qxF \"$IDEMPOTENCY_KEY\" ledger.txt 2>/dev/null; \
then echo \"already applied: $IDEMPOTENCY_KEY\"; \
else echo \"$IDEMPOTENCY_KEY\" >> ledger.txt; echo \"applied: $IDEMPOTENCY_KEY\"; fi";

fn script() -> String {
    let mut lines = String::from("# agentlog demo: three side-effecting steps, then a summary\n");
    for step in 1..=STEPS {
        // Each step's command names its step: three identical calls in a row would wait for
        // a person (the runner's --repeat-limit).
        let command = format!("# step {step}\n{LEDGER_COMMAND}");
        let reply = serde_json::json!({
            "text": format!("Step {step} of {STEPS}: applying a side effect to the ledger."),
            "tool_uses": [{"name": "bash", "input": {"command": command}}],
            "chunk_delay_ms": 20,
        });
        lines.push_str(&format!("{reply}\n"));
    }
    let done = serde_json::json!({
        "text": "All three steps are applied. The ledger has one line per step.",
        "chunk_delay_ms": 20,
    });
    lines.push_str(&format!("{done}\n"));
    lines
}

pub async fn demo(keep: Option<PathBuf>) -> Result<()> {
    let tmp;
    let data_dir = match keep {
        Some(dir) => {
            if dir.join("store").exists() {
                bail!(
                    "{} already holds a demo; pass an empty or new directory",
                    dir.display()
                );
            }
            dir
        }
        None => {
            tmp = tempfile::tempdir().context("cannot create a temp dir for the demo")?;
            tmp.path().to_path_buf()
        }
    };
    let workspaces = data_dir.join("workspaces");
    std::fs::create_dir_all(&workspaces)?;
    let script_path = data_dir.join("demo-script.jsonl");
    std::fs::write(&script_path, script())?;
    let model = format!("scripted:{}", script_path.display());
    let runner_args = ["--lease-ttl-ms".to_string(), LEASE_TTL_MS.to_string()];

    say("starting an event store and runner-1 (logs: warnings only)");
    let (mut store_proc, addr) = start_store(
        &data_dir.join("store"),
        "127.0.0.1:0",
        LogView::WarningsOnly,
    )
    .await?;
    let url = format!("http://{addr}");
    let mut first = start_runner(
        &url,
        "runner-1",
        &workspaces,
        &model,
        &runner_args,
        LogView::WarningsOnly,
    )
    .await?;
    let mut client = store::connect(&url).await?;
    client
        .append(agentlog_proto::v1::AppendRequest {
            session_id: SESSION.into(),
            events: vec![Event {
                event_id: "user:demo".into(),
                kind: Some(Kind::UserMessage(agentlog_proto::v1::UserMessage {
                    text: "Apply the three ledger steps.".into(),
                })),
                ..Event::default()
            }],
            ..Default::default()
        })
        .await
        .map_err(|s| store::explain(&url, "Append", s))?;
    say(&format!(
        "session {SESSION:?}: each step runs `{LEDGER_COMMAND}`"
    ));

    let (tx, mut events) = mpsc::unbounded_channel::<Event>();
    let follow_url = url.clone();
    let follower = tokio::spawn(async move {
        follow(&follow_url, SESSION, 1, |event| {
            let _ = tx.send(event.clone());
            Ok(if ends_turn(event) {
                Flow::Stop
            } else {
                Flow::Continue
            })
        })
        .await
    });

    let mut transcript = Transcript::new();
    let mut second = None;
    let mut killed = false;
    let stdout = std::io::stdout();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(90);
    while let Ok(Some(event)) = tokio::time::timeout_at(deadline, events.recv()).await {
        transcript.event(&event, &mut stdout.lock())?;
        let starts_victim = matches!(&event.kind,
            Some(Kind::ToolStarted(s)) if s.tool_use_id == KILL_IN && s.attempt == 1);
        if starts_victim && !killed {
            tokio::time::sleep(KILL_AFTER).await;
            let pid = first.pid().map_or("?".into(), |p| p.to_string());
            first.send(Signal::SIGKILL);
            first.wait().await?;
            killed = true;
            say(&format!(
                "SIGKILL runner-1 (pid {}) {} ms into {KILL_IN}: its tool_started is logged, its result never will be",
                pid,
                KILL_AFTER.as_millis()
            ));
            say("starting runner-2: it claims the session once runner-1's lease lapses");
            second = Some(
                start_runner(
                    &url,
                    "runner-2",
                    &workspaces,
                    &model,
                    &runner_args,
                    LogView::WarningsOnly,
                )
                .await?,
            );
        }
    }
    follower.await??;

    let log = read_log(&mut client, SESSION).await?;
    let ledger =
        std::fs::read_to_string(workspaces.join(SESSION).join("ledger.txt")).unwrap_or_default();
    let ok = evidence(&log, &ledger, killed);

    if let Some(mut second) = second {
        second.stop(RUNNER_STOP_GRACE).await?;
    }
    first.kill9().await;
    store_proc.stop(STORE_STOP_GRACE).await?;
    if !ok {
        bail!("a side effect was not applied exactly once: see the evidence above");
    }
    Ok(())
}

/// Prints what the log and the ledger say about each call; true if all is exactly once.
fn evidence(log: &[Event], ledger: &str, killed: bool) -> bool {
    #[derive(Default)]
    struct Call {
        attempts: Vec<u32>,
        results: usize,
        key: String,
    }
    let mut calls: BTreeMap<String, Call> = BTreeMap::new();
    for event in log {
        match &event.kind {
            Some(Kind::AssistantMessage(m)) => {
                for block in &m.content {
                    if let Some(Block::ToolUse(u)) = &block.block {
                        calls.entry(u.id.clone()).or_default();
                    }
                }
            }
            Some(Kind::ToolStarted(s)) => {
                let call = calls.entry(s.tool_use_id.clone()).or_default();
                call.attempts.push(s.attempt);
                call.key = s.idempotency_key.clone();
            }
            Some(Kind::ToolResult(r)) => {
                calls.entry(r.tool_use_id.clone()).or_default().results += 1
            }
            _ => {}
        }
    }
    let mut entries: BTreeMap<&str, usize> = BTreeMap::new();
    for line in ledger.lines() {
        *entries.entry(line).or_default() += 1;
    }
    println!();
    say("evidence, from the event log and the workspace's ledger.txt");
    println!(
        "  {:<10} {:<18} {:<8} {:<15}",
        "call", "tool_started", "results", "ledger lines"
    );
    let mut ok = killed && calls.len() == STEPS;
    for (id, call) in &calls {
        let applied = entries.get(call.key.as_str()).copied().unwrap_or(0);
        let attempts: Vec<String> = call.attempts.iter().map(|a| format!("#{a}")).collect();
        let note = if call.attempts.len() > 1 {
            "  <- interrupted by the SIGKILL; re-run with the same key"
        } else {
            ""
        };
        println!(
            "  {:<10} {:<18} {:<8} {:<15}{note}",
            id,
            attempts.join(" "),
            call.results,
            applied
        );
        ok &= call.results == 1 && applied == 1;
    }
    println!(
        "  (the killed runner's command may still have finished on its own: the re-run, with the \
         same key, then finds the entry and says \"already applied\")"
    );
    println!("  ledger.txt:");
    for line in ledger.lines() {
        println!("    {line}");
    }
    let replies = log
        .iter()
        .filter(|e| matches!(e.kind, Some(Kind::AssistantMessage(_))))
        .count();
    println!(
        "  the log holds {replies} model replies and {} events",
        log.len()
    );
    if ok {
        say("every side effect was applied exactly once, and the session finished");
    } else if !killed {
        say("the runner was never killed mid-tool (the session went too fast?)");
    }
    ok
}

fn say(text: &str) {
    println!("== {text}");
}
