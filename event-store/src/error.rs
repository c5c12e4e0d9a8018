//! Errors a caller can cause or meet, each mapped to its gRPC status in one place.

use tonic::{Code, Status};

#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum StoreError {
    /// A malformed request; the message names the field and what to fix.
    #[error("{0}")]
    InvalidArgument(String),
    /// `expected_last_seq` did not match.
    #[error("expected_last_seq is {expected} but session {session_id} is at seq {actual}")]
    Aborted {
        session_id: String,
        expected: u64,
        actual: u64,
    },
    /// A lease rule refused the request (no lease, a stale epoch, someone else's lease).
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    NotFound(String),
    /// A size limit.
    #[error("{0}")]
    ResourceExhausted(String),
    /// The store is shutting down or its disk failed; retry against a healthy store.
    #[error("{0}")]
    Unavailable(String),
    #[error("internal error: {0}")]
    Internal(String),
}

impl From<StoreError> for Status {
    fn from(err: StoreError) -> Status {
        let code = match &err {
            StoreError::InvalidArgument(_) => Code::InvalidArgument,
            StoreError::Aborted { .. } => Code::Aborted,
            StoreError::FailedPrecondition(_) => Code::FailedPrecondition,
            StoreError::NotFound(_) => Code::NotFound,
            StoreError::ResourceExhausted(_) => Code::ResourceExhausted,
            StoreError::Unavailable(_) => Code::Unavailable,
            StoreError::Internal(_) => Code::Internal,
        };
        Status::new(code, err.to_string())
    }
}

impl From<crate::index::IndexError> for StoreError {
    fn from(err: crate::index::IndexError) -> StoreError {
        StoreError::Internal(err.to_string())
    }
}

impl From<crate::log::LogError> for StoreError {
    fn from(err: crate::log::LogError) -> StoreError {
        StoreError::Internal(err.to_string())
    }
}
