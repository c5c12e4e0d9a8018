//! A private PostgreSQL 15 for tests, started by the harness itself: initdb in a temp dir
//! and `postgres` on a free loopback port, as an unprivileged user when the tests run as
//! root (PostgreSQL refuses root; CI runs as root). Each store under test gets a fresh
//! database in it.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use anyhow::{bail, ensure, Context, Result};

/// Where the packaged PostgreSQL binaries are (else they are looked up on PATH).
pub fn pg_bin(name: &str) -> PathBuf {
    let packaged = Path::new("/usr/lib/postgresql/15/bin").join(name);
    if packaged.exists() {
        packaged
    } else {
        PathBuf::from(name)
    }
}

/// The user PostgreSQL runs as when we are root: `postgres` if it exists, else `nobody`.
fn run_as() -> Result<Option<(u32, u32)>> {
    if std::os::unix::fs::MetadataExt::uid(&std::fs::metadata("/proc/self")?) != 0 {
        return Ok(None);
    }
    let passwd = std::fs::read_to_string("/etc/passwd")?;
    for name in ["postgres:", "nobody:"] {
        if let Some(line) = passwd.lines().find(|l| l.starts_with(name)) {
            let fields: Vec<&str> = line.split(':').collect();
            return Ok(Some((fields[2].parse()?, fields[3].parse()?)));
        }
    }
    bail!("running as root with neither a postgres nor a nobody user to run PostgreSQL as")
}

/// A PostgreSQL server process on its own data dir; killed (SIGKILL) when dropped.
pub struct Postgres {
    child: Option<Child>,
    /// The address it listens on (`127.0.0.1`, or its namespace's).
    pub host: String,
    pub port: u16,
    pub data: PathBuf,
    /// The directory holding `data`, the socket and the server log.
    pub dir: PathBuf,
    user: Option<(u32, u32)>,
    _tmp: Option<tempfile::TempDir>,
}

impl Postgres {
    /// initdb and start a fresh cluster in a temp dir.
    pub fn start() -> Result<Postgres> {
        Postgres::start_with(&[])
    }

    /// The same with extra `-c` settings (e.g. `shared_preload_libraries=…`).
    pub fn start_with(settings: &[&str]) -> Result<Postgres> {
        let tmp = tempfile::tempdir()?;
        let mut pg = Postgres::init(tmp.path(), settings)?;
        pg._tmp = Some(tmp);
        Ok(pg)
    }

    /// initdb in `<dir>/data` and start it with extra `-c` settings (e.g. replication).
    pub fn init(dir: &Path, settings: &[&str]) -> Result<Postgres> {
        Postgres::init_at(dir, &Place::default(), settings)
    }

    /// initdb in `<dir>/data` and start it inside `netns`, listening on its address only
    /// (reached over the namespace's link, which the test may cut).
    pub fn init_in_netns(
        dir: &Path,
        netns: &crate::netns::NetNs,
        settings: &[&str],
    ) -> Result<Postgres> {
        let place = Place {
            host: netns.addr.clone(),
            netns: Some(netns.name.clone()),
        };
        Postgres::init_at(dir, &place, settings)
    }

    fn init_at(dir: &Path, place: &Place, settings: &[&str]) -> Result<Postgres> {
        let user = run_as()?;
        if let Some((uid, gid)) = user {
            std::os::unix::fs::chown(dir, Some(uid), Some(gid))?;
        }
        let data = dir.join("data");
        let mut initdb = Command::new(pg_bin("initdb"));
        initdb.arg("-D").arg(&data).args([
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
            "-E",
            "UTF8",
        ]);
        if let Some((uid, gid)) = user {
            initdb.uid(uid).gid(gid);
        }
        let out = initdb
            .output()
            .context("run initdb (is PostgreSQL 15 installed? .ci/run installs it)")?;
        ensure!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        if place.netns.is_some() {
            // initdb trusts loopback only; this one is reached over the namespace's link.
            let mut hba = std::fs::OpenOptions::new()
                .append(true)
                .open(data.join("pg_hba.conf"))?;
            std::io::Write::write_all(&mut hba, b"host all all 0.0.0.0/0 trust\n")?;
        }
        Postgres::start_on(dir, data, user, None, place, settings)
    }

