//! Why the store refused a request, in a form a program can decide on.
//!
//! Every refusal the caller must act on carries a `google.rpc.ErrorInfo` in the status
//! details: `reason` is one of [`Reason`]'s names, `domain` is [`DOMAIN`], and the status
//! message stays the human explanation. Clients decide on [`Reason::of`], never on the
//! status code or the message text.

use std::collections::HashMap;

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use crate::v1::AppendError;

/// The `ErrorInfo.domain` of every agentlog refusal.
pub const DOMAIN: &str = "agentlog.dev";

/// The machine-readable cause of a refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The caller's lease epoch is no longer the session's live lease (a newer holder, or it
    /// expired or was released): the caller has been fenced off and must stop writing.
    LeaseFenced,
    /// Another owner holds a live lease on the session.
    LeaseHeld,
    /// A runner-written kind was appended without a lease epoch.
    LeaseRequired,
    /// `expected_last_seq` did not match the session's last seq.
    SeqConflict,
    /// The session does not exist.
    SessionNotFound,
    /// The session was deleted (`DeleteSession`, or retention): it is gone for good, and
    /// nothing can write it again.
    SessionDeleted,
    /// An `approval_decision` answers no pending `approval_requested` (or a second time).
    ApprovalNotPending,
    /// The store's volume is full; appends resume by themselves once there is room.
    DiskFull,
    /// `ForkSession` at a seq that is not a settled point (a call of the prefix would be
    /// left without its result); the message names the nearest settled seqs.
    ForkPointUnsettled,
    /// `ForkSession` named a `new_session_id` that already exists.
    SessionExists,
    /// An event's kind is not one this store knows: a newer writer's kind, refused until
    /// the store is of a release that has it (the kind's number is in the metadata
    /// [`FIELD_NUMBER`]). A writer then goes on as its previous release would have.
    UnknownKind,
}

/// The `ErrorInfo.metadata` key of an [`Reason::UnknownKind`] refusal: the kind's field
/// number.
pub const FIELD_NUMBER: &str = "field_number";

impl Reason {
    /// Every reason, for tables and tests.
    pub const ALL: [Reason; 11] = [
        Reason::LeaseFenced,
        Reason::LeaseHeld,
        Reason::LeaseRequired,
        Reason::SeqConflict,
        Reason::SessionNotFound,
        Reason::SessionDeleted,
        Reason::ApprovalNotPending,
        Reason::DiskFull,
        Reason::ForkPointUnsettled,
        Reason::SessionExists,
        Reason::UnknownKind,
    ];

    /// The `ErrorInfo.reason` string.
    pub fn name(self) -> &'static str {
        match self {
            Reason::LeaseFenced => "LEASE_FENCED",
            Reason::LeaseHeld => "LEASE_HELD",
            Reason::LeaseRequired => "LEASE_REQUIRED",
            Reason::SeqConflict => "SEQ_CONFLICT",
            Reason::SessionNotFound => "SESSION_NOT_FOUND",
            Reason::SessionDeleted => "SESSION_DELETED",
            Reason::ApprovalNotPending => "APPROVAL_NOT_PENDING",
            Reason::DiskFull => "DISK_FULL",
            Reason::ForkPointUnsettled => "FORK_POINT_UNSETTLED",
            Reason::SessionExists => "SESSION_EXISTS",
            Reason::UnknownKind => "UNKNOWN_KIND",
        }
    }

    /// The status code this reason is always sent with.
    pub fn code(self) -> Code {
        match self {
            Reason::LeaseFenced
            | Reason::LeaseHeld
            | Reason::LeaseRequired
            | Reason::ApprovalNotPending
            | Reason::ForkPointUnsettled
            | Reason::UnknownKind => Code::FailedPrecondition,
            Reason::SeqConflict => Code::Aborted,
            Reason::SessionNotFound | Reason::SessionDeleted => Code::NotFound,
            Reason::DiskFull => Code::ResourceExhausted,
            Reason::SessionExists => Code::AlreadyExists,
        }
    }

    /// A status with this reason's code, `message`, and the `ErrorInfo` detail.
    pub fn status(self, message: impl Into<String>) -> Status {
        self.status_with(message, HashMap::new())
    }

    /// [`Reason::status`] with `metadata` in the `ErrorInfo`.
    pub fn status_with(
        self,
        message: impl Into<String>,
        metadata: HashMap<String, String>,
    ) -> Status {
        Status::with_error_details(
            self.code(),
            message,
            ErrorDetails::with_error_info(self.name(), DOMAIN, metadata),
        )
    }

    /// The reason a status carries, if it is an agentlog refusal with a known reason.
    pub fn of(status: &Status) -> Option<Reason> {
        let info = status.get_details_error_info()?;
        if info.domain != DOMAIN {
            return None;
        }
        Reason::ALL.into_iter().find(|r| r.name() == info.reason)
    }
}

