//! The local backend's snapshots: one file per (session, format) under
//! `<data-dir>/snapshots/<session_id>/<format>`, holding the seq (8 bytes, little endian)
//! and the data.
//!
//! Promises:
//! - A file is replaced whole or not at all: the new one is written beside it, fsync'd, and
//!   renamed over it (the directory fsync'd after), so a crash leaves the old snapshot or the
//!   new one, never a mix.
//! - A snapshot never replaces one with a higher seq (puts of one session are serialised).
//! - A snapshot is derived data: losing one costs a reader a longer read of the log, never
//!   correctness, so the directory is not part of recovery and the log never refers to it.
//! - A deleted session's snapshots go with it: its directory is removed once its tombstone
//!   is durable (and again by the reclamation that erases the session, and at open for one
//!   awaiting it: a deletion a crash cut short), and a put that checks
//!   the session while removals are held off can never write one back.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::backend::Snapshot;
use crate::StoreError;

const SEQ_BYTES: usize = 8;

/// The snapshot files of one store.
#[derive(Debug)]
pub struct SnapshotDir {
    dir: PathBuf,
    /// Serialises puts, so that the seq check and the rename are one step.
    writing: Mutex<()>,
}

impl SnapshotDir {
    /// Snapshots under `dir` (created when the first one is written).
    pub fn new(dir: PathBuf) -> SnapshotDir {
        SnapshotDir {
            dir,
            writing: Mutex::new(()),
        }
    }

    fn path(&self, session_id: &str, format: &str) -> PathBuf {
        // Both are validated by the service: no `/`, no leading `.`.
        self.dir.join(session_id).join(format)
    }

    /// Keeps `snapshot` unless a newer one is kept; returns the seq of the kept one.
    /// `allowed` decides whether it may be kept at all, called while puts and removals are
    /// held off.
    pub fn put(
        &self,
        snapshot: &Snapshot,
        allowed: impl FnOnce() -> Result<(), StoreError>,
    ) -> Result<u64, StoreError> {
        let _writing = self.writing.lock().unwrap_or_else(|p| p.into_inner());
        allowed()?;
        let path = self.path(&snapshot.session_id, &snapshot.format);
        if let Some(kept) = read_seq(&path)? {
            if kept > snapshot.seq {
                return Ok(kept);
            }
        }
        let session_dir = path.parent().unwrap_or(&self.dir);
        let created = !session_dir.exists();
        std::fs::create_dir_all(session_dir).map_err(|e| io_error(session_dir, e))?;
        if created {
            sync_dir(&self.dir)?;
        }
        // Formats start with a letter or digit, so no format names this file.
        let tmp = session_dir.join(format!(".{}.tmp", snapshot.format));
        let mut file = std::fs::File::create(&tmp).map_err(|e| io_error(&tmp, e))?;
        file.write_all(&snapshot.seq.to_le_bytes())
            .and_then(|()| file.write_all(&snapshot.data))
            .and_then(|()| file.sync_data())
            .map_err(|e| io_error(&tmp, e))?;
        drop(file);
        std::fs::rename(&tmp, &path).map_err(|e| io_error(&path, e))?;
        sync_dir(session_dir)?;
        Ok(snapshot.seq)
    }

    /// Removes every snapshot of these sessions (deleted ones), durably.
    pub fn remove_sessions<'a>(
        &self,
        session_ids: impl IntoIterator<Item = &'a str>,
    ) -> std::io::Result<()> {
        let _writing = self.writing.lock().unwrap_or_else(|p| p.into_inner());
        let mut removed = false;
        for session_id in session_ids {
            match std::fs::remove_dir_all(self.dir.join(session_id)) {
                Ok(()) => removed = true,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        if removed {
            std::fs::File::open(&self.dir)?.sync_all()?;
        }
        Ok(())
    }

    /// The kept snapshot of `format`, if any, opened: its seq read, its data to come.
    pub fn open(&self, session_id: &str, format: &str) -> Result<Option<SnapshotFile>, StoreError> {
        use std::io::Read;
        let path = self.path(session_id, format);
        let mut file = match std::fs::File::open(&path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(io_error(&path, e)),
        };
        let mut header = [0u8; SEQ_BYTES];
        match file.read_exact(&mut header) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return Err(StoreError::Internal(format!(
                    "snapshot file {} is shorter than its header",
                    path.display()
                )))
            }
            Err(e) => return Err(io_error(&path, e)),
        }
        Ok(Some(SnapshotFile {
            seq: u64::from_le_bytes(header),
            file,
            path,
        }))
    }
}

