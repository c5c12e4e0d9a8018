//! The protections of the tool sandbox, and which mechanism enforces each on this node.
//!
//! A protection is a promise to the user (a tool call reads and writes only its own
//! workspace, …); a mechanism is what the node offers to keep it (Landlock at some ABI, a
//! seccomp filter, the runner made non-dumpable, a separate uid, the helper process,
//! rlimits). [`table`] is a pure function of what the start-up probe measured
//! ([`ProbeReport`]): each protection gets the mechanisms that enforce it, strongest first,
//! or none, with how to get one. `--sandbox require` refuses to start exactly when some
//! protection has none; a Landlock ABI older than the newest is never a reason by itself.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use super::filter::Refusals;
use super::ToolNetwork;

/// What the start-up probe found, in a process that applied every mechanism to itself the
/// way a tool call's stage does, then tried what a tool would.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeReport {
    /// The kernel's Landlock ABI, or why there is none (`ENOSYS`, `EOPNOTSUPP`, `EPERM`…).
    pub landlock_kernel: Result<i32, String>,
    /// The ABI the runner asks for: the kernel's, capped by `AGENTLOG_SANDBOX_MAX_ABI`.
    pub landlock_requested: Option<i32>,
    /// The ruleset at that ABI was fully enforced (`RulesetStatus::FullyEnforced`) and
    /// /proc was out of reach afterwards; else what went wrong.
    pub landlock_enforced: Result<(), String>,
    /// The switch to the tool user (`None`: tools run as the runner's user).
    pub separate_uid: Option<Result<u32, String>>,
    /// A seccomp filter was installed and refused `socket(AF_INET)`.
    pub seccomp: Result<(), String>,
    /// A seccomp filter with a user-notification listener was installed.
    pub notify: Result<(), String>,
    pub subreaper: Result<(), String>,
    pub rlimits: Result<(), String>,
    /// The runner's secret files the probe could still open at the end.
    pub readable_secret_files: Vec<String>,
    /// Whether the probe could still read `/proc/<runner>/environ` at the end.
    pub runner_environ_readable: bool,
    /// The node's kernel is gVisor's (the pod is the boundary).
    pub gvisor: bool,
}

/// The runner's own state, beside the probe's findings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunnerFacts {
    /// `PR_SET_DUMPABLE` 0 took effect.
    pub non_dumpable: bool,
    pub network: ToolNetwork,
    /// `--sandbox off`: nothing but the helper, rlimits and the tool user.
    pub off: bool,
}

/// The mechanisms every call of this runner gets (the stage applies exactly these).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mechanisms {
    /// Landlock at this ABI's rights.
    pub landlock_abi: Option<i32>,
    /// The refusal filter (`None`: no seccomp).
    pub refusals: Option<Refusals>,
    /// The signal filter, vetted by the helper.
    pub notify: bool,
}

/// One protection of the sandbox.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protection {
    WorkspaceOnly,
    OtherWorkspaces,
    RunnerSecrets,
    Signals,
    Network,
    Leftovers,
    Limits,
}

impl Protection {
    pub const ALL: [Protection; 7] = [
        Protection::WorkspaceOnly,
        Protection::OtherWorkspaces,
        Protection::RunnerSecrets,
        Protection::Signals,
        Protection::Network,
        Protection::Leftovers,
        Protection::Limits,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Protection::WorkspaceOnly => "workspace only (read and write)",
            Protection::OtherWorkspaces => "other sessions' workspaces",
            Protection::RunnerSecrets => "the runner's secrets",
            Protection::Signals => "signals to the runner and other calls",
            Protection::Network => "network egress",
            Protection::Leftovers => "processes left behind",
            Protection::Limits => "resource limits",
        }
    }
}

/// A row of the table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Row {
    pub protection: Protection,
    /// Strongest first; empty when nothing enforces it.
    pub mechanisms: Vec<String>,
    pub enforced: bool,
    /// When not enforced: what is missing and how to get it.
    pub missing: Option<String>,
    /// What the mechanism costs ordinary work, if anything.
    pub note: Option<String>,
}

