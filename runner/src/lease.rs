//! Session ownership: the claim loop, and the lease each claimed session is worked under.
//!
//! Promise: a session is worked on only while its lease is ours. The lease is renewed every
//! ttl/3; when a renewal is refused (a newer epoch exists), or renewals fail until the
//! lease's time is up, the session's cancellation token fires and its work stops at once.
//! Time is kept by this process's monotonic clock, counted from *before* each renewal was
//! sent, so the runner's idea of its lease never outlasts the store's: a runner paused past
//! its lease (GC, SIGSTOP, a partition) sees [`LeaseGuard::has_margin`] fail on waking and
//! starts nothing more.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::store_client::StoreClient;
use agentlog_proto::v1::{ClaimSessionRequest, Lease, ReleaseLeaseRequest, RenewLeaseRequest};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tonic::Code;
use tracing::Instrument;

use crate::session_log::{Appender, FoldCache, SessionLog, StoreError};
use crate::turn::{self, Outcome, TurnContext, TurnError};

/// How long one `ClaimSession` long-poll waits for a runnable session.
const CLAIM_WAIT: Duration = Duration::from_secs(2);
/// The pause after the store could not be reached.
const CLAIM_RETRY: Duration = Duration::from_secs(1);
/// Sessions' folds kept for a quick re-claim, per session this runner may work at once.
const KEPT_FOLDS_PER_SLOT: usize = 4;

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

    /// Records that the store refused us (an append answered `FAILED_PRECONDITION`).
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
        Ok(Err(status)) if matches!(status.code(), Code::FailedPrecondition | Code::NotFound) => {
            Err(StoreError::LeaseLost)
        }
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

/// How this runner claims sessions.
#[derive(Debug, Clone)]
pub struct ClaimConfig {
    pub runner_id: String,
    pub lease_ttl: Duration,
    pub max_sessions: usize,
}

/// Claims runnable sessions, up to `max_sessions` at once, and works each until it is idle,
/// its lease is lost, or `shutdown` fires. On shutdown no new claim is made, every session
/// finishes the append in hand and gives its lease back, and then this returns.
pub async fn claim_loop(
    client: StoreClient,
    config: ClaimConfig,
    context: Arc<TurnContext>,
    shutdown: CancellationToken,
) {
    let permits = Arc::new(Semaphore::new(config.max_sessions.max(1)));
    let folds = Arc::new(FoldCache::new(
        config.max_sessions.max(1) * KEPT_FOLDS_PER_SLOT,
    ));
    let mut sessions = JoinSet::new();
    loop {
        let permit = tokio::select! {
            _ = shutdown.cancelled() => break,
            permit = permits.clone().acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
        };
        while sessions.try_join_next().is_some() {}
        let request = ClaimSessionRequest {
            owner: config.runner_id.clone(),
            ttl_ms: config.lease_ttl.as_millis() as u64,
            wait_ms: CLAIM_WAIT.as_millis() as u64,
        };
        // The long-poll is not cut short by shutdown: a lease granted meanwhile must be seen,
        // to be given back at once rather than left to expire.
        let lease = match client.clone().claim_session(request).await {
            Ok(response) => response.into_inner().lease,
            Err(status) => {
                tracing::warn!(%status, "ClaimSession failed; retrying");
                tokio::select! {
                    _ = shutdown.cancelled() => break,
                    _ = tokio::time::sleep(CLAIM_RETRY) => continue,
                }
            }
        };
        let Some(lease) = lease else { continue };
        let span = tracing::info_span!("turn", session_id = %lease.session_id, epoch = lease.epoch);
        let client = client.clone();
        let context = context.clone();
        let shutdown = shutdown.clone();
        let folds = folds.clone();
        let ttl = config.lease_ttl;
        sessions.spawn(
            async move {
                work_session(client, lease, ttl, &context, &folds, &shutdown).await;
                drop(permit);
            }
            .instrument(span),
        );
    }
    tracing::info!(
        sessions = sessions.len(),
        "stopped claiming; waiting for sessions to let go"
    );
    while sessions.join_next().await.is_some() {}
}

/// Works one claimed session until it is idle or must stop, then lets the lease go.
async fn work_session(
    client: StoreClient,
    lease: Lease,
    ttl: Duration,
    context: &TurnContext,
    folds: &FoldCache,
    shutdown: &CancellationToken,
) {
    let _held = crate::metrics::SessionHeld::enter();
    let hold = LeaseGuard::hold(client.clone(), lease.clone(), ttl, shutdown);
    let guard = match hold.instrument(tracing::info_span!("claim")).await {
        Ok(guard) => guard,
        Err(e) => {
            tracing::warn!(error = %e, "could not confirm the claimed lease; leaving the session");
            return;
        }
    };
    tracing::info!("claimed");
    let appender = Appender::new(client, lease.session_id.clone(), lease.epoch);
    let mut log = match SessionLog::open(appender, folds).await {
        Ok(log) => log,
        Err(e) => {
            tracing::warn!(error = %e, "cannot read the session's log; leaving the session");
            guard.release().await;
            return;
        }
    };
    match turn::drive_session(context, &mut log, &guard).await {
        Ok(Outcome::Idle) => tracing::info!("session is idle; releasing it"),
        Ok(Outcome::AwaitingApproval) => {
            tracing::info!("a call waits for a person; releasing the session")
        }
        Ok(Outcome::Stopped) => tracing::info!("stopped working on the session"),
        Err(TurnError::Store(StoreError::LeaseLost)) => {
            guard.mark_lost();
            tracing::warn!("the store refused an append: the lease is lost; dropping the session");
        }
        Err(e) => tracing::warn!(error = %e, "leaving the session"),
    }
    log.keep_in(folds);
    guard.release().await;
}
