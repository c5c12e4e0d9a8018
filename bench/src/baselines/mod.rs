//! The stores users would otherwise pick, each started by the bench from the installed
//! Debian packages on 127.0.0.1 with its data on the same disk, configured to be durable
//! before it acknowledges, and stopped when dropped.

pub mod etcd;
pub mod postgres;
pub mod redis;

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use testkit::{signal, Signal};

/// A baseline server process; SIGTERM (then SIGKILL) when dropped.
pub struct ServerProcess {
    name: &'static str,
    child: Child,
    pub dir: PathBuf,
}

impl ServerProcess {
    /// Spawns `command` with its output in `<dir>/<name>.log`.
    pub fn spawn(name: &'static str, mut command: Command, dir: &Path) -> anyhow::Result<Self> {
        let log = std::fs::File::create(dir.join(format!("{name}.log")))?;
        let child = command
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("start {name} (is it installed? bench/run installs it)"))?;
        Ok(ServerProcess {
            name,
            child,
            dir: dir.to_path_buf(),
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The last lines of the server's log, for error messages.
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(self.dir.join(format!("{}.log", self.name)))
            .unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(15)..].join("\n")
    }

    /// Fails with the server's log if it already exited.
    pub fn check_running(&mut self) -> anyhow::Result<()> {
        if let Some(status) = self.child.try_wait()? {
            anyhow::bail!("{} exited ({status}):\n{}", self.name, self.log_tail());
        }
        Ok(())
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        signal(self.child.id(), Signal::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A port that was free a moment ago on 127.0.0.1.
pub fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Retries `connect` every 100 ms until it succeeds or `bound` passes.
pub async fn wait_until_up<T, F, Fut>(
    server: &mut ServerProcess,
    bound: Duration,
    mut connect: F,
) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<T>>,
{
    let deadline = Instant::now() + bound;
    loop {
        server.check_running()?;
        match connect().await {
            Ok(value) => return Ok(value),
            Err(e) if Instant::now() > deadline => {
                return Err(e.context(format!(
                    "{} did not come up within {bound:?}:\n{}",
                    server.name,
                    server.log_tail()
                )))
            }
            Err(_) => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
}

/// The first line of `program --version`-like output, for the report.
pub fn version_of(program: &str, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .output()
        .ok()
        .map(|o| {
            let text = if o.stdout.is_empty() {
                o.stderr
            } else {
                o.stdout
            };
            String::from_utf8_lossy(&text)
                .lines()
                .next()
                .unwrap_or("")
                .trim()
                .to_string()
        })
        .unwrap_or_else(|| "not installed".into())
}
