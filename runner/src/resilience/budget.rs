//! A run's budget: model replies, their input plus output tokens, and the wall time since
//! the run's user message, each counted from the log (so a takeover does not reset it;
//! failed calls are not replies). Where the runner would call the model once a limit is
//! reached, the run pauses itself instead (`run_paused { reason: "budget" }`) and waits for
//! a person's next turn, which starts a new run with a fresh budget.

use agentlog_proto::v1::Budget;

use crate::fold::run::RunState;

/// The limits that hold for a run: the session's, each field of 0 taking the runner's
/// (and a runner's 0 meaning no limit).
pub fn effective(session: Option<&Budget>, runner: &Budget) -> Budget {
    let pick = |mine: u64, default: u64| if mine == 0 { default } else { mine };
    match session {
        None => *runner,
        Some(s) => Budget {
            max_model_calls: pick(s.max_model_calls, runner.max_model_calls),
            max_tokens: pick(s.max_tokens, runner.max_tokens),
            max_seconds: pick(s.max_seconds, runner.max_seconds),
        },
    }
}

/// The limit the run has reached, in words with its figures (`max_model_calls 4 reached (4
/// replies)`), if any.
pub fn reached(run: &RunState, budget: &Budget, now_unix_ms: i64) -> Option<String> {
    if budget.max_model_calls > 0 && run.replies >= budget.max_model_calls {
        return Some(format!(
            "max_model_calls {} reached ({} replies)",
            budget.max_model_calls, run.replies
        ));
    }
    if budget.max_tokens > 0 && run.tokens >= budget.max_tokens {
        return Some(format!(
            "max_tokens {} reached ({} tokens in and out)",
            budget.max_tokens, run.tokens
        ));
    }
    let elapsed_ms = now_unix_ms.saturating_sub(run.started_unix_ms).max(0) as u64;
    if budget.max_seconds > 0 && run.started_unix_ms > 0 && elapsed_ms >= budget.max_seconds * 1000
    {
        return Some(format!(
            "max_seconds {} reached ({} s since the run's user message)",
            budget.max_seconds,
            elapsed_ms / 1000
        ));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(replies: u64, tokens: u64, started: i64) -> RunState {
        RunState {
            replies,
            tokens,
            started_unix_ms: started,
            ..RunState::default()
        }
    }

    #[test]
    fn the_sessions_budget_over_the_runners_and_each_limit_in_words() {
        let runner = Budget {
            max_model_calls: 200,
            max_tokens: 0,
            max_seconds: 0,
        };
        let session = Budget {
            max_model_calls: 4,
            max_tokens: 0,
            max_seconds: 60,
        };
        let budget = effective(Some(&session), &runner);
        assert_eq!(
            (
                budget.max_model_calls,
                budget.max_tokens,
                budget.max_seconds
            ),
            (4, 0, 60)
        );
        assert_eq!(effective(None, &runner), runner);
        assert_eq!(reached(&run(3, 10, 1_000), &budget, 2_000), None);
        assert_eq!(
            reached(&run(4, 10, 1_000), &budget, 2_000).as_deref(),
            Some("max_model_calls 4 reached (4 replies)")
        );
        assert_eq!(
            reached(&run(1, 10, 1_000), &budget, 61_000).as_deref(),
            Some("max_seconds 60 reached (60 s since the run's user message)")
        );
        let tokens = Budget {
            max_tokens: 100,
            ..Budget::default()
        };
        assert!(reached(&run(1, 100, 0), &tokens, 0)
            .is_some_and(|d| d.starts_with("max_tokens 100 reached")));
    }
}
