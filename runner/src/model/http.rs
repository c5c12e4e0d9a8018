//! What the HTTP providers share: the client, the classification of a failed call
//! ([`super::FailReason`], and the wait the provider asked for, [`super::wait`]), and
//! reading an SSE stream with an idle timeout.

use std::time::{Duration, SystemTime};

use eventsource_stream::{Event, EventStreamError, Eventsource};
use futures::{Stream, StreamExt};
use reqwest::{Response, StatusCode};

use super::{FailReason, Failure, ModelError};

const CONNECT_TIMEOUT: Duration = Duration::from_secs(15);

pub(super) fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .connect_timeout(CONNECT_TIMEOUT)
        .build()
        .unwrap_or_default()
}

/// Sends the request; no response within `idle_timeout`, no connection, or a
/// non-success status becomes the matching [`ModelError`].
pub(super) async fn send(
    request: reqwest::RequestBuilder,
    idle_timeout: Duration,
) -> Result<Response, ModelError> {
    let response = match tokio::time::timeout(idle_timeout, request.send()).await {
        Err(_) => {
            return Err(ModelError::transient(
                FailReason::Timeout,
                format!(
                    "the provider answered nothing for {}",
                    humantime::format_duration(idle_timeout)
                ),
            ))
        }
        Ok(Err(e)) if e.is_connect() => {
            return Err(ModelError::transient(
                FailReason::Unreachable,
                format!("cannot reach the provider: {e}"),
            ))
        }
        Ok(Err(e)) => {
            return Err(ModelError::transient(
                FailReason::Cut,
                format!("the request broke off: {e}"),
            ))
        }
        Ok(Ok(response)) => response,
    };
    let status = response.status();
    if status.is_success() {
        return Ok(response);
    }
    let wait = super::wait::provider_wait(response.headers(), SystemTime::now());
    let body = response.text().await.unwrap_or_default();
    let message = format!("HTTP {status}: {}", error_message(&body));
    if is_billing_refusal(status, &body) {
        return Err(ModelError::Unusable(message));
    }
    match transient_reason(status) {
        Some(reason) => Err(ModelError::Transient(Failure {
            reason,
            message,
            wait,
        })),
        None => Err(ModelError::Refused(message)),
    }
}

/// Why a status is worth another attempt: 529 and 503 (busy), 429, 408 and every other
/// 5xx; `None` for the others.
fn transient_reason(status: StatusCode) -> Option<FailReason> {
    match status.as_u16() {
        529 | 503 => Some(FailReason::Overloaded),
        429 => Some(FailReason::RateLimited),
        408 => Some(FailReason::ServerError),
        _ if status.is_server_error() => Some(FailReason::ServerError),
        _ => None,
    }
}

/// A 429 that is a billing state, not a passing one (OpenAI's `insufficient_quota`): asking
/// again does not help.
fn is_billing_refusal(status: StatusCode, body: &str) -> bool {
    if status != StatusCode::TOO_MANY_REQUESTS {
        return false;
    }
    let Ok(value) = serde_json::from_str::<serde_json::Value>(body) else {
        return false;
    };
    let error = &value["error"];
    [&error["code"], &error["type"]]
        .iter()
        .any(|v| v.as_str() == Some("insufficient_quota"))
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

/// The next event; a broken connection is a cut stream, a silence past `idle_timeout` a
/// stalled one, and the end of the stream is `None`.
pub(super) async fn next_event(
    stream: &mut (impl Stream<Item = Result<Event, EventStreamError<reqwest::Error>>> + Unpin),
    idle_timeout: Duration,
) -> Result<Option<Event>, ModelError> {
    match tokio::time::timeout(idle_timeout, stream.next()).await {
        Err(_) => Err(ModelError::transient(
            FailReason::Stalled,
            format!(
                "the stream sent nothing for {}",
                humantime::format_duration(idle_timeout)
            ),
        )),
        Ok(None) => Ok(None),
        Ok(Some(Ok(event))) => Ok(Some(event)),
        Ok(Some(Err(e))) => Err(ModelError::transient(
            FailReason::Cut,
            format!("the stream broke: {e}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_are_classified_as_the_providers_mean_them() {
        let reason = |code: u16| transient_reason(StatusCode::from_u16(code).unwrap());
        assert_eq!(reason(529), Some(FailReason::Overloaded));
        assert_eq!(reason(503), Some(FailReason::Overloaded));
        assert_eq!(reason(429), Some(FailReason::RateLimited));
        assert_eq!(reason(500), Some(FailReason::ServerError));
        assert_eq!(reason(504), Some(FailReason::ServerError));
        assert_eq!(reason(400), None);
        assert_eq!(reason(401), None);
        let quota = r#"{"error":{"message":"You exceeded your current quota","type":"insufficient_quota","code":"insufficient_quota"}}"#;
        assert!(is_billing_refusal(StatusCode::TOO_MANY_REQUESTS, quota));
        let limit = r#"{"error":{"message":"Rate limit reached","type":"requests","code":"rate_limit_exceeded"}}"#;
        assert!(!is_billing_refusal(StatusCode::TOO_MANY_REQUESTS, limit));
    }
}
