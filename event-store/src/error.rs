//! Errors a caller can cause or meet, each mapped to its gRPC status in one place.

use agentlog_proto::reason::Reason;
use tonic::{Code, Status};

#[derive(Debug, thiserror::Error, Clone, PartialEq)]
pub enum StoreError {
    /// A malformed request; the message names the field and what to fix.
    #[error("{0}")]
    InvalidArgument(String),
    /// A rule of the session refused the request (a lease, `expected_last_seq`, an
    /// approval, a missing session, a full disk): sent with the reason's code and its
    /// `google.rpc.ErrorInfo`, so that clients decide on the reason, not on the text.
    #[error("{1}")]
    Refused(Reason, String),
    /// A size limit.
    #[error("{0}")]
    ResourceExhausted(String),
    /// The store is shutting down or its disk failed; retry against a healthy store.
    #[error("{0}")]
    Unavailable(String),
    #[error("internal error: {0}")]
    Internal(String),
}

impl StoreError {
    /// The status code this error is sent with.
    pub fn code(&self) -> Code {
        match self {
            StoreError::InvalidArgument(_) => Code::InvalidArgument,
            StoreError::Refused(reason, _) => reason.code(),
            StoreError::ResourceExhausted(_) => Code::ResourceExhausted,
            StoreError::Unavailable(_) => Code::Unavailable,
            StoreError::Internal(_) => Code::Internal,
        }
    }

    /// The refusal's reason, if a rule refused.
    pub fn reason(&self) -> Option<Reason> {
        match self {
            StoreError::Refused(reason, _) => Some(*reason),
            _ => None,
        }
    }
}

impl From<StoreError> for Status {
    fn from(err: StoreError) -> Status {
        match err {
            StoreError::Refused(reason, message) => reason.status(message),
            other => Status::new(other.code(), other.to_string()),
        }
    }
}
