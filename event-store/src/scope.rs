//! Which sessions a caller may see: the one rule ("a session id starts with one of the
//! caller's prefixes") that the auth layer applies to named sessions and that `ListSessions`
//! and `ClaimSession` apply to the sessions they hand out, so a tenant never learns of, or
//! is given, a session outside its prefixes.

use std::sync::Arc;
use std::time::Duration;

use agentlog_proto::v1::Lease;
use tokio_util::sync::CancellationToken;

use crate::error::StoreError;
use crate::session::now_unix_ms;
use crate::Store;

/// The sessions a caller may touch: every session, or those whose id starts with one of a
/// set of prefixes (a tenant such as `acme:`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scope {
    /// `None`: every session.
    prefixes: Option<Arc<[String]>>,
}

impl Scope {
    /// Every session (admins, unrestricted runners, and the store without a tokens file).
    pub fn everything() -> Scope {
        Scope { prefixes: None }
    }

    /// Sessions whose id starts with one of `prefixes` (none at all: no session).
    pub fn prefixes(prefixes: Vec<String>) -> Scope {
        Scope {
            prefixes: Some(prefixes.into()),
        }
    }

    pub fn is_everything(&self) -> bool {
        self.prefixes.is_none()
    }

    /// Whether `session_id` is in this scope.
    pub fn admits(&self, session_id: &str) -> bool {
        match &self.prefixes {
            None => true,
            Some(prefixes) => prefixes.iter().any(|p| session_id.starts_with(p.as_str())),
        }
    }
}

impl Store {
    /// [`Store::claim`] restricted to `scope`: only a runnable, unleased session in scope
    /// is ever granted.
    ///
    /// An unrestricted scope is the writer's own claim. A restricted one picks candidates
    /// from the published view (oldest update first, as the writer does) and takes each
    /// with `AcquireLease`, which the writer refuses while another owner's lease is live: a
    /// candidate taken meanwhile by someone else is skipped, so each runnable session still
    /// goes to exactly one claimant. (Callers claim one at a time per owner, as the runner
    /// does; two concurrent claims by the *same* owner could fence each other.)
    pub async fn claim_in(
        &self,
        owner: String,
        ttl_ms: u64,
        wait: Duration,
        cancel: &CancellationToken,
        scope: &Scope,
    ) -> Result<Option<Lease>, StoreError> {
        if scope.is_everything() {
            return self.claim(owner, ttl_ms, wait, cancel).await;
        }
        let deadline = tokio::time::Instant::now() + wait;
        let mut changes = self.shared.claimable.subscribe();
        loop {
            changes.borrow_and_update();
            let (candidates, next_expiry) = self.claim_candidates(scope);
            for session_id in candidates {
                match self.acquire_lease(session_id, owner.clone(), ttl_ms).await {
                    Ok(lease) => return Ok(Some(lease)),
                    // Taken by another claimant since the view was published.
                    Err(StoreError::FailedPrecondition(_)) => continue,
                    Err(e) => return Err(e),
                }
            }
            let mut wake = deadline;
            if let Some(at) = next_expiry {
                let in_ms = (at - now_unix_ms()).max(0) as u64 + 1;
                wake = wake.min(tokio::time::Instant::now() + Duration::from_millis(in_ms));
            }
            tokio::select! {
                _ = cancel.cancelled() => return Ok(None),
                _ = changes.changed() => {}
                _ = tokio::time::sleep_until(wake) => {}
            }
            if tokio::time::Instant::now() >= deadline {
                return Ok(None);
            }
        }
    }

    /// Runnable, unleased sessions in `scope`, oldest update first, and the earliest expiry
    /// of a live lease on a runnable session in scope (when it may become claimable).
    fn claim_candidates(&self, scope: &Scope) -> (Vec<String>, Option<i64>) {
        let now = now_unix_ms();
        let sessions = self
            .shared
            .sessions
            .read()
            .unwrap_or_else(|p| p.into_inner());
        let mut free = Vec::new();
        let mut next_expiry: Option<i64> = None;
        for (id, meta) in sessions.iter() {
            if meta.last_seq == 0 || !meta.is_runnable() || !scope.admits(id) {
                continue;
            }
            match meta.live_lease(now) {
                None => free.push((meta.updated_unix_ms, id.clone())),
                Some(lease) => {
                    next_expiry = Some(
                        next_expiry.map_or(lease.expires_unix_ms, |t| t.min(lease.expires_unix_ms)),
                    )
                }
            }
        }
        free.sort_unstable();
        (free.into_iter().map(|(_, id)| id).collect(), next_expiry)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_admit_only_their_sessions() {
        let scope = Scope::prefixes(vec!["acme:".into(), "beta-".into()]);
        assert!(scope.admits("acme:s1"));
        assert!(scope.admits("beta-7"));
        assert!(!scope.admits("acme"));
        assert!(!scope.admits("other:acme:s1"));
        assert!(!Scope::prefixes(vec![]).admits("s1"));
        assert!(Scope::everything().admits("anything"));
    }
}
