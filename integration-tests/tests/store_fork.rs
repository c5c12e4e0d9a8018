//! ForkSession against the real `event-store` (either backend: `AGENTLOG_TEST_BACKEND`):
//! the fork's log is the parent's prefix, ids, times and contents kept, then the request's
//! events, in one step; only settled points are accepted, and a refusal names the nearest;
//! an existing id is refused; the fork is a session of its own from then on, across a
//! restart of the store (SIGKILL) too.

use agentlog_proto::reason::Reason;
use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::{
    content_block::Block, event, AcquireLeaseRequest, AppendRequest, AssistantMessage,
    ContentBlock, Event, ForkSessionRequest, GetSessionRequest, SessionStatus, TextBlock,
    ToolResult, ToolStarted, ToolUseBlock, UserMessage,
};
use integration_tests::{grpcurl, read_log, Store};
use serde_json::json;
use tonic::transport::Channel;

type Client = EventStoreClient<Channel>;

fn user(id: &str, text: &str) -> Event {
    Event {
        event_id: id.into(),
        kind: Some(event::Kind::UserMessage(UserMessage { text: text.into() })),
        ..Event::default()
    }
}

fn runner_event(id: &str, kind: event::Kind) -> Event {
    Event {
        event_id: id.into(),
        kind: Some(kind),
        ..Event::default()
    }
}

fn reply(calls: &[&str], text: &str) -> event::Kind {
    let mut content: Vec<ContentBlock> = calls
        .iter()
        .map(|id| ContentBlock {
            block: Some(Block::ToolUse(ToolUseBlock {
                id: (*id).into(),
                name: "bash".into(),
                input: None,
            })),
        })
        .collect();
    if !text.is_empty() {
        content.push(ContentBlock {
            block: Some(Block::Text(TextBlock { text: text.into() })),
        });
    }
    event::Kind::AssistantMessage(AssistantMessage {
        content,
        stop_reason: if calls.is_empty() {
            "end_turn"
        } else {
            "tool_use"
        }
        .into(),
        ..AssistantMessage::default()
    })
}

async fn append(client: &mut Client, session: &str, events: Vec<Event>, epoch: Option<u64>) {
    client
        .append(AppendRequest {
            session_id: session.into(),
            events,
            lease_epoch: epoch,
            ..AppendRequest::default()
        })
        .await
        .expect("append");
}

/// user(1), reply with calls a, b(2), started a(3), result a(4), started b(5), result b(6),
/// final reply(7), user(8). Settled: 1, 6, 7, 8.
async fn parent(client: &mut Client, session: &str) {
    append(client, session, vec![user("u1", "first")], None).await;
    let epoch = client
        .acquire_lease(AcquireLeaseRequest {
            session_id: session.into(),
            owner: "test".into(),
            ttl_ms: 60_000,
        })
        .await
        .expect("lease")
        .into_inner()
        .epoch;
    let started = |id: &str| {
        event::Kind::ToolStarted(ToolStarted {
            tool_use_id: id.into(),
            idempotency_key: format!("{session}/{id}"),
            attempt: 1,
        })
    };
    let result = |id: &str| {
        event::Kind::ToolResult(ToolResult {
            tool_use_id: id.into(),
            content: format!("ran {id}"),
            is_error: false,
            workspace_checkpoint: Some(format!("{id:0>64}")),
            served_from: None,
        })
    };
    for (id, kind) in [
        ("reply:0", reply(&["a", "b"], "")),
        ("started:a", started("a")),
        ("result:a", result("a")),
        ("started:b", started("b")),
        ("result:b", result("b")),
        ("reply:1", reply(&[], "done")),
    ] {
        append(client, session, vec![runner_event(id, kind)], Some(epoch)).await;
    }
    append(client, session, vec![user("u2", "second")], None).await;
}

async fn fork(
    client: &mut Client,
    parent: &str,
    at_seq: u64,
    new_id: &str,
    events: Vec<Event>,
) -> Result<(String, u64), tonic::Status> {
    client
        .fork_session(ForkSessionRequest {
            session_id: parent.into(),
            at_seq,
            new_session_id: new_id.into(),
            events,
        })
        .await
        .map(|r| {
            let r = r.into_inner();
            (r.session_id, r.last_seq)
        })
}

