//! Recording a workspace: walk it (never following a symbolic link, every open relative to
//! its directory's descriptor), and for each file decide from its metadata alone whether the
//! previous checkpoint already holds it. Only files whose inode, size, mtime, ctime or mode
//! moved are read, hashed and stored. A directory whose entries are all as before keeps
//! its previous tree, so a checkpoint after a call that changed ten files writes the trees
//! on those ten files' paths and nothing else.
//!
//! The walk splits across threads (as many as the machine has) at the first directories
//! with more than one subdirectory; each thread records its subtrees into objects and
//! trees of its own, merged after.
//!
//! Racy entries: a file changed within the file system's clock tick in which the previous
//! checkpoint's scan ended could keep the ctime recorded for it. So an entry is trusted only
//! if its ctime is older than that moment ([`Previous::racy_limit_ns`], the mtime of the
//! session's `last` file, written after the scan); a newer one is read again.

use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::fs::File;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::Arc;

use nix::dir::Dir;
use nix::errno::Errno;
use nix::fcntl::{openat, readlinkat, AtFlags, OFlag};
use nix::sys::stat::{fstat, fstatat, FileStat, Mode, SFlag};

use super::area::{Area, Hash, Kind, Pending};
use super::ignore::IgnoreRules;
use super::tree::{Entry, EntryKind, Tree};

/// A checkpoint's trees by hash, as decoded (the runner keeps the last one per session).
pub type Trees = HashMap<Hash, Arc<Tree>>;

/// The checkpoint the next one compares against.
#[derive(Debug)]
pub struct Previous<'a> {
    pub root: Hash,
    /// Its trees, as far as they are at hand; the others are read from the area.
    pub trees: &'a Trees,
    /// Entries with a ctime at or past this are read again (see the module head).
    pub racy_limit_ns: i64,
}

/// A recorded checkpoint.
#[derive(Debug)]
pub struct Recorded {
    pub root: Hash,
    pub trees: Trees,
    /// Files that were read (their metadata had moved), for the log.
    pub files_read: usize,
    pub bytes_read: u64,
}

const DIR_FLAGS: OFlag = OFlag::O_RDONLY
    .union(OFlag::O_DIRECTORY)
    .union(OFlag::O_NOFOLLOW)
    .union(OFlag::O_CLOEXEC);

pub fn mode_bits(stat: &FileStat) -> u32 {
    stat.st_mode & 0o7777
}

pub fn mtime_ns(stat: &FileStat) -> i64 {
    stat.st_mtime * 1_000_000_000 + stat.st_mtime_nsec
}

pub fn ctime_ns(stat: &FileStat) -> i64 {
    stat.st_ctime * 1_000_000_000 + stat.st_ctime_nsec
}

fn file_type(stat: &FileStat) -> SFlag {
    SFlag::from_bits_truncate(stat.st_mode & SFlag::S_IFMT.bits())
}

/// Records `workspace` (a missing one records as empty) into `area`, against `previous`.
/// The objects it wrote still need `area.sync(pending)` before anything names them.
pub fn record(
    area: &Area,
    workspace: &Path,
    ignore: &IgnoreRules,
    previous: Option<&Previous>,
    pending: &mut Pending,
) -> io::Result<Recorded> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut scan = Scan::new(area, ignore, previous, threads);
    let root = match Dir::open(workspace, DIR_FLAGS, Mode::empty()) {
        Ok(dir) => {
            let previous_root = previous.and_then(|p| scan.previous_tree(&p.root));
            scan.directory(dir, &mut Vec::new(), previous_root)?
        }
        Err(Errno::ENOENT) => scan.store_tree(Tree::default(), None)?,
        Err(e) => return Err(e.into()),
    };
    pending.absorb(std::mem::take(&mut scan.pending));
    Ok(Recorded {
        root,
        trees: scan.trees,
        files_read: scan.files_read,
        bytes_read: scan.bytes_read,
    })
}

struct Scan<'a> {
    area: &'a Area,
    ignore: &'a IgnoreRules,
    previous: Option<&'a Previous<'a>>,
    pending: Pending,
    trees: Trees,
    files_read: usize,
    bytes_read: u64,
    /// Threads this scan may still use (itself included).
    threads: usize,
}

/// A subdirectory whose tree is still to be recorded: where its entry goes, the entry,
/// the open directory, its path and its previous tree.
type Subdir = (usize, Entry, Dir, Vec<u8>, Option<(Hash, Arc<Tree>)>);

