//! Wake-ups across replicas: when a session changes, its followers and the claimants on
//! every replica look again.
//!
//! A wake-up is only a hint to re-read; the database is the truth. So they are sent outside
//! the append's transaction (a NOTIFY inside it would serialise every commit behind the
//! notify queue lock), in batches, after the commit. A missed one costs latency, never
//! correctness: every follower and claimant also re-reads on a safety poll, and after the
//! listening connection is re-established every one of them re-reads at once, because
//! notifications sent while it was down are never replayed. In [`NotifyMode::Poll`] (for
//! PostgreSQL-compatible engines without LISTEN) replicas only poll, and a replica's own
//! writes still wake its own followers at once.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use futures::StreamExt;
use tokio::sync::{mpsc, watch};
use tokio_postgres::AsyncMessage;
use tokio_util::sync::CancellationToken;

use super::connection::Connector;

/// The channel every replica listens on.
const CHANNEL: &str = "agentlog";
/// PostgreSQL caps a payload below 8000 bytes.
const MAX_PAYLOAD: usize = 7000;
/// The NOTIFYs of one replica go out at least this far apart; the wake-ups of the writes in
/// between gather into the next one. Each NOTIFY is a transaction of its own and wakes every
/// listening replica, which at one NOTIFY per batch statement cost PostgreSQL about as much
/// CPU as the appends' own statements at low load (bench/RESULTS.md, "PostgreSQL
/// backend"). A follower on another replica learns of a write up to this much later; one on
/// the writing replica is woken at once.
const NOTIFY_GAP: Duration = Duration::from_millis(2);

/// How replicas learn of each other's writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum NotifyMode {
    /// LISTEN/NOTIFY, sent in batches after commit, plus a slow safety poll.
    Listen,
    /// Polling only.
    Poll,
}

/// This replica's wake-up board: one counter per followed session and one for "a session
/// may have become claimable"; a bump wakes whoever waits on it.
#[derive(Default)]
pub struct Board {
    sessions: Mutex<Followed>,
    claimable: watch::Sender<u64>,
}

#[derive(Default)]
struct Followed {
    by_session: HashMap<String, watch::Sender<u64>>,
    /// Sessions nobody follows any more are dropped when the map reaches this size.
    prune_at: usize,
}

impl Followed {
    fn prune(&mut self) {
        self.by_session.retain(|_, tx| tx.receiver_count() > 0);
        self.prune_at = (self.by_session.len() * 2).max(1024);
    }
}

impl Board {
    /// A receiver that changes whenever `session_id` may have new events.
    pub fn follow(&self, session_id: &str) -> watch::Receiver<u64> {
        let mut sessions = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
        if sessions.by_session.len() >= sessions.prune_at {
            sessions.prune();
        }
        sessions
            .by_session
            .entry(session_id.to_string())
            .or_insert_with(|| watch::channel(0).0)
            .subscribe()
    }

    pub fn claimable(&self) -> watch::Receiver<u64> {
        self.claimable.subscribe()
    }

    /// `session_id` changed; `claimable`: it may now be claimable.
    pub fn wake(&self, session_id: &str, claimable: bool) {
        {
            let sessions = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(tx) = sessions.by_session.get(session_id) {
                tx.send_modify(|n| *n = n.wrapping_add(1));
            }
        }
        if claimable {
            self.claimable.send_modify(|n| *n = n.wrapping_add(1));
        }
    }

    /// Everyone re-reads (after notifications may have been missed).
    pub fn wake_all(&self) {
        let mut sessions = self.sessions.lock().unwrap_or_else(|p| p.into_inner());
        sessions.prune();
        for tx in sessions.by_session.values() {
            tx.send_modify(|n| *n = n.wrapping_add(1));
        }
        self.claimable.send_modify(|n| *n = n.wrapping_add(1));
    }
}

/// One line of a payload: `+id` (may be claimable) or `.id`.
fn line(session_id: &str, claimable: bool) -> String {
    format!("{}{session_id}", if claimable { '+' } else { '.' })
}

