//! The JSON side of `agentlog web`: the session list, one session, the POSTs that append a
//! user message, an interrupt or an approval decision, the fork of a session, and the DELETE
//! that ends one. Each store error becomes one HTTP status, here and nowhere else, with a
//! message that says what to fix.

use agentlog_proto::reason::Reason;
use agentlog_proto::v1::{
    event::Kind, AppendRequest, ApprovalDecision, DeleteSessionRequest, Event, GetSessionRequest,
    Interrupt, ListSessionsRequest, SessionStatus, UserMessage,
};
use axum::extract::rejection::JsonRejection;
use axum::extract::{Path, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};
use tonic::Code;

use super::App;
use crate::render::session_json;

/// Sessions per page of `GET /v1/sessions` unless `limit` says otherwise.
const DEFAULT_PAGE: u32 = 100;
/// The largest page the store serves.
const MAX_PAGE: u32 = 1000;

/// An HTTP error with a JSON body: `{"error": {"status": …, "message": …}}`, with the
/// store's `grpcCode` and refusal `reason` (e.g. `SESSION_DELETED`) when it came from the
/// store.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    grpc: Option<Code>,
    reason: Option<Reason>,
    message: String,
}

impl ApiError {
    pub fn new(status: StatusCode, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            grpc: None,
            reason: None,
            message: message.into(),
        }
    }

    /// A store error, as the HTTP status a program would expect for it.
    pub fn from_store(what: &str, status: tonic::Status) -> ApiError {
        let http = match status.code() {
            Code::InvalidArgument | Code::OutOfRange => StatusCode::BAD_REQUEST,
            Code::NotFound => StatusCode::NOT_FOUND,
            Code::FailedPrecondition | Code::Aborted | Code::AlreadyExists => StatusCode::CONFLICT,
            Code::ResourceExhausted => StatusCode::PAYLOAD_TOO_LARGE,
            Code::Unavailable | Code::DeadlineExceeded => StatusCode::SERVICE_UNAVAILABLE,
            // The store refused this server's own credentials: an operator must fix them.
            _ => StatusCode::BAD_GATEWAY,
        };
        let message = match status.code() {
            Code::Unavailable => {
                format!("{what}: the event store is not reachable right now; try again")
            }
            Code::Unauthenticated | Code::PermissionDenied => format!(
                "{what}: the event store refused this web server's credentials ({})",
                status.message()
            ),
            _ => format!("{what}: {}", status.message()),
        };
        ApiError {
            status: http,
            grpc: Some(status.code()),
            reason: Reason::of(&status),
            message,
        }
    }
}

impl From<JsonRejection> for ApiError {
    fn from(rejection: JsonRejection) -> ApiError {
        ApiError::new(
            rejection.status(),
            format!(
                "the body must be JSON (Content-Type: application/json): {}",
                rejection.body_text()
            ),
        )
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut body = json!({"status": self.status.as_u16(), "message": self.message});
        if let Some(code) = self.grpc {
            body["grpcCode"] = json!(format!("{code:?}"));
        }
        if let Some(reason) = self.reason {
            body["reason"] = json!(reason.name());
        }
        (self.status, Json(json!({ "error": body }))).into_response()
    }
}

#[derive(Debug, Deserialize)]
pub struct ListQuery {
    query: Option<String>,
    status: Option<String>,
    limit: Option<u32>,
    #[serde(alias = "pageToken")]
    page_token: Option<String>,
}

