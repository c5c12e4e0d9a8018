//! The tool sandbox: a `bash` call reads and writes its own workspace and nothing else of
//! the other sessions, the runner or the machine.
//!
//! Each call runs under a helper process (the runner's binary re-executed, see
//! [`process`]) that leaves no process of the call behind, and in a Landlock domain that
//! allows read and execute on the system directories, everything on the session's
//! workspace, no signal to a process outside the call, and (with `--tool-network none`) no
//! TCP, plus a seccomp filter that refuses every non-Unix socket. When the runner is root,
//! the tool runs as an unprivileged user that owns the workspaces.
//!
//! [`Sandbox::probe`] asks the kernel, at start, how much of this it enforces: `require`
//! refuses to start where it cannot enforce all of it, `best-effort` marks every tool
//! result, `off` runs tools without Landlock or the seccomp filter.

mod process;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Stdio;

use serde::{Deserialize, Serialize};

pub use process::main as process_main;

/// The hidden first argument that makes the runner binary a sandbox process.
pub const HELPER_ARG: &str = "__tool-sandbox";
/// The running runner binary: still the same file after the one on disk is replaced (a
/// rebuild, an upgrade), unlike its path.
pub const SELF_EXE: &str = "/proc/self/exe";
/// Test-only: set to `unsupported` to make the start-up probe answer that the kernel has no
/// Landlock, as an old or misconfigured kernel would.
pub const PROBE_OVERRIDE_ENV: &str = "AGENTLOG_TEST_SANDBOX_PROBE";

/// `runner --sandbox`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SandboxMode {
    /// Refuse to start where the kernel cannot enforce the whole sandbox.
    Require,
    /// Enforce what the kernel can; warn at start and mark every tool result.
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

/// How strictly the stage applies Landlock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
enum Enforcement {
    Require,
    BestEffort,
    Off,
}

/// What a sandbox process is told to do (passed as JSON on its command line).
#[derive(Debug, Serialize, Deserialize)]
struct Plan {
    /// The runner's pid: a helper whose parent is already someone else stops at once.
    runner: u32,
    workspace: PathBuf,
    user: Option<Ids>,
    enforcement: Enforcement,
    network: ToolNetwork,
    read_paths: Vec<PathBuf>,
    cpu_secs: u64,
    command: String,
}

#[derive(Debug, thiserror::Error)]
pub enum SandboxError {
    #[error(
        "the tool sandbox needs Landlock ABI 6 or newer (Linux 6.12+, with `landlock` in the \
         `lsm=` boot parameter) and this kernel cannot enforce it ({0}); start the runner \
         with `--sandbox best-effort` to run tools with what the kernel enforces, or \
         `--sandbox off` to run them unconfined"
    )]
    Unsupported(String),
    #[error("cannot run the sandbox probe: {0}")]
    Probe(String),
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
    /// In best-effort mode on a kernel that cannot enforce everything: what it said.
    pub weakness: Option<String>,
}

impl Sandbox {
    /// Asks the kernel, through a probe process, how much of the sandbox it enforces.
    /// `require`: an error unless all of it; `best-effort`: remembers the gap.
    pub async fn probe(&mut self, workspace_root: &Path) -> Result<(), SandboxError> {
        if self.mode == SandboxMode::Off {
            return Ok(());
        }
        let answer = match std::env::var(PROBE_OVERRIDE_ENV).ok().as_deref() {
            Some("unsupported") => format!(
                "none Landlock unsupported ({PROBE_OVERRIDE_ENV}=unsupported, a test-only setting)"
            ),
            _ => {
                let plan = self.plan(workspace_root, 1, String::new(), Enforcement::BestEffort);
                let out = tokio::process::Command::new(&self.helper)
                    .args([HELPER_ARG, "probe", &plan])
                    .stdin(Stdio::null())
                    .output()
                    .await
                    .map_err(|e| SandboxError::Probe(e.to_string()))?;
                if !out.status.success() {
                    return Err(SandboxError::Probe(
                        String::from_utf8_lossy(&out.stderr).trim().to_string(),
                    ));
                }
                String::from_utf8_lossy(&out.stdout).trim().to_string()
            }
        };
        let (word, detail) = answer.split_once(' ').unwrap_or((&answer, ""));
        if word == "full" {
            return Ok(());
        }
        let gap = format!("Landlock enforcement: {word}; {detail}");
        match self.mode {
            SandboxMode::Require => Err(SandboxError::Unsupported(gap)),
            _ => {
                self.weakness = Some(gap);
                Ok(())
            }
        }
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

    /// The note added to every tool result in best-effort mode where the kernel falls short.
    pub fn mark(&self) -> Option<String> {
        self.weakness.as_ref().map(|gap| {
            format!("[sandbox: best-effort, this kernel does not enforce all of it ({gap})]")
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
        let enforcement = match self.mode {
            SandboxMode::Require => Enforcement::Require,
            SandboxMode::BestEffort => Enforcement::BestEffort,
            SandboxMode::Off => Enforcement::Off,
        };
        let plan = self.plan(workspace, cpu_secs, command, enforcement);
        let mut helper = tokio::process::Command::new(&self.helper);
        helper.args([HELPER_ARG, "helper", &plan]);
        helper
    }

    fn plan(
        &self,
        workspace: &Path,
        cpu_secs: u64,
        command: String,
        enforcement: Enforcement,
    ) -> String {
        let plan = Plan {
            runner: std::process::id(),
            workspace: workspace.to_path_buf(),
            user: self.user,
            enforcement,
            network: self.network,
            read_paths: self.read_paths.clone(),
            cpu_secs,
            command,
        };
        // A struct of paths, numbers and strings always serializes.
        serde_json::to_string(&plan).unwrap_or_default()
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
            weakness: None,
        }
    }
}
