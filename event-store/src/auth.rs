//! Who may do what to which session: one tower layer at the store's edge.
//!
//! A caller presents `authorization: Bearer <token>`. The tokens file (`--tokens-file`)
//! holds only the SHA-256 of each token, with the token's name, role and scope:
//!
//! ```json
//! {"tokens": [
//!   {"name": "acme-web",     "sha256": "<64 hex>", "role": "client", "prefixes": ["acme:"]},
//!   {"name": "runners",      "sha256": "<64 hex>", "role": "runner"},
//!   {"name": "acme-runners", "sha256": "<64 hex>", "role": "runner", "prefixes": ["acme:"]},
//!   {"name": "ops",          "sha256": "<64 hex>", "role": "admin"}
//! ]}
//! ```
//!
//! - `client` (needs `prefixes`): appends `user_message` events, and reads, follows, gets
//!   and lists sessions, all within its prefixes;
//! - `runner` (all sessions, or its `prefixes`): claims and leases sessions, appends
//!   runner-written kinds, and reads what it works on;
//! - `admin`: everything.
//!
//! Missing or unknown token: `UNAUTHENTICATED`. A named session outside the caller's scope:
//! `PERMISSION_DENIED` for a write, `NOT_FOUND` for a read (the same answer whether or not
//! it exists). `ListSessions` and `ClaimSession` get the caller's [`Scope`] in the request
//! extensions and only ever return sessions in it. Health is open; reflection needs any
//! valid token. Without a tokens file the store is open: every caller is an anonymous admin.
//!
//! No token, and no hash, ever appears in a log line or an error message: callers are named
//! by the token's `name`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use agentlog_proto::v1::AppendRequest;
use bytes::Bytes;
use http_body_util::BodyExt;
use prost::Message;
use serde::Deserialize;
use tonic::body::Body;
use tonic::codegen::http::{Request, Response};
use tonic::Status;

use crate::scope::Scope;
use crate::service::MAX_DECODED_FRAME_BYTES;
use crate::session::{is_runner_kind, kind_name};

/// How long a caller may take to send the (single) request message of a call.
const REQUEST_BODY_TIMEOUT: Duration = Duration::from_secs(60);

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Client,
    Runner,
    Admin,
}

/// The authenticated caller, put into each request's extensions by [`AuthLayer`].
#[derive(Debug, Clone)]
pub struct Caller {
    /// The token's name (or `anonymous` on an open store): safe to log.
    pub name: Arc<str>,
    pub role: Role,
    pub scope: Scope,
    /// False on an open store (no tokens file): limits then key on the peer address.
    pub authenticated: bool,
}

