//! What the model stand-ins (`anthropic_standin`, `openai_standin`) share: a real HTTP
//! server on `127.0.0.1:0`, and the journal behind it — the scripted replies, the faults
//! queued per turn, every request received and every rule a request broke.

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Result;
use axum::Router;
use serde_json::Value;
use tokio::sync::oneshot;

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
    pub faults: HashMap<usize, VecDeque<F>>,
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
}

impl<R, F> Journal<R, F> {
    pub fn new(replies: Vec<R>) -> Journal<R, F> {
        Journal {
            replies,
            faults: HashMap::new(),
            requests: Vec::new(),
            violations: Vec::new(),
            hook: None,
            streams_dropped: Vec::new(),
            api_key: None,
            foreign_turns: 0,
        }
    }

    /// The next fault queued for `turn` (faults for a turn are served in order).
    pub fn next_fault(&mut self, turn: usize) -> Option<F> {
        self.faults.get_mut(&turn).and_then(VecDeque::pop_front)
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

/// A running stand-in; the server stops when it is dropped.
pub struct Standin<R, F> {
    pub addr: SocketAddr,
    journal: Shared<R, F>,
    _stop: oneshot::Sender<()>,
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
        let listener = tokio::net::TcpListener::bind(addr).await?;
        let addr = listener.local_addr()?;
        let (stop, stopped) = oneshot::channel::<()>();
        tokio::spawn(async move {
            let _ = axum::serve(listener, app)
                .with_graceful_shutdown(async {
                    let _ = stopped.await;
                })
                .await;
        });
        Ok(Standin {
            addr,
            journal,
            _stop: stop,
        })
    }

    /// Serves `fault` to the next request for `turn` (faults for a turn are used in order).
    pub fn inject(&self, turn: usize, fault: F) {
        lock(&self.journal)
            .faults
            .entry(turn)
            .or_default()
            .push_back(fault);
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
    /// (unix ms): at the stand-in's next piece of the stream after the connection closed.
    pub fn streams_dropped(&self) -> Vec<i64> {
        lock(&self.journal).streams_dropped.clone()
    }
}
