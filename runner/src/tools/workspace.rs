//! A session's workspace directory and the rule that file tools stay inside it: `..` is
//! refused, absolute paths must point into the workspace, and every open happens beneath
//! the workspace directory with `openat2(RESOLVE_BENEATH | RESOLVE_NO_MAGICLINKS)`, so a
//! symbolic link (even one a bash call plants between a check and the open) cannot lead
//! out: the kernel refuses the resolution itself.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};

use nix::errno::Errno;
use nix::fcntl::{openat2, OFlag, OpenHow, ResolveFlag};
use nix::sys::stat::{mkdirat, Mode};
use nix::unistd::{fchown, Gid, Uid};

use super::sandbox::Ids;

/// The private temporary directory inside each workspace (the tools' `TMPDIR`).
const TMP_DIR: &str = ".tmp";

/// `<workspace-root>/<session_id>/`, created on first use, held in canonical form.
#[derive(Debug)]
pub struct Workspace {
    dir: PathBuf,
    handle: OwnedFd,
    /// The tool user, who owns the workspace and everything the file tools create in it.
    owner: Option<Ids>,
}

impl Workspace {
    /// Creates (if needed) and opens the workspace of `session_id` under `root`, owned by
    /// `owner` (mode 0700) when given.
    pub async fn open(root: &Path, session_id: &str, owner: Option<Ids>) -> io::Result<Workspace> {
        // The store only accepts ids of [A-Za-z0-9._:-] starting with a letter or digit,
        // which can never name a parent directory; checked again because this is a path.
        if session_id.is_empty()
            || session_id.starts_with('.')
            || session_id.contains(['/', '\\', '\0'])
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("session id {session_id:?} cannot name a workspace directory"),
            ));
        }
        let dir = root.join(session_id);
        tokio::fs::create_dir_all(dir.join(TMP_DIR)).await?;
        let dir = tokio::fs::canonicalize(&dir).await?;
        tokio::task::spawn_blocking(move || {
            if let Some(ids) = owner {
                for path in [dir.join(TMP_DIR), dir.clone()] {
                    std::os::unix::fs::chown(&path, Some(ids.uid), Some(ids.gid))?;
                    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o700))?;
                }
            }
            let handle = nix::fcntl::open(
                &dir,
                OFlag::O_PATH | OFlag::O_DIRECTORY | OFlag::O_CLOEXEC,
                Mode::empty(),
            )?;
            Ok(Workspace { dir, handle, owner })
        })
        .await?
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The tools' private `TMPDIR`.
    pub fn tmp_dir(&self) -> PathBuf {
        self.dir.join(TMP_DIR)
    }

    /// The path, relative to the workspace, that `path` names (empty for the workspace
    /// itself): `..` is refused and an absolute path must lie inside the workspace.
    pub fn relative(&self, path: &str) -> Result<PathBuf, String> {
        let requested = Path::new(path);
        if requested
            .components()
            .any(|c| matches!(c, Component::ParentDir))
        {
            return Err(format!(
                "`{path}`: `..` is not allowed; use a path inside the workspace"
            ));
        }
        let relative = if requested.is_absolute() {
            requested.strip_prefix(&self.dir).map_err(|_| {
                format!(
                    "`{path}` is outside the workspace {}; use a relative path",
                    self.dir.display()
                )
            })?
        } else {
            requested
        };
        Ok(relative
            .components()
            .filter(|c| matches!(c, Component::Normal(_)))
            .collect())
    }

    /// Opens `relative` (from [`Workspace::relative`]) beneath the workspace. `shown` is
    /// the path as the model gave it, for the error message.
    pub fn open_beneath(
        &self,
        relative: &Path,
        flags: OFlag,
        shown: &str,
    ) -> Result<OwnedFd, String> {
        let target: &Path = if relative.as_os_str().is_empty() {
            Path::new(".")
        } else {
            relative
        };
        let mut how = OpenHow::new()
            .flags(flags | OFlag::O_CLOEXEC)
            .resolve(ResolveFlag::RESOLVE_BENEATH | ResolveFlag::RESOLVE_NO_MAGICLINKS);
        // openat2 refuses a mode without O_CREAT.
        if flags.contains(OFlag::O_CREAT) {
            how = how.mode(Mode::from_bits_truncate(0o644));
        }
        let fd = openat2(self.handle.as_fd(), target, how).map_err(|e| describe(shown, e))?;
        if flags.contains(OFlag::O_CREAT) {
            self.give_to_owner(&fd, shown)?;
        }
        Ok(fd)
    }

    /// Creates the directories of `relative` that are missing, each beneath the one before.
    pub fn create_dirs(&self, relative: &Path, shown: &str) -> Result<(), String> {
        let mut parent = PathBuf::new();
        for part in relative.iter() {
            let dir = self.open_beneath(&parent, OFlag::O_PATH | OFlag::O_DIRECTORY, shown)?;
            match mkdirat(dir.as_fd(), part, Mode::from_bits_truncate(0o755)) {
                Ok(()) => {
                    parent.push(part);
                    let created =
                        self.open_beneath(&parent, OFlag::O_RDONLY | OFlag::O_DIRECTORY, shown)?;
                    self.give_to_owner(&created, shown)?;
                }
                Err(Errno::EEXIST) => parent.push(part),
                Err(e) => return Err(describe(shown, e)),
            }
        }
        Ok(())
    }

    fn give_to_owner(&self, fd: &OwnedFd, shown: &str) -> Result<(), String> {
        match self.owner {
            Some(ids) => fchown(
                fd.as_fd(),
                Some(Uid::from_raw(ids.uid)),
                Some(Gid::from_raw(ids.gid)),
            )
            .map_err(|e| format!("cannot give `{shown}` to the tool user: {e}")),
            None => Ok(()),
        }
    }
}

