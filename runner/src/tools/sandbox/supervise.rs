//! The helper's verdict on a signal a tool process tries to send, where Landlock's signal
//! scope (ABI 6) is missing: the signal may go only to processes of the same call, that
//! is to strict descendants of the call's helper (orphans come back to it as the child
//! subreaper, so every process of the call is one). Not the helper itself, not the runner,
//! not another call's processes; `kill(-1, …)` never.
//!
//! The targets are read from /proc while the caller waits; the call then runs in the
//! caller's own context. A target that exits and whose pid is handed to a new process in
//! between is the one gap: pids are not reused that fast, and the kernel's pid allocator
//! cycles through the whole range first.

use std::path::PathBuf;

use nix::libc;

use super::kernel::Notification;

/// What the verdict needs to know about processes.
pub trait Processes {
    /// The parent of `pid` (a thread id gives its process's parent); `None` if it is gone.
    fn parent(&self, pid: i32) -> Option<i32>;
    /// The process group of `pid`.
    fn group(&self, pid: i32) -> Option<i32>;
    /// Every process in the process group `pgid`.
    fn members(&self, pgid: i32) -> Vec<i32>;
    /// The process the descriptor `fd` of `pid` refers to (a pidfd or a `/proc/<pid>`
    /// directory); `None` if it refers to none or cannot be read.
    fn pidfd_target(&self, pid: i32, fd: i32) -> Option<i32>;
}

/// Whether the intercepted call may run: every process it would signal is a strict
/// descendant of `helper`.
pub fn may_signal(helper: i32, call: &Notification, procs: &impl Processes) -> bool {
    let caller = call.pid as i32;
    // The first argument is a pid or descriptor, an int in the kernel's signature.
    let first = call.args[0] as u32 as i32;
    let below = |pid: i32| is_descendant(helper, pid, procs);
    let group = |pgid: i32| procs.members(pgid).into_iter().all(below);
    match call.syscall {
        libc::SYS_kill => match first {
            pid if pid > 0 => below(pid),
            0 => procs.group(caller).is_some_and(group),
            -1 => false,
            pid => pid.checked_neg().is_some_and(group),
        },
        libc::SYS_tkill
        | libc::SYS_tgkill
        | libc::SYS_rt_sigqueueinfo
        | libc::SYS_rt_tgsigqueueinfo => first > 0 && below(first),
        libc::SYS_pidfd_send_signal => procs.pidfd_target(caller, first).is_some_and(below),
        _ => false,
    }
}

fn is_descendant(helper: i32, pid: i32, procs: &impl Processes) -> bool {
    let mut current = pid;
    // A bound on the walk, in case /proc changes under it into a loop.
    for _ in 0..4096 {
        if current == helper {
            return current != pid;
        }
        match procs.parent(current) {
            Some(parent) if parent > 0 => current = parent,
            _ => return false,
        }
    }
    false
}

/// The live /proc.
pub struct Proc;

impl Proc {
    /// Fields 4 and 5 of `/proc/<pid>/stat` (ppid, pgrp); comm may hold spaces and
    /// parentheses, so fields are counted after its last `)`.
    fn stat(pid: i32) -> Option<(i32, i32)> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let mut fields = stat.rsplit_once(')')?.1.split_whitespace().skip(1);
        let ppid = fields.next()?.parse().ok()?;
        let pgrp = fields.next()?.parse().ok()?;
        Some((ppid, pgrp))
    }
}

impl Processes for Proc {
    fn parent(&self, pid: i32) -> Option<i32> {
        Proc::stat(pid).map(|(ppid, _)| ppid)
    }

    fn group(&self, pid: i32) -> Option<i32> {
        Proc::stat(pid).map(|(_, pgrp)| pgrp)
    }

