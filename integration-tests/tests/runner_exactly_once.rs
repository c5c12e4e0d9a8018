//! Exactly-once under SIGKILL with the Anthropic provider: the suite of
//! `runner_support::sigkill` (the runner killed at each point of a step and at random
//! moments, restarted each time under a new id), against the strict Anthropic stand-in.

mod runner_support;

use std::path::Path;

use integration_tests::anthropic_standin::{AnthropicStandin, StandinReply};
use integration_tests::standin::RecordedRequest;
use integration_tests::Store;
use runner_support::sigkill::{sigkill_suite, KillModel, TTL_MS};
use runner_support::*;
use serde_json::json;

/// Three steps, each recording its key from bash, then a final reply.
fn script() -> Vec<StandinReply> {
    let mut replies: Vec<StandinReply> = (0..3)
        .map(|i| {
            StandinReply::text(&format!(
                "Step {i}: I am recording the idempotency key in the file now."
            ))
            .slow(10)
            .tool(
                "bash",
                json!({"command": "sleep 0.3; echo \"$IDEMPOTENCY_KEY\" >> keys.txt"}),
            )
        })
        .collect();
    replies.push(StandinReply::text("Every step is done and the keys are recorded.").slow(10));
    replies
}

impl KillModel for AnthropicStandin {
    fn start_runner(&self, store: &Store, id: &str, workspace_root: &Path) -> RunnerProc {
        start_runner(&store.url(), id, workspace_root, &self.url(), TTL_MS, 2)
    }

    fn final_stop_reason(&self) -> &'static str {
        "end_turn"
    }

    fn scripted_calls(&self) -> usize {
        3
    }

    fn requests(&self) -> Vec<RecordedRequest> {
        AnthropicStandin::requests(self)
    }

    fn violations(&self) -> Vec<String> {
        AnthropicStandin::violations(self)
    }
}

async fn standin() -> AnthropicStandin {
    AnthropicStandin::start(script()).await.expect("stand-in")
}

sigkill_suite!(standin);
