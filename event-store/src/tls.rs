//! TLS for the gRPC listener (rustls, `ring` provider), with certificates that can change
//! under a running store.
//!
//! Kubernetes rotates a mounted Secret by swapping the files in place; cert-manager renews
//! certificates weeks before they expire. So the server configuration is rebuilt whenever
//! the certificate, key or client CA files change (polled) or on SIGHUP, and each new
//! connection's handshake uses the configuration in force when it arrived. A rebuild that
//! fails (a half-written file, a key that does not match) is reported and the previous
//! configuration stays in force.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{self, RootCertStore, ServerConfig};
use tokio_rustls::TlsAcceptor;
use tokio_util::sync::CancellationToken;

/// Where the server's certificate chain, its key and (for mTLS) the client CA live.
#[derive(Debug, Clone)]
pub struct TlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Set: every client must present a certificate signed by this CA (mTLS).
    pub client_ca: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {what} {path}: {source}")]
    Read {
        what: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error("{what} {path} holds no usable PEM {expected}")]
    Pem {
        what: &'static str,
        path: String,
        expected: &'static str,
    },
    #[error("the TLS configuration is not usable: {0}")]
    Config(String),
}

/// A file's flag name, path and bytes.
type FileBytes<'a> = (&'static str, &'a Path, Vec<u8>);

impl TlsFiles {
    fn contents(&self) -> Result<Vec<FileBytes<'_>>, TlsError> {
        let mut files = vec![
            ("--tls-cert", self.cert.as_path()),
            ("--tls-key", &self.key),
        ];
        if let Some(ca) = &self.client_ca {
            files.push(("--tls-client-ca", ca));
        }
        files
            .into_iter()
            .map(|(what, path)| {
                std::fs::read(path)
                    .map(|bytes| (what, path, bytes))
                    .map_err(|source| TlsError::Read {
                        what,
                        path: path.display().to_string(),
                        source,
                    })
            })
            .collect()
    }

    /// Builds a server configuration from the files as they are now, and a digest of what
    /// was read (to notice a change).
    pub fn load(&self) -> Result<(Arc<ServerConfig>, [u8; 32]), TlsError> {
        let contents = self.contents()?;
        let mut digest = ring::digest::Context::new(&ring::digest::SHA256);
        for (_, _, bytes) in &contents {
            digest.update(&(bytes.len() as u64).to_le_bytes());
            digest.update(bytes);
        }
        let mut fingerprint = [0u8; 32];
        fingerprint.copy_from_slice(digest.finish().as_ref());
        let pem_err = |i: usize, expected| TlsError::Pem {
            what: contents[i].0,
            path: contents[i].1.display().to_string(),
            expected,
        };
        let chain: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&contents[0].2)
            .collect::<Result<_, _>>()
            .map_err(|_| pem_err(0, "certificates"))?;
        if chain.is_empty() {
            return Err(pem_err(0, "certificates"));
        }
        let key =
            PrivateKeyDer::from_pem_slice(&contents[1].2).map_err(|_| pem_err(1, "private key"))?;
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| TlsError::Config(e.to_string()))?;
        let builder = match contents.get(2) {
            None => builder.with_no_client_auth(),
            Some((_, _, ca_pem)) => {
                let mut roots = RootCertStore::empty();
                for cert in CertificateDer::pem_slice_iter(ca_pem) {
                    let cert = cert.map_err(|_| pem_err(2, "CA certificates"))?;
                    roots
                        .add(cert)
                        .map_err(|e| TlsError::Config(format!("--tls-client-ca: {e}")))?;
                }
                if roots.is_empty() {
                    return Err(pem_err(2, "CA certificates"));
                }
                let verifier =
                    WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                        .build()
                        .map_err(|e| TlsError::Config(format!("--tls-client-ca: {e}")))?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder
            .with_single_cert(chain, key)
            .map_err(|e| TlsError::Config(format!("--tls-cert/--tls-key: {e}")))?;
        // gRPC is HTTP/2 only; clients (grpc-go, grpcurl) insist on negotiating it.
        config.alpn_protocols = vec![b"h2".to_vec()];
        Ok((Arc::new(config), fingerprint))
    }
}

/// The server TLS configuration in force, rebuilt when its files change.
pub struct ReloadingTls {
    files: TlsFiles,
    current: RwLock<Arc<ServerConfig>>,
    last_seen: Mutex<[u8; 32]>,
}

impl ReloadingTls {
    pub fn open(files: TlsFiles) -> Result<ReloadingTls, TlsError> {
        let (config, fingerprint) = files.load()?;
        Ok(ReloadingTls {
            files,
            current: RwLock::new(config),
            last_seen: Mutex::new(fingerprint),
        })
    }

    /// An acceptor with the configuration in force now.
    pub fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(
            self.current
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
        )
    }

    pub fn requires_client_cert(&self) -> bool {
        self.files.client_ca.is_some()
    }
}

/// Something re-read from files at run time (the TLS configuration, the tokens file).
pub trait Reload: Send + Sync {
    /// Names it in log lines.
    fn what(&self) -> &'static str;
    /// Re-reads the files; `Ok(Some(summary))` if something new took effect, `Ok(None)` if
    /// nothing changed, `Err` (a message without secrets) if the new files were refused.
    fn reload(&self, forced: bool) -> Result<Option<String>, String>;
}

impl Reload for ReloadingTls {
    fn what(&self) -> &'static str {
        "TLS certificate"
    }

    fn reload(&self, forced: bool) -> Result<Option<String>, String> {
        // Cheap check first: the files' bytes, before any parsing.
        let contents = self.files.contents().map_err(|e| e.to_string())?;
        let mut digest = ring::digest::Context::new(&ring::digest::SHA256);
        for (_, _, bytes) in &contents {
            digest.update(&(bytes.len() as u64).to_le_bytes());
            digest.update(bytes);
        }
        let mut fingerprint = [0u8; 32];
        fingerprint.copy_from_slice(digest.finish().as_ref());
        {
            let mut last = self.last_seen.lock().unwrap_or_else(|p| p.into_inner());
            if *last == fingerprint && !forced {
                return Ok(None);
            }
            *last = fingerprint;
        }
        let (config, _) = self.files.load().map_err(|e| {
            format!("{e}; the previous certificate stays in force (retried when the files change)")
        })?;
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = config;
        Ok(Some("new connections use the new files".into()))
    }
}

/// Re-reads everything in `watched` every `interval` (a change takes effect) and on SIGHUP
/// (forced), until `shutdown`.
pub async fn watch_files(
    watched: Vec<Arc<dyn Reload>>,
    interval: Duration,
    shutdown: CancellationToken,
) {
    if watched.is_empty() {
        return;
    }
    let mut hangup = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()) {
        Ok(hangup) => Some(hangup),
        Err(e) => {
            tracing::warn!(error = %e, "cannot listen for SIGHUP; reloading on change only");
            None
        }
    };
    loop {
        let forced = tokio::select! {
            _ = shutdown.cancelled() => return,
            _ = tokio::time::sleep(interval) => false,
            Some(()) = async { match hangup.as_mut() { Some(h) => h.recv().await, None => None } } => {
                tracing::info!("SIGHUP: reloading the certificate and tokens files");
                true
            }
        };
        for item in &watched {
            match item.reload(forced) {
                Ok(None) => {}
                Ok(Some(summary)) => tracing::info!(what = item.what(), %summary, "reloaded"),
                Err(message) => {
                    tracing::error!(what = item.what(), error = %message, "reload refused")
                }
            }
        }
    }
}
