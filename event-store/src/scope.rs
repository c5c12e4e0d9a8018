//! Which sessions a caller may see: the one rule ("a session id starts with one of the
//! caller's prefixes") that the auth layer applies to named sessions and that `ListSessions`
//! and `ClaimSession` apply to the sessions they hand out, so a tenant never learns of, or
//! is given, a session outside its prefixes.

use std::sync::Arc;

/// The sessions a caller may touch: every session, or those whose id starts with one of a
/// set of prefixes (a tenant such as `acme:`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scope {
    /// `None`: every session.
    prefixes: Option<Arc<[String]>>,
}

impl Scope {
    /// Every session (admins, unrestricted runners, and the store without a tokens file).
    pub fn everything() -> Scope {
        Scope { prefixes: None }
    }

    /// Sessions whose id starts with one of `prefixes` (none at all: no session).
    pub fn prefixes(prefixes: Vec<String>) -> Scope {
        Scope {
            prefixes: Some(prefixes.into()),
        }
    }

    pub fn is_everything(&self) -> bool {
        self.prefixes.is_none()
    }

    /// The prefixes, or `None` for every session (for backends that filter in a query).
    pub fn prefix_list(&self) -> Option<&[String]> {
        self.prefixes.as_deref()
    }

    /// Whether `session_id` is in this scope.
    pub fn admits(&self, session_id: &str) -> bool {
        match &self.prefixes {
            None => true,
            Some(prefixes) => prefixes.iter().any(|p| session_id.starts_with(p.as_str())),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefixes_admit_only_their_sessions() {
        let scope = Scope::prefixes(vec!["acme:".into(), "beta-".into()]);
        assert!(scope.admits("acme:s1"));
        assert!(scope.admits("beta-7"));
        assert!(!scope.admits("acme"));
        assert!(!scope.admits("other:acme:s1"));
        assert!(!Scope::prefixes(vec![]).admits("s1"));
        assert!(Scope::everything().admits("anything"));
    }
}
