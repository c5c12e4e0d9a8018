//! An S3-compatible server for the tests and the bench: moto's server mode (`moto_server`,
//! from PyPI: `.ci/run` installs it), a real HTTP server on a free loopback port speaking
//! the S3 REST protocol, with one bucket made at start. The runners under test reach it as
//! any S3 endpoint (`AWS_ENDPOINT_URL`, path-style requests).
//!
//! The server is a child process: [`S3Server::pause`] and [`S3Server::resume`] stop and
//! continue it (a store that does not answer), and it is killed when dropped.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::{signal, Signal};

/// The access key the tests give runners (moto accepts any).
pub const ACCESS_KEY_ID: &str = "agentlog-test-key-id";
pub const SECRET_ACCESS_KEY: &str = "agentlog-test-secret-key";

/// A running `moto_server` with one bucket.
pub struct S3Server {
    child: Child,
    pub port: u16,
    pub bucket: String,
}

impl S3Server {
    /// Starts the server and makes `bucket` in it.
    pub fn start(bucket: &str) -> Result<S3Server> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let child = Command::new("moto_server")
            .args(["-H", "127.0.0.1", "-p", &port.to_string()])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("start moto_server (pip install 'moto[server]'; .ci/run installs it)")?;
        let server = S3Server {
            child,
            port,
            bucket: bucket.to_string(),
        };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match server.request("PUT", &format!("/{bucket}")) {
                Ok((200, _)) => return Ok(server),
                Ok((status, body)) => bail!("moto_server refused the bucket: {status} {body}"),
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(100))
                }
                Err(e) => return Err(e.context("moto_server did not come up within 30 s")),
            }
        }
    }

    /// The server's process id (`agentlog-bench-checkpoints` reads its CPU time).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// `http://127.0.0.1:PORT`.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// `s3://BUCKET/PREFIX`, for `runner --checkpoint-store`.
    pub fn url(&self, prefix: &str) -> String {
        format!("s3://{}/{prefix}", self.bucket)
    }

    /// The environment a runner needs to reach the server.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ENDPOINT_URL", self.endpoint()),
            ("AWS_ACCESS_KEY_ID", ACCESS_KEY_ID.to_string()),
            ("AWS_SECRET_ACCESS_KEY", SECRET_ACCESS_KEY.to_string()),
            ("AWS_REGION", "us-east-1".to_string()),
        ]
    }

    /// Every key in the bucket under `prefix`, with its size (moto answers unsigned
    /// requests, so the tests list without a client of their own).
    pub fn list(&self, prefix: &str) -> Result<Vec<(String, u64)>> {
        let mut keys = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut path = format!("/{}?list-type=2&prefix={prefix}", self.bucket);
            if let Some(token) = &token {
                path.push_str("&continuation-token=");
                path.push_str(&percent(token));
            }
            let (status, body) = self.request("GET", &path)?;
            if status != 200 {
                bail!("listing the bucket: {status} {body}");
            }
            for contents in body.split("<Contents>").skip(1) {
                let key = between(contents, "<Key>", "</Key>").unwrap_or_default();
                let size = between(contents, "<Size>", "</Size>")
                    .and_then(|s| s.parse().ok())
                    .unwrap_or(0);
                keys.push((key.replace("&amp;", "&"), size));
            }
            token = between(&body, "<NextContinuationToken>", "</NextContinuationToken>")
                .map(str::to_string);
            if token.is_none() {
                return Ok(keys);
            }
        }
    }

    /// Stops the server (SIGSTOP): connections are accepted by the kernel and never answered.
    pub fn pause(&self) {
        signal(self.child.id(), Signal::SIGSTOP);
    }

    /// Continues a paused server.
    pub fn resume(&self) {
        signal(self.child.id(), Signal::SIGCONT);
    }

    /// One plain HTTP/1.1 request; the status and the body.
    fn request(&self, method: &str, path: &str) -> Result<(u16, String)> {
        let mut stream = TcpStream::connect(("127.0.0.1", self.port))?;
        stream.set_read_timeout(Some(Duration::from_secs(30)))?;
        write!(
            stream,
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n",
            self.port
        )?;
        let mut response = String::new();
        stream.read_to_string(&mut response)?;
        let status = response
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .context("no HTTP status")?;
        let body = response
            .split_once("\r\n\r\n")
            .map_or("", |(_, body)| body)
            .to_string();
        Ok((status, body))
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        signal(self.child.id(), Signal::SIGCONT);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn between<'a>(text: &'a str, open: &str, close: &str) -> Option<&'a str> {
    let start = text.find(open)? + open.len();
    let end = text[start..].find(close)? + start;
    Some(&text[start..end])
}

fn percent(text: &str) -> String {
    text.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}
