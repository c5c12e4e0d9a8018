//! Where segment bytes live. The log only needs a few things from a disk: list, create,
//! allocate, append, read, `fdatasync`, whether the volume is running out of room, and
//! for the rewrite of a segment a file beside it that is put in its place atomically.
//! Behind this trait sit the real filesystem and a power-loss simulator that forgets every
//! byte not covered by the last `sync_data`, so the same durability tests run against both
//! (the way redb tests crash consistency); the simulator can also cut the power at the
//! named [`CrashPoint`]s of a rewrite.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// One segment file. Every method takes `&self`: the writer appends while subscribers read.
pub trait SegmentFile: Send + Sync {
    /// Bytes in the file.
    fn size(&self) -> io::Result<u64>;
    /// Fills `buf` from `offset`; a short file is an `UnexpectedEof` error.
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()>;
    /// Writes `data` at `offset` (the writer always writes at the end).
    fn write_all_at(&self, data: &[u8], offset: u64) -> io::Result<()>;
    /// Reserves disk blocks for `len` bytes at `offset` without changing the file's size,
    /// so that a full volume shows up here, as an error of kind `StorageFull`, rather than
    /// as a failed write or `fdatasync` later.
    fn allocate(&self, offset: u64, len: u64) -> io::Result<()>;
    /// `fdatasync`: when it returns, every byte written before it survives power loss.
    fn sync_data(&self) -> io::Result<()>;
    /// Cuts the file to `len` bytes and makes the cut durable (drops a torn tail).
    fn truncate(&self, len: u64) -> io::Result<()>;
    /// Writes here, at `at`, the `len` bytes of `source` at `offset` (not yet synced). A
    /// file on the real disk has the kernel copy them (`copy_file_range`), so that they do
    /// not pass through this process; otherwise through a buffer.
    fn copy_from(
        &self,
        source: &dyn SegmentFile,
        offset: u64,
        len: u64,
        at: u64,
    ) -> io::Result<()> {
        copy_through_buffer(self, source, offset, len, at)
    }
    /// The file's descriptor, if it is one on the real disk (for [`SegmentFile::copy_from`]).
    fn fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        None
    }
    /// Starts writing the `len` bytes at `offset` out to the disk without waiting for it
    /// (and lets their pages leave the cache once written), so that a later `sync_data`
    /// finds little left: a large write then never reaches the disk in one burst that
    /// other files' `fdatasync`s would queue behind.
    fn start_writeback(&self, _offset: u64, _len: u64) -> io::Result<()> {
        Ok(())
    }
}

/// [`SegmentFile::copy_from`] through a buffer of at most 1 MiB.
fn copy_through_buffer<F: SegmentFile + ?Sized>(
    to: &F,
    source: &dyn SegmentFile,
    offset: u64,
    len: u64,
    at: u64,
) -> io::Result<()> {
    let mut buf = vec![0u8; len.min(1 << 20) as usize];
    let mut done = 0;
    while done < len {
        let n = buf.len().min((len - done) as usize);
        source.read_exact_at(&mut buf[..n], offset + done)?;
        to.write_all_at(&buf[..n], at + done)?;
        done += n as u64;
    }
    Ok(())
}

