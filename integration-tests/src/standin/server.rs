//! The stand-ins' HTTP/1.1 server: serves a router on one address, and can stop listening
//! and listen again on the same port, as a provider that goes down and comes back does.
//! While it is down a connection is refused, and every connection it had was closed when it
//! went down (mid-stream ones too). Every response carries a `date` on the provider's
//! clock. Dropping the server closes its listener and all its connections at once.

use std::net::SocketAddr;
use std::time::Duration;

use anyhow::{Context, Result};
use axum::extract::State;
use axum::http::header::DATE;
use axum::middleware::map_response_with_state;
use axum::response::Response;
use axum::Router;
use hyper_util::rt::TokioIo;
use hyper_util::service::TowerToHyperService;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinSet;

use super::advice::ProviderClock;

/// A running server; stops (abruptly) when dropped.
#[derive(Debug)]
pub struct Server {
    addr: SocketAddr,
    control: mpsc::Sender<Control>,
}

enum Control {
    Down(oneshot::Sender<()>),
    Up(TcpListener),
}

impl Server {
    /// Serves `app` on `addr` (port 0: a free one); needs a running tokio runtime.
    pub async fn start(app: Router, addr: SocketAddr, clock: ProviderClock) -> Result<Server> {
        let listener = TcpListener::bind(addr)
            .await
            .with_context(|| format!("bind {addr}"))?;
        let addr = listener.local_addr()?;
        let app = app.layer(map_response_with_state(clock, dated));
        let (control, commands) = mpsc::channel(4);
        tokio::spawn(run(listener, app, commands));
        Ok(Server { addr, control })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Stops listening and closes every connection; returns once the port refuses.
    pub async fn stop_listening(&self) {
        let (done, stopped) = oneshot::channel();
        if self.control.send(Control::Down(done)).await.is_ok() {
            let _ = stopped.await;
        }
    }

    /// Listens again on the same address. Fails if the port was taken meanwhile (or the
    /// server is still listening).
    pub async fn listen_again(&self) -> Result<()> {
        let listener = TcpListener::bind(self.addr)
            .await
            .with_context(|| format!("listen on {} again", self.addr))?;
        self.control
            .send(Control::Up(listener))
            .await
            .map_err(|_| anyhow::anyhow!("the stand-in's server has stopped"))
    }
}

/// An address on this machine where nothing listens (a port just freed): a connection
/// there is refused, until something else happens to take the port.
pub fn refused_addr() -> SocketAddr {
    std::net::TcpListener::bind(("127.0.0.1", 0))
        .and_then(|listener| listener.local_addr())
        .expect("bind a free port on 127.0.0.1")
}

async fn dated(State(clock): State<ProviderClock>, mut response: Response) -> Response {
    if !response.headers().contains_key(DATE) {
        response.headers_mut().insert(DATE, clock.date_header());
    }
    response
}

/// Accepts and serves until the [`Server`] is dropped; connections live in one set, so
/// going down (or dropping) ends them all.
async fn run(listener: TcpListener, app: Router, mut commands: mpsc::Receiver<Control>) {
    let mut listener = Some(listener);
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            command = commands.recv() => match command {
                None => return,
                Some(Control::Down(done)) => {
                    listener = None;
                    connections.shutdown().await;
                    let _ = done.send(());
                }
                Some(Control::Up(up)) => listener = Some(up),
            },
            accepted = accept(listener.as_ref()) => match accepted {
                Ok(stream) => {
                    let service = TowerToHyperService::new(app.clone());
                    connections.spawn(async move {
                        let _ = hyper::server::conn::http1::Builder::new()
                            .serve_connection(TokioIo::new(stream), service)
                            .await;
                    });
                }
                // Out of file descriptors, say: try again shortly rather than spin.
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            },
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

async fn accept(listener: Option<&TcpListener>) -> std::io::Result<TcpStream> {
    match listener {
        Some(listener) => listener.accept().await.map(|(stream, _)| stream),
        None => std::future::pending().await,
    }
}
