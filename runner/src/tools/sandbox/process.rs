//! The process side of the tool sandbox: the runner's own binary re-executed as
//! `runner __tool-sandbox VERB PLAN`, single-threaded, without an async runtime.
//!
//! - `helper` runs outside the tool's sandbox, as the runner's user. It becomes a child
//!   subreaper (so everything the call orphans — `setsid`, double forks — is re-parented to
//!   it), starts the `stage`, waits for it, then kills and reaps every process the call left
//!   behind. It does the same when told to stop (SIGTERM, SIGINT, SIGHUP: a timeout, an
//!   interrupt, a dropped call) and when the runner dies (its parent-death signal).
//! - `stage` is the tool's side: it enters the workspace, sets the rlimits, drops to the
//!   tool user, restricts itself with Landlock (filesystem, TCP, signal and abstract-socket
//!   scopes) and the seccomp network filter, and execs `bash -c COMMAND`.
//! - `probe` applies the same Landlock ruleset to itself and prints how much of it the
//!   kernel enforces: `full`, `partial` or `none`, then a detail.
//!
//! No unsafe code: the privilege drop and the restrictions happen in the stage process
//! itself, before it execs bash, rather than between fork and exec.

use std::collections::HashMap;
use std::convert::Infallible;
use std::ffi::OsString;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use landlock::{
    Access, AccessFs, AccessNet, CompatLevel, Compatible, PathBeneath, PathFd, Ruleset,
    RulesetAttr, RulesetCreated, RulesetCreatedAttr, RulesetStatus, Scope, ABI,
};
use nix::errno::Errno;
use nix::libc;
use nix::sys::resource::{setrlimit, Resource};
use nix::sys::signal::{kill, raise, SigSet, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::{getpid, getppid, setgroups, setresgid, setresuid, Gid, Pid, Uid};
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule,
};

use super::{Enforcement, Plan, ToolNetwork, HELPER_ARG, SELF_EXE};

/// The Landlock ABI whose features the sandbox asks for: filesystem access (with truncate
/// and device ioctls), TCP bind/connect, and the signal and abstract-socket scopes.
pub(super) const LANDLOCK_ABI: ABI = ABI::V6;
/// Readable and executable for tools, besides `--tool-read-path` (missing ones are skipped).
const SYSTEM_DIRS: &[&str] = &[
    "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt",
];
/// Device files tools may read and write.
const DEVICES: &[&str] = &[
    "/dev/null",
    "/dev/zero",
    "/dev/full",
    "/dev/random",
    "/dev/urandom",
];
/// The exit code of the helper or stage when the sandbox itself failed (the message is on
/// stderr, which the tool result shows).
const SANDBOX_FAILED: i32 = 125;
/// How long the helper keeps killing and reaping before it gives up on stuck processes.
const CLEANUP_LIMIT: Duration = Duration::from_secs(10);
/// The most processes (of the tool user, all sessions together) a tool may fork into.
const MAX_PROCESSES: u64 = 512;
const MAX_OPEN_FILES: u64 = 4096;
const MAX_FILE_SIZE: u64 = 4 << 30;

/// Entry point of `runner __tool-sandbox VERB PLAN`; returns the exit code.
pub fn main(args: &[OsString]) -> i32 {
    let (verb, plan) = match args {
        [verb, plan] => (verb.to_string_lossy(), plan.to_string_lossy()),
        _ => {
            eprintln!("sandbox: usage: runner {HELPER_ARG} helper|stage|probe PLAN");
            return SANDBOX_FAILED;
        }
    };
    let parsed: Plan = match serde_json::from_str(&plan) {
        Ok(parsed) => parsed,
        Err(e) => {
            eprintln!("sandbox: bad plan: {e}");
            return SANDBOX_FAILED;
        }
    };
    let result = match verb.as_ref() {
        "helper" => helper(&plan, parsed.runner),
        "stage" => stage(&parsed).map(|never| match never {}),
        "probe" => probe(&parsed),
        other => Err(format!("unknown verb {other:?}")),
    };
    result.unwrap_or_else(|message| {
        eprintln!("sandbox: {message}");
        SANDBOX_FAILED
    })
}

/// How the tool's call ended, as far as the helper saw it.
enum Outcome {
    Exited(i32),
    Signaled(Signal),
    /// The helper was told to stop before the stage ended.
    Stopped,
}

