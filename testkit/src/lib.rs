//! The kit for starting the real agentlog binaries as users start them (a free port, a temp
//! data dir or a fresh database), shared by the integration tests and the bench: where the
//! binaries are, the event store process, signals, a private PostgreSQL (`pg`), the last
//! release's binaries beside this build's (`previous`), and a watchdog that turns a hung
//! test into its threads' stacks (`watchdog`).
//!
//! Binaries are taken from the cargo target directory the caller was built into; build them
//! first (`cargo build --workspace --bins`, which `.ci/run` does).
#![forbid(unsafe_code)]

pub mod docker;
pub mod netns;
pub mod pg;
pub mod previous;
pub mod s3;
mod watchdog;

pub use watchdog::{watchdog, Watchdog};

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use agentlog_proto::v1::event_store_client::EventStoreClient;
use anyhow::{bail, Context, Result};
pub use nix::sys::signal::Signal;
use tonic::transport::Channel;

/// The path of a workspace binary next to the running test executable.
pub fn bin_path(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("current executable");
    // A test runs from target/<profile>/deps/, a tool (the bench) from target/<profile>/.
    let dir = exe.parent().expect("executable has a directory");
    let dir = if dir.ends_with("deps") {
        dir.parent().expect("deps has a parent")
    } else {
        dir
    };
    let path = dir.join(name);
    assert!(
        path.exists(),
        "{} is missing: run `cargo build --workspace --bins` before the integration tests",
        path.display()
    );
    path
}

/// Which backend [`Store::start`] runs the store on: `AGENTLOG_TEST_BACKEND=postgres` runs
/// every store suite over PostgreSQL (a private server the harness starts, a fresh database
/// per store); anything else, or unset, over the local log.
pub fn test_backend_is_postgres() -> bool {
    std::env::var("AGENTLOG_TEST_BACKEND").is_ok_and(|b| b == "postgres")
}

/// Where a store keeps its data.
#[derive(Clone)]
pub enum Backing {
    Dir(PathBuf),
    /// A database URL, and the server it is on (kept running while a store uses it).
    Database(String, Option<Arc<pg::Postgres>>),
}

impl Backing {
    /// A fresh database on the server the stores of this test process share
    /// ([`pg::shared`]).
    pub fn fresh_database() -> Result<Backing> {
        let pg = pg::shared()?;
        let url = pg.create_database()?;
        Ok(Backing::Database(url, Some(pg)))
    }

    fn args(&self) -> Vec<std::ffi::OsString> {
        match self {
            Backing::Dir(dir) => vec!["--data-dir".into(), dir.into()],
            Backing::Database(url, _) => vec!["--database-url".into(), url.into()],
        }
    }
}

/// A workspace binary that any user may execute, for tests that start it as `nobody`: the
/// binary where it is when every directory above it lets others pass, else a copy in
/// `/tmp/agentlog-test-bin/` (a checkout in a private directory, as `mktemp -d` makes one).
pub fn bin_path_for_any_user(name: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = bin_path(name);
    let passable = |dir: &Path| {
        dir.metadata()
            .is_ok_and(|m| m.permissions().mode() & 0o001 != 0)
    };
    if path.ancestors().skip(1).all(passable) {
        return path;
    }
    let meta = std::fs::metadata(&path).expect("the binary's metadata");
    let stamp = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos());
    let dir = Path::new("/tmp/agentlog-test-bin");
    std::fs::create_dir_all(dir).expect("create /tmp/agentlog-test-bin");
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    // Named by the build it copies, so a rebuilt binary gets a copy of its own.
    let copy = dir.join(format!("{name}-{}-{stamp}", meta.len()));
    if !copy.exists() {
        let partial = dir.join(format!(".{name}-{}", std::process::id()));
        std::fs::copy(&path, &partial).expect("copy the binary");
        std::fs::set_permissions(&partial, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        std::fs::rename(&partial, &copy).expect("move the copy in place");
    }
    copy
}

/// A running `event-store` process on its own port and data dir (or database).
pub struct Store {
    child: Child,
    pub addr: SocketAddr,
    /// The data dir (a PostgreSQL-backed store has none: an empty path).
    pub data_dir: PathBuf,
    pub backing: Backing,
    /// The arguments it was started with beyond the backend's (kept for [`Store::restart`]).
    pub extra: Vec<String>,
    /// The environment it was started with beyond this process's.
    pub env: Vec<(String, String)>,
    _tmp: Option<Arc<tempfile::TempDir>>,
}

impl Store {
    /// Starts a store on a fresh temp data dir, or on a fresh database when
    /// [`test_backend_is_postgres`].
    pub fn start() -> Result<Store> {
        Store::start_with(&[])
    }

    /// [`Store::start`] with `extra` arguments (e.g. `--retain-idle 30d`).
    pub fn start_with(extra: &[&str]) -> Result<Store> {
        Store::start_with_env(extra, &[])
    }

    /// [`Store::start_with`], with `env` set for the process too.
    pub fn start_with_env(extra: &[&str], env: &[(&str, &str)]) -> Result<Store> {
        let env: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        if test_backend_is_postgres() {
            return Store::spawn(
                &bin_path("event-store"),
                Backing::fresh_database()?,
                "127.0.0.1:0",
                extra,
                env,
            );
        }
        let tmp = tempfile::tempdir()?;
        let mut store = Store::spawn(
            &bin_path("event-store"),
            Backing::Dir(tmp.path().to_path_buf()),
            "127.0.0.1:0",
            extra,
            env,
        )?;
        store._tmp = Some(Arc::new(tmp));
        Ok(store)
    }

