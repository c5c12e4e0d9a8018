//! Which failed calls are worth repeating, and how long to wait between attempts: one
//! definition of a transient failure and one backoff for every client of the store (and for
//! the runner's model providers, with their own [`Backoff::MODEL`]).

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;
use tonic::Code;

/// Whether another attempt at the same call may succeed: the store, or the path to it, is
/// briefly away (restarting, unreachable, a cut connection). A connection cut mid-call
/// surfaces from tonic as `Unknown` ("transport error") or `Cancelled` (a reset stream); the
/// store itself answers neither.
pub fn is_transient(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        Code::Unavailable | Code::Unknown | Code::Cancelled | Code::DeadlineExceeded
    )
}

/// Capped exponential backoff with "full jitter": the wait after failed attempt `n` is
/// uniform in `[0, min(cap, base·2^(n-1))]`, so clients hit by the same outage do not come
/// back in step.
#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    /// The first ceiling, doubled per attempt.
    pub base: Duration,
    /// No computed wait exceeds this (nor does an honoured `retry-after`).
    pub cap: Duration,
    /// Attempts in all, the first included (for callers that give up by count).
    pub max_attempts: u32,
}

impl Backoff {
    /// Model providers that fail transiently (overloaded, rate-limited), when the runner
    /// retries in memory (a store that does not keep `model_retry`): patient, and giving
    /// up after 8 attempts (the turn then logs a retryable `run_error`).
    pub const MODEL: Backoff = Backoff {
        base: Duration::from_millis(500),
        cap: Duration::from_secs(30),
        max_attempts: 8,
    };

    /// Model calls whose retries are in the log: about 1 s doubling, at most 60 s, for as
    /// long as the runner's `--give-up-after` allows ([`Backoff::about`]).
    pub const MODEL_LOGGED: Backoff = Backoff {
        base: Duration::from_secs(1),
        cap: Duration::from_secs(60),
        max_attempts: u32::MAX,
    };

    /// Calls to the event store: quick first retries, never more than 2 s apart.
    pub const STORE: Backoff = Backoff {
        base: Duration::from_millis(100),
        cap: Duration::from_secs(2),
        max_attempts: u32::MAX,
    };

    /// The wait after failed attempt `attempt` (1-based); at least `retry_after` when the
    /// other side named one (capped like the rest).
    pub fn delay(&self, attempt: u32, retry_after: Option<Duration>) -> Duration {
        let exponent = attempt.saturating_sub(1).min(20);
        let ceiling = self.base.saturating_mul(1 << exponent).min(self.cap);
        let jittered = ceiling.mul_f64(fastrand::f64());
        match retry_after {
            Some(wait) => wait.min(self.cap).max(jittered),
            None => jittered,
        }
    }
}

impl Backoff {
    /// The wait after failed attempt `attempt` (1-based), "about" the doubled base: between
    /// half of it and all of it (equal jitter), so a wait is never much shorter than the
    /// schedule says yet clients hit by the same outage still come back apart.
    pub fn about(&self, attempt: u32) -> Duration {
        let exponent = attempt.saturating_sub(1).min(20);
        let ceiling = self.base.saturating_mul(1 << exponent).min(self.cap);
        ceiling.mul_f64(0.5 + 0.5 * fastrand::f64())
    }
}

/// Runs `call` until it succeeds, fails with a status that is not transient, or `patience`
/// is spent; waits [`Backoff::STORE`] between attempts. The caller makes the call safe to
/// repeat (an append carries its `event_id`, so a repeat writes nothing twice).
pub async fn retry_transient<T, F, Fut>(
    what: &str,
    patience: Duration,
    mut call: F,
) -> Result<T, tonic::Status>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, tonic::Status>>,
{
    let deadline = Instant::now() + patience;
    let mut attempt = 1;
    loop {
        match call().await {
            Ok(value) => return Ok(value),
            Err(status) if is_transient(&status) && Instant::now() < deadline => {
                tracing::warn!(%status, attempt, "{what} failed; retrying");
                let wait = Backoff::STORE.delay(attempt, None);
                tokio::time::sleep_until((Instant::now() + wait).min(deadline)).await;
                attempt += 1;
            }
            Err(status) => return Err(status),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;

    #[test]
    fn delays_grow_stay_capped_and_honour_retry_after() {
        let backoff = Backoff {
            base: Duration::from_millis(100),
            cap: Duration::from_secs(2),
            max_attempts: 5,
        };
        for _ in 0..200 {
            assert!(backoff.delay(1, None) <= Duration::from_millis(100));
            assert!(backoff.delay(3, None) <= Duration::from_millis(400));
            assert!(backoff.delay(40, None) <= Duration::from_secs(2));
            assert!(backoff.delay(1, Some(Duration::from_secs(1))) >= Duration::from_secs(1));
            assert_eq!(
                backoff.delay(1, Some(Duration::from_secs(600))),
                Duration::from_secs(2)
            );
        }
    }

    #[test]
    fn only_a_store_or_path_that_is_away_is_transient() {
        for code in [
            Code::Unavailable,
            Code::Unknown,
            Code::Cancelled,
            Code::DeadlineExceeded,
        ] {
            assert!(is_transient(&tonic::Status::new(code, "x")), "{code:?}");
        }
        for code in [
            Code::FailedPrecondition,
            Code::NotFound,
            Code::InvalidArgument,
            Code::ResourceExhausted,
            Code::PermissionDenied,
        ] {
            assert!(!is_transient(&tonic::Status::new(code, "x")), "{code:?}");
        }
    }

    #[tokio::test(start_paused = true)]
    async fn transient_failures_are_retried_until_patience_runs_out_refusals_never() {
        let calls = AtomicU32::new(0);
        let result = retry_transient("Append", Duration::from_secs(60), || {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            async move {
                if n < 3 {
                    Err(tonic::Status::unavailable("restarting"))
                } else {
                    Ok(n)
                }
            }
        })
        .await;
        assert_eq!(result.ok(), Some(3));

        calls.store(0, Ordering::SeqCst);
        let refused: Result<(), _> = retry_transient("Append", Duration::from_secs(60), || {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Err(tonic::Status::invalid_argument("bad")) }
        })
        .await;
        assert_eq!(refused.map_err(|s| s.code()), Err(Code::InvalidArgument));
        assert_eq!(calls.load(Ordering::SeqCst), 1);

        let away: Result<(), _> = retry_transient("Append", Duration::from_secs(5), || async {
            Err(tonic::Status::unavailable("gone"))
        })
        .await;
        assert_eq!(away.map_err(|s| s.code()), Err(Code::Unavailable));
    }
}
