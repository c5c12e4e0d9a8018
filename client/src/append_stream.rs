//! Appends from many callers on one `AppendStream`: each caller gets the answer a unary
//! `Append` would have given it, at about half the store's CPU per append.
//!
//! A task owns the stream. Callers hand it a request and a oneshot; it sends the requests
//! in the order it received them and pairs the store's answers with them in that same
//! order (the store answers an `AppendStream` in order, one answer per request).
//!
//! Promises:
//! - [`AppendStream::append`] returns what `Append` would have returned for the request: its
//!   response, or a status with the same code, message and `ErrorInfo` reason
//!   (`Status::from(AppendError)` in `agentlog_proto::reason`), so the helpers in
//!   [`crate::refusal`] and [`crate::retry`] classify it alike. A refused request does not
//!   disturb the others.
//! - Requests from one caller go out in the order its calls were made.
//! - If the stream breaks (the store restarted, the connection was cut), every request not
//!   answered yet fails with that status (a transient one: [`crate::retry::is_transient`]),
//!   and the next request opens a new stream. Whether a failed request was written is then
//!   unknown, as for a unary call that lost its answer: retry it with the same `event_id`
//!   and the store answers with the original seq.
//! - At most [`IN_FLIGHT`] requests are sent and unanswered, and at most [`QUEUED`] wait
//!   for the task; beyond that, callers wait (backpressure, bounded memory).
//! - When every clone of the [`AppendStream`] is dropped, the task closes the stream and
//!   ends.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use agentlog_proto::release::Release;
use agentlog_proto::v1::{append_stream_response, AppendRequest, AppendResponse};
use prost::Message;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;
use tracing::Instrument;

use crate::StoreClient;

/// Requests sent on the stream and not answered yet, at most (the store keeps up to 1,024
/// per stream in its queue).
pub const IN_FLIGHT: usize = 256;
/// Requests handed to the task and not sent yet, at most.
pub const QUEUED: usize = 64;
/// The protocol's limit on one append request; a larger one is refused here, as the store
/// would refuse it, so that it never reaches the stream shared with other callers (a frame
/// the store cannot decode would end the stream for all of them).
pub const MAX_REQUEST_BYTES: usize = 4 << 20;

/// A handle on the task that owns the stream. Cheap to clone; the stream lives while a
/// clone does.
#[derive(Debug, Clone)]
pub struct AppendStream {
    queue: mpsc::Sender<Queued>,
    /// The release of the store behind the latest stream, as its response named it
    /// ([`agentlog_proto::release::HEADER`]; `None`: no stream answered yet).
    release: Arc<Mutex<Option<Release>>>,
}

/// A request and where its answer goes.
struct Queued {
    request: AppendRequest,
    answer: oneshot::Sender<Result<AppendResponse, Status>>,
}

impl AppendStream {
    /// Spawns the task (call it inside a tokio runtime). The stream is opened by the first
    /// request, in the span current now: the store's side of the call joins that trace.
    pub fn new(client: StoreClient) -> AppendStream {
        let (queue, queued) = mpsc::channel(QUEUED);
        let release: Arc<Mutex<Option<Release>>> = Arc::default();
        tokio::spawn(own_the_stream(client, queued, release.clone()).in_current_span());
        AppendStream { queue, release }
    }

