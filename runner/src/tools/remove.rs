//! Removing a directory tree a tool wrote (a deleted session's workspace, a restore's
//! leftovers).
//!
//! Promises:
//! - No symbolic link is followed, anywhere: every step is taken relative to a directory
//!   already open, and a directory is opened with `O_NOFOLLOW`, so a link a tool planted
//!   (even one swapped in mid-removal) is unlinked itself and what it points at is left
//!   alone.
//! - Depth costs memory, not stack or file descriptors: the walk keeps one directory open
//!   (two while it climbs), and climbs by `..`, checked against the device and inode it
//!   noted on the way down. A tree moved about while it is removed stops the removal with
//!   an error rather than leading it elsewhere.
//! - A directory a tool made unwritable or unreadable (`chmod 000`) is given back to its
//!   owner first, when that is this process's user (root needs no such help).
//! - Another remover working on the same tree at the same time is no error: what is
//!   already gone is done. A writer adding entries meanwhile is outlasted for a while
//!   ([`REFILLS`]), then reported.

use std::ffi::{OsStr, OsString};
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use nix::dir::{Dir, Type};
use nix::errno::Errno;
use nix::fcntl::{open, openat, OFlag};
use nix::sys::stat::{fstat, Mode};
use nix::unistd::{unlinkat, UnlinkatFlags};

/// How many times a directory found refilled as it was about to go is emptied again.
const REFILLS: u32 = 64;

/// Removes `path` and everything under it, without following a symbolic link (a link at
/// `path` itself is removed, not its target). Nothing there is no error. Blocking.
pub fn remove_tree(path: &Path) -> io::Result<()> {
    let meta = match std::fs::symlink_metadata(path) {
        Ok(meta) => meta,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    if !meta.is_dir() {
        return gone_is_done(std::fs::remove_file(path));
    }
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{} names no entry of a directory", path.display()),
        ));
    };
    let parent = if parent.as_os_str().is_empty() {
        Path::new(".")
    } else {
        parent
    };
    let top = open(
        parent,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    remove_at(top, name)
        .map_err(|e| io::Error::new(e.kind(), format!("cannot remove {}: {e}", path.display())))
}

fn gone_is_done(result: io::Result<()>) -> io::Result<()> {
    match result {
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        other => other,
    }
}

/// A directory on the way down: its name in its parent, its identity, and the
/// subdirectories still to empty.
struct Level {
    name: OsString,
    id: (u64, u64),
    subdirs: Vec<OsString>,
}

fn identity(fd: impl AsFd) -> nix::Result<(u64, u64)> {
    let stat = fstat(fd)?;
    Ok((stat.st_dev as u64, stat.st_ino as u64))
}

