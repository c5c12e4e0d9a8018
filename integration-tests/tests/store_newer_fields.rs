//! What a newer writer sends, against the real `event-store` (either backend:
//! `AGENTLOG_TEST_BACKEND`). The test speaks a newer protocol than the store's, declared
//! here as prost messages: fields the store does not know on the `Event`, inside a kind it
//! knows, inside a content block, and a kind it does not know.
//! - every field survives Append, AppendStream, Subscribe (history and live), a fork,
//!   export → import into another store, the search index reading the events, and the
//!   parent's deletion under the fork (its prefix materialized: the local log's segments
//!   rewritten, PostgreSQL's rows copied) across a restart, byte for byte;
//! - an unknown kind is refused with `FAILED_PRECONDITION`, reason `UNKNOWN_KIND` and its
//!   number in the metadata, on Append and AppendStream alike, and nothing is stored; an
//!   event with no kind at all is `INVALID_ARGUMENT` naming every kind;
//! - every response, a refusal's too, names the store's release in `agentlog-release`.

use std::time::Duration;

use agentlog_proto::reason::{Reason, FIELD_NUMBER};
use agentlog_proto::v1::{
    AcquireLeaseRequest, AppendResponse, AppendStreamResponse, DeleteSessionRequest, ExportChunk,
    ExportRequest, ForkSessionResponse, GetSessionRequest, ImportChunk, ImportOutcome,
    ImportResult, SearchSessionsRequest, SubscribeRequest,
};
use futures::StreamExt;
use integration_tests::newer::*;
use integration_tests::{test_backend_is_postgres, Store};
use prost::Message;
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::Channel;
use tonic::{Code, Request, Status};
use tonic_prost::ProstCodec;
use tonic_types::StatusExt;

async fn lease(channel: &Channel, session_id: &str) -> Result<u64> {
    let mut client = agentlog_proto::v1::event_store_client::EventStoreClient::new(channel.clone());
    let lease = client
        .acquire_lease(AcquireLeaseRequest {
            session_id: session_id.into(),
            owner: "newer-runner".into(),
            ttl_ms: 60_000,
        })
        .await?
        .into_inner();
    Ok(lease.epoch)
}

async fn export_all(channel: &Channel) -> Result<String> {
    let mut client = agentlog_proto::v1::event_store_client::EventStoreClient::new(channel.clone())
        .max_decoding_message_size(16 << 20);
    let mut stream = client
        .export(ExportRequest {
            session_ids: vec![],
            all: true,
        })
        .await?
        .into_inner();
    let mut text = String::new();
    while let Some(ExportChunk { text: piece }) = stream.message().await? {
        text.push_str(&piece);
    }
    Ok(text)
}

async fn import(channel: &Channel, text: &str) -> Result<Vec<ImportResult>> {
    let mut client = agentlog_proto::v1::event_store_client::EventStoreClient::new(channel.clone());
    let chunks = vec![ImportChunk { text: text.into() }];
    let mut results = client
        .import(tokio_stream::iter(chunks))
        .await?
        .into_inner();
    let mut all = Vec::new();
    while let Some(result) = results.message().await? {
        all.push(result);
    }
    Ok(all)
}

