//! Which build of agentlog a binary is: the workspace's version (semver; `-dev` between
//! releases, `CHANGELOG.md` names the releases) and the full hash of the commit it was built
//! from. `--version` of every binary prints both, and both services export them as
//! `agentlog_build_info{version,commit}`. Only the binaries depend on this crate: the commit
//! changes with every commit, and what depends on it is built again.
#![forbid(unsafe_code)]

use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

/// The workspace's version.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");

/// The full hash of the commit this binary was built from (`unknown` without git).
pub const COMMIT: &str = env!("AGENTLOG_COMMIT");

/// What `--version` prints after the binary's name: `VERSION (COMMIT)`.
pub const VERSION_AND_COMMIT: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (",
    env!("AGENTLOG_COMMIT"),
    ")"
);

/// Registers `agentlog_build_info{version,commit}` (always 1) in `registry`, so a dashboard
/// sees which build each replica runs, and when a rollout has reached every one.
pub fn register(registry: &mut Registry) {
    let info = prometheus_client::metrics::family::Family::<[(&'static str, &'static str); 2], Gauge>::default();
    info.get_or_create(&[("version", VERSION), ("commit", COMMIT)])
        .set(1);
    registry.register(
        "agentlog_build_info",
        "The build this process runs: its version and the commit it was built from (always 1)",
        info,
    );
}