/// A set of segment files, each named by the log offset of its first byte.
pub trait Storage: Send + Sync {
    /// The base offsets of every segment, ascending.
    fn list(&self) -> io::Result<Vec<u64>>;
    fn open(&self, base: u64) -> io::Result<Arc<dyn SegmentFile>>;
    /// Creates an empty segment; the file and its directory entry are durable on return.
    fn create(&self, base: u64) -> io::Result<Arc<dyn SegmentFile>>;
    /// Why the log should not grow now, if the volume is (nearly) full: the last of its
    /// room is kept for the index, which must never fail a write of its own.
    fn low_space(&self) -> io::Result<Option<String>>;
    /// Creates, empty, the file a rewrite of segment `base` is written into (replacing one
    /// left from before). It is no segment: [`Storage::list`] never names it.
    fn create_rewrite(&self, base: u64) -> io::Result<Arc<dyn SegmentFile>>;
    /// Puts the rewrite of `base` (written and synced) in place of the segment: atomically
    /// (a crash leaves the old segment or the new one, each whole) and durably on return.
    fn install_rewrite(&self, base: u64) -> io::Result<()>;
    /// Removes the rewrite of `base`, or every rewrite left behind (`None`, at open).
    fn remove_rewrite(&self, base: Option<u64>) -> io::Result<()>;
    /// A moment of a rewrite where a crash may cut it: the simulator cuts the power here
    /// when told to (and fails, as a machine that is gone would); the real disk goes on.
    fn crash_point(&self, _point: CrashPoint) -> io::Result<()> {
        Ok(())
    }
    /// Keeps `bytes` of the volume taken by a file of its own (the reserve), so that a
    /// deletion's tombstone and the reclamation of its space can run on a volume that is
    /// full (whoever filled it); put in place now if there is room, else later
    /// ([`Storage::restore_reserve`]). While it is not in place the volume counts as full
    /// for appends ([`Storage::low_space`]), so appends never eat into it. (The simulator
    /// keeps none.)
    fn keep_reserve(&self, _bytes: u64) -> io::Result<()> {
        Ok(())
    }
    /// Gives the reserve's room back to the volume, for a deletion or a rewrite that found
    /// none; the bytes it freed.
    fn release_reserve(&self) -> io::Result<u64> {
        Ok(0)
    }
    /// Puts the reserve back if the volume has room for it and the headroom above it;
    /// whether it is in place.
    fn restore_reserve(&self) -> io::Result<bool> {
        Ok(true)
    }
}

/// The moments of the reclamation of deleted sessions' space where a crash may cut it
/// (`backend::local::reclaim` states what each leaves behind).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CrashPoint {
    /// A fork's shared prefix is written as its own, not yet synced.
    MaterializeWritten,
    /// It is durable (perhaps not in the index yet); the base's records are all there.
    Materialized,
    /// A segment's rewrite is written but not synced.
    RewriteWritten,
    /// It is synced, not yet in place of the segment.
    RewriteSynced,
    /// Every rewrite of the pass is in place; the index still holds the deleted sessions'
    /// entries.
    Installed,
    /// The index no longer holds them but still marks the sessions as awaiting erasure.
    Purged,
}

/// Bytes kept free on the log's volume for the index: 1/32 of the volume, between 1 MiB
/// and 256 MiB.
pub fn headroom(volume_bytes: u64) -> u64 {
    (volume_bytes / 32).clamp(1 << 20, 256 << 20)
}

/// Segment files in a directory on the real filesystem.
pub struct FsStorage {
    dir: PathBuf,
    /// The reserve's size (0: none kept) and whether its file is in place.
    reserve: Mutex<(u64, bool)>,
    /// The last look at the volume for [`Storage::low_space`]: when, its free bytes and
    /// what is kept free.
    looked: Mutex<Option<(Instant, u64, u64)>>,
}

/// The reserve's file in the log directory.
const RESERVE_FILE: &str = "reserve";

/// [`Storage::low_space`] is asked before every batch the log writes; a `statvfs` costs
/// ~2 µs on that path. A look at most this old answers it while the volume had more than
/// [`ROOM_MARGIN`] to spare above what is kept free: the log cannot write that much in
/// this time, and whoever else fills the volume meanwhile meets the same `fallocate`
/// (`StorageFull`) that a look just before would have raced. Nearer the line, every call
/// looks again.
const ROOM_FRESH: Duration = Duration::from_millis(10);
const ROOM_MARGIN: u64 = 256 << 20;

impl FsStorage {
    pub fn open_dir(dir: &Path) -> io::Result<FsStorage> {
        std::fs::create_dir_all(dir)?;
        Ok(FsStorage {
            dir: dir.to_path_buf(),
            reserve: Mutex::new((0, false)),
            looked: Mutex::new(None),
        })
    }

    /// The size of the volume the directory is on.
    pub fn volume_bytes(&self) -> io::Result<u64> {
        Ok(self.room()?.2)
    }

    /// The volume's free bytes, and what is kept free for the index.
    fn room(&self) -> io::Result<(u64, u64, u64)> {
        let stat = nix::sys::statvfs::statvfs(&self.dir).map_err(io::Error::from)?;
        let unit = stat.fragment_size() as u64;
        let volume = stat.blocks() as u64 * unit;
        let free = stat.blocks_available() as u64 * unit;
        Ok((free, headroom(volume), volume))
    }

