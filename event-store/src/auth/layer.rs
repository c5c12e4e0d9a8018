//! The tower layer: authenticates each call by its bearer token, works out which call it
//! is ([`Route`], put in the request extensions for the layers and the service after it),
//! reads the request message the [`super::policy`] needs and re-frames it for the service,
//! and hands the [`Caller`] on.

use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use agentlog_proto::v1::{AppendRequest, ForkSessionRequest};
use bytes::Bytes;
use http_body_util::BodyExt;
use prost::Message;
use tonic::body::Body;
use tonic::codegen::http::{Request, Response};
use tonic::Status;

use super::policy::{authorize, Target};
use super::tokens::TokensFileWatch;
use super::{Caller, Role};
use crate::wire::{route, Route, Rpc, MAX_APPEND_BYTES, MAX_DECODED_FRAME_BYTES};

/// How long a caller may take to send the (single) request message of a call.
const REQUEST_BODY_TIMEOUT: Duration = Duration::from_secs(60);

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
    request.extensions_mut().insert(route);
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
    if let (Route::Store(rpc), true) = (route, caller.role != Role::Admin) {
        let needs_message = !matches!(
            rpc,
            Rpc::ListSessions
                | Rpc::ClaimSession
                | Rpc::AppendStream
                | Rpc::PutSnapshot
                | Rpc::Export
                | Rpc::Import
        ) && rpc != Rpc::SearchSessions;
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
                MAX_APPEND_BYTES
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
            leased: req.lease_epoch.is_some(),
            kinds: req
                .events
                .into_iter()
                .map(|e| {
                    let replayed = super::policy::is_replayed_turn(&e.event_id);
                    (e.kind, replayed)
                })
                .collect(),
            ..Target::default()
        })
    } else if rpc == Rpc::ForkSession {
        let req = ForkSessionRequest::decode(message.clone()).map_err(undecodable)?;
        Ok(Target {
            session_id: req.session_id,
            new_session_id: req.new_session_id,
            ..Target::default()
        })
    } else {
        let req = NamesSession::decode(message.clone()).map_err(undecodable)?;
        Ok(Target {
            session_id: req.session_id,
            ..Target::default()
        })
    }
}

/// The request messages that name a session all carry it as field 1.
#[derive(Clone, PartialEq, Message)]
struct NamesSession {
    #[prost(string, tag = "1")]
    session_id: String,
}
