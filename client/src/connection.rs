//! The connection to the event store: TLS for `https://` URLs (the store's CA from
//! `--tls-ca`, or the public web roots; a client certificate for mTLS), HTTP/2 keepalive,
//! and the caller's bearer token on every call, with the caller's trace context.
//!
//! Promise: the token is read once, from `--token-file` or `AGENTLOG_TOKEN`, kept in a
//! metadata value marked sensitive, and never logged or put in an error message.

use std::path::{Path, PathBuf};
use std::time::Duration;

use agentlog_proto::v1::event_store_client::EventStoreClient;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Certificate, Channel, ClientTlsConfig, Endpoint, Identity};

/// How much one stream may have in flight to this client, unread.
const STREAM_WINDOW_BYTES: u32 = 16 << 20;
/// How much all streams of the connection together may have in flight, unread.
const CONNECTION_WINDOW_BYTES: u32 = 32 << 20;

/// The environment variable that may hold the store token (instead of a file).
pub const TOKEN_ENV: &str = "AGENTLOG_TOKEN";

/// The event store client of every program (runner, CLI, bench, tests).
pub type StoreClient = EventStoreClient<InterceptedService<Channel, BearerToken>>;

/// How to reach the store.
#[derive(Debug, Clone, Default)]
pub struct StoreConnection {
    pub url: String,
    /// PEM CA that signed the store's certificate (default: the public web roots).
    pub tls_ca: Option<PathBuf>,
    /// PEM certificate and key this client presents (mTLS).
    pub client_cert: Option<PathBuf>,
    pub client_key: Option<PathBuf>,
    pub token_file: Option<PathBuf>,
    /// A token the caller already read (the runner reads its secrets at start); it wins
    /// over `token_file` and `AGENTLOG_TOKEN`.
    pub token: Option<BearerToken>,
}

#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("{0:?} is not an event store URL (http://HOST:PORT or https://HOST:PORT)")]
    Url(String),
    #[error("cannot read {what} {path}: {source}")]
    Read {
        what: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error("{0}")]
    Config(String),
}

/// Adds `authorization: Bearer <token>` to every call (when there is a token).
#[derive(Clone)]
pub struct BearerToken(Option<MetadataValue<Ascii>>);

impl std::fmt::Debug for BearerToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_some() {
            "BearerToken(<redacted>)"
        } else {
            "BearerToken(none)"
        })
    }
}

impl BearerToken {
    /// No token: calls go out without `authorization` (an open store).
    pub fn none() -> BearerToken {
        BearerToken(None)
    }

    /// `token` as `authorization: Bearer <token>` (surrounding whitespace ignored; an empty
    /// token is none).
    pub fn new(token: &str) -> Result<BearerToken, ConnectError> {
        let token = token.trim();
        if token.is_empty() {
            return Ok(BearerToken::none());
        }
        let mut value = MetadataValue::try_from(format!("Bearer {token}")).map_err(|_| {
            ConnectError::Config(
                "the store token holds characters not allowed in a header (use printable ASCII)"
                    .into(),
            )
        })?;
        value.set_sensitive(true);
        Ok(BearerToken(Some(value)))
    }

    /// A client on `channel` whose every call carries this token.
    pub fn client(self, channel: Channel) -> StoreClient {
        EventStoreClient::with_interceptor(channel, self)
    }
}

impl tonic::service::Interceptor for BearerToken {
    fn call(
        &mut self,
        mut request: tonic::Request<()>,
    ) -> Result<tonic::Request<()>, tonic::Status> {
        telemetry::propagation::inject(request.metadata_mut());
        if let Some(value) = &self.0 {
            request
                .metadata_mut()
                .insert("authorization", value.clone());
        }
        Ok(request)
    }
}

impl StoreConnection {
    /// A lazily connecting client (the store may come up after the caller; the channel
    /// reconnects by itself after an outage).
    pub fn client(&self) -> Result<StoreClient, ConnectError> {
        let token = self.bearer()?;
        Ok(token.client(self.endpoint()?.connect_lazy()))
    }

