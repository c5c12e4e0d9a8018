//! An S3-compatible server for the tests and the bench: moto's server mode (`moto_server`,
//! from PyPI: `.ci/run` installs it), a real HTTP server on a free loopback port speaking
//! the S3 REST protocol, with one bucket made at start. The runners under test reach it as
//! any S3 endpoint (`AWS_ENDPOINT_URL`, path-style requests).
//!
//! The server is a child process: [`S3Server::pause`] and [`S3Server::resume`] stop and
//! continue it (a store that does not answer), and it is killed when dropped. The container
//! tests run the same release as a container of their own (`docker::helper_images`), and
//! make their bucket with [`make_bucket`].

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::{signal, Signal};

/// The release of moto every test runs (`.ci/run` installs the same one on the machine).
pub const MOTO_SERVER: &str = "moto[server]==5.2.5";

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
        make_bucket(port, bucket, Duration::from_secs(30))?;
        Ok(server)
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

    /// A client of the bucket, signing its requests with the tests' key (moto refuses
    /// unsigned reads of objects).
    pub fn client(&self) -> Result<Bucket> {
        let store = object_store::aws::AmazonS3Builder::new()
            .with_endpoint(self.endpoint())
            .with_allow_http(true)
            .with_bucket_name(&self.bucket)
            .with_region("us-east-1")
            .with_access_key_id(ACCESS_KEY_ID)
            .with_secret_access_key(SECRET_ACCESS_KEY)
            .build()?;
        Ok(Bucket(store))
    }

    /// Stops the server (SIGSTOP): connections are accepted by the kernel and never answered.
    pub fn pause(&self) {
        signal(self.child.id(), Signal::SIGSTOP);
    }

    /// Continues a paused server.
    pub fn resume(&self) {
        signal(self.child.id(), Signal::SIGCONT);
    }

    fn request(&self, method: &str, path: &str) -> Result<(u16, String)> {
        request(self.port, method, path)
    }
}

impl Drop for S3Server {
    fn drop(&mut self) {
        signal(self.child.id(), Signal::SIGCONT);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Makes `bucket` in the moto server on `127.0.0.1:port`, waiting up to `within` for the
/// server to answer.
pub fn make_bucket(port: u16, bucket: &str, within: Duration) -> Result<()> {
    let deadline = Instant::now() + within;
    loop {
        match request(port, "PUT", &format!("/{bucket}")) {
            Ok((200, _)) => return Ok(()),
            Ok((status, body)) => bail!("moto_server refused the bucket: {status} {body}"),
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(100)),
            Err(e) => {
                return Err(e.context(format!("moto_server did not answer within {within:?}")))
            }
        }
    }
}

/// One plain HTTP/1.1 request to `127.0.0.1:port`; the status and the body.
fn request(port: u16, method: &str, path: &str) -> Result<(u16, String)> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))?;
    stream.set_read_timeout(Some(Duration::from_secs(30)))?;
    write!(
        stream,
        "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
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

/// A signed client of an [`S3Server`]'s bucket.
pub struct Bucket(object_store::aws::AmazonS3);

impl Bucket {
    /// The object `key` as text, if it is there.
    pub async fn text(&self, key: &str) -> Result<Option<String>> {
        use object_store::ObjectStoreExt;
        match self.0.get(&object_store::path::Path::from(key)).await {
            Ok(got) => Ok(Some(
                String::from_utf8_lossy(&got.bytes().await?).into_owned(),
            )),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
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
