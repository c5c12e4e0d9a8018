//! The process side of the tool sandbox: the runner's own binary re-executed as
//! `runner __tool-sandbox VERB PLAN`, single-threaded, without an async runtime.
//!
//! - `helper` runs outside the tool's sandbox, as the runner's user, non-dumpable (a tool
//!   of the same user cannot attach to it or read its memory). It becomes a child
//!   subreaper (so everything the call orphans — `setsid`, double forks — is re-parented to
//!   it), starts the `stage`, answers the stage's signal filter (a seccomp user
//!   notification per signal a tool sends, where Landlock's signal scope is missing; see
//!   `supervise`), waits for the stage, then kills and reaps every process the call left
//!   behind. It does the same when told to stop (SIGTERM, SIGINT, SIGHUP: a timeout, an
//!   interrupt, a dropped call) and when the runner dies (its parent-death signal).
//! - `stage` is the tool's side: it enters the workspace, becomes its own process group,
//!   sets the rlimits, drops to the tool user, applies the plan's mechanisms (Landlock at
//!   the plan's ABI, checked fully enforced; the refusal filter; the signal filter, whose
//!   listener it hands to the helper over its stdin, a socket) and execs `bash -c COMMAND`
//!   with stdin on /dev/null.
//! - `probe` applies every mechanism the node may have to itself, the way a stage does,
//!   then tries what a tool would (read the runner's secret files and its environment,
//!   open an internet socket), and prints a `ProbeReport` as JSON.

use std::collections::HashMap;
use std::convert::Infallible;
use std::ffi::OsString;
use std::io::{IoSlice, IoSliceMut};
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use landlock::{
    Access, AccessFs, AccessNet, CompatLevel, Compatible, PathBeneath, PathFd, Ruleset,
    RulesetAttr, RulesetCreated, RulesetCreatedAttr, RulesetStatus, Scope, ABI,
};
use nix::errno::Errno;
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::resource::{setrlimit, Resource};
use nix::sys::signal::{kill, raise, SigSet, Signal};
use nix::sys::signalfd::SignalFd;
use nix::sys::socket::{
    recvmsg, sendmsg, socket, socketpair, AddressFamily, ControlMessage, ControlMessageOwned,
    MsgFlags, SockFlag, SockType,
};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::{getpid, getppid, setgroups, setpgid, setresgid, setresuid, Gid, Pid, Uid};

use super::filter::{self, Refusals};
use super::kernel;
use super::protections::ProbeReport;
use super::supervise;
use super::{Plan, ToolNetwork, HELPER_ARG, SELF_EXE};