/// `GET /v1/sessions?query=&status=runnable|idle|waiting&limit=&page_token=`
pub async fn list_sessions(
    State(app): State<App>,
    Query(q): Query<ListQuery>,
) -> Result<Json<Value>, ApiError> {
    let status = match q.status.as_deref().map(str::to_ascii_lowercase).as_deref() {
        None | Some("") => SessionStatus::Unspecified,
        Some("runnable") => SessionStatus::Runnable,
        Some("idle") => SessionStatus::Idle,
        Some("waiting") => SessionStatus::Waiting,
        Some(other) => {
            return Err(ApiError::new(
                StatusCode::BAD_REQUEST,
                format!("status {other:?} is not one of runnable, idle, waiting"),
            ))
        }
    };
    let page = app
        .store
        .clone()
        .list_sessions(ListSessionsRequest {
            page_size: q.limit.unwrap_or(DEFAULT_PAGE).clamp(1, MAX_PAGE),
            page_token: q.page_token.unwrap_or_default(),
            query: q.query.unwrap_or_default(),
            status: status as i32,
        })
        .await
        .map_err(|s| ApiError::from_store("ListSessions", s))?
        .into_inner();
    Ok(Json(json!({
        "sessions": page.sessions.iter().map(session_json).collect::<Vec<_>>(),
        "nextPageToken": page.next_page_token,
    })))
}

/// `GET /v1/sessions/{id}`
pub async fn get_session(
    State(app): State<App>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let info = app
        .store
        .clone()
        .get_session(GetSessionRequest { session_id: id })
        .await
        .map_err(|s| ApiError::from_store("GetSession", s))?
        .into_inner();
    Ok(Json(session_json(&info)))
}

/// `DELETE /v1/sessions/{id}`: the session is deleted for good; `200 {"sessionId",
/// "deleted": true}` (also for a session already deleted), 404 for one that never existed.
pub async fn delete_session(
    State(app): State<App>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    app.store
        .clone()
        .delete_session(DeleteSessionRequest {
            session_id: id.clone(),
        })
        .await
        .map_err(|s| ApiError::from_store("DeleteSession", s))?;
    Ok(Json(json!({"sessionId": id, "deleted": true})))
}

#[derive(Debug, Deserialize)]
pub struct MessageBody {
    text: String,
}

/// `POST /v1/sessions/{id}/messages {"text": …}`: a user turn (a new id starts a session).
pub async fn post_message(
    State(app): State<App>,
    Path(id): Path<String>,
    body: Result<Json<MessageBody>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(body) = body?;
    if body.text.trim().is_empty() {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "text: say something",
        ));
    }
    let kind = Kind::UserMessage(UserMessage { text: body.text });
    append(&app, id, "user", kind).await
}

#[derive(Debug, Default, Deserialize)]
pub struct CancelBody {
    #[serde(default)]
    reason: String,
}

/// `POST /v1/sessions/{id}/cancel {"reason": …}`: an interrupt.
pub async fn post_cancel(
    State(app): State<App>,
    Path(id): Path<String>,
    body: Option<Json<CancelBody>>,
) -> Result<Response, ApiError> {
    let mut reason = body.map(|Json(b)| b.reason).unwrap_or_default();
    if reason.trim().is_empty() {
        reason = "cancelled from the web view".into();
    }
    append(&app, id, "interrupt", Kind::Interrupt(Interrupt { reason })).await
}

#[derive(Debug, Deserialize)]
pub struct DecisionBody {
    #[serde(alias = "toolUseId")]
    tool_use_id: String,
    #[serde(default)]
    note: String,
}

/// `POST /v1/sessions/{id}/approve {"toolUseId": …, "note": …}`
pub async fn post_approve(
    State(app): State<App>,
    Path(id): Path<String>,
    body: Result<Json<DecisionBody>, JsonRejection>,
) -> Result<Response, ApiError> {
    decide(&app, id, body?.0, true).await
}

/// `POST /v1/sessions/{id}/deny {"toolUseId": …, "note": …}`
pub async fn post_deny(
    State(app): State<App>,
    Path(id): Path<String>,
    body: Result<Json<DecisionBody>, JsonRejection>,
) -> Result<Response, ApiError> {
    decide(&app, id, body?.0, false).await
}

async fn decide(
    app: &App,
    id: String,
    body: DecisionBody,
    approved: bool,
) -> Result<Response, ApiError> {
    if body.tool_use_id.is_empty() {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "toolUseId: name the pending call (its approvalRequested event has it)",
        ));
    }
    let kind = Kind::ApprovalDecision(ApprovalDecision {
        tool_use_id: body.tool_use_id,
        approved,
        note: body.note,
    });
    append(app, id, "decision", kind).await
}

