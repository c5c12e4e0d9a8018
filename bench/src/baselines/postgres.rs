//! PostgreSQL 15: one INSERT (autocommit, `synchronous_commit=on`, `fsync=on`) per event
//! into an `(session, seq)` table, over the native protocol (tokio-postgres), one
//! connection per client.

use std::path::Path;
use std::time::Instant;

use tokio_postgres::{Client, NoTls, Statement};

use super::version_of;
use crate::load::Appender;

/// A private cluster started by `testkit::pg` (the one the tests use), with full-durability
/// settings.
pub struct Postgres {
    server: testkit::pg::Postgres,
    port: u16,
    pub version: String,
}

impl Postgres {
    pub fn pid(&self) -> u32 {
        self.server
            .pid()
            .expect("the server runs until the baseline is dropped")
    }

    /// initdb in `dir` and start a private cluster on a free port.
    pub async fn start(dir: &Path) -> anyhow::Result<Postgres> {
        let dir = dir.to_path_buf();
        // initdb and the wait for the server block: off the async threads.
        let server = tokio::task::spawn_blocking(move || {
            testkit::pg::Postgres::init(
                &dir,
                &["fsync=on", "full_page_writes=on", "shared_buffers=256MB"],
            )
        })
        .await??;
        let port = server.port;
        let client = connect(&format!(
            "host=127.0.0.1 port={port} user=postgres dbname=postgres"
        ))
        .await?;
        client
            .batch_execute(
                "CREATE TABLE events (session text NOT NULL, seq bigint NOT NULL, \
                 body text NOT NULL, PRIMARY KEY (session, seq))",
            )
            .await?;
        let postgres = testkit::pg::pg_bin("postgres");
        Ok(Postgres {
            server,
            port,
            version: version_of(postgres.to_str().unwrap_or("postgres"), &["--version"]),
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

    /// Reads a whole session in seq order, each row's seq checked and its body taken (as
    /// text, without a copy), as agentlog's reader checks and decodes each event; returns
    /// rows per second.
    pub async fn catch_up(&self, session: &str, expected: usize) -> anyhow::Result<f64> {
        let client = self.client().await?;
        let start = Instant::now();
        let rows = client
            .query(
                "SELECT seq, body FROM events WHERE session = $1 AND seq >= $2 ORDER BY seq",
                &[&session, &1i64],
            )
            .await?;
        let mut body_bytes = 0;
        for (i, row) in rows.iter().enumerate() {
            let seq: i64 = row.try_get(0)?;
            anyhow::ensure!(seq == i as i64 + 1, "row {i} has seq {seq}");
            body_bytes += row.try_get::<_, &str>(1)?.len();
        }
        let secs = start.elapsed().as_secs_f64();
        anyhow::ensure!(
            rows.len() == expected && body_bytes > 0,
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
