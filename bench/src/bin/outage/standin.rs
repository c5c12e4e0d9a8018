//! The model provider of the drill: integration-tests' `model-standin` program (the Anthropic
//! Messages API answering from a script), started on a free port, its model failed and
//! healed over its HTTP control endpoints and its journal read back, as a test whose
//! runners live in containers drives it (`integration-tests/src/standin/control.rs`).

use std::net::SocketAddr;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::scrape::free_port;

/// A running `model-standin`; stopped when dropped.
pub struct Standin {
    child: Child,
    addr: SocketAddr,
}

/// One call the stand-in received, as its journal tells it.
#[derive(Debug, Clone)]
pub struct Call {
    /// `"reply"`, or the fault it was served (`"overloaded"`).
    pub served: String,
    pub received_unix_ms: i64,
}

impl Standin {
    /// Serves `script` (one reply a line, chosen by the assistant turns in the request) on a
    /// free port; its log goes to `log`.
    pub async fn start(script: &Path, log: &Path) -> anyhow::Result<Standin> {
        let addr = SocketAddr::from(([127, 0, 0, 1], free_port()?));
        let child = Command::new(testkit::bin_path("model-standin"))
            .arg("--listen")
            .arg(addr.to_string())
            .arg("--script")
            .arg(script)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log)?)
            .spawn()
            .context("start model-standin (cargo build -p integration-tests --bins)")?;
        let standin = Standin { child, addr };
        let deadline = Instant::now() + Duration::from_secs(30);
        while standin.request("GET", "/journal", None).await.is_err() {
            if Instant::now() > deadline {
                bail!("model-standin did not answer on {addr} within 30 s (its log: {log:?})");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(standin)
    }

    /// Where the runners reach it (`ANTHROPIC_BASE_URL`).
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Every call of `model` from now on gets `fault`, until [`Standin::heal`].
    pub async fn fail(&self, model: &str, fault: Value) -> anyhow::Result<()> {
        self.control("/control/fail", json!({ "model": model, "fault": fault }))
            .await
    }

    /// `model` answers again.
    pub async fn heal(&self, model: &str) -> anyhow::Result<()> {
        self.control("/control/heal", json!({ "model": model }))
            .await
    }

    /// The calls of `model` so far, in the order received.
    pub async fn calls(&self, model: &str) -> anyhow::Result<Vec<Call>> {
        let (status, body) = self.request("GET", "/journal", None).await?;
        if status != 200 {
            bail!("GET /journal answered {status}");
        }
        let journal: Value = serde_json::from_slice(&body).context("the journal's JSON")?;
        let calls = journal["calls"].as_array().context("the journal's calls")?;
        Ok(calls
            .iter()
            .filter(|c| c["model"] == model)
            .map(|c| Call {
                served: c["served"].as_str().unwrap_or("?").to_string(),
                received_unix_ms: c["received_unix_ms"].as_i64().unwrap_or(0),
            })
            .collect())
    }

    async fn control(&self, path: &str, body: Value) -> anyhow::Result<()> {
        let (status, answer) = self.request("POST", path, Some(&body)).await?;
        if status != 200 {
            bail!(
                "POST {path} answered {status}: {}",
                String::from_utf8_lossy(&answer)
            );
        }
        Ok(())
    }

    /// One HTTP/1.0 request (the server closes the connection after its answer): the status
    /// and the body.
    async fn request(
        &self,
        method: &str,
        path: &str,
        body: Option<&Value>,
    ) -> anyhow::Result<(u16, Vec<u8>)> {
        let body = body.map(Value::to_string).unwrap_or_default();
        let mut stream = tokio::net::TcpStream::connect(self.addr).await?;
        let head = format!(
            "{method} {path} HTTP/1.0\r\nHost: {}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\n\r\n",
            self.addr,
            body.len()
        );
        stream.write_all(head.as_bytes()).await?;
        stream.write_all(body.as_bytes()).await?;
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await?;
        let split = answer
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .context("an HTTP answer without a blank line")?;
        let status = String::from_utf8_lossy(&answer[..split])
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .context("an HTTP answer without a status")?;
        Ok((status, answer[split + 4..].to_vec()))
    }
}

impl Drop for Standin {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
