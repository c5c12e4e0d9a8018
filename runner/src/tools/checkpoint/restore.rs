//! Restoring a checkpoint into an empty directory: every file with its content, mode and
//! mtime, every directory (empty ones too), every symbolic link with its target, all given
//! to the tool user. What the checkpoint did not keep (left out, or not a kind it keeps) is
//! listed, never silently dropped. Alongside, it builds the checkpoint of what it wrote, with
//! the new files' metadata, so the fork's first checkpoint finds them unchanged without
//! reading them.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use nix::fcntl::{openat, AtFlags, OFlag};
use nix::sys::stat::{fchmod, fstat, fstatat, futimens, mkdirat, utimensat, Mode, UtimensatFlags};
use nix::sys::time::TimeSpec;
use nix::unistd::{fchown, fchownat, symlinkat, Gid, Uid};

use super::area::{hex, Area, Hash, Kind, Pending};
use super::scan::{ctime_ns, mode_bits, mtime_ns, Trees};
use super::tree::{Entry, EntryKind, Tree};
use crate::tools::sandbox::Ids;

/// What a restore wrote, and what it could not.
#[derive(Debug)]
pub struct Restored {
    /// The checkpoint of the restored directory as it now is.
    pub root: Hash,
    pub trees: Trees,
    /// `path: why` for each path the checkpoint named and the restore could not make.
    pub not_restored: Vec<String>,
    pub files: usize,
    pub bytes: u64,
}

/// Fills the empty directory `target` with checkpoint `root`, owned by `owner` (the tool
/// user; `None`: the runner's own).
pub fn restore(
    area: &Area,
    root: &Hash,
    target: &OwnedFd,
    owner: Option<Ids>,
    pending: &mut Pending,
) -> io::Result<Restored> {
    let mut restore = Restore {
        area,
        owner,
        pending,
        trees: Trees::new(),
        not_restored: Vec::new(),
        files: 0,
        bytes: 0,
    };
    let root = restore.directory(root, target, &mut Vec::new())?;
    Ok(Restored {
        root,
        trees: restore.trees,
        not_restored: restore.not_restored,
        files: restore.files,
        bytes: restore.bytes,
    })
}

/// The checkpoint of an empty workspace, for a fork whose prefix names none.
pub fn restore_empty(area: &Area, pending: &mut Pending) -> io::Result<Restored> {
    let tree = Tree::default();
    let root = area.put_bytes(Kind::Tree, &tree.to_bytes(), pending)?;
    Ok(Restored {
        root,
        trees: Trees::from([(root, Arc::new(tree))]),
        not_restored: Vec::new(),
        files: 0,
        bytes: 0,
    })
}

struct Restore<'a> {
    area: &'a Area,
    owner: Option<Ids>,
    pending: &'a mut Pending,
    trees: Trees,
    not_restored: Vec<String>,
    files: usize,
    bytes: u64,
}

fn timespec(ns: i64) -> TimeSpec {
    TimeSpec::new(ns.div_euclid(1_000_000_000), ns.rem_euclid(1_000_000_000))
}

