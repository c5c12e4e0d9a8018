//! `model-standin`: the Anthropic stand-in (`integration-tests/src/anthropic_standin.rs`) as a
//! program of its own, for tests whose runners live in containers and reach the model over
//! a network.
//!
//! ```text
//! model-standin --listen 0.0.0.0:8080 --script replies.jsonl [--api-key-file FILE]
//!               [--faults faults.json] [--fail-model MODEL:KIND[:N]]...
//! ```
//!
//! The script has `scripted:FILE`'s form: one reply per line, `{"text", "tool_uses":
//! [{"name", "input"}], "chunk_delay_ms"}`, chosen by the number of assistant turns in the
//! request (blank lines and `#` lines skipped). With `--api-key-file`, a request must carry
//! that key in `x-api-key` (else the API's 401).
//!
//! Faults are scripted per model (the request's `model` field) from the start with
//! `--faults`, a JSON array of plans as `POST /control/fail` takes them (`{"model", "fault",
//! "calls" | "call" | "for_ms" | "until_unix_ms"}` or `{"model", "faults": [...]}`; the
//! faults as `anthropic_standin::Fault` reads them), or with `--fail-model MODEL:KIND[:N]`:
//! a fault without parameters by name (`overloaded`, `spend_limit`, `error_event`,
//! `cut_stream`, `stall`, `never_starts`, `bad_request`) for the model's next N calls, or
//! every call without N. While it runs, `POST /control/fail`, `/control/heal` and
//! `/control/clock` change them, and `GET /journal` tells what it saw (see
//! `integration-tests/src/standin/control.rs`). It stops on SIGTERM or Ctrl-C.
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Parser;
use integration_tests::anthropic_standin::{AnthropicStandin, Fault, StandinReply};
use integration_tests::standin::{FaultPlan, PlanRequest};
use serde::Deserialize;
use serde_json::{json, Value};

#[derive(Parser)]
#[command(about = "A stand-in for the Anthropic Messages API, replying from a script")]
struct Args {
    /// HOST:PORT to serve on.
    #[arg(long)]
    listen: SocketAddr,
    /// The replies, one JSON object a line.
    #[arg(long)]
    script: PathBuf,
    /// A file holding the one API key requests must carry.
    #[arg(long)]
    api_key_file: Option<PathBuf>,
    /// A JSON array of fault plans, as `POST /control/fail` takes them.
    #[arg(long)]
    faults: Option<PathBuf>,
    /// MODEL:KIND[:N]: the fault KIND (one without parameters) for MODEL's next N calls, or
    /// every call. Repeatable.
    #[arg(long = "fail-model", value_parser = parse_fail_model)]
    fail_model: Vec<(String, FaultPlan<Fault>)>,
}

/// `MODEL:KIND[:N]`, read from the right (a model name may hold a colon).
fn parse_fail_model(text: &str) -> Result<(String, FaultPlan<Fault>), String> {
    let mut parts: Vec<&str> = text.split(':').collect();
    let calls = match parts.last().map(|n| n.parse::<usize>()) {
        Some(Ok(n)) if parts.len() >= 3 => {
            parts.pop();
            Some(n)
        }
        _ => None,
    };
    let (Some(kind), true) = (parts.pop(), !parts.is_empty()) else {
        return Err(format!("expected MODEL:KIND[:N], got {text:?}"));
    };
    let model = parts.join(":");
    // A unit fault is its name; a fault whose fields all have defaults is `{name: {}}`.
    let fault = serde_json::from_value::<Fault>(json!(kind))
        .or_else(|_| serde_json::from_value::<Fault>(json!({ kind: {} })))
        .map_err(|_| {
            format!(
                "{kind:?} is not a fault without parameters (overloaded, spend_limit, \
                 error_event, cut_stream, stall, never_starts, bad_request); give faults \
                 with parameters in --faults"
            )
        })?;
    let plan = match calls {
        Some(n) => FaultPlan::Calls(vec![fault; n]),
        None => FaultPlan::Always(fault),
    };
    Ok((model, plan))
}

fn read_faults(path: &PathBuf) -> Result<Vec<(String, FaultPlan<Fault>)>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the faults {}", path.display()))?;
    let plans: Vec<PlanRequest<Fault>> = serde_json::from_str(&text)
        .with_context(|| format!("{}: a JSON array of fault plans", path.display()))?;
    plans
        .into_iter()
        .enumerate()
        .map(|(i, plan)| {
            plan.plan()
                .map_err(|e| anyhow::anyhow!("{} plan {i}: {e}", path.display()))
        })
        .collect()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ScriptLine {
    #[serde(default)]
    text: String,
    #[serde(default)]
    tool_uses: Vec<ToolUse>,
    #[serde(default)]
    chunk_delay_ms: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ToolUse {
    name: String,
    input: Value,
}

fn read_script(path: &PathBuf) -> Result<Vec<StandinReply>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading the script {}", path.display()))?;
    let mut replies = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let parsed: ScriptLine = serde_json::from_str(line)
            .with_context(|| format!("{} line {}", path.display(), i + 1))?;
        let mut reply = StandinReply::text(&parsed.text).slow(parsed.chunk_delay_ms);
        for call in parsed.tool_uses {
            reply = reply.tool(&call.name, call.input);
        }
        replies.push(reply);
    }
    if replies.is_empty() {
        bail!("the script {} holds no reply", path.display());
    }
    Ok(replies)
}

#[tokio::main]
async fn main() -> Result<()> {
    let args = Args::parse();
    let replies = read_script(&args.script)?;
    let api_key = match &args.api_key_file {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?
                .trim()
                .to_string(),
        ),
        None => None,
    };
    let mut plans = match &args.faults {
        Some(path) => read_faults(path)?,
        None => Vec::new(),
    };
    plans.extend(args.fail_model);
    let standin = AnthropicStandin::start_on(replies, args.listen, api_key).await?;
    for (model, plan) in plans {
        standin.fail_model(&model, plan);
    }
    eprintln!("model-standin: listening on {}", standin.addr);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    Ok(())
}