/// Readable and executable for tools, besides `--tool-read-path` (missing ones are skipped).
pub(super) const SYSTEM_DIRS: &[&str] = &[
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
        "helper" => helper(&plan, &parsed),
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

fn helper(plan_text: &str, plan: &Plan) -> Result<i32, String> {
    nix::sys::prctl::set_pdeathsig(Signal::SIGTERM)
        .map_err(|e| format!("cannot set the parent-death signal: {e}"))?;
    // Checked after the parent-death signal is set, so the runner cannot die unnoticed.
    if u32::try_from(getppid().as_raw()).ok() != Some(plan.runner) {
        return Err("the runner exited before the call started".into());
    }
    // A tool of the runner's own user must not attach to the helper, which is outside the
    // sandbox, nor read its memory.
    nix::sys::prctl::set_dumpable(false)
        .map_err(|e| format!("cannot make the helper non-dumpable: {e}"))?;
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
    let signal_fd =
        SignalFd::new(&signals).map_err(|e| format!("cannot read signals from a signalfd: {e}"))?;

    let mut stage = Command::new(SELF_EXE);
    stage.args([HELPER_ARG, "stage", plan_text]);
    // The stage hands the signal filter's listener back over its stdin, a socket.
    let channel = if plan.mechanisms.notify {
        let (ours, theirs) = socketpair(
            AddressFamily::Unix,
            SockType::Stream,
            None,
            SockFlag::SOCK_CLOEXEC,
        )
        .map_err(|e| format!("cannot make the listener's channel: {e}"))?;
        stage.stdin(Stdio::from(theirs));
        Some(ours)
    } else {
        None
    };
    let started = stage
        .spawn()
        .map_err(|e| format!("cannot start the tool: {e}"))?;
    // The stage's end went with it (the Command held the only copy of it here).
    drop(stage);
    let tool = Pid::from_raw(i32::try_from(started.id()).map_err(|e| e.to_string())?);
    // Blocks only until the stage sent the listener or ended (its end closes).
    let listener = channel.and_then(|channel| receive_listener(&channel));

    let outcome = supervise_until_done(tool, &signal_fd, listener);
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

/// The listener the stage sent, if it sent one before its end of the channel closed.
fn receive_listener(channel: &OwnedFd) -> Option<OwnedFd> {
    let mut byte = [0u8; 1];
    let mut iov = [IoSliceMut::new(&mut byte)];
    let mut space = nix::cmsg_space!(std::os::fd::RawFd);
    let message = recvmsg::<()>(
        channel.as_raw_fd(),
        &mut iov,
        Some(&mut space),
        MsgFlags::MSG_CMSG_CLOEXEC,
    )
    .ok()?;
    let mut fds = Vec::new();
    for cmsg in message.cmsgs().ok()? {
        if let ControlMessageOwned::ScmRights(received) = cmsg {
            fds.extend(received.into_iter().map(kernel::adopt_received));
        }
    }
    fds.into_iter().next()
}

/// Waits for the stage to end (or for the order to stop), answering the signal filter's
/// notifications meanwhile.
fn supervise_until_done(tool: Pid, signal_fd: &SignalFd, mut listener: Option<OwnedFd>) -> Outcome {
    let helper = getpid().as_raw();
    loop {
        let (signal_ready, listener_ready, listener_gone) = {
            let mut fds = vec![PollFd::new(signal_fd.as_fd(), PollFlags::POLLIN)];
            if let Some(listener) = &listener {
                fds.push(PollFd::new(listener.as_fd(), PollFlags::POLLIN));
            }
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) => {}
                Err(Errno::EINTR) => continue,
                // Cannot wait: stop the call rather than spin.
                Err(_) => return Outcome::Stopped,
            }
            let ready = |fd: &PollFd, flags| fd.revents().is_some_and(|r| r.intersects(flags));
            (
                ready(&fds[0], PollFlags::POLLIN),
                fds.get(1).is_some_and(|fd| ready(fd, PollFlags::POLLIN)),
                fds.get(1).is_some_and(|fd| {
                    ready(
                        fd,
                        PollFlags::POLLHUP | PollFlags::POLLERR | PollFlags::POLLNVAL,
                    )
                }),
            )
        };
        if listener_ready {
            if let Some(listener) = &listener {
                answer_one(helper, listener.as_raw_fd());
            }
        } else if listener_gone {
            // No process of the call holds the filter any more.
            listener = None;
        }
        if signal_ready {
            match signal_fd.read_signal() {
                Ok(Some(info)) if info.ssi_signo == Signal::SIGCHLD as u32 => {
                    if let Some(outcome) = reap_children(tool) {
                        return outcome;
                    }
                }
                Ok(Some(_)) => return Outcome::Stopped,
                Ok(None) | Err(_) => {}
            }
        }
    }
}