/// A kept snapshot being read. It stays the snapshot it was when opened, even if a newer
/// one is renamed over it meanwhile.
#[derive(Debug)]
pub struct SnapshotFile {
    pub seq: u64,
    file: std::fs::File,
    path: PathBuf,
}

impl SnapshotFile {
    /// The next piece of the data, at most `max` bytes; `None` at its end.
    pub fn read_piece(&mut self, max: usize) -> Result<Option<Vec<u8>>, StoreError> {
        use std::io::Read;
        let mut piece = Vec::with_capacity(max);
        (&mut self.file)
            .take(max as u64)
            .read_to_end(&mut piece)
            .map_err(|e| io_error(&self.path, e))?;
        Ok((!piece.is_empty()).then_some(piece))
    }
}

/// The seq of the snapshot kept at `path`, if any.
fn read_seq(path: &Path) -> Result<Option<u64>, StoreError> {
    use std::io::Read;
    let mut header = [0u8; SEQ_BYTES];
    match std::fs::File::open(path).and_then(|mut f| f.read_exact(&mut header)) {
        Ok(()) => Ok(Some(u64::from_le_bytes(header))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        // A file cut short (it cannot be, after a rename; but never trust it): replace it.
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => Ok(None),
        Err(e) => Err(io_error(path, e)),
    }
}

fn sync_dir(dir: &Path) -> Result<(), StoreError> {
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io_error(dir, e))
}

fn io_error(path: &Path, e: std::io::Error) -> StoreError {
    if e.raw_os_error() == Some(28) {
        return StoreError::ResourceExhausted(format!(
            "no room for the snapshot at {}: the volume is full",
            path.display()
        ));
    }
    StoreError::Internal(format!("snapshot file {}: {e}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn snapshot(seq: u64, data: &[u8]) -> Snapshot {
        Snapshot {
            session_id: "s1".into(),
            format: "fold".into(),
            seq,
            data: data.to_vec(),
        }
    }

    /// The kept snapshot, read whole in small pieces.
    fn read(snapshots: &SnapshotDir, format: &str) -> Option<Snapshot> {
        let mut file = snapshots.open("s1", format).unwrap()?;
        let mut data = Vec::new();
        while let Some(piece) = file.read_piece(2).unwrap() {
            assert!(piece.len() <= 2);
            data.extend(piece);
        }
        Some(Snapshot {
            session_id: "s1".into(),
            format: format.into(),
            seq: file.seq,
            data,
        })
    }

    #[test]
    fn the_newest_snapshot_is_kept_and_an_older_one_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let snapshots = SnapshotDir::new(dir.path().join("snapshots"));
        assert_eq!(read(&snapshots, "fold"), None);
        let put = |s: Snapshot| snapshots.put(&s, || Ok(())).unwrap();
        assert_eq!(put(snapshot(10, b"ten")), 10);
        assert_eq!(put(snapshot(7, b"seven")), 10);
        assert_eq!(read(&snapshots, "fold"), Some(snapshot(10, b"ten")));
        assert_eq!(put(snapshot(12, b"")), 12);
        assert_eq!(read(&snapshots, "fold"), Some(snapshot(12, b"")));
        assert_eq!(read(&snapshots, "other"), None);
        // Reopened (a restarted store), the kept snapshot is still there.
        let reopened = SnapshotDir::new(dir.path().join("snapshots"));
        assert_eq!(read(&reopened, "fold"), Some(snapshot(12, b"")));
    }

    #[test]
    fn a_deleted_sessions_snapshots_are_removed_and_a_refused_put_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let snapshots = SnapshotDir::new(dir.path().join("snapshots"));
        snapshots.put(&snapshot(3, b"three"), || Ok(())).unwrap();
        snapshots.remove_sessions(["s1", "never-had-one"]).unwrap();
        assert_eq!(read(&snapshots, "fold"), None);
        assert!(!dir.path().join("snapshots/s1").exists());
        let refused = snapshots.put(&snapshot(4, b"four"), || {
            Err(StoreError::Internal("deleted".into()))
        });
        assert!(refused.is_err());
        assert!(!dir.path().join("snapshots/s1").exists());
    }
}
