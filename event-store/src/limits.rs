//! Per-caller limits, so that one tenant cannot starve another: a request rate (token
//! bucket), concurrent subscriptions, and (with [`crate::incoming`]) connections per peer
//! address. Over a limit the call is answered `RESOURCE_EXHAUSTED`, saying which limit.
//!
//! A caller is the token's name; on an open store (no tokens file) it is the peer address.
//! Health checks are never limited: a probe must not fail because a tenant is busy.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tokio::time::Instant;
use tonic::body::Body;
use tonic::codegen::http::{Request, Response};
use tonic::Status;

use crate::auth::Caller;
use crate::incoming::PeerInfo;
use crate::wire::{Route, Rpc};

/// Beyond this many tracked callers, idle ones are forgotten.
const MAX_TRACKED_CALLERS: usize = 10_000;

#[derive(Debug, Clone, Copy)]
pub struct CallerLimits {
    /// Sustained requests per second per caller (0: no limit).
    pub requests_per_sec: u32,
    /// Requests a caller may make at once above the sustained rate.
    pub burst: u32,
    /// Subscribe streams one caller may have open at once (0: no limit).
    pub max_subscriptions: usize,
}

struct CallerState {
    tokens: f64,
    refilled: Instant,
    subscriptions: Arc<AtomicUsize>,
}

pub struct Limits {
    config: CallerLimits,
    callers: Mutex<HashMap<Arc<str>, CallerState>>,
}

impl Limits {
    pub fn new(config: CallerLimits) -> Limits {
        Limits {
            config,
            callers: Mutex::new(HashMap::new()),
        }
    }

    /// Whether a call is counted at all: not when no limit applies to it.
    fn counts(&self, subscribe: bool) -> bool {
        self.config.requests_per_sec > 0 || (subscribe && self.config.max_subscriptions > 0)
    }

    /// Takes one request from `caller`'s budget; for a subscription also a stream slot,
    /// held until the returned guard is dropped.
    fn admit(&self, caller: Arc<str>, subscribe: bool) -> Result<Option<SubscriptionSlot>, Status> {
        let now = Instant::now();
        let config = self.config;
        let mut callers = self.callers.lock().unwrap_or_else(|p| p.into_inner());
        if callers.len() >= MAX_TRACKED_CALLERS && !callers.contains_key(&caller) {
            callers.retain(|_, s| {
                s.subscriptions.load(Ordering::Relaxed) > 0
                    || now.duration_since(s.refilled).as_secs() < 60
            });
        }
        let state = callers
            .entry(caller.clone())
            .or_insert_with(|| CallerState {
                tokens: f64::from(config.burst.max(1)),
                refilled: now,
                subscriptions: Arc::new(AtomicUsize::new(0)),
            });
        if config.requests_per_sec > 0 {
            let capacity = f64::from(config.burst.max(1));
            let elapsed = now.duration_since(state.refilled).as_secs_f64();
            state.tokens =
                (state.tokens + elapsed * f64::from(config.requests_per_sec)).min(capacity);
            state.refilled = now;
            if state.tokens < 1.0 {
                return Err(Status::resource_exhausted(format!(
                    "caller {caller:?} is over its request rate ({} per second, bursts of {}); \
                     slow down and retry",
                    config.requests_per_sec, config.burst
                )));
            }
            state.tokens -= 1.0;
        } else {
            state.refilled = now;
        }
        if !subscribe {
            return Ok(None);
        }
        let open = state.subscriptions.fetch_add(1, Ordering::SeqCst);
        let slot = SubscriptionSlot(state.subscriptions.clone());
        if config.max_subscriptions > 0 && open >= config.max_subscriptions {
            drop(slot);
            return Err(Status::resource_exhausted(format!(
                "caller {caller:?} has {open} subscriptions open, the limit is {}; close one \
                 (one follow stream per session is enough)",
                config.max_subscriptions
            )));
        }
        Ok(Some(slot))
    }
}

/// A streaming call's caller and its request budget: the service takes one request from it
/// per message, so a stream of appends is held to the same rate as single calls.
#[derive(Clone)]
pub struct MessageBudget {
    limits: Arc<Limits>,
    caller: Arc<str>,
}

impl MessageBudget {
    /// One request from the budget, or `RESOURCE_EXHAUSTED` saying which limit.
    pub fn take(&self) -> Result<(), Status> {
        self.limits.admit(self.caller.clone(), false).map(|_| ())
    }
}

/// One open subscription, counted until the response stream is dropped.
struct SubscriptionSlot(Arc<AtomicUsize>);

impl Drop for SubscriptionSlot {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[derive(Clone)]
pub struct LimitsLayer {
    limits: Arc<Limits>,
}

impl LimitsLayer {
    pub fn new(limits: CallerLimits) -> LimitsLayer {
        LimitsLayer {
            limits: Arc::new(Limits::new(limits)),
        }
    }
}

impl<S> tower::Layer<S> for LimitsLayer {
    type Service = Limited<S>;

    fn layer(&self, inner: S) -> Limited<S> {
        Limited {
            inner,
            limits: self.limits.clone(),
        }
    }
}

#[derive(Clone)]
pub struct Limited<S> {
    inner: S,
    limits: Arc<Limits>,
}

type BoxFuture<T> = Pin<Box<dyn std::future::Future<Output = T> + Send>>;

impl<S> tower::Service<Request<Body>> for Limited<S>
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

    fn call(&mut self, mut request: Request<Body>) -> Self::Future {
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let route = Route::of(&request);
        if route == Route::Open {
            return Box::pin(inner.call(request));
        }
        let peer = request.extensions().get::<PeerInfo>();
        if let Some(reason) = peer.and_then(|p| p.over_limit.clone()) {
            return Box::pin(async move { Ok(Status::resource_exhausted(&*reason).into_http()) });
        }
        let subscribe = route == Route::Store(Rpc::Subscribe);
        if !self.limits.counts(subscribe) {
            return Box::pin(inner.call(request));
        }
        let key: Arc<str> = match request.extensions().get::<Caller>() {
            Some(caller) if caller.authenticated => caller.name.clone(),
            _ => match peer.and_then(|p| p.remote) {
                Some(addr) => addr.ip().to_string().into(),
                None => "unknown peer".into(),
            },
        };
        let slot = match self.limits.admit(key.clone(), subscribe) {
            Ok(slot) => slot,
            Err(status) => return Box::pin(async move { Ok(status.into_http()) }),
        };
        if route == Route::Store(Rpc::AppendStream) {
            request.extensions_mut().insert(MessageBudget {
                limits: self.limits.clone(),
                caller: key,
            });
        }
        Box::pin(async move {
            let response = inner.call(request).await?;
            Ok(match slot {
                None => response,
                // The slot lives as long as the stream: the response body owns it.
                Some(slot) => response.map(|body| Body::new(WithSlot { body, _slot: slot })),
            })
        })
    }
}

/// A response body that holds a subscription slot until it is dropped.
struct WithSlot {
    body: Body,
    _slot: SubscriptionSlot,
}

impl http_body::Body for WithSlot {
    type Data = bytes::Bytes;
    type Error = Status;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<bytes::Bytes>, Status>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
    }
}
