//! What a newer writer sends, against the real `event-store` (either backend:
//! `AGENTLOG_TEST_BACKEND`). The test speaks a newer protocol than the store's, declared
//! here as prost messages: fields the store does not know on the `Event`, inside a kind it
//! knows, inside a content block, and a kind it does not know.
//! - every field survives Append, AppendStream, Subscribe (history and live), a fork and
//!   export → import into another store, byte for byte;
//! - an unknown kind is refused with `FAILED_PRECONDITION`, reason `UNKNOWN_KIND` and its
//!   number in the metadata, on Append and AppendStream alike, and nothing is stored; an
//!   event with no kind at all is `INVALID_ARGUMENT` naming every kind;
//! - every response, a refusal's too, names the store's release in `agentlog-release`.

use std::time::Duration;

use agentlog_proto::reason::{Reason, FIELD_NUMBER};
use agentlog_proto::v1::{
    AcquireLeaseRequest, AppendResponse, AppendStreamResponse, ExportChunk, ExportRequest,
    ForkSessionResponse, GetSessionRequest, ImportChunk, ImportOutcome, ImportResult,
    SubscribeRequest,
};
use futures::StreamExt;
use integration_tests::Store;
use prost::Message;
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::Channel;
use tonic::{Code, Request, Status};
use tonic_prost::ProstCodec;
use tonic_types::StatusExt;

type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

// A later release's messages, as its writers encode them. Field numbers this tree's proto
// does not have: `Event.trace` (1000), `UserMessage.mood` (2), `ContentBlock.image` (9),
// `AssistantMessage.effort` (6), `Usage.reasoning_tokens` (9), and the kind `future` (42).

