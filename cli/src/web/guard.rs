//! Who may use `agentlog web`, decided once for every request (a middleware in front of the
//! routes):
//!
//! - **DNS rebinding**: a server bound to loopback answers only requests addressed to a
//!   loopback name (`localhost`, `127.0.0.1`, `[::1]`), so a web page whose own host name
//!   was re-pointed at 127.0.0.1 cannot read or drive it.
//! - **Cross-site requests**: every POST must carry the `X-Agentlog-Request` header (a
//!   cross-site form cannot send one, and a cross-site `fetch` with it needs a CORS
//!   preflight this server never grants) and, if the browser sent an `Origin`, it must be
//!   this server's own.
//! - **Login** (with `--login-token-file`): the login form trades the token for an
//!   `HttpOnly; SameSite=Strict` cookie holding an HMAC of the token, never the token
//!   itself; programs may send `Authorization: Bearer TOKEN` instead. Tokens never travel
//!   in URLs. Changing the token signs everyone out.
//! - Every response says: no framing (the Approve button cannot be clickjacked), scripts
//!   only from this server, no sniffing, no referrer.

use std::path::Path;
use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::header::{self, HeaderMap, HeaderValue};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Redirect, Response};
use ring::hmac;

use super::api::ApiError;

/// The login cookie's name.
const COOKIE: &str = "agentlog_login";
/// What the cookie's HMAC signs: a cookie proves its holder once knew the token.
const COOKIE_MESSAGE: &[u8] = b"agentlog web login v1";
/// The header every POST must carry.
pub const REQUEST_HEADER: &str = "x-agentlog-request";

#[derive(Debug, thiserror::Error)]
pub enum LoginTokenError {
    #[error("cannot read --login-token-file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("--login-token-file {path} holds {len} characters; a login token needs at least 16")]
    TooShort { path: String, len: usize },
}

/// The rules in force for this server.
pub struct Guard {
    login: Option<hmac::Key>,
    /// Bound to loopback: requests must name a loopback host.
    loopback: bool,
    /// Served over HTTPS: the cookie is `Secure`.
    tls: bool,
}

impl Guard {
    pub fn new(login: Option<hmac::Key>, loopback: bool, tls: bool) -> Guard {
        Guard {
            login,
            loopback,
            tls,
        }
    }

    /// Reads the login token (surrounding whitespace ignored).
    pub fn read_login_token(path: &Path) -> Result<hmac::Key, LoginTokenError> {
        let text = std::fs::read_to_string(path).map_err(|source| LoginTokenError::Read {
            path: path.display().to_string(),
            source,
        })?;
        let token = text.trim();
        if token.len() < 16 {
            return Err(LoginTokenError::TooShort {
                path: path.display().to_string(),
                len: token.len(),
            });
        }
        Ok(hmac::Key::new(hmac::HMAC_SHA256, token.as_bytes()))
    }

    pub fn needs_login(&self) -> bool {
        self.login.is_some()
    }

    /// Whether `presented` is the login token (compared in constant time).
    pub fn is_token(&self, presented: &str) -> bool {
        let Some(key) = &self.login else {
            return false;
        };
        let presented_tag = hmac::sign(
            &hmac::Key::new(hmac::HMAC_SHA256, presented.as_bytes()),
            COOKIE_MESSAGE,
        );
        hmac::verify(key, COOKIE_MESSAGE, presented_tag.as_ref()).is_ok()
    }

    /// The `Set-Cookie` value that signs this browser in.
    pub fn login_cookie(&self) -> Option<String> {
        let key = self.login.as_ref()?;
        let tag = hmac::sign(key, COOKIE_MESSAGE);
        Some(format!(
            "{COOKIE}={}; Path=/; HttpOnly; SameSite=Strict{}",
            hex(tag.as_ref()),
            if self.tls { "; Secure" } else { "" }
        ))
    }

    /// The `Set-Cookie` value that signs this browser out.
    pub fn logout_cookie(&self) -> String {
        format!("{COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0")
    }

    fn signed_in(&self, headers: &HeaderMap) -> bool {
        let Some(key) = &self.login else {
            return true;
        };
        let bearer = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "));
        if let Some(token) = bearer {
            return self.is_token(token.trim());
        }
        headers
            .get_all(header::COOKIE)
            .iter()
            .filter_map(|v| v.to_str().ok())
            .flat_map(|v| v.split(';'))
            .filter_map(|pair| pair.trim().strip_prefix(COOKIE)?.strip_prefix('='))
            .filter_map(unhex)
            .any(|tag| hmac::verify(key, COOKIE_MESSAGE, &tag).is_ok())
    }
}

