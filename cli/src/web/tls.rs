//! HTTPS for `agentlog web`: the certificate and key from `--tls-cert`/`--tls-key`, and a
//! listener whose handshakes run beside the accept loop, so one client that never finishes
//! its handshake delays nobody else.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::{self, ServerConfig};
use tokio_rustls::server::TlsStream;
use tokio_rustls::TlsAcceptor;

/// A handshake that takes longer than this is dropped.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// Handshaken connections waiting for the HTTP server to take them.
const READY_QUEUE: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {flag} {path}: {source}")]
    Read {
        flag: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error("{flag} {path} holds no PEM {expected}")]
    Pem {
        flag: &'static str,
        path: String,
        expected: &'static str,
    },
    #[error("--tls-cert/--tls-key are not usable together: {0}")]
    Config(String),
}

/// The server configuration for `cert` (a PEM chain) and `key` (a PEM private key).
pub fn server_config(cert: &Path, key: &Path) -> Result<Arc<ServerConfig>, TlsError> {
    let read = |flag, path: &Path| {
        std::fs::read(path).map_err(|source| TlsError::Read {
            flag,
            path: path.display().to_string(),
            source,
        })
    };
    let pem_err = |flag, path: &Path, expected| TlsError::Pem {
        flag,
        path: path.display().to_string(),
        expected,
    };
    let cert_pem = read("--tls-cert", cert)?;
    let key_pem = read("--tls-key", key)?;
    let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&cert_pem)
        .collect::<Result<_, _>>()
        .map_err(|_| pem_err("--tls-cert", cert, "certificates"))?;
    if chain.is_empty() {
        return Err(pem_err("--tls-cert", cert, "certificates"));
    }
    let key = PrivateKeyDer::from_pem_slice(&key_pem)
        .map_err(|_| pem_err("--tls-key", key, "private key"))?;
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut config = ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| TlsError::Config(e.to_string()))?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(|e| TlsError::Config(e.to_string()))?;
    // The web server speaks HTTP/1.1 (Server-Sent Events need nothing more).
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// Accepts TCP connections and hands over those whose TLS handshake succeeded.
pub struct TlsListener {
    ready: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
}

impl TlsListener {
    pub fn new(tcp: TcpListener, config: Arc<ServerConfig>) -> std::io::Result<TlsListener> {
        let local = tcp.local_addr()?;
        let (tx, ready) = mpsc::channel(READY_QUEUE);
        let acceptor = TlsAcceptor::from(config);
        tokio::spawn(async move {
            loop {
                let (stream, peer) = match tcp.accept().await {
                    Ok(accepted) => accepted,
                    Err(e) => {
                        // Out of file descriptors and the like: wait, then go on.
                        eprintln!("agentlog web: accept failed: {e}");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue;
                    }
                };
                let acceptor = acceptor.clone();
                let tx = tx.clone();
                tokio::spawn(async move {
                    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await {
                        Ok(Ok(tls)) => {
                            let _ = tx.send((tls, peer)).await;
                        }
                        Ok(Err(e)) => eprintln!("agentlog web: TLS handshake with {peer}: {e}"),
                        Err(_) => eprintln!("agentlog web: TLS handshake with {peer} timed out"),
                    }
                });
            }
        });
        Ok(TlsListener { ready, local })
    }
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.ready.recv().await {
            Some(accepted) => accepted,
            // The accept loop never ends on its own; nothing more will come.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<SocketAddr> {
        Ok(self.local)
    }
}
