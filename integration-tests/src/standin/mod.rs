//! What the model stand-ins (`anthropic_standin`, `openai_standin`) share: a real HTTP
//! server on `127.0.0.1:0` that can go down and come back on its port ([`server`]), and the
//! journal behind it — the scripted replies, the faults scripted per model, per call and per
//! turn ([`script`]), every request received (which model it named, when, and what it was
//! served) and every rule a request broke. Every response is dated on the provider's clock
//! ([`advice`]), and dropping a stand-in closes its port and every connection at once. Both
//! stand-ins also serve `GET /journal` and the fault controls `POST /control/fail`, `/heal`
//! and `/clock` ([`control`]).

pub mod advice;
pub mod control;
pub mod script;
pub mod server;

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use anyhow::Result;
use axum::body::Bytes;
use axum::response::Response;
use axum::Router;
use serde_json::Value;
use tokio::sync::mpsc;

pub use advice::{Limit, ProviderClock, RateLimit, RetryAfter};
pub use script::{FaultPlan, FaultScript, PlanRequest};
pub use server::{refused_addr, Server};

/// A request a stand-in received.
#[derive(Debug, Clone)]
pub struct RecordedRequest {
    /// The number of assistant turns in the request: the turn being asked for.
    pub turn: usize,
    /// The text of the first user message (tells sessions apart).
    pub first_user_text: String,
    pub received_unix_ms: i64,
    /// What was served: `"reply"`, a fault's name, or `"rejected"`.
    pub served: String,
    /// The request body as sent.
    pub body: Value,
    /// The model the request named (its `model` field; empty when it named none).
    pub model: String,
    /// The request's index among the calls of its model, from 0 across all sessions.
    pub call: usize,
}

/// Called with each well-formed request's body before it is answered (the model's caller
/// waits meanwhile): for a test that looks at the world at that moment.
#[derive(Clone)]
pub struct Hook(pub Arc<dyn Fn(&Value) + Send + Sync>);

impl std::fmt::Debug for Hook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Hook")
    }
}

/// A stand-in's script (replies of type `R`, faults of type `F`) and what it has seen.
#[derive(Debug)]
pub struct Journal<R, F> {
    pub replies: Vec<R>,
    pub faults: FaultScript<F>,
    pub requests: Vec<RecordedRequest>,
    pub violations: Vec<String>,
    pub hook: Option<Hook>,
    /// When a streamed reply's caller went away before its end (unix ms), in order.
    pub streams_dropped: Vec<i64>,
    /// The API key requests must carry (any non-empty one when unset), as a provider checks
    /// its keys: a request with another gets the API's 401.
    pub api_key: Option<String>,
    /// How many leading assistant turns of a request another model wrote (a replay's
    /// recorded prefix): held to the API's rules, not to this stand-in's script.
    pub foreign_turns: usize,
    /// The provider's clock, on which every time it sends is written.
    pub clock: ProviderClock,
}

impl<R, F> Journal<R, F> {
    pub fn new(replies: Vec<R>) -> Journal<R, F> {
        Journal {
            replies,
            faults: FaultScript::default(),
            requests: Vec::new(),
            violations: Vec::new(),
            hook: None,
            streams_dropped: Vec::new(),
            api_key: None,
            foreign_turns: 0,
            clock: ProviderClock::default(),
        }
    }
}

/// The journal as the server's handlers and the test share it.
pub type Shared<R, F> = Arc<Mutex<Journal<R, F>>>;

/// The journal, whether or not a handler panicked while holding it.
pub fn lock<R, F>(shared: &Shared<R, F>) -> MutexGuard<'_, Journal<R, F>> {
    shared
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

/// A response that never starts: the request was read, and not one byte of the response
/// (not even its status line) is sent until the caller gives up and closes the connection.
pub async fn never_answer() -> Response {
    std::future::pending().await
}

/// What a streamed body is sent through: pieces, or an error that aborts the connection.
pub type BodySender = mpsc::Sender<Result<Bytes, std::io::Error>>;

/// Aborts a streamed response's connection once everything sent before has left, so the
/// caller gets those pieces and then a connection that closes before the stream's end.
/// (An error right behind the last piece could abort the connection before the server
/// wrote that piece out.)
pub async fn cut_connection(tx: &BodySender) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while tx.capacity() < tx.max_capacity() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    // Taken from the channel, the last piece is written out before the server asks the
    // body for more.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let _ = tx
        .send(Err(std::io::Error::other(
            "connection reset by the stand-in",
        )))
        .await;
}

