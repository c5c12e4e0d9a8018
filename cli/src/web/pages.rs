//! The pages people use: plain HTML, CSS and JavaScript compiled into the binary (no build
//! step, nothing fetched from elsewhere). The scripts talk to the JSON and event-stream
//! endpoints of `api` and `events`, as any program would.

use std::sync::Arc;

use axum::extract::{rejection::JsonRejection, Path};
use axum::http::{header, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::{Extension, Json};
use serde::Deserialize;

use super::api::ApiError;
use super::guard::Guard;

pub async fn list() -> Html<&'static str> {
    Html(include_str!("assets/list.html"))
}

/// Any session id: the page's script reads it from the address and asks the API.
pub async fn session(Path(_id): Path<String>) -> Html<&'static str> {
    Html(include_str!("assets/session.html"))
}

/// Two sessions side by side: the script reads `a` and `b` from the address.
pub async fn compare() -> Html<&'static str> {
    Html(include_str!("assets/compare.html"))
}

pub async fn login() -> Html<&'static str> {
    Html(include_str!("assets/login.html"))
}

#[derive(Debug, Deserialize)]
pub struct LoginBody {
    token: String,
}

/// `POST /login {"token": …}`: sets the login cookie for the right token.
pub async fn post_login(
    Extension(guard): Extension<Arc<Guard>>,
    body: Result<Json<LoginBody>, JsonRejection>,
) -> Result<Response, ApiError> {
    let Json(body) = body?;
    let Some(cookie) = guard.login_cookie() else {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            "this server needs no login (it listens on loopback without --login-token-file)",
        ));
    };
    if !guard.is_token(body.token.trim()) {
        return Err(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "that is not the login token",
        ));
    }
    Ok((StatusCode::NO_CONTENT, [(header::SET_COOKIE, cookie)]).into_response())
}

pub async fn post_logout(Extension(guard): Extension<Arc<Guard>>) -> Response {
    (
        StatusCode::NO_CONTENT,
        [(header::SET_COOKIE, guard.logout_cookie())],
    )
        .into_response()
}

/// `/assets/{file}`: the stylesheet and the scripts.
pub async fn asset(Path(file): Path<String>) -> Response {
    let (content_type, body) = match file.as_str() {
        "app.css" => ("text/css; charset=utf-8", include_str!("assets/app.css")),
        "common.js" => (
            "text/javascript; charset=utf-8",
            include_str!("assets/common.js"),
        ),
        "list.js" => (
            "text/javascript; charset=utf-8",
            include_str!("assets/list.js"),
        ),
        "search.js" => (
            "text/javascript; charset=utf-8",
            include_str!("assets/search.js"),
        ),
        "session.js" => (
            "text/javascript; charset=utf-8",
            include_str!("assets/session.js"),
        ),
        "compare.js" => (
            "text/javascript; charset=utf-8",
            include_str!("assets/compare.js"),
        ),
        "login.js" => (
            "text/javascript; charset=utf-8",
            include_str!("assets/login.js"),
        ),
        _ => return ApiError::new(StatusCode::NOT_FOUND, "no such asset").into_response(),
    };
    ([(header::CONTENT_TYPE, content_type)], body).into_response()
}