fn helper(plan: &str, runner: u32) -> Result<i32, String> {
    nix::sys::prctl::set_pdeathsig(Signal::SIGTERM)
        .map_err(|e| format!("cannot set the parent-death signal: {e}"))?;
    // Checked after the parent-death signal is set, so the runner cannot die unnoticed.
    if u32::try_from(getppid().as_raw()).ok() != Some(runner) {
        return Err("the runner exited before the call started".into());
    }
    nix::sys::prctl::set_child_subreaper(true)
        .map_err(|e| format!("cannot become a child subreaper: {e}"))?;
    // The helper may re-raise the tool's fatal signal on itself: never with a core dump.
    setrlimit(Resource::RLIMIT_CORE, 0, 0)
        .map_err(|e| format!("cannot disable core dumps: {e}"))?;
    let mut signals = SigSet::empty();
    for signal in [
        Signal::SIGTERM,
        Signal::SIGINT,
        Signal::SIGHUP,
        Signal::SIGCHLD,
    ] {
        signals.add(signal);
    }
    signals
        .thread_block()
        .map_err(|e| format!("cannot block signals: {e}"))?;
    let stage = Command::new(SELF_EXE)
        .args([HELPER_ARG, "stage", plan])
        .spawn()
        .map_err(|e| format!("cannot start the tool: {e}"))?;
    let tool = Pid::from_raw(i32::try_from(stage.id()).map_err(|e| e.to_string())?);

    let outcome = loop {
        match signals.wait() {
            Ok(Signal::SIGCHLD) => {
                if let Some(outcome) = reap_children(tool) {
                    break outcome;
                }
            }
            Ok(_) => break Outcome::Stopped,
            Err(_) => {}
        }
    };
    kill_everything_left();
    Ok(match outcome {
        Outcome::Exited(code) => code,
        Outcome::Signaled(signal) => {
            // Die the same way, so the runner reports the signal; a signal that would not
            // end the helper (SIGPIPE is ignored here) falls back to the shell's 128 + N.
            let _ = SigSet::all().thread_unblock();
            let _ = raise(signal);
            128 + signal as i32
        }
        Outcome::Stopped => 128 + Signal::SIGTERM as i32,
    })
}

/// Reaps every child that has ended; returns the tool's outcome once the stage is among
/// them.
fn reap_children(tool: Pid) -> Option<Outcome> {
    let mut outcome = None;
    loop {
        match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::Exited(pid, code)) if pid == tool => {
                outcome = Some(Outcome::Exited(code));
            }
            Ok(WaitStatus::Signaled(pid, signal, _)) if pid == tool => {
                outcome = Some(Outcome::Signaled(signal));
            }
            Ok(WaitStatus::StillAlive) | Err(_) => return outcome,
            Ok(_) => {}
        }
    }
}

/// SIGKILLs every descendant and reaps them, round after round, until the helper has no
/// child left (orphans come to it, so none can hide), or [`CLEANUP_LIMIT`] passed.
fn kill_everything_left() {
    let me = getpid();
    let deadline = Instant::now() + CLEANUP_LIMIT;
    let mut pause = Duration::from_millis(1);
    loop {
        for pid in descendants(me) {
            // ESRCH: it died on its own meanwhile.
            let _ = kill(pid, Signal::SIGKILL);
        }
        loop {
            match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                Err(Errno::ECHILD) => return,
                Ok(WaitStatus::StillAlive) | Err(_) => break,
                Ok(_) => {}
            }
        }
        if Instant::now() > deadline {
            eprintln!("sandbox: some processes of the call could not be killed");
            return;
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

/// Every live process below `root`, from the parent links in `/proc/*/stat`.
fn descendants(root: Pid) -> Vec<Pid> {
    let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|name| name.parse::<i32>().ok())
            else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(entry.path().join("stat")) else {
                continue;
            };
            // `pid (comm) state ppid …`; comm may hold spaces and parentheses.
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|ppid| ppid.parse::<i32>().ok());
            if let Some(ppid) = ppid {
                children.entry(ppid).or_default().push(pid);
            }
        }
    }
    let mut found = Vec::new();
    let mut queue = vec![root.as_raw()];
    while let Some(pid) = queue.pop() {
        if let Some(kids) = children.get(&pid) {
            for &kid in kids {
                found.push(Pid::from_raw(kid));
                queue.push(kid);
            }
        }
    }
    found
}