#[derive(Clone, PartialEq, Message)]
struct NewerEvent {
    #[prost(string, tag = "1")]
    session_id: String,
    #[prost(uint64, tag = "2")]
    seq: u64,
    #[prost(string, tag = "3")]
    event_id: String,
    #[prost(int64, tag = "4")]
    ts_unix_ms: i64,
    #[prost(uint32, tag = "5")]
    schema_version: u32,
    #[prost(string, tag = "1000")]
    trace: String,
    #[prost(oneof = "NewerKind", tags = "10, 11, 42")]
    kind: Option<NewerKind>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum NewerKind {
    #[prost(message, tag = "10")]
    UserMessage(NewerUserMessage),
    #[prost(message, tag = "11")]
    AssistantMessage(NewerAssistantMessage),
    #[prost(message, tag = "42")]
    Future(NewerUserMessage),
}

#[derive(Clone, PartialEq, Message)]
struct NewerUserMessage {
    #[prost(string, tag = "1")]
    text: String,
    #[prost(string, tag = "2")]
    mood: String,
}

#[derive(Clone, PartialEq, Message)]
struct NewerAssistantMessage {
    #[prost(message, repeated, tag = "1")]
    content: Vec<NewerBlock>,
    #[prost(string, tag = "2")]
    stop_reason: String,
    #[prost(message, optional, tag = "4")]
    usage: Option<NewerUsage>,
    #[prost(string, tag = "6")]
    effort: String,
}

#[derive(Clone, PartialEq, Message)]
struct NewerBlock {
    #[prost(oneof = "NewerBlockKind", tags = "1, 9")]
    block: Option<NewerBlockKind>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
enum NewerBlockKind {
    #[prost(message, tag = "1")]
    Text(NewerText),
    #[prost(message, tag = "9")]
    Image(NewerText),
}

#[derive(Clone, PartialEq, Message)]
struct NewerText {
    #[prost(string, tag = "1")]
    text: String,
}

#[derive(Clone, PartialEq, Message)]
struct NewerUsage {
    #[prost(uint64, tag = "1")]
    input_tokens: u64,
    #[prost(uint64, tag = "9")]
    reasoning_tokens: u64,
}

#[derive(Clone, PartialEq, Message)]
struct NewerAppendRequest {
    #[prost(string, tag = "1")]
    session_id: String,
    #[prost(message, repeated, tag = "2")]
    events: Vec<NewerEvent>,
    #[prost(uint64, optional, tag = "4")]
    lease_epoch: Option<u64>,
}

#[derive(Clone, PartialEq, Message)]
struct NewerForkRequest {
    #[prost(string, tag = "1")]
    session_id: String,
    #[prost(uint64, tag = "2")]
    at_seq: u64,
    #[prost(string, tag = "3")]
    new_session_id: String,
    #[prost(message, repeated, tag = "4")]
    events: Vec<NewerEvent>,
}

fn user(id: &str, text: &str) -> NewerEvent {
    NewerEvent {
        event_id: id.into(),
        trace: format!("trace of {id}"),
        kind: Some(NewerKind::UserMessage(NewerUserMessage {
            text: text.into(),
            mood: "curious".into(),
        })),
        ..NewerEvent::default()
    }
}

fn reply(id: &str) -> NewerEvent {
    NewerEvent {
        event_id: id.into(),
        kind: Some(NewerKind::AssistantMessage(NewerAssistantMessage {
            content: vec![
                NewerBlock {
                    block: Some(NewerBlockKind::Text(NewerText {
                        text: "here it is".into(),
                    })),
                },
                NewerBlock {
                    block: Some(NewerBlockKind::Image(NewerText {
                        text: "a picture the store knows nothing of".into(),
                    })),
                },
            ],
            stop_reason: "end_turn".into(),
            usage: Some(NewerUsage {
                input_tokens: 12,
                reasoning_tokens: 34,
            }),
            effort: "high".into(),
        })),
        ..NewerEvent::default()
    }
}

const APPEND: &str = "/agentlog.v1.EventStore/Append";

async fn unary<Req, Resp>(
    channel: &Channel,
    path: &'static str,
    request: Req,
) -> std::result::Result<tonic::Response<Resp>, Status>
where
    Req: Message + Send + Sync + 'static,
    Resp: Message + Default + Send + Sync + 'static,
{
    let mut grpc = tonic::client::Grpc::new(channel.clone());
    grpc.ready()
        .await
        .map_err(|e| Status::unavailable(e.to_string()))?;
    grpc.unary(
        Request::new(request),
        PathAndQuery::from_static(path),
        ProstCodec::<Req, Resp>::default(),
    )
    .await
}

/// The session's log, each event as the newer writer reads it, with its bytes.
async fn read(channel: &Channel, session_id: &str) -> Result<Vec<(NewerEvent, Vec<u8>)>> {
    let mut grpc = tonic::client::Grpc::new(channel.clone());
    grpc.ready().await?;
    let mut stream = grpc
        .server_streaming(
            Request::new(SubscribeRequest {
                session_id: session_id.into(),
                from_seq: 1,
                follow: false,
            }),
            PathAndQuery::from_static("/agentlog.v1.EventStore/Subscribe"),
            ProstCodec::<SubscribeRequest, RawEvent>::default(),
        )
        .await?
        .into_inner();
    let mut events = Vec::new();
    while let Some(raw) = stream.message().await? {
        events.push((NewerEvent::decode(&raw.0[..])?, raw.0));
    }
    Ok(events)
}

/// An event's bytes as they came over the wire.
#[derive(Clone, PartialEq, Default, Debug)]
struct RawEvent(Vec<u8>);

impl Message for RawEvent {
    fn encode_raw(&self, buf: &mut impl bytes::BufMut) {
        buf.put_slice(&self.0);
    }
    /// Takes the message's bytes whole, as they came.
    fn merge(&mut self, mut buf: impl bytes::Buf) -> std::result::Result<(), prost::DecodeError> {
        while buf.has_remaining() {
            let chunk = buf.chunk();
            self.0.extend_from_slice(chunk);
            let n = chunk.len();
            buf.advance(n);
        }
        Ok(())
    }
    fn merge_field(
        &mut self,
        _: u32,
        _: prost::encoding::WireType,
        _: &mut impl bytes::Buf,
        _: prost::encoding::DecodeContext,
    ) -> std::result::Result<(), prost::DecodeError> {
        unreachable!("merge takes the bytes whole")
    }
    fn encoded_len(&self) -> usize {
        self.0.len()
    }
    fn clear(&mut self) {
        self.0.clear();
    }
}

/// `sent` as the store serves it: the same bytes, with the fields the store sets.
fn stored(sent: &NewerEvent, session_id: &str, seq: u64, served: &NewerEvent) -> NewerEvent {
    NewerEvent {
        session_id: session_id.into(),
        seq,
        event_id: served.event_id.clone(),
        ts_unix_ms: served.ts_unix_ms,
        schema_version: served.schema_version,
        ..sent.clone()
    }
}

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
    let store = Store::start()?;
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
    check("history", &read(&channel, "newer").await?, "newer");

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
    let fork_log = read(&channel, "newer-fork").await?;
    assert_eq!(fork_log.len(), 3);
    for (i, (served, _)) in fork_log.iter().enumerate() {
        let sent = [&first, &second, &fork_event][i];
        assert_eq!(
            served,
            &stored(sent, "newer-fork", i as u64 + 1, served),
            "the fork's event {}",
            i + 1
        );
    }

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
    check("imported", &read(&other_channel, "newer").await?, "newer");
    let fork_there = read(&other_channel, "newer-fork").await?;
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
    Ok(())
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
    let refused = unary::<_, AppendResponse>(&channel, APPEND, request.clone())
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
