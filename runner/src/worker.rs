//! The claim/lease worker: claims runnable sessions, holds each one's lease, and works it
//! through the agent loop (`turn.rs`) until it is idle, waits for a person, or must stop.

use std::sync::Arc;
use std::time::Duration;

use agentlog_client::StoreClient;
use agentlog_proto::v1::{ClaimSessionRequest, Lease};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::lease::LeaseGuard;
use crate::session_log::{Appender, FoldCache, SessionLog, StoreError};
use crate::turn::{self, Outcome, TurnContext, TurnError};

/// How long one `ClaimSession` long-poll waits for a runnable session.
const CLAIM_WAIT: Duration = Duration::from_secs(2);
/// The pause after the store could not be reached.
const CLAIM_RETRY: Duration = Duration::from_secs(1);
/// Sessions' folds kept for a quick re-claim, per session this runner may work at once.
const KEPT_FOLDS_PER_SLOT: usize = 4;

/// How this runner claims sessions.
#[derive(Debug, Clone)]
pub struct ClaimConfig {
    pub runner_id: String,
    pub lease_ttl: Duration,
    pub max_sessions: usize,
    /// Seqs between snapshots of a session's fold in the store (0: none); see
    /// [`FoldCache::new`].
    pub snapshot_every: u64,
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
        config.snapshot_every,
        Some(context.model.form()),
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
        Ok(Outcome::Idle) => {
            log.write_snapshot_if_due().await;
            tracing::info!("session is idle; releasing it")
        }
        Ok(Outcome::AwaitingApproval) => {
            log.write_snapshot_if_due().await;
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
