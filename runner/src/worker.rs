//! The claim/lease worker: claims runnable sessions, holds each one's lease, and works it
//! through the agent loop (`turn.rs`) until it is idle, waits for a person, or must stop.
//! A session the store says was deleted (while held, or as it was claimed) stops at once;
//! its lease is not given back (the store dropped it), its fold is not kept, and once its
//! work has stopped its workspace is removed and a sweep asked for (`sweep.rs`).

use std::sync::Arc;
use std::time::Duration;

use agentlog_client::StoreClient;
use agentlog_proto::v1::{ClaimSessionRequest, Lease};
use futures::FutureExt;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tracing::Instrument;

use crate::context::TurnContext;
use crate::drain::{Drain, APPEND_GRACE};
use crate::lease::{self, LeaseGuard};
use crate::session_log::{Appender, FoldCache, SessionLog};
use crate::store_error::StoreError;
use crate::sweep::Sweeper;
use crate::turn::{self, Outcome, TurnError};

/// How long one `ClaimSession` long-poll waits for a runnable session.
const CLAIM_WAIT: Duration = Duration::from_secs(2);
/// A claim still unanswered this long after its wait is given up (and so cancelled): on a
/// connection gone silent it would otherwise hang until HTTP/2 keepalive notices, 10 s on.
const CLAIM_SLACK: Duration = Duration::from_secs(3);
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
/// its lease is lost, or the runner drains. When `drain` begins nothing more is claimed: a
/// long-poll in flight is cut short (cancelled; the store gives back a lease it grants a
/// claimant that went away, and one whose answer was already here is given back by us).
/// Every session then finishes its step in hand (within the drain's budget) and gives its
/// lease back, and this returns.
pub async fn claim_loop(
    client: StoreClient,
    config: ClaimConfig,
    context: Arc<TurnContext>,
    sweeper: Arc<Sweeper>,
    drain: Drain,
) {
    let permits = Arc::new(Semaphore::new(config.max_sessions.max(1)));
    let folds = Arc::new(FoldCache::new(
        config.max_sessions.max(1) * KEPT_FOLDS_PER_SLOT,
        config.snapshot_every,
        context.models.forms(),
    ));
    let mut sessions = JoinSet::new();
    loop {
        // Biased: with a permit free and the drain begun, an unbiased select would claim
        // again half the time, each time for a whole long-poll.
        let permit = tokio::select! {
            biased;
            _ = drain.begun() => break,
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
        let mut claimant = client.clone();
        let claim = tokio::time::timeout(CLAIM_WAIT + CLAIM_SLACK, claimant.claim_session(request));
        tokio::pin!(claim);
        let claimed = tokio::select! {
            biased;
            claimed = &mut claim => claimed,
            // The drain cuts the long-poll short: an answer already here is taken (its lease
            // is given back below); one still on its way is cancelled with the call.
            _ = drain.begun() => match (&mut claim).now_or_never() {
                Some(claimed) => claimed,
                None => break,
            },
        };
        let lease = match claimed {
            Ok(Ok(response)) => response.into_inner().lease,
            Ok(Err(status)) => {
                tracing::warn!(%status, "ClaimSession failed; retrying");
                tokio::select! {
                    biased;
                    _ = drain.begun() => break,
                    _ = tokio::time::sleep(CLAIM_RETRY) => continue,
                }
            }
            Err(_) => {
                tracing::warn!(
                    wait_ms = CLAIM_WAIT.as_millis() as u64,
                    "ClaimSession did not answer in time; claiming again"
                );
                continue;
            }
        };
        let Some(lease) = lease else { continue };
        if drain.has_begun() {
            tracing::info!(session_id = %lease.session_id, "a lease came as the drain began; giving it back");
            lease::release(&client, &lease).await;
            break;
        }
        let span = tracing::info_span!("turn", session_id = %lease.session_id, epoch = lease.epoch);
        let client = client.clone();
        let context = context.clone();
        let drain = drain.clone();
        let folds = folds.clone();
        let sweeper = sweeper.clone();
        let ttl = config.lease_ttl;
        sessions.spawn(
            async move {
                let session_id = lease.session_id.clone();
                let ended = work_session(client, lease, ttl, &context, &folds, &drain).await;
                if ended == Ended::Deleted {
                    remove_deleted(&sweeper, &session_id).await;
                }
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

/// How a session's work ended, for what follows it.
#[derive(Debug, PartialEq, Eq)]
enum Ended {
    /// The lease was given back, or lost.
    LetGo,
    /// The store said the session was deleted; its work has stopped.
    Deleted,
}

/// Removes the workspace of a deleted session whose work has stopped here, and asks for a
/// sweep so that its checkpoints go too. A failure is left for a later sweep.
async fn remove_deleted(sweeper: &Sweeper, session_id: &str) {
    match sweeper.remove_workspace(session_id).await {
        Ok(true) => tracing::info!("removed the deleted session's workspace"),
        Ok(false) => {}
        Err(e) => {
            tracing::warn!(error = %e, "could not remove the deleted session's workspace; a later sweep will")
        }
    }
    sweeper.kick();
}

/// Works one claimed session until it is idle or must stop, then lets the lease go.
async fn work_session(
    client: StoreClient,
    lease: Lease,
    ttl: Duration,
    context: &TurnContext,
    folds: &FoldCache,
    drain: &Drain,
) -> Ended {
    let _held = crate::metrics::SessionHeld::enter();
    let hold = LeaseGuard::hold(client.clone(), lease.clone(), ttl, drain);
    let held = tokio::select! {
        biased;
        _ = drain.begun() => None,
        held = hold.instrument(tracing::info_span!("claim")) => Some(held),
    };
    let guard = match held {
        Some(Ok(guard)) => guard,
        Some(Err(StoreError::SessionDeleted)) => {
            tracing::info!("the claimed session was deleted; leaving it");
            crate::metrics::session_deleted();
            return Ended::Deleted;
        }
        Some(Err(e)) => {
            tracing::warn!(error = %e, "could not confirm the claimed lease; leaving the session");
            return Ended::LetGo;
        }
        None => {
            tracing::info!("draining before any step; releasing the session");
            lease::release(&client, &lease).await;
            return Ended::LetGo;
        }
    };
    tracing::info!("claimed");
    let deletion = guard.deletion();
    let appender =
        Appender::new(client, lease.session_id.clone(), lease.epoch).telling(deletion.clone());
    let opened = tokio::select! {
        biased;
        _ = drain.begun() => None,
        opened = SessionLog::open(appender, folds, deletion.clone()) => Some(opened),
    };
    let mut log = match opened {
        Some(Ok(log)) => log,
        Some(Err(StoreError::SessionDeleted)) => {
            deletion.seen("GetSession");
            guard.release().await;
            return Ended::Deleted;
        }
        Some(Err(e)) => {
            tracing::warn!(error = %e, "cannot read the session's log; leaving the session");
            guard.release().await;
            return Ended::LetGo;
        }
        None => {
            tracing::info!("draining before any step; releasing the session");
            guard.release().await;
            return Ended::LetGo;
        }
    };
    // Past the budget the step in hand is stopped (a tool's process tree killed); an append
    // still in flight then gets APPEND_GRACE before the work is dropped.
    let outcome = tokio::select! {
        biased;
        outcome = turn::drive_session(context, &mut log, &guard) => outcome,
        _ = drain.expired_for(APPEND_GRACE) => {
            tracing::warn!("the drain's budget is spent and an append is still unanswered; leaving the session");
            Ok(Outcome::Stopped)
        }
    };
    if outcome.as_ref().is_err_and(TurnError::is_session_deleted) {
        deletion.seen("a store call");
    }
    if guard.is_deleted() {
        // Stopped already: the model stream dropped, a tool's process tree killed and reaped.
        drop(log);
        guard.release().await;
        return Ended::Deleted;
    }
    match outcome {
        Ok(Outcome::Idle) => {
            // The snapshot only saves a later claim some reading: not worth a drain's time.
            tokio::select! {
                biased;
                _ = drain.begun() => {}
                _ = log.write_snapshot_if_due() => {}
            }
            tracing::info!("session is idle; releasing it")
        }
        Ok(Outcome::AwaitingApproval) => {
            tokio::select! {
                biased;
                _ = drain.begun() => {}
                _ = log.write_snapshot_if_due() => {}
            }
            tracing::info!("a call waits for a person; releasing the session")
        }
        Ok(Outcome::Parked { until }) => {
            crate::metrics::parked();
            tracing::info!(
                due_unix_ms = until,
                "the next model call is a long wait away; parking the session until then"
            )
        }
        Ok(Outcome::Stopped) if drain.has_begun() => {
            tracing::info!("drained: releasing the session")
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
    Ended::LetGo
}
