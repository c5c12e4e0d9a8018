//! The agentlog runner: claims runnable sessions, folds each log into the next
//! step, calls the model and runs tools under lease-fenced, deterministic appends so that
//! a crash at any moment resumes exactly where the log stops.
#![forbid(unsafe_code)]

pub mod drain;
pub mod fold;
pub mod lease;
pub mod metrics;
pub mod model;
pub mod session_log;
pub mod tools;
pub mod turn;
pub mod worker;
