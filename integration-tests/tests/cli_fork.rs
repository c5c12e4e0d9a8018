//! `agentlog fork` refused by the store, as a user reads it: one wording for the store's
//! refusal whatever its code, and the message as the store wrote it (one space between
//! words, the nearest settled seqs named).

use std::process::{Command, Stdio};

use agentlog_client::json::object_to_struct;
use agentlog_proto::v1::{
    content_block::Block, event::Kind, AcquireLeaseRequest, AppendRequest, AssistantMessage,
    ContentBlock, Event, ToolUseBlock,
};
use integration_tests::{bin_path, user_event, Store};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fork_at_an_unsettled_point_is_refused_in_the_stores_words() {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    client
        .append(AppendRequest {
            session_id: "s".into(),
            events: vec![user_event("u1", "go")],
            ..AppendRequest::default()
        })
        .await
        .expect("a user turn");
    let lease = client
        .acquire_lease(AcquireLeaseRequest {
            session_id: "s".into(),
            owner: "test".into(),
            ttl_ms: 30_000,
        })
        .await
        .expect("a lease")
        .into_inner();
    let call = ContentBlock {
        block: Some(Block::ToolUse(ToolUseBlock {
            id: "t1".into(),
            name: "bash".into(),
            input: Some(object_to_struct(serde_json::Map::new())),
        })),
    };
    client
        .append(AppendRequest {
            session_id: "s".into(),
            events: vec![Event {
                kind: Some(Kind::AssistantMessage(AssistantMessage {
                    content: vec![call],
                    ..AssistantMessage::default()
                })),
                ..Event::default()
            }],
            lease_epoch: Some(lease.epoch),
            ..AppendRequest::default()
        })
        .await
        .expect("a reply with an open call");
    for (at, says) in [
        ("2", "ForkSession: the store refused it: seq 2 of session s is not a settled point: a fork is made after a user message, a final assistant message, an interrupted, or the tool result that answers the last open call, so that no call is left without its result; the nearest settled seq is 1"),
        ("9", "ForkSession: the store refused it: at_seq: 9 is outside session s's log (seqs 1 to 2); name the last seq the fork takes"),
    ] {
        let out = Command::new(bin_path("agentlog"))
            .args(["--addr", &store.url(), "fork", "s", "--at", at])
            .stdin(Stdio::null())
            .output()
            .expect("run agentlog");
        assert!(!out.status.success());
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(stderr.trim(), format!("agentlog: {says}"));
    }
}