    /// [`FsStorage::room`]'s free and kept bytes, from a recent look if it is good enough
    /// ([`ROOM_FRESH`]).
    fn recent_room(&self) -> io::Result<(u64, u64)> {
        let mut looked = lock(&self.looked);
        if let Some((at, free, keep)) = *looked {
            if free >= keep.saturating_add(ROOM_MARGIN) && at.elapsed() < ROOM_FRESH {
                return Ok((free, keep));
            }
        }
        let (free, keep, _) = self.room()?;
        *looked = Some((Instant::now(), free, keep));
        Ok((free, keep))
    }

    fn path(&self, base: u64) -> PathBuf {
        self.dir.join(format!("{base:020}.seg"))
    }

    fn rewrite_path(&self, base: u64) -> PathBuf {
        self.dir.join(format!("{base:020}.seg{REWRITE_SUFFIX}"))
    }

    fn sync_dir(&self) -> io::Result<()> {
        File::open(&self.dir)?.sync_all()
    }
}

/// A rewrite of `X.seg` is written as `X.seg.rewrite`.
const REWRITE_SUFFIX: &str = ".rewrite";

impl Storage for FsStorage {
    fn list(&self) -> io::Result<Vec<u64>> {
        let mut bases = Vec::new();
        for entry in std::fs::read_dir(&self.dir)? {
            let name = entry?.file_name();
            let Some(name) = name.to_str() else { continue };
            if let Some(base) = name.strip_suffix(".seg").and_then(|s| s.parse().ok()) {
                bases.push(base);
            }
        }
        bases.sort_unstable();
        Ok(bases)
    }

    fn open(&self, base: u64) -> io::Result<Arc<dyn SegmentFile>> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(self.path(base))?;
        Ok(Arc::new(FsSegment { file }))
    }

    fn create(&self, base: u64) -> io::Result<Arc<dyn SegmentFile>> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(self.path(base))?;
        file.sync_all()?;
        // A new file's name is durable only once its directory is fsync'd.
        File::open(&self.dir)?.sync_all()?;
        Ok(Arc::new(FsSegment { file }))
    }

    fn create_rewrite(&self, base: u64) -> io::Result<Arc<dyn SegmentFile>> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(self.rewrite_path(base))?;
        Ok(Arc::new(FsSegment { file }))
    }

    fn install_rewrite(&self, base: u64) -> io::Result<()> {
        std::fs::rename(self.rewrite_path(base), self.path(base))?;
        self.sync_dir()
    }

    fn remove_rewrite(&self, base: Option<u64>) -> io::Result<()> {
        let paths = match base {
            Some(base) => vec![self.rewrite_path(base)],
            None => std::fs::read_dir(&self.dir)?
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| p.to_str().is_some_and(|p| p.ends_with(REWRITE_SUFFIX)))
                .collect(),
        };
        let mut removed = false;
        for path in paths {
            match std::fs::remove_file(&path) {
                Ok(()) => removed = true,
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        if removed {
            self.sync_dir()?;
        }
        Ok(())
    }

    fn low_space(&self) -> io::Result<Option<String>> {
        let (free, keep) = self.recent_room()?;
        let (reserve, in_place) = *lock(&self.reserve);
        if reserve > 0 && !in_place {
            return Ok(Some(format!(
                "{} has no room for the {reserve} bytes kept in reserve for deletions and \
                 their reclamation ({free} bytes free)",
                self.dir.display()
            )));
        }
        Ok((free < keep).then(|| {
            format!(
                "{} has {free} bytes free, less than the {keep} kept free for the index",
                self.dir.display()
            )
        }))
    }

    fn keep_reserve(&self, bytes: u64) -> io::Result<()> {
        let (_, _, volume) = self.room()?;
        // Never more than an eighth of the volume.
        let bytes = bytes.min(volume / 8);
        let path = self.dir.join(RESERVE_FILE);
        let in_place = std::fs::metadata(&path).is_ok_and(|m| m.len() == bytes);
        *lock(&self.reserve) = (bytes, in_place);
        if !in_place {
            let _ = std::fs::remove_file(&path);
            if !self.restore_reserve()? {
                tracing::warn!(
                    reserve_bytes = bytes,
                    "no room on the log's volume for the reserve kept for deletions; \
                     appends wait until there is"
                );
            }
        }
        Ok(())
    }

    fn release_reserve(&self) -> io::Result<u64> {
        let mut reserve = lock(&self.reserve);
        if !reserve.1 {
            return Ok(0);
        }
        std::fs::remove_file(self.dir.join(RESERVE_FILE))?;
        reserve.1 = false;
        tracing::warn!(
            bytes = reserve.0,
            "the log's volume is full: the reserve is released for deletions and their \
             reclamation; appends wait until it is back"
        );
        Ok(reserve.0)
    }

    fn restore_reserve(&self) -> io::Result<bool> {
        let mut reserve = lock(&self.reserve);
        let (bytes, in_place) = *reserve;
        if bytes == 0 || in_place {
            return Ok(true);
        }
        let (free, keep, _) = self.room()?;
        if free < bytes + keep {
            return Ok(false);
        }
        let path = self.dir.join(RESERVE_FILE);
        let file = File::create(&path)?;
        let flags = nix::fcntl::FallocateFlags::empty();
        let len = i64::try_from(bytes).map_err(io::Error::other)?;
        match nix::fcntl::fallocate(&file, flags, 0, len) {
            Ok(()) => {}
            // A filesystem without fallocate: zeros take the room instead.
            Err(nix::errno::Errno::EOPNOTSUPP) => {
                let zeros = vec![0u8; 1 << 20];
                let mut at = 0;
                while at < bytes {
                    let n = zeros.len().min((bytes - at) as usize);
                    if let Err(e) = FileExt::write_all_at(&file, &zeros[..n], at) {
                        drop(file);
                        let _ = std::fs::remove_file(&path);
                        return if e.kind() == io::ErrorKind::StorageFull {
                            Ok(false)
                        } else {
                            Err(e)
                        };
                    }
                    at += n as u64;
                }
            }
            Err(nix::errno::Errno::ENOSPC) => {
                drop(file);
                std::fs::remove_file(&path)?;
                return Ok(false);
            }
            Err(e) => return Err(e.into()),
        }
        file.sync_all()?;
        reserve.1 = true;
        Ok(true)
    }
}