/// `GET /v1/sessions/{id}/settled`: `{"settledSeqs": […]}`, the seqs a fork may be made at
/// (the store's own rule), for the page's "Fork from here".
pub async fn settled(
    State(app): State<App>,
    Path(id): Path<String>,
) -> Result<Json<Value>, ApiError> {
    let events = agentlog_client::log::read_log(&mut app.store.clone(), &id)
        .await
        .map_err(|s| ApiError::from_store("Subscribe", s))?;
    let seqs: Vec<String> = agentlog_proto::settled::SettledPoints::of(&events)
        .into_iter()
        .map(|seq| seq.to_string())
        .collect();
    Ok(Json(json!({ "settledSeqs": seqs })))
}

#[derive(Debug, Default, Deserialize)]
pub struct ForkBody {
    #[serde(alias = "atSeq", default, deserialize_with = "seq_number_or_string")]
    at_seq: Option<u64>,
    #[serde(default)]
    text: Option<String>,
}

/// A seq as JSON gives it: a number, or (the proto3 mapping of 64-bit integers) a string.
fn seq_number_or_string<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
    match Option::<Value>::deserialize(d)? {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => n
            .as_u64()
            .map(Some)
            .ok_or_else(|| serde::de::Error::custom("atSeq: a seq is a whole number")),
        Some(Value::String(s)) => s
            .parse()
            .map(Some)
            .map_err(|_| serde::de::Error::custom("atSeq: a seq is a whole number")),
        Some(_) => Err(serde::de::Error::custom("atSeq: a seq is a whole number")),
    }
}

/// `POST /v1/sessions/{id}/fork {"atSeq": …, "text": …}`: as `agentlog fork` (`atSeq`
/// defaults to the last settled point; `text`, at a user message, takes its place);
/// `201 {"sessionId", "lastSeq"}`.
pub async fn post_fork(
    State(app): State<App>,
    Path(id): Path<String>,
    body: Result<Json<ForkBody>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(body) = body?;
    let text = body.text.as_deref().filter(|t| !t.is_empty());
    let mut client = app.store.clone();
    let (made, last_seq) = crate::fork::fork(&mut client, &id, body.at_seq, text)
        .await
        .map_err(|e| match e {
            crate::fork::ForkError::Store { what, status } => ApiError::from_store(what, status),
            crate::fork::ForkError::NoSession(_) => {
                ApiError::new(StatusCode::NOT_FOUND, e.to_string())
            }
            crate::fork::ForkError::NothingSettled(_) => {
                ApiError::new(StatusCode::CONFLICT, e.to_string())
            }
            crate::fork::ForkError::FirstMessage(_) | crate::fork::ForkError::EmptyText => {
                ApiError::new(StatusCode::BAD_REQUEST, e.to_string())
            }
        })?;
    Ok((
        StatusCode::CREATED,
        Json(json!({"sessionId": made, "lastSeq": last_seq.to_string()})),
    )
        .into_response())
}

/// Appends one client-written event; `201 {"sessionId", "seq"}`. Each POST is a new event
/// (a fresh event id): a second decision for the same call is the store's to refuse.
async fn append(app: &App, id: String, prefix: &str, kind: Kind) -> Result<Response, ApiError> {
    let request = AppendRequest {
        session_id: id.clone(),
        events: vec![Event {
            event_id: format!("{prefix}:{}", uuid::Uuid::new_v4().simple()),
            kind: Some(kind),
            ..Event::default()
        }],
        ..AppendRequest::default()
    };
    let seq = app
        .store
        .clone()
        .append(request)
        .await
        .map_err(|s| ApiError::from_store("Append", s))?
        .into_inner()
        .last_seq;
    Ok((
        StatusCode::CREATED,
        Json(json!({"sessionId": id, "seq": seq.to_string()})),
    )
        .into_response())
}