    /// The endpoint, with TLS for an `https://` URL. HTTP/2 keepalive pings find a
    /// connection that went silent (a blackholed network, a store that vanished without a
    /// FIN), so that calls fail and followers resubscribe instead of waiting forever. The
    /// receive windows let a snapshot (tens of MiB) or a log's history stream in without
    /// waiting on a window update every 2 MiB, hyper's default. Frames stay at 16 KiB: frames
    /// of up to 1 MiB made a catch-up about 5% faster but a resume from a snapshot about 8 ms
    /// slower at 100,000 events (bench/RESULTS.md).
    pub fn endpoint(&self) -> Result<Endpoint, ConnectError> {
        let mut endpoint = Endpoint::from_shared(self.url.clone())
            .map_err(|_| ConnectError::Url(self.url.clone()))?
            .connect_timeout(Duration::from_secs(5))
            .http2_keep_alive_interval(Duration::from_secs(5))
            .keep_alive_timeout(Duration::from_secs(5))
            .keep_alive_while_idle(true)
            .initial_stream_window_size(STREAM_WINDOW_BYTES)
            .initial_connection_window_size(CONNECTION_WINDOW_BYTES);
        if self.url.starts_with("https://") {
            let mut tls = ClientTlsConfig::new();
            tls = match &self.tls_ca {
                Some(ca) => tls.ca_certificate(Certificate::from_pem(read(ca, "--tls-ca")?)),
                None => tls.with_webpki_roots(),
            };
            match (&self.client_cert, &self.client_key) {
                (Some(cert), Some(key)) => {
                    tls = tls.identity(Identity::from_pem(
                        read(cert, "--tls-client-cert")?,
                        read(key, "--tls-client-key")?,
                    ))
                }
                (None, None) => {}
                _ => {
                    return Err(ConnectError::Config(
                        "--tls-client-cert and --tls-client-key go together".into(),
                    ))
                }
            }
            endpoint = endpoint
                .tls_config(tls)
                .map_err(|e| ConnectError::Config(format!("TLS configuration: {e}")))?;
        } else if self.tls_ca.is_some() || self.client_cert.is_some() {
            return Err(ConnectError::Config(
                "--tls-ca and --tls-client-cert need an https:// store URL".into(),
            ));
        }
        Ok(endpoint)
    }

    /// The bearer token every call carries (none without a token). Read once: reading it
    /// removes `AGENTLOG_TOKEN` from this process's environment.
    pub fn bearer(&self) -> Result<BearerToken, ConnectError> {
        let token = self.token()?;
        if token.is_some() && !self.url.starts_with("https://") && !is_loopback_url(&self.url) {
            tracing::warn!(
                "sending the store token over plaintext http to a non-loopback address; use an \
                 https:// store URL"
            );
        }
        Ok(BearerToken(token))
    }

    /// The token, from `--token-file` or `AGENTLOG_TOKEN` (then removed from this process's
    /// environment, so nothing spawned later could inherit it).
    fn token(&self) -> Result<Option<MetadataValue<Ascii>>, ConnectError> {
        if let Some(BearerToken(token)) = &self.token {
            return Ok(token.clone());
        }
        let raw = match &self.token_file {
            Some(path) => Some(String::from_utf8(read(path, "--token-file")?).map_err(|_| {
                ConnectError::Config(format!("--token-file {} is not text", path.display()))
            })?),
            None => std::env::var(TOKEN_ENV).ok(),
        };
        std::env::remove_var(TOKEN_ENV);
        match raw {
            Some(raw) => Ok(BearerToken::new(&raw)?.0),
            None => Ok(None),
        }
    }
}

fn read(path: &Path, what: &'static str) -> Result<Vec<u8>, ConnectError> {
    std::fs::read(path).map_err(|source| ConnectError::Read {
        what,
        path: path.display().to_string(),
        source,
    })
}

fn is_loopback_url(url: &str) -> bool {
    let host = url
        .split("://")
        .nth(1)
        .unwrap_or(url)
        .split('/')
        .next()
        .unwrap_or("");
    let host = host.rsplit_once(':').map_or(host, |(h, _)| h);
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host == "localhost"
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn loopback_urls() {
        assert!(is_loopback_url("http://127.0.0.1:50051"));
        assert!(is_loopback_url("http://localhost:1"));
        assert!(is_loopback_url("http://[::1]:50051"));
        assert!(!is_loopback_url("http://event-store:50051"));
        assert!(!is_loopback_url("http://10.0.0.1:50051"));
    }

    #[tokio::test]
    async fn the_token_never_shows_in_debug_output() {
        let conn = StoreConnection {
            url: "http://127.0.0.1:1".into(),
            ..Default::default()
        };
        let shown = format!("{:?}", BearerToken::new(" s3cret\n").expect("ascii"));
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(conn.client().is_ok());
    }
}