struct FsSegment {
    file: File,
}

impl SegmentFile for FsSegment {
    fn size(&self) -> io::Result<u64> {
        Ok(self.file.metadata()?.len())
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        FileExt::read_exact_at(&self.file, buf, offset)
    }
    fn write_all_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        FileExt::write_all_at(&self.file, data, offset)
    }
    fn allocate(&self, offset: u64, len: u64) -> io::Result<()> {
        let as_off = |n: u64| {
            i64::try_from(n).map_err(|_| io::Error::other(format!("offset {n} is out of range")))
        };
        let flags = nix::fcntl::FallocateFlags::FALLOC_FL_KEEP_SIZE;
        match nix::fcntl::fallocate(&self.file, flags, as_off(offset)?, as_off(len)?) {
            Ok(()) => Ok(()),
            // A filesystem without fallocate: the writes themselves will tell.
            Err(nix::errno::Errno::EOPNOTSUPP) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }
    fn sync_data(&self) -> io::Result<()> {
        self.file.sync_data()
    }
    fn truncate(&self, len: u64) -> io::Result<()> {
        self.file.set_len(len)?;
        self.file.sync_all()
    }
    fn copy_from(
        &self,
        source: &dyn SegmentFile,
        offset: u64,
        len: u64,
        at: u64,
    ) -> io::Result<()> {
        let Some(from) = source.fd() else {
            return copy_through_buffer(self, source, offset, len, at);
        };
        let as_off = |n: u64| {
            i64::try_from(n).map_err(|_| io::Error::other(format!("offset {n} is out of range")))
        };
        let (mut from_off, mut to_off) = (as_off(offset)?, as_off(at)?);
        let mut left = len;
        while left > 0 {
            let want = left.min(1 << 30) as usize;
            match nix::fcntl::copy_file_range(
                from,
                Some(&mut from_off),
                &self.file,
                Some(&mut to_off),
                want,
            ) {
                Ok(0) => {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the source ended before the range was copied",
                    ))
                }
                Ok(n) => left -= n as u64,
                // A kernel or filesystem that cannot: the rest through a buffer.
                Err(
                    nix::errno::Errno::ENOSYS
                    | nix::errno::Errno::EXDEV
                    | nix::errno::Errno::EINVAL
                    | nix::errno::Errno::EOPNOTSUPP,
                ) => {
                    let done = len - left;
                    return copy_through_buffer(self, source, offset + done, left, at + done);
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }
    fn fd(&self) -> Option<std::os::fd::BorrowedFd<'_>> {
        use std::os::fd::AsFd;
        Some(self.file.as_fd())
    }
    fn start_writeback(&self, offset: u64, len: u64) -> io::Result<()> {
        let as_off = |n: u64| {
            i64::try_from(n).map_err(|_| io::Error::other(format!("offset {n} is out of range")))
        };
        // Linux starts the writeback of the range's dirty pages (not waiting) and drops the
        // clean ones.
        let advice = nix::fcntl::PosixFadviseAdvice::POSIX_FADV_DONTNEED;
        nix::fcntl::posix_fadvise(&self.file, as_off(offset)?, as_off(len)?, advice)?;
        Ok(())
    }
}

