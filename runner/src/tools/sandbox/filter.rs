//! The seccomp filters of a tool call, built for what Landlock does not already enforce on
//! this node (see `protections`):
//!
//! - the **refusal filter** fails with EPERM: `socket()` of any family but `AF_UNIX`
//!   (`--tool-network none`), io_uring (which would run calls past the filter), and where
//!   needed `ptrace`/`process_vm_readv`/`process_vm_writev`/`pidfd_getfd` (no Landlock),
//!   path `truncate` (Landlock below ABI 3 does not handle it), and the ways to aim SIGIO
//!   at another process (`F_SETOWN`, `FIOSETOWN`, `SIOCSPGRP`; below ABI 6);
//! - the **signal filter** (below ABI 6) hands every signal-sending call (`kill`, `tkill`,
//!   `tgkill`, `rt_sigqueueinfo`, `rt_tgsigqueueinfo`, `pidfd_send_signal`) to the call's
//!   helper through a seccomp user-notification listener; the helper lets it run only when
//!   it targets processes of the same call (`supervise`).

use nix::libc;
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
    SeccompRule,
};
use serde::{Deserialize, Serialize};

/// Which refusals a call's filter holds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refusals {
    /// Every socket family but `AF_UNIX`.
    pub network: bool,
    /// `ptrace`, `process_vm_readv`, `process_vm_writev`, `pidfd_getfd`.
    pub ptrace: bool,
    /// Path `truncate(2)`.
    pub truncate: bool,
    /// `F_SETOWN`, `F_SETOWN_EX`, `FIOSETOWN`, `SIOCSPGRP`.
    pub sigio_owner: bool,
}

/// `fcntl` and `ioctl` commands the libc crate does not name (asm-generic values, as on
/// x86_64 and aarch64).
const F_SETOWN_EX: u64 = 15;
const FIOSETOWN: u64 = 0x8901;
const SIOCSPGRP: u64 = 0x8902;

/// The tag the signal filter's calls carry before they become user notifications
/// (seccompiler has no user-notification action; [`signal_filter`] rewrites it).
const NOTIFY_TAG: u32 = 0x5167;

/// The signal-sending system calls the helper vets.
pub const SIGNAL_CALLS: &[i64] = &[
    libc::SYS_kill,
    libc::SYS_tkill,
    libc::SYS_tgkill,
    libc::SYS_rt_sigqueueinfo,
    libc::SYS_rt_tgsigqueueinfo,
    libc::SYS_pidfd_send_signal,
];

fn arch() -> Result<seccompiler::TargetArch, String> {
    std::env::consts::ARCH
        .try_into()
        .map_err(|e| format!("no seccomp support for this architecture: {e:?}"))
}

fn arg_is(index: u8, op: SeccompCmpOp, value: u64) -> Result<SeccompRule, String> {
    let condition = SeccompCondition::new(index, SeccompCmpArgLen::Dword, op, value)
        .map_err(|e| e.to_string())?;
    SeccompRule::new(vec![condition]).map_err(|e| e.to_string())
}

fn compile(
    rules: Vec<(i64, Vec<SeccompRule>)>,
    action: SeccompAction,
) -> Result<BpfProgram, String> {
    let filter = SeccompFilter::new(
        rules.into_iter().collect(),
        SeccompAction::Allow,
        action,
        arch()?,
    )
    .map_err(|e| format!("cannot build the seccomp filter: {e}"))?;
    filter
        .try_into()
        .map_err(|e: seccompiler::BackendError| format!("cannot compile the seccomp filter: {e}"))
}

/// The refusal filter (EPERM); io_uring is always refused.
pub fn refusal_filter(refusals: Refusals) -> Result<BpfProgram, String> {
    let mut rules: Vec<(i64, Vec<SeccompRule>)> = vec![
        (libc::SYS_io_uring_setup, vec![]),
        (libc::SYS_io_uring_enter, vec![]),
        (libc::SYS_io_uring_register, vec![]),
    ];
    if refusals.network {
        rules.push((
            libc::SYS_socket,
            vec![arg_is(0, SeccompCmpOp::Ne, libc::AF_UNIX as u64)?],
        ));
    }
    if refusals.ptrace {
        for call in [
            libc::SYS_ptrace,
            libc::SYS_process_vm_readv,
            libc::SYS_process_vm_writev,
            libc::SYS_pidfd_getfd,
        ] {
            rules.push((call, vec![]));
        }
    }
    if refusals.truncate {
        rules.push((libc::SYS_truncate, vec![]));
    }
    if refusals.sigio_owner {
        rules.push((
            libc::SYS_fcntl,
            vec![
                arg_is(1, SeccompCmpOp::Eq, libc::F_SETOWN as u64)?,
                arg_is(1, SeccompCmpOp::Eq, F_SETOWN_EX)?,
            ],
        ));
        rules.push((
            libc::SYS_ioctl,
            vec![
                arg_is(1, SeccompCmpOp::Eq, FIOSETOWN)?,
                arg_is(1, SeccompCmpOp::Eq, SIOCSPGRP)?,
            ],
        ));
    }
    compile(rules, SeccompAction::Errno(libc::EPERM as u32))
}

/// The signal filter: every call of [`SIGNAL_CALLS`] waits for the helper's verdict.
pub fn signal_filter() -> Result<BpfProgram, String> {
    let rules = SIGNAL_CALLS.iter().map(|&call| (call, vec![])).collect();
    let mut program = compile(rules, SeccompAction::Trace(NOTIFY_TAG))?;
    let tagged = libc::SECCOMP_RET_TRACE | NOTIFY_TAG;
    let mut rewritten = 0;
    for instruction in &mut program {
        // BPF_RET | BPF_K: return the constant `k`.
        if instruction.code == 0x06 && instruction.k == tagged {
            instruction.k = libc::SECCOMP_RET_USER_NOTIF;
            rewritten += 1;
        }
    }
    if rewritten == 0 {
        return Err("the signal filter has no user-notification return".into());
    }
    Ok(program)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn filters_compile_and_the_signal_filter_notifies() {
        let all = Refusals {
            network: true,
            ptrace: true,
            truncate: true,
            sigio_owner: true,
        };
        assert!(
            refusal_filter(all).expect("compiles").len()
                > refusal_filter(Refusals::default()).expect("compiles").len()
        );
        let program = signal_filter().expect("compiles");
        assert!(program
            .iter()
            .any(|i| i.code == 0x06 && i.k == libc::SECCOMP_RET_USER_NOTIF));
        assert!(!program
            .iter()
            .any(|i| i.code == 0x06 && i.k & 0xffff0000 == libc::SECCOMP_RET_TRACE));
    }
}
