//! What a provider tells a caller it refuses: when to come back (`retry-after` in seconds,
//! as an HTTP date, or `retry-after-ms`), how its rate limits stand, and the time on its own
//! clock. Every time is written on the [`ProviderClock`], which may run ahead of or behind
//! this machine's, so a test can tell a caller that compares a reset with the response's
//! `date` from one that compares it with its own clock. A time the caller must wait for is
//! rounded up to the whole second its format can say, so honouring it is never early.

use std::sync::atomic::{AtomicI64, Ordering};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::http::header::DATE;
use axum::http::{HeaderMap, HeaderName, HeaderValue};
use serde::{Deserialize, Deserializer};

/// The provider's clock: this machine's, shifted by a skew a test may set.
#[derive(Debug, Clone, Default)]
pub struct ProviderClock {
    skew_ms: Arc<AtomicI64>,
}

impl ProviderClock {
    /// Lets the provider's clock run `ms` ahead of this machine's (behind when negative).
    pub fn set_skew_ms(&self, ms: i64) {
        self.skew_ms.store(ms, Ordering::SeqCst);
    }

    /// `at` (on this machine's clock) as the provider's clock shows it.
    pub fn shift(&self, at: SystemTime) -> SystemTime {
        let skew = self.skew_ms.load(Ordering::SeqCst);
        let by = Duration::from_millis(skew.unsigned_abs());
        if skew >= 0 {
            at + by
        } else {
            at.checked_sub(by).unwrap_or(UNIX_EPOCH)
        }
    }

    /// The time on the provider's clock.
    pub fn now(&self) -> SystemTime {
        self.shift(SystemTime::now())
    }

    /// The `date` header the provider sends now.
    pub fn date_header(&self) -> HeaderValue {
        header_value(&httpdate::fmt_http_date(self.now()))
    }
}

/// When the caller may call again, in one of the forms providers send.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RetryAfter {
    /// `retry-after: N`, whole seconds.
    Seconds(u64),
    /// `retry-after-ms: N`.
    Millis(u64),
    /// `retry-after: <IMF-fixdate>` naming this time (this machine's clock; sent on the
    /// provider's, rounded up to the second). In JSON, unix milliseconds.
    Date(#[serde(deserialize_with = "unix_ms")] SystemTime),
}

impl RetryAfter {
    /// An HTTP date `wait` from now.
    pub fn date_in(wait: Duration) -> RetryAfter {
        RetryAfter::Date(SystemTime::now() + wait)
    }

    /// Adds the header this advice is sent as.
    pub fn write(&self, clock: &ProviderClock, headers: &mut HeaderMap) {
        let (name, value) = match self {
            RetryAfter::Seconds(s) => ("retry-after", s.to_string()),
            RetryAfter::Millis(ms) => ("retry-after-ms", ms.to_string()),
            RetryAfter::Date(at) => (
                "retry-after",
                httpdate::fmt_http_date(ceil_to_second(clock.shift(*at))),
            ),
        };
        headers.insert(HeaderName::from_static(name), header_value(&value));
    }
}

/// Which of a provider's limits a 429 ran out of.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Limit {
    Requests,
    /// All tokens (OpenAI's only token limit; Anthropic's most restrictive one).
    Tokens,
    /// Anthropic's input tokens per minute (OpenAI: tokens).
    InputTokens,
    /// Anthropic's output tokens per minute (OpenAI: tokens).
    OutputTokens,
}

/// A 429: which limit ran out, when it resets, and the retry advice sent with it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RateLimit {
    pub exhausted: Limit,
    /// How long after the response the exhausted limit is whole again.
    #[serde(rename = "reset_ms", deserialize_with = "millis")]
    pub reset_in: Duration,
    #[serde(default)]
    pub retry_after: Option<RetryAfter>,
}

impl RateLimit {
    /// `exhausted` runs out until `reset_in` from the response; `retry-after` says the same
    /// in whole seconds (rounded up), as providers send it.
    pub fn new(exhausted: Limit, reset_in: Duration) -> RateLimit {
        RateLimit {
            exhausted,
            reset_in,
            retry_after: Some(RetryAfter::Seconds(ceil_seconds(reset_in))),
        }
    }

    /// The same limit with other retry advice (`None`: no `retry-after` at all).
    pub fn retry_after(mut self, advice: Option<RetryAfter>) -> RateLimit {
        self.retry_after = advice;
        self
    }