/// A power-loss simulator: bytes live in memory, and [`SimStorage::power_loss`] forgets
/// everything not covered by the last `sync_data` of its file (optionally keeping a torn,
/// partly garbled piece of the unsynced tail, as a real disk may).
///
/// After a power loss the disk stays off until [`SimStorage::power_on`]: every write, sync,
/// create, truncate and read fails, as on a machine that is gone. A store still running on
/// it can therefore acknowledge nothing more, and cannot scribble over the state that the
/// next store recovers from. [`SimStorage::fail_syncs`] is a gentler fault: writes land,
/// but every `fdatasync` fails (EIO), which leaves an unsynced tail behind the writer.
///
/// [`SimStorage::set_full`] simulates a full volume: allocations (and new files) fail with
/// `StorageFull` until it is called again with `false`.
#[derive(Clone, Default)]
pub struct SimStorage {
    files: Arc<Mutex<BTreeMap<u64, Arc<SimSegment>>>>,
    /// Rewrites of segments, not yet in place.
    rewrites: Arc<Mutex<BTreeMap<u64, Arc<SimSegment>>>>,
    health: Arc<AtomicU8>,
    full: Arc<AtomicBool>,
    /// Cut the power when a rewrite reaches this point for the n-th time (1 = the first).
    crash_at: Arc<Mutex<Option<(CrashPoint, usize)>>>,
}

const HEALTHY: u8 = 0;
const SYNCS_FAIL: u8 = 1;
const POWERED_OFF: u8 = 2;

struct SimSegment {
    state: Mutex<SimBytes>,
    health: Arc<AtomicU8>,
    full: Arc<AtomicBool>,
}

#[derive(Default)]
struct SimBytes {
    data: Vec<u8>,
    synced: usize,
}

impl SimStorage {
    pub fn new() -> SimStorage {
        SimStorage::default()
    }

    /// Power is cut: each file keeps its synced bytes plus `torn(unsynced_len)` bytes of
    /// its unsynced tail, the last of which may be garbled by `garble`. The disk then stays
    /// off (every operation fails) until [`SimStorage::power_on`].
    pub fn power_loss(&self, mut torn: impl FnMut(usize) -> usize, garble: Option<u8>) {
        let files = lock(&self.files);
        let rewrites = lock(&self.rewrites);
        // Off before any file is cut: a write or sync that takes a file's lock after this
        // sees the disk off, and one that took it before is either cut away (unsynced) or
        // was synced before the cut, so its acknowledgement was true.
        self.health.store(POWERED_OFF, Ordering::SeqCst);
        for segment in files.values().chain(rewrites.values()) {
            let mut bytes = lock(&segment.state);
            let unsynced = bytes.data.len() - bytes.synced;
            let keep = bytes.synced + torn(unsynced).min(unsynced);
            bytes.data.truncate(keep);
            if let (Some(mask), true) = (garble, keep > bytes.synced) {
                bytes.data[keep - 1] ^= mask.max(1);
            }
            bytes.synced = bytes.data.len();
        }
    }

    /// From now on every `fdatasync` (and create and truncate, which sync too) fails with
    /// an I/O error, while writes still land, unsynced, until [`SimStorage::power_on`].
    pub fn fail_syncs(&self) {
        let _files = lock(&self.files);
        self.health.store(SYNCS_FAIL, Ordering::SeqCst);
    }

    /// Whether the power is off (after [`SimStorage::power_loss`], or a crash point).
    pub fn is_off(&self) -> bool {
        self.health.load(Ordering::SeqCst) == POWERED_OFF
    }

    /// Power (or a healthy disk) is back: the bytes are what the fault left.
    pub fn power_on(&self) {
        let _files = lock(&self.files);
        self.health.store(HEALTHY, Ordering::SeqCst);
    }

    /// The volume is full (`true`: allocations fail) or has room again (`false`).
    pub fn set_full(&self, full: bool) {
        self.full.store(full, Ordering::SeqCst);
    }

