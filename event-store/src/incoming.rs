//! Connections: accept, count per peer address, and (with TLS) the handshake, each off the
//! accept loop so that a slow or hostile handshaker delays nobody else.
//!
//! Limits: beyond `max_connections` in all a new connection is closed at once; beyond
//! `max_per_peer` from one address it is served just long enough for every call on it to
//! be answered `RESOURCE_EXHAUSTED` (by [`crate::limits`]), then closed.
//!
//! Shutdown: accepting stops at once, and the server lets every connection finish the
//! calls it has; a connection still open [`SHUTDOWN_GRACE`] later (a peer that stopped
//! reading, so its last answer cannot be sent) is cut, so that the store exits within its
//! pod's grace period whatever its clients do.

use std::collections::HashMap;
use std::future::Future;
use std::net::{IpAddr, SocketAddr};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::transport::server::Connected;

use crate::stop::{Stop, StopCheck};
use crate::tls::ReloadingTls;

/// A TLS handshake must finish within this.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// An over-limit connection is closed this long after it was accepted.
const OVER_LIMIT_GRACE: Duration = Duration::from_secs(5);
/// How long after shutdown began a connection may stay open; then it is cut. Under the
/// manifests' `terminationGracePeriodSeconds: 60`, with room for the writer's last fsync.
pub const SHUTDOWN_GRACE: Duration = Duration::from_secs(50);
/// How long a closing connection drains what its peer still sends (see
/// `ServerConn::poll_shutdown`); a peer that answers our close closes in a round trip.
const LINGER: Duration = Duration::from_secs(1);

#[derive(Debug, Clone, Copy)]
pub struct ConnLimits {
    pub max_connections: usize,
    pub max_per_peer: usize,
}

/// What the service layers learn about a call's connection (request extensions).
#[derive(Debug, Clone)]
pub struct PeerInfo {
    pub remote: Option<SocketAddr>,
    /// Set on a connection over the per-peer limit: why its calls are refused.
    pub over_limit: Option<Arc<str>>,
}

#[derive(Default)]
struct Counts {
    total: usize,
    per_peer: HashMap<IpAddr, usize>,
}

/// One open connection in the counts, until dropped.
struct Counted {
    counts: Arc<Mutex<Counts>>,
    ip: Option<IpAddr>,
}

impl Drop for Counted {
    fn drop(&mut self) {
        let mut counts = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        counts.total = counts.total.saturating_sub(1);
        if let Some(ip) = self.ip {
            if let Some(n) = counts.per_peer.get_mut(&ip) {
                *n -= 1;
                if *n == 0 {
                    counts.per_peer.remove(&ip);
                }
            }
        }
    }
}

enum Io {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

/// An accepted (and, with TLS, handshaken) connection.
pub struct ServerConn {
    io: Io,
    info: PeerInfo,
    close_at: Option<Pin<Box<tokio::time::Sleep>>>,
    /// Fires [`SHUTDOWN_GRACE`] after shutdown began. Looked at before every read and
    /// write, and waited for whenever one waits.
    cut: StopCheck,
    /// Set once our side is shut down: until when what the peer still sends is drained.
    linger: Option<Pin<Box<tokio::time::Sleep>>>,
    _counted: Counted,
}

/// The error every read and write returns once the connection is cut.
fn cut_error() -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::ConnectionAborted,
        "the store's shutdown grace is over",
    )
}

impl ServerConn {
    /// `io`'s outcome, unless the connection is cut; one about to wait also waits for the
    /// cut, so a parked connection is woken by it.
    fn unless_cut<T>(
        &mut self,
        cx: &mut Context<'_>,
        io: impl FnOnce(&mut Io, &mut Context<'_>) -> Poll<std::io::Result<T>>,
    ) -> Poll<std::io::Result<T>> {
        if self.cut.stopped() {
            return Poll::Ready(Err(cut_error()));
        }
        match io(&mut self.io, cx) {
            Poll::Pending if self.cut.poll_stopped(cx) => Poll::Ready(Err(cut_error())),
            outcome => outcome,
        }
    }
}

impl Connected for ServerConn {
    type ConnectInfo = PeerInfo;

