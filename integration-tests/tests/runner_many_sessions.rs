//! Two runners, many sessions: every session is done exactly once and none is worked by two
//! runners at a time (each turn is asked of the model once, each tool started once).

mod runner_support;

use std::collections::HashMap;
use std::time::Duration;

use integration_tests::anthropic_standin::{AnthropicStandin, StandinReply};
use integration_tests::Store;
use runner_support::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread")]
async fn two_runners_share_many_sessions() {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    let standin = AnthropicStandin::start(vec![
        StandinReply::text("Recording.").tool(
            "bash",
            json!({"command": "echo \"$IDEMPOTENCY_KEY\" >> keys.txt"}),
        ),
        StandinReply::text("Listing.").tool("list_files", json!({})),
        StandinReply::text("Done."),
    ])
    .await
    .expect("stand-in");
    let workspaces = tempfile::tempdir().expect("temp dir");
    let _a = start_runner(
        &store.url(),
        "a",
        workspaces.path(),
        &standin.url(),
        3000,
        3,
    );
    let _b = start_runner(
        &store.url(),
        "b",
        workspaces.path(),
        &standin.url(),
        3000,
        3,
    );

    let sessions: Vec<String> = (0..16).map(|i| format!("many-{i}")).collect();
    for session in &sessions {
        user_says(&mut client, session, session).await;
    }
    for session in &sessions {
        let events = wait_idle(&mut client, session, 0, Duration::from_secs(120)).await;
        let starts = assert_exactly_once(&events);
        assert!(
            starts.values().all(|&n| n == 1),
            "{session}: every call started once: {starts:?}"
        );
        assert_eq!(
            key_counts(workspaces.path(), session)
                .values()
                .sum::<usize>(),
            1
        );
    }
    let mut asked: HashMap<(String, usize), usize> = HashMap::new();
    for request in standin.requests() {
        *asked
            .entry((request.first_user_text, request.turn))
            .or_default() += 1;
    }
    assert_eq!(asked.len(), sessions.len() * 3);
    assert!(
        asked.values().all(|&n| n == 1),
        "each turn asked once: {asked:?}"
    );
    assert_eq!(standin.violations(), Vec::<String>::new());
}
