//! Zombie: a runner stopped with SIGSTOP past its lease while another takes over, then
//! resumed with SIGCONT, gets no write into the log and runs no tool.

mod runner_support;

use std::time::Duration;

use agentlog_proto::v1::event::Kind;
use integration_tests::anthropic_standin::{AnthropicStandin, StandinReply};
use integration_tests::{Signal, Store};
use runner_support::*;
use serde_json::json;

#[tokio::test(flavor = "multi_thread")]
async fn a_paused_runner_wakes_up_fenced_out() {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    let standin = AnthropicStandin::start(vec![
        StandinReply::text("one two three four five six seven eight nine ten eleven twelve")
            .slow(100)
            .tool(
                "bash",
                json!({"command": "echo \"$IDEMPOTENCY_KEY\" >> keys.txt"}),
            ),
        StandinReply::text("Done."),
    ])
    .await
    .expect("stand-in");
    let workspaces = tempfile::tempdir().expect("temp dir");
    let session = "zombie".to_string();
    let mut zombie = start_runner(
        &store.url(),
        "zombie",
        workspaces.path(),
        &standin.url(),
        1500,
        2,
    );
    user_says(&mut client, &session, &session).await;

    // Freeze the first runner mid-stream, before it could start the tool.
    let mut stream = client
        .subscribe(agentlog_proto::v1::SubscribeRequest {
            session_id: session.clone(),
            from_seq: 1,
            follow: true,
        })
        .await
        .expect("subscribe")
        .into_inner();
    while let Some(Ok(event)) = tokio_stream::StreamExt::next(&mut stream).await {
        if matches!(event.kind, Some(Kind::AssistantDelta(_))) {
            zombie.signal(Signal::SIGSTOP);
            break;
        }
    }
    tokio::time::sleep(Duration::from_millis(2500)).await; // past its 1.5 s lease

    let mut successor = start_runner(
        &store.url(),
        "successor",
        workspaces.path(),
        &standin.url(),
        1500,
        2,
    );
    let finished = wait_idle(&mut client, &session, 0, Duration::from_secs(30)).await;
    assert_exactly_once(&finished);
    let keys_before = key_counts(workspaces.path(), &session);
    assert_eq!(keys_before.values().sum::<usize>(), 1);
    successor.kill9();

    zombie.signal(Signal::SIGCONT);
    tokio::time::sleep(Duration::from_secs(4)).await;
    let after = history(&mut client, &session).await;
    assert_eq!(after, finished, "the woken runner wrote nothing");
    assert_eq!(
        key_counts(workspaces.path(), &session),
        keys_before,
        "and ran no tool"
    );
    assert!(zombie.is_running(), "losing a lease is not a crash");
    assert!(zombie.terminate().success());
    assert_eq!(standin.violations(), Vec::<String>::new());
}