    fn connect_info(&self) -> PeerInfo {
        self.info.clone()
    }
}

impl AsyncRead for ServerConn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if let Some(close_at) = this.close_at.as_mut() {
            if close_at.as_mut().poll(cx).is_ready() {
                return Poll::Ready(Ok(())); // end of stream: hyper closes the connection
            }
        }
        this.unless_cut(cx, |io, cx| match io {
            Io::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        })
    }
}

impl AsyncWrite for ServerConn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.get_mut().unless_cut(cx, |io, cx| match io {
            Io::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        })
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.get_mut().unless_cut(cx, |io, cx| match io {
            Io::Plain(s) => Pin::new(s).poll_flush(cx),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        })
    }

    /// Ends our side (FIN), then reads and drops what the peer still sends until it closes
    /// too, for at most [`LINGER`]: closing a socket with unread bytes makes the kernel
    /// answer with a reset, and a reset can destroy the last answers still on their way to
    /// the peer (an AppendStream's closing status while its client was still sending).
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if this.linger.is_none() {
            let shut = match &mut this.io {
                Io::Plain(s) => Pin::new(s).poll_shutdown(cx),
                Io::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
            };
            std::task::ready!(shut)?;
            this.linger = Some(Box::pin(tokio::time::sleep(LINGER)));
        }
        let mut scratch = [0u8; 4096];
        loop {
            if this.cut.poll_stopped(cx)
                || this
                    .linger
                    .as_mut()
                    .is_some_and(|l| l.as_mut().poll(cx).is_ready())
            {
                return Poll::Ready(Ok(()));
            }
            let mut buf = ReadBuf::new(&mut scratch);
            let read = match &mut this.io {
                Io::Plain(s) => Pin::new(s).poll_read(cx, &mut buf),
                Io::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, &mut buf),
            };
            match read {
                Poll::Ready(Ok(())) if !buf.filled().is_empty() => continue,
                Poll::Ready(_) => return Poll::Ready(Ok(())),
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        self.get_mut().unless_cut(cx, |io, cx| match io {
            Io::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Io::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        })
    }

    fn is_write_vectored(&self) -> bool {
        match &self.io {
            Io::Plain(s) => s.is_write_vectored(),
            Io::Tls(s) => s.is_write_vectored(),
        }
    }
}

/// The stream of connections `tonic` serves: accepted on `listener` until `shutdown`; those
/// still open [`SHUTDOWN_GRACE`] after it are cut.
pub fn accept(
    listener: TcpListener,
    tls: Option<Arc<ReloadingTls>>,
    limits: ConnLimits,
    shutdown: CancellationToken,
) -> ReceiverStream<Result<ServerConn, std::io::Error>> {
    let (tx, rx) = mpsc::channel(256);
    let counts = Arc::new(Mutex::new(Counts::default()));
    let cut = Stop::following(CancellationToken::new());
    tokio::spawn(cut_after_grace(
        shutdown.clone(),
        cut.clone(),
        counts.clone(),
    ));
    tokio::spawn(accept_loop(
        listener, tls, limits, shutdown, cut, counts, tx,
    ));
    ReceiverStream::new(rx)
}

async fn cut_after_grace(shutdown: CancellationToken, cut: Stop, counts: Arc<Mutex<Counts>>) {
    shutdown.cancelled().await;
    tokio::time::sleep(SHUTDOWN_GRACE).await;
    let open = counts.lock().unwrap_or_else(|p| p.into_inner()).total;
    if open > 0 {
        tracing::warn!(
            open,
            grace_secs = SHUTDOWN_GRACE.as_secs(),
            "connections still open after the shutdown grace; cutting them"
        );
    }
    cut.token().cancel();
}