#[tokio::test]
async fn a_newer_writers_fields_survive_every_path_byte_for_byte() -> Result<()> {
    // Deleted sessions' records leave the local log soon after the deletion.
    let mut store = Store::start_with(&["--reclaim-after", "100ms"])?;
    let channel = Channel::from_shared(store.url())?.connect().await?;

    // A follower from the start sees the live path.
    let mut live_client =
        agentlog_proto::v1::event_store_client::EventStoreClient::new(channel.clone());
    let mut live = live_client
        .subscribe(SubscribeRequest {
            session_id: "newer".into(),
            from_seq: 1,
            follow: true,
        })
        .await?
        .into_inner();

    // Unary Append: a user turn, then (under a lease) a reply.
    let first = user("u1", "hello");
    let answer: AppendResponse = unary(
        &channel,
        None,
        APPEND,
        NewerAppendRequest {
            session_id: "newer".into(),
            events: vec![first.clone()],
            lease_epoch: None,
        },
    )
    .await?
    .into_inner();
    assert_eq!(answer.seqs, [1]);
    let epoch = lease(&channel, "newer").await?;
    let second = reply("reply:0");
    unary::<_, AppendResponse>(
        &channel,
        None,
        APPEND,
        NewerAppendRequest {
            session_id: "newer".into(),
            events: vec![second.clone()],
            lease_epoch: Some(epoch),
        },
    )
    .await?;

    // AppendStream: one more user turn.
    let third = user("u2", "and then");
    let mut grpc = tonic::client::Grpc::new(channel.clone());
    grpc.ready().await?;
    let mut answers = grpc
        .streaming(
            Request::new(tokio_stream::iter([NewerAppendRequest {
                session_id: "newer".into(),
                events: vec![third.clone()],
                lease_epoch: None,
            }])),
            PathAndQuery::from_static("/agentlog.v1.EventStore/AppendStream"),
            ProstCodec::<NewerAppendRequest, AppendStreamResponse>::default(),
        )
        .await?
        .into_inner();
    let streamed = answers.message().await?.expect("an answer");
    assert!(
        matches!(
            streamed.result,
            Some(agentlog_proto::v1::append_stream_response::Result::Response(ref r)) if r.seqs == [3]
        ),
        "{streamed:?}"
    );

    let sent = [&first, &second, &third];
    let check = |what: &str, log: &[(NewerEvent, Vec<u8>)], session_id: &str| {
        assert_eq!(log.len(), sent.len(), "{what}: the whole log");
        for (i, ((served, bytes), sent)) in log.iter().zip(sent).enumerate() {
            let expected = stored(sent, session_id, i as u64 + 1, served);
            assert_eq!(
                served,
                &expected,
                "{what}: event {} as a newer reader reads it",
                i + 1
            );
            assert_eq!(
                bytes,
                &expected.encode_to_vec(),
                "{what}: event {} byte for byte",
                i + 1
            );
        }
    };
    check("history", &read(&channel, None, "newer").await?, "newer");

    // The live follower got the same bytes (a decoder of this tree's proto keeps what it
    // knows; the newer fields are checked through the history above and the bytes here).
    for i in 1..=3u64 {
        let event = tokio::time::timeout(Duration::from_secs(10), live.message())
            .await??
            .expect("a live event");
        assert_eq!(event.seq, i);
    }

    // A fork keeps the parent's prefix as it was, and its own new event's fields.
    let fork_event = user("f1", "instead");
    let forked: ForkSessionResponse = unary(
        &channel,
        None,
        "/agentlog.v1.EventStore/ForkSession",
        NewerForkRequest {
            session_id: "newer".into(),
            at_seq: 2,
            new_session_id: "newer-fork".into(),
            events: vec![fork_event.clone()],
        },
    )
    .await?
    .into_inner();
    assert_eq!(forked.last_seq, 3);
    let check_fork = |what: &str, log: &[(NewerEvent, Vec<u8>)]| {
        assert_eq!(log.len(), 3, "{what}: the whole fork");
        for (i, (served, bytes)) in log.iter().enumerate() {
            let sent = [&first, &second, &fork_event][i];
            let expected = stored(sent, "newer-fork", i as u64 + 1, served);
            assert_eq!(served, &expected, "{what}: the fork's event {}", i + 1);
            assert_eq!(
                bytes,
                &expected.encode_to_vec(),
                "{what}: the fork's event {} byte for byte",
                i + 1
            );
        }
    };
    let fork_log = read(&channel, None, "newer-fork").await?;
    check_fork("the fork", &fork_log);

    // Export → import into another store, and back into this one.
    let text = export_all(&channel).await?;
    assert!(text.contains("\"unknownFields\""), "{text}");
    let other = Store::start()?;
    let other_channel = Channel::from_shared(other.url())?.connect().await?;
    let results = import(&other_channel, &text).await?;
    assert!(
        results
            .iter()
            .all(|r| r.outcome == ImportOutcome::Imported as i32),
        "{results:?}"
    );
    check(
        "imported",
        &read(&other_channel, None, "newer").await?,
        "newer",
    );
    let fork_there = read(&other_channel, None, "newer-fork").await?;
    let fork_here: Vec<_> = fork_log.iter().map(|(e, _)| e.clone()).collect();
    let fork_there: Vec<_> = fork_there.into_iter().map(|(e, _)| e).collect();
    assert_eq!(fork_there, fork_here, "the imported fork");
    for (store, channel) in [
        ("the other store", &other_channel),
        ("this store", &channel),
    ] {
        let again = import(channel, &text).await?;
        assert!(
            again
                .iter()
                .all(|r| r.outcome == ImportOutcome::Unchanged as i32),
            "{store}: importing the same export again changes nothing: {again:?}"
        );
    }

    // The search index reads the newer events as any other: their words are found.
    let mut client = store.client().await?;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    loop {
        let hits = client
            .search_sessions(SearchSessionsRequest {
                query: "instead".into(),
                ..SearchSessionsRequest::default()
            })
            .await?
            .into_inner()
            .hits;
        if hits
            .iter()
            .any(|h| h.session_id == "newer-fork" && h.seq == 3)
        {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the fork's newer event is not found by its words: {hits:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The parent deleted: the fork's prefix is made its own (the local log rewrites the
    // parent's records out of its segments, and the parent's last event, past the fork
    // point, leaves the disk; PostgreSQL copies the rows in the deletion), and what the
    // fork serves is still what was sent, after a restart too.
    let log_dir = store.data_dir.join("log");
    let local = !test_backend_is_postgres();
    assert!(
        !local || holds(&log_dir, b"and then"),
        "the parent's last event is in the log"
    );
    client
        .delete_session(DeleteSessionRequest {
            session_id: "newer".into(),
        })
        .await?;
    if local {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
        while holds(&log_dir, b"and then") {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the deleted parent's records are still in the log"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    check_fork(
        "the fork after its parent's deletion",
        &read(&channel, None, "newer-fork").await?,
    );
    store.kill9();
    let store = store.restart()?;
    let channel = Channel::from_shared(store.url())?.connect().await?;
    check_fork(
        "the fork after a restart",
        &read(&channel, None, "newer-fork").await?,
    );
    Ok(())
}

/// Whether any file under `dir` holds `needle`.
fn holds(dir: &std::path::Path, needle: &[u8]) -> bool {
    std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .any(|e| {
            let path = e.path();
            if path.is_dir() {
                holds(&path, needle)
            } else {
                std::fs::read(&path).is_ok_and(|b| b.windows(needle.len()).any(|w| w == needle))
            }
        })
}

#[tokio::test]
async fn a_kind_the_store_does_not_know_is_refused_for_now_with_its_number() -> Result<()> {
    let store = Store::start()?;
    let channel = Channel::from_shared(store.url())?.connect().await?;
    let future = NewerEvent {
        event_id: "f".into(),
        kind: Some(NewerKind::Future(NewerUserMessage {
            text: "a kind from a later release".into(),
            mood: String::new(),
        })),
        ..NewerEvent::default()
    };
    let request = NewerAppendRequest {
        session_id: "future".into(),
        events: vec![user("u1", "first"), future.clone()],
        lease_epoch: None,
    };
    let refused = unary::<_, AppendResponse>(&channel, None, APPEND, request.clone())
        .await
        .expect_err("refused");
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert_eq!(Reason::of(&refused), Some(Reason::UnknownKind));
    let info = refused.get_details_error_info().expect("an ErrorInfo");
    assert_eq!(
        info.metadata.get(FIELD_NUMBER).map(String::as_str),
        Some("42")
    );
    assert!(refused.message().contains("42"), "{}", refused.message());

    // The same refusal on AppendStream, metadata included.
    let mut grpc = tonic::client::Grpc::new(channel.clone());
    grpc.ready().await?;
    let mut answers = grpc
        .streaming(
            Request::new(tokio_stream::iter([request])),
            PathAndQuery::from_static("/agentlog.v1.EventStore/AppendStream"),
            ProstCodec::<NewerAppendRequest, AppendStreamResponse>::default(),
        )
        .await?
        .into_inner();
    let answer = answers.message().await?.expect("an answer");
    let Some(agentlog_proto::v1::append_stream_response::Result::Error(error)) = answer.result
    else {
        panic!("refused on the stream too: {answer:?}");
    };
    let status = Status::from(error);
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert_eq!(Reason::of(&status), Some(Reason::UnknownKind));
    assert_eq!(
        status
            .get_details_error_info()
            .and_then(|i| i.metadata.get(FIELD_NUMBER).cloned())
            .as_deref(),
        Some("42")
    );

    // Nothing of either request was stored.
    let mut client = agentlog_proto::v1::event_store_client::EventStoreClient::new(channel.clone());
    let missing = client
        .get_session(GetSessionRequest {
            session_id: "future".into(),
        })
        .await
        .expect_err("no session");
    assert_eq!(missing.code(), Code::NotFound);

    // An event with no kind at all is a malformed request, and the refusal names every kind.
    let no_kind = NewerEvent {
        event_id: "none".into(),
        ..NewerEvent::default()
    };
    let refused = unary::<_, AppendResponse>(
        &channel,
        None,
        APPEND,
        NewerAppendRequest {
            session_id: "future".into(),
            events: vec![no_kind],
            lease_epoch: None,
        },
    )
    .await
    .expect_err("refused");
    assert_eq!(refused.code(), Code::InvalidArgument);
    for kind in [
        "user_message",
        "assistant_message",
        "tool_started",
        "tool_result",
        "assistant_delta",
        "run_error",
        "interrupt",
        "interrupted",
        "approval_requested",
        "approval_decision",
        "session_config",
    ] {
        assert!(refused.message().contains(kind), "{}", refused.message());
    }
    Ok(())
}

#[tokio::test]
async fn every_response_names_the_stores_release() -> Result<()> {
    let store = Store::start()?;
    let mut client = store.client().await?;
    let release = agentlog_proto::release::VERSION;
    let appended = client
        .append(agentlog_proto::v1::AppendRequest {
            session_id: "r".into(),
            events: vec![agentlog_proto::v1::Event {
                kind: Some(agentlog_proto::v1::event::Kind::UserMessage(
                    agentlog_proto::v1::UserMessage { text: "hi".into() },
                )),
                ..Default::default()
            }],
            ..Default::default()
        })
        .await?;
    let header = |m: &tonic::metadata::MetadataMap| {
        m.get(agentlog_proto::release::HEADER)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    assert_eq!(header(appended.metadata()).as_deref(), Some(release));
    let refused = client
        .get_session(GetSessionRequest {
            session_id: "absent".into(),
        })
        .await
        .expect_err("not found");
    assert_eq!(
        header(refused.metadata()).as_deref(),
        Some(release),
        "{refused:?}"
    );
    let mut follow = client
        .subscribe(SubscribeRequest {
            session_id: "r".into(),
            from_seq: 1,
            follow: false,
        })
        .await?;
    assert_eq!(header(follow.metadata()).as_deref(), Some(release));
    while follow.get_mut().next().await.transpose()?.is_some() {}
    Ok(())
}
