//! A session's log as a runner sees it while it holds the lease: the history, read without
//! follow and kept in memory, and appends fenced by the lease epoch.
//!
//! Promise: an append carries the lease epoch and the caller's deterministic `event_id`, so
//! retrying it after a lost acknowledgement writes nothing new (the store answers with the
//! original seq). `FAILED_PRECONDITION` means the lease is gone and is reported as
//! [`StoreError::LeaseLost`], never retried.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::store_client::StoreClient;
use agentlog_proto::v1::{event::Kind, AppendRequest, Durability, Event, SubscribeRequest};
use tokio_stream::StreamExt;
use tonic::Code;

/// Attempts for an append or read that fails because the store is unreachable.
const STORE_ATTEMPTS: u32 = 6;
const STORE_RETRY_BASE: Duration = Duration::from_millis(100);

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the lease was lost: a newer lease exists or it expired")]
    LeaseLost,
    #[error("the event store failed: {0}")]
    Failed(tonic::Status),
}

impl From<tonic::Status> for StoreError {
    fn from(status: tonic::Status) -> StoreError {
        match status.code() {
            Code::FailedPrecondition => StoreError::LeaseLost,
            _ => StoreError::Failed(status),
        }
    }
}

/// Whether another attempt may succeed: the store or the path to it is briefly down. A
/// connection cut mid-call (the store killed, a reset) surfaces from tonic as `Unknown`
/// ("transport error"); the store itself never answers `Unknown`.
fn is_transient(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        Code::Unavailable | Code::DeadlineExceeded | Code::Unknown
    )
}

/// Appends to one session under one lease epoch. Cheap to clone (the delta writer has one).
#[derive(Debug, Clone)]
pub struct Appender {
    client: StoreClient,
    session_id: String,
    epoch: u64,
    /// The highest seq any clone of this appender was given for a SYNC append: the store
    /// makes those readable before it acknowledges them, so a read of the log that does not
    /// reach it means the store lost an acknowledged event. (BUFFERED deltas are
    /// acknowledged before they are durable and readable; the fold ignores them anyway.)
    appended: Arc<AtomicU64>,
}

impl Appender {
    pub fn new(client: StoreClient, session_id: String, epoch: u64) -> Appender {
        Appender {
            client,
            session_id,
            epoch,
            appended: Arc::new(AtomicU64::new(0)),
        }
    }

    pub fn session_id(&self) -> &str {
        &self.session_id
    }

    /// Appends one event; returns its seq (the original one if `event_id` was already
    /// written).
    #[tracing::instrument(name = "append", skip_all, fields(%event_id, ?durability, seq))]
    pub async fn append(
        &self,
        event_id: String,
        kind: Kind,
        durability: Durability,
    ) -> Result<u64, StoreError> {
        let request = AppendRequest {
            session_id: self.session_id.clone(),
            events: vec![Event {
                session_id: self.session_id.clone(),
                event_id,
                kind: Some(kind),
                ..Event::default()
            }],
            expected_last_seq: None,
            lease_epoch: Some(self.epoch),
            durability: durability as i32,
        };
        let mut attempt = 1;
        loop {
            match self.client.clone().append(request.clone()).await {
                Ok(response) => {
                    let response = response.into_inner();
                    let seq = response.seqs.first().copied().unwrap_or(response.last_seq);
                    if durability == Durability::Sync {
                        self.appended.fetch_max(seq, Ordering::SeqCst);
                    }
                    tracing::Span::current().record("seq", seq);
                    return Ok(seq);
                }
                Err(status) if is_transient(&status) && attempt < STORE_ATTEMPTS => {
                    tracing::warn!(%status, attempt, "append failed; retrying with the same event id");
                    tokio::time::sleep(STORE_RETRY_BASE * 2u32.pow(attempt)).await;
                    attempt += 1;
                }
                Err(status) => return Err(status.into()),
            }
        }
    }
}

/// The session's history so far, plus its appender.
#[derive(Debug)]
pub struct SessionLog {
    appender: Appender,
    events: Vec<Event>,
}

impl SessionLog {
    pub fn new(appender: Appender) -> SessionLog {
        SessionLog {
            appender,
            events: Vec::new(),
        }
    }

    pub fn appender(&self) -> &Appender {
        &self.appender
    }

    /// Reads every event past the last one seen (our own appends included, and user turns
    /// that clients added meanwhile) and returns the whole history. The history must reach
    /// our own last SYNC append: deciding the next step on a log that lacks it would redo
    /// that step, so a log that falls short is an error, never folded.
    pub async fn catch_up(&mut self) -> Result<&[Event], StoreError> {
        let mut attempt = 1;
        loop {
            match self.read_new().await {
                Ok(()) => {
                    let appended = self.appender.appended.load(Ordering::SeqCst);
                    let seen = self.events.last().map_or(0, |event| event.seq);
                    if seen >= appended {
                        return Ok(&self.events);
                    }
                    return Err(StoreError::Failed(tonic::Status::data_loss(format!(
                        "the log shows seq {seen} but our acknowledged append has seq {appended}"
                    ))));
                }
                Err(status) if is_transient(&status) && attempt < STORE_ATTEMPTS => {
                    tracing::warn!(%status, attempt, "reading the log failed; retrying");
                    tokio::time::sleep(STORE_RETRY_BASE * 2u32.pow(attempt)).await;
                    attempt += 1;
                }
                Err(status) => return Err(StoreError::Failed(status)),
            }
        }
    }

    async fn read_new(&mut self) -> Result<(), tonic::Status> {
        let from_seq = self.events.last().map_or(1, |event| event.seq + 1);
        let mut stream = self
            .appender
            .client
            .clone()
            .subscribe(SubscribeRequest {
                session_id: self.appender.session_id.clone(),
                from_seq,
                follow: false,
            })
            .await?
            .into_inner();
        while let Some(event) = stream.next().await {
            let event = event?;
            // Seqs are gapless and ascending; anything else (a retried read overlapping the
            // last one) is skipped rather than folded twice.
            if event.seq == self.events.last().map_or(1, |e| e.seq + 1) {
                self.events.push(event);
            }
        }
        Ok(())
    }
}
