//! When a provider says to come back: the wait it asks for in a refusal's headers, the
//! provider's own word before any backoff of ours.
//!
//! In order, the first that says anything: `retry-after-ms`; `retry-after` (seconds, or an
//! HTTP date); the latest reset of an exhausted rate limit, Anthropic's
//! `anthropic-ratelimit-*-reset` (an RFC 3339 time) whose `-remaining` is 0, or OpenAI's
//! `x-ratelimit-reset-*` (a duration such as `20ms`, `1s`, `6m0s`) whose `-remaining` is 0.
//! A time is compared with the response's `date` header when it has one (the provider's
//! clock, not ours), and a time already past asks for no wait.

use std::time::{Duration, SystemTime};

use reqwest::header::HeaderMap;

/// The wait `headers` ask for, counted from the response; `None` when they say nothing.
pub fn provider_wait(headers: &HeaderMap, received: SystemTime) -> Option<Duration> {
    let text = |name: &str| headers.get(name)?.to_str().ok().map(str::trim);
    if let Some(ms) = text("retry-after-ms").and_then(|v| v.parse::<f64>().ok()) {
        if ms.is_finite() && ms >= 0.0 {
            return Some(Duration::from_secs_f64(ms / 1000.0));
        }
    }
    // The provider's clock: its `date`, else ours when the response came.
    let their_now = text("date")
        .and_then(|d| httpdate::parse_http_date(d).ok())
        .unwrap_or(received);
    let until = |at: SystemTime| at.duration_since(their_now).unwrap_or(Duration::ZERO);
    if let Some(value) = text("retry-after") {
        if let Ok(seconds) = value.parse::<f64>() {
            if seconds.is_finite() && seconds >= 0.0 {
                return Some(Duration::from_secs_f64(seconds));
            }
        } else if let Ok(at) = httpdate::parse_http_date(value) {
            return Some(until(at));
        }
    }
    let exhausted = |prefix: &str, kind: &str| {
        text(&format!("{prefix}-remaining-{kind}"))
            .or_else(|| text(&format!("{prefix}-{kind}-remaining")))
            .and_then(|v| v.parse::<u64>().ok())
            == Some(0)
    };
    let mut latest: Option<Duration> = None;
    let mut later = |wait: Duration| latest = Some(latest.map_or(wait, |l| l.max(wait)));
    for kind in ["requests", "tokens", "input-tokens", "output-tokens"] {
        let anthropic = "anthropic-ratelimit";
        if exhausted(anthropic, kind) {
            if let Some(at) = text(&format!("{anthropic}-{kind}-reset"))
                .and_then(|v| humantime::parse_rfc3339_weak(v).ok())
            {
                later(until(at));
            }
        }
        if exhausted("x-ratelimit", kind) {
            if let Some(wait) =
                text(&format!("x-ratelimit-reset-{kind}")).and_then(parse_go_duration)
            {
                later(wait);
            }
        }
    }
    latest
}

/// A duration as OpenAI writes its resets (Go's form): `20ms`, `1s`, `1.5s`, `6m0s`,
/// `1h2m3s`.
fn parse_go_duration(text: &str) -> Option<Duration> {
    let mut total = 0f64;
    let mut rest = text;
    if rest.is_empty() {
        return None;
    }
    while !rest.is_empty() {
        let number_end = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let number: f64 = rest[..number_end].parse().ok()?;
        rest = &rest[number_end..];
        let unit_end = rest
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(rest.len());
        let seconds = match &rest[..unit_end] {
            "h" => 3600.0,
            "m" => 60.0,
            "s" => 1.0,
            "ms" => 0.001,
            "us" | "µs" => 0.000_001,
            "ns" => 0.000_000_001,
            _ => return None,
        };
        total += number * seconds;
        rest = &rest[unit_end..];
    }
    total.is_finite().then(|| Duration::from_secs_f64(total))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(
                reqwest::header::HeaderName::from_bytes(name.as_bytes()).unwrap(),
                value.parse().unwrap(),
            );
        }
        map
    }

    fn at(unix: u64) -> SystemTime {
        SystemTime::UNIX_EPOCH + Duration::from_secs(unix)
    }

    #[test]
    fn the_providers_word_in_its_order() {
        let now = at(1_700_000_000);
        assert_eq!(provider_wait(&headers(&[]), now), None);
        assert_eq!(
            provider_wait(&headers(&[("retry-after", "7")]), now),
            Some(Duration::from_secs(7))
        );
        assert_eq!(
            provider_wait(
                &headers(&[("retry-after", "7"), ("retry-after-ms", "1500")]),
                now
            ),
            Some(Duration::from_millis(1500))
        );
        // An HTTP date, on the provider's clock (its `date`), whatever ours says.
        let date = httpdate::fmt_http_date(at(1_800_000_000));
        let then = httpdate::fmt_http_date(at(1_800_000_030));
        assert_eq!(
            provider_wait(&headers(&[("date", &date), ("retry-after", &then)]), now),
            Some(Duration::from_secs(30))
        );
        assert_eq!(
            provider_wait(&headers(&[("retry-after", &date)]), at(1_800_000_100)),
            Some(Duration::ZERO),
            "a date already past asks for no wait"
        );
    }

    #[test]
    fn an_exhausted_rate_limit_says_when_it_resets() {
        let date = httpdate::fmt_http_date(at(1_800_000_000));
        let anthropic = headers(&[
            ("date", &date),
            ("anthropic-ratelimit-requests-remaining", "5"),
            ("anthropic-ratelimit-requests-reset", "2027-01-15T08:00:20Z"),
            ("anthropic-ratelimit-tokens-remaining", "0"),
            ("anthropic-ratelimit-tokens-reset", "2027-01-15T08:00:45Z"),
        ]);
        let date_then = humantime::parse_rfc3339("2027-01-15T08:00:00Z").unwrap();
        let mut anthropic_then = anthropic.clone();
        anthropic_then.insert("date", httpdate::fmt_http_date(date_then).parse().unwrap());
        assert_eq!(
            provider_wait(&anthropic_then, at(0)),
            Some(Duration::from_secs(45)),
            "the exhausted limit's reset, not the other's"
        );
        let openai = headers(&[
            ("x-ratelimit-remaining-requests", "0"),
            ("x-ratelimit-reset-requests", "6m0s"),
            ("x-ratelimit-remaining-tokens", "0"),
            ("x-ratelimit-reset-tokens", "20ms"),
        ]);
        assert_eq!(
            provider_wait(&openai, at(0)),
            Some(Duration::from_secs(360)),
            "the latest of the exhausted ones"
        );
    }

    #[test]
    fn go_durations() {
        assert_eq!(parse_go_duration("20ms"), Some(Duration::from_millis(20)));
        assert_eq!(parse_go_duration("1.5s"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_go_duration("1h2m3s"), Some(Duration::from_secs(3723)));
        assert_eq!(parse_go_duration("soon"), None);
        assert_eq!(parse_go_duration(""), None);
    }
}