impl Caller {
    /// Every caller of a store without a tokens file.
    pub fn anonymous() -> Caller {
        Caller {
            name: "anonymous".into(),
            role: Role::Admin,
            scope: Scope::everything(),
            authenticated: false,
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum TokensError {
    #[error("cannot read the tokens file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    /// Deliberately without serde's message, which may quote values from the file.
    #[error("the tokens file {path} is not valid JSON of the documented shape (line {line}, column {column}); see `event-store --help` and the README")]
    Parse {
        path: String,
        line: usize,
        column: usize,
    },
    #[error("the tokens file {path}: token #{index}: {problem}")]
    Entry {
        path: String,
        index: usize,
        problem: String,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokensFile {
    tokens: Vec<TokenEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenEntry {
    name: String,
    sha256: String,
    role: Role,
    #[serde(default)]
    prefixes: Option<Vec<String>>,
}

/// The tokens in force: SHA-256 of the token → the caller it authenticates.
#[derive(Debug, Default)]
pub struct TokenSet {
    by_hash: HashMap<[u8; 32], Caller>,
}

impl TokenSet {
    /// Parses and checks a tokens file's text (`path` only names it in errors).
    pub fn parse(text: &str, path: &str) -> Result<TokenSet, TokensError> {
        let file: TokensFile = serde_json::from_str(text).map_err(|e| TokensError::Parse {
            path: path.to_string(),
            line: e.line(),
            column: e.column(),
        })?;
        let mut set = TokenSet::default();
        let mut names = std::collections::HashSet::new();
        for (index, entry) in file.tokens.into_iter().enumerate() {
            let bad = |problem: String| TokensError::Entry {
                path: path.to_string(),
                index,
                problem,
            };
            if entry.name.is_empty()
                || entry.name.len() > 128
                || entry.name.chars().any(|c| c.is_control())
            {
                return Err(bad(
                    "name: give each token 1-128 printable characters".into()
                ));
            }
            if !names.insert(entry.name.clone()) {
                return Err(bad(format!("name {:?} is used twice", entry.name)));
            }
            let hash = parse_sha256(&entry.sha256).ok_or_else(|| {
                bad(format!(
                    "sha256 of {:?} is not 64 hex digits (store `printf %s TOKEN | sha256sum`, \
                     never the token itself)",
                    entry.name
                ))
            })?;
            if set.by_hash.contains_key(&hash) {
                return Err(bad(format!(
                    "{:?} has the same sha256 as another token",
                    entry.name
                )));
            }
            let scope = match (entry.role, entry.prefixes) {
                (Role::Admin, Some(_)) => {
                    return Err(bad(format!(
                        "{:?}: an admin sees every session; drop `prefixes` or use role \
                         runner/client",
                        entry.name
                    )))
                }
                (Role::Client, None) => {
                    return Err(bad(format!(
                        "{:?}: a client needs `prefixes` (its tenant, e.g. [\"acme:\"])",
                        entry.name
                    )))
                }
                (_, None) => Scope::everything(),
                (_, Some(prefixes)) => {
                    if prefixes.is_empty() || prefixes.iter().any(|p| !valid_prefix(p)) {
                        return Err(bad(format!(
                            "{:?}: prefixes must be non-empty strings of [A-Za-z0-9._:-] \
                             starting with a letter or digit",
                            entry.name
                        )));
                    }
                    Scope::prefixes(prefixes)
                }
            };
            set.by_hash.insert(
                hash,
                Caller {
                    name: entry.name.into(),
                    role: entry.role,
                    scope,
                    authenticated: true,
                },
            );
        }
        Ok(set)
    }

    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    /// The caller a presented token authenticates, if any. The lookup is by the token's
    /// SHA-256, so its timing says nothing useful about the token.
    pub fn authenticate(&self, token: &str) -> Option<&Caller> {
        self.by_hash.get(&sha256(token.as_bytes()))
    }
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    let mut out = [0u8; 32];
    out.copy_from_slice(digest.as_ref());
    out
}

fn parse_sha256(hex: &str) -> Option<[u8; 32]> {
    let hex = hex.trim();
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

fn valid_prefix(prefix: &str) -> bool {
    !prefix.is_empty()
        && prefix.len() <= 128
        && prefix.as_bytes()[0].is_ascii_alphanumeric()
        && prefix
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

/// The tokens file, re-read when its content changes (Kubernetes swaps mounted secrets in
/// place) or on SIGHUP. A file that no longer parses is reported and the previous tokens
/// stay in force.
pub struct TokensFileWatch {
    path: PathBuf,
    current: RwLock<Arc<TokenSet>>,
    /// Digest of the content last tried (loaded or refused), so a bad file is reported once.
    last_seen: Mutex<[u8; 32]>,
}

impl TokensFileWatch {
    pub fn open(path: &Path) -> Result<TokensFileWatch, TokensError> {
        let text = read(path)?;
        let set = TokenSet::parse(&text, &path.display().to_string())?;
        Ok(TokensFileWatch {
            path: path.to_path_buf(),
            current: RwLock::new(Arc::new(set)),
            last_seen: Mutex::new(sha256(text.as_bytes())),
        })
    }

    pub fn current(&self) -> Arc<TokenSet> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn len(&self) -> usize {
        self.current().len()
    }

    pub fn is_empty(&self) -> bool {
        self.current().is_empty()
    }
}

impl crate::tls::Reload for TokensFileWatch {
    fn what(&self) -> &'static str {
        "tokens file"
    }

    fn reload(&self, forced: bool) -> Result<Option<String>, String> {
        let text = read(&self.path).map_err(|e| e.to_string())?;
        let digest = sha256(text.as_bytes());
        {
            let mut last = self.last_seen.lock().unwrap_or_else(|p| p.into_inner());
            if *last == digest && !forced {
                return Ok(None);
            }
            *last = digest;
        }
        let set = TokenSet::parse(&text, &self.path.display().to_string())
            .map_err(|e| format!("{e}; the previous tokens stay in force"))?;
        let n = set.len();
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(set);
        Ok(Some(format!("{n} tokens")))
    }
}

fn read(path: &Path) -> Result<String, TokensError> {
    std::fs::read_to_string(path).map_err(|source| TokensError::Read {
        path: path.display().to_string(),
        source,
    })
}

/// The RPCs of `agentlog.v1.EventStore`, by what they touch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rpc {
    Append,
    /// Authorized per request, in the service, as [`Rpc::Append`] (see
    /// [`authorize_append`]).
    AppendStream,
    Subscribe,
    GetSession,
    ListSessions,
    ClaimSession,
    AcquireLease,
    RenewLease,
    ReleaseLease,
}

impl Rpc {
    pub const ALL: [Rpc; 9] = [
        Rpc::Append,
        Rpc::AppendStream,
        Rpc::Subscribe,
        Rpc::GetSession,
        Rpc::ListSessions,
        Rpc::ClaimSession,
        Rpc::AcquireLease,
        Rpc::RenewLease,
        Rpc::ReleaseLease,
    ];

    fn from_method(method: &str) -> Option<Rpc> {
        Some(match method {
            "Append" => Rpc::Append,
            "AppendStream" => Rpc::AppendStream,
            "Subscribe" => Rpc::Subscribe,
            "GetSession" => Rpc::GetSession,
            "ListSessions" => Rpc::ListSessions,
            "ClaimSession" => Rpc::ClaimSession,
            "AcquireLease" => Rpc::AcquireLease,
            "RenewLease" => Rpc::RenewLease,
            "ReleaseLease" => Rpc::ReleaseLease,
            _ => return None,
        })
    }

    /// Reads answer `NOT_FOUND` outside the scope (no existence leak); writes
    /// `PERMISSION_DENIED`.
    fn is_read(self) -> bool {
        matches!(self, Rpc::Subscribe | Rpc::GetSession | Rpc::ListSessions)
    }
}

/// What a request is, from its path.
enum Route {
    /// Health: open, for probes.
    Open,
    /// Reflection, or a path that names no RPC of ours: any valid token.
    AnyCaller,
    Store(Rpc),
}

fn route(path: &str) -> Route {
    if path.starts_with("/grpc.health.v1.Health/") {
        return Route::Open;
    }
    match path.strip_prefix("/agentlog.v1.EventStore/") {
        Some(method) => Rpc::from_method(method).map_or(Route::AnyCaller, Route::Store),
        None => Route::AnyCaller,
    }
}

/// What the auth decision needs from a request message.
#[derive(Debug, Default)]
pub struct Target {
    /// The session the request names (empty for List/Claim).
    pub session_id: String,
    /// For an append: each event's kind (`None`: no kind; validation refuses it).
    pub kinds: Vec<Option<agentlog_proto::v1::event::Kind>>,
}

/// The request messages that name a session all carry it as field 1.
#[derive(Clone, PartialEq, Message)]
struct NamesSession {
    #[prost(string, tag = "1")]
    session_id: String,
}

/// Whether `caller` may make the call `rpc` on `target`. This is the whole rule; the store
/// applies `caller.scope` to what List and Claim return.
pub fn authorize(caller: &Caller, rpc: Rpc, target: &Target) -> Result<(), Status> {
    if caller.role == Role::Admin {
        return Ok(());
    }
    let who = &caller.name;
    let role_may = match (caller.role, rpc) {
        (
            _,
            Rpc::Append | Rpc::AppendStream | Rpc::Subscribe | Rpc::GetSession | Rpc::ListSessions,
        ) => true,
        (Role::Runner, _) => true,
        (Role::Client, _) => false,
        (Role::Admin, _) => true,
    };
    if !role_may {
        return Err(Status::permission_denied(format!(
            "token {who:?} (role client) may not call {rpc:?}; that needs a runner or admin token"
        )));
    }
    if matches!(
        rpc,
        Rpc::ListSessions | Rpc::ClaimSession | Rpc::AppendStream
    ) {
        return Ok(());
    }
    if !caller.scope.admits(&target.session_id) {
        return Err(if rpc.is_read() {
            // Word for word what the store says of a session that does not exist.
            agentlog_proto::reason::Reason::SessionNotFound
                .status(format!("session {} does not exist", target.session_id))
        } else {
            Status::permission_denied(format!(
                "token {who:?} may not write to session {:?}: it is outside the token's prefixes",
                target.session_id
            ))
        });
    }
    if rpc == Rpc::Append {
        check_kinds(caller, target.kinds.iter().map(Option::as_ref))?;
    }
    Ok(())
}

/// Whether `caller` may make this append (one request of an `AppendStream`): the rule of
/// [`authorize`] for [`Rpc::Append`], read from the message itself.
pub fn authorize_append(caller: &Caller, request: &AppendRequest) -> Result<(), Status> {
    if caller.role == Role::Admin {
        return Ok(());
    }
    if !caller.scope.admits(&request.session_id) {
        return Err(Status::permission_denied(format!(
            "token {:?} may not write to session {:?}: it is outside the token's prefixes",
            caller.name, request.session_id
        )));
    }
    check_kinds(caller, request.events.iter().map(|e| e.kind.as_ref()))
}

/// Clients append a person's kinds only, runners the runner-written kinds only.
fn check_kinds<'a>(
    caller: &Caller,
    kinds: impl Iterator<Item = Option<&'a agentlog_proto::v1::event::Kind>>,
) -> Result<(), Status> {
    if caller.role == Role::Admin {
        return Ok(());
    }
    let who = &caller.name;
    let client = caller.role == Role::Client;
    for (i, kind) in kinds.enumerate() {
        let Some(kind) = kind else { continue };
        if is_runner_kind(kind) == client {
            return Err(Status::permission_denied(format!(
                "events[{i}]: token {who:?} (role {}) may not append {}; {}",
                if client { "client" } else { "runner" },
                kind_name(kind),
                if client {
                    "clients append user_message, interrupt and approval_decision only"
                } else {
                    "runners append the runner-written kinds only (assistant_message, \
                     tool_started, tool_result, assistant_delta, run_error, interrupted, \
                     approval_requested)"
                }
            )));
        }
    }
    Ok(())
}

/// Who may call: an open store, or the tokens in force.
#[derive(Clone)]
pub enum Access {
    Open,
    Tokens(Arc<TokensFileWatch>),
}

/// The tower layer: authenticates every call (but health), authorizes it against the
/// message it carries, and hands the [`Caller`] on in the request extensions.
#[derive(Clone)]
pub struct AuthLayer {
    access: Access,
}

impl AuthLayer {
    pub fn new(access: Access) -> AuthLayer {
        AuthLayer { access }
    }
}

impl<S> tower::Layer<S> for AuthLayer {
    type Service = Auth<S>;

    fn layer(&self, inner: S) -> Auth<S> {
        Auth {
            inner,
            access: self.access.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Auth<S> {
    inner: S,
    access: Access,
}

type BoxFuture<T> = std::pin::Pin<Box<dyn std::future::Future<Output = T> + Send>>;

impl<S> tower::Service<Request<Body>> for Auth<S>
where
    S: tower::Service<Request<Body>, Response = Response<Body>> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response<Body>;
    type Error = S::Error;
    type Future = BoxFuture<Result<Response<Body>, S::Error>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        // The clone that was polled ready serves this call.
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let access = self.access.clone();
        Box::pin(async move {
            match admit(&access, request).await {
                Ok(request) => inner.call(request).await,
                Err(status) => Ok(status.into_http()),
            }
        })
    }
}

/// The caller of every request to an open store, made once.
static ANONYMOUS: std::sync::LazyLock<Caller> = std::sync::LazyLock::new(Caller::anonymous);

/// Authenticates and authorizes one request; returns it (with the [`Caller`] in its
/// extensions) or the status to answer with.
async fn admit(access: &Access, mut request: Request<Body>) -> Result<Request<Body>, Status> {
    let route = route(request.uri().path());
    let caller = match access {
        Access::Open => ANONYMOUS.clone(),
        Access::Tokens(_) if matches!(route, Route::Open) => return Ok(request),
        Access::Tokens(tokens) => {
            let token = bearer_token(request.headers()).ok_or_else(|| {
                Status::unauthenticated(
                    "this store needs a token: send metadata `authorization: Bearer <token>`",
                )
            })?;
            tokens
                .current()
                .authenticate(token)
                .cloned()
                .ok_or_else(|| Status::unauthenticated("the bearer token is not known here"))?
        }
    };
    if let (Route::Store(rpc), true) = (&route, caller.role != Role::Admin) {
        let rpc = *rpc;
        let needs_message = !matches!(
            rpc,
            Rpc::ListSessions | Rpc::ClaimSession | Rpc::AppendStream
        );
        let target = if needs_message {
            let (parts, body) = request.into_parts();
            let message = read_single_message(body).await?;
            let target = decode_target(rpc, &message)?;
            // The service decodes the very bytes that were checked.
            let mut framed = Vec::with_capacity(message.len() + 5);
            framed.push(0);
            framed.extend_from_slice(&(message.len() as u32).to_be_bytes());
            framed.extend_from_slice(&message);
            request = Request::from_parts(
                parts,
                Body::new(http_body_util::Full::new(Bytes::from(framed))),
            );
            target
        } else {
            Target::default()
        };
        authorize(&caller, rpc, &target)?;
    }
    request.extensions_mut().insert(caller);
    Ok(request)
}

fn bearer_token(headers: &tonic::codegen::http::HeaderMap) -> Option<&str> {
    let value = headers.get("authorization")?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// The one gRPC message of a unary or server-streaming call (the client half-closes after
/// it). Anything else (no message, two, a compressed one) is refused here, so what was
/// checked is exactly what is served.
async fn read_single_message(body: Body) -> Result<Bytes, Status> {
    let limited = http_body_util::Limited::new(body, MAX_DECODED_FRAME_BYTES + 5);
    let collected = tokio::time::timeout(REQUEST_BODY_TIMEOUT, limited.collect())
        .await
        .map_err(|_| Status::deadline_exceeded("the request message did not arrive in time"))?;
    let bytes = match collected {
        Ok(collected) => collected.to_bytes(),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            return Err(Status::resource_exhausted(format!(
                "the request is over the limit of {} bytes (4 MiB); split it into several \
                 appends",
                crate::service::MAX_APPEND_BYTES
            )))
        }
        Err(_) => return Err(Status::cancelled("the request body was cut off")),
    };
    if bytes.len() < 5 {
        return Err(Status::invalid_argument(
            "the call carries no request message",
        ));
    }
    if bytes[0] != 0 {
        return Err(Status::unimplemented(
            "compressed request messages are not accepted",
        ));
    }
    let len = u32::from_be_bytes([bytes[1], bytes[2], bytes[3], bytes[4]]) as usize;
    if bytes.len() != 5 + len {
        return Err(Status::invalid_argument(
            "the call must carry exactly one request message",
        ));
    }
    Ok(bytes.slice(5..))
}

fn decode_target(rpc: Rpc, message: &Bytes) -> Result<Target, Status> {
    let undecodable =
        |_| Status::invalid_argument(format!("the {rpc:?} request message cannot be decoded"));
    if rpc == Rpc::Append {
        let req = AppendRequest::decode(message.clone()).map_err(undecodable)?;
        Ok(Target {
            session_id: req.session_id,
            kinds: req.events.into_iter().map(|e| e.kind).collect(),
        })
    } else {
        let req = NamesSession::decode(message.clone()).map_err(undecodable)?;
        Ok(Target {
            session_id: req.session_id,
            kinds: Vec::new(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"{"tokens": [
        {"name": "acme", "sha256": "SHA_A", "role": "client", "prefixes": ["acme:"]},
        {"name": "pool", "sha256": "SHA_R", "role": "runner"},
        {"name": "ops", "sha256": "SHA_O", "role": "admin"}
    ]}"#;

    fn hex(token: &str) -> String {
        sha256(token.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    fn set() -> TokenSet {
        let text = FILE
            .replace("SHA_A", &hex("tok-a"))
            .replace("SHA_R", &hex("tok-r"))
            .replace("SHA_O", &hex("tok-o"));
        TokenSet::parse(&text, "tokens.json").expect("valid file")
    }

    #[test]
    fn tokens_authenticate_by_their_hash_only() {
        let set = set();
        assert_eq!(set.len(), 3);
        let acme = set.authenticate("tok-a").expect("known");
        assert_eq!((&*acme.name, acme.role), ("acme", Role::Client));
        assert!(set.authenticate("tok-x").is_none());
        assert!(
            set.authenticate(&hex("tok-a")).is_none(),
            "the hash is not a token"
        );
    }

    #[test]
    fn bad_files_are_refused_without_quoting_values() {
        let raw = r#"{"tokens": [{"name": "x", "sha256": "my-secret-token", "role": "admin"}]}"#;
        let err = TokenSet::parse(raw, "t.json")
            .expect_err("not a hash")
            .to_string();
        assert!(!err.contains("my-secret-token"), "{err}");
        let raw = r#"{"tokens": [{"name": "x", "token": "my-secret-token", "role": "admin"}]}"#;
        let err = TokenSet::parse(raw, "t.json")
            .expect_err("unknown field")
            .to_string();
        assert!(!err.contains("my-secret-token"), "{err}");
        let raw = format!(
            r#"{{"tokens": [{{"name": "x", "sha256": "{}", "role": "client"}}]}}"#,
            hex("t")
        );
        assert!(
            TokenSet::parse(&raw, "t.json").is_err(),
            "a client needs prefixes"
        );
    }

    #[test]
    fn each_request_of_an_append_stream_is_authorized_like_an_append() {
        let set = set();
        let acme = set.authenticate("tok-a").expect("known");
        let pool = set.authenticate("tok-r").expect("known");
        let request = |id: &str, kind: agentlog_proto::v1::event::Kind| AppendRequest {
            session_id: id.into(),
            events: vec![agentlog_proto::v1::Event {
                kind: Some(kind),
                ..Default::default()
            }],
            ..Default::default()
        };
        let user = || agentlog_proto::v1::event::Kind::UserMessage(Default::default());
        let result = || agentlog_proto::v1::event::Kind::ToolResult(Default::default());
        let code = |r: Result<(), Status>| r.err().map(|s| s.code());
        use tonic::Code::*;
        assert_eq!(
            code(authorize(acme, Rpc::AppendStream, &Target::default())),
            None
        );
        assert_eq!(
            code(authorize_append(acme, &request("acme:1", user()))),
            None
        );
        assert_eq!(
            code(authorize_append(acme, &request("acme:1", result()))),
            Some(PermissionDenied)
        );
        assert_eq!(
            code(authorize_append(acme, &request("beta:1", user()))),
            Some(PermissionDenied)
        );
        assert_eq!(
            code(authorize_append(pool, &request("beta:1", result()))),
            None
        );
        assert_eq!(
            code(authorize_append(pool, &request("beta:1", user()))),
            Some(PermissionDenied)
        );
    }

    #[test]
    fn roles_and_scopes() {
        let set = set();
        let acme = set.authenticate("tok-a").expect("known");
        let pool = set.authenticate("tok-r").expect("known");
        let user = Some(agentlog_proto::v1::event::Kind::UserMessage(
            Default::default(),
        ));
        let result = Some(agentlog_proto::v1::event::Kind::ToolResult(
            Default::default(),
        ));
        let append = |id: &str, kinds: Vec<_>| Target {
            session_id: id.into(),
            kinds,
        };
        let code = |r: Result<(), Status>| r.err().map(|s| s.code());
        use tonic::Code::*;
        assert_eq!(
            code(authorize(
                acme,
                Rpc::Append,
                &append("acme:1", vec![user.clone()])
            )),
            None
        );
        assert_eq!(
            code(authorize(
                acme,
                Rpc::Append,
                &append("acme:1", vec![result.clone()])
            )),
            Some(PermissionDenied)
        );
        assert_eq!(
            code(authorize(
                acme,
                Rpc::Append,
                &append("beta:1", vec![user.clone()])
            )),
            Some(PermissionDenied)
        );
        assert_eq!(
            code(authorize(acme, Rpc::GetSession, &append("beta:1", vec![]))),
            Some(NotFound)
        );
        assert_eq!(
            code(authorize(acme, Rpc::ClaimSession, &Target::default())),
            Some(PermissionDenied)
        );
        assert_eq!(
            code(authorize(
                pool,
                Rpc::Append,
                &append("beta:1", vec![result])
            )),
            None
        );
        assert_eq!(
            code(authorize(pool, Rpc::Append, &append("beta:1", vec![user]))),
            Some(PermissionDenied)
        );
        assert_eq!(
            code(authorize(
                pool,
                Rpc::AcquireLease,
                &append("beta:1", vec![])
            )),
            None
        );
    }
}
