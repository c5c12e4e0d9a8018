//! What a runner's call to the event store can come to, as the runner acts on it: the lease
//! is gone, the session is gone, or the store failed. Both the lease keeper (`lease.rs`) and
//! the session's log (`session_log.rs`) return it, so it lives apart from either.

use agentlog_client::refusal::{is_lease_lost, is_session_deleted};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("the lease was lost: a newer lease exists or it expired")]
    LeaseLost,
    #[error("the session was deleted")]
    SessionDeleted,
    #[error("the event store failed: {0}")]
    Failed(tonic::Status),
}

impl From<tonic::Status> for StoreError {
    /// Decided on the refusal's reason, never on its status code.
    fn from(status: tonic::Status) -> StoreError {
        if is_session_deleted(&status) {
            StoreError::SessionDeleted
        } else if is_lease_lost(&status) {
            StoreError::LeaseLost
        } else {
            StoreError::Failed(status)
        }
    }
}