async fn accept_loop(
    listener: TcpListener,
    tls: Option<Arc<ReloadingTls>>,
    limits: ConnLimits,
    shutdown: CancellationToken,
    cut: Stop,
    counts: Arc<Mutex<Counts>>,
    tx: mpsc::Sender<Result<ServerConn, std::io::Error>>,
) {
    let mut last_full_warning: Option<tokio::time::Instant> = None;
    loop {
        let (stream, remote) = tokio::select! {
            _ = shutdown.cancelled() => return,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors and the like: pause rather than spin.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            },
        };
        let ip = remote.ip();
        let (counted, over_limit) = {
            let mut c = counts.lock().unwrap_or_else(|p| p.into_inner());
            if c.total >= limits.max_connections {
                drop(c);
                let now = tokio::time::Instant::now();
                if last_full_warning.is_none_or(|t| now - t > Duration::from_secs(10)) {
                    last_full_warning = Some(now);
                    tracing::warn!(
                        max_connections = limits.max_connections,
                        "connection limit reached; closing new connections"
                    );
                }
                continue;
            }
            c.total += 1;
            let n = c.per_peer.entry(ip).or_default();
            *n += 1;
            let over = (*n > limits.max_per_peer).then(|| {
                Arc::<str>::from(format!(
                    "too many connections from your address ({} open, the limit is {}); \
                     HTTP/2 multiplexes calls: reuse a connection",
                    *n, limits.max_per_peer
                ))
            });
            (
                Counted {
                    counts: counts.clone(),
                    ip: Some(ip),
                },
                over,
            )
        };
        let _ = stream.set_nodelay(true);
        let info = PeerInfo {
            remote: Some(remote),
            over_limit,
        };
        let close_at = info
            .over_limit
            .is_some()
            .then(|| Box::pin(tokio::time::sleep(OVER_LIMIT_GRACE)));
        match &tls {
            None => {
                let conn = ServerConn {
                    io: Io::Plain(stream),
                    info,
                    close_at,
                    cut: cut.check(),
                    linger: None,
                    _counted: counted,
                };
                if tx.send(Ok(conn)).await.is_err() {
                    return;
                }
            }
            Some(tls) => {
                let acceptor = tls.acceptor();
                let tx = tx.clone();
                let cut = cut.clone();
                tokio::spawn(async move {
                    let handshake =
                        tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(stream)).await;
                    match handshake {
                        Ok(Ok(stream)) => {
                            let conn = ServerConn {
                                io: Io::Tls(Box::new(stream)),
                                info,
                                close_at,
                                cut: cut.check(),
                                linger: None,
                                _counted: counted,
                            };
                            let _ = tx.send(Ok(conn)).await;
                        }
                        // A scanner, a plaintext client, a client without an acceptable
                        // certificate (mTLS): nothing was served.
                        Ok(Err(e)) => tracing::info!(%remote, error = %e, "TLS handshake refused"),
                        Err(_) => tracing::info!(%remote, "TLS handshake timed out"),
                    }
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    /// A connection whose peer says nothing, and the token that cuts it.
    async fn quiet_connection() -> (ServerConn, TcpStream, CancellationToken) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let peer = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (stream, remote) = listener.accept().await.unwrap();
        let token = CancellationToken::new();
        let conn = ServerConn {
            io: Io::Plain(stream),
            info: PeerInfo {
                remote: Some(remote),
                over_limit: None,
            },
            close_at: None,
            cut: Stop::following(token.clone()).check(),
            linger: None,
            _counted: Counted {
                counts: Arc::default(),
                ip: None,
            },
        };
        (conn, peer, token)
    }

    #[tokio::test]
    async fn a_read_waiting_for_a_quiet_peer_ends_when_the_connection_is_cut() {
        let (mut conn, _peer, cut) = quiet_connection().await;
        let read = tokio::spawn(async move {
            let mut buf = [0u8; 16];
            conn.read(&mut buf).await
        });
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert!(!read.is_finished(), "nothing to read yet");
        cut.cancel();
        let outcome = tokio::time::timeout(Duration::from_secs(5), read)
            .await
            .expect("woken by the cut")
            .unwrap();
        let error = outcome.expect_err("a cut connection reads nothing");
        assert_eq!(error.kind(), std::io::ErrorKind::ConnectionAborted);
    }

    #[tokio::test]
    async fn a_cut_connection_neither_reads_nor_writes_though_the_peer_talks() {
        let (mut conn, mut peer, cut) = quiet_connection().await;
        peer.write_all(b"hello").await.unwrap();
        cut.cancel();
        // The flag follows the token within a moment.
        let mut buf = [0u8; 16];
        let read = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                match conn.read(&mut buf).await {
                    Ok(_) => tokio::task::yield_now().await,
                    Err(e) => return e,
                }
            }
        })
        .await
        .expect("the cut reaches the reads");
        assert_eq!(read.kind(), std::io::ErrorKind::ConnectionAborted);
        let write = conn.write_all(b"answer").await.expect_err("nor the writes");
        assert_eq!(write.kind(), std::io::ErrorKind::ConnectionAborted);
    }
}
