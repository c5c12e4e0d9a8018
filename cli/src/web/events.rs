//! `GET /v1/sessions/{id}/events?from_seq=N` as Server-Sent Events.
//!
//! Promise: a reader gets the session's events from `from_seq` (or, on a reconnect, from
//! the seq after its `Last-Event-ID`) exactly once each, in seq order, with no gap — the
//! history first, then one `caught_up` event (no id) once it has everything the session
//! held when it connected, then the live tail. Each event is `id:` its seq, `event:` its
//! kind's field name (`unknown` for a kind newer than this server), `data:` the event in
//! the proto3 JSON mapping. The stream rides out store restarts (see `follow`), sends
//! keep-alive comments, and ends for a reader that stops reading — that reader's next
//! request (browsers send `Last-Event-ID` by themselves) resumes where it stopped. A
//! session deleted while it is followed ends its stream with one `deleted` event (no id);
//! one already deleted is answered 404 (`reason` `SESSION_DELETED`).

use std::convert::Infallible;
use std::time::Duration;

use agentlog_client::refusal::is_session_not_found;
use agentlog_proto::v1::{Event, GetSessionRequest};
use axum::extract::{Path, Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use serde::Deserialize;
use serde_json::json;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};

use super::api::ApiError;
use super::App;
use crate::follow::{follow_async, Flow};
use crate::render::{event_json, kind_name};
use crate::store::SessionDeleted;

/// Events queued for one reader before the reader counts as slow.
const READER_BUFFER: usize = 256;
/// How long a full buffer may stay full before the slow reader is let go.
const SLOW_READER_PATIENCE: Duration = Duration::from_secs(5);
/// A comment this often keeps proxies and browsers from closing an idle stream.
const KEEP_ALIVE: Duration = Duration::from_secs(10);
/// How soon a browser retries after the stream ends.
const RETRY: Duration = Duration::from_secs(1);

#[derive(Debug, Deserialize)]
pub struct EventsQuery {
    #[serde(alias = "fromSeq")]
    from_seq: Option<u64>,
}

/// The handler.
pub async fn events(
    State(app): State<App>,
    Path(session): Path<String>,
    Query(q): Query<EventsQuery>,
    headers: HeaderMap,
) -> Result<Sse<impl Stream<Item = Result<SseEvent, Infallible>>>, ApiError> {
    // Last-Event-ID wins: it is where this very reader stopped.
    let resume_after = match headers.get("last-event-id") {
        None => None,
        Some(value) => Some(
            value
                .to_str()
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
                .ok_or_else(|| {
                    ApiError::new(
                        axum::http::StatusCode::BAD_REQUEST,
                        "Last-Event-ID must be the seq of the last event received",
                    )
                })?,
        ),
    };
    let from = match resume_after {
        Some(seq) => seq + 1,
        None => q.from_seq.unwrap_or(1).max(1),
    };
    // The head when the reader connected: `caught_up` follows the event with this seq.
    // A session with no event yet has head 0; its first event arrives live.
    let head = match app
        .store
        .clone()
        .get_session(GetSessionRequest {
            session_id: session.clone(),
        })
        .await
    {
        Ok(info) => info.into_inner().last_seq,
        Err(status) if is_session_not_found(&status) => 0,
        Err(status) => return Err(ApiError::from_store("GetSession", status)),
    };
    let (tx, rx) = mpsc::channel(READER_BUFFER);
    tokio::spawn(feed(app, session, from, head, tx));
    let stream = ReceiverStream::new(rx).map(Ok);
    Ok(Sse::new(stream).keep_alive(KeepAlive::new().interval(KEEP_ALIVE)))
}

/// Moves events from the store to one reader until the reader leaves, is too slow, or the
/// server shuts down.
async fn feed(app: App, session: String, from: u64, head: u64, tx: mpsc::Sender<SseEvent>) {
    let mut caught_up = false;
    if from > head {
        caught_up = true;
        if tx.send(caught_up_event(head)).await.is_err() {
            return;
        }
    }
    let mut shutdown = app.shutdown.clone();
    let reader = tx.clone();
    let following = follow_async(&app.store_addr, &session, from, move |event: Event| {
        let marker = (!caught_up && event.seq >= head).then(|| caught_up_event(event.seq));
        caught_up |= marker.is_some();
        let tx = tx.clone();
        async move {
            for sse in std::iter::once(sse_event(&event)).chain(marker) {
                match tx.send_timeout(sse, SLOW_READER_PATIENCE).await {
                    Ok(()) => {}
                    Err(mpsc::error::SendTimeoutError::Timeout(_)) => {
                        eprintln!(
                            "agentlog web: a reader of {} fell {READER_BUFFER} events behind at seq {}; letting it go (it resumes from there)",
                            event.session_id, event.seq
                        );
                        return Ok(Flow::Stop);
                    }
                    Err(mpsc::error::SendTimeoutError::Closed(_)) => return Ok(Flow::Stop),
                }
            }
            Ok(Flow::Continue)
        }
    });
    let deleted = tokio::select! {
        result = following => match result {
            Err(e) if e.is::<SessionDeleted>() => true,
            Err(e) => {
                eprintln!("agentlog web: following {session}: {e:#}");
                false
            }
            Ok(()) => false,
        },
        _ = reader.closed() => false,
        _ = shutdown.wait_for(|stop| *stop) => false,
    };
    if deleted {
        let _ = reader
            .send(SseEvent::default().event("deleted").data("{}"))
            .await;
    }
}

fn sse_event(event: &Event) -> SseEvent {
    SseEvent::default()
        .id(event.seq.to_string())
        .event(kind_name(event).unwrap_or("unknown"))
        .data(event_json(event).to_string())
        .retry(RETRY)
}

fn caught_up_event(last_seq: u64) -> SseEvent {
    SseEvent::default()
        .event("caught_up")
        .data(json!({"lastSeq": last_seq.to_string()}).to_string())
}
