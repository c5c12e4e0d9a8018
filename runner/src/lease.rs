//! The lease a claimed session is worked under.
//!
//! Promise: a session is worked on only while its lease is ours, and its work has stopped
//! (a running tool's process tree killed) *before* the lease can run out. The lease is
//! renewed every ttl/3. Time is kept by this process's monotonic clock, counted from
//! *before* each renewal was sent, so the runner's idea of its lease never outlasts the
//! store's: the lease is surely ours until (when the last successful renewal was sent) +
//! ttl. A timer set to that moment minus [`stop_margin`] stops the work, whatever the
//! renewals in flight are doing (one hanging on a cut network may take ttl/3 to fail); a
//! renewal that succeeds moves the timer on. The work also stops at once when a renewal or
//! an append is refused because a newer lease exists
//! (`agentlog_client::refusal::is_lease_lost`), and when the runner's drain runs out of
//! budget (`drain.rs`). A runner paused past its lease (GC, SIGSTOP, a partition) sees
//! [`LeaseGuard::has_margin`] fail on waking and starts nothing more.
//!
//! A deleted session stops the same way, at once: the store ends the session's live
//! subscription with `SESSION_DELETED` (the fast signal, passed on through [`Deletion`]), or
//! refuses a renewal or an append for that reason (the slow one). The store dropped the
//! lease with the session, so it is never given back ([`LeaseGuard::release`] says so
//! quietly); `worker.rs` then removes the session's workspace.
//!
//! Guarded by `integration-tests/tests/runner_partition.rs` (a runner cut off mid-call by a
//! network namespace: no two runs of the call overlap, at several ttls),
//! `integration-tests/tests/runner_delete.rs` (a deletion mid call and mid stream) and this
//! module's tests of the timer.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use agentlog_client::refusal::{is_lease_lost, is_session_deleted};
use agentlog_client::StoreClient;
use agentlog_proto::v1::{Lease, ReleaseLeaseRequest, RenewLeaseRequest};
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::drain::{Drain, RELEASE_DEADLINE};
use crate::store_error::StoreError;

/// How long before the lease's end (by our clock) the work is stopped: time for a tool's
/// process tree to be killed and reaped with room to spare. A tenth of the ttl, at least
/// 100 ms and at most 2 s.
pub fn stop_margin(ttl: Duration) -> Duration {
    (ttl / 10).clamp(Duration::from_millis(100), Duration::from_secs(2))
}

/// A held lease, renewed in the background until released or lost.
#[derive(Debug)]
pub struct LeaseGuard {
    client: StoreClient,
    lease: Lease,
    ttl: Duration,
    /// By our monotonic clock: the store's expiry is no earlier than this.
    valid_until: watch::Receiver<Instant>,
    /// Set once the lease is gone or may be: the store said a newer one exists, or its
    /// time ran out before a renewal came back.
    lost: Arc<AtomicBool>,
    /// Set once the store said the session was deleted (the lease went with it).
    deleted: Arc<AtomicBool>,
    /// Fires on loss of the lease, shortly before it could run out, when the session is
    /// deleted, and when the drain's budget is spent.
    cancel: CancellationToken,
    drain: Drain,
    renewer: tokio::task::JoinHandle<()>,
    timer: tokio::task::JoinHandle<()>,
}

impl LeaseGuard {
    /// Takes over a lease just granted by `ClaimSession`. A first renewal pins its expiry to
    /// our own clock (the claim's long-poll leaves the moment of the grant unknown).
    pub async fn hold(
        client: StoreClient,
        lease: Lease,
        ttl: Duration,
        drain: &Drain,
    ) -> Result<LeaseGuard, StoreError> {
        let (until, valid_until) = watch::channel(Instant::now());
        renew(&client, &lease, ttl, &until).await?;
        let lost = Arc::new(AtomicBool::new(false));
        let cancel = drain.expired().child_token();
        let deletion = Deletion {
            deleted: Arc::new(AtomicBool::new(false)),
            lost: lost.clone(),
            cancel: cancel.clone(),
        };
        let renewer = tokio::spawn(
            keep_renewing(client.clone(), lease.clone(), ttl, until, deletion.clone())
                .in_current_span(),
        );
        let timer = tokio::spawn(
            stop_before_expiry(
                valid_until.clone(),
                stop_margin(ttl),
                lost.clone(),
                cancel.clone(),
            )
            .in_current_span(),
        );
        Ok(LeaseGuard {
            client,
            lease,
            ttl,
            valid_until,
            lost,
            deleted: deletion.deleted,
            cancel,
            drain: drain.clone(),
            renewer,
            timer,
        })
    }

    pub fn epoch(&self) -> u64 {
        self.lease.epoch
    }

