//! AppendStream: many appends on one call, each handled as Append handles it, answered in
//! order.

use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use agentlog_proto::kept::KeptAppendRequest;
use agentlog_proto::v1::{
    append_stream_response, AppendError, AppendResponse, AppendStreamResponse,
};
use tokio_stream::Stream;
use tonic::Status;
use tracing::Instrument;

use super::validate::validate_append;
use crate::auth::{authorize_append, Caller};
use crate::backend::{AppendAnswer, Backend};
use crate::error::StoreError;
use crate::limits::MessageBudget;
use crate::metrics::{AppendCall, AppendObserver};
use crate::stop::StopCheck;

/// Requests of one AppendStream read and not answered yet, at most: the stream's
/// read-ahead, which lets the backend commit many of them at once. Beyond it the store
/// stops reading, and the client is held back by the stream's HTTP/2 window (see
/// ARCHITECTURE.md, "Flow control, not hang-ups").
const APPEND_STREAM_IN_FLIGHT: usize = 1024;

/// The read-ahead's bound in bytes (of the requests as encoded): no further request is
/// read while those unanswered hold this much (one always is).
const APPEND_STREAM_IN_FLIGHT_BYTES: usize = crate::wire::MAX_APPEND_BYTES;

/// An AppendStream request on its way into the writer's queue, with its observer and
/// size.
type Queuing =
    Pin<Box<dyn Future<Output = (AppendObserver, usize, Result<AppendAnswer, StoreError>)> + Send>>;

/// A request read and not answered yet, with its size.
enum InFlight {
    /// Answered without the backend (refused): sent once those before it are.
    Answered(usize, Result<AppendResponse, Status>),
    /// Queued in the backend: its answer to come, counted by its observer when it does.
    Queued(usize, AppendObserver, AppendAnswer),
}

/// The responses of one AppendStream. Requests are read, checked and queued for the writer
/// as the response side is polled (so in order, and at most [`APPEND_STREAM_IN_FLIGHT`]
/// and [`APPEND_STREAM_IN_FLIGHT_BYTES`] unanswered), and their answers are sent in that
/// same order: one task per call, no channel between reading a request and sending its
/// answer. Only the oldest unanswered request's answer is polled: no later one can be sent
/// before it, and a backend carries out a queued append whether or not its answer is
/// polled ([`Backend::enqueue_append`]); so an answer wakes this task directly, once. A
/// request that breaks the stream (a bad frame) ends it with that status after the answers
/// before it; shutdown stops the reading, the answers already queued still go out, and the
/// stream ends with `UNAVAILABLE` (a request the store did not read is the client's to send
/// again). Each request is counted, timed and traced as a unary Append is
/// ([`AppendObserver`]), its span a child of the call's.
pub(super) struct AppendStreamAnswers {
    requests: tonic::Streaming<KeptAppendRequest>,
    caller: Caller,
    budget: Option<MessageBudget>,
    /// The call's span (the responses are polled outside it).
    span: tracing::Span,
    store: Arc<dyn Backend>,
    shutdown: StopCheck,
    /// A request being queued (waiting for room in the writer's queue).
    queuing: Option<Queuing>,
    /// Oldest first.
    answers: VecDeque<InFlight>,
    /// The encoded size of the requests read and not answered.
    in_flight_bytes: usize,
    /// Set once no more requests are read; the status to end with after the answers, if
    /// the stream broke.
    reading_done: Option<Option<Status>>,
}

impl AppendStreamAnswers {
    pub(super) fn new(
        requests: tonic::Streaming<KeptAppendRequest>,
        caller: Caller,
        budget: Option<MessageBudget>,
        store: Arc<dyn Backend>,
        shutdown: StopCheck,
    ) -> AppendStreamAnswers {
        AppendStreamAnswers {
            requests,
            caller,
            budget,
            span: tracing::Span::current(),
            store,
            shutdown,
            queuing: None,
            answers: VecDeque::new(),
            in_flight_bytes: 0,
            reading_done: None,
        }
    }

