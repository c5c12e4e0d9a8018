//! When and on which model a turn calls next, from its logged `model_retry`s.
//!
//! A session's chain is its model (else the runner's default), then its
//! `session_config.fallback_models` (else the runner's `--fallback-model`s), each once, the
//! ones this runner was not given left out. A turn starts at the head of the chain; after
//! `--fallback-after` failed calls of one model it moves to the next at once (in that
//! provider's format); when every model of the chain has failed its share the turn waits
//! and starts again at the head. A billing refusal (`insufficient_quota`) uses up its
//! model's share at once. The wait after failed call `n` of the turn is the provider's own
//! word when it gave one, else about 1 s doubling up to 60 s, and never later than the
//! give-up deadline (`--give-up-after` after the turn's first failure), when the run
//! pauses instead of calling again.
//!
//! [`next`] decides what the turn does now; [`after_failure`] makes the `model_retry` a
//! failed call logs. Both are pure functions of the run, the chain and the time.

use std::time::Duration;

use agentlog_client::retry::Backoff;
use agentlog_proto::v1::ModelRetry;

use super::circuit::Admission;
use super::Settings;
use crate::fold::run::{RunState, CIRCUIT_OPEN};
use crate::model::Failure;

/// The models a turn may call, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Chain {
    pub models: Vec<String>,
    /// Fallbacks the session names that this runner was not given (left out).
    pub skipped: Vec<String>,
}

impl Chain {
    /// The session's model, then its fallbacks (else the runner's), each once; `has` says
    /// which models this runner was given.
    pub fn of(
        model: &str,
        session_fallbacks: &[String],
        runner_fallbacks: &[String],
        has: impl Fn(&str) -> bool,
    ) -> Chain {
        let fallbacks = if session_fallbacks.is_empty() {
            runner_fallbacks
        } else {
            session_fallbacks
        };
        let mut chain = Chain {
            models: vec![model.to_string()],
            skipped: Vec::new(),
        };
        for fallback in fallbacks {
            if chain.models.contains(fallback) {
                continue;
            }
            if has(fallback) {
                chain.models.push(fallback.clone());
            } else {
                chain.skipped.push(fallback.clone());
            }
        }
        chain
    }

    fn index_of(&self, model: &str) -> Option<usize> {
        self.models.iter().position(|m| m == model)
    }
}

/// What a turn does now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Next {
    /// Call model `index` of the chain now (`probe`: it is its circuit's probe).
    Call { index: usize, probe: bool },
    /// No call before `until` (unix ms): the log's due time.
    Wait { until: i64 },
    /// Every model the turn could call now has its circuit open: log a `model_retry` of
    /// model `index` with reason `circuit_open`, due at `until`.
    CircuitOpen { index: usize, until: i64 },
    /// The give-up deadline passed: the run pauses, saying this.
    GiveUp { detail: String },
}

/// Where the turn stands in its chain: the model whose turn it is, and that model's
/// failed calls in this round.
fn position(chain: &Chain, retries: &[ModelRetry], fallback_after: u32) -> (usize, u32) {
    let share = fallback_after.max(1);
    let (mut index, mut failed) = (0usize, 0u32);
    for retry in retries.iter().filter(|r| r.reason != CIRCUIT_OPEN) {
        let Some(model) = chain.index_of(&retry.model) else {
            continue;
        };
        if model != index {
            (index, failed) = (model, 0);
        }
        failed += if is_billing_refusal(retry) { share } else { 1 };
        if failed >= share {
            (index, failed) = ((index + 1) % chain.models.len(), 0);
        }
    }
    (index, failed)
}

/// A `model_retry` that records a billing refusal: its model will not answer this turn.
fn is_billing_refusal(retry: &ModelRetry) -> bool {
    retry.reason == "rate_limited" && retry.message.contains("insufficient_quota")
}

