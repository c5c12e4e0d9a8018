//! The store's own background threads (retention, and the reclamation of deleted sessions'
//! space): each sends its work through the writer's queue like any caller, paces itself,
//! and stops when the store closes ([`Stop`]), letting go of the queue so that the writer
//! can finish.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};

use super::snapshots::SnapshotDir;
use super::writer::{DeleteOp, Op};
use crate::clock::now_unix_ms;
use crate::error::StoreError;
use crate::retention::{Retention, BATCH};

/// Tells the background threads to stop, and waits for it between their steps.
#[derive(Clone, Default)]
pub struct Stop(Arc<(Mutex<bool>, Condvar)>);

impl Stop {
    pub fn stop(&self) {
        let (stopped, wake) = &*self.0;
        *stopped.lock().unwrap_or_else(|p| p.into_inner()) = true;
        wake.notify_all();
    }

    /// Waits up to `wait`; whether the store is stopping.
    pub fn wait(&self, wait: Duration) -> bool {
        let (stopped, wake) = &*self.0;
        let guard = stopped.lock().unwrap_or_else(|p| p.into_inner());
        let (guard, _) = wake
            .wait_timeout_while(guard, wait, |stopped| !*stopped)
            .unwrap_or_else(|p| p.into_inner());
        *guard
    }

    pub fn is_stopped(&self) -> bool {
        *self.0 .0.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Sends `op` (made with its reply channel) to the writer and waits for the answer; `None`
/// if the writer is gone.
pub fn ask<T>(
    queue: &mpsc::Sender<Op>,
    make: impl FnOnce(oneshot::Sender<Result<T, StoreError>>) -> Op,
) -> Option<Result<T, StoreError>> {
    let (tx, rx) = oneshot::channel();
    queue.blocking_send(make(tx)).ok()?;
    rx.blocking_recv().ok()
}

/// Retention: every `retention.interval`, deletes the sessions idle for longer than
/// `retention.idle`, [`BATCH`] at a time (each step one op of the writer's queue, with
/// appends between them), and removes their snapshots.
pub fn run_retention(
    queue: mpsc::Sender<Op>,
    retention: Retention,
    snapshots: Arc<SnapshotDir>,
    stop: Stop,
) {
    while !stop.wait(retention.interval) {
        loop {
            let idle_before = retention.idle_before(now_unix_ms());
            let step = DeleteOp::Idle {
                idle_before,
                max: BATCH,
            };
            let deleted = match ask(&queue, |tx| Op::Delete(step, tx)) {
                None => return,
                Some(Ok(deleted)) => deleted,
                Some(Err(e)) => {
                    tracing::warn!(error = %e, "a retention step failed; the next pass tries again");
                    break;
                }
            };
            crate::metrics::sessions_deleted("retention", deleted.len());
            if !deleted.is_empty() {
                tracing::info!(sessions = deleted.len(), "retention deleted idle sessions");
            }
            if let Err(e) = snapshots.remove_sessions(deleted.iter().map(String::as_str)) {
                tracing::warn!(error = %e, "removing deleted sessions' snapshots failed; the next open does it");
            }
            if deleted.len() < BATCH || stop.is_stopped() {
                break;
            }
        }
    }
}