    /// Reads and queues one request if one is ready and there is room; whether it did.
    fn read_one(&mut self, cx: &mut Context<'_>) -> bool {
        if self.reading_done.is_some() {
            return false;
        }
        if let Some(queuing) = self.queuing.as_mut() {
            return match queuing.as_mut().poll(cx) {
                Poll::Ready((observer, size, queued)) => {
                    self.queuing = None;
                    self.answers.push_back(match queued {
                        Ok(answer) => InFlight::Queued(size, observer, answer),
                        Err(e) => refused(size, observer, e),
                    });
                    true
                }
                Poll::Pending => false,
            };
        }
        if self.shutdown.stopped() {
            return self.stop_reading();
        }
        if self.answers.len() >= APPEND_STREAM_IN_FLIGHT
            || self.in_flight_bytes >= APPEND_STREAM_IN_FLIGHT_BYTES
        {
            return false;
        }
        match Pin::new(&mut self.requests).poll_next(cx) {
            Poll::Ready(Some(Ok(req))) => {
                let size = req.encoded_len();
                self.in_flight_bytes += size;
                if let Err(status) = admit_streamed(&self.caller, self.budget.as_ref(), &req) {
                    self.answers
                        .push_back(InFlight::Answered(size, Err(status)));
                    return true;
                }
                let observer = self
                    .span
                    .in_scope(|| AppendObserver::start(&req, AppendCall::Stream));
                match validate_append(req) {
                    Ok(op) => {
                        let store = self.store.clone();
                        let span = observer.span().clone();
                        self.queuing = Some(Box::pin(async move {
                            let queued = store.enqueue_append(op).instrument(span).await;
                            (observer, size, queued)
                        }));
                    }
                    Err(e) => self.answers.push_back(refused(size, observer, e)),
                }
                true
            }
            Poll::Ready(Some(Err(status))) => {
                self.reading_done = Some(Some(status));
                false
            }
            Poll::Ready(None) => {
                self.reading_done = Some(None);
                false
            }
            // Waiting for the next request, and for the shutdown.
            Poll::Pending if self.shutdown.poll_stopped(cx) => self.stop_reading(),
            Poll::Pending => false,
        }
    }

    /// Shutdown: no more requests are read; the stream ends with `UNAVAILABLE` after the
    /// answers to those read.
    fn stop_reading(&mut self) -> bool {
        self.reading_done = Some(Some(super::stopping_status("AppendStream")));
        false
    }

    /// The oldest request's answer, once it has one; `None` if no request is unanswered.
    fn poll_oldest(
        &mut self,
        cx: &mut Context<'_>,
    ) -> Poll<Option<(usize, Result<AppendResponse, Status>)>> {
        let Some(oldest) = self.answers.pop_front() else {
            return Poll::Ready(None);
        };
        match oldest {
            InFlight::Answered(size, answer) => Poll::Ready(Some((size, answer))),
            InFlight::Queued(size, observer, mut answer) => match answer.as_mut().poll(cx) {
                Poll::Ready(result) => {
                    observer.finish(&result);
                    Poll::Ready(Some((size, result.map_err(Status::from))))
                }
                Poll::Pending => {
                    self.answers
                        .push_front(InFlight::Queued(size, observer, answer));
                    Poll::Pending
                }
            },
        }
    }
}

/// A request the backend refused before queuing it, counted as refused.
fn refused(size: usize, observer: AppendObserver, e: StoreError) -> InFlight {
    let refusal = Err(e);
    observer.finish(&refusal);
    InFlight::Answered(size, refusal.map_err(Status::from))
}

impl Stream for AppendStreamAnswers {
    type Item = Result<AppendStreamResponse, Status>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        let this = self.get_mut();
        loop {
            let read = this.read_one(cx);
            match this.poll_oldest(cx) {
                Poll::Ready(Some((size, answer))) => {
                    this.in_flight_bytes -= size;
                    return Poll::Ready(Some(Ok(streamed(answer))));
                }
                Poll::Ready(None) if this.queuing.is_none() => {
                    if let Some(end) = &mut this.reading_done {
                        return Poll::Ready(end.take().map(Err));
                    }
                }
                _ => {}
            }
            if !read {
                return Poll::Pending;
            }
        }
    }
}

/// One request of an AppendStream, checked as the auth and limits layers check a single
/// Append (then [`validate_append`] checks it as it checks one).
fn admit_streamed(
    caller: &Caller,
    budget: Option<&MessageBudget>,
    req: &KeptAppendRequest,
) -> Result<(), Status> {
    if let Some(budget) = budget {
        budget.take()?;
    }
    Ok(authorize_append(caller, req)?)
}

/// An answer of Append as one response of AppendStream.
fn streamed(answer: Result<AppendResponse, Status>) -> AppendStreamResponse {
    AppendStreamResponse {
        result: Some(match answer {
            Ok(response) => append_stream_response::Result::Response(response),
            Err(status) => append_stream_response::Result::Error(AppendError::from(&status)),
        }),
    }
}