/// What the turn does at `now`: the run's logged retries, the chain, and each model's
/// circuit as `circuit` tells it.
pub fn next(
    run: &RunState,
    chain: &Chain,
    settings: &Settings,
    circuit: impl Fn(&str) -> Admission,
    now: i64,
) -> Next {
    if let Some(deadline) = give_up_at(run, settings) {
        if now >= deadline {
            return Next::GiveUp {
                detail: gave_up_detail(run, chain),
            };
        }
    }
    let due = run.due_unix_ms();
    if due > now {
        return Next::Wait { until: due };
    }
    let (head, _) = position(chain, &run.retries, settings.fallback_after);
    // The model whose turn it is, else (its circuit open) the next one of the chain that
    // may be called, in chain order from it.
    let mut earliest: Option<i64> = None;
    for offset in 0..chain.models.len() {
        let index = (head + offset) % chain.models.len();
        match circuit(&chain.models[index]) {
            Admission::Call => {
                return Next::Call {
                    index,
                    probe: false,
                }
            }
            Admission::Probe => return Next::Call { index, probe: true },
            Admission::Wait { until } => earliest = Some(earliest.map_or(until, |e| e.min(until))),
        }
    }
    let until = earliest.unwrap_or(now);
    let until = give_up_at(run, settings).map_or(until, |deadline| until.min(deadline.max(now)));
    Next::CircuitOpen { index: head, until }
}

/// The `model_retry` after model `index` of the chain failed at `now` with `failure`:
/// the next call's time is now when the turn moves on to another model of this round,
/// else the provider's word or the backoff, and never past the give-up deadline.
pub fn after_failure(
    run: &RunState,
    chain: &Chain,
    settings: &Settings,
    index: usize,
    failure: &Failure,
    now: i64,
) -> ModelRetry {
    let mut retry = ModelRetry {
        turn: run.session_replies,
        attempt: run.failed_calls() + 1,
        model: chain.models[index].clone(),
        reason: failure.reason.name().to_string(),
        message: failure.message.clone(),
        retry_at_unix_ms: now,
    };
    let mut retries = run.retries.clone();
    retries.push(retry.clone());
    let (next_index, failed) = position(chain, &retries, settings.fallback_after);
    let moves_on_now = next_index != index && failed == 0 && next_index > index;
    if !moves_on_now {
        let wait = failure
            .wait
            .unwrap_or_else(|| Backoff::MODEL_LOGGED.about(retry.attempt));
        retry.retry_at_unix_ms = now.saturating_add(millis(wait));
    }
    let first_failure = if run.first_failure_unix_ms > 0 {
        run.first_failure_unix_ms
    } else {
        now
    };
    let deadline = first_failure.saturating_add(millis(settings.give_up_after));
    retry.retry_at_unix_ms = retry.retry_at_unix_ms.min(deadline.max(now));
    retry
}

/// The `model_retry` of a turn whose every callable model has its circuit open: no call
/// was made.
pub fn circuit_open(run: &RunState, chain: &Chain, index: usize, until: i64) -> ModelRetry {
    ModelRetry {
        turn: run.session_replies,
        attempt: run.failed_calls(),
        model: chain.models[index].clone(),
        reason: CIRCUIT_OPEN.to_string(),
        message: "the model's circuit is open after it failed in a row; no call was made"
            .to_string(),
        retry_at_unix_ms: until,
    }
}

/// When the run gives up: `--give-up-after` after the turn's first failed call.
fn give_up_at(run: &RunState, settings: &Settings) -> Option<i64> {
    (run.first_failure_unix_ms > 0).then(|| {
        run.first_failure_unix_ms
            .saturating_add(millis(settings.give_up_after))
    })
}

/// The models and their failed calls, as `run_paused`'s detail says them.
fn gave_up_detail(run: &RunState, chain: &Chain) -> String {
    let mut counts: Vec<(String, u32)> = Vec::new();
    for retry in run.retries.iter().filter(|r| r.reason != CIRCUIT_OPEN) {
        match counts.iter_mut().find(|(m, _)| *m == retry.model) {
            Some((_, n)) => *n += 1,
            None => counts.push((retry.model.clone(), 1)),
        }
    }
    let models: Vec<String> = counts
        .iter()
        .map(|(m, n)| format!("{m} ({n} failed calls)"))
        .collect();
    let last = run
        .retries
        .iter()
        .rev()
        .find(|r| r.reason != CIRCUIT_OPEN)
        .map(|r| format!("; the last: {} ({})", r.reason, r.message))
        .unwrap_or_default();
    let chain = if chain.models.len() > 1 {
        format!(" of the chain {}", chain.models.join(", "))
    } else {
        String::new()
    };
    format!(
        "every model{chain} kept failing: {}{last}",
        models.join(", ")
    )
}

