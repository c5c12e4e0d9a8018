//! Reaching the event store: one place that turns `--addr` into a channel and a failed call
//! into an error that says what to fix.

use std::time::Duration;

use agentlog_proto::v1::event_store_client::EventStoreClient;
use anyhow::{anyhow, Context, Result};
use tonic::transport::{Channel, Endpoint};
use tonic::Code;

pub type Client = EventStoreClient<Channel>;

/// The default `--addr`: where `agentlog up` serves the store.
pub const DEFAULT_ADDR: &str = "http://127.0.0.1:50051";

/// The endpoint for `addr` (`http://HOST:PORT`; a bare `HOST:PORT` is taken as http).
///
/// HTTP/2 keepalive pings find a connection that went silent (a blackholed network, a
/// store that vanished without a FIN) so that followers reconnect instead of waiting
/// forever.
///
/// TLS hook: when the store serves TLS, an `https://` address is where a
/// `tonic::transport::ClientTlsConfig` (CA, client identity) gets attached, here and only
/// here; the CLI does not configure one yet.
pub fn endpoint(addr: &str) -> Result<Endpoint> {
    let url = normalize(addr);
    let endpoint = Endpoint::from_shared(url.clone())
        .with_context(|| format!("--addr {addr:?} is not a URL; use http://HOST:PORT"))?;
    Ok(endpoint
        .connect_timeout(Duration::from_secs(3))
        .http2_keep_alive_interval(Duration::from_secs(5))
        .keep_alive_timeout(Duration::from_secs(5))
        .keep_alive_while_idle(true))
}

/// `HOST:PORT` → `http://HOST:PORT`; URLs are kept as they are.
pub fn normalize(addr: &str) -> String {
    if addr.contains("://") {
        addr.to_string()
    } else {
        format!("http://{addr}")
    }
}

/// Connects now, so that a store that is not there is reported up front.
pub async fn connect(addr: &str) -> Result<Client> {
    let channel = endpoint(addr)?
        .connect()
        .await
        .map_err(|_| not_reachable(addr))?;
    Ok(EventStoreClient::new(channel))
}

pub fn not_reachable(addr: &str) -> anyhow::Error {
    anyhow!(
        "no event store at {}: start one with `agentlog up` (or point --addr / AGENTLOG_ADDR at a running one)",
        normalize(addr)
    )
}

/// Whether a failed call is worth repeating against the same store: it was unreachable
/// or went away mid-call (a restart, a cut connection).
pub fn is_transient(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        Code::Unavailable | Code::Unknown | Code::Cancelled | Code::DeadlineExceeded
    )
}

/// A failed call as the user should read it.
pub fn explain(addr: &str, what: &str, status: tonic::Status) -> anyhow::Error {
    match status.code() {
        Code::Unavailable => not_reachable(addr),
        Code::InvalidArgument => anyhow!("{what}: the store refused it: {}", status.message()),
        _ => anyhow!("{what} failed ({:?}): {}", status.code(), status.message()),
    }
}

/// Capped, jittered exponential backoff for reconnects.
#[derive(Debug)]
pub struct Backoff {
    next: Duration,
}

impl Backoff {
    const FIRST: Duration = Duration::from_millis(100);
    const MAX: Duration = Duration::from_secs(3);

    pub fn new() -> Backoff {
        Backoff { next: Self::FIRST }
    }

    /// Called after progress: the next failure starts over from the shortest wait.
    pub fn reset(&mut self) {
        self.next = Self::FIRST;
    }

    /// Sleeps for the current delay (with ±25% jitter) and doubles it up to the cap.
    pub async fn wait(&mut self) {
        let base = self.next.as_millis() as u64;
        let jitter = fastrand::u64(0..=base / 2);
        tokio::time::sleep(Duration::from_millis(base * 3 / 4 + jitter)).await;
        self.next = (self.next * 2).min(Self::MAX);
    }
}

impl Default for Backoff {
    fn default() -> Backoff {
        Backoff::new()
    }
}
