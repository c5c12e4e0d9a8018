//! `model-standin`: the Anthropic stand-in (`integration-tests/src/anthropic_standin.rs`) as a
//! program of its own, for tests whose runners live in containers and reach the model over
//! a network.
//!
//! ```text
//! model-standin --listen 0.0.0.0:8080 --script replies.jsonl [--api-key-file FILE]
//! ```
//!
//! The script has `scripted:FILE`'s form: one reply per line, `{"text", "tool_uses":
//! [{"name", "input"}], "chunk_delay_ms"}`, chosen by the number of assistant turns in the
//! request (blank lines and `#` lines skipped). With `--api-key-file`, a request must carry
//! that key in `x-api-key` (else the API's 401). `GET /journal` tells what it saw. It stops
//! on SIGTERM or Ctrl-C.
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Parser;
use integration_tests::anthropic_standin::{AnthropicStandin, StandinReply};
use serde::Deserialize;
use serde_json::Value;

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
    let standin = AnthropicStandin::start_on(replies, args.listen, api_key).await?;
    eprintln!("model-standin: listening on {}", standin.addr);
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        _ = term.recv() => {}
        _ = tokio::signal::ctrl_c() => {}
    }
    Ok(())
}