/// One refused request of an `AppendStream`, as the store sends it: the code, message and
/// `ErrorInfo` reason of the status a unary `Append` would have failed with.
impl From<&Status> for AppendError {
    fn from(status: &Status) -> AppendError {
        let (reason, metadata) = status
            .get_details_error_info()
            .filter(|info| info.domain == DOMAIN)
            .map_or_else(Default::default, |info| (info.reason, info.metadata));
        AppendError {
            code: status.code() as i32,
            message: status.message().to_string(),
            reason,
            metadata,
        }
    }
}

/// The status a unary `Append` would have failed with, from the `AppendStream` answer that
/// carries it: same code and message, and the reason (any, even one this build does not
/// know) as the same `ErrorInfo`, so that [`Reason::of`] reads both alike.
impl From<AppendError> for Status {
    fn from(error: AppendError) -> Status {
        let code = Code::from(error.code);
        if error.reason.is_empty() {
            return Status::new(code, error.message);
        }
        Status::with_error_details(
            code,
            error.message,
            ErrorDetails::with_error_info(error.reason, DOMAIN, error.metadata),
        )
    }
}

impl std::fmt::Display for Reason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_survives_the_round_trip_with_its_message() {
        for reason in Reason::ALL {
            let status = reason.status("the human explanation");
            assert_eq!(status.code(), reason.code());
            assert_eq!(status.message(), "the human explanation");
            assert_eq!(Reason::of(&status), Some(reason));
        }
    }

    #[test]
    fn a_refusal_survives_the_append_stream_as_the_unary_status() {
        let mut refusals: Vec<Status> = Reason::ALL
            .into_iter()
            .map(|r| r.status("the human explanation"))
            .collect();
        refusals.push(Status::invalid_argument("events: at least one event"));
        refusals.push(Status::resource_exhausted("over 4 MiB"));
        for unary in refusals {
            let streamed = Status::from(AppendError::from(&unary));
            assert_eq!(streamed.code(), unary.code());
            assert_eq!(streamed.message(), unary.message());
            assert_eq!(Reason::of(&streamed), Reason::of(&unary));
            assert_eq!(streamed.details(), unary.details(), "{unary:?}");
        }
        // A reason this build does not know still reaches the caller's ErrorInfo.
        let newer = Status::from(AppendError {
            code: Code::FailedPrecondition as i32,
            message: "x".into(),
            reason: "SOMETHING_NEW".into(),
            metadata: Default::default(),
        });
        assert_eq!(
            newer.get_details_error_info().map(|i| i.reason),
            Some("SOMETHING_NEW".into())
        );
        assert_eq!(Reason::of(&newer), None);
    }

    #[test]
    fn a_plain_status_or_a_foreign_domain_has_no_reason() {
        assert_eq!(Reason::of(&Status::failed_precondition("x")), None);
        let foreign = Status::with_error_details(
            Code::FailedPrecondition,
            "x",
            ErrorDetails::with_error_info(
                "LEASE_FENCED",
                "example.com",
                std::collections::HashMap::new(),
            ),
        );
        assert_eq!(Reason::of(&foreign), None);
    }
}