    /// Fires when the session's work must stop now: the lease is lost or about to run out,
    /// the session was deleted, or the drain's budget is spent.
    pub fn cancelled(&self) -> &CancellationToken {
        &self.cancel
    }

    /// What the session's log follower and appender tell when the store says the session
    /// was deleted.
    pub fn deletion(&self) -> Deletion {
        Deletion {
            deleted: self.deleted.clone(),
            lost: self.lost.clone(),
            cancel: self.cancel.clone(),
        }
    }

    /// Whether the store said the session was deleted.
    pub fn is_deleted(&self) -> bool {
        self.deleted.load(Ordering::SeqCst)
    }

    /// Whether the runner is draining: the step in hand may finish, no new one starts.
    pub fn draining(&self) -> bool {
        self.drain.has_begun()
    }

    /// Resolves once the runner drains.
    pub async fn drain_begun(&self) {
        self.drain.begun().await
    }

    /// Whether the lease, by our clock, still has a third of its ttl left: enough to start
    /// a tool and write its `tool_started` while it is surely ours.
    pub fn has_margin(&self) -> bool {
        Instant::now() + self.ttl / 3 < *self.valid_until.borrow()
    }

    /// Records that the store refused us: an append was refused as fenced off.
    pub fn mark_lost(&self) {
        self.lost.store(true, Ordering::SeqCst);
        self.cancel.cancel();
    }

    /// Stops renewing and gives the lease back, unless it is gone (lost, or dropped by the
    /// store with the deleted session); the release has a deadline ([`RELEASE_DEADLINE`]),
    /// so a store that does not answer delays nobody.
    pub async fn release(self) {
        self.renewer.abort();
        self.timer.abort();
        if self.is_deleted() {
            tracing::info!("the session was deleted: its lease went with it");
            return;
        }
        if self.lost.load(Ordering::SeqCst) {
            crate::metrics::lease_lost();
            return;
        }
        release(&self.client, &self.lease).await;
    }
}

/// Gives `lease` back, within [`RELEASE_DEADLINE`]. A refusal means it had already ended;
/// a release that times out leaves the lease to expire by itself.
pub async fn release(client: &StoreClient, lease: &Lease) {
    let request = ReleaseLeaseRequest {
        session_id: lease.session_id.clone(),
        owner: lease.owner.clone(),
        epoch: lease.epoch,
    };
    match tokio::time::timeout(RELEASE_DEADLINE, client.clone().release_lease(request)).await {
        Ok(Ok(_)) => {}
        Ok(Err(status)) => {
            tracing::debug!(%status, "release refused (the lease had already ended)")
        }
        Err(_) => tracing::warn!(
            epoch = lease.epoch,
            "the store did not answer the release in time; the lease will expire by itself"
        ),
    }
}

/// One renewal. On success the lease is ours until `sent + ttl` by our clock.
async fn renew(
    client: &StoreClient,
    lease: &Lease,
    ttl: Duration,
    valid_until: &watch::Sender<Instant>,
) -> Result<(), StoreError> {
    let sent = Instant::now();
    let request = RenewLeaseRequest {
        session_id: lease.session_id.clone(),
        owner: lease.owner.clone(),
        epoch: lease.epoch,
        ttl_ms: ttl.as_millis() as u64,
    };
    // A renewal slower than a third of the ttl is useless; give up on it and try again.
    match tokio::time::timeout(ttl / 3, client.clone().renew_lease(request)).await {
        Ok(Ok(_)) => {
            valid_until.send_if_modified(|until| {
                let moved = sent + ttl > *until;
                if moved {
                    *until = sent + ttl;
                }
                moved
            });
            Ok(())
        }
        Ok(Err(status)) if is_session_deleted(&status) => Err(StoreError::SessionDeleted),
        Ok(Err(status)) if is_lease_lost(&status) => Err(StoreError::LeaseLost),
        Ok(Err(status)) => Err(StoreError::Failed(status)),
        Err(_) => Err(StoreError::Failed(tonic::Status::deadline_exceeded(
            "RenewLease took longer than ttl/3",
        ))),
    }
}

async fn keep_renewing(
    client: StoreClient,
    lease: Lease,
    ttl: Duration,
    valid_until: watch::Sender<Instant>,
    deletion: Deletion,
) {
    let mut pause = ttl / 3;
    loop {
        tokio::select! {
            _ = deletion.cancel.cancelled() => return,
            _ = tokio::time::sleep(pause) => {}
        }
        pause = match renew(&client, &lease, ttl, &valid_until).await {
            Ok(()) => ttl / 3,
            Err(StoreError::SessionDeleted) => {
                deletion.seen("a lease renewal");
                return;
            }
            Err(StoreError::LeaseLost) => {
                tracing::warn!(
                    epoch = lease.epoch,
                    "lease lost: a newer lease exists; stopping work"
                );
                deletion.lost.store(true, Ordering::SeqCst);
                deletion.cancel.cancel();
                return;
            }
            // Try again soon: the timer, not this loop, decides when the work must stop.
            Err(e) => {
                tracing::warn!(error = %e, "lease renewal failed; retrying");
                ttl / 10
            }
        };
    }
}

