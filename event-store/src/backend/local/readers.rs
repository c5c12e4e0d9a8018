//! Which releases can read a data directory: `<data-dir>/release.json`, checked before
//! anything else of the directory is opened and written once it is found readable.
//!
//! `{"readableBy":"0.1.0","openedBy":"0.2.0-dev"}` says that every release from
//! `readableBy` on reads the directory rightly, and which release opened it last. This
//! build changes nothing that release 0.1.0 cannot read, so it keeps `readableBy` as it
//! found it (0.1.0 for a directory without the file). A later release that changes the
//! data in a way this build would misread raises `readableBy` to itself, and this build
//! then refuses to start, naming the release it needs: a rollback never serves data it
//! misreads. (Release 0.1.0 does not read this file: a release that makes 0.1.0's reading
//! wrong must make it refuse by a check 0.1.0 has, such as a record kind it does not know in
//! a sealed segment.)
//!
//! The file is written beside its place, fsync'd and renamed over it, so a crash leaves
//! the old one or the new one.

use std::io::Write;
use std::path::Path;

use agentlog_proto::release::{Release, VERSION};
use serde::{Deserialize, Serialize};

/// The file's name in the data directory.
pub const FILE: &str = "release.json";

/// The oldest release that reads what this build writes.
const READABLE_BY: Release = Release::FIRST;

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
struct Readers {
    readable_by: String,
    opened_by: String,
}

/// Why a data directory is not this build's to open.
#[derive(Debug, thiserror::Error)]
pub enum ReadersError {
    #[error(
        "the data directory {dir} was written by agentlog {opened_by} in a form that needs \
         release {needed} or later to read; run event-store {needed} or later on it (this is \
         {VERSION})"
    )]
    TooNew {
        dir: String,
        needed: String,
        opened_by: String,
    },
    #[error(
        "{0}: {1}; it says which releases read this data directory, as JSON like {example}",
        example = r#"{"readableBy":"0.1.0","openedBy":"0.2.0"}"#
    )]
    Unreadable(String, String),
    #[error("{0}: {1}")]
    Io(String, std::io::Error),
}

/// Checks that this build reads `data_dir`, then records it as the last to open it.
pub fn check_and_mark(data_dir: &Path) -> Result<(), ReadersError> {
    let path = data_dir.join(FILE);
    let shown = path.display().to_string();
    let readable_by = match std::fs::read(&path) {
        Ok(bytes) => {
            let readers: Readers = serde_json::from_slice(&bytes)
                .map_err(|e| ReadersError::Unreadable(shown.clone(), e.to_string()))?;
            let needed = Release::parse(&readers.readable_by).ok_or_else(|| {
                ReadersError::Unreadable(
                    shown.clone(),
                    format!("readableBy {:?} is not a version", readers.readable_by),
                )
            })?;
            if needed > Release::this() {
                return Err(ReadersError::TooNew {
                    dir: data_dir.display().to_string(),
                    needed: readers.readable_by,
                    opened_by: readers.opened_by,
                });
            }
            needed.max(READABLE_BY)
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => READABLE_BY,
        Err(e) => return Err(ReadersError::Io(shown, e)),
    };
    let readers = Readers {
        readable_by: readable_by.to_string(),
        opened_by: VERSION.to_string(),
    };
    write(data_dir, &readers).map_err(|e| ReadersError::Io(shown, e))
}

fn write(data_dir: &Path, readers: &Readers) -> std::io::Result<()> {
    let json = serde_json::to_vec(readers).map_err(std::io::Error::other)?;
    let partial = data_dir.join(format!("{FILE}.partial"));
    let mut file = std::fs::File::create(&partial)?;
    file.write_all(&json)?;
    file.write_all(b"\n")?;
    file.sync_all()?;
    std::fs::rename(&partial, data_dir.join(FILE))?;
    std::fs::File::open(data_dir)?.sync_all()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(dir: &Path) -> Readers {
        serde_json::from_slice(&std::fs::read(dir.join(FILE)).unwrap()).unwrap()
    }

    #[test]
    fn a_new_or_older_directory_is_marked_readable_by_the_first_release() {
        let dir = tempfile::tempdir().unwrap();
        check_and_mark(dir.path()).unwrap();
        let readers = read(dir.path());
        assert_eq!(readers.readable_by, "0.1.0");
        assert_eq!(readers.opened_by, VERSION);
        // Opened again: the same.
        check_and_mark(dir.path()).unwrap();
        assert_eq!(read(dir.path()).readable_by, "0.1.0");
    }

    #[test]
    fn a_directory_a_later_release_changed_is_refused_naming_the_release_it_needs() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join(FILE),
            r#"{"readableBy":"9.4.0","openedBy":"9.4.1"}"#,
        )
        .unwrap();
        let e = check_and_mark(dir.path()).unwrap_err().to_string();
        assert!(e.contains("9.4.0 or later"), "{e}");
        assert!(e.contains("9.4.1"), "{e}");
        // Untouched.
        assert_eq!(read(dir.path()).readable_by, "9.4.0");
        std::fs::write(dir.path().join(FILE), "not json").unwrap();
        assert!(matches!(
            check_and_mark(dir.path()),
            Err(ReadersError::Unreadable(..))
        ));
    }
}