    /// Anthropic's headers: `anthropic-ratelimit-{requests,tokens,input-tokens,
    /// output-tokens}-{limit,remaining,reset}`, each reset an RFC 3339 time. The exhausted
    /// limit has 0 remaining and resets `reset_in` from now; the others are whole (reset
    /// now). An input or output token limit that ran out is also the most restrictive
    /// token limit, so `tokens-*` says the same of it. The `date` is written from the same
    /// instant as the resets, so their difference is exact.
    pub fn write_anthropic(&self, clock: &ProviderClock, headers: &mut HeaderMap) {
        let now = clock.now();
        let reset_at = ceil_to_second(now + self.reset_in);
        let tokens_follow = matches!(self.exhausted, Limit::InputTokens | Limit::OutputTokens);
        for (name, limit, kind) in [
            ("requests", 50, Limit::Requests),
            ("input-tokens", 40_000, Limit::InputTokens),
            ("output-tokens", 8_000, Limit::OutputTokens),
            ("tokens", 48_000, Limit::Tokens),
        ] {
            let (limit, exhausted) = if kind == Limit::Tokens && tokens_follow {
                let limit = if self.exhausted == Limit::InputTokens {
                    40_000
                } else {
                    8_000
                };
                (limit, true)
            } else {
                (limit, kind == self.exhausted)
            };
            let (remaining, reset) = if exhausted {
                (0, reset_at)
            } else {
                (limit, ceil_to_second(now))
            };
            let header = |field: &str| {
                HeaderName::try_from(format!("anthropic-ratelimit-{name}-{field}"))
                    .expect("a valid header name")
            };
            headers.insert(header("limit"), header_value(&limit.to_string()));
            headers.insert(header("remaining"), header_value(&remaining.to_string()));
            headers.insert(
                header("reset"),
                header_value(&humantime::format_rfc3339_seconds(reset).to_string()),
            );
        }
        headers.insert(DATE, header_value(&httpdate::fmt_http_date(now)));
        if let Some(advice) = &self.retry_after {
            advice.write(clock, headers);
        }
    }

    /// OpenAI's headers: `x-ratelimit-{limit,remaining,reset}-{requests,tokens}`, each
    /// reset a duration (`20ms`, `1s`, `6m0s`). Input and output token limits are OpenAI's
    /// one token limit.
    pub fn write_openai(&self, clock: &ProviderClock, headers: &mut HeaderMap) {
        for (name, limit, exhausted) in [
            ("requests", 500, self.exhausted == Limit::Requests),
            ("tokens", 30_000, self.exhausted != Limit::Requests),
        ] {
            let (remaining, reset) = if exhausted {
                (0, self.reset_in)
            } else {
                (limit, Duration::ZERO)
            };
            let header = |field: &str| {
                HeaderName::try_from(format!("x-ratelimit-{field}-{name}"))
                    .expect("a valid header name")
            };
            headers.insert(header("limit"), header_value(&limit.to_string()));
            headers.insert(header("remaining"), header_value(&remaining.to_string()));
            headers.insert(header("reset"), header_value(&go_duration(reset)));
        }
        if let Some(advice) = &self.retry_after {
            advice.write(clock, headers);
        }
    }
}

/// A duration as Go prints one (OpenAI's servers are written in it), to the millisecond:
/// `0s`, `20ms`, `1s`, `1.5s`, `6m0s`, `1h2m5s`.
pub fn go_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if ms == 0 {
        return "0s".into();
    }
    if ms < 1000 {
        return format!("{ms}ms");
    }
    let (h, m, s, frac) = (ms / 3_600_000, ms / 60_000 % 60, ms / 1000 % 60, ms % 1000);
    let seconds = if frac == 0 {
        s.to_string()
    } else {
        format!("{s}.{}", format!("{frac:03}").trim_end_matches('0'))
    };
    match (h, m) {
        (0, 0) => format!("{seconds}s"),
        (0, m) => format!("{m}m{seconds}s"),
        (h, m) => format!("{h}h{m}m{seconds}s"),
    }
}

/// `at`, rounded up to the whole second.
pub fn ceil_to_second(at: SystemTime) -> SystemTime {
    let since = at.duration_since(UNIX_EPOCH).unwrap_or_default();
    UNIX_EPOCH + Duration::from_secs(ceil_seconds(since))
}

fn ceil_seconds(d: Duration) -> u64 {
    d.as_secs() + u64::from(d.subsec_nanos() > 0)
}

fn header_value(text: &str) -> HeaderValue {
    HeaderValue::from_str(text).expect("the stand-in writes visible ASCII headers")
}

fn unix_ms<'de, D: Deserializer<'de>>(d: D) -> Result<SystemTime, D::Error> {
    let ms = u64::deserialize(d)?;
    Ok(UNIX_EPOCH + Duration::from_millis(ms))
}

fn millis<'de, D: Deserializer<'de>>(d: D) -> Result<Duration, D::Error> {
    Ok(Duration::from_millis(u64::deserialize(d)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_read_as_go_writes_them() {
        let cases = [
            (0, "0s"),
            (20, "20ms"),
            (999, "999ms"),
            (1000, "1s"),
            (1500, "1.5s"),
            (1250, "1.25s"),
            (360_000, "6m0s"),
            (61_500, "1m1.5s"),
            (3_725_000, "1h2m5s"),
            (5_400_000, "1h30m0s"),
        ];
        for (ms, text) in cases {
            assert_eq!(go_duration(Duration::from_millis(ms)), text, "{ms} ms");
        }
    }

    #[test]
    fn a_skewed_clock_shifts_every_time_it_writes() {
        let clock = ProviderClock::default();
        let at = UNIX_EPOCH + Duration::from_millis(1_700_000_000_250);
        clock.set_skew_ms(-3_000);
        assert_eq!(
            clock.shift(at),
            UNIX_EPOCH + Duration::from_millis(1_699_999_997_250)
        );
        let mut headers = HeaderMap::new();
        RetryAfter::Date(at).write(&clock, &mut headers);
        // 1_699_999_997.25 s rounds up to ...998: Tue, 14 Nov 2023 22:13:18 GMT.
        assert_eq!(headers["retry-after"], "Tue, 14 Nov 2023 22:13:18 GMT");
    }
}
