//! Retention (`event-store --retain-idle DURATION`): sessions whose last event is older than
//! the span and that hold no live lease ([`crate::rules::expired`]) are deleted as
//! `DeleteSession` deletes them. Each backend runs the passes its own way (the local
//! writer walks its sessions in the order of their last event; on PostgreSQL one replica
//! at a time, under an advisory lock), always in steps of at most [`BATCH`] sessions, so
//! that appends pass between the steps.

use std::time::Duration;

/// Sessions one step of a retention pass deletes at most.
pub const BATCH: usize = 256;

/// When retention runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// Sessions idle for longer than this are deleted.
    pub idle: Duration,
    /// A pass starts this long after the previous one ended.
    pub interval: Duration,
}

impl Retention {
    /// The time before which a session's last event must be for a pass at `now` to take it.
    pub fn idle_before(&self, now: i64) -> i64 {
        now.saturating_sub(self.idle.as_millis().min(i64::MAX as u128) as i64)
    }
}

/// A span people write (`30d`, `12h`, `90m`, `45s`, `500ms`; humantime's forms), above
/// zero.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let span = humantime::parse_duration(text.trim())
        .map_err(|e| format!("{text:?}: {e}; write e.g. 30d, 12h, 90m, 45s or 500ms"))?;
    if span.is_zero() {
        return Err(format!(
            "{text:?} is no time at all; give a span above zero"
        ));
    }
    Ok(span)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_are_a_number_and_a_unit() {
        let day = Duration::from_secs(86_400);
        assert_eq!(parse_duration("30d"), Ok(day * 30));
        assert_eq!(parse_duration("12h"), Ok(Duration::from_secs(12 * 3600)));
        assert_eq!(parse_duration("90m"), Ok(Duration::from_secs(90 * 60)));
        assert_eq!(parse_duration("45s"), Ok(Duration::from_secs(45)));
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("1.5d"), Ok(Duration::from_secs(36 * 3600)));
        for bad in ["30", "d", "3x", "-1d", "0h", "99999999999999999999d", ""] {
            assert!(parse_duration(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn a_pass_takes_what_is_older_than_the_span() {
        let retention = Retention {
            idle: Duration::from_secs(10),
            interval: Duration::from_secs(1),
        };
        assert_eq!(retention.idle_before(100_000), 90_000);
        assert_eq!(retention.idle_before(i64::MIN + 5), i64::MIN);
    }
}