/// The table, and the mechanisms each call gets.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Table {
    pub rows: Vec<Row>,
    pub mechanisms: Mechanisms,
    pub gvisor: bool,
}

const LANDLOCK_HOW: &str =
    "Landlock (Linux 5.13+ with `landlock` among its LSMs; node images: deploy/README.md)";

/// Why Landlock is not in use, in words.
fn landlock_gap(report: &ProbeReport) -> String {
    match (&report.landlock_kernel, &report.landlock_enforced) {
        (Err(errno), _) if errno.starts_with("EPERM") => format!(
            "the landlock_* system calls are refused ({errno}), as a seccomp profile that lacks \
             them does: use one that allows landlock_create_ruleset, landlock_add_rule and \
             landlock_restrict_self"
        ),
        (Err(errno), _) if errno.starts_with("EOPNOTSUPP") => format!(
            "Landlock is built into this kernel but not enabled ({errno}): add `landlock` to \
             the lsm= boot parameter"
        ),
        (Err(errno), _) if errno.starts_with("ENOSYS") => format!(
            "this kernel has no Landlock ({errno}; gVisor has none either): use a node \
             kernel with {LANDLOCK_HOW}"
        ),
        (Err(errno), _) => format!("the Landlock probe failed ({errno})"),
        (Ok(_), _) if report.landlock_requested.is_none() => {
            "Landlock is capped at ABI 0 (AGENTLOG_SANDBOX_MAX_ABI, a test-only setting)".into()
        }
        (Ok(_), Err(why)) => format!("Landlock did not enforce the ruleset: {why}"),
        (Ok(_), Ok(())) => String::new(),
    }
}

