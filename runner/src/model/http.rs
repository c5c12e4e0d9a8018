//! What the HTTP providers share: the client, the classification of HTTP failures into
//! transient and refused, and reading an SSE stream with an idle timeout.

use std::time::Duration;

use eventsource_stream::{Event, EventStreamError, Eventsource};
use futures::{Stream, StreamExt};
use reqwest::header::HeaderMap;
use reqwest::{Response, StatusCode};

use super::ModelError;

/// A stream that sends nothing for this long is treated as cut.
const IDLE_TIMEOUT: Duration = Duration::from_secs(120);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);

pub(super) fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .connect_timeout(CONNECT_TIMEOUT)
        .build()
        .unwrap_or_default()
}

/// Sends the request; a non-success status becomes the matching [`ModelError`].
pub(super) async fn send(request: reqwest::RequestBuilder) -> Result<Response, ModelError> {
    let response = request
        .send()
        .await
        .map_err(|e| ModelError::transient(format!("cannot reach the provider: {e}")))?;
    let status = response.status();
    if status.is_success() {
        return Ok(response);
    }
    let retry_after = retry_after(response.headers());
    let body = response.text().await.unwrap_or_default();
    let message = format!("HTTP {status}: {}", error_message(&body));
    if is_transient(status) {
        Err(ModelError::Transient {
            message,
            retry_after,
        })
    } else {
        Err(ModelError::Refused(message))
    }
}

/// 408, 429, every 5xx and Anthropic's 529 "overloaded" are worth another attempt.
fn is_transient(status: StatusCode) -> bool {
    status == StatusCode::REQUEST_TIMEOUT
        || status == StatusCode::TOO_MANY_REQUESTS
        || status.is_server_error()
        || status.as_u16() == 529
}

/// `retry-after` in seconds (the form both providers use).
fn retry_after(headers: &HeaderMap) -> Option<Duration> {
    let seconds: f64 = headers
        .get("retry-after")?
        .to_str()
        .ok()?
        .trim()
        .parse()
        .ok()?;
    (seconds.is_finite() && seconds >= 0.0).then(|| Duration::from_secs_f64(seconds))
}

/// The provider's own words from an error body (`{"error": {"message": …}}`), else the body.
pub(super) fn error_message(body: &str) -> String {
    serde_json::from_str::<serde_json::Value>(body)
        .ok()
        .and_then(|v| {
            let error = &v["error"];
            let message = error["message"].as_str().or_else(|| error.as_str())?;
            Some(match error["type"].as_str() {
                Some(kind) => format!("{kind}: {message}"),
                None => message.to_string(),
            })
        })
        .unwrap_or_else(|| body.chars().take(2000).collect())
}

/// The server-sent events of a streaming response.
pub(super) fn events(
    response: Response,
) -> impl Stream<Item = Result<Event, EventStreamError<reqwest::Error>>> + Unpin {
    Box::pin(response.bytes_stream().eventsource())
}

/// The next event; a broken connection or a silence past [`IDLE_TIMEOUT`] is a transient
/// failure and the end of the stream is `None`.
pub(super) async fn next_event(
    stream: &mut (impl Stream<Item = Result<Event, EventStreamError<reqwest::Error>>> + Unpin),
) -> Result<Option<Event>, ModelError> {
    match tokio::time::timeout(IDLE_TIMEOUT, stream.next()).await {
        Err(_) => Err(ModelError::transient(format!(
            "the stream sent nothing for {} s",
            IDLE_TIMEOUT.as_secs()
        ))),
        Ok(None) => Ok(None),
        Ok(Some(Ok(event))) => Ok(Some(event)),
        Ok(Some(Err(e))) => Err(ModelError::transient(format!("the stream broke: {e}"))),
    }
}