impl Restore<'_> {
    fn missing(&mut self, path: &[u8], why: &str) {
        let path = String::from_utf8_lossy(path);
        let shown = if path.is_empty() { "." } else { &path };
        self.not_restored.push(format!("{shown}: {why}"));
    }

    /// Restores tree `hash` into the directory `dir` (at `path`); returns the tree of what
    /// it wrote.
    fn directory(&mut self, hash: &Hash, dir: &OwnedFd, path: &mut Vec<u8>) -> io::Result<Hash> {
        let tree = match self.area.read(Kind::Tree, hash) {
            Ok(bytes) => Tree::from_bytes(&bytes).map_err(|e| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("checkpoint tree {} does not decode: {e}", hex(hash)),
                )
            })?,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                self.missing(path, "its listing is missing from the checkpoint area");
                Tree::default()
            }
            Err(e) => return Err(e),
        };
        let mut written = Vec::with_capacity(tree.entries.len());
        for entry in &tree.entries {
            let before = path.len();
            if !path.is_empty() {
                path.push(b'/');
            }
            path.extend_from_slice(&entry.name);
            let made = self.entry(entry, dir, path);
            path.truncate(before);
            if let Some(made) = made? {
                written.push(made);
            }
        }
        let tree = Tree { entries: written };
        let hash = self
            .area
            .put_bytes(Kind::Tree, &tree.to_bytes(), self.pending)?;
        self.trees.insert(hash, Arc::new(tree));
        Ok(hash)
    }

    fn entry(
        &mut self,
        entry: &Entry,
        dir: &OwnedFd,
        path: &mut Vec<u8>,
    ) -> io::Result<Option<Entry>> {
        let name = CString::new(entry.name.clone()).map_err(|_| {
            io::Error::new(
                io::ErrorKind::InvalidData,
                "a checkpoint entry name holds a NUL",
            )
        })?;
        let (uid, gid) = match self.owner {
            Some(ids) => (Some(Uid::from_raw(ids.uid)), Some(Gid::from_raw(ids.gid))),
            None => (None, None),
        };
        let mut made = Entry {
            name: entry.name.clone(),
            kind: entry.kind,
            object: entry.object.clone(),
            target: entry.target.clone(),
            ..Entry::default()
        };
        match entry.kind() {
            EntryKind::File => {
                let Some(blob) = entry.object_hash() else {
                    self.missing(path, "the checkpoint names no content for it");
                    return Ok(None);
                };
                let mut source = match File::open(self.area.object_path(Kind::Blob, &blob)) {
                    Ok(source) => source,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {
                        self.missing(path, "its content is missing from the checkpoint area");
                        return Ok(None);
                    }
                    Err(e) => return Err(e),
                };
                let flags = OFlag::O_WRONLY
                    | OFlag::O_CREAT
                    | OFlag::O_EXCL
                    | OFlag::O_NOFOLLOW
                    | OFlag::O_CLOEXEC;
                let fd = openat(dir, name.as_c_str(), flags, Mode::from_bits_truncate(0o600))?;
                let mut file = File::from(fd);
                let length = io::copy(&mut source, &mut file)?;
                // Owner first: chown clears the set-id bits the mode may hold.
                fchown(file.as_fd(), uid, gid)?;
                fchmod(file.as_fd(), Mode::from_bits_truncate(entry.mode))?;
                let mtime = timespec(entry.mtime_ns);
                futimens(file.as_fd(), &mtime, &mtime)?;
                let stat = fstat(file.as_fd())?;
                self.files += 1;
                self.bytes += length;
                made.size = length;
                fill(&mut made, &stat);
                Ok(Some(made))
            }
            EntryKind::Dir => {
                let Some(subtree) = entry.object_hash() else {
                    self.missing(path, "the checkpoint names no listing for it");
                    return Ok(None);
                };
                mkdirat(dir, name.as_c_str(), Mode::from_bits_truncate(0o700))?;
                let flags =
                    OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
                let child = openat(dir, name.as_c_str(), flags, Mode::empty())?;
                made.object = self.directory(&subtree, &child, path)?.to_vec();
                fchown(child.as_fd(), uid, gid)?;
                fchmod(child.as_fd(), Mode::from_bits_truncate(entry.mode))?;
                let mtime = timespec(entry.mtime_ns);
                futimens(child.as_fd(), &mtime, &mtime)?;
                let stat = fstat(child.as_fd())?;
                fill(&mut made, &stat);
                Ok(Some(made))
            }
            EntryKind::Symlink => {
                let target = CString::new(entry.target.clone()).map_err(|_| {
                    io::Error::new(io::ErrorKind::InvalidData, "a link target holds a NUL")
                })?;
                symlinkat(target.as_c_str(), dir, name.as_c_str())?;
                if uid.is_some() {
                    fchownat(dir, name.as_c_str(), uid, gid, AtFlags::AT_SYMLINK_NOFOLLOW)?;
                }
                let mtime = timespec(entry.mtime_ns);
                utimensat(
                    dir,
                    name.as_c_str(),
                    &mtime,
                    &mtime,
                    UtimensatFlags::NoFollowSymlink,
                )?;
                let stat = fstatat(dir, name.as_c_str(), AtFlags::AT_SYMLINK_NOFOLLOW)?;
                made.size = stat.st_size as u64;
                fill(&mut made, &stat);
                Ok(Some(made))
            }
            EntryKind::LeftOut | EntryKind::Skipped => {
                let note = if entry.note.is_empty() {
                    "not kept by the checkpoint"
                } else {
                    &entry.note
                };
                self.missing(path, note);
                Ok(None)
            }
        }
    }
}

fn fill(entry: &mut Entry, stat: &nix::sys::stat::FileStat) {
    entry.mode = mode_bits(stat);
    entry.mtime_ns = mtime_ns(stat);
    entry.ctime_ns = ctime_ns(stat);
    entry.ino = stat.st_ino;
    entry.dev = stat.st_dev;
}

/// Opens a directory for [`restore`].
pub fn open_dir(path: &std::path::Path) -> io::Result<OwnedFd> {
    let flags = OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC;
    Ok(nix::fcntl::open(path, flags, Mode::empty())?)
}

/// Removes `path` and everything under it, never following a link out of it.
pub fn remove_tree(path: &std::path::Path) -> io::Result<()> {
    match std::fs::symlink_metadata(path) {
        Ok(meta) if meta.is_dir() => std::fs::remove_dir_all(path),
        Ok(_) => std::fs::remove_file(path),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    }
}