/// Which protection each mechanism keeps, from what the probe measured.
pub fn table(report: &ProbeReport, runner: RunnerFacts) -> Table {
    let seccomp = !runner.off && report.seccomp.is_ok();
    let landlock = if runner.off {
        None
    } else {
        report
            .landlock_enforced
            .is_ok()
            .then_some(report.landlock_requested)
            .flatten()
            .filter(|&abi| abi >= 1)
    };
    let notify = seccomp && report.notify.is_ok() && landlock.is_none_or(|abi| abi < 6);
    let refusals = seccomp.then(|| Refusals {
        network: runner.network == ToolNetwork::None,
        ptrace: landlock.is_none(),
        truncate: landlock.is_none_or(|abi| abi < 3),
        sigio_owner: landlock.is_none_or(|abi| abi < 6),
    });
    let uid = report
        .separate_uid
        .as_ref()
        .and_then(|r| r.as_ref().ok())
        .copied();
    let off_gap = || "--sandbox off".to_string();

    let mut rows = Vec::new();
    // The filesystem: only Landlock confines paths; below ABI 3 it does not handle
    // truncate(2), which the refusal filter then refuses.
    let filesystem = |protection| {
        let (mechanisms, missing) = match landlock {
            Some(abi) if abi >= 3 => (vec![format!("Landlock ABI {abi}")], None),
            Some(abi) if seccomp => (
                vec![format!("Landlock ABI {abi}"), "seccomp (truncate)".into()],
                None,
            ),
            Some(abi) => (
                vec![format!("Landlock ABI {abi}")],
                Some(format!(
                    "Landlock ABI {abi} does not handle truncate(2) and seccomp is unavailable ({})",
                    err(&report.seccomp)
                )),
            ),
            None if runner.off => (Vec::new(), Some(off_gap())),
            None => (
                Vec::new(),
                Some(format!("needs {LANDLOCK_HOW}; here {}", landlock_gap(report))),
            ),
        };
        Row {
            protection,
            enforced: missing.is_none(),
            mechanisms,
            missing,
            // ABI 1 has no LANDLOCK_ACCESS_FS_REFER: every reparenting is refused.
            note: (landlock == Some(1)).then(|| {
                "at ABI 1 a rename or link into another directory fails (EXDEV): `mv` copies \
                 instead, `git mv a dir/a` fails"
                    .to_string()
            }),
        }
    };
    rows.push(filesystem(Protection::WorkspaceOnly));
    rows.push(filesystem(Protection::OtherWorkspaces));

    // Secrets: measured (the probe tried to read them); ptrace is kept off by any of a
    // separate uid, Landlock, the non-dumpable runner or the refusal filter.
    let mut mechanisms = Vec::new();
    if let Some(uid) = uid {
        mechanisms.push(format!("separate uid {uid}"));
    }
    if let Some(abi) = landlock {
        mechanisms.push(format!("Landlock ABI {abi}"));
    }
    if runner.non_dumpable {
        mechanisms.push("non-dumpable runner".into());
    }
    if refusals.is_some_and(|r| r.ptrace) {
        mechanisms.push("seccomp (ptrace, process_vm_readv/writev)".into());
    }
    let mut gaps = Vec::new();
    for file in &report.readable_secret_files {
        gaps.push(format!(
            "a tool can read the secret file {file}: mount it outside the paths tools may read \
             (/usr, /bin, /sbin, /lib*, /etc, /opt, --tool-read-path, the workspace root), or \
             run tools as a separate uid that cannot read it"
        ));
    }
    if report.runner_environ_readable {
        gaps.push(
            "a tool can read /proc/<runner>/environ: needs the runner non-dumpable \
             (PR_SET_DUMPABLE), Landlock or a separate uid"
                .into(),
        );
    }
    if mechanisms.is_empty() {
        gaps.push(
            "nothing keeps ptrace and process_vm_readv off the runner: needs a separate uid, \
             Landlock, a non-dumpable runner or seccomp"
                .into(),
        );
    }
    rows.push(Row {
        protection: Protection::RunnerSecrets,
        enforced: gaps.is_empty(),
        mechanisms,
        missing: (!gaps.is_empty()).then(|| gaps.join("; ")),
        note: None,
    });

    // Signals: Landlock's scope (ABI 6), else the helper vetting each signal. A separate
    // uid alone keeps the runner safe, not the other calls (they share the tool user).
    let (mut mechanisms, missing) =
        match landlock {
            Some(abi) if abi >= 6 => (vec![format!("Landlock ABI {abi} (signal scope)")], None),
            _ if notify => (
                vec!["seccomp user notification (the helper vets each signal)".into()],
                None,
            ),
            _ if runner.off => (Vec::new(), Some(off_gap())),
            _ => {
                (
                    Vec::new(),
                    Some(format!(
                "needs Landlock ABI 6 (Linux 6.12+) or seccomp user notification (Linux 5.5+; \
                 here {})",
                if seccomp { err(&report.notify) } else { err(&report.seccomp) }
            )),
                )
            }
        };
    if let Some(uid) = uid {
        mechanisms.push(format!("separate uid {uid} (the runner)"));
    }
    rows.push(Row {
        protection: Protection::Signals,
        enforced: missing.is_none(),
        mechanisms,
        missing,
        note: None,
    });

    // The network: the refusal filter refuses every socket family but AF_UNIX; Landlock
    // (ABI 4) handles TCP only, so it adds to seccomp and cannot replace it.
    let row = match runner.network {
        ToolNetwork::All => Row {
            protection: Protection::Network,
            mechanisms: vec!["none: --tool-network all".into()],
            enforced: true,
            missing: None,
            note: None,
        },
        ToolNetwork::None => {
            let mut mechanisms = Vec::new();
            if seccomp {
                mechanisms.push("seccomp (socket families)".to_string());
            }
            if let Some(abi) = landlock.filter(|&abi| abi >= 4) {
                mechanisms.push(format!("Landlock ABI {abi} (TCP)"));
            }
            let missing = (!seccomp).then(|| {
                if runner.off {
                    off_gap()
                } else {
                    format!(
                        "needs a seccomp filter (Linux 3.5+, no_new_privs), here {}",
                        err(&report.seccomp)
                    )
                }
            });
            Row {
                protection: Protection::Network,
                enforced: missing.is_none(),
                mechanisms,
                missing,
                note: None,
            }
        }
    };
    rows.push(row);

    let simple = |protection, result: &Result<(), String>, mechanism: &str| Row {
        protection,
        mechanisms: if result.is_ok() {
            vec![mechanism.to_string()]
        } else {
            Vec::new()
        },
        enforced: result.is_ok(),
        missing: result
            .as_ref()
            .err()
            .map(|e| format!("{mechanism} failed: {e}")),
        note: None,
    };
    rows.push(simple(
        Protection::Leftovers,
        &report.subreaper,
        "the helper (child subreaper, kills what the call leaves)",
    ));
    rows.push(simple(
        Protection::Limits,
        &report.rlimits,
        "rlimits (CPU time, processes, file size, open files)",
    ));

    Table {
        rows,
        mechanisms: Mechanisms {
            landlock_abi: landlock,
            refusals,
            notify,
        },
        gvisor: report.gvisor,
    }
}