    /// Cuts the power (every unsynced byte forgotten) the `nth` time (from 1) a rewrite
    /// reaches `point`; the rewrite then fails there, as on a machine that is gone.
    pub fn crash_at(&self, point: CrashPoint, nth: usize) {
        *lock(&self.crash_at) = Some((point, nth.max(1)));
    }

    /// A disk of its own with a copy of every file as it is now, synced bytes and unsynced
    /// alike: what a test opens to look at a live store's log. Opening a log repairs it (it
    /// drops a torn tail, removes a rewrite in progress), which on the store's own disk
    /// would cut the append it is writing or the rewrite it is making. Taken under the file
    /// set's lock, so a rewrite is seen either in place or not at all.
    pub fn snapshot(&self) -> SimStorage {
        let files = lock(&self.files);
        let rewrites = lock(&self.rewrites);
        let copy = SimStorage {
            health: Arc::new(AtomicU8::new(self.health.load(Ordering::SeqCst))),
            full: Arc::new(AtomicBool::new(self.full.load(Ordering::SeqCst))),
            ..SimStorage::default()
        };
        let copy_of = |segments: &BTreeMap<u64, Arc<SimSegment>>| {
            let segments = segments.iter().map(|(base, segment)| {
                let bytes = lock(&segment.state);
                let bytes = SimBytes {
                    data: bytes.data.clone(),
                    synced: bytes.synced,
                };
                (*base, copy.new_segment(bytes))
            });
            segments.collect::<BTreeMap<_, _>>()
        };
        *lock(&copy.files) = copy_of(&files);
        *lock(&copy.rewrites) = copy_of(&rewrites);
        copy
    }

    /// A file of this disk holding `bytes`.
    fn new_segment(&self, bytes: SimBytes) -> Arc<SimSegment> {
        Arc::new(SimSegment {
            state: Mutex::new(bytes),
            health: self.health.clone(),
            full: self.full.clone(),
        })
    }

    /// Every byte of every file, segments and rewrites alike (to look for what must be gone).
    pub fn all_bytes(&self) -> Vec<u8> {
        let files = lock(&self.files);
        let rewrites = lock(&self.rewrites);
        let mut all = Vec::new();
        for segment in files.values().chain(rewrites.values()) {
            all.extend_from_slice(&lock(&segment.state).data);
        }
        all
    }

    /// Total bytes across all files (for tests that corrupt a chosen byte).
    pub fn total_len(&self) -> u64 {
        lock(&self.files)
            .values()
            .map(|s| lock(&s.state).data.len() as u64)
            .sum()
    }

    /// Applies `edit` to the bytes of the last segment, as a disk fault would, and marks
    /// the result synced.
    pub fn corrupt(&self, edit: impl FnOnce(&mut Vec<u8>)) {
        let last = lock(&self.files).keys().next_back().copied();
        if let Some(base) = last {
            self.corrupt_segment(base, edit);
        }
    }

