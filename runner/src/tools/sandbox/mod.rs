//! The tool sandbox: a `bash` call reads and writes its own workspace and nothing else of
//! the other sessions, the runner or the machine.
//!
//! Each call runs under a helper process (the runner's binary re-executed, see
//! [`process`]) that leaves no process of the call behind. The sandbox names its
//! protections (own workspace only, other sessions' workspaces, the runner's secrets,
//! signals, network, leftovers, limits) and enforces each with the strongest mechanism the
//! node has: Landlock at whatever ABI the kernel offers, seccomp filters (with a
//! user-notification listener the helper answers, for signals below Landlock ABI 6), the
//! runner made non-dumpable, a separate uid where the runner may switch (root, or
//! SETUID/SETGID in a user-namespaced pod). See [`protections`] for which holds which.
//!
//! [`Sandbox::start`] measures, at start, what the node enforces (a probe process applies
//! every mechanism to itself and tries what a tool would) and prints the table: `require`
//! refuses to start where some protection has no mechanism, `best-effort` marks every tool
//! result, `off` runs tools without Landlock or seccomp.

mod filter;
mod kernel;
mod process;
pub mod protections;
mod supervise;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Stdio;

use serde::{Deserialize, Serialize};

pub use process::main as process_main;
use protections::{Mechanisms, ProbeReport, RunnerFacts, Table};

/// The hidden first argument that makes the runner binary a sandbox process.
pub const HELPER_ARG: &str = "__tool-sandbox";
/// The running runner binary: still the same file after the one on disk is replaced (a
/// rebuild, an upgrade), unlike its path.
pub const SELF_EXE: &str = "/proc/self/exe";
/// Test-only: `AGENTLOG_SANDBOX_MAX_ABI=N` makes the runner ask Landlock for ABI N's rights
/// only, as on an older kernel (0: no Landlock).
pub const MAX_ABI_ENV: &str = "AGENTLOG_SANDBOX_MAX_ABI";

/// `runner --sandbox`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SandboxMode {
    /// Refuse to start where some protection has no mechanism on this node.
    Require,
    /// Enforce what the node can; say what is missing at start and on every tool result.
    BestEffort,
    /// No Landlock, no seccomp filter (the helper, rlimits and the tool user stay).
    Off,
}

/// `runner --tool-network`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolNetwork {
    /// Unix sockets only.
    None,
    /// Whatever the runner's own network reaches.
    All,
}

/// A user and group id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ids {
    pub uid: u32,
    pub gid: u32,
}

/// What a sandbox process is told to do (passed as JSON on its command line).
#[derive(Debug, Serialize, Deserialize)]
struct Plan {
    /// The runner's pid: a helper whose parent is already someone else stops at once.
    runner: u32,
    workspace: PathBuf,
    user: Option<Ids>,
    mechanisms: Mechanisms,
    network: ToolNetwork,
    read_paths: Vec<PathBuf>,
    cpu_secs: u64,
    command: String,
    /// Set for the start-up probe only.
    probe: Option<ProbeRequest>,
}

/// What the start-up probe is to try.
#[derive(Debug, Serialize, Deserialize)]
struct ProbeRequest {
    /// The `AGENTLOG_SANDBOX_MAX_ABI` cap.
    max_abi: Option<i32>,
    /// The runner's secret files, which no tool may open.
    secret_files: Vec<PathBuf>,
    /// Try Landlock and seccomp (not under `--sandbox off`).
    confine: bool,
}

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error(
        "--sandbox require: on this node nothing enforces {}:\n{}\nStart the runner with \
         `--sandbox best-effort` to run tools with what the node enforces (every tool result \
         then says what is missing), or `--sandbox off` to run them unconfined",
        .names,
        .details
    )]
    Unenforced { names: String, details: String },
    #[error("cannot run the sandbox probe: {0}")]
    Probe(String),
    #[error("{MAX_ABI_ENV}={0:?} is not a Landlock ABI number (0 to 9)")]
    MaxAbi(String),
}

/// The sandbox every tool call of this runner runs in.
#[derive(Debug, Clone)]
pub struct Sandbox {
    pub mode: SandboxMode,
    pub network: ToolNetwork,
    /// The user tools run as and workspaces belong to; `None`: the runner's own.
    pub user: Option<Ids>,
    /// Extra paths tools may read and execute.
    pub read_paths: Vec<PathBuf>,
    /// The runner binary, re-executed as the helper.
    pub helper: PathBuf,
    /// The runner's secret files (token, keys), which no tool may read.
    pub secret_files: Vec<PathBuf>,
    /// What [`Sandbox::start`] found; `None` before it ran.
    pub table: Option<Table>,
}

