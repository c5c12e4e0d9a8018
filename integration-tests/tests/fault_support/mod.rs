//! Shared by the fault tests: a TCP proxy that can blackhole or reset the connections
//! through it, the `agentlog` CLI as a process, and fault counting.
#![allow(dead_code)] // each test file uses its own subset

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use integration_tests::bin_path;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// A TCP proxy in front of one upstream address. `blackhole` makes every connection
/// through it (and every new one) go silent — bytes are held, nothing is answered, as in a
/// network partition; `reset_all` ends every live connection with a RST.
pub struct TcpProxy {
    pub addr: SocketAddr,
    blackhole: watch::Sender<bool>,
    resets: watch::Sender<u64>,
    accepted: Arc<AtomicUsize>,
    task: tokio::task::JoinHandle<()>,
}

impl TcpProxy {
    pub async fn start(upstream: SocketAddr) -> TcpProxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let (blackhole, _) = watch::channel(false);
        let (resets, _) = watch::channel(0u64);
        let accepted = Arc::new(AtomicUsize::new(0));
        let task = {
            let blackhole = blackhole.clone();
            let resets = resets.clone();
            let accepted = accepted.clone();
            tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    accepted.fetch_add(1, Ordering::SeqCst);
                    let _ = client.set_nodelay(true);
                    tokio::spawn(pipe(
                        client,
                        upstream,
                        blackhole.subscribe(),
                        resets.subscribe(),
                    ));
                }
            })
        };
        TcpProxy {
            addr,
            blackhole,
            resets,
            accepted,
            task,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn set_blackhole(&self, on: bool) {
        self.blackhole.send_replace(on);
    }

    /// RSTs every connection open now.
    pub fn reset_all(&self) {
        self.resets.send_modify(|n| *n += 1);
    }

    /// Connections accepted so far.
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.task.abort();
        self.reset_all();
    }
}

async fn pipe(
    client: TcpStream,
    upstream: SocketAddr,
    mut blackhole: watch::Receiver<bool>,
    mut resets: watch::Receiver<u64>,
) {
    resets.borrow_and_update();
    // A connection made during a blackhole hangs until the next reset.
    while *blackhole.borrow_and_update() {
        tokio::select! {
            _ = resets.changed() => return rst(client, None),
            _ = blackhole.changed() => {}
        }
    }
    let Ok(server) = TcpStream::connect(upstream).await else {
        return rst(client, None);
    };
    let _ = server.set_nodelay(true);
    let (mut client, mut server) = (client, server);
    let mut up = vec![0u8; 64 * 1024];
    let mut down = vec![0u8; 64 * 1024];
    loop {
        let holding = *blackhole.borrow_and_update();
        tokio::select! {
            _ = resets.changed() => return rst(client, Some(server)),
            _ = blackhole.changed() => {}
            read = client.read(&mut up), if !holding => match read {
                Ok(n) if n > 0 => if server.write_all(&up[..n]).await.is_err() { return },
                _ => { let _ = server.shutdown().await; return }
            },
            read = server.read(&mut down), if !holding => match read {
                Ok(n) if n > 0 => if client.write_all(&down[..n]).await.is_err() { return },
                _ => { let _ = client.shutdown().await; return }
            },
        }
    }
}

/// Drops both ends with SO_LINGER 0: the peers see a connection reset.
fn rst(client: TcpStream, server: Option<TcpStream>) {
    let _ = client.set_zero_linger();
    if let Some(server) = &server {
        let _ = server.set_zero_linger();
    }
}

/// Counts faults by kind, for the closing note each test prints.
#[derive(Debug, Default, Clone)]
pub struct Faults(Arc<Mutex<Vec<(String, usize)>>>);

impl Faults {
    pub fn add(&self, kind: &str) {
        let mut faults = self.0.lock().unwrap_or_else(|p| p.into_inner());
        match faults.iter_mut().find(|(k, _)| k == kind) {
            Some((_, n)) => *n += 1,
            None => faults.push((kind.to_string(), 1)),
        }
    }

