//! The web view's compare page and its JSON: `GET /v1/compare?a=A&b=B`, the comparison
//! `agentlog --json compare A B` prints (`crate::compare`, the one function both use).

use agentlog_proto::v1::{Event, GetSessionRequest, SessionInfo};
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::Json;
use serde::Deserialize;
use serde_json::Value;

use super::api::ApiError;
use super::App;

#[derive(Debug, Deserialize)]
pub struct CompareQuery {
    a: Option<String>,
    b: Option<String>,
}

async fn load(app: &App, session: &str) -> Result<(SessionInfo, Vec<Event>), ApiError> {
    let info = app
        .store
        .clone()
        .get_session(GetSessionRequest {
            session_id: session.to_string(),
        })
        .await
        .map_err(|s| ApiError::from_store("GetSession", s))?
        .into_inner();
    let events = agentlog_client::log::read_log(&mut app.store.clone(), session)
        .await
        .map_err(|s| ApiError::from_store("Subscribe", s))?;
    Ok((info, events))
}

/// `GET /v1/compare?a=A&b=B`: the two sessions side by side from their fork point.
pub async fn compare(
    State(app): State<App>,
    Query(q): Query<CompareQuery>,
) -> Result<Json<Value>, ApiError> {
    let (Some(a), Some(b)) = (q.a.filter(|a| !a.is_empty()), q.b.filter(|b| !b.is_empty())) else {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "a and b: name the two sessions to compare (?a=RECORDING&b=REPLAY)",
        ));
    };
    let (a, a_log) = load(&app, &a).await?;
    let (b, b_log) = load(&app, &b).await?;
    let comparison = crate::compare::compare(&a, &a_log, &b, &b_log);
    serde_json::to_value(comparison)
        .map(Json)
        .map_err(|e| ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string()))
}
