//! The few kernel calls of the sandbox that no safe wrapper offers: the Landlock ABI probe
//! (the raw syscall, so that a seccomp profile's EPERM is told apart from a kernel without
//! Landlock), a seccomp filter installed with a user-notification listener, and the
//! listener's receive/answer ioctls.
//!
//! Every `unsafe` block of the runner is here; each passes only pointers to live, correctly
//! sized values the kernel copies from or into.
#![allow(unsafe_code)]

use std::os::fd::{FromRawFd, OwnedFd, RawFd};

use nix::errno::Errno;
use nix::libc;
use seccompiler::BpfProgram;

/// `landlock_create_ruleset(NULL, 0, LANDLOCK_CREATE_RULESET_VERSION)`: the kernel's
/// Landlock ABI version, or why there is none: `ENOSYS` (not built in, or gVisor),
/// `EOPNOTSUPP` (built in, not enabled at boot), `EPERM` (blocked, e.g. by a container
/// runtime's seccomp profile).
pub fn landlock_abi() -> Result<i32, Errno> {
    const LANDLOCK_CREATE_RULESET_VERSION: libc::c_uint = 1;
    // SAFETY: a null attribute pointer with size 0 is the documented form of this query;
    // the kernel reads no memory for it.
    let answer = unsafe {
        libc::syscall(
            libc::SYS_landlock_create_ruleset,
            std::ptr::null::<libc::c_void>(),
            0usize,
            LANDLOCK_CREATE_RULESET_VERSION,
        )
    };
    if answer < 0 {
        Err(Errno::last())
    } else {
        Ok(answer as i32)
    }
}

/// Installs `program` (no_new_privs must be set) with `SECCOMP_FILTER_FLAG_NEW_LISTENER`:
/// its `SECCOMP_RET_USER_NOTIF` answers wait for whoever holds the returned listener.
pub fn install_filter_with_listener(program: &BpfProgram) -> Result<OwnedFd, Errno> {
    let len = u16::try_from(program.len()).map_err(|_| Errno::EINVAL)?;
    let fprog = libc::sock_fprog {
        len,
        // seccompiler's sock_filter has the kernel's layout (u16, u8, u8, u32).
        filter: program.as_ptr() as *mut libc::sock_filter,
    };
    // SAFETY: `fprog` points at `program`, alive for the call; the kernel copies it.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_seccomp,
            libc::SECCOMP_SET_MODE_FILTER,
            libc::SECCOMP_FILTER_FLAG_NEW_LISTENER,
            &fprog as *const libc::sock_fprog,
        )
    };
    if fd < 0 {
        return Err(Errno::last());
    }
    // SAFETY: the kernel just returned this descriptor to us; nothing else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// One intercepted system call, as the listener reports it.
#[derive(Debug, Clone, Copy)]
pub struct Notification {
    pub id: u64,
    /// The calling thread's id, in the listener's pid namespace.
    pub pid: u32,
    pub syscall: i64,
    pub args: [u64; 6],
}

/// Takes the next intercepted call (blocks until there is one; poll first).
pub fn receive(listener: RawFd) -> Result<Notification, Errno> {
    // SAFETY: all-zero is a valid seccomp_notif (plain integers), and the kernel requires
    // the buffer zeroed.
    let mut notif: libc::seccomp_notif = unsafe { std::mem::zeroed() };
    // SAFETY: `notif` is a live seccomp_notif the ioctl fills.
    let rc = unsafe {
        libc::ioctl(
            listener,
            libc::SECCOMP_IOCTL_NOTIF_RECV,
            &mut notif as *mut libc::seccomp_notif,
        )
    };
    if rc < 0 {
        return Err(Errno::last());
    }
    let mut args = [0u64; 6];
    args.copy_from_slice(&notif.data.args);
    Ok(Notification {
        id: notif.id,
        pid: notif.pid,
        syscall: i64::from(notif.data.nr),
        args,
    })
}

/// Whether the call `id` is still waiting (its caller did not die or get interrupted):
/// what was read about it in /proc meanwhile still describes the caller.
pub fn still_waiting(listener: RawFd, id: u64) -> bool {
    let mut id = id;
    // SAFETY: the ioctl reads one u64 from the live `id`.
    unsafe {
        libc::ioctl(
            listener,
            libc::SECCOMP_IOCTL_NOTIF_ID_VALID,
            &mut id as *mut u64,
        ) == 0
    }
}

/// Answers the call `id`: let it run as the caller asked (`None`), or fail it with `errno`.
pub fn answer(listener: RawFd, id: u64, refuse: Option<Errno>) -> Result<(), Errno> {
    let resp = libc::seccomp_notif_resp {
        id,
        val: 0,
        error: refuse.map_or(0, |errno| -(errno as i32)),
        flags: if refuse.is_none() {
            libc::SECCOMP_USER_NOTIF_FLAG_CONTINUE as u32
        } else {
            0
        },
    };
    // SAFETY: `resp` is a live seccomp_notif_resp the ioctl reads.
    let rc = unsafe {
        libc::ioctl(
            listener,
            libc::SECCOMP_IOCTL_NOTIF_SEND,
            &resp as *const libc::seccomp_notif_resp,
        )
    };
    if rc < 0 {
        Err(Errno::last())
    } else {
        Ok(())
    }
}

/// Takes ownership of a descriptor the kernel just installed in this process (received
/// with `SCM_RIGHTS`).
pub fn adopt_received(fd: RawFd) -> OwnedFd {
    // SAFETY: recvmsg just created this descriptor for us; nothing else refers to it.
    unsafe { OwnedFd::from_raw_fd(fd) }
}
