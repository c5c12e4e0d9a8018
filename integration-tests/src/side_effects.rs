//! Side effects counted from outside the sessions: a bash call sends its `IDEMPOTENCY_KEY`
//! to a TCP port of the test (`echo "$IDEMPOTENCY_KEY" > /dev/tcp/127.0.0.1/PORT`, with the
//! runner's `--tool-network all`), so every run of a call shows as a line, whatever its
//! workspace holds and whichever runner (or release) ran it.

use std::collections::BTreeMap;
use std::io::Read;
use std::net::TcpListener;
use std::sync::{Arc, Mutex};

/// The listener that counts the runs reported to it.
pub struct Counter {
    pub port: u16,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Counter {
    pub fn start() -> Counter {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind the counter");
        let port = listener.local_addr().expect("address").port();
        let lines = Arc::new(Mutex::new(Vec::new()));
        let seen = lines.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let mut text = String::new();
                let _ = stream.read_to_string(&mut text);
                let mut seen = seen.lock().unwrap_or_else(|p| p.into_inner());
                seen.extend(text.lines().map(str::to_string));
            }
        });
        Counter { port, lines }
    }

    /// The shell that reports one run of the call it is in.
    pub fn report(&self) -> String {
        format!(
            "echo \"$IDEMPOTENCY_KEY\" > /dev/tcp/127.0.0.1/{}",
            self.port
        )
    }

    /// Every key reported, with how often.
    pub fn counts(&self) -> BTreeMap<String, usize> {
        let mut counts = BTreeMap::new();
        for line in self.lines.lock().unwrap_or_else(|p| p.into_inner()).iter() {
            *counts.entry(line.clone()).or_default() += 1;
        }
        counts
    }
}
