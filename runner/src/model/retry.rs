//! Capped, jittered exponential backoff for transient provider failures, honouring the
//! provider's `retry-after`.

use std::time::Duration;

#[derive(Debug, Clone, Copy)]
pub struct Backoff {
    /// The first delay, doubled per attempt.
    pub base: Duration,
    /// No computed delay exceeds this (nor does an honoured `retry-after`).
    pub cap: Duration,
    /// Attempts in all, the first included.
    pub max_attempts: u32,
}

impl Default for Backoff {
    fn default() -> Backoff {
        Backoff {
            base: Duration::from_millis(500),
            cap: Duration::from_secs(30),
            max_attempts: 8,
        }
    }
}

impl Backoff {
    /// The wait after failed attempt `attempt` (1-based): "full jitter" (uniform in
    /// `[0, min(cap, base·2^(attempt-1))]`) so that runners hit by the same overload do not
    /// come back in step; at least the provider's `retry-after` when it gave one.
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

#[cfg(test)]
mod tests {
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
}
