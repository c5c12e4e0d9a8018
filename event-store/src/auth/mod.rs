//! Who may do what to which session: one tower layer at the store's edge, in three parts:
//! [`tokens`] (the tokens file and its reload), [`policy`] (the rule, returning a typed
//! [`Denial`]) and [`layer`] (authentication and the request message the rule needs).
//!
//! A caller presents `authorization: Bearer <token>`. The tokens file (`--tokens-file`)
//! holds only the SHA-256 of each token, with the token's name, role and scope:
//!
//! ```json
//! {"tokens": [
//!   {"name": "acme-web",     "sha256": "<64 hex>", "role": "client", "prefixes": ["acme:"]},
//!   {"name": "runners",      "sha256": "<64 hex>", "role": "runner"},
//!   {"name": "acme-runners", "sha256": "<64 hex>", "role": "runner", "prefixes": ["acme:"]},
//!   {"name": "ops",          "sha256": "<64 hex>", "role": "admin"}
//! ]}
//! ```
//!
//! - `client` (needs `prefixes`): appends `user_message` events, and reads, follows, gets
//!   and lists sessions, all within its prefixes;
//! - `runner` (all sessions, or its `prefixes`): claims and leases sessions, appends
//!   runner-written kinds, and reads what it works on;
//! - `admin`: everything.
//!
//! Missing or unknown token: `UNAUTHENTICATED`. A named session outside the caller's scope:
//! `PERMISSION_DENIED` for a write, `NOT_FOUND` for a read (the same answer whether or not
//! it exists). `ListSessions` and `ClaimSession` get the caller's [`Scope`] in the request
//! extensions and only ever return sessions in it. Health is open; reflection needs any
//! valid token. Without a tokens file the store is open: every caller is an anonymous admin.
//!
//! No token, and no hash, ever appears in a log line or an error message: callers are named
//! by the token's `name`.

pub mod layer;
pub mod policy;
pub mod tokens;

use std::sync::Arc;

use serde::Deserialize;

use crate::scope::Scope;

pub use layer::{Access, AuthLayer};
pub use policy::{authorize, authorize_append, authorize_snapshot_put, Denial, Target};
pub use tokens::{TokenSet, TokensError, TokensFileWatch};

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    Client,
    Runner,
    Admin,
}

/// The authenticated caller, put into each request's extensions by [`AuthLayer`].
#[derive(Debug, Clone)]
pub struct Caller {
    /// The token's name (or `anonymous` on an open store): safe to log.
    pub name: Arc<str>,
    pub role: Role,
    pub scope: Scope,
    /// False on an open store (no tokens file): limits then key on the peer address.
    pub authenticated: bool,
}

impl Caller {
    /// Every caller of a store without a tokens file.
    pub fn anonymous() -> Caller {
        Caller {
            name: "anonymous".into(),
            role: Role::Admin,
            scope: Scope::everything(),
            authenticated: false,
        }
    }
}
