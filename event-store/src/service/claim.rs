//! A `ClaimSession` long-poll whose caller may go away: a runner that drains cancels its
//! poll, a cut connection drops the call. The poll then ends at once, and a lease it granted
//! meanwhile is given back instead of being left to expire while its session waits.

use std::sync::Arc;

use agentlog_proto::v1::Lease;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use crate::backend::Backend;
use crate::error::StoreError;

/// The poll runs in a task of its own, which keeps the lease until the handler has taken
/// it; dropping this before then (the handler was dropped) cancels the poll and releases
/// what it granted.
pub(super) struct ClaimInFlight {
    store: Arc<dyn Backend>,
    /// Ends the poll.
    cancel: CancellationToken,
    task: Option<tokio::task::JoinHandle<Result<Option<Lease>, StoreError>>>,
}

impl ClaimInFlight {
    pub(super) fn start(
        store: Arc<dyn Backend>,
        cancel: CancellationToken,
        poll: impl std::future::Future<Output = Result<Option<Lease>, StoreError>> + Send + 'static,
    ) -> ClaimInFlight {
        ClaimInFlight {
            store,
            cancel,
            task: Some(tokio::spawn(poll.in_current_span())),
        }
    }

    /// The poll's answer, handed over to the caller.
    pub(super) async fn answer(&mut self) -> Result<Option<Lease>, StoreError> {
        let Some(task) = self.task.as_mut() else {
            return Ok(None);
        };
        let answer = task
            .await
            .unwrap_or_else(|e| Err(StoreError::Internal(format!("the claim stopped: {e}"))));
        self.task = None;
        answer
    }
}

impl Drop for ClaimInFlight {
    fn drop(&mut self) {
        let Some(task) = self.task.take() else {
            return;
        };
        self.cancel.cancel();
        let store = self.store.clone();
        tokio::spawn(async move {
            if let Ok(Ok(Some(lease))) = task.await {
                tracing::info!(session_id = %lease.session_id, epoch = lease.epoch, "the claimant went away; giving its lease back");
                let _ = store
                    .release_lease(lease.session_id, lease.owner, lease.epoch)
                    .await;
            }
        });
    }
}
