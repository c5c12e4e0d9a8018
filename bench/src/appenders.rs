//! The appends every append figure drives the real `event-store` with over gRPC: unary
//! `Append`, or one `AppendStream` per client; one SYNC 300-byte user message per call,
//! each sent once the previous one is acknowledged.

use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::{
    append_stream_response, event, AppendRequest, AppendResponse, AppendStreamResponse, Event,
    UserMessage,
};
use anyhow::Context;
use tonic::transport::Channel;

use crate::load::Appender;

/// One SYNC append of one 300-byte user message per call, on its own HTTP/2 connection.
pub struct AgentlogAppender {
    client: EventStoreClient<Channel>,
    request: AppendRequest,
}

impl AgentlogAppender {
    pub async fn connect(url: &str, session_id: String) -> anyhow::Result<AgentlogAppender> {
        Ok(AgentlogAppender {
            client: EventStoreClient::connect(url.to_string()).await?,
            request: AppendRequest {
                session_id,
                events: vec![user_event(crate::event_text())],
                ..Default::default()
            },
        })
    }
}

impl Appender for AgentlogAppender {
    async fn append(&mut self) -> anyhow::Result<()> {
        self.client.append(self.request.clone()).await?;
        Ok(())
    }
}

/// The same appends as [`AgentlogAppender`] (one SYNC 300-byte event each, the next sent
/// once the previous one is acknowledged) on one `AppendStream` per client, on its own
/// HTTP/2 connection.
pub struct AgentlogStreamAppender {
    requests: tokio::sync::mpsc::Sender<AppendRequest>,
    responses: tonic::Streaming<AppendStreamResponse>,
    request: AppendRequest,
}

impl AgentlogStreamAppender {
    pub async fn connect(url: &str, session_id: String) -> anyhow::Result<AgentlogStreamAppender> {
        let mut client = EventStoreClient::connect(url.to_string()).await?;
        let (requests, rx) = tokio::sync::mpsc::channel(16);
        let responses = client
            .append_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
            .await?
            .into_inner();
        Ok(AgentlogStreamAppender {
            requests,
            responses,
            request: AppendRequest {
                session_id,
                events: vec![user_event(crate::event_text())],
                ..Default::default()
            },
        })
    }
}

impl AgentlogStreamAppender {
    /// Sends `request` on the stream and waits for its answer: what `Append` would have
    /// answered, a refusal as an error.
    pub async fn send(&mut self, request: AppendRequest) -> anyhow::Result<AppendResponse> {
        self.requests
            .send(request)
            .await
            .context("the append stream closed")?;
        let response = self
            .responses
            .message()
            .await?
            .context("the append stream ended")?;
        match response.result {
            Some(append_stream_response::Result::Response(r)) => Ok(r),
            Some(append_stream_response::Result::Error(e)) => {
                anyhow::bail!("append refused: code {}: {}", e.code, e.message)
            }
            None => anyhow::bail!("an empty AppendStream response"),
        }
    }
}

impl Appender for AgentlogStreamAppender {
    async fn append(&mut self) -> anyhow::Result<()> {
        self.send(self.request.clone()).await?;
        Ok(())
    }
}

pub fn user_event(text: String) -> Event {
    Event {
        kind: Some(event::Kind::UserMessage(UserMessage { text })),
        ..Default::default()
    }
}
