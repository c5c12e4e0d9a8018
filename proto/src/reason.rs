//! Why the store refused a request, in a form a program can decide on.
//!
//! Every refusal the caller must act on carries a `google.rpc.ErrorInfo` in the status
//! details: `reason` is one of [`Reason`]'s names, `domain` is [`DOMAIN`], and the status
//! message stays the human explanation. Clients decide on [`Reason::of`], never on the
//! status code or the message text.

use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

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
    /// An `approval_decision` answers no pending `approval_requested` (or a second time).
    ApprovalNotPending,
    /// The store's volume is full; appends resume by themselves once there is room.
    DiskFull,
}

impl Reason {
    /// Every reason, for tables and tests.
    pub const ALL: [Reason; 7] = [
        Reason::LeaseFenced,
        Reason::LeaseHeld,
        Reason::LeaseRequired,
        Reason::SeqConflict,
        Reason::SessionNotFound,
        Reason::ApprovalNotPending,
        Reason::DiskFull,
    ];

    /// The `ErrorInfo.reason` string.
    pub fn name(self) -> &'static str {
        match self {
            Reason::LeaseFenced => "LEASE_FENCED",
            Reason::LeaseHeld => "LEASE_HELD",
            Reason::LeaseRequired => "LEASE_REQUIRED",
            Reason::SeqConflict => "SEQ_CONFLICT",
            Reason::SessionNotFound => "SESSION_NOT_FOUND",
            Reason::ApprovalNotPending => "APPROVAL_NOT_PENDING",
            Reason::DiskFull => "DISK_FULL",
        }
    }

    /// The status code this reason is always sent with.
    pub fn code(self) -> Code {
        match self {
            Reason::LeaseFenced
            | Reason::LeaseHeld
            | Reason::LeaseRequired
            | Reason::ApprovalNotPending => Code::FailedPrecondition,
            Reason::SeqConflict => Code::Aborted,
            Reason::SessionNotFound => Code::NotFound,
            Reason::DiskFull => Code::ResourceExhausted,
        }
    }

    /// A status with this reason's code, `message`, and the `ErrorInfo` detail.
    pub fn status(self, message: impl Into<String>) -> Status {
        Status::with_error_details(
            self.code(),
            message,
            ErrorDetails::with_error_info(self.name(), DOMAIN, std::collections::HashMap::new()),
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
