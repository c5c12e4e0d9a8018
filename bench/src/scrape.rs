//! A store's or runner's Prometheus endpoint (`--metrics-listen`), read by the benches.

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// A free port on 127.0.0.1 (for `--metrics-listen`).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

/// The value of the sample `name` (all labels summed) at `/metrics` on `addr`.
pub async fn metric(addr: &str, name: &str) -> anyhow::Result<f64> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    stream
        .write_all(format!("GET /metrics HTTP/1.0\r\nHost: {addr}\r\n\r\n").as_bytes())
        .await?;
    let mut body = String::new();
    stream.read_to_string(&mut body).await?;
    Ok(body
        .lines()
        .filter(|l| l.split(['{', ' ']).next() == Some(name))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum())
}
