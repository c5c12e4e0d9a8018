//! The agentlog runner: claims runnable sessions, folds each log into the next
//! step, calls the model and runs tools under lease-fenced, deterministic appends so that
//! a crash at any moment resumes exactly where the log stops.
// Unsafe code lives only in tools/sandbox/kernel.rs (raw Landlock and seccomp calls).
#![deny(unsafe_code)]

pub mod call_model;
pub mod context;
pub mod drain;
pub mod fold;
pub mod lease;
pub mod metrics;
pub mod model;
pub mod replay;
pub mod resilience;
pub mod secrets;
pub mod session_log;
pub mod store_error;
pub mod sweep;
pub mod tools;
pub mod turn;
pub mod worker;
