//! The lease calls (acquire, renew, release): a lease rule ([`crate::rules`]) run against
//! the session's state and its outcome written over the row, version-checked like every
//! write.
//!
//! Promises:
//! - Epochs never repeat: a grant is written before it is returned, and it lands only on
//!   the state it was decided against (the row still at that version), so two grants of
//!   one session on any replicas never both land on the same epoch.
//! - A refusal is decided against a state read fresh, never against the cache.

use agentlog_proto::v1::Lease;

use super::replica::Replica;
use crate::rules;
use crate::session::{lease_of, LeaseRecord, SessionMeta};
use crate::StoreError;

impl Replica {
    pub(super) async fn acquire_lease(
        &self,
        session_id: String,
        owner: String,
        ttl_ms: u64,
    ) -> Result<Lease, StoreError> {
        self.change_session(&session_id, |meta, now| {
            let record = rules::acquire(meta, &session_id, owner.clone(), ttl_ms, now)?;
            Ok((Some(with_lease(meta, &record)), lease_of(&record)))
        })
        .await
    }

    pub(super) async fn renew_lease(
        &self,
        session_id: String,
        owner: String,
        epoch: u64,
        ttl_ms: u64,
    ) -> Result<Lease, StoreError> {
        self.change_session(&session_id, |meta, now| {
            let record = rules::renew(meta, &session_id, &owner, epoch, ttl_ms, now)?;
            Ok((Some(with_lease(meta, &record)), lease_of(&record)))
        })
        .await
    }

    pub(super) async fn release_lease(
        &self,
        session_id: String,
        owner: String,
        epoch: u64,
    ) -> Result<(), StoreError> {
        self.change_session(&session_id, |meta, now| {
            let released = rules::release(meta, &session_id, &owner, epoch, now)?;
            Ok((released.map(|record| with_lease(meta, &record)), ()))
        })
        .await
    }
}

fn with_lease(meta: &SessionMeta, record: &LeaseRecord) -> SessionMeta {
    let mut meta = meta.clone();
    meta.apply_lease(record);
    meta
}