/// Sends the queued wake-ups of this replica's writes to the other replicas, as few NOTIFYs
/// as fit them, outside any append transaction, at most one round of them per
/// [`NOTIFY_GAP`]. A failed send is dropped: the receivers' safety poll covers it.
pub async fn send_batches(
    connector: Arc<Connector>,
    mut queue: mpsc::UnboundedReceiver<(String, bool)>,
    shutdown: CancellationToken,
) {
    let mut next_round = tokio::time::Instant::now();
    loop {
        let first = tokio::select! {
            item = queue.recv() => match item { Some(item) => item, None => return },
            _ = shutdown.cancelled() => return,
        };
        // The writes that come while it waits join this round.
        tokio::select! {
            _ = tokio::time::sleep_until(next_round) => {}
            _ = shutdown.cancelled() => return,
        }
        next_round = tokio::time::Instant::now() + NOTIFY_GAP;
        let mut lines: HashMap<String, bool> = HashMap::new();
        lines.insert(first.0, first.1);
        while let Ok((id, claimable)) = queue.try_recv() {
            *lines.entry(id).or_default() |= claimable;
        }
        let mut payloads = vec![String::new()];
        for (id, claimable) in lines {
            let l = line(&id, claimable);
            let current = payloads.last_mut().expect("at least one payload");
            if !current.is_empty() && current.len() + l.len() + 1 > MAX_PAYLOAD {
                payloads.push(l);
            } else {
                if !current.is_empty() {
                    current.push('\n');
                }
                current.push_str(&l);
            }
        }
        let Ok(client) = connector.pool.get().await else {
            continue;
        };
        // Prepared once per connection: a NOTIFY goes out every few milliseconds under load.
        // PostgreSQL gives a transaction that notifies a transaction id, so its commit is
        // a commit record like an append's; a wake-up is only a hint (a lost one costs
        // latency, never correctness), so this one transaction does not wait for its
        // commit to reach the disk (`set_config(…, true)` lasts until its end).
        let notify = match client
            .prepare_cached(
                "SELECT pg_notify($1, $2), set_config('synchronous_commit', 'off', true)",
            )
            .await
        {
            Ok(statement) => statement,
            Err(e) => {
                tracing::debug!(error = %e, "a wake-up was not sent; the safety poll covers it");
                continue;
            }
        };
        for payload in payloads {
            if let Err(e) = client.execute(&notify, &[&CHANNEL, &payload]).await {
                tracing::debug!(error = %e, "a wake-up was not sent; the safety poll covers it");
                break;
            }
        }
    }
}

/// Holds a LISTEN connection of its own and turns every notification into wake-ups on
/// `board`; reconnects with backoff when it drops, then wakes everyone.
pub async fn listen(connector: Arc<Connector>, board: Arc<Board>, shutdown: CancellationToken) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let connected = connector.pg_config.connect(connector.tls.clone());
        let (client, mut connection) = tokio::select! {
            c = connected => match c {
                Ok(c) => c,
                Err(e) => {
                    tracing::warn!(error = %e, "LISTEN connection failed; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(backoff) => {}
                        _ = shutdown.cancelled() => return,
                    }
                    backoff = (backoff * 2).min(Duration::from_secs(5));
                    continue;
                }
            },
            _ = shutdown.cancelled() => return,
        };
        let (tx, mut rx) = mpsc::unbounded_channel();
        let driver = tokio::spawn(async move {
            let mut messages = futures::stream::poll_fn(move |cx| connection.poll_message(cx));
            while let Some(Ok(message)) = messages.next().await {
                if let AsyncMessage::Notification(n) = message {
                    if tx.send(n.payload().to_string()).is_err() {
                        return;
                    }
                }
            }
        });
        if let Err(e) = client.batch_execute(&format!("LISTEN {CHANNEL}")).await {
            tracing::warn!(error = %e, "LISTEN failed; retrying");
            driver.abort();
            continue;
        }
        backoff = Duration::from_millis(100);
        // Whatever was sent while no connection listened is gone: everyone re-reads.
        board.wake_all();
        loop {
            tokio::select! {
                payload = rx.recv() => match payload {
                    Some(payload) => {
                        for l in payload.lines() {
                            match l.split_at_checked(1) {
                                Some(("+", id)) => board.wake(id, true),
                                Some((_, id)) => board.wake(id, false),
                                None => {}
                            }
                        }
                    }
                    None => break,
                },
                _ = shutdown.cancelled() => {
                    driver.abort();
                    return;
                }
            }
        }
        tracing::warn!("the LISTEN connection dropped; reconnecting");
        drop(client);
    }
}