/// The event with its session id cleared: what a fork keeps of its parent's.
fn content(event: &Event) -> Event {
    Event {
        session_id: String::new(),
        ..event.clone()
    }
}

#[tokio::test]
async fn a_fork_at_each_settled_point_holds_the_parents_prefix_as_it_was() {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    parent(&mut client, "p").await;
    let log = read_log(&mut client, "p").await;
    assert_eq!(log.len(), 8);
    for at in [1u64, 6, 7, 8] {
        let id = format!("p-at-{at}");
        let (made, last_seq) = fork(&mut client, "p", at, &id, vec![]).await.expect("fork");
        assert_eq!((made.as_str(), last_seq), (id.as_str(), at));
        let copied = read_log(&mut client, &id).await;
        assert!(copied.iter().all(|e| e.session_id == id));
        let copied: Vec<Event> = copied.iter().map(content).collect();
        let prefix: Vec<Event> = log[..at as usize].iter().map(content).collect();
        assert_eq!(copied, prefix, "fork at {at}");
        let info = client
            .get_session(GetSessionRequest {
                session_id: id.clone(),
            })
            .await
            .expect("get")
            .into_inner();
        let from = info.forked_from.clone().expect("forked_from");
        assert_eq!((from.session_id.as_str(), from.seq), ("p", at));
        assert_eq!(info.title, "first");
        let expected = if at == 7 {
            SessionStatus::Idle
        } else {
            SessionStatus::Runnable
        };
        assert_eq!(info.status(), expected, "fork at {at}");
    }
    // The parent is no fork.
    let info = client
        .get_session(GetSessionRequest {
            session_id: "p".into(),
        })
        .await
        .expect("get")
        .into_inner();
    assert_eq!(info.forked_from, None);
}

#[tokio::test]
async fn a_fork_is_refused_where_a_call_would_be_left_open_or_the_id_exists() {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    parent(&mut client, "p").await;
    for (at, nearest) in [(2, "are 1 and 6"), (4, "are 1 and 6"), (5, "are 1 and 6")] {
        let refused = fork(&mut client, "p", at, &format!("f{at}"), vec![])
            .await
            .expect_err("unsettled");
        assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
        assert_eq!(Reason::of(&refused), Some(Reason::ForkPointUnsettled));
        assert!(refused.message().contains(nearest), "{}", refused.message());
        // Nothing was made.
        assert!(read_log(&mut client, &format!("f{at}")).await.is_empty());
    }
    for at in [0, 9] {
        let refused = fork(&mut client, "p", at, "f", vec![])
            .await
            .expect_err("outside");
        assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    }
    let missing = fork(&mut client, "nobody", 1, "f", vec![])
        .await
        .expect_err("no parent");
    assert_eq!(missing.code(), tonic::Code::NotFound);
    append(&mut client, "taken", vec![user("t", "mine")], None).await;
    for existing in ["taken", "p"] {
        let refused = fork(&mut client, "p", 1, existing, vec![])
            .await
            .expect_err("exists");
        assert_eq!(refused.code(), tonic::Code::AlreadyExists);
        assert_eq!(Reason::of(&refused), Some(Reason::SessionExists));
    }
    assert_eq!(read_log(&mut client, "taken").await.len(), 1);
    // A runner's kind among the new events needs a lease, which a fork never has.
    let refused = fork(
        &mut client,
        "p",
        1,
        "f-runner-kind",
        vec![runner_event("x", reply(&[], "forged"))],
    )
    .await
    .expect_err("runner kind");
    assert_eq!(Reason::of(&refused), Some(Reason::LeaseRequired));
    let bad = fork(&mut client, "p", 1, "bad id!", vec![])
        .await
        .expect_err("bad id");
    assert_eq!(bad.code(), tonic::Code::InvalidArgument);
    assert!(
        bad.message().contains("new_session_id"),
        "{}",
        bad.message()
    );
}

