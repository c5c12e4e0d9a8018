//! What a refusal from the store means to a client, decided on its machine-readable reason
//! ([`Reason::of`]), never on the status code or the message text, but for the one refusal
//! of release 0.1.0 that carries no reason ([`is_unknown_kind`]).

use agentlog_proto::reason::Reason;

/// Whether a refused append or renewal means the caller no longer holds the session's
/// lease and must stop working it: it was fenced off (a newer epoch, or the lease expired or
/// was released), the epoch belongs to another owner, or the session is gone (never
/// there, or deleted).
pub fn is_lease_lost(status: &tonic::Status) -> bool {
    matches!(
        Reason::of(status),
        Some(
            Reason::LeaseFenced
                | Reason::LeaseHeld
                | Reason::SessionNotFound
                | Reason::SessionDeleted
        )
    )
}

/// Whether the store refused because the session was deleted: it is gone for good, and
/// nothing more may be done for it (its work stops, its workspace goes).
pub fn is_session_deleted(status: &tonic::Status) -> bool {
    Reason::of(status) == Some(Reason::SessionDeleted)
}

/// Whether the store refused because the session does not exist.
pub fn is_session_not_found(status: &tonic::Status) -> bool {
    Reason::of(status) == Some(Reason::SessionNotFound)
}

/// Whether an `approval_decision` was refused because its call is not waiting for one
/// (never asked, already decided, or already closed).
pub fn is_approval_not_pending(status: &tonic::Status) -> bool {
    Reason::of(status) == Some(Reason::ApprovalNotPending)
}

/// Whether the store refused an event because it does not know its kind: reason
/// `UNKNOWN_KIND`, or (release 0.1.0, which has no such reason) `INVALID_ARGUMENT` saying
/// an event needs exactly one kind. The writer then goes on as its previous release would.
pub fn is_unknown_kind(status: &tonic::Status) -> bool {
    Reason::of(status) == Some(Reason::UnknownKind)
        || (status.code() == tonic::Code::InvalidArgument
            && status.message().contains("an event needs exactly one kind"))
}

#[cfg(test)]
mod tests {
    use tonic::{Code, Status};

    use super::*;

    #[test]
    fn the_lease_is_lost_on_the_lease_reasons_only() {
        for reason in [
            Reason::LeaseFenced,
            Reason::LeaseHeld,
            Reason::SessionNotFound,
            Reason::SessionDeleted,
        ] {
            assert!(is_lease_lost(&reason.status("x")), "{reason}");
        }
        for reason in [
            Reason::LeaseRequired,
            Reason::SeqConflict,
            Reason::ApprovalNotPending,
            Reason::DiskFull,
        ] {
            assert!(!is_lease_lost(&reason.status("x")), "{reason}");
        }
        // The code alone decides nothing: a plain FAILED_PRECONDITION is not a lost lease.
        assert!(!is_lease_lost(&Status::failed_precondition("x")));
        assert!(!is_lease_lost(&Status::new(Code::NotFound, "x")));
    }

    #[test]
    fn session_and_approval_refusals_are_told_by_their_reason() {
        assert!(is_session_not_found(&Reason::SessionNotFound.status("x")));
        assert!(!is_session_not_found(&Status::not_found("x")));
        assert!(is_session_deleted(&Reason::SessionDeleted.status("x")));
        assert!(!is_session_deleted(&Reason::SessionNotFound.status("x")));
        assert!(!is_session_deleted(&Status::not_found("x")));
        assert!(is_approval_not_pending(
            &Reason::ApprovalNotPending.status("x")
        ));
        assert!(!is_approval_not_pending(&Reason::LeaseFenced.status("x")));
        assert!(!is_approval_not_pending(&Status::failed_precondition("x")));
    }
}