fn err(result: &Result<(), String>) -> String {
    match result {
        Ok(()) => "available".into(),
        Err(e) => e.clone(),
    }
}

impl Table {
    /// The protections nothing enforces.
    pub fn gaps(&self) -> Vec<&Row> {
        self.rows.iter().filter(|row| !row.enforced).collect()
    }

    /// The table as the runner prints it at start, one line each, every line starting
    /// with `sandbox: ` (so `agentlog up` finds them).
    pub fn render(&self, mode: &str, network: &str) -> String {
        let mut out = String::new();
        let gaps = self.gaps().len();
        let verdict = if gaps == 0 {
            "every protection enforced".to_string()
        } else {
            format!("{gaps} of {} protections NOT enforced", self.rows.len())
        };
        let _ = writeln!(
            out,
            "sandbox: tool sandbox (--sandbox {mode}, --tool-network {network}): {verdict}"
        );
        if self.gvisor {
            let _ = writeln!(
                out,
                "sandbox: runtime: gVisor — the pod is the boundary: tools reach the node's kernel \
                 only through it, and everything inside the pod as the rows say"
            );
        }
        let width = Protection::ALL
            .iter()
            .map(|p| p.name().len())
            .max()
            .unwrap_or(0);
        let _ = writeln!(
            out,
            "sandbox:   {:width$}  {:8}  mechanism",
            "protection", "enforced"
        );
        for row in &self.rows {
            let mechanism = if row.mechanisms.is_empty() {
                "none".to_string()
            } else {
                row.mechanisms.join(" + ")
            };
            let _ = writeln!(
                out,
                "sandbox:   {:width$}  {:8}  {mechanism}",
                row.protection.name(),
                if row.enforced { "yes" } else { "NO" }
            );
            for text in [&row.missing, &row.note].into_iter().flatten() {
                let _ = writeln!(out, "sandbox:   {:width$}            {text}", "");
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn full() -> ProbeReport {
        ProbeReport {
            landlock_kernel: Ok(7),
            landlock_requested: Some(7),
            landlock_enforced: Ok(()),
            separate_uid: None,
            seccomp: Ok(()),
            notify: Ok(()),
            subreaper: Ok(()),
            rlimits: Ok(()),
            readable_secret_files: Vec::new(),
            runner_environ_readable: false,
            gvisor: false,
        }
    }

    const POD: RunnerFacts = RunnerFacts {
        non_dumpable: true,
        network: ToolNetwork::None,
        off: false,
    };

    fn mechanisms(table: &Table, protection: Protection) -> String {
        let row = table
            .rows
            .iter()
            .find(|r| r.protection == protection)
            .expect("row");
        row.mechanisms.join(" + ")
    }

    #[test]
    fn a_full_kernel_enforces_everything_with_landlock() {
        let table = table(&full(), POD);
        assert!(table.gaps().is_empty(), "{table:?}");
        assert_eq!(
            mechanisms(&table, Protection::WorkspaceOnly),
            "Landlock ABI 7"
        );
        assert_eq!(
            mechanisms(&table, Protection::Signals),
            "Landlock ABI 7 (signal scope)"
        );
        assert!(!table.mechanisms.notify);
        let refusals = table.mechanisms.refusals.expect("seccomp");
        assert!(
            refusals.network && !refusals.ptrace && !refusals.truncate && !refusals.sigio_owner
        );
    }

    #[test]
    fn every_old_abi_still_enforces_everything_with_seccomp_beside_it() {
        for abi in 1..=5 {
            let report = ProbeReport {
                landlock_requested: Some(abi),
                ..full()
            };
            let table = table(&report, POD);
            assert!(table.gaps().is_empty(), "ABI {abi}: {table:?}");
            assert!(table.mechanisms.notify, "ABI {abi}");
            assert_eq!(table.mechanisms.landlock_abi, Some(abi));
            assert_eq!(
                table.mechanisms.refusals.expect("seccomp").truncate,
                abi < 3,
                "ABI {abi}"
            );
            assert!(
                mechanisms(&table, Protection::Signals).starts_with("seccomp user notification")
            );
        }
    }

    #[test]
    fn a_blocked_landlock_leaves_the_filesystem_unprotected_and_says_why() {
        let report = ProbeReport {
            landlock_kernel: Err("EPERM".into()),
            landlock_requested: None,
            landlock_enforced: Err("not tried".into()),
            ..full()
        };
        let table = table(&report, POD);
        let gaps: Vec<Protection> = table.gaps().iter().map(|r| r.protection).collect();
        assert_eq!(
            gaps,
            [Protection::WorkspaceOnly, Protection::OtherWorkspaces]
        );
        let missing = table.gaps()[0].missing.clone().unwrap_or_default();
        assert!(
            missing.contains("refused (EPERM)") && missing.contains("seccomp profile"),
            "{missing}"
        );
        let refusals = table.mechanisms.refusals.expect("seccomp");
        assert!(refusals.ptrace && refusals.truncate && refusals.sigio_owner);
        assert!(mechanisms(&table, Protection::RunnerSecrets).contains("non-dumpable runner"));
    }

    #[test]
    fn readable_secrets_and_a_missing_notify_are_gaps() {
        let report = ProbeReport {
            landlock_requested: Some(4),
            notify: Err("EBUSY".into()),
            readable_secret_files: vec!["/etc/key".into()],
            separate_uid: Some(Ok(65534)),
            ..full()
        };
        let table = table(&report, POD);
        let gaps: Vec<Protection> = table.gaps().iter().map(|r| r.protection).collect();
        assert_eq!(gaps, [Protection::RunnerSecrets, Protection::Signals]);
        assert_eq!(
            mechanisms(&table, Protection::Signals),
            "separate uid 65534 (the runner)"
        );
        let rendered = table.render("require", "none");
        assert!(
            rendered.lines().all(|l| l.starts_with("sandbox: ")),
            "{rendered}"
        );
        assert!(
            rendered.contains("2 of 7 protections NOT enforced"),
            "{rendered}"
        );
        assert!(rendered.contains("/etc/key"), "{rendered}");
    }

    #[test]
    fn off_applies_nothing_but_the_helper_and_limits() {
        let table = table(&full(), RunnerFacts { off: true, ..POD });
        assert_eq!(table.mechanisms, Mechanisms::default());
        let gaps: Vec<Protection> = table.gaps().iter().map(|r| r.protection).collect();
        assert_eq!(
            gaps,
            [
                Protection::WorkspaceOnly,
                Protection::OtherWorkspaces,
                Protection::Signals,
                Protection::Network
            ]
        );
    }
}
