//! PostgreSQL 15: one INSERT (autocommit, `synchronous_commit=on`, `fsync=on`) per event
//! into an `(session, seq)` table, over the native protocol (tokio-postgres), one
//! connection per client.

use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Context;
use tokio_postgres::{Client, NoTls, Statement};

use super::{free_port, version_of, wait_until_up, ServerProcess};
use crate::load::Appender;

pub struct Postgres {
    server: ServerProcess,
    port: u16,
    pub version: String,
}

fn pg_bin(name: &str) -> PathBuf {
    let packaged = Path::new("/usr/lib/postgresql/15/bin").join(name);
    if packaged.exists() {
        packaged
    } else {
        PathBuf::from(name)
    }
}

/// PostgreSQL refuses to run as root: as root, run it as the `postgres` user.
fn run_as() -> anyhow::Result<Option<(u32, u32)>> {
    if std::fs::metadata("/proc/self")?.uid() != 0 {
        return Ok(None);
    }
    let passwd = std::fs::read_to_string("/etc/passwd")?;
    let line = passwd
        .lines()
        .find(|l| l.starts_with("postgres:"))
        .context("running as root and there is no postgres user to run PostgreSQL as")?;
    let fields: Vec<&str> = line.split(':').collect();
    Ok(Some((fields[2].parse()?, fields[3].parse()?)))
}

impl Postgres {
    pub fn pid(&self) -> u32 {
        self.server.pid()
    }

    /// initdb in `dir` and start a private cluster on a free port.
    pub async fn start(dir: &Path) -> anyhow::Result<Postgres> {
        let user = run_as()?;
        if let Some((uid, gid)) = user {
            std::os::unix::fs::chown(dir, Some(uid), Some(gid))?;
        }
        let data = dir.join("pgdata");
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
            .context("run initdb (PostgreSQL 15 installed?)")?;
        anyhow::ensure!(
            out.status.success(),
            "initdb failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let port = free_port()?;
        let mut postgres = Command::new(pg_bin("postgres"));
        postgres
            .arg("-D")
            .arg(&data)
            .args(["-p", &port.to_string()]);
        for setting in [
            "listen_addresses=127.0.0.1".to_string(),
            format!("unix_socket_directories={}", dir.display()),
            "fsync=on".into(),
            "synchronous_commit=on".into(),
            "full_page_writes=on".into(),
            "max_connections=300".into(),
            "shared_buffers=256MB".into(),
        ] {
            postgres.args(["-c", &setting]);
        }
        if let Some((uid, gid)) = user {
            postgres.uid(uid).gid(gid);
        }
        let mut server = ServerProcess::spawn("postgres", postgres, dir)?;
        let url = format!("host=127.0.0.1 port={port} user=postgres dbname=postgres");
        let client = wait_until_up(&mut server, Duration::from_secs(60), || async {
            connect(&url).await
        })
        .await?;
        client
            .batch_execute(
                "CREATE TABLE events (session text NOT NULL, seq bigint NOT NULL, \
                 body text NOT NULL, PRIMARY KEY (session, seq))",
            )
            .await?;
        Ok(Postgres {
            server,
            port,
            version: version_of(
                pg_bin("postgres").to_str().unwrap_or("postgres"),
                &["--version"],
            ),
        })
    }

    pub async fn client(&self) -> anyhow::Result<Client> {
        connect(&format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres",
            self.port
        ))
        .await
    }

    pub async fn appender(&self, session: String) -> anyhow::Result<PgAppender> {
        let client = self.client().await?;
        let insert = client
            .prepare("INSERT INTO events (session, seq, body) VALUES ($1, $2, $3)")
            .await?;
        Ok(PgAppender {
            client,
            insert,
            session,
            seq: 0,
            body: crate::event_json(),
        })
    }

    /// Writes a session of `events` rows in one statement.
    pub async fn fill(&self, session: &str, events: i64) -> anyhow::Result<()> {
        let client = self.client().await?;
        client
            .execute(
                "INSERT INTO events (session, seq, body) \
                 SELECT $1, g, $3 FROM generate_series(1, $2::bigint) g",
                &[&session, &events, &crate::event_json()],
            )
            .await?;
        Ok(())
    }

    /// Reads a whole session in seq order; returns rows per second.
    pub async fn catch_up(&self, session: &str, expected: usize) -> anyhow::Result<f64> {
        let client = self.client().await?;
        let start = Instant::now();
        let rows = client
            .query(
                "SELECT seq, body FROM events WHERE session = $1 AND seq >= $2 ORDER BY seq",
                &[&session, &1i64],
            )
            .await?;
        let secs = start.elapsed().as_secs_f64();
        anyhow::ensure!(
            rows.len() == expected,
            "read {} rows, expected {expected}",
            rows.len()
        );
        Ok(rows.len() as f64 / secs)
    }
}

async fn connect(url: &str) -> anyhow::Result<Client> {
    let (client, connection) = tokio_postgres::connect(url, NoTls).await?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

pub struct PgAppender {
    client: Client,
    insert: Statement,
    session: String,
    seq: i64,
    body: String,
}

impl Appender for PgAppender {
    async fn append(&mut self) -> anyhow::Result<()> {
        self.seq += 1;
        self.client
            .execute(&self.insert, &[&self.session, &self.seq, &self.body])
            .await?;
        Ok(())
    }
}