/// An open error as the model should read it.
fn describe(shown: &str, e: Errno) -> String {
    match e {
        Errno::EXDEV | Errno::ELOOP => {
            format!("`{shown}` leads outside the workspace through a symbolic link")
        }
        Errno::ENOENT => format!("`{shown}`: no such file or directory"),
        Errno::ENOTDIR => format!("`{shown}`: a part of the path is not a directory"),
        Errno::EISDIR => format!("`{shown}` is a directory"),
        other => format!("`{shown}`: {}", io::Error::from(other)),
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    async fn workspace() -> (tempfile::TempDir, Workspace) {
        let root = tempfile::tempdir().expect("temp dir");
        let ws = Workspace::open(root.path(), "s1", None)
            .await
            .expect("workspace");
        (root, ws)
    }

    #[tokio::test]
    async fn paths_are_made_relative_to_the_workspace() {
        let (_root, ws) = workspace().await;
        assert_eq!(ws.relative("src/new.rs"), Ok(PathBuf::from("src/new.rs")));
        assert_eq!(ws.relative("./a/b"), Ok(PathBuf::from("a/b")));
        assert_eq!(ws.relative(""), Ok(PathBuf::new()));
        let absolute = ws.dir().join("src");
        assert_eq!(
            ws.relative(&absolute.to_string_lossy()),
            Ok(PathBuf::from("src"))
        );
        assert!(ws.tmp_dir().is_dir());
    }

    #[tokio::test]
    async fn escapes_are_refused() {
        let (root, ws) = workspace().await;
        assert!(ws
            .relative("../s2/x")
            .unwrap_err()
            .contains("`..` is not allowed"));
        assert!(ws.relative("a/../../x").is_err());
        assert!(ws
            .relative("/etc/passwd")
            .unwrap_err()
            .contains("outside the workspace"));

        std::fs::create_dir(root.path().join("secret")).expect("mkdir");
        symlink(root.path().join("secret"), ws.dir().join("out")).expect("symlink");
        symlink("../../", ws.dir().join("up")).expect("symlink");
        for path in ["out/x", "up/x", "out"] {
            let err = ws
                .open_beneath(Path::new(path), OFlag::O_RDONLY, path)
                .unwrap_err();
            assert!(err.contains("symbolic link"), "{path}: {err}");
        }
        assert!(ws
            .create_dirs(Path::new("out/a/b"), "out/a/b")
            .unwrap_err()
            .contains("symbolic link"));
        assert!(!root.path().join("secret/a").exists());
        std::fs::create_dir(ws.dir().join("inner")).expect("mkdir");
        symlink("inner", ws.dir().join("loop_in")).expect("symlink");
        std::fs::write(ws.dir().join("inner/f"), "in").expect("write");
        assert!(ws
            .open_beneath(Path::new("loop_in/f"), OFlag::O_RDONLY, "loop_in/f")
            .is_ok());
    }

    #[tokio::test]
    async fn session_ids_cannot_escape_the_root() {
        let root = tempfile::tempdir().expect("temp dir");
        assert!(Workspace::open(root.path(), "..", None).await.is_err());
        assert!(Workspace::open(root.path(), "a/b", None).await.is_err());
    }
}
