//! The lease a claimed session is worked under.
//!
//! Promise: a session is worked on only while its lease is ours. The lease is renewed every
//! ttl/3; when a renewal is refused because the lease is lost
//! (`agentlog_client::refusal::is_lease_lost`), or renewals fail until the
//! lease's time is up, the session's cancellation token fires and its work stops at once.
//! Time is kept by this process's monotonic clock, counted from *before* each renewal was
//! sent, so the runner's idea of its lease never outlasts the store's: a runner paused past
//! its lease (GC, SIGSTOP, a partition) sees [`LeaseGuard::has_margin`] fail on waking and
//! starts nothing more.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use agentlog_client::refusal::is_lease_lost;
use agentlog_client::StoreClient;
use agentlog_proto::v1::{Lease, ReleaseLeaseRequest, RenewLeaseRequest};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::session_log::StoreError;

/// A held lease, renewed in the background until released or lost.
#[derive(Debug)]
pub struct LeaseGuard {
    client: StoreClient,
    lease: Lease,
    ttl: Duration,
    /// By our monotonic clock: the store's expiry is no earlier than this.
    valid_until: Arc<Mutex<Instant>>,
    /// Set once the store has said a newer lease exists.
    lost: Arc<AtomicBool>,
    /// Fires on loss of the lease and on shutdown.
    cancel: CancellationToken,
    renewer: tokio::task::JoinHandle<()>,
}

impl LeaseGuard {
    /// Takes over a lease just granted by `ClaimSession`. A first renewal pins its expiry to
    /// our own clock (the claim's long-poll leaves the moment of the grant unknown).
    pub async fn hold(
        client: StoreClient,
        lease: Lease,
        ttl: Duration,
        shutdown: &CancellationToken,
    ) -> Result<LeaseGuard, StoreError> {
        let valid_until = Arc::new(Mutex::new(Instant::now()));
        renew(&client, &lease, ttl, &valid_until).await?;
        let lost = Arc::new(AtomicBool::new(false));
        let cancel = shutdown.child_token();
        let renewer = tokio::spawn(
            keep_renewing(
                client.clone(),
                lease.clone(),
                ttl,
                valid_until.clone(),
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
            cancel,
            renewer,
        })
    }

    pub fn epoch(&self) -> u64 {
        self.lease.epoch
    }

    /// Fires when the session's work must stop: the lease is lost, or the runner stops.
    pub fn cancelled(&self) -> &CancellationToken {
        &self.cancel
    }

    /// Whether the lease, by our clock, still has a third of its ttl left: enough to start
    /// a tool and write its `tool_started` while it is surely ours.
    pub fn has_margin(&self) -> bool {
        let valid_until = *self
            .valid_until
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        Instant::now() + self.ttl / 3 < valid_until
    }

    /// Records that the store refused us: an append was refused as fenced off.
    pub fn mark_lost(&self) {
        self.lost.store(true, Ordering::SeqCst);
        self.cancel.cancel();
    }

    /// Stops renewing and gives the lease back, unless the store already took it.
    pub async fn release(self) {
        self.renewer.abort();
        if self.lost.load(Ordering::SeqCst) {
            crate::metrics::lease_lost();
            return;
        }
        let request = ReleaseLeaseRequest {
            session_id: self.lease.session_id.clone(),
            owner: self.lease.owner.clone(),
            epoch: self.lease.epoch,
        };
        if let Err(status) = self.client.clone().release_lease(request).await {
            tracing::debug!(%status, "release refused (the lease had already ended)");
        }
    }
}

/// One renewal. On success the lease is ours until `sent + ttl` by our clock.
async fn renew(
    client: &StoreClient,
    lease: &Lease,
    ttl: Duration,
    valid_until: &Mutex<Instant>,
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
            let mut until = valid_until
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
            *until = (*until).max(sent + ttl);
            Ok(())
        }
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
    valid_until: Arc<Mutex<Instant>>,
    lost: Arc<AtomicBool>,
    cancel: CancellationToken,
) {
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(ttl / 3) => {}
        }
        match renew(&client, &lease, ttl, &valid_until).await {
            Ok(()) => {}
            Err(StoreError::LeaseLost) => {
                tracing::warn!(
                    epoch = lease.epoch,
                    "lease lost: a newer lease exists; stopping work"
                );
                lost.store(true, Ordering::SeqCst);
                cancel.cancel();
                return;
            }
            Err(e) => tracing::warn!(error = %e, "lease renewal failed; retrying"),
        }
        let expired = Instant::now()
            >= *valid_until
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner());
        if expired {
            tracing::warn!(
                epoch = lease.epoch,
                "lease expired without a renewal; stopping work"
            );
            lost.store(true, Ordering::SeqCst);
            cancel.cancel();
            return;
        }
    }
}
