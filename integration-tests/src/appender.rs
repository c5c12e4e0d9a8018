//! A client appending user turns under the faults a test makes: `load:<n % 4>` sessions,
//! each append with an event id of its own (`load-<n>`), through the given replicas in turn,
//! retried (the same event id, the next replica) until acknowledged, and every
//! acknowledgement recorded as (session, event id, seq) for the test to find in the logs
//! (`assert_log_holds`).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentlog_client::StoreClient;
use agentlog_proto::v1::AppendRequest;

use crate::user_event;

/// session → event id → the seq it was acknowledged at.
pub type Acknowledged = BTreeMap<String, BTreeMap<String, u64>>;

/// The appending task; stopped by [`Appender::finish`].
pub struct Appender {
    stop: Arc<AtomicBool>,
    acked: Arc<Mutex<Acknowledged>>,
    retries: Arc<Mutex<u64>>,
    task: tokio::task::JoinHandle<()>,
}

impl Appender {
    /// Starts appending through `clients`, one per replica (needs a running tokio runtime).
    pub fn start(clients: Vec<StoreClient>) -> Appender {
        let stop = Arc::new(AtomicBool::new(false));
        let acked: Arc<Mutex<Acknowledged>> = Arc::default();
        let retries = Arc::new(Mutex::new(0));
        let (stop2, acked2, retries2) = (stop.clone(), acked.clone(), retries.clone());
        let task = tokio::spawn(async move {
            let mut n: usize = 0;
            while !stop2.load(Ordering::Relaxed) {
                let session = format!("load:{}", n % 4);
                let event_id = format!("load-{n}");
                let mut attempt = 0usize;
                loop {
                    let replica = (n + attempt) % clients.len();
                    let request = AppendRequest {
                        session_id: session.clone(),
                        events: vec![user_event(&event_id, &format!("append {n}"))],
                        ..Default::default()
                    };
                    let answer = tokio::time::timeout(
                        Duration::from_secs(5),
                        clients[replica].clone().append(request),
                    )
                    .await;
                    if let Ok(Ok(response)) = answer {
                        let seq = response.into_inner().seqs[0];
                        lock(&acked2)
                            .entry(session.clone())
                            .or_default()
                            .insert(event_id.clone(), seq);
                        break;
                    }
                    attempt += 1;
                    *lock(&retries2) += 1;
                    // An append still in doubt when the test stops is not acknowledged.
                    if stop2.load(Ordering::Relaxed) && attempt > 100 {
                        break;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                n += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        });
        Appender {
            stop,
            acked,
            retries,
            task,
        }
    }

    /// (appends acknowledged, attempts retried) so far.
    pub fn count(&self) -> (usize, u64) {
        (
            lock(&self.acked).values().map(BTreeMap::len).sum(),
            *lock(&self.retries),
        )
    }

    /// Waits for `more` acknowledgements beyond now; panics after `bound`.
    pub async fn wait_more(&self, more: usize, bound: Duration) {
        let start = self.count().0;
        let deadline = Instant::now() + bound;
        while self.count().0 < start + more {
            assert!(
                Instant::now() < deadline,
                "appends stopped being acknowledged"
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Stops appending; every acknowledged append.
    pub async fn finish(self) -> Acknowledged {
        self.stop.store(true, Ordering::Relaxed);
        self.task.await.expect("the appender");
        std::mem::take(&mut *lock(&self.acked))
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}
