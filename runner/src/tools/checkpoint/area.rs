//! The checkpoint area on disk, `<workspace-root>/.checkpoints/` (a name no session id can
//! take, since ids start with a letter or digit), mode 0700 and the runner's own:
//!
//! | path | what |
//! |---|---|
//! | `lock` | `flock`ed shared by every checkpoint, adoption and restore, exclusively by the GC |
//! | `blobs/<sha256>` | a file's content |
//! | `trees/<sha256>` | a directory's entries ([`super::tree::Tree`]); a checkpoint's id is its root tree's |
//! | `sessions/<id>/refs` | the checkpoints the session's log may name, one id a line (append-only) |
//! | `sessions/<id>/adopted` | a fork's `refs` hold every checkpoint its copied prefix names |
//! | `sessions/<id>/restored` | a fork's workspace was restored; what could not be |
//! | `sessions/<id>/note` | that note, until a tool result has carried it to the model |
//! | `sessions/<id>/last` | the session's newest checkpoint, whose metadata the next one compares against; its mtime is the file system's clock after that checkpoint's scan |
//! | `tmp/` | objects being written and restores being staged |
//! | `removing/` | workspaces of deleted sessions, moved here to be removed ([`super::Checkpoints::remove_workspace_blocking`]) |
//!
//! Every object is written aside in `tmp/`, `fdatasync`ed and renamed to its hash, so an
//! object under its final name is always whole; the directories it was renamed into are
//! fsynced before anything that names it is made durable. A checkpoint's objects are synced
//! together ([`Area::sync`]): all their `fdatasync`s at once, so that the file system
//! commits them in one journal transaction instead of one each (a new file's `fdatasync`
//! costs a commit: about 4 ms here, and a call that changed ten files makes some twenty
//! objects).

use std::collections::{BTreeSet, HashSet};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};
use ring::digest::{Context, Digest, SHA256};

/// The area's directory name under the workspace root.
pub const AREA_DIR: &str = ".checkpoints";

/// A SHA-256, the name of an object.
pub type Hash = [u8; 32];

pub fn hex(hash: &Hash) -> String {
    hash.iter().map(|b| format!("{b:02x}")).collect()
}

/// The hash a 64-hex-digit name spells, if it is one.
pub fn parse_hex(text: &str) -> Option<Hash> {
    let text = text.as_bytes();
    if text.len() != 64 {
        return None;
    }
    let mut hash = [0u8; 32];
    for (i, pair) in text.chunks(2).enumerate() {
        let digit = |c: u8| (c as char).to_digit(16);
        hash[i] = (digit(pair[0])? * 16 + digit(pair[1])?) as u8;
    }
    Some(hash)
}

pub fn sha256(bytes: &[u8]) -> Hash {
    to_hash(ring::digest::digest(&SHA256, bytes))
}

fn to_hash(digest: Digest) -> Hash {
    let mut hash = [0u8; 32];
    hash.copy_from_slice(digest.as_ref());
    hash
}

/// Which kind of object.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Blob,
    Tree,
}

impl Kind {
    fn dir(self) -> &'static str {
        match self {
            Kind::Blob => "blobs",
            Kind::Tree => "trees",
        }
    }
}

/// The area's paths and the writes every part of the checkpoints shares.
#[derive(Debug, Clone)]
pub struct Area {
    dir: PathBuf,
}

/// Objects written aside, to be synced and renamed into place by [`Area::sync`].
#[derive(Debug, Default)]
pub struct Pending {
    objects: Vec<(File, PathBuf, PathBuf)>,
    names: HashSet<(&'static str, Hash)>,
    dirs: BTreeSet<&'static str>,
}

impl Pending {
    /// Takes in the objects another scan wrote.
    pub fn absorb(&mut self, other: Pending) {
        self.objects.extend(other.objects);
        self.names.extend(other.names);
        self.dirs.extend(other.dirs);
    }
}

/// `fdatasync`s issued at once, at most.
const PARALLEL_SYNCS: usize = 64;
/// Past this many objects, one `syncfs` of the area's file system is cheaper than a
/// `fdatasync` each (a session's first checkpoint of a large workspace).
const SYNCFS_OBJECTS: usize = 512;

impl Area {
    /// The area of the workspaces under `workspace_root` (created by [`Area::ensure`]).
    pub fn new(workspace_root: &Path) -> Area {
        Area {
            dir: workspace_root.join(AREA_DIR),
        }
    }

