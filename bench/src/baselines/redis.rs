//! Redis Streams (`appendonly yes`, `appendfsync always`: the AOF is fsync'd before a
//! write is acknowledged): `XADD` per event, `XREAD` from an id to catch up and to follow,
//! over the native protocol (redis-rs), one connection per client.

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::Context;
use redis::aio::MultiplexedConnection;
use redis::streams::StreamReadReply;
use redis::AsyncConnectionConfig;

use super::{free_port, version_of, wait_until_up, ServerProcess};
use crate::fanout::{FollowerContext, Received};
use crate::load::Appender;

pub struct Redis {
    server: ServerProcess,
    client: redis::Client,
    pub version: String,
}

impl Redis {
    pub fn pid(&self) -> u32 {
        self.server.pid()
    }

    pub async fn start(dir: &Path) -> anyhow::Result<Redis> {
        let port = free_port()?;
        let mut command = Command::new("redis-server");
        command.args([
            "--bind",
            "127.0.0.1",
            "--port",
            &port.to_string(),
            "--protected-mode",
            "yes",
            "--appendonly",
            "yes",
            "--appendfsync",
            "always",
            "--save",
            "",
            "--maxclients",
            "4000",
            "--daemonize",
            "no",
        ]);
        command.arg("--dir").arg(dir);
        let mut server = ServerProcess::spawn("redis", command, dir)?;
        let client = redis::Client::open(format!("redis://127.0.0.1:{port}/"))?;
        let probe = client.clone();
        let mut con: MultiplexedConnection =
            wait_until_up(&mut server, Duration::from_secs(30), || {
                let probe = probe.clone();
                async move { Ok(probe.get_multiplexed_async_connection().await?) }
            })
            .await?;
        let _: () = redis::cmd("PING").query_async(&mut con).await?;
        Ok(Redis {
            server,
            client,
            version: version_of("redis-server", &["--version"]),
        })
    }

    /// A connection of its own, with no response timeout (XREAD BLOCK waits).
    pub async fn connection(&self) -> anyhow::Result<MultiplexedConnection> {
        Ok(self
            .client
            .get_multiplexed_async_connection_with_config(
                &AsyncConnectionConfig::new().set_response_timeout(None),
            )
            .await?)
    }

    pub async fn appender(&self, stream: String) -> anyhow::Result<RedisAppender> {
        Ok(RedisAppender {
            con: self.connection().await?,
            stream,
            k: 0,
            body: crate::event_json(),
        })
    }

    /// Writes a stream of `events` entries, 1000 per pipeline.
    pub async fn fill(&self, stream: &str, events: usize) -> anyhow::Result<()> {
        let mut con = self.connection().await?;
        let body = crate::event_json();
        let mut left = events;
        while left > 0 {
            let n = left.min(1000);
            let mut pipe = redis::pipe();
            for _ in 0..n {
                pipe.cmd("XADD")
                    .arg(stream)
                    .arg("*")
                    .arg("body")
                    .arg(&body)
                    .ignore();
            }
            let _: () = pipe.query_async(&mut con).await?;
            left -= n;
        }
        Ok(())
    }

    /// Reads a whole stream with XREAD COUNT 1000 from the last id; entries per second.
    pub async fn catch_up(&self, stream: &str, expected: usize) -> anyhow::Result<f64> {
        let mut con = self.connection().await?;
        let start = Instant::now();
        let mut last = "0-0".to_string();
        let mut n = 0;
        loop {
            let reply: StreamReadReply = redis::cmd("XREAD")
                .arg("COUNT")
                .arg(1000)
                .arg("STREAMS")
                .arg(stream)
                .arg(&last)
                .query_async(&mut con)
                .await?;
            let Some(key) = reply.keys.into_iter().next() else {
                break;
            };
            if key.ids.is_empty() {
                break;
            }
            n += key.ids.len();
            last = key.ids.last().map(|e| e.id.clone()).unwrap_or(last);
        }
        let secs = start.elapsed().as_secs_f64();
        anyhow::ensure!(n == expected, "read {n} entries, expected {expected}");
        Ok(n as f64 / secs)
    }

    /// Live fan-out: every follower loops on `XREAD BLOCK` on its own connection.
    pub async fn fan_out(
        &self,
        stream: &str,
        followers: usize,
        events: usize,
        interval: Duration,
    ) -> anyhow::Result<Vec<f64>> {
        let mut cons = Vec::with_capacity(followers);
        for _ in 0..followers {
            cons.push(self.connection().await?);
        }
        let writer = self.connection().await?;
        let spawn_follower = |f: usize, ctx: FollowerContext| {
            let mut con = cons[f].clone();
            let stream = stream.to_string();
            tokio::spawn(async move {
                let mut last = "0-0".to_string();
                let mut received: Received = Vec::with_capacity(ctx.events);
                while received.len() < ctx.events {
                    let reply: StreamReadReply = redis::cmd("XREAD")
                        .arg("BLOCK")
                        .arg(10_000)
                        .arg("COUNT")
                        .arg(1000)
                        .arg("STREAMS")
                        .arg(&stream)
                        .arg(&last)
                        .query_async(&mut con)
                        .await?;
                    let at = Instant::now();
                    for key in reply.keys {
                        for entry in key.ids {
                            last = entry.id.clone();
                            let k: u64 = entry.get("k").context("an entry without k")?;
                            if k == 0 {
                                let _ = ctx.ready.send(()).await;
                            } else {
                                received.push((k, at));
                            }
                        }
                    }
                }
                anyhow::Ok(received)
            })
        };
        let append = |k: u64| {
            let mut con = writer.clone();
            let stream = stream.to_string();
            async move {
                let _: String = redis::cmd("XADD")
                    .arg(&stream)
                    .arg("*")
                    .arg("k")
                    .arg(k)
                    .arg("body")
                    .arg(crate::event_json())
                    .query_async(&mut con)
                    .await?;
                anyhow::Ok(())
            }
        };
        crate::fanout::measure(followers, events, interval, spawn_follower, append).await
    }
}

pub struct RedisAppender {
    con: MultiplexedConnection,
    stream: String,
    k: u64,
    body: String,
}

impl Appender for RedisAppender {
    async fn append(&mut self) -> anyhow::Result<()> {
        self.k += 1;
        let _: String = redis::cmd("XADD")
            .arg(&self.stream)
            .arg("*")
            .arg("k")
            .arg(self.k)
            .arg("body")
            .arg(&self.body)
            .query_async(&mut self.con)
            .await?;
        Ok(())
    }
}