    fn members(&self, pgid: i32) -> Vec<i32> {
        std::fs::read_dir("/proc")
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|entry| entry.file_name().to_str()?.parse::<i32>().ok())
            .filter(|&pid| Proc::stat(pid).is_some_and(|(_, pgrp)| pgrp == pgid))
            .collect()
    }

    fn pidfd_target(&self, pid: i32, fd: i32) -> Option<i32> {
        if fd < 0 {
            return None;
        }
        // A pidfd: its fdinfo names the process.
        let fdinfo = std::fs::read_to_string(format!("/proc/{pid}/fdinfo/{fd}")).ok()?;
        if let Some(target) = fdinfo
            .lines()
            .find_map(|line| line.strip_prefix("Pid:"))
            .and_then(|value| value.trim().parse::<i32>().ok())
        {
            return Some(target);
        }
        // A /proc/<pid> directory, which pidfd_send_signal also accepts.
        let link: PathBuf = std::fs::read_link(format!("/proc/{pid}/fd/{fd}")).ok()?;
        let mut parts = link.strip_prefix("/proc").ok()?.iter();
        let target = parts.next()?.to_str()?.parse().ok()?;
        parts.next().is_none().then_some(target)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// pid → (ppid, pgrp), and (pid, fd) → target.
    struct Table(HashMap<i32, (i32, i32)>, HashMap<(i32, i32), i32>);

    impl Processes for Table {
        fn parent(&self, pid: i32) -> Option<i32> {
            self.0.get(&pid).map(|p| p.0)
        }
        fn group(&self, pid: i32) -> Option<i32> {
            self.0.get(&pid).map(|p| p.1)
        }
        fn members(&self, pgid: i32) -> Vec<i32> {
            self.0
                .iter()
                .filter(|(_, p)| p.1 == pgid)
                .map(|(pid, _)| *pid)
                .collect()
        }
        fn pidfd_target(&self, pid: i32, fd: i32) -> Option<i32> {
            self.1.get(&(pid, fd)).copied()
        }
    }

    fn call(syscall: i64, first: i64, caller: u32) -> Notification {
        Notification {
            id: 1,
            pid: caller,
            syscall,
            args: [first as u64, 9, 0, 0, 0, 0],
        }
    }

    #[test]
    fn only_the_calls_own_processes_can_be_signalled() {
        // 1 runner (pgrp 1) → 10 helper (pgrp 10) → 11 stage/bash (pgrp 11) → 12, 13 (pgrp 11);
        // 13 moved itself into pgrp 20, the group of another call: 1 → 20 helper → 21 bash.
        let procs = Table(
            HashMap::from([
                (1, (0, 1)),
                (10, (1, 10)),
                (11, (10, 11)),
                (12, (11, 11)),
                (13, (11, 20)),
                (20, (1, 20)),
                (21, (20, 20)),
            ]),
            HashMap::from([((12, 3), 11), ((12, 4), 1)]),
        );
        let helper = 10;
        let allowed =
            |syscall, first, caller| may_signal(helper, &call(syscall, first, caller), &procs);
        assert!(allowed(libc::SYS_kill, 12, 11));
        assert!(allowed(libc::SYS_kill, 0, 12), "its own group");
        assert!(allowed(libc::SYS_kill, -11, 12));
        assert!(allowed(libc::SYS_tgkill, 13, 12));
        assert!(allowed(libc::SYS_pidfd_send_signal, 3, 12));
        assert!(!allowed(libc::SYS_kill, 1, 11), "the runner");
        assert!(!allowed(libc::SYS_kill, 10, 11), "the helper");
        assert!(!allowed(libc::SYS_kill, 21, 11), "another call");
        assert!(!allowed(libc::SYS_kill, -1, 11), "everyone");
        assert!(!allowed(libc::SYS_kill, -20, 11), "another call's group");
        assert!(!allowed(libc::SYS_kill, 0, 13), "the group it joined");
        assert!(!allowed(libc::SYS_kill, 999, 11), "a process that is gone");
        assert!(!allowed(libc::SYS_tkill, 1, 11));
        assert!(!allowed(libc::SYS_rt_sigqueueinfo, 20, 11));
        assert!(
            !allowed(libc::SYS_pidfd_send_signal, 4, 12),
            "a pidfd of the runner"
        );
        assert!(
            !allowed(libc::SYS_pidfd_send_signal, 5, 12),
            "an unknown descriptor"
        );
    }

    #[test]
    fn the_live_proc_finds_children_groups_and_pidfds() {
        use std::os::fd::AsRawFd;
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .expect("sleep");
        let me = std::process::id() as i32;
        let kid = child.id() as i32;
        let parent = Proc.parent(me).expect("our parent");
        let allowed = |first: i64| may_signal(me, &call(libc::SYS_kill, first, me as u32), &Proc);
        assert!(allowed(i64::from(kid)), "our child is below us");
        assert!(!allowed(i64::from(me)), "we are not below ourselves");
        assert!(!allowed(i64::from(parent)), "our parent is not below us");
        assert!(Proc.members(Proc.group(me).expect("group")).contains(&me));
        let pidfd = std::fs::File::open(format!("/proc/{kid}")).expect("a /proc directory");
        assert_eq!(Proc.pidfd_target(me, pidfd.as_raw_fd()), Some(kid));
        let _ = child.kill();
        let _ = child.wait();
    }
}
