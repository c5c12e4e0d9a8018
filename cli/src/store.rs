//! Reaching the event store: one place that turns `--addr` into a channel (through
//! `agentlog_client`, as the runner does) and a failed call into an error that says what to
//! fix.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use agentlog_client::refusal::is_session_deleted;
use agentlog_client::{BearerToken, StoreConnection};
use agentlog_proto::release::Release;
use anyhow::{anyhow, Result};
use tonic::transport::{Channel, Endpoint};
use tonic::Code;

/// The same client (TLS, bearer token) the runner uses.
pub type Client = agentlog_client::StoreClient;

/// How this process authenticates to the store: the CA to trust for an `https://` address
/// and the bearer token (from `--token-file` or `AGENTLOG_TOKEN`), set once by `main`.
struct Credentials {
    tls_ca: Option<PathBuf>,
    bearer: BearerToken,
}

static CREDENTIALS: OnceLock<Credentials> = OnceLock::new();

/// Reads the token (once) and remembers the CA for every connection this process makes.
pub fn configure(addr: &str, tls_ca: Option<PathBuf>, token_file: Option<PathBuf>) -> Result<()> {
    let connection = StoreConnection {
        url: normalize(addr),
        token_file,
        ..StoreConnection::default()
    };
    let bearer = connection.bearer()?;
    // A second call keeps the first credentials (main calls this once).
    let _ = CREDENTIALS.set(Credentials { tls_ca, bearer });
    Ok(())
}

/// A client on `channel` that sends this process's bearer token, if any.
pub fn client(channel: Channel) -> Client {
    let bearer = match CREDENTIALS.get() {
        Some(credentials) => credentials.bearer.clone(),
        None => BearerToken::none(),
    };
    bearer.client(channel)
}

/// The default `--addr`: where `agentlog up` serves the store.
pub const DEFAULT_ADDR: &str = "http://127.0.0.1:50051";

/// The endpoint for `addr` (`http://HOST:PORT`; a bare `HOST:PORT` is taken as http), with
/// HTTP/2 keepalive (see `StoreConnection::endpoint`). An `https://` address gets TLS,
/// trusting `--tls-ca` (or the public web roots).
pub fn endpoint(addr: &str) -> Result<Endpoint> {
    let connection = StoreConnection {
        url: normalize(addr),
        tls_ca: CREDENTIALS.get().and_then(|c| c.tls_ca.clone()),
        ..StoreConnection::default()
    };
    let endpoint = connection
        .endpoint()
        .map_err(|e| anyhow!("--addr {addr:?}: {e}"))?;
    // A person waits for "no event store at …": say it sooner than a runner gives up.
    Ok(endpoint.connect_timeout(Duration::from_secs(3)))
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
    Ok(client(channel))
}

/// The release of the store behind `client`, as a response of it names it (a refusal's
/// too; release 0.1.0 names none): asked with a `GetSession` of `session`.
pub async fn release(client: &mut Client, session: &str) -> Release {
    let answer = client
        .get_session(agentlog_proto::v1::GetSessionRequest {
            session_id: session.to_string(),
        })
        .await;
    let metadata = match &answer {
        Ok(response) => response.metadata(),
        Err(status) => status.metadata(),
    };
    Release::of_header(
        metadata
            .get(agentlog_proto::release::HEADER)
            .and_then(|v| v.to_str().ok()),
    )
}

pub fn not_reachable(addr: &str) -> anyhow::Error {
    anyhow!(
        "no event store at {}: start one with `agentlog up` (or point --addr / AGENTLOG_ADDR at a running one)",
        normalize(addr)
    )
}

/// The store refused a call because the session was deleted: it is gone for good.
#[derive(Debug, thiserror::Error)]
#[error("the session was deleted: its events are gone and it takes no more")]
pub struct SessionDeleted;

/// A failed call as the user should read it (a deleted session as [`SessionDeleted`], so
/// that callers can tell it apart).
pub fn explain(addr: &str, what: &str, status: tonic::Status) -> anyhow::Error {
    if is_session_deleted(&status) {
        return anyhow::Error::new(SessionDeleted);
    }
    match status.code() {
        Code::Unavailable => not_reachable(addr),
        // The store looked at the request and said no: its message says why and what to fix.
        Code::InvalidArgument
        | Code::FailedPrecondition
        | Code::AlreadyExists
        | Code::NotFound
        | Code::OutOfRange
        | Code::Aborted
        | Code::ResourceExhausted
        | Code::PermissionDenied
        | Code::Unauthenticated => anyhow!("{what}: the store refused it: {}", status.message()),
        _ => anyhow!("{what} failed ({:?}): {}", status.code(), status.message()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_reads_the_same_whatever_its_code() {
        for code in [
            Code::InvalidArgument,
            Code::FailedPrecondition,
            Code::AlreadyExists,
        ] {
            let said = explain(
                "a:1",
                "ForkSession",
                tonic::Status::new(code, "seq 4 is not settled"),
            );
            assert_eq!(
                said.to_string(),
                "ForkSession: the store refused it: seq 4 is not settled"
            );
        }
        let failed = explain("a:1", "ForkSession", tonic::Status::internal("disk"));
        assert_eq!(failed.to_string(), "ForkSession failed (Internal): disk");
    }
}
