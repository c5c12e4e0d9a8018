//! Errors a caller can cause or meet, each mapped to its gRPC status in one place.

use agentlog_proto::reason::{Reason, FIELD_NUMBER};
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
    /// An event's kind is one this build does not know (a newer writer's): refused with
    /// [`Reason::UnknownKind`], its field number in the `ErrorInfo`'s metadata.
    #[error("{message}")]
    UnknownKind { field_number: u32, message: String },
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
            StoreError::UnknownKind { .. } => Reason::UnknownKind.code(),
            StoreError::ResourceExhausted(_) => Code::ResourceExhausted,
            StoreError::Unavailable(_) => Code::Unavailable,
            StoreError::Internal(_) => Code::Internal,
        }
    }

    /// The refusal's reason, if a rule refused.
    pub fn reason(&self) -> Option<Reason> {
        match self {
            StoreError::Refused(reason, _) => Some(*reason),
            StoreError::UnknownKind { .. } => Some(Reason::UnknownKind),
            _ => None,
        }
    }
}

impl From<StoreError> for Status {
    fn from(err: StoreError) -> Status {
        match err {
            StoreError::Refused(reason, message) => reason.status(message),
            StoreError::UnknownKind {
                field_number,
                message,
            } => Reason::UnknownKind.status_with(
                message,
                [(FIELD_NUMBER.to_string(), field_number.to_string())].into(),
            ),
            other => Status::new(other.code(), other.to_string()),
        }
    }
}