/// Removes the directory `name` of the directory `top`.
fn remove_at(top: OwnedFd, name: &OsStr) -> io::Result<()> {
    let mut refills = REFILLS;
    // Level 0 stands for `top` itself, with `name` its one subdirectory to remove.
    let mut stack = vec![Level {
        name: OsString::new(),
        id: identity(&top)?,
        subdirs: vec![name.to_os_string()],
    }];
    let mut current = top;
    loop {
        let Some(level) = stack.last_mut() else {
            return Ok(());
        };
        if let Some(child) = level.subdirs.pop() {
            if let Some((fd, entered)) = enter(&current, &child)? {
                current = fd;
                stack.push(entered);
            }
            continue;
        }
        let Some(done) = stack.pop() else {
            return Ok(());
        };
        let Some(parent) = stack.last_mut() else {
            // Level 0 has nothing left: the tree is gone.
            return Ok(());
        };
        let up = openat(
            &current,
            "..",
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
            Mode::empty(),
        )?;
        if identity(&up)? != parent.id {
            return Err(io::Error::other(
                "a directory was moved while it was being removed",
            ));
        }
        current = up;
        match unlinkat(&current, done.name.as_os_str(), UnlinkatFlags::RemoveDir) {
            Ok(()) | Err(Errno::ENOENT) => {}
            Err(Errno::ENOTEMPTY | Errno::EEXIST) if refills > 0 => {
                // Written into since it was listed: empty it again.
                refills -= 1;
                parent.subdirs.push(done.name);
            }
            Err(Errno::ENOTEMPTY | Errno::EEXIST) => {
                return Err(io::Error::other(
                    "something kept writing into the tree while it was being removed",
                ))
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Opens the directory `name` of `dir` without following a link, makes it writable by its
/// owner when that is us, unlinks every entry that is not a directory and lists the
/// directories. `None` if it is gone or turned out not to be a directory (then it was
/// unlinked).
fn enter(dir: &OwnedFd, name: &OsStr) -> io::Result<Option<(OwnedFd, Level)>> {
    let opened = openat(
        dir,
        name,
        OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    );
    let fd = match opened {
        Ok(fd) => fd,
        Err(Errno::ENOENT) => return Ok(None),
        // A link, or swapped for a file since it was listed: it goes as it is.
        Err(Errno::ENOTDIR | Errno::ELOOP) => {
            return match unlinkat(dir, name, UnlinkatFlags::NoRemoveDir) {
                Ok(()) | Err(Errno::ENOENT) => Ok(None),
                Err(e) => Err(e.into()),
            }
        }
        Err(e) => return Err(e.into()),
    };
    let stat = fstat(&fd)?;
    let me = nix::unistd::geteuid();
    if !me.is_root() && stat.st_uid == me.as_raw() && stat.st_mode & 0o700 != 0o700 {
        // The O_PATH descriptor names this very directory: chmod through it follows no link.
        let by_fd = format!("/proc/self/fd/{}", fd.as_raw_fd());
        let mode = (stat.st_mode & 0o7777) | 0o700;
        nix::sys::stat::fchmodat(
            nix::fcntl::AT_FDCWD,
            by_fd.as_str(),
            Mode::from_bits_truncate(mode),
            nix::sys::stat::FchmodatFlags::FollowSymlink,
        )?;
    }
    let mut listing = Dir::openat(
        &fd,
        ".",
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    let mut subdirs = Vec::new();
    for entry in listing.iter() {
        let entry = entry?;
        let entry_name = OsStr::from_bytes(entry.file_name().to_bytes());
        if entry_name == "." || entry_name == ".." {
            continue;
        }
        if entry.file_type() == Some(Type::Directory) {
            subdirs.push(entry_name.to_os_string());
            continue;
        }
        match unlinkat(&fd, entry_name, UnlinkatFlags::NoRemoveDir) {
            Ok(()) | Err(Errno::ENOENT) => {}
            // A directory after all (the file system gives no type, or it was swapped).
            Err(Errno::EISDIR | Errno::EPERM) => subdirs.push(entry_name.to_os_string()),
            Err(e) => return Err(e.into()),
        }
    }
    let id = (stat.st_dev as u64, stat.st_ino as u64);
    Ok(Some((
        fd,
        Level {
            name: name.to_os_string(),
            id,
            subdirs,
        },
    )))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::{symlink, PermissionsExt};

    use super::*;

    #[test]
    fn a_tree_goes_and_no_link_in_it_is_followed() {
        let root = tempfile::tempdir().expect("temp dir");
        let outside = root.path().join("outside");
        std::fs::create_dir_all(outside.join("keep")).expect("mkdir");
        std::fs::write(outside.join("keep/file"), "kept").expect("write");
        let tree = root.path().join("ws");
        std::fs::create_dir_all(tree.join("a/b/c")).expect("mkdir");
        std::fs::write(tree.join("a/b/c/f"), "x").expect("write");
        std::fs::write(tree.join("top"), "y").expect("write");
        symlink(&outside, tree.join("a/to_outside")).expect("symlink");
        symlink(outside.join("keep/file"), tree.join("a/b/to_file")).expect("symlink");
        symlink("../../..", tree.join("a/b/up")).expect("symlink");
        nix::unistd::mkfifo(&tree.join("fifo"), Mode::from_bits_truncate(0o600)).expect("fifo");
        remove_tree(&tree).expect("removed");
        assert!(!tree.exists());
        assert_eq!(
            std::fs::read_to_string(outside.join("keep/file")).expect("kept"),
            "kept"
        );
        // Nothing there is done already; a link at the top goes itself.
        remove_tree(&tree).expect("nothing to remove");
        symlink(&outside, &tree).expect("symlink");
        remove_tree(&tree).expect("the link goes");
        assert!(outside.join("keep/file").exists() && !tree.exists());
    }

    #[test]
    fn depth_and_breadth_cost_neither_stack_nor_descriptors() {
        let root = tempfile::tempdir().expect("temp dir");
        let tree = root.path().join("deep");
        std::fs::create_dir(&tree).expect("mkdir");
        // Deeper than any path the kernel takes in one call, made one level at a time.
        let mut dir = open(
            &tree,
            OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
            Mode::empty(),
        )
        .expect("open");
        for _ in 0..3000 {
            nix::sys::stat::mkdirat(&dir, "d", Mode::from_bits_truncate(0o755)).expect("mkdirat");
            dir = openat(
                &dir,
                "d",
                OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
                Mode::empty(),
            )
            .expect("openat");
        }
        drop(dir);
        for i in 0..500 {
            std::fs::create_dir(tree.join(format!("wide{i}"))).expect("mkdir");
        }
        std::thread::Builder::new()
            .stack_size(64 * 1024)
            .spawn(move || remove_tree(&tree).map(|()| tree.exists()))
            .expect("thread")
            .join()
            .map(|removed| assert!(!removed.expect("removed")))
            .expect("no stack overflow");
    }

    #[test]
    fn two_removers_at_once_both_succeed() {
        let root = tempfile::tempdir().expect("temp dir");
        let tree = root.path().join("ws");
        for i in 0..50 {
            let dir = tree.join(format!("d{i}/e"));
            std::fs::create_dir_all(&dir).expect("mkdir");
            for j in 0..20 {
                std::fs::write(dir.join(format!("f{j}")), "x").expect("write");
            }
        }
        let removers: Vec<_> = (0..2)
            .map(|_| {
                let tree = tree.clone();
                std::thread::spawn(move || remove_tree(&tree))
            })
            .collect();
        for remover in removers {
            remover.join().expect("thread").expect("removed");
        }
        assert!(!tree.exists());
    }

    #[test]
    fn a_directory_a_tool_locked_is_opened_again_by_its_owner() {
        let root = tempfile::tempdir().expect("temp dir");
        let tree = root.path().join("ws");
        std::fs::create_dir_all(tree.join("locked/inner")).expect("mkdir");
        std::fs::write(tree.join("locked/inner/f"), "x").expect("write");
        for dir in ["locked/inner", "locked"] {
            std::fs::set_permissions(tree.join(dir), std::fs::Permissions::from_mode(0o000))
                .expect("chmod");
        }
        remove_tree(&tree).expect("removed");
        assert!(!tree.exists());
    }
}
