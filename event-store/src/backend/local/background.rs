//! The store's own background threads (retention, and the reclamation of deleted sessions'
//! space): each sends its work through the writer's queue like any caller, paces itself,
//! and stops when the store closes ([`Signal`], `signal.rs`), letting go of the queue so that the writer
//! can finish.

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

use super::signal::Signal;
use super::snapshots::SnapshotDir;
use super::writer::{DeleteOp, Op};
use crate::clock::now_unix_ms;
use crate::error::StoreError;
use crate::retention::{Retention, BATCH};

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
    stop: Signal,
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
