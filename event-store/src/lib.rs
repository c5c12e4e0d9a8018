//! agentlog's event store: per-session append-only logs that acknowledge only what is
//! durable, with live subscriptions and leases with fencing epochs.
//!
//! - [`backend`]: the storage contract every backend keeps, and its two implementations:
//!   [`backend::local`] (our segment log and its sled index, one replica on one volume) and
//!   [`backend::postgres`] (any number of replicas over one database).
//! - [`rules`]: the append and lease rules, pure functions both backends decide by;
//!   [`session`]: the session state they decide on, derived from the log; [`queries`]:
//!   ListSessions paging and the ClaimSession long-poll, shared by the backends;
//!   [`retention`]: `--retain-idle`.
//! - [`service`]: the gRPC edge: validation, status codes, health and reflection, over
//!   any [`backend::Backend`].
//! - [`auth`], [`limits`], [`tls`], [`incoming`]: who may call, how much, and over what;
//!   [`scope`]: the one rule for which sessions a caller may see; [`wire`]: which call a
//!   request is, and the request limits.
//! - [`transfer`]: sessions that move: the export format, export, import, the archive.
//! - [`search`]: `SearchSessions`' words, queries and snippets, shared by the backends'
//!   indexes.
//! - [`metrics`]: what the store reports to Prometheus; [`clock`]: the store's wall clock.
#![forbid(unsafe_code)]

pub mod auth;
pub mod backend;
pub mod clock;
pub mod error;
mod ids;
pub mod incoming;
pub mod limits;
pub mod metrics;
pub mod queries;
pub mod retention;
pub mod rules;
pub mod scope;
pub mod search;
pub mod service;
pub mod session;
mod stop;
pub mod tls;
pub mod transfer;
pub mod wire;

pub use error::StoreError;