fn stage(plan: &Plan) -> Result<Infallible, String> {
    std::env::set_current_dir(&plan.workspace).map_err(|e| {
        format!(
            "cannot enter the workspace {}: {e}",
            plan.workspace.display()
        )
    })?;
    // Opened while still the runner's user, who can reach every path.
    let ruleset = match plan.enforcement {
        Enforcement::Off => None,
        Enforcement::Require => Some(ruleset(plan, CompatLevel::HardRequirement)),
        Enforcement::BestEffort => Some(ruleset(plan, CompatLevel::BestEffort)),
    }
    .transpose()
    .map_err(|e| format!("cannot build the Landlock ruleset: {e}"))?;
    let filter = match (plan.enforcement, plan.network) {
        (Enforcement::Off, _) | (_, ToolNetwork::All) => None,
        _ => Some(network_filter()?),
    };

    let cpu = plan.cpu_secs.max(1);
    for (resource, soft, hard) in [
        (Resource::RLIMIT_CORE, 0, 0),
        (Resource::RLIMIT_CPU, cpu, cpu + 5),
        (Resource::RLIMIT_FSIZE, MAX_FILE_SIZE, MAX_FILE_SIZE),
        (Resource::RLIMIT_NOFILE, MAX_OPEN_FILES, MAX_OPEN_FILES),
        (Resource::RLIMIT_NPROC, MAX_PROCESSES, MAX_PROCESSES),
    ] {
        setrlimit(resource, soft, hard)
            .map_err(|e| format!("cannot set the limit {resource:?}: {e}"))?;
    }
    if let Some(ids) = plan.user {
        let (uid, gid) = (Uid::from_raw(ids.uid), Gid::from_raw(ids.gid));
        setgroups(&[]).map_err(|e| format!("cannot drop supplementary groups: {e}"))?;
        setresgid(gid, gid, gid).map_err(|e| format!("cannot switch to group {gid}: {e}"))?;
        setresuid(uid, uid, uid).map_err(|e| format!("cannot switch to user {uid}: {e}"))?;
    }
    SigSet::empty()
        .thread_set_mask()
        .map_err(|e| format!("cannot reset the signal mask: {e}"))?;
    if let Some(ruleset) = ruleset {
        ruleset
            .restrict_self()
            .map_err(|e| format!("Landlock refused the ruleset: {e}"))?;
    }
    if let Some(filter) = filter {
        if let Err(e) = seccompiler::apply_filter(&filter) {
            let message = format!("cannot install the seccomp network filter: {e}");
            if plan.enforcement == Enforcement::Require {
                return Err(message);
            }
            eprintln!("sandbox (best-effort): {message}");
        }
    }
    let error = Command::new("bash").arg("-c").arg(&plan.command).exec();
    Err(format!("cannot start bash: {error}"))
}

fn probe(plan: &Plan) -> Result<i32, String> {
    let status = ruleset(plan, CompatLevel::BestEffort)
        .and_then(|ruleset| Ok(ruleset.restrict_self()?))
        .map_err(|e| format!("cannot apply a Landlock ruleset: {e}"))?;
    let word = match status.ruleset {
        RulesetStatus::FullyEnforced => "full",
        RulesetStatus::PartiallyEnforced => "partial",
        RulesetStatus::NotEnforced => "none",
    };
    println!("{word} {:?}", status.landlock);
    Ok(0)
}

/// Read and execute on the system directories and `--tool-read-path`s, read and write on a
/// few devices, everything on the workspace; nothing else. With no network, TCP bind and
/// connect are handled with no port allowed. Signals and abstract Unix sockets reach only
/// processes inside the same sandbox.
fn ruleset(plan: &Plan, level: CompatLevel) -> Result<RulesetCreated, Box<dyn std::error::Error>> {
    let abi = LANDLOCK_ABI;
    let mut ruleset = Ruleset::default()
        .set_compatibility(level)
        .handle_access(AccessFs::from_all(abi))?;
    if plan.network == ToolNetwork::None {
        ruleset = ruleset.handle_access(AccessNet::BindTcp | AccessNet::ConnectTcp)?;
    }
    let mut created = ruleset
        .scope(Scope::Signal | Scope::AbstractUnixSocket)?
        .create()?;
    let read_only = SYSTEM_DIRS
        .iter()
        .map(Path::new)
        .chain(plan.read_paths.iter().map(|p| p.as_path()));
    for path in read_only {
        let Ok(meta) = std::fs::metadata(path) else {
            continue;
        };
        let access = if meta.is_dir() {
            AccessFs::from_read(abi)
        } else {
            AccessFs::from_read(abi) & AccessFs::from_file(abi)
        };
        if let Ok(fd) = PathFd::new(path) {
            created = created.add_rule(PathBeneath::new(fd, access))?;
        }
    }
    for device in DEVICES {
        if let Ok(fd) = PathFd::new(device) {
            created = created.add_rule(PathBeneath::new(fd, AccessFs::from_file(abi)))?;
        }
    }
    let workspace = PathFd::new(&plan.workspace)?;
    Ok(created.add_rule(PathBeneath::new(workspace, AccessFs::from_all(abi)))?)
}

/// Refuses `socket()` for every family but `AF_UNIX` (UDP, raw, netlink and TCP alike), and
/// io_uring, which could open sockets past the filter.
fn network_filter() -> Result<BpfProgram, String> {
    let arch = std::env::consts::ARCH
        .try_into()
        .map_err(|e| format!("no seccomp support for this architecture: {e:?}"))?;
    let not_unix = SeccompCondition::new(
        0,
        SeccompCmpArgLen::Dword,
        SeccompCmpOp::Ne,
        libc::AF_UNIX as u64,
    )
    .map_err(|e| e.to_string())?;
    let rules = [
        (
            libc::SYS_socket,
            vec![SeccompRule::new(vec![not_unix]).map_err(|e| e.to_string())?],
        ),
        (libc::SYS_io_uring_setup, vec![]),
    ];
    let filter = SeccompFilter::new(
        rules.into_iter().collect(),
        SeccompAction::Allow,
        SeccompAction::Errno(libc::EACCES as u32),
        arch,
    )
    .map_err(|e| format!("cannot build the seccomp filter: {e}"))?;
    filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| format!("cannot compile the seccomp filter: {e}"))
}
