//! `GET /v1/search?q=&limit=&page_token=`: SearchSessions for programs and the search box,
//! `{"hits": […], "nextPageToken": …}`, each hit in the proto3 JSON mapping; a bad query
//! is 400 with the store's message (which says what is wrong with it).

use agentlog_proto::v1::SearchSessionsRequest;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::Json;
use serde::Deserialize;
use serde_json::{json, Value};

use super::api::ApiError;
use super::App;
use crate::render::hit_json;

/// The largest page the store serves.
const MAX_PAGE: u32 = 100;

#[derive(Debug, Deserialize)]
pub struct SearchQuery {
    q: Option<String>,
    limit: Option<u32>,
    #[serde(alias = "pageToken")]
    page_token: Option<String>,
}

pub async fn search(
    State(app): State<App>,
    Query(q): Query<SearchQuery>,
) -> Result<Json<Value>, ApiError> {
    let Some(query) = q.q else {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "give the words to search for as ?q=",
        ));
    };
    let page = app
        .store
        .clone()
        .search_sessions(SearchSessionsRequest {
            query,
            page_size: q.limit.unwrap_or(0).min(MAX_PAGE),
            page_token: q.page_token.unwrap_or_default(),
        })
        .await
        .map_err(|s| ApiError::from_store("SearchSessions", s))?
        .into_inner();
    Ok(Json(json!({
        "hits": page.hits.iter().map(hit_json).collect::<Vec<_>>(),
        "nextPageToken": page.next_page_token,
    })))
}