    /// The release of the store the latest stream reached (release 0.1.0 names none), once
    /// a stream was answered: a writer sends what is new in its own release only to a
    /// store that has it.
    pub fn store_release(&self) -> Option<Release> {
        *self.release.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Appends as a unary `Append` would: the response, or the status it would fail with.
    pub async fn append(&self, request: AppendRequest) -> Result<AppendResponse, Status> {
        let (answer, answered) = oneshot::channel();
        self.queue
            .send(Queued { request, answer })
            .await
            .map_err(|_| task_gone())?;
        answered.await.map_err(|_| task_gone())?
    }
}

fn task_gone() -> Status {
    Status::internal("the append stream's task ended")
}

/// Opens a stream for the first request after the last one broke, until every handle is
/// dropped.
async fn own_the_stream(
    client: StoreClient,
    mut queued: mpsc::Receiver<Queued>,
    release: Arc<Mutex<Option<Release>>>,
) {
    while let Some(first) = queued.recv().await {
        serve_one_stream(client.clone(), first, &mut queued, &release).await;
    }
}

/// Sends `first` and then every request handed over on a new stream, answering each from
/// the stream, until the stream breaks (every unanswered request then fails with its status)
/// or every handle is dropped.
async fn serve_one_stream(
    mut client: StoreClient,
    first: Queued,
    queued: &mut mpsc::Receiver<Queued>,
    release: &Mutex<Option<Release>>,
) {
    let (outgoing, body) = mpsc::channel(IN_FLIGHT);
    let mut waiting = Waiting::default();
    if !waiting.send(first, &outgoing) {
        return;
    }
    let mut answers = match client.append_stream(ReceiverStream::new(body)).await {
        Ok(response) => {
            let named = response
                .metadata()
                .get(agentlog_proto::release::HEADER)
                .and_then(|v| v.to_str().ok());
            *release.lock().unwrap_or_else(|p| p.into_inner()) = Some(Release::of_header(named));
            response.into_inner()
        }
        Err(status) => return waiting.fail_all(&status),
    };
    loop {
        tokio::select! {
            // Answers first: they make room for more requests.
            biased;
            answer = answers.message() => match answer {
                Ok(Some(answer)) => {
                    let Some(caller) = waiting.callers.pop_front() else {
                        tracing::warn!("the store answered an AppendStream request never sent");
                        return;
                    };
                    let _ = caller.send(match answer.result {
                        Some(append_stream_response::Result::Response(response)) => Ok(response),
                        Some(append_stream_response::Result::Error(error)) => Err(error.into()),
                        None => Err(Status::internal("an empty AppendStream answer")),
                    });
                }
                Ok(None) => {
                    return waiting.fail_all(&Status::unavailable(
                        "the store ended the append stream before answering",
                    ))
                }
                Err(status) => return waiting.fail_all(&status),
            },
            next = queued.recv(), if waiting.callers.len() < IN_FLIGHT => match next {
                Some(next) => {
                    if !waiting.send(next, &outgoing) {
                        return;
                    }
                }
                // Every handle is gone, and with them every caller: closing the request side
                // and dropping the answers ends the call.
                None => return,
            },
        }
    }
}

/// The callers of the requests sent on one stream and not answered yet, oldest first.
#[derive(Default)]
struct Waiting {
    callers: VecDeque<oneshot::Sender<Result<AppendResponse, Status>>>,
}

impl Waiting {
    /// Sends one request (or answers it at once: a caller that gave up, a request over the
    /// limit); false if the stream is gone, after failing every caller waiting on it.
    fn send(&mut self, queued: Queued, outgoing: &mpsc::Sender<AppendRequest>) -> bool {
        let Queued { request, answer } = queued;
        if answer.is_closed() {
            return true;
        }
        let bytes = request.encoded_len();
        if bytes > MAX_REQUEST_BYTES {
            let _ = answer.send(Err(Status::resource_exhausted(format!(
                "the append request is {bytes} bytes, over the limit of {MAX_REQUEST_BYTES} \
                 (4 MiB); split it into several appends"
            ))));
            return true;
        }
        // Never full: it holds at most the requests waiting for an answer.
        match outgoing.try_send(request) {
            Ok(()) => {
                self.callers.push_back(answer);
                true
            }
            Err(_) => {
                let status = Status::unavailable("the append stream closed");
                let _ = answer.send(Err(status.clone()));
                self.fail_all(&status);
                false
            }
        }
    }

    fn fail_all(&mut self, status: &Status) {
        if !self.callers.is_empty() {
            tracing::warn!(%status, unanswered = self.callers.len(), "the append stream broke");
        }
        for caller in self.callers.drain(..) {
            let _ = caller.send(Err(status.clone()));
        }
    }
}