/// Takes one intercepted signal and lets it run only if it stays within the call.
fn answer_one(helper: i32, listener: std::os::fd::RawFd) {
    let Ok(call) = kernel::receive(listener) else {
        // The caller died or was interrupted before we read it.
        return;
    };
    let allowed = supervise::may_signal(helper, &call, &supervise::Proc);
    // What /proc said holds only while the caller still waits.
    let refuse = if allowed && kernel::still_waiting(listener, call.id) {
        None
    } else {
        Some(Errno::EPERM)
    };
    // ENOENT: the caller is gone meanwhile; nothing to answer.
    let _ = kernel::answer(listener, call.id, refuse);
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

/// The rlimits of a call (also tried by the probe).
fn set_limits(cpu_secs: u64) -> Result<(), String> {
    let cpu = cpu_secs.max(1);
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
    Ok(())
}

fn switch_user(plan: &Plan) -> Result<Option<u32>, String> {
    let Some(ids) = plan.user else {
        return Ok(None);
    };
    let (uid, gid) = (Uid::from_raw(ids.uid), Gid::from_raw(ids.gid));
    setgroups(&[]).map_err(|e| format!("cannot drop supplementary groups: {e}"))?;
    setresgid(gid, gid, gid).map_err(|e| format!("cannot switch to group {gid}: {e}"))?;
    setresuid(uid, uid, uid).map_err(|e| format!("cannot switch to user {uid}: {e}"))?;
    Ok(Some(ids.uid))
}

/// Restricts this process with `ruleset` and checks that the kernel enforces all of
/// `abi`'s rights: a ruleset only partly enforced (or a blocked syscall) is an error, never
/// a silent pass.
fn restrict(ruleset: RulesetCreated, abi: i32) -> Result<(), String> {
    let status = ruleset
        .restrict_self()
        .map_err(|e| format!("Landlock refused the ruleset: {e}"))?;
    match status.ruleset {
        RulesetStatus::FullyEnforced => Ok(()),
        other => Err(format!(
            "Landlock enforced the ruleset only {other:?} at ABI {abi} ({:?})",
            status.landlock
        )),
    }
}

fn stage(plan: &Plan) -> Result<Infallible, String> {
    std::env::set_current_dir(&plan.workspace).map_err(|e| {
        format!(
            "cannot enter the workspace {}: {e}",
            plan.workspace.display()
        )
    })?;
    // Its own process group: a tool's `kill 0` then reaches the call, not its helper.
    setpgid(Pid::from_raw(0), Pid::from_raw(0))
        .map_err(|e| format!("cannot start a process group: {e}"))?;
    set_limits(plan.cpu_secs)?;
    // The ruleset's paths are opened while still the runner's user, who reaches them all.
    let mechanisms = plan.mechanisms;
    let ruleset = mechanisms
        .landlock_abi
        .map(|abi| ruleset(plan, &plan.workspace, abi).map(|ruleset| (ruleset, abi)))
        .transpose()
        .map_err(|e| format!("cannot build the Landlock ruleset: {e}"))?;
    let refusals = mechanisms
        .refusals
        .map(filter::refusal_filter)
        .transpose()?;
    let signals = mechanisms.notify.then(filter::signal_filter).transpose()?;
    switch_user(plan)?;
    SigSet::empty()
        .thread_set_mask()
        .map_err(|e| format!("cannot reset the signal mask: {e}"))?;
    if let Some((ruleset, abi)) = ruleset {
        restrict(ruleset, abi)?;
    }
    if let Some(program) = refusals {
        seccompiler::apply_filter(&program)
            .map_err(|e| format!("cannot install the seccomp filter: {e}"))?;
    }
    if let Some(program) = signals {
        nix::sys::prctl::set_no_new_privs().map_err(|e| format!("cannot set no_new_privs: {e}"))?;
        let listener = kernel::install_filter_with_listener(&program)
            .map_err(|e| format!("cannot install the seccomp signal filter: {e}"))?;
        let stdin = std::io::stdin();
        sendmsg::<()>(
            stdin.as_fd().as_raw_fd(),
            &[IoSlice::new(b"L")],
            &[ControlMessage::ScmRights(&[listener.as_raw_fd()])],
            MsgFlags::empty(),
            None,
        )
        .map_err(|e| format!("cannot hand the signal filter to the helper: {e}"))?;
        // The helper holds it now; bash must not (it would answer its own calls).
        drop(listener);
    }
    let error = Command::new("bash")
        .arg("-c")
        .arg(&plan.command)
        .stdin(Stdio::null())
        .exec();
    Err(format!("cannot start bash: {error}"))
}

/// What the probe found, printed as JSON on stdout.
fn probe(plan: &Plan) -> Result<i32, String> {
    let probe = plan.probe.as_ref().ok_or("a probe needs its request")?;
    let release = nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_default();
    let cmdline = std::fs::read_to_string("/proc/cmdline").unwrap_or_default();
    let gvisor = release.contains("gvisor") || cmdline.contains("gvisor");
    let landlock_kernel = kernel::landlock_abi().map_err(errno_name);
    let landlock_requested = landlock_kernel
        .as_ref()
        .ok()
        .map(|&abi| probe.max_abi.map_or(abi, |max| abi.min(max)))
        .filter(|&abi| abi >= 1);
    let subreaper = nix::sys::prctl::set_child_subreaper(true).map_err(|e| e.to_string());
    let rlimits = set_limits(1);
    let separate_uid = plan
        .user
        .map(|_| switch_user(plan).map(|uid| uid.unwrap_or_default()));
    let (landlock_enforced, seccomp, notify) = if probe.confine {
        let landlock_enforced = match landlock_requested {
            Some(abi) => ruleset(plan, &plan.workspace, abi)
                .map_err(|e| format!("cannot build the Landlock ruleset: {e}"))
                .and_then(|ruleset| restrict(ruleset, abi))
                .and_then(|()| {
                    // A rule the kernel took but does not apply would leave /proc open.
                    match std::fs::read_dir("/proc/self/fd") {
                        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => Ok(()),
                        Err(e) => Err(format!("/proc/self/fd: {e}")),
                        Ok(_) => Err("/proc is still readable under the ruleset".into()),
                    }
                }),
            None => Err("not tried".into()),
        };
        let all = Refusals {
            network: true,
            ptrace: true,
            truncate: true,
            sigio_owner: true,
        };
        let seccomp = filter::refusal_filter(all).and_then(|program| {
            seccompiler::apply_filter(&program).map_err(|e| e.to_string())?;
            match socket(
                AddressFamily::Inet,
                SockType::Stream,
                SockFlag::empty(),
                None,
            ) {
                Err(Errno::EPERM) => Ok(()),
                Err(e) => Err(format!("socket(AF_INET) failed with {e}, not EPERM")),
                Ok(_) => Err("the filter let socket(AF_INET) through".into()),
            }
        });
        let notify = filter::signal_filter().and_then(|program| {
            nix::sys::prctl::set_no_new_privs().map_err(errno_name)?;
            kernel::install_filter_with_listener(&program)
                .map(drop)
                .map_err(errno_name)
        });
        (landlock_enforced, seccomp, notify)
    } else {
        let off = || Err("--sandbox off".to_string());
        (off(), off(), off())
    };
    let readable_secret_files = probe
        .secret_files
        .iter()
        .filter(|file| std::fs::File::open(file).is_ok())
        .map(|file| file.display().to_string())
        .collect();
    let runner_environ_readable = std::fs::read(format!("/proc/{}/environ", plan.runner)).is_ok();
    let report = ProbeReport {
        landlock_kernel,
        landlock_requested,
        landlock_enforced,
        separate_uid,
        seccomp,
        notify,
        subreaper,
        rlimits,
        readable_secret_files,
        runner_environ_readable,
        gvisor,
    };
    println!(
        "{}",
        serde_json::to_string(&report).map_err(|e| e.to_string())?
    );
    Ok(0)
}

fn errno_name(errno: Errno) -> String {
    format!("{errno:?}")
}

/// Read and execute on the system directories and `--tool-read-path`s, read and write on a
/// few devices, everything on the workspace; nothing else. With no network (ABI 4+), TCP
/// bind and connect are handled with no port allowed. From ABI 6, signals and abstract Unix
/// sockets reach only processes inside the same sandbox. Only `abi`'s rights are asked for.
fn ruleset(
    plan: &Plan,
    workspace: &Path,
    abi: i32,
) -> Result<RulesetCreated, Box<dyn std::error::Error>> {
    let abi = ABI::from(abi);
    let mut ruleset = Ruleset::default()
        .set_compatibility(CompatLevel::HardRequirement)
        .handle_access(AccessFs::from_all(abi))?;
    if plan.network == ToolNetwork::None && abi >= ABI::V4 {
        ruleset = ruleset.handle_access(AccessNet::from_all(abi))?;
    }
    if abi >= ABI::V6 {
        ruleset = ruleset.scope(Scope::from_all(abi))?;
    }
    let mut created = ruleset.create()?;
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
    let workspace = PathFd::new(workspace)?;
    Ok(created.add_rule(PathBeneath::new(workspace, AccessFs::from_all(abi)))?)
}