    /// Starts another store process on the same data (after this one stopped, or beside it
    /// on a shared database), on a free port, with the same arguments and environment.
    pub fn restart(&self) -> Result<Store> {
        self.restart_on("127.0.0.1:0")
    }

    /// [`Store::restart`] listening on `listen` (this store's own address, once it has
    /// stopped, for clients that reconnect to where it was).
    pub fn restart_on(&self, listen: &str) -> Result<Store> {
        let extra: Vec<&str> = self.extra.iter().map(String::as_str).collect();
        self.restart_at(listen, &extra)
    }

    /// [`Store::restart`] with other arguments (the same environment).
    pub fn restart_with(&self, extra: &[&str]) -> Result<Store> {
        self.restart_at("127.0.0.1:0", extra)
    }

    fn restart_at(&self, listen: &str, extra: &[&str]) -> Result<Store> {
        self.restart_binary_at(&bin_path("event-store"), listen, extra)
    }

    /// [`Store::restart_on`] with another build of the store (the last release's, say: an
    /// upgrade or a rollback of this replica), with the same arguments and environment.
    pub fn restart_binary_on(&self, binary: &Path, listen: &str) -> Result<Store> {
        let extra: Vec<&str> = self.extra.iter().map(String::as_str).collect();
        self.restart_binary_at(binary, listen, &extra)
    }

    fn restart_binary_at(&self, binary: &Path, listen: &str, extra: &[&str]) -> Result<Store> {
        let mut store = Store::spawn(
            binary,
            self.backing.clone(),
            listen,
            extra,
            self.env.clone(),
        )?;
        store._tmp = self._tmp.clone();
        Ok(store)
    }

    /// Starts a store on `data_dir` (which may hold an earlier store's data), on a free port.
    pub fn start_in(data_dir: &Path) -> Result<Store> {
        Store::start_on(data_dir, "127.0.0.1:0")
    }

    /// Starts a store on `data_dir`, listening on `listen` (e.g. the address of a store that
    /// was killed, so that clients reconnect to the same place).
    pub fn start_on(data_dir: &Path, listen: &str) -> Result<Store> {
        Store::start_binary_on(&bin_path("event-store"), data_dir, listen)
    }

    /// Starts another build of the store (e.g. the bench's fsync-skipped one) on
    /// `data_dir`, on a free port.
    pub fn start_binary(binary: &Path, data_dir: &Path) -> Result<Store> {
        Store::start_binary_on(binary, data_dir, "127.0.0.1:0")
    }

    fn start_binary_on(binary: &Path, data_dir: &Path, listen: &str) -> Result<Store> {
        Store::start_backed(binary, Backing::Dir(data_dir.to_path_buf()), listen, &[])
    }

    /// Starts `binary` on `backing` with `extra` arguments (e.g. `--notify poll`).
    pub fn start_backed(
        binary: &Path,
        backing: Backing,
        listen: &str,
        extra: &[&str],
    ) -> Result<Store> {
        Store::spawn(binary, backing, listen, extra, Vec::new())
    }

    fn spawn(
        binary: &Path,
        backing: Backing,
        listen: &str,
        extra: &[&str],
        env: Vec<(String, String)>,
    ) -> Result<Store> {
        let mut child = Command::new(binary)
            .args(["--listen", listen])
            .args(backing.args())
            .args(extra)
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env(
                "RUST_LOG",
                std::env::var("RUST_LOG").unwrap_or_else(|_| "info".into()),
            )
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("spawn {}", binary.display()))?;
        let addr = wait_for_listen_line(
            child.stderr.take().expect("piped stderr"),
            "event-store",
            None,
        )?;
        let data_dir = match &backing {
            Backing::Dir(dir) => dir.clone(),
            Backing::Database(..) => PathBuf::new(),
        };
        Ok(Store {
            child,
            addr,
            data_dir,
            backing,
            extra: extra.iter().map(|a| a.to_string()).collect(),
            env,
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

/// Copies a child's stderr to ours (so `cargo test -- --nocapture` shows it), and to
/// `keep` when given, and returns the address from its `listening` log line.
pub fn wait_for_listen_line(
    stderr: std::process::ChildStderr,
    what: &str,
    keep: Option<Arc<Mutex<Vec<String>>>>,
) -> Result<SocketAddr> {
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
            if let Some(keep) = &keep {
                keep.lock().unwrap_or_else(|p| p.into_inner()).push(line);
            }
        }
    });
    rx.recv_timeout(Duration::from_secs(60))
        .with_context(|| format!("{what} did not log its listen address within 60 s"))
}

/// Finds `listen_addr=HOST:PORT` in a log line.
pub fn parse_listen_line(line: &str) -> Option<SocketAddr> {
    let rest = line.split("listen_addr=").nth(1)?;
    let token = rest.split_whitespace().next()?.trim_matches('"');
    token.parse().ok()
}

/// A process's user + system CPU time so far, in milliseconds (`/proc/<pid>/stat`).
pub fn cpu_ms(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // After the command name (in parentheses, which may hold spaces): fields 14 and 15.
    let rest = stat.rsplit_once(')').context("a stat line")?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = fields[11].parse::<f64>()? + fields[12].parse::<f64>()?;
    let hz = nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)?.context("clock ticks")? as f64;
    Ok(ticks * 1000.0 / hz)
}
