//! Resume: how long a runner takes from claiming a session to its first new action, as
//! the session's log grows (the cost of reading and folding it).
//!
//! Each session is built directly with appends (user turn, a reply with a `bash`
//! tool_use, `tool_started`, `tool_result`, a final reply: 5 events per cycle, 300-byte
//! texts), so it ends idle. A `runner` with a scripted model waits in `ClaimSession`. Each
//! resume appends one user turn (the session becomes runnable) and times, from that
//! append's acknowledgement, the first event the runner writes (its first streamed delta)
//! and its durable reply. Three cases per run ([`measure`]): *cold*, a runner process that
//! never worked the session and keeps no snapshots (it reads and folds the whole log), then
//! *warm*, the same runner claiming it again (it keeps the session's fold and reads only the
//! new events), then *cold from a snapshot*, a new runner process with snapshots on (the
//! default): it restores the fold from the snapshot a runner left in the store and reads
//! only the events after it.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::{
    content_block::Block, event, AcquireLeaseRequest, AppendRequest, AssistantMessage,
    ContentBlock, Event, ReleaseLeaseRequest, SubscribeRequest, TextBlock, ToolResult, ToolStarted,
    ToolUseBlock,
};
use anyhow::Context;
use tonic::transport::Channel;

use crate::agentlog::user_event;
use crate::stats::signed_ms;
use crate::stats::Runs;

const EVENTS_PER_CYCLE: usize = 5;

/// Every run of one session size: cold and warm resumes.
#[derive(Debug, Clone, Default)]
pub struct ResumeRow {
    pub size: usize,
    pub cold_first: Runs,
    pub cold_reply: Runs,
    pub warm_first: Runs,
    pub warm_reply: Runs,
    pub snapshot_first: Runs,
    pub snapshot_reply: Runs,
}

/// The runner's default `--snapshot-every`.
const SNAPSHOT_EVERY: u64 = 1000;

/// Builds one idle session per size on the store at `url` and lets a runner with snapshots
/// on answer each once (it leaves a snapshot of every session of 1,000 events or more).
/// Then, `runs` times: starts a fresh runner without snapshots, lets it answer a 10-event
/// session (its start-up, not counted), and resumes each size once cold and once warm; then
/// starts a fresh runner with snapshots and resumes each size once, cold from the snapshot.
pub async fn measure(
    url: &str,
    dir: &Path,
    sizes: &[usize],
    runs: usize,
) -> anyhow::Result<Vec<ResumeRow>> {
    const WARM_UP: &str = "resume-warm-up";
    let max = sizes.iter().copied().max().unwrap_or(0);
    build_session(url, WARM_UP, 10).await?;
    for &size in sizes {
        build_session(url, &format!("resume-{size}"), size).await?;
    }
    let mut rows: Vec<ResumeRow> = sizes
        .iter()
        .map(|&size| ResumeRow {
            size,
            ..ResumeRow::default()
        })
        .collect();
    let resumes = 5 * runs + 2;
    {
        let runner = start_runner(url, dir, max, resumes, SNAPSHOT_EVERY)?;
        for &size in sizes {
            let session = format!("resume-{size}");
            resume_once(url, &session)
                .await
                .context("priming resume (see runner.log in the bench dir)")?;
            wait_released(url, &session).await?;
        }
        drop(runner);
    }
    let sessions: Vec<String> = std::iter::once(WARM_UP.to_string())
        .chain(sizes.iter().map(|size| format!("resume-{size}")))
        .collect();
    for _ in 0..runs {
        // A new process per run: its first claim of each session is cold.
        let runner = start_runner(url, dir, max, resumes, 0)?;
        resume_once(url, WARM_UP)
            .await
            .context("warm-up resume (see runner.log in the bench dir)")?;
        for row in &mut rows {
            let session = format!("resume-{}", row.size);
            for warm in [false, true] {
                tokio::time::sleep(Duration::from_millis(200)).await;
                let r = resume_once(url, &session).await?;
                let (first, reply) = if warm {
                    (&mut row.warm_first, &mut row.warm_reply)
                } else {
                    (&mut row.cold_first, &mut row.cold_reply)
                };
                first.push(r.first_action_ms);
                reply.push(r.reply_ms);
            }
        }
        // The runner lets a session go just after its reply; killing it before then would
        // leave a live lease for the next cold claim to wait out.
        for session in &sessions {
            wait_released(url, session).await?;
        }
        drop(runner);

        let runner = start_runner(url, dir, max, resumes, SNAPSHOT_EVERY)?;
        resume_once(url, WARM_UP)
            .await
            .context("warm-up resume (see runner.log in the bench dir)")?;
        for row in &mut rows {
            tokio::time::sleep(Duration::from_millis(200)).await;
            let r = resume_once(url, &format!("resume-{}", row.size)).await?;
            row.snapshot_first.push(r.first_action_ms);
            row.snapshot_reply.push(r.reply_ms);
        }
        for session in &sessions {
            wait_released(url, session).await?;
        }
        drop(runner);
    }
    Ok(rows)
}

