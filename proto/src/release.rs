//! Which release a program is, and how a store tells its clients which it is. Every
//! response of a store of this tree carries [`HEADER`]; release 0.1.0's carry none. A
//! writer learns the release behind a connection from the first response on it, and writes
//! what is new in its own release (a kind, a field) only to a store that has it
//! ([`Release::keeps_unknown_fields`] and the like).

/// The response header that names the store's release.
pub const HEADER: &str = "agentlog-release";

/// This tree's version (the workspace's; `-dev` between releases).
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// A release, by its major, minor and patch numbers (a `-dev` suffix is the release it
/// leads to).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Release {
    pub major: u32,
    pub minor: u32,
    pub patch: u32,
}

impl Release {
    /// The first release, 0.1.0: the store whose responses carry no [`HEADER`].
    pub const FIRST: Release = Release::new(0, 1, 0);

    pub const fn new(major: u32, minor: u32, patch: u32) -> Release {
        Release {
            major,
            minor,
            patch,
        }
    }

    /// This tree's release.
    pub fn this() -> Release {
        Release::parse(VERSION).expect("the workspace's version is semver")
    }

    /// `MAJOR.MINOR.PATCH`, with any `-pre` or `+build` suffix ignored.
    pub fn parse(version: &str) -> Option<Release> {
        let core = version.split(['-', '+']).next()?;
        let mut parts = core.split('.').map(|p| p.parse::<u32>().ok());
        let release = Release::new(parts.next()??, parts.next()??, parts.next()??);
        parts.next().is_none().then_some(release)
    }

    /// The release a store answered as: its [`HEADER`]'s value, or [`Release::FIRST`]
    /// without one (a value that does not parse is taken as the oldest too).
    pub fn of_header(value: Option<&str>) -> Release {
        value.and_then(Release::parse).unwrap_or(Release::FIRST)
    }

    /// Whether a store of this release keeps the fields it does not know (0.1.0 drops
    /// them), so that a field new to a later release may be written to it.
    pub fn keeps_unknown_fields(self) -> bool {
        self >= Release::new(0, 2, 0)
    }
}

impl std::fmt::Display for Release {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_versions_and_orders_them() {
        assert_eq!(Release::parse("0.2.0-dev"), Some(Release::new(0, 2, 0)));
        assert_eq!(
            Release::parse("1.10.3+build.7"),
            Some(Release::new(1, 10, 3))
        );
        assert_eq!(Release::parse("1.2"), None);
        assert_eq!(Release::parse("1.2.3.4"), None);
        assert!(Release::new(0, 10, 0) > Release::new(0, 9, 9));
        assert_eq!(Release::of_header(None), Release::FIRST);
        assert_eq!(Release::of_header(Some("garbage")), Release::FIRST);
        assert!(!Release::FIRST.keeps_unknown_fields());
        assert!(Release::this().keeps_unknown_fields());
    }
}
