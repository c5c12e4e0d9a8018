//! When the work keeps failing without crashing: a provider that answers 529 or 429 for
//! minutes, a quota that resets in an hour, a stream that goes silent, a model that asks
//! for the same failing command again and again, a run that would burn tokens without end.
//!
//! Every decision here is a pure function of the session's log (the fold's
//! [`crate::fold::run::RunState`] and `session_config`) and the clock, and what it decides
//! is an event, so a runner killed at any instant, or drained, and the one that takes the
//! session over go on with the same schedule: nothing is reset, nothing is called early,
//! nothing twice.
//! - [`schedule`]: which model the turn calls next and when (the provider's own word first,
//!   else backoff), falling back along the session's chain, parking a long wait, giving up
//!   into `run_paused`;
//! - [`circuit`]: a model that keeps failing across a runner's sessions is left alone for
//!   a cool-down (the one piece of state that is the runner's, not the log's);
//! - [`budget`]: a run stops itself at its limits;
//! - the row of identical calls is counted by the fold and asked of a person by the tool
//!   guard (`crate::tools::guard`).

pub mod budget;
pub mod circuit;
pub mod schedule;

use std::time::Duration;

use agentlog_proto::v1::Budget;

/// The runner's settings for failing work (its flags).
#[derive(Debug, Clone)]
pub struct Settings {
    /// `--fallback-model`: a session's chain when it names none of its own.
    pub fallback_models: Vec<String>,
    /// `--fallback-after`: failed calls of one model in a turn before the next one is
    /// tried.
    pub fallback_after: u32,
    /// `--park-after`: a longer wait releases the session until it is due.
    pub park_after: Duration,
    /// `--give-up-after`: since the turn's first failure, after which the run pauses.
    pub give_up_after: Duration,
    /// `--circuit-failures`: failed calls of a model in a row that open its circuit.
    pub circuit_failures: u32,
    /// `--repeat-limit`: the identical call in a row that needs a person.
    pub repeat_limit: u32,
    /// `--run-max-*`: a run's budget where the session sets none (0: no limit).
    pub budget: Budget,
    /// `--model-idle-timeout`: a call that answers nothing for this long fails.
    pub model_idle_timeout: Duration,
}

impl Default for Settings {
    fn default() -> Settings {
        Settings {
            fallback_models: Vec::new(),
            fallback_after: 2,
            park_after: Duration::from_secs(10),
            give_up_after: Duration::from_secs(3600),
            circuit_failures: 5,
            repeat_limit: 3,
            budget: Budget {
                max_model_calls: 200,
                max_tokens: 0,
                max_seconds: 0,
            },
            model_idle_timeout: Duration::from_secs(120),
        }
    }
}