/// Stops a session's work when the store says the session was deleted; cheap to clone.
#[derive(Debug, Clone)]
pub struct Deletion {
    deleted: Arc<AtomicBool>,
    lost: Arc<AtomicBool>,
    cancel: CancellationToken,
}

impl Deletion {
    /// The store refused `what` (or ended it) with `SESSION_DELETED`: the work stops now
    /// (the model stream dropped, a tool's process tree killed) and the lease is not given
    /// back.
    pub fn seen(&self, what: &str) {
        if !self.deleted.swap(true, Ordering::SeqCst) {
            tracing::info!(by = what, "the session was deleted; stopping its work");
            crate::metrics::session_deleted();
        }
        self.lost.store(true, Ordering::SeqCst);
        self.cancel.cancel();
    }
}

/// Fires `cancel` [`stop_margin`] before the lease can run out by our clock, following
/// `valid_until` as renewals move it; marks the lease lost when it does.
async fn stop_before_expiry(
    mut valid_until: watch::Receiver<Instant>,
    margin: Duration,
    lost: Arc<AtomicBool>,
    cancel: CancellationToken,
) {
    loop {
        let until = *valid_until.borrow_and_update();
        let stop_at = until.checked_sub(margin).unwrap_or(until);
        tokio::select! {
            _ = cancel.cancelled() => return,
            changed = valid_until.changed() => if changed.is_err() {
                // The renewer is gone: nothing will move the end any more.
                tokio::select! {
                    _ = cancel.cancelled() => return,
                    _ = tokio::time::sleep_until(stop_at) => {}
                }
            } else {
                continue
            },
            _ = tokio::time::sleep_until(stop_at) => {}
        }
        tracing::warn!(
            margin_ms = margin.as_millis() as u64,
            "no renewal came back in time: stopping work before the lease can run out"
        );
        lost.store(true, Ordering::SeqCst);
        cancel.cancel();
        return;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timer(ttl: Duration) -> (watch::Sender<Instant>, Arc<AtomicBool>, CancellationToken) {
        let (until, valid_until) = watch::channel(Instant::now() + ttl);
        let lost = Arc::new(AtomicBool::new(false));
        let cancel = CancellationToken::new();
        tokio::spawn(stop_before_expiry(
            valid_until,
            stop_margin(ttl),
            lost.clone(),
            cancel.clone(),
        ));
        (until, lost, cancel)
    }

    #[tokio::test(start_paused = true)]
    async fn work_stops_a_margin_before_the_lease_runs_out_without_a_renewal() {
        let ttl = Duration::from_secs(3);
        let (_until, lost, cancel) = timer(ttl);
        tokio::time::sleep(Duration::from_millis(2_690)).await;
        assert!(!cancel.is_cancelled(), "not before ttl - margin (2.7 s)");
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(
            cancel.is_cancelled(),
            "at ttl - margin, whatever renewals do"
        );
        assert!(lost.load(Ordering::SeqCst));
    }

    #[tokio::test(start_paused = true)]
    async fn a_successful_renewal_moves_the_stop_on() {
        let ttl = Duration::from_secs(3);
        let (until, _lost, cancel) = timer(ttl);
        tokio::time::sleep(Duration::from_secs(1)).await;
        until.send_replace(Instant::now() + ttl);
        tokio::time::sleep(Duration::from_millis(2_600)).await;
        assert!(
            !cancel.is_cancelled(),
            "the renewal at 1 s moved the end to 4 s"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(cancel.is_cancelled());
        // Even with the renewer gone, the last end stands.
        let (until, _lost, cancel) = timer(ttl);
        drop(until);
        tokio::time::sleep(Duration::from_millis(2_710)).await;
        assert!(cancel.is_cancelled());
    }

    #[test]
    fn the_margin_is_a_tenth_of_the_ttl_within_bounds() {
        assert_eq!(
            stop_margin(Duration::from_secs(3)),
            Duration::from_millis(300)
        );
        assert_eq!(
            stop_margin(Duration::from_millis(300)),
            Duration::from_millis(100)
        );
        assert_eq!(stop_margin(Duration::from_secs(60)), Duration::from_secs(2));
    }
}