    /// Starts a server on an existing data dir `<dir>/data` (e.g. a standby made by
    /// `pg_basebackup`) on a free port.
    pub fn start_existing(dir: &Path, settings: &[&str]) -> Result<Postgres> {
        let user = run_as()?;
        Postgres::start_on(
            dir,
            dir.join("data"),
            user,
            None,
            &Place::default(),
            settings,
        )
    }

    /// Starts a server on an existing data dir `<dir>/data` on `port` (e.g. the one a killed
    /// server had, so that its clients find it again).
    pub fn start_existing_on(dir: &Path, port: u16, settings: &[&str]) -> Result<Postgres> {
        let user = run_as()?;
        Postgres::start_on(
            dir,
            dir.join("data"),
            user,
            Some(port),
            &Place::default(),
            settings,
        )
    }

    fn start_on(
        dir: &Path,
        data: PathBuf,
        user: Option<(u32, u32)>,
        port: Option<u16>,
        place: &Place,
        settings: &[&str],
    ) -> Result<Postgres> {
        let port = match port {
            Some(port) => port,
            None => std::net::TcpListener::bind("127.0.0.1:0")?
                .local_addr()?
                .port(),
        };
        // The backends of a server killed with SIGKILL outlive it for a moment and still
        // hold its shared memory, which a new server on the same data dir refuses to start
        // over; and the port of a killed server may meanwhile be lent to a listener of a
        // test running beside this one, for that test's few seconds: wait for both to go.
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            match Postgres::spawn(dir, data.clone(), user, port, place, settings) {
                Err(e)
                    if ["pre-existing shared memory block", "Address already in use"]
                        .iter()
                        .any(|passing| e.to_string().contains(passing))
                        && Instant::now() < deadline =>
                {
                    std::thread::sleep(Duration::from_millis(100));
                }
                started => return started,
            }
        }
    }

    fn spawn(
        dir: &Path,
        data: PathBuf,
        user: Option<(u32, u32)>,
        port: u16,
        place: &Place,
        settings: &[&str],
    ) -> Result<Postgres> {
        let log = std::fs::File::create(dir.join("postgres.log"))?;
        if let Some((uid, gid)) = user {
            std::os::unix::fs::chown(dir.join("postgres.log"), Some(uid), Some(gid))?;
        }
        let mut cmd = match &place.netns {
            // `ip netns exec` and setpriv each exec the next: the child is postgres itself.
            Some(netns) => {
                let mut cmd = Command::new("ip");
                cmd.args(["netns", "exec", netns]);
                if let Some((uid, gid)) = user {
                    cmd.args([
                        "setpriv",
                        &format!("--reuid={uid}"),
                        &format!("--regid={gid}"),
                    ])
                    .arg("--clear-groups");
                }
                cmd.arg(pg_bin("postgres"));
                cmd
            }
            None => {
                let mut cmd = Command::new(pg_bin("postgres"));
                if let Some((uid, gid)) = user {
                    cmd.uid(uid).gid(gid);
                }
                cmd
            }
        };
        cmd.arg("-D").arg(&data).args(["-p", &port.to_string()]);
        let socket_dir = format!("unix_socket_directories={}", dir.display());
        let listen = format!("listen_addresses={}", place.host);
        for setting in [
            listen.as_str(),
            &socket_dir,
            "max_connections=300",
            "synchronous_commit=on",
        ]
        .iter()
        .chain(settings)
        {
            cmd.args(["-c", setting]);
        }
        let child = cmd
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .context("start postgres")?;
        let mut pg = Postgres {
            child: Some(child),
            host: place.host.clone(),
            port,
            data,
            dir: dir.to_path_buf(),
            user,
            _tmp: None,
        };
        pg.wait_ready(Duration::from_secs(60))?;
        Ok(pg)
    }

    /// Waits until the server accepts connections.
    pub fn wait_ready(&mut self, bound: Duration) -> Result<()> {
        let deadline = Instant::now() + bound;
        loop {
            if let Some(child) = &mut self.child {
                if let Some(status) = child.try_wait()? {
                    bail!("postgres exited ({status}): {}", self.log_tail());
                }
            }
            let ready = Command::new(pg_bin("pg_isready"))
                .args(["-q", "-h", &self.host, "-p", &self.port.to_string()])
                .status()?;
            if ready.success() {
                return Ok(());
            }
            if Instant::now() > deadline {
                bail!(
                    "postgres did not come up within {bound:?}: {}",
                    self.log_tail()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    pub fn log_tail(&self) -> String {
        let log = std::fs::read_to_string(self.dir.join("postgres.log")).unwrap_or_default();
        let lines: Vec<&str> = log.lines().collect();
        lines[lines.len().saturating_sub(20)..].join("\n")
    }

    /// The URL of database `db` on this server.
    pub fn url(&self, db: &str) -> String {
        format!("postgres://postgres@{}:{}/{db}", self.host, self.port)
    }

    /// Runs SQL with psql as the superuser; returns its output (unaligned, tuples only).
    pub fn psql(&self, db: &str, sql: &str) -> Result<String> {
        let out = Command::new("psql")
            .args([
                "-X",
                "-A",
                "-t",
                "-v",
                "ON_ERROR_STOP=1",
                "-d",
                &self.url(db),
                "-c",
                sql,
            ])
            .output()
            .context("run psql")?;
        ensure!(
            out.status.success(),
            "psql {sql:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
    }

    /// A fresh, empty database; returns its URL.
    pub fn create_database(&self) -> Result<String> {
        let name = format!("t{}", uuid_like());
        self.psql("postgres", &format!("CREATE DATABASE {name}"))?;
        Ok(self.url(&name))
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// SIGKILL the server: the postmaster and every backend at once, as a crash of its machine
    /// would.
    pub fn kill9(&mut self) {
        if let Some(mut child) = self.child.take() {
            // The postmaster alone dying leaves its backends finishing the statements in hand
            // on their open connections (they notice the death only later), so a commit could
            // still be acknowledged after the "crash". Stopped first, it forks no new one.
            let pid = child.id();
            crate::signal(pid, crate::Signal::SIGSTOP);
            for backend in children_of(pid) {
                crate::signal(backend, crate::Signal::SIGKILL);
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// The user the server runs as (for files the test prepares for it).
    pub fn owner(&self) -> Option<(u32, u32)> {
        self.user
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // SIGQUIT: immediate shutdown of the postmaster and all its backends.
            crate::signal(child.id(), crate::Signal::SIGQUIT);
            let deadline = Instant::now() + Duration::from_secs(5);
            while Instant::now() < deadline {
                if let Ok(Some(_)) = child.try_wait() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn uuid_like() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!("{:x}{:x}", std::process::id(), nanos)
}

/// Where a server listens: on loopback here, or on a network namespace's address in it.
struct Place {
    host: String,
    netns: Option<String>,
}

impl Default for Place {
    fn default() -> Place {
        Place {
            host: "127.0.0.1".into(),
            netns: None,
        }
    }
}

/// The server the stores of this test process share: started with the first store, stopped
/// when the last one is gone.
pub fn shared() -> Result<Arc<Postgres>> {
    static SHARED: Mutex<Weak<Postgres>> = Mutex::new(Weak::new());
    let mut shared = SHARED.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(pg) = shared.upgrade() {
        return Ok(pg);
    }
    let pg = Arc::new(Postgres::start()?);
    *shared = Arc::downgrade(&pg);
    Ok(pg)
}

/// The processes whose parent is `pid` (from `/proc/<pid>/stat`).
fn children_of(pid: u32) -> Vec<u32> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    entries
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|candidate| {
            std::fs::read_to_string(format!("/proc/{candidate}/stat"))
                .ok()
                .and_then(|stat| {
                    // `pid (comm) state ppid …`; comm may hold spaces and parentheses.
                    let after = stat.rsplit_once(')')?.1;
                    after.split_whitespace().nth(1)?.parse::<u32>().ok()
                })
                == Some(pid)
        })
        .collect()
}
