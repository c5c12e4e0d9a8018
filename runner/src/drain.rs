//! How a runner stops on SIGTERM: it drains.
//!
//! Promise: from the moment the drain begins the runner claims nothing more (a claim
//! long-poll in flight is cut short) and starts no new step; every step already in hand (a
//! tool call that has started, a model stream) may run to its end and be logged until the
//! budget (`runner --drain-timeout`) is spent. Then what still runs is stopped: a tool's
//! process tree is killed and the call is left to its tool's unknown-outcome policy, a
//! model stream is dropped (no side effect). Every store call on the way out has a
//! deadline, so the process is gone within the budget plus [`EXIT_MARGIN`] whatever the
//! store does. A second signal ends the budget at once.
//!
//! Guarded by `integration-tests/tests/runner_drain.rs` (SIGTERM at random moments: no
//! call re-run, the exit bound in every trial; a call longer than the budget; the store
//! unreachable during the stop) and `runner_rolling_deploy.rs`.

use std::time::Duration;

use tokio_util::sync::CancellationToken;

/// After the budget: an append in flight gets [`APPEND_GRACE`], a lease release
/// [`RELEASE_DEADLINE`]; past this margin the process exits whatever is left.
pub const EXIT_MARGIN: Duration = Duration::from_secs(3);
/// How long an append in flight when the budget ends (a stopped call's neighbour, a
/// reply) may still take before the session's work is dropped.
pub const APPEND_GRACE: Duration = Duration::from_secs(1);
/// How long giving a lease back may take on the way out; a release that does not make it
/// leaves the lease to expire, which costs the next runner one ttl of waiting.
pub const RELEASE_DEADLINE: Duration = Duration::from_secs(1);

/// The drain of one runner process: cheap to clone, shared by the claim loop and every
/// session's work.
#[derive(Debug, Clone)]
pub struct Drain {
    budget: Duration,
    /// Fires when the drain begins: claim nothing, start no new step.
    begun: CancellationToken,
    /// Fires when the budget is spent: stop what still runs.
    expired: CancellationToken,
}

impl Drain {
    pub fn new(budget: Duration) -> Drain {
        Drain {
            budget,
            begun: CancellationToken::new(),
            expired: CancellationToken::new(),
        }
    }

    /// Begins the drain (call it inside the runtime); a second call spends the budget at
    /// once.
    pub fn begin(&self) {
        if self.begun.is_cancelled() {
            self.expired.cancel();
            return;
        }
        self.begun.cancel();
        let expired = self.expired.clone();
        let budget = self.budget;
        tokio::spawn(async move {
            tokio::select! {
                _ = expired.cancelled() => {}
                _ = tokio::time::sleep(budget) => expired.cancel(),
            }
        });
    }

    pub fn has_begun(&self) -> bool {
        self.begun.is_cancelled()
    }

    /// Resolves once the drain has begun.
    pub async fn begun(&self) {
        self.begun.cancelled().await
    }

    /// Fires when the budget is spent (the work still running must stop).
    pub fn expired(&self) -> &CancellationToken {
        &self.expired
    }

    /// Resolves `grace` after the budget is spent.
    pub async fn expired_for(&self, grace: Duration) {
        self.expired.cancelled().await;
        tokio::time::sleep(grace).await;
    }

    /// Resolves [`EXIT_MARGIN`] after the budget is spent: the process must be gone by then.
    pub async fn overrun(&self) {
        self.expired_for(EXIT_MARGIN).await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn the_budget_runs_from_the_signal_and_a_second_signal_spends_it() {
        let drain = Drain::new(Duration::from_secs(20));
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(!drain.has_begun() && !drain.expired().is_cancelled());
        drain.begin();
        assert!(drain.has_begun());
        tokio::time::sleep(Duration::from_millis(19_900)).await;
        assert!(!drain.expired().is_cancelled(), "the budget is 20 s");
        tokio::time::sleep(Duration::from_millis(200)).await;
        assert!(drain.expired().is_cancelled());

        let again = Drain::new(Duration::from_secs(20));
        again.begin();
        again.begin();
        assert!(
            again.expired().is_cancelled(),
            "a second signal ends the drain"
        );
    }
}