/// Waits until no lease is held on the session.
async fn wait_released(url: &str, session_id: &str) -> anyhow::Result<()> {
    let mut client = EventStoreClient::connect(url.to_string()).await?;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let info = client
            .get_session(agentlog_proto::v1::GetSessionRequest {
                session_id: session_id.into(),
            })
            .await?
            .into_inner();
        if info.lease.is_none() {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the runner still holds {session_id} 30 s after its reply"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// One resume, timed from the acknowledgement of the user turn.
#[derive(Debug, Clone, Copy)]
pub struct ResumeRun {
    pub first_action_ms: f64,
    pub reply_ms: f64,
}

/// A `runner` process; SIGKILLed when dropped.
pub struct Runner(Child);

impl Drop for Runner {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Writes a script long enough for sessions of up to `max_events` events plus `runs`
/// resumes, and starts a runner that works with it, keeping snapshots every
/// `snapshot_every` events (0: none).
pub fn start_runner(
    url: &str,
    dir: &Path,
    max_events: usize,
    runs: usize,
    snapshot_every: u64,
) -> anyhow::Result<Runner> {
    // The scripted model picks its reply by the number of assistant turns so far.
    let replies = 2 * max_events.div_ceil(EVENTS_PER_CYCLE) + runs + 16;
    let script = dir.join("script.jsonl");
    std::fs::write(&script, "{\"text\": \"resumed\"}\n".repeat(replies))?;
    let log = std::fs::File::create(dir.join("runner.log"))?;
    let workspaces = dir.join("workspaces");
    let child = Command::new(testkit::bin_path("runner"))
        .args(["--event-store", url, "--runner-id", "bench-runner"])
        .arg("--workspace-root")
        .arg(&workspaces)
        .arg("--model")
        .arg(format!("scripted:{}", script.display()))
        .args(["--snapshot-every", &snapshot_every.to_string()])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log)
        .spawn()
        .context("spawn runner")?;
    Ok(Runner(child))
}

/// Builds an idle session of at least `events` events (whole cycles).
pub async fn build_session(url: &str, session_id: &str, events: usize) -> anyhow::Result<()> {
    let mut client = EventStoreClient::connect(url.to_string()).await?;
    // The session must exist before a lease can be taken on it.
    client
        .append(AppendRequest {
            session_id: session_id.into(),
            events: vec![user_event(crate::event_text())],
            ..Default::default()
        })
        .await?;
    let lease = client
        .acquire_lease(AcquireLeaseRequest {
            session_id: session_id.into(),
            owner: "bench-builder".into(),
            ttl_ms: 600_000,
        })
        .await?
        .into_inner();
    let cycles = events.div_ceil(EVENTS_PER_CYCLE).max(1);
    let mut batch: Vec<Event> = Vec::new();
    for c in 0..cycles {
        let mut cycle = cycle_events(c);
        if c == 0 {
            cycle.remove(0); // the user turn written above
        }
        batch.extend(cycle);
        if batch.len() >= 995 || c + 1 == cycles {
            client
                .append(AppendRequest {
                    session_id: session_id.into(),
                    events: std::mem::take(&mut batch),
                    lease_epoch: Some(lease.epoch),
                    ..Default::default()
                })
                .await
                .context("append a built cycle")?;
        }
    }
    client
        .release_lease(ReleaseLeaseRequest {
            session_id: session_id.into(),
            owner: "bench-builder".into(),
            epoch: lease.epoch,
        })
        .await?;
    Ok(())
}

/// User turn, a reply calling `bash`, its start and result, the final reply.
fn cycle_events(c: usize) -> Vec<Event> {
    let tool_use_id = format!("toolu_built_{c}");
    let kind = |k| Event {
        kind: Some(k),
        ..Default::default()
    };
    let input = prost_types::Struct {
        fields: [(
            "command".to_string(),
            prost_types::Value {
                kind: Some(prost_types::value::Kind::StringValue("echo built".into())),
            },
        )]
        .into(),
    };
    vec![
        user_event(crate::event_text()),
        kind(event::Kind::AssistantMessage(AssistantMessage {
            content: vec![
                ContentBlock {
                    block: Some(Block::Text(TextBlock {
                        text: "Let me run it.".into(),
                    })),
                },
                ContentBlock {
                    block: Some(Block::ToolUse(ToolUseBlock {
                        id: tool_use_id.clone(),
                        name: "bash".into(),
                        input: Some(input),
                    })),
                },
            ],
            stop_reason: "tool_use".into(),
            model: "scripted".into(),
            ..Default::default()
        })),
        kind(event::Kind::ToolStarted(ToolStarted {
            tool_use_id: tool_use_id.clone(),
            idempotency_key: format!("built/{tool_use_id}"),
            attempt: 1,
        })),
        kind(event::Kind::ToolResult(ToolResult {
            tool_use_id,
            content: crate::event_text(),
            is_error: false,
            workspace_checkpoint: None,
            served_from: None,
        })),
        kind(event::Kind::AssistantMessage(AssistantMessage {
            content: vec![ContentBlock {
                block: Some(Block::Text(TextBlock {
                    text: crate::event_text(),
                })),
            }],
            stop_reason: "end_turn".into(),
            model: "scripted".into(),
            ..Default::default()
        })),
    ]
}

/// Appends a user turn to an idle session and times the runner's answer.
pub async fn resume_once(url: &str, session_id: &str) -> anyhow::Result<ResumeRun> {
    let mut client: EventStoreClient<Channel> = EventStoreClient::connect(url.to_string()).await?;
    let last = client
        .get_session(agentlog_proto::v1::GetSessionRequest {
            session_id: session_id.into(),
        })
        .await?
        .into_inner()
        .last_seq;
    let mut follow = client.clone();
    let mut stream = follow
        .subscribe(SubscribeRequest {
            session_id: session_id.into(),
            from_seq: last + 1,
            follow: true,
        })
        .await?
        .into_inner();
    let user_seq = client
        .append(AppendRequest {
            session_id: session_id.into(),
            events: vec![user_event("and once more, please".into())],
            ..Default::default()
        })
        .await?
        .into_inner()
        .last_seq;
    let acked = Instant::now();
    let mut first_action = None;
    let wait = async {
        while let Some(event) = stream.message().await? {
            if event.seq <= user_seq {
                continue;
            }
            let at = Instant::now();
            first_action.get_or_insert(at);
            if matches!(
                event.kind,
                Some(event::Kind::AssistantMessage(_) | event::Kind::RunError(_))
            ) {
                if let Some(event::Kind::RunError(e)) = event.kind {
                    anyhow::bail!("the runner gave up: {}", e.message);
                }
                return Ok(at);
            }
        }
        anyhow::bail!("the subscription ended before the runner replied")
    };
    let replied = tokio::time::timeout(Duration::from_secs(120), wait)
        .await
        .context("no reply from the runner within 120 s")??;
    let first = first_action.unwrap_or(replied);
    Ok(ResumeRun {
        first_action_ms: signed_ms(acked, first),
        reply_ms: signed_ms(acked, replied),
    })
}