fn millis(d: Duration) -> i64 {
    i64::try_from(d.as_millis()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::FailReason;

    const S: i64 = 1_000;

    fn settings() -> Settings {
        Settings {
            fallback_after: 2,
            give_up_after: Duration::from_secs(3600),
            ..Settings::default()
        }
    }

    fn chain(models: &[&str]) -> Chain {
        Chain {
            models: models.iter().map(|m| m.to_string()).collect(),
            skipped: Vec::new(),
        }
    }

    fn failure(wait: Option<u64>) -> Failure {
        Failure {
            reason: FailReason::Overloaded,
            message: "HTTP 529".into(),
            wait: wait.map(Duration::from_secs),
        }
    }

    /// The run after `retry` was logged at `at`.
    fn logged(mut run: RunState, retry: ModelRetry, at: i64) -> RunState {
        if retry.reason != CIRCUIT_OPEN && run.first_failure_unix_ms == 0 {
            run.first_failure_unix_ms = at;
        }
        run.retries.push(retry);
        run
    }

    fn closed(_: &str) -> Admission {
        Admission::Call
    }

    #[test]
    fn a_chain_is_the_model_then_the_sessions_fallbacks_or_the_runners_those_given() {
        let has = |m: &str| m != "openai:missing";
        let runner = vec!["openai:b".to_string()];
        assert_eq!(
            Chain::of("anthropic:a", &[], &runner, has).models,
            ["anthropic:a", "openai:b"]
        );
        let session = vec![
            "openai:missing".to_string(),
            "anthropic:a".to_string(),
            "openai:c".to_string(),
        ];
        let c = Chain::of("anthropic:a", &session, &runner, has);
        assert_eq!(c.models, ["anthropic:a", "openai:c"]);
        assert_eq!(c.skipped, ["openai:missing"]);
    }

    #[test]
    fn a_turn_retries_its_model_then_falls_back_at_once_then_waits_and_starts_over() {
        let (s, c) = (settings(), chain(&["a:1", "b:2"]));
        let mut run = RunState::default();
        let mut now = 100 * S;
        assert_eq!(
            next(&run, &c, &s, closed, now),
            Next::Call {
                index: 0,
                probe: false
            }
        );

        // The first failure of a: a again, after the provider's word.
        let retry = after_failure(&run, &c, &s, 0, &failure(Some(7)), now);
        assert_eq!((retry.attempt, retry.retry_at_unix_ms), (1, now + 7 * S));
        run = logged(run, retry, now);
        assert_eq!(
            next(&run, &c, &s, closed, now),
            Next::Wait { until: now + 7 * S }
        );
        now += 7 * S;
        assert_eq!(
            next(&run, &c, &s, closed, now),
            Next::Call {
                index: 0,
                probe: false
            }
        );

        // Its second: b at once (the provider's word is a's alone).
        let retry = after_failure(&run, &c, &s, 0, &failure(Some(30)), now);
        assert_eq!((retry.attempt, retry.retry_at_unix_ms), (2, now));
        run = logged(run, retry, now);
        assert_eq!(
            next(&run, &c, &s, closed, now),
            Next::Call {
                index: 1,
                probe: false
            }
        );

        // b fails twice: the round is over, the turn waits (backoff) and starts at a.
        let retry = after_failure(&run, &c, &s, 1, &failure(None), now);
        let wait = retry.retry_at_unix_ms - now;
        assert!(
            (2 * S..=4 * S).contains(&wait),
            "about 4 s for attempt 3: {wait}"
        );
        run = logged(run, retry, now);
        now += wait;
        assert_eq!(
            next(&run, &c, &s, closed, now),
            Next::Call {
                index: 1,
                probe: false
            }
        );
        let retry = after_failure(&run, &c, &s, 1, &failure(None), now);
        let wait = retry.retry_at_unix_ms - now;
        assert!(
            (4 * S..=8 * S).contains(&wait),
            "about 8 s for attempt 4: {wait}"
        );
        run = logged(run, retry, now);
        now += wait;
        assert_eq!(
            next(&run, &c, &s, closed, now),
            Next::Call {
                index: 0,
                probe: false
            }
        );
    }

    #[test]
    fn the_backoff_doubles_to_a_minute_and_no_wait_passes_the_give_up_deadline() {
        let (mut s, c) = (settings(), chain(&["a:1"]));
        s.give_up_after = Duration::from_secs(100);
        let mut run = RunState::default();
        let start = 1_000 * S;
        let mut now = start;
        let mut waits = Vec::new();
        loop {
            match next(&run, &c, &s, closed, now) {
                Next::Call { .. } => {}
                Next::GiveUp { detail } => {
                    assert!(detail.contains("a:1 ("), "{detail}");
                    break;
                }
                other => panic!("{other:?}"),
            }
            let retry = after_failure(&run, &c, &s, 0, &failure(None), now);
            assert!(
                retry.retry_at_unix_ms <= start + 100 * S,
                "never past the deadline"
            );
            waits.push(retry.retry_at_unix_ms - now);
            let due = retry.retry_at_unix_ms;
            run = logged(run, retry, now);
            now = due;
        }
        assert!(waits.iter().all(|w| *w <= 60 * S));
        assert_eq!(now, start + 100 * S, "the last wait ends at the deadline");
        // A provider that asks for an hour is taken at its word, up to the deadline.
        let run = RunState::default();
        let retry = after_failure(&run, &c, &s, 0, &failure(Some(3600)), now);
        assert_eq!(retry.retry_at_unix_ms, now + 100 * S);
    }

    #[test]
    fn an_open_circuit_sends_the_turn_to_the_fallback_or_makes_it_wait_for_the_probe() {
        let (s, c) = (settings(), chain(&["a:1", "b:2"]));
        let run = RunState::default();
        let a_open = |m: &str| {
            if m == "a:1" {
                Admission::Wait { until: 130 * S }
            } else {
                Admission::Call
            }
        };
        assert_eq!(
            next(&run, &c, &s, a_open, 100 * S),
            Next::Call {
                index: 1,
                probe: false
            }
        );
        let alone = chain(&["a:1"]);
        assert_eq!(
            next(&run, &alone, &s, a_open, 100 * S),
            Next::CircuitOpen {
                index: 0,
                until: 130 * S
            }
        );
        let probe = |_: &str| Admission::Probe;
        assert_eq!(
            next(&run, &alone, &s, probe, 130 * S),
            Next::Call {
                index: 0,
                probe: true
            }
        );
        // A circuit_open retry is no failed call: the position stays.
        let retry = circuit_open(&run, &alone, 0, 130 * S);
        assert_eq!(retry.attempt, 0);
        let run = logged(run, retry, 100 * S);
        assert_eq!(run.first_failure_unix_ms, 0);
        assert_eq!(
            next(&run, &alone, &s, closed, 120 * S),
            Next::Wait { until: 130 * S }
        );
    }

    #[test]
    fn a_billing_refusal_moves_on_at_once() {
        let (s, c) = (settings(), chain(&["openai:a", "anthropic:b"]));
        let run = RunState::default();
        let quota = Failure {
            reason: FailReason::RateLimited,
            message: "HTTP 429: insufficient_quota: You exceeded your current quota".into(),
            wait: None,
        };
        let retry = after_failure(&run, &c, &s, 0, &quota, 5 * S);
        assert_eq!(retry.retry_at_unix_ms, 5 * S);
        let run = logged(run, retry, 5 * S);
        assert_eq!(
            next(&run, &c, &s, closed, 5 * S),
            Next::Call {
                index: 1,
                probe: false
            }
        );
    }
}