    pub fn count(&self, kind: &str) -> usize {
        let faults = self.0.lock().unwrap_or_else(|p| p.into_inner());
        faults
            .iter()
            .find(|(k, _)| k == kind)
            .map_or(0, |(_, n)| *n)
    }

    /// Prints `FAULTS <test>: kind=n, ... -> outcome` (visible with --nocapture and in
    /// nextest's output of a failing test).
    pub fn report(&self, test: &str, outcome: &str) {
        let faults = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let list: Vec<String> = faults.iter().map(|(k, n)| format!("{k}={n}")).collect();
        println!("FAULTS {test}: {} -> {outcome}", list.join(", "));
    }
}

/// Runs `agentlog ARGS` to completion.
pub fn agentlog(args: &[&str]) -> std::process::Output {
    Command::new(bin_path("agentlog"))
        .args(args)
        .env_remove("AGENTLOG_ADDR")
        .stdin(Stdio::null())
        .output()
        .expect("run agentlog")
}

/// A long-running `agentlog` (`up`, `tail`) whose stdout is collected while it runs;
/// SIGKILLed when dropped.
pub struct CliProc {
    child: Child,
    stdout: Arc<Mutex<String>>,
    stderr: Arc<Mutex<String>>,
}

impl CliProc {
    pub fn spawn(args: &[&str]) -> CliProc {
        let mut child = Command::new(bin_path("agentlog"))
            .args(args)
            .env("NO_COLOR", "1")
            // The local stack's model comes from these: the tests want the demo model.
            .env_remove("ANTHROPIC_API_KEY")
            .env_remove("OPENAI_BASE_URL")
            .env_remove("AGENTLOG_ADDR")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn agentlog");
        let stdout = Arc::new(Mutex::new(String::new()));
        let stderr = Arc::new(Mutex::new(String::new()));
        collect(
            child.stdout.take().expect("piped stdout"),
            stdout.clone(),
            false,
        );
        collect(
            child.stderr.take().expect("piped stderr"),
            stderr.clone(),
            true,
        );
        CliProc {
            child,
            stdout,
            stderr,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn stdout(&self) -> String {
        self.stdout
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn stderr(&self) -> String {
        self.stderr
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The complete lines printed so far.
    pub fn lines(&self) -> Vec<String> {
        let out = self.stdout();
        let complete = out.rfind('\n').map_or("", |i| &out[..i]);
        complete
            .lines()
            .filter(|l| !l.is_empty())
            .map(String::from)
            .collect()
    }

    /// Polls until stdout contains `needle`; panics (with both outputs) after `bound`.
    pub fn wait_for(&mut self, needle: &str, bound: Duration) {
        let deadline = Instant::now() + bound;
        while !self.stdout().contains(needle) {
            let exited = !matches!(self.child.try_wait(), Ok(None));
            assert!(
                !exited && Instant::now() < deadline,
                "agentlog never printed {needle:?} (exited: {exited}); stdout:\n{}\nstderr:\n{}",
                self.stdout(),
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGTERM and the exit status (within 60 s).
    pub fn terminate(&mut self) -> std::process::ExitStatus {
        integration_tests::signal(self.child.id(), integration_tests::Signal::SIGTERM);
        self.wait_exit(Duration::from_secs(60))
    }

    /// The exit status, once it has exited; panics after `bound`.
    pub fn wait_exit(&mut self, bound: Duration) -> std::process::ExitStatus {
        let deadline = Instant::now() + bound;
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return status;
            }
            assert!(
                Instant::now() < deadline,
                "agentlog did not exit within {bound:?}: {}",
                self.stderr()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for CliProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn collect(from: impl std::io::Read + Send + 'static, into: Arc<Mutex<String>>, echo: bool) {
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(from).lines().map_while(Result::ok) {
            if echo {
                eprintln!("[agentlog] {line}");
            }
            let mut text = into.lock().unwrap_or_else(|p| p.into_inner());
            text.push_str(&line);
            text.push('\n');
        }
    });
}