    /// Applies `edit` to the bytes of the segment starting at log offset `base` (one of
    /// [`Storage::list`]) and marks the result synced; `false` if there is no such segment.
    pub fn corrupt_segment(&self, base: u64, edit: impl FnOnce(&mut Vec<u8>)) -> bool {
        let Some(segment) = lock(&self.files).get(&base).cloned() else {
            return false;
        };
        let mut bytes = lock(&segment.state);
        edit(&mut bytes.data);
        bytes.synced = bytes.data.len();
        true
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Fails if the simulated disk is off, or if `syncs` and syncs are failing. Called under
/// the lock of the file (or file set) at hand, so a fault never lands halfway through one.
fn check_health(health: &AtomicU8, syncs: bool) -> io::Result<()> {
    match health.load(Ordering::SeqCst) {
        POWERED_OFF => Err(io::Error::other("simulated power loss: the disk is off")),
        SYNCS_FAIL if syncs => Err(io::Error::other("simulated EIO from fdatasync")),
        _ => Ok(()),
    }
}

impl Storage for SimStorage {
    fn list(&self) -> io::Result<Vec<u64>> {
        let files = lock(&self.files);
        check_health(&self.health, false)?;
        Ok(files.keys().copied().collect())
    }
    fn open(&self, base: u64) -> io::Result<Arc<dyn SegmentFile>> {
        let files = lock(&self.files);
        check_health(&self.health, false)?;
        match files.get(&base) {
            Some(s) => Ok(s.clone()),
            None => Err(io::ErrorKind::NotFound.into()),
        }
    }
    fn create(&self, base: u64) -> io::Result<Arc<dyn SegmentFile>> {
        let mut files = lock(&self.files);
        // Creating a segment syncs the file and its directory.
        check_health(&self.health, true)?;
        if self.full.load(Ordering::SeqCst) {
            return Err(io::ErrorKind::StorageFull.into());
        }
        let segment = self.new_segment(SimBytes::default());
        files.insert(base, segment.clone());
        Ok(segment)
    }
    /// A simulated volume has no size: it is full only when allocations fail.
    fn low_space(&self) -> io::Result<Option<String>> {
        let _files = lock(&self.files);
        check_health(&self.health, false)?;
        Ok(None)
    }
    fn create_rewrite(&self, base: u64) -> io::Result<Arc<dyn SegmentFile>> {
        let mut rewrites = lock(&self.rewrites);
        check_health(&self.health, false)?;
        if self.full.load(Ordering::SeqCst) {
            return Err(io::ErrorKind::StorageFull.into());
        }
        let segment = self.new_segment(SimBytes::default());
        rewrites.insert(base, segment.clone());
        Ok(segment)
    }
    /// The rename and the directory's fsync, as one step: a cut before it leaves the old
    /// segment, a cut after it the new one (a real disk may show either until the directory
    /// is synced; both are whole, so both are tested through the points around it).
    fn install_rewrite(&self, base: u64) -> io::Result<()> {
        let mut files = lock(&self.files);
        let mut rewrites = lock(&self.rewrites);
        check_health(&self.health, true)?;
        let segment = rewrites.remove(&base).ok_or(io::ErrorKind::NotFound)?;
        files.insert(base, segment);
        Ok(())
    }
    fn remove_rewrite(&self, base: Option<u64>) -> io::Result<()> {
        let mut rewrites = lock(&self.rewrites);
        check_health(&self.health, true)?;
        match base {
            Some(base) => {
                rewrites.remove(&base);
            }
            None => rewrites.clear(),
        }
        Ok(())
    }
    fn crash_point(&self, point: CrashPoint) -> io::Result<()> {
        let cut = {
            let mut armed = lock(&self.crash_at);
            match armed.as_mut() {
                Some((at, n)) if *at == point => {
                    *n -= 1;
                    let cut = *n == 0;
                    if cut {
                        *armed = None;
                    }
                    cut
                }
                _ => false,
            }
        };
        if cut {
            self.power_loss(|_| 0, None);
        }
        check_health(&self.health, false)
    }
}

impl SegmentFile for SimSegment {
    fn size(&self) -> io::Result<u64> {
        let bytes = lock(&self.state);
        check_health(&self.health, false)?;
        Ok(bytes.data.len() as u64)
    }
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> io::Result<()> {
        let bytes = lock(&self.state);
        check_health(&self.health, false)?;
        let start = usize::try_from(offset).map_err(|_| io::ErrorKind::UnexpectedEof)?;
        let src = bytes
            .data
            .get(start..start + buf.len())
            .ok_or(io::ErrorKind::UnexpectedEof)?;
        buf.copy_from_slice(src);
        Ok(())
    }
    fn write_all_at(&self, data: &[u8], offset: u64) -> io::Result<()> {
        let mut bytes = lock(&self.state);
        check_health(&self.health, false)?;
        let start = offset as usize;
        if bytes.data.len() < start + data.len() {
            bytes.data.resize(start + data.len(), 0);
        }
        bytes.data[start..start + data.len()].copy_from_slice(data);
        Ok(())
    }
    fn allocate(&self, _offset: u64, _len: u64) -> io::Result<()> {
        let _bytes = lock(&self.state);
        check_health(&self.health, false)?;
        if self.full.load(Ordering::SeqCst) {
            return Err(io::ErrorKind::StorageFull.into());
        }
        Ok(())
    }
    fn sync_data(&self) -> io::Result<()> {
        let mut bytes = lock(&self.state);
        check_health(&self.health, true)?;
        bytes.synced = bytes.data.len();
        Ok(())
    }
    fn truncate(&self, len: u64) -> io::Result<()> {
        let mut bytes = lock(&self.state);
        check_health(&self.health, true)?;
        bytes.data.truncate(len as usize);
        bytes.synced = bytes.data.len();
        Ok(())
    }
}