    /// The area in the directory `dir` (`runner --checkpoint-store file:///PATH`).
    pub fn at(dir: PathBuf) -> Area {
        Area { dir }
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Creates the area's directories (mode 0700) if they are missing.
    pub fn ensure(&self) -> io::Result<()> {
        let mut builder = fs::DirBuilder::new();
        builder.recursive(true).mode(0o700);
        for sub in ["blobs", "trees", "sessions", "tmp"] {
            builder.create(self.dir.join(sub))?;
        }
        Ok(())
    }

    /// Held while a checkpoint, adoption or restore reads or writes the area; the GC takes
    /// it exclusively, so it never sweeps an object something is about to name.
    pub fn lock_shared(&self) -> io::Result<Flock<File>> {
        self.lock(FlockArg::LockShared)
    }

    pub fn lock_exclusive(&self) -> io::Result<Flock<File>> {
        self.lock(FlockArg::LockExclusive)
    }

    fn lock(&self, how: FlockArg) -> io::Result<Flock<File>> {
        lock_path(&self.dir.join("lock"), how)
    }

    pub fn object_path(&self, kind: Kind, hash: &Hash) -> PathBuf {
        self.dir.join(kind.dir()).join(hex(hash))
    }

    pub fn objects_dir(&self, kind: Kind) -> PathBuf {
        self.dir.join(kind.dir())
    }

    pub fn has(&self, kind: Kind, hash: &Hash) -> bool {
        self.object_path(kind, hash).exists()
    }

    /// Whether the object is in place or among `pending`.
    fn has_or_pending(&self, kind: Kind, hash: &Hash, pending: &Pending) -> bool {
        pending.names.contains(&(kind.dir(), *hash)) || self.has(kind, hash)
    }

    pub fn tmp_dir(&self) -> PathBuf {
        self.dir.join("tmp")
    }

    /// Where deleted sessions' workspaces are moved to be removed.
    pub fn removing_dir(&self) -> PathBuf {
        self.dir.join("removing")
    }

    pub fn sessions_dir(&self) -> PathBuf {
        self.dir.join("sessions")
    }

    pub fn session_dir(&self, session_id: &str) -> PathBuf {
        self.sessions_dir().join(session_id)
    }

    /// A fresh file in `tmp/` (mode 0600), to be renamed into place.
    pub fn create_temp(&self) -> io::Result<(PathBuf, File)> {
        loop {
            let path = self.tmp_dir().join(format!("w-{:016x}", fastrand::u64(..)));
            match OpenOptions::new()
                .write(true)
                .read(true)
                .create_new(true)
                .mode(0o600)
                .open(&path)
            {
                Ok(file) => return Ok((path, file)),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// Stores `bytes` as an object (if it is not there already); returns its hash.
    pub fn put_bytes(&self, kind: Kind, bytes: &[u8], pending: &mut Pending) -> io::Result<Hash> {
        let hash = sha256(bytes);
        if self.has_or_pending(kind, &hash, pending) {
            return Ok(hash);
        }
        let (path, mut file) = self.create_temp()?;
        let written = file.write_all(bytes);
        self.settle(kind, &hash, path, file, written, pending)?;
        Ok(hash)
    }

    /// Stores everything `source` reads as a blob, hashing it on the way; returns its hash
    /// and length.
    pub fn put_reader(
        &self,
        source: &mut impl Read,
        pending: &mut Pending,
    ) -> io::Result<(Hash, u64)> {
        let (path, mut file) = self.create_temp()?;
        let mut context = Context::new(&SHA256);
        let mut buffer = vec![0u8; 256 * 1024];
        let mut length = 0u64;
        let copied = (|| loop {
            let n = match source.read(&mut buffer) {
                Ok(0) => return Ok(()),
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            context.update(&buffer[..n]);
            file.write_all(&buffer[..n])?;
            length += n as u64;
        })();
        let hash = to_hash(context.finish());
        if copied.is_ok() && self.has_or_pending(Kind::Blob, &hash, pending) {
            let _ = fs::remove_file(&path);
            return Ok((hash, length));
        }
        self.settle(Kind::Blob, &hash, path, file, copied, pending)?;
        Ok((hash, length))
    }

    fn settle(
        &self,
        kind: Kind,
        hash: &Hash,
        temp: PathBuf,
        file: File,
        written: io::Result<()>,
        pending: &mut Pending,
    ) -> io::Result<()> {
        if let Err(e) = written {
            let _ = fs::remove_file(&temp);
            return Err(e);
        }
        pending.names.insert((kind.dir(), *hash));
        pending.dirs.insert(kind.dir());
        pending
            .objects
            .push((file, temp, self.object_path(kind, hash)));
        Ok(())
    }

    /// Puts every object of `pending` in place, durably: their data synced (all at once),
    /// then each renamed to its hash, then the directories renamed into synced. (A crash
    /// before the renames leaves temporary files, which the GC removes.)
    pub fn sync(&self, pending: Pending) -> io::Result<()> {
        self.sync_alongside(pending, || Ok(()))
    }

    /// [`Area::sync`], running `alongside` (a durable write that may land before the
    /// objects do, such as a `refs` line: a checkpoint nothing names yet may lack objects
    /// after a crash) at the same time as the objects' data syncs.
    pub fn sync_alongside(
        &self,
        pending: Pending,
        alongside: impl FnOnce() -> io::Result<()> + Send,
    ) -> io::Result<()> {
        let Pending { objects, dirs, .. } = pending;
        std::thread::scope(|scope| {
            let beside = scope.spawn(alongside);
            let synced = if objects.len() > SYNCFS_OBJECTS {
                match objects.first() {
                    Some((file, _, _)) => nix::unistd::syncfs(file).map_err(io::Error::from),
                    None => Ok(()),
                }
            } else {
                objects.chunks(PARALLEL_SYNCS).try_for_each(|batch| {
                    all_ok(std::thread::scope(|inner| {
                        let syncs: Vec<_> = batch
                            .iter()
                            .map(|(file, _, _)| inner.spawn(move || file.sync_data()))
                            .collect();
                        syncs.into_iter().map(joined).collect::<Vec<_>>()
                    }))
                })
            };
            all_ok(vec![synced, joined(beside)])
        })?;
        for (file, temp, path) in objects {
            drop(file);
            // Another runner storing the same content renames the same bytes: either wins.
            fs::rename(&temp, &path)?;
        }
        all_ok(std::thread::scope(|scope| {
            let syncs: Vec<_> = dirs
                .iter()
                .map(|dir| {
                    let path = self.dir.join(dir);
                    scope.spawn(move || sync_dir(&path))
                })
                .collect();
            syncs.into_iter().map(joined).collect::<Vec<_>>()
        }))
    }

    pub fn read(&self, kind: Kind, hash: &Hash) -> io::Result<Vec<u8>> {
        fs::read(self.object_path(kind, hash))
    }

    /// Writes `bytes` to `path` whole: aside, synced, renamed, the directory synced.
    pub fn write_file_durably(&self, path: &Path, bytes: &[u8]) -> io::Result<()> {
        let (temp, mut file) = self.create_temp()?;
        let written = file.write_all(bytes).and_then(|()| file.sync_data());
        if let Err(e) = written.and_then(|()| fs::rename(&temp, path)) {
            let _ = fs::remove_file(&temp);
            return Err(e);
        }
        sync_dir(path.parent().unwrap_or(&self.dir))
    }

    /// Creates the session's directory, durably, if it is missing.
    pub fn ensure_session_dir(&self, session_id: &str) -> io::Result<PathBuf> {
        let dir = self.session_dir(session_id);
        match fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => sync_dir(&self.sessions_dir())?,
            Err(e) if e.kind() == io::ErrorKind::AlreadyExists => {}
            Err(e) => return Err(e),
        }
        Ok(dir)
    }

    /// Appends checkpoint ids to the session's `refs`, durably.
    pub fn add_refs(&self, session_id: &str, ids: &[Hash]) -> io::Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let dir = self.ensure_session_dir(session_id)?;
        let path = dir.join("refs");
        let created = !path.exists();
        let mut file = OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o600)
            .open(&path)?;
        let mut lines = String::with_capacity(ids.len() * 65);
        for id in ids {
            lines.push_str(&hex(id));
            lines.push('\n');
        }
        file.write_all(lines.as_bytes())?;
        file.sync_data()?;
        if created {
            sync_dir(&dir)?;
        }
        Ok(())
    }

    /// The checkpoint ids of the session's `refs` (a torn last line is skipped: its
    /// checkpoint was never named by the log).
    pub fn refs(&self, session_id: &str) -> io::Result<Vec<Hash>> {
        match fs::read_to_string(self.session_dir(session_id).join("refs")) {
            Ok(text) => Ok(text.lines().filter_map(parse_hex).collect()),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
            Err(e) => Err(e),
        }
    }
}

/// An exclusive `flock` on `path` (created if missing), released when dropped or when the
/// process dies.
pub fn lock_file(path: &Path) -> io::Result<Flock<File>> {
    lock_path(path, FlockArg::LockExclusive)
}

fn lock_path(path: &Path, how: FlockArg) -> io::Result<Flock<File>> {
    let file = OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .mode(0o600)
        .open(path)?;
    Flock::lock(file, how).map_err(|(_, errno)| io::Error::from(errno))
}

fn joined(handle: std::thread::ScopedJoinHandle<'_, io::Result<()>>) -> io::Result<()> {
    handle
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("a sync thread panicked")))
}

fn all_ok(results: Vec<io::Result<()>>) -> io::Result<()> {
    results.into_iter().collect()
}

pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_spell_and_parse_back() {
        let hash = sha256(b"abc");
        assert_eq!(
            hex(&hash),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(parse_hex(&hex(&hash)), Some(hash));
        assert_eq!(parse_hex("zz"), None);
        assert_eq!(parse_hex(&"g".repeat(64)), None);
    }

    #[test]
    fn objects_are_stored_once_under_their_hash() {
        let root = tempfile::tempdir().expect("temp dir");
        let area = Area::new(root.path());
        area.ensure().expect("area");
        let mut pending = Pending::default();
        let a = area
            .put_bytes(Kind::Tree, b"tree", &mut pending)
            .expect("put");
        assert_eq!(
            area.put_bytes(Kind::Tree, b"tree", &mut pending)
                .expect("put"),
            a
        );
        let (b, len) = area
            .put_reader(&mut &b"blob content"[..], &mut pending)
            .expect("put");
        assert_eq!((b, len), (sha256(b"blob content"), 12));
        let (again, _) = area
            .put_reader(&mut &b"blob content"[..], &mut pending)
            .expect("put");
        assert_eq!(again, b);
        area.sync(pending).expect("sync");
        assert_eq!(area.read(Kind::Blob, &b).expect("read"), b"blob content");
        assert_eq!(fs::read_dir(area.tmp_dir()).expect("tmp").count(), 0);
        area.add_refs("s1", &[a, b]).expect("refs");
        area.add_refs("s1", &[a]).expect("refs");
        assert_eq!(area.refs("s1").expect("refs"), vec![a, b, a]);
        assert_eq!(area.refs("s2").expect("refs"), Vec::<Hash>::new());
    }
}