/// A running stand-in; the server stops when it is dropped.
pub struct Standin<R, F> {
    pub addr: SocketAddr,
    journal: Shared<R, F>,
    server: Server,
}

impl<R, F> Standin<R, F> {
    /// Serves `app` (whose handlers share `journal`) on a free port; needs a running tokio
    /// runtime.
    pub async fn serve(journal: Shared<R, F>, app: Router) -> Result<Standin<R, F>> {
        Standin::serve_on(journal, app, SocketAddr::from(([127, 0, 0, 1], 0))).await
    }

    /// As [`Standin::serve`], on `addr` (the `model-standin` binary serves a container's
    /// network).
    pub async fn serve_on(
        journal: Shared<R, F>,
        app: Router,
        addr: SocketAddr,
    ) -> Result<Standin<R, F>> {
        let clock = lock(&journal).clock.clone();
        let server = Server::start(app, addr, clock).await?;
        Ok(Standin {
            addr: server.addr(),
            journal,
            server,
        })
    }

    /// Serves `fault` to the next request for `turn` (faults for a turn are used in order),
    /// unless the request's model has a fault scripted for it ([`Standin::fail_model`]).
    pub fn inject(&self, turn: usize, fault: F) {
        lock(&self.journal).faults.inject(turn, fault);
    }

    /// Adds `plan` to the faults of `model` (as requests name it in their `model` field);
    /// see [`script`] for which fault a call gets.
    pub fn fail_model(&self, model: &str, plan: FaultPlan<F>) {
        lock(&self.journal).faults.fail_model(model, plan);
    }

    /// Heals `model`: forgets every fault scripted for it (its calls keep counting).
    pub fn clear_model(&self, model: &str) {
        lock(&self.journal).faults.clear_model(model);
    }

    /// How many requests named `model` so far (the next call's index).
    pub fn calls_of(&self, model: &str) -> usize {
        lock(&self.journal)
            .faults
            .calls
            .get(model)
            .copied()
            .unwrap_or(0)
    }

    /// The requests that named `model`, in the order received.
    pub fn requests_of(&self, model: &str) -> Vec<RecordedRequest> {
        lock(&self.journal)
            .requests
            .iter()
            .filter(|r| r.model == model)
            .cloned()
            .collect()
    }

    /// Lets the provider's clock run `ms` ahead of this machine's (behind when negative):
    /// every time it sends (`date`, a `retry-after` date, a rate-limit reset) is on it.
    pub fn set_clock_skew_ms(&self, ms: i64) {
        lock(&self.journal).clock.set_skew_ms(ms);
    }

    /// Stops listening and closes every open connection, as a provider that went down:
    /// from the return on, a connection to [`Standin::addr`] is refused.
    pub async fn stop_listening(&self) {
        self.server.stop_listening().await;
    }

    /// Listens on the same address again (fails if the port was taken meanwhile).
    pub async fn listen_again(&self) -> Result<()> {
        self.server.listen_again().await
    }

    /// Takes the first `turns` assistant turns of every request as another model's (a
    /// replay's recorded prefix): they must follow the API's rules, but need not be this
    /// stand-in's replies. Its script still counts them (reply `turns` answers the first
    /// turn after them).
    pub fn foreign_turns(&self, turns: usize) {
        lock(&self.journal).foreign_turns = turns;
    }

    /// Runs `hook` on every well-formed request before it is answered.
    pub fn on_request(&self, hook: impl Fn(&Value) + Send + Sync + 'static) {
        lock(&self.journal).hook = Some(Hook(Arc::new(hook)));
    }

    pub fn requests(&self) -> Vec<RecordedRequest> {
        lock(&self.journal).requests.clone()
    }

    /// Every rule a request broke, in the words of the error it got.
    pub fn violations(&self) -> Vec<String> {
        lock(&self.journal).violations.clone()
    }

    /// When each streamed reply whose caller went away before its end was found dropped
    /// (unix ms): at the stand-in's next piece of the stream after the connection closed
    /// (a stalled stream: as soon as the connection closed).
    pub fn streams_dropped(&self) -> Vec<i64> {
        lock(&self.journal).streams_dropped.clone()
    }
}

#[cfg(test)]
mod tests;