impl Sandbox {
    /// Measures what the node enforces (a probe process applies every mechanism to itself
    /// and tries what a tool would), keeps the table and the mechanisms calls get. Under
    /// `require`, an error naming each protection nothing enforces, and how to get it.
    pub async fn start(
        &mut self,
        workspace_root: &Path,
        non_dumpable: bool,
    ) -> Result<&Table, SandboxError> {
        let max_abi = match std::env::var(MAX_ABI_ENV) {
            Ok(value) => Some(
                value
                    .trim()
                    .parse::<i32>()
                    .ok()
                    .filter(|abi| (0..=9).contains(abi))
                    .ok_or(SandboxError::MaxAbi(value))?,
            ),
            Err(_) => None,
        };
        let request = ProbeRequest {
            max_abi,
            secret_files: self.secret_files.clone(),
            confine: self.mode != SandboxMode::Off,
        };
        let mut plan = self.plan(workspace_root, 1, String::new(), Mechanisms::default());
        plan.probe = Some(request);
        let plan = serde_json::to_string(&plan).map_err(|e| SandboxError::Probe(e.to_string()))?;
        let out = tokio::process::Command::new(&self.helper)
            .args([HELPER_ARG, "probe", &plan])
            .env_clear()
            .stdin(Stdio::null())
            .output()
            .await
            .map_err(|e| SandboxError::Probe(e.to_string()))?;
        let report: ProbeReport = serde_json::from_slice(&out.stdout).map_err(|e| {
            SandboxError::Probe(format!(
                "{e}; it said: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ))
        })?;
        let facts = RunnerFacts {
            non_dumpable,
            network: self.network,
            off: self.mode == SandboxMode::Off,
        };
        let table = protections::table(&report, facts);
        let gaps = table.gaps();
        if self.mode == SandboxMode::Require && !gaps.is_empty() {
            let names: Vec<&str> = gaps.iter().map(|row| row.protection.name()).collect();
            let details: Vec<String> = gaps
                .iter()
                .map(|row| {
                    format!(
                        "  - {}: {}",
                        row.protection.name(),
                        row.missing.as_deref().unwrap_or("no mechanism")
                    )
                })
                .collect();
            // The table goes out too: it says what does hold.
            eprint!("{}", table.render(self.mode_name(), self.network_name()));
            return Err(SandboxError::Unenforced {
                names: names.join(", "),
                details: details.join("\n"),
            });
        }
        Ok(self.table.insert(table))
    }

    /// The mechanisms every call gets (none before [`Sandbox::start`]).
    fn mechanisms(&self) -> Mechanisms {
        self.table
            .as_ref()
            .map(|table| table.mechanisms)
            .unwrap_or_default()
    }

    /// The mode's flag value, for the start-up log line (`agentlog up` shows it).
    pub fn mode_name(&self) -> &'static str {
        match self.mode {
            SandboxMode::Require => "require",
            SandboxMode::BestEffort => "best-effort",
            SandboxMode::Off => "off",
        }
    }

    /// The network's flag value, for the start-up log line.
    pub fn network_name(&self) -> &'static str {
        match self.network {
            ToolNetwork::None => "none",
            ToolNetwork::All => "all",
        }
    }

    /// The note added to every tool result in best-effort mode where the node falls short.
    pub fn mark(&self) -> Option<String> {
        if self.mode != SandboxMode::BestEffort {
            return None;
        }
        let gaps = self.table.as_ref()?.gaps();
        (!gaps.is_empty()).then(|| {
            let names: Vec<&str> = gaps.iter().map(|row| row.protection.name()).collect();
            format!(
                "[sandbox: best-effort, not enforced on this node: {}]",
                names.join(", ")
            )
        })
    }

    /// Makes `root` reachable (search permission) for the tool user, so absolute paths of
    /// its workspaces work: `root` becomes `0711`, and an ancestor the tool user cannot
    /// search gets search permission for others. Returns the ancestors it changed.
    pub fn open_path_to(&self, root: &Path) -> std::io::Result<Vec<PathBuf>> {
        let Some(ids) = self.user else {
            return Ok(Vec::new());
        };
        let root = root.canonicalize()?;
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o711))?;
        let mut changed = Vec::new();
        for dir in root.ancestors().skip(1) {
            let meta = std::fs::metadata(dir)?;
            let mode = meta.mode();
            let searchable = if meta.uid() == ids.uid {
                mode & 0o100 != 0
            } else if meta.gid() == ids.gid {
                mode & 0o010 != 0
            } else {
                mode & 0o001 != 0
            };
            if !searchable {
                std::fs::set_permissions(
                    dir,
                    std::fs::Permissions::from_mode((mode & 0o7777) | 0o001),
                )?;
                changed.push(dir.to_path_buf());
            }
        }
        Ok(changed)
    }

    /// The helper process that runs `command` in `workspace` (its stdio still to be set).
    pub(super) fn command(
        &self,
        workspace: &Path,
        cpu_secs: u64,
        command: String,
    ) -> tokio::process::Command {
        let plan = self.plan(workspace, cpu_secs, command, self.mechanisms());
        // A struct of paths, numbers and strings always serializes.
        let plan = serde_json::to_string(&plan).unwrap_or_default();
        let mut helper = tokio::process::Command::new(&self.helper);
        helper.args([HELPER_ARG, "helper", &plan]);
        helper
    }

    fn plan(
        &self,
        workspace: &Path,
        cpu_secs: u64,
        command: String,
        mechanisms: Mechanisms,
    ) -> Plan {
        Plan {
            runner: std::process::id(),
            workspace: workspace.to_path_buf(),
            user: self.user,
            mechanisms,
            network: self.network,
            read_paths: self.read_paths.clone(),
            cpu_secs,
            command,
            probe: None,
        }
    }
}

#[cfg(test)]
impl Sandbox {
    /// For unit tests of the file tools, which never start the helper.
    pub(crate) fn unconfined_for_tests() -> Sandbox {
        Sandbox {
            mode: SandboxMode::Off,
            network: ToolNetwork::None,
            user: None,
            read_paths: Vec::new(),
            helper: PathBuf::from("runner"),
            secret_files: Vec::new(),
            table: None,
        }
    }
}