/// The middleware: refuses what the rules above refuse, and adds the safety headers.
pub async fn protect(State(guard): State<Arc<Guard>>, request: Request, next: Next) -> Response {
    let mut response = match check(&guard, &request) {
        Ok(()) => next.run(request).await,
        Err(refusal) => refusal.into_response(),
    };
    let headers = response.headers_mut();
    for (name, value) in [
        (
            header::CONTENT_SECURITY_POLICY,
            "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'",
        ),
        (header::X_FRAME_OPTIONS, "DENY"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::REFERRER_POLICY, "no-referrer"),
    ] {
        headers.insert(name, HeaderValue::from_static(value));
    }
    response
}

/// Why a request is refused.
enum Refusal {
    Error(ApiError),
    /// A page asked for without the login cookie: off to the login form.
    SignIn,
}

impl IntoResponse for Refusal {
    fn into_response(self) -> Response {
        match self {
            Refusal::Error(e) => e.into_response(),
            Refusal::SignIn => Redirect::to("/login").into_response(),
        }
    }
}

fn check(guard: &Guard, request: &Request) -> Result<(), Refusal> {
    let headers = request.headers();
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if guard.loopback && !is_loopback_host(host) {
        return Err(Refusal::Error(ApiError::new(
            StatusCode::MISDIRECTED_REQUEST,
            "this server listens on loopback and answers only to localhost, 127.0.0.1 or [::1]",
        )));
    }
    if request.method() != Method::GET && request.method() != Method::HEAD {
        if !headers.contains_key(REQUEST_HEADER) {
            return Err(Refusal::Error(ApiError::new(
                StatusCode::FORBIDDEN,
                "a POST must carry the X-Agentlog-Request header (it keeps other sites from posting here)",
            )));
        }
        if let Some(origin) = headers.get(header::ORIGIN) {
            let origin = origin.to_str().unwrap_or("");
            let own = origin
                .split_once("://")
                .is_some_and(|(_, authority)| authority == host);
            if !own {
                return Err(Refusal::Error(ApiError::new(
                    StatusCode::FORBIDDEN,
                    format!("a POST from origin {origin:?} is refused: only pages of this server may post here"),
                )));
            }
        }
    }
    let path = request.uri().path();
    let public = path == "/login" || path.starts_with("/assets/");
    if public || guard.signed_in(headers) {
        return Ok(());
    }
    if path.starts_with("/v1/") {
        Err(Refusal::Error(ApiError::new(
            StatusCode::UNAUTHORIZED,
            "sign in first: send Authorization: Bearer TOKEN (the --login-token-file token)",
        )))
    } else {
        Err(Refusal::SignIn)
    }
}

/// `localhost`, a loopback IPv4 address, or `[::1]`, with or without a port.
fn is_loopback_host(host: &str) -> bool {
    let name = if let Some(rest) = host.strip_prefix('[') {
        rest.split(']').next().unwrap_or("")
    } else {
        host.rsplit_once(':').map_or(host, |(name, _)| name)
    };
    name.eq_ignore_ascii_case("localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &str) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(text.get(i..i + 2)?, 16).ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_loopback_names_pass_the_rebinding_check() {
        for host in [
            "localhost:8080",
            "127.0.0.1:8080",
            "[::1]:8080",
            "localhost",
        ] {
            assert!(is_loopback_host(host), "{host}");
        }
        for host in ["evil.example:8080", "10.0.0.1:8080", "", "[fe80::1]:80"] {
            assert!(!is_loopback_host(host), "{host}");
        }
    }

    #[test]
    fn the_cookie_proves_the_token_and_nothing_else_does() {
        let key = hmac::Key::new(hmac::HMAC_SHA256, b"correct horse battery staple");
        let guard = Guard::new(Some(key), false, true);
        assert!(guard.is_token("correct horse battery staple"));
        assert!(!guard.is_token("correct horse battery stapl"));
        let cookie = guard.login_cookie().expect("a login is configured");
        assert!(cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"));
        assert!(cookie.contains("Secure"));
        assert!(!cookie.contains("staple"), "the token itself never leaves");
        let value = cookie.split(';').next().expect("name=value");
        let mut headers = HeaderMap::new();
        headers.insert(header::COOKIE, HeaderValue::from_str(value).expect("ascii"));
        assert!(guard.signed_in(&headers));
        headers.insert(
            header::COOKIE,
            HeaderValue::from_static("agentlog_login=00ff"),
        );
        assert!(!guard.signed_in(&headers));
    }
}