#[tokio::test]
async fn edit_and_resend_then_forks_of_forks_each_go_their_own_way() {
    let mut store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    parent(&mut client, "p").await;
    // Edit and resend the second message: fork before it, the new text in its place.
    let (edited, last) = fork(
        &mut client,
        "p",
        7,
        "p-edit",
        vec![user("u2-edited", "second, edited")],
    )
    .await
    .expect("fork");
    assert_eq!((edited.as_str(), last), ("p-edit", 8));
    // Made by the store when no id is given.
    let (made, _) = fork(&mut client, "p-edit", 8, "", vec![])
        .await
        .expect("fork");
    assert!(made.starts_with("fork-"), "{made}");
    let (grandchild, _) = fork(&mut client, &made, 1, "g", vec![])
        .await
        .expect("fork of a fork");

    // Each goes on alone.
    append(&mut client, "p", vec![user("u3", "parent only")], None).await;
    append(&mut client, &made, vec![user("u3", "fork only")], None).await;
    let texts = |events: Vec<Event>| -> Vec<String> {
        events
            .into_iter()
            .filter_map(|e| match e.kind {
                Some(event::Kind::UserMessage(m)) => Some(m.text),
                _ => None,
            })
            .collect()
    };
    let parent_texts = vec!["first", "second", "parent only"];
    let edited_texts = vec!["first", "second, edited"];
    let made_texts = vec!["first", "second, edited", "fork only"];
    assert_eq!(texts(read_log(&mut client, "p").await), parent_texts);
    assert_eq!(texts(read_log(&mut client, "p-edit").await), edited_texts);
    assert_eq!(texts(read_log(&mut client, &made).await), made_texts);
    assert_eq!(
        texts(read_log(&mut client, &grandchild).await),
        vec!["first"]
    );

    // A fork survives a SIGKILL of the store whole, with where it came from.
    let before = read_log(&mut client, &made).await;
    store.kill9();
    let store = store.restart().expect("restart");
    let mut client = store.client().await.expect("client");
    assert_eq!(read_log(&mut client, &made).await, before);
    let info = client
        .get_session(GetSessionRequest {
            session_id: made.clone(),
        })
        .await
        .expect("get")
        .into_inner();
    let from = info.forked_from.expect("forked_from survives");
    assert_eq!((from.session_id.as_str(), from.seq), ("p-edit", 8));
}

#[test]
fn grpcurl_forks_as_the_contract_spells_it() {
    let store = Store::start().expect("store");
    grpcurl(
        store.addr,
        "agentlog.v1.EventStore/Append",
        Some(
            &json!({"session_id": "g1", "events": [{"user_message": {"text": "hi"}}]}).to_string(),
        ),
    );
    let out = grpcurl(
        store.addr,
        "agentlog.v1.EventStore/ForkSession",
        Some(
            &json!({"session_id": "g1", "at_seq": 1, "new_session_id": "g2",
                    "events": [{"user_message": {"text": "hello instead"}}]})
            .to_string(),
        ),
    )
    .json();
    assert_eq!(out["sessionId"], "g2");
    assert_eq!(out["lastSeq"], "2");
}

#[tokio::test]
async fn a_follower_waiting_for_the_fork_gets_its_whole_log_live() {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    parent(&mut client, "p").await;
    let mut live = client
        .subscribe(agentlog_proto::v1::SubscribeRequest {
            session_id: "f-live".into(),
            from_seq: 1,
            follow: true,
        })
        .await
        .expect("follow a session that does not exist yet")
        .into_inner();
    // The follow is registered before the fork exists.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    fork(&mut client, "p", 8, "f-live", vec![user("u3", "third")])
        .await
        .expect("fork");
    let parent_log = read_log(&mut client, "p").await;
    let mut seen = Vec::new();
    while seen.len() < 9 {
        let event = tokio::time::timeout(std::time::Duration::from_secs(10), live.message())
            .await
            .expect("the fork's events arrive")
            .expect("stream")
            .expect("an event");
        seen.push(event);
    }
    assert!(seen.iter().all(|e| e.session_id == "f-live"));
    assert_eq!(
        seen[..8].iter().map(content).collect::<Vec<_>>(),
        parent_log.iter().map(content).collect::<Vec<_>>()
    );
    assert_eq!(seen[8].seq, 9);
}
