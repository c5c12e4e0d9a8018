//! A later release's writer, for the tests of what this build of the store does with
//! fields it does not know: that release's messages declared here as prost messages (fields
//! and a kind this tree's proto lacks), sent and read over the store's own RPCs, and each
//! served event's bytes as they came over the wire.

use prost::Message;
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::Channel;
use tonic::{Request, Status};
use tonic_prost::ProstCodec;

use agentlog_proto::v1::SubscribeRequest;

pub type Result<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// `request` with the bearer `token`, if any.
fn authorized<T>(mut request: Request<T>, token: Option<&str>) -> Request<T> {
    if let Some(token) = token {
        let value = format!("Bearer {token}").parse().expect("a token is ASCII");
        request.metadata_mut().insert("authorization", value);
    }
    request
}

// A later release's messages, as its writers encode them. Field numbers this tree's proto
// does not have: `Event.trace` (1000), `UserMessage.mood` (2), `ContentBlock.image` (9),
// `AssistantMessage.effort` (6), `Usage.reasoning_tokens` (9), and the kind `future` (42).

#[derive(Clone, PartialEq, Message)]
pub struct NewerEvent {
    #[prost(string, tag = "1")]
    pub session_id: String,
    #[prost(uint64, tag = "2")]
    pub seq: u64,
    #[prost(string, tag = "3")]
    pub event_id: String,
    #[prost(int64, tag = "4")]
    pub ts_unix_ms: i64,
    #[prost(uint32, tag = "5")]
    pub schema_version: u32,
    #[prost(string, tag = "1000")]
    pub trace: String,
    #[prost(oneof = "NewerKind", tags = "10, 11, 42")]
    pub kind: Option<NewerKind>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum NewerKind {
    #[prost(message, tag = "10")]
    UserMessage(NewerUserMessage),
    #[prost(message, tag = "11")]
    AssistantMessage(NewerAssistantMessage),
    #[prost(message, tag = "42")]
    Future(NewerUserMessage),
}

#[derive(Clone, PartialEq, Message)]
pub struct NewerUserMessage {
    #[prost(string, tag = "1")]
    pub text: String,
    #[prost(string, tag = "2")]
    pub mood: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct NewerAssistantMessage {
    #[prost(message, repeated, tag = "1")]
    pub content: Vec<NewerBlock>,
    #[prost(string, tag = "2")]
    pub stop_reason: String,
    #[prost(message, optional, tag = "4")]
    pub usage: Option<NewerUsage>,
    #[prost(string, tag = "6")]
    pub effort: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct NewerBlock {
    #[prost(oneof = "NewerBlockKind", tags = "1, 9")]
    pub block: Option<NewerBlockKind>,
}

#[derive(Clone, PartialEq, prost::Oneof)]
pub enum NewerBlockKind {
    #[prost(message, tag = "1")]
    Text(NewerText),
    #[prost(message, tag = "9")]
    Image(NewerText),
}

#[derive(Clone, PartialEq, Message)]
pub struct NewerText {
    #[prost(string, tag = "1")]
    pub text: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct NewerUsage {
    #[prost(uint64, tag = "1")]
    pub input_tokens: u64,
    #[prost(uint64, tag = "9")]
    pub reasoning_tokens: u64,
}

#[derive(Clone, PartialEq, Message)]
pub struct NewerAppendRequest {
    #[prost(string, tag = "1")]
    pub session_id: String,
    #[prost(message, repeated, tag = "2")]
    pub events: Vec<NewerEvent>,
    #[prost(uint64, optional, tag = "4")]
    pub lease_epoch: Option<u64>,
}

#[derive(Clone, PartialEq, Message)]
pub struct NewerForkRequest {
    #[prost(string, tag = "1")]
    pub session_id: String,
    #[prost(uint64, tag = "2")]
    pub at_seq: u64,
    #[prost(string, tag = "3")]
    pub new_session_id: String,
    #[prost(message, repeated, tag = "4")]
    pub events: Vec<NewerEvent>,
}

pub fn user(id: &str, text: &str) -> NewerEvent {
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

pub fn reply(id: &str) -> NewerEvent {
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

pub const APPEND: &str = "/agentlog.v1.EventStore/Append";

pub async fn unary<Req, Resp>(
    channel: &Channel,
    token: Option<&str>,
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
        authorized(Request::new(request), token),
        PathAndQuery::from_static(path),
        ProstCodec::<Req, Resp>::default(),
    )
    .await
}

/// The session's log, each event as the newer writer reads it, with its bytes.
pub async fn read(
    channel: &Channel,
    token: Option<&str>,
    session_id: &str,
) -> Result<Vec<(NewerEvent, Vec<u8>)>> {
    let mut grpc = tonic::client::Grpc::new(channel.clone());
    grpc.ready().await?;
    let mut stream = grpc
        .server_streaming(
            authorized(
                Request::new(SubscribeRequest {
                    session_id: session_id.into(),
                    from_seq: 1,
                    follow: false,
                }),
                token,
            ),
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
pub struct RawEvent(pub Vec<u8>);

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
pub fn stored(sent: &NewerEvent, session_id: &str, seq: u64, served: &NewerEvent) -> NewerEvent {
    NewerEvent {
        session_id: session_id.into(),
        seq,
        event_id: served.event_id.clone(),
        ts_unix_ms: served.ts_unix_ms,
        schema_version: served.schema_version,
        ..sent.clone()
    }
}