impl<'a> Scan<'a> {
    fn new(
        area: &'a Area,
        ignore: &'a IgnoreRules,
        previous: Option<&'a Previous<'a>>,
        threads: usize,
    ) -> Scan<'a> {
        Scan {
            area,
            ignore,
            previous,
            pending: Pending::default(),
            trees: Trees::new(),
            files_read: 0,
            bytes_read: 0,
            threads,
        }
    }

    /// Records `subdirs`, on another thread too while the budget allows; returns each
    /// one's entry, its tree named.
    fn subdirectories(&mut self, mut subdirs: Vec<Subdir>) -> io::Result<Vec<(usize, Entry)>> {
        if self.threads < 2 || subdirs.len() < 2 {
            let mut done = Vec::with_capacity(subdirs.len());
            for (at, mut entry, dir, mut path, previous) in subdirs {
                entry.object = self.directory(dir, &mut path, previous)?.to_vec();
                done.push((at, entry));
            }
            return Ok(done);
        }
        let theirs = subdirs.split_off(subdirs.len() / 2);
        let given = self.threads / 2;
        self.threads -= given;
        let mut other = Scan::new(self.area, self.ignore, self.previous, given);
        let (mine, helped) = std::thread::scope(|scope| {
            let helper = scope.spawn(move || {
                let done = other.subdirectories(theirs);
                (other, done)
            });
            let mine = self.subdirectories(subdirs);
            let helped = helper
                .join()
                .map_err(|_| io::Error::other("a checkpoint thread panicked"));
            (mine, helped)
        });
        let (other, their_done) = helped?;
        self.threads += given;
        self.pending.absorb(other.pending);
        self.trees.extend(other.trees);
        self.files_read += other.files_read;
        self.bytes_read += other.bytes_read;
        let mut done = mine?;
        done.extend(their_done?);
        Ok(done)
    }

    /// A tree of the previous checkpoint: at hand, or read from the area (a missing or
    /// undecodable one only means its files are read again).
    fn previous_tree(&self, hash: &Hash) -> Option<(Hash, Arc<Tree>)> {
        let previous = self.previous?;
        if let Some(tree) = previous.trees.get(hash) {
            return Some((*hash, tree.clone()));
        }
        let bytes = self.area.read(Kind::Tree, hash).ok()?;
        Tree::from_bytes(&bytes)
            .ok()
            .map(|tree| (*hash, Arc::new(tree)))
    }

    /// Records the directory `dir` at `path` (relative, `/`-separated); returns its tree.
    fn directory(
        &mut self,
        mut dir: Dir,
        path: &mut Vec<u8>,
        previous: Option<(Hash, Arc<Tree>)>,
    ) -> io::Result<Hash> {
        let mut names: Vec<CString> = dir
            .iter()
            .filter_map(Result::ok)
            .map(|entry| entry.file_name().to_owned())
            .filter(|name| name.as_bytes() != b"." && name.as_bytes() != b"..")
            .collect();
        names.sort();
        let mut entries: Vec<Option<Entry>> = Vec::with_capacity(names.len());
        let mut subdirs: Vec<Subdir> = Vec::new();
        for name in names {
            let stat = match fstatat(&dir, name.as_c_str(), AtFlags::AT_SYMLINK_NOFOLLOW) {
                Ok(stat) => stat,
                // Gone since the listing: it is not part of the workspace any more.
                Err(Errno::ENOENT) => continue,
                Err(e) => return Err(e.into()),
            };
            let before = path.len();
            if !path.is_empty() {
                path.push(b'/');
            }
            path.extend_from_slice(name.as_bytes());
            let prior = previous.as_ref().and_then(|(_, t)| t.find(name.as_bytes()));
            let visited = self.entry(&dir, &name, &stat, path, prior);
            match visited {
                Ok(Visit::Entry(entry)) => entries.push(Some(entry)),
                Ok(Visit::Gone) => {}
                Ok(Visit::Dir(entry, child, previous)) => {
                    subdirs.push((entries.len(), entry, child, path.clone(), previous));
                    entries.push(None);
                }
                Err(e) => {
                    path.truncate(before);
                    return Err(e);
                }
            }
            path.truncate(before);
        }
        for (at, entry) in self.subdirectories(subdirs)? {
            entries[at] = Some(entry);
        }
        let tree = Tree {
            entries: entries.into_iter().flatten().collect(),
        };
        self.store_tree(tree, previous)
    }

    fn store_tree(&mut self, tree: Tree, previous: Option<(Hash, Arc<Tree>)>) -> io::Result<Hash> {
        if let Some((hash, previous)) = previous.filter(|(_, p)| p.entries == tree.entries) {
            self.trees.insert(hash, previous);
            return Ok(hash);
        }
        let hash = self
            .area
            .put_bytes(Kind::Tree, &tree.to_bytes(), &mut self.pending)?;
        self.trees.insert(hash, Arc::new(tree));
        Ok(hash)
    }

    fn entry(
        &mut self,
        dir: &Dir,
        name: &CStr,
        stat: &FileStat,
        path: &mut [u8],
        prior: Option<&Entry>,
    ) -> io::Result<Visit> {
        let kind = file_type(stat);
        let mut entry = Entry {
            name: name.to_bytes().to_vec(),
            mode: mode_bits(stat),
            mtime_ns: mtime_ns(stat),
            ino: stat.st_ino,
            ctime_ns: ctime_ns(stat),
            dev: stat.st_dev,
            ..Entry::default()
        };
        let is_dir = kind == SFlag::S_IFDIR;
        if let Some(pattern) = self.ignore.matching(path, name.to_bytes(), is_dir) {
            // Only the name: what is inside may change without the checkpoint changing.
            return Ok(Visit::Entry(Entry {
                name: entry.name,
                kind: EntryKind::LeftOut as i32,
                note: format!("left out by --checkpoint-ignore {pattern}"),
                ..Entry::default()
            }));
        }
        match kind {
            SFlag::S_IFREG => self.file(dir, name, stat, entry, prior).map(Visit::Entry),
            SFlag::S_IFDIR => {
                let child = match Dir::openat(dir, name, DIR_FLAGS, Mode::empty()) {
                    Ok(child) => child,
                    Err(Errno::ENOENT) => return Ok(Visit::Gone),
                    Err(e @ (Errno::EACCES | Errno::EPERM)) => {
                        return Ok(Visit::Entry(skipped(
                            entry,
                            &format!("could not be read: {e}"),
                        )))
                    }
                    Err(e) => return Err(e.into()),
                };
                let previous = prior
                    .filter(|p| p.kind() == EntryKind::Dir)
                    .and_then(Entry::object_hash)
                    .and_then(|hash| self.previous_tree(&hash));
                entry.kind = EntryKind::Dir as i32;
                Ok(Visit::Dir(entry, child, previous))
            }
            SFlag::S_IFLNK => match readlinkat(dir, name) {
                Ok(target) => {
                    entry.kind = EntryKind::Symlink as i32;
                    entry.target = target.as_bytes().to_vec();
                    entry.size = stat.st_size as u64;
                    Ok(Visit::Entry(entry))
                }
                Err(Errno::ENOENT) => Ok(Visit::Gone),
                Err(e) => Err(e.into()),
            },
            SFlag::S_IFIFO => Ok(Visit::Entry(skipped(entry, "a FIFO, which is not kept"))),
            SFlag::S_IFSOCK => Ok(Visit::Entry(skipped(entry, "a socket, which is not kept"))),
            _ => Ok(Visit::Entry(skipped(
                entry,
                "a device node, which is not kept",
            ))),
        }
    }

    fn file(
        &mut self,
        dir: &Dir,
        name: &CStr,
        stat: &FileStat,
        mut entry: Entry,
        prior: Option<&Entry>,
    ) -> io::Result<Entry> {
        entry.kind = EntryKind::File as i32;
        entry.size = stat.st_size as u64;
        let racy_limit = self.previous.map_or(i64::MIN, |p| p.racy_limit_ns);
        if let Some(prior) = prior.filter(|p| {
            p.kind() == EntryKind::File
                && p.ino == entry.ino
                && p.dev == entry.dev
                && p.size == entry.size
                && p.mtime_ns == entry.mtime_ns
                && p.ctime_ns == entry.ctime_ns
                && p.mode == entry.mode
                && p.ctime_ns < racy_limit
                && p.object.len() == 32
        }) {
            entry.object = prior.object.clone();
            return Ok(entry);
        }
        let flags = OFlag::O_RDONLY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC | OFlag::O_NOCTTY;
        let fd = match openat(dir, name, flags, Mode::empty()) {
            Ok(fd) => fd,
            Err(e @ (Errno::EACCES | Errno::EPERM)) => {
                return Ok(skipped(entry, &format!("could not be read: {e}")))
            }
            Err(e) => return Err(e.into()),
        };
        // The metadata of what was opened, should it have moved since the listing.
        let opened = fstat(&fd)?;
        if file_type(&opened) != SFlag::S_IFREG {
            return Ok(skipped(entry, "changed while it was recorded"));
        }
        entry.mode = mode_bits(&opened);
        entry.mtime_ns = mtime_ns(&opened);
        entry.ctime_ns = ctime_ns(&opened);
        entry.ino = opened.st_ino;
        let mut file = File::from(fd);
        let (hash, length) = self.area.put_reader(&mut file, &mut self.pending)?;
        self.files_read += 1;
        self.bytes_read += length;
        entry.size = length;
        entry.object = hash.to_vec();
        Ok(entry)
    }
}

/// What one directory entry turned out to be.
enum Visit {
    Entry(Entry),
    /// A subdirectory, opened, whose tree is still to be recorded (with its previous one).
    Dir(Entry, Dir, Option<(Hash, Arc<Tree>)>),
    /// Gone since the listing.
    Gone,
}

fn skipped(mut entry: Entry, note: &str) -> Entry {
    entry.kind = EntryKind::Skipped as i32;
    entry.note = note.to_string();
    entry.mode = 0;
    entry
}
