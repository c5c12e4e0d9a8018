//! Shared by the telemetry tests: the real `event-store` and `runner` started with
//! `--metrics-listen` (and whatever environment a test adds, e.g. an OTLP endpoint), and a
//! plain HTTP scrape of `/metrics`.
#![allow(dead_code)] // each test file uses its own subset

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use integration_tests::{bin_path, signal, Signal};

/// A binary started with `--metrics-listen 127.0.0.1:0`; SIGKILLed when dropped.
pub struct Observed {
    child: Child,
    /// The gRPC address (the store only).
    pub listen: Option<SocketAddr>,
    pub metrics: SocketAddr,
}

impl Observed {
    /// SIGTERM, then waits (30 s at most) for a clean exit: both binaries flush their last
    /// spans on the way out.
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        signal(self.child.id(), Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status;
            }
            assert!(Instant::now() < deadline, "no exit within 30 s of SIGTERM");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Scrapes `/metrics` now.
    pub fn scrape(&self) -> Metrics {
        scrape(self.metrics)
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.listen.expect("a gRPC address"))
    }
}

impl Drop for Observed {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `event-store` on a free port and `data_dir`, metrics on another free port.
pub fn start_store(data_dir: &Path, env: &[(&str, &str)]) -> Observed {
    let mut command = Command::new(bin_path("event-store"));
    command
        .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
        .arg("--data-dir")
        .arg(data_dir);
    start(command, "event-store", env, true)
}

/// `event-store` over the PostgreSQL database at `database_url`, metrics on a free port.
pub fn start_store_on_database(database_url: &str, extra: &[&str]) -> Observed {
    let mut command = Command::new(bin_path("event-store"));
    command
        .args(["--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0"])
        .args(["--database-url", database_url])
        .args(extra);
    start(command, "event-store", &[], true)
}

/// `runner` against `store_url` with the Anthropic stand-in at `model_url`.
pub fn start_runner(
    store_url: &str,
    workspace_root: &Path,
    model_url: &str,
    env: &[(&str, &str)],
) -> Observed {
    let mut command = Command::new(bin_path("runner"));
    command
        .args(["--event-store", store_url, "--runner-id", "r1"])
        .args(["--model", "anthropic:standin-1", "--lease-ttl-ms", "3000"])
        .args(["--metrics-listen", "127.0.0.1:0", "--workspace-root"])
        .arg(workspace_root)
        .env("ANTHROPIC_BASE_URL", model_url)
        .env("ANTHROPIC_API_KEY", "test-key");
    start(command, "runner", env, false)
}

fn start(mut command: Command, name: &str, env: &[(&str, &str)], grpc: bool) -> Observed {
    command
        .env(
            "RUST_LOG",
            std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
        )
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    let mut child = command.spawn().expect("spawn");
    let stderr = child.stderr.take().expect("piped stderr");
    let (tx, rx) = mpsc::channel();
    let name = name.to_string();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("[{name}] {line}");
            for key in ["listen_addr=", "metrics_addr="] {
                if let Some(addr) = address_after(&line, key) {
                    let _ = tx.send((key, addr));
                }
            }
        }
    });
    let (mut listen, mut metrics) = (None, None);
    while metrics.is_none() || (grpc && listen.is_none()) {
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(("listen_addr=", addr)) => listen = Some(addr),
            Ok((_, addr)) => metrics = Some(addr),
            Err(_) => panic!("the binary did not log its addresses within 60 s"),
        }
    }
    Observed {
        child,
        listen,
        metrics: metrics.expect("metrics address"),
    }
}

fn address_after(line: &str, key: &str) -> Option<SocketAddr> {
    let rest = line.split(key).nth(1)?;
    rest.split_whitespace()
        .next()?
        .trim_matches('"')
        .parse()
        .ok()
}

/// One scrape: each sample line `name{labels} value`, keyed by `name{labels}` exactly as
/// exposed.
pub struct Metrics {
    pub text: String,
    samples: HashMap<String, f64>,
}

impl Metrics {
    /// The sample's value; 0 when the series is absent (a counter not yet touched).
    pub fn get(&self, series: &str) -> f64 {
        self.samples.get(series).copied().unwrap_or(0.0)
    }

    /// Every metric family named by a `# TYPE` line.
    pub fn families(&self) -> Vec<String> {
        self.text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split_whitespace().next())
            .map(str::to_string)
            .collect()
    }
}

pub fn scrape(addr: SocketAddr) -> Metrics {
    let mut stream = TcpStream::connect(addr).expect("connect to /metrics");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .expect("read timeout");
    write!(
        stream,
        "GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("send the request");
    let mut response = String::new();
    stream
        .read_to_string(&mut response)
        .expect("read the response");
    let (head, body) = response.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(head.starts_with("HTTP/1.1 200"), "scrape failed: {head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/openmetrics-text"),
        "{head}"
    );
    let samples = body
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| {
            let (series, value) = l.rsplit_once(' ')?;
            Some((series.to_string(), value.parse().ok()?))
        })
        .collect();
    Metrics {
        text: body.to_string(),
        samples,
    }
}
