//! PinSession: the session's `pinned` changed by the rule ([`crate::rules::pin`]) and
//! written over its row, version-checked like every write, with the `pinned` column that
//! retention's statement filters on.

use agentlog_proto::v1::SessionInfo;

use super::replica::Replica;
use crate::clock::now_unix_ms;
use crate::rules;
use crate::StoreError;

impl Replica {
    pub(super) async fn pin(
        &self,
        session_id: &str,
        pinned: bool,
    ) -> Result<SessionInfo, StoreError> {
        self.change_session(session_id, |meta, _now| {
            let changed = rules::pin(Some(meta), session_id, pinned)?;
            let after = changed.clone().unwrap_or_else(|| meta.clone());
            Ok((changed, after))
        })
        .await
        .map(|meta| meta.info(session_id, now_unix_ms()))
    }
}
