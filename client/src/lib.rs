//! How a program talks to the agentlog event store, in one place for the runner, the CLI,
//! the bench and the tests:
//!
//! - [`connection`]: the store's URL, TLS (a CA, a client certificate) and the bearer token
//!   every call carries;
//! - [`retry`]: which failed calls are worth repeating ([`retry::is_transient`]) and how
//!   long to wait between attempts ([`retry::Backoff`]);
//! - [`refusal`]: what a refusal means, decided on the store's machine-readable reason
//!   (`agentlog_proto::reason::Reason`), never on the status code or message;
//! - [`append_stream`]: appends from many callers on one `AppendStream`, each answered as a
//!   unary `Append` would be;
//! - [`follow`]: a session's events, each once and in seq order, across store restarts and
//!   cut connections;
//! - [`log`]: a session's whole log as it is now;
//! - [`json`]: `google.protobuf.Struct` ↔ JSON, as tools, providers and `--json` speak it.
#![forbid(unsafe_code)]

pub mod append_stream;
pub mod connection;
pub mod follow;
pub mod json;
pub mod log;
pub mod refusal;
pub mod retry;

pub use connection::{BearerToken, ConnectError, StoreClient, StoreConnection};
