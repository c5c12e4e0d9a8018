//! The last release beside this build, for the mixed-version tests: its binaries, which
//! `deploy/previous-release` builds (once per release, kept by commit) and names in
//! `AGENTLOG_PREVIOUS_RELEASE_DIR`, are started through the same helpers as this build's,
//! with the binary as a parameter ([`Store::start_backed`], [`Store::restart_binary_on`]).
//! A test that needs them and finds the variable unset fails saying how to set it.

use std::path::PathBuf;

use anyhow::Result;

use crate::{Backing, Store};

/// Set by `eval "$(deploy/previous-release)"`: the release's directory, holding `bin/`.
pub const DIR_ENV: &str = "AGENTLOG_PREVIOUS_RELEASE_DIR";
/// Set beside it: the release's version, as CHANGELOG.md names it.
pub const VERSION_ENV: &str = "AGENTLOG_PREVIOUS_RELEASE_VERSION";

/// The directory of the last release's build; panics, saying what to run, when unset.
pub fn dir() -> PathBuf {
    match std::env::var_os(DIR_ENV) {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir),
        _ => panic!(
            "{DIR_ENV} is not set: the mixed-version tests run the last release's binaries \
             beside this build's. Run `eval \"$(deploy/previous-release)\"` in this shell first \
             (it builds the release CHANGELOG.md names, once, and prints where it put it)"
        ),
    }
}

/// The last release's binary `name` (`event-store`, `runner` or `agentlog`).
pub fn bin_path(name: &str) -> PathBuf {
    let path = dir().join("bin").join(name);
    assert!(
        path.exists(),
        "{} is missing: run `eval \"$(deploy/previous-release)\"` again",
        path.display()
    );
    path
}

/// The last release's version (`0.1.0`).
pub fn version() -> String {
    std::env::var(VERSION_ENV).unwrap_or_else(|_| "the previous release".into())
}

/// Which build a process runs: the last release's, or this tree's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Build {
    Previous,
    This,
}

impl Build {
    /// This build's binary `name`.
    pub fn bin_path(self, name: &str) -> PathBuf {
        match self {
            Build::Previous => bin_path(name),
            Build::This => crate::bin_path(name),
        }
    }

    /// Its version, for what a test prints.
    pub fn version(self) -> String {
        match self {
            Build::Previous => version(),
            Build::This => env!("CARGO_PKG_VERSION").to_string(),
        }
    }

    /// A store of this build on `backing`, on a free port, with `extra` arguments.
    pub fn start_store(self, backing: Backing, extra: &[&str]) -> Result<Store> {
        Store::start_backed(&self.bin_path("event-store"), backing, "127.0.0.1:0", extra)
    }

    /// `store` SIGKILLed and started again on its data and address as this build, with the
    /// same arguments: an upgrade, a rollback, or the same build again.
    pub fn replace_store(self, store: &mut Store) -> Result<Store> {
        store.kill9();
        store.restart_binary_on(&self.bin_path("event-store"), &store.addr.to_string())
    }
}

impl std::fmt::Display for Build {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.version())
    }
}
