//! A session's workspace directory and the rule that file tools stay inside it: `..` is
//! refused, absolute paths must point into the workspace, and a path whose existing part
//! resolves (through symbolic links) outside the workspace is refused.

use std::io;
use std::path::{Component, Path, PathBuf};

/// `<workspace-root>/<session_id>/`, created on first use, held in canonical form.
#[derive(Debug, Clone)]
pub struct Workspace {
    dir: PathBuf,
}

impl Workspace {
    /// Creates (if needed) and opens the workspace of `session_id` under `root`.
    pub async fn open(root: &Path, session_id: &str) -> io::Result<Workspace> {
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
        tokio::fs::create_dir_all(&dir).await?;
        Ok(Workspace {
            dir: tokio::fs::canonicalize(&dir).await?,
        })
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The real path `path` names inside the workspace (the workspace itself for `""` or
    /// `"."`). The part of it that exists is resolved through symbolic links; the rest does
    /// not exist yet and, holding no `..`, can only be created inside.
    pub fn resolve(&self, path: &str) -> Result<PathBuf, String> {
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
        let parts: Vec<&std::ffi::OsStr> = relative
            .components()
            .filter_map(|c| match c {
                Component::Normal(part) => Some(part),
                _ => None,
            })
            .collect();

        // The longest prefix that exists (a dangling link counts as existing: writing
        // through it would create its target, wherever that is).
        let mut existing = parts.len();
        while existing > 0 {
            let prefix: PathBuf = self
                .dir
                .iter()
                .chain(parts[..existing].iter().copied())
                .collect();
            if prefix.symlink_metadata().is_ok() {
                break;
            }
            existing -= 1;
        }
        let prefix: PathBuf = self
            .dir
            .iter()
            .chain(parts[..existing].iter().copied())
            .collect();
        let real = prefix.canonicalize().map_err(|e| {
            format!(
                "`{path}`: cannot resolve {} ({e}); a symbolic link may point nowhere",
                prefix.display()
            )
        })?;
        if !real.starts_with(&self.dir) {
            return Err(format!(
                "`{path}` leads outside the workspace through a symbolic link"
            ));
        }
        Ok(real
            .iter()
            .chain(parts[existing..].iter().copied())
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::symlink;

    use super::*;

    async fn workspace() -> (tempfile::TempDir, Workspace) {
        let root = tempfile::tempdir().expect("temp dir");
        let ws = Workspace::open(root.path(), "s1").await.expect("workspace");
        (root, ws)
    }

    #[tokio::test]
    async fn inside_paths_resolve_and_new_paths_stay_inside() {
        let (_root, ws) = workspace().await;
        std::fs::create_dir(ws.dir().join("src")).expect("mkdir");
        assert_eq!(ws.resolve("src/new.rs"), Ok(ws.dir().join("src/new.rs")));
        assert_eq!(ws.resolve("./a/b"), Ok(ws.dir().join("a/b")));
        assert_eq!(ws.resolve(""), Ok(ws.dir().to_path_buf()));
        let absolute = ws.dir().join("src");
        assert_eq!(ws.resolve(&absolute.to_string_lossy()), Ok(absolute));
    }

    #[tokio::test]
    async fn escapes_are_refused() {
        let (root, ws) = workspace().await;
        assert!(ws
            .resolve("../s2/x")
            .unwrap_err()
            .contains("`..` is not allowed"));
        assert!(ws.resolve("a/../../x").is_err());
        assert!(ws
            .resolve("/etc/passwd")
            .unwrap_err()
            .contains("outside the workspace"));

        std::fs::create_dir(root.path().join("secret")).expect("mkdir");
        symlink(root.path().join("secret"), ws.dir().join("out")).expect("symlink");
        assert!(ws.resolve("out/x").unwrap_err().contains("symbolic link"));
        symlink(root.path().join("nowhere"), ws.dir().join("dangling")).expect("symlink");
        assert!(ws.resolve("dangling").is_err());
        symlink(ws.dir().join("inner"), ws.dir().join("loop_in")).expect("symlink");
        std::fs::create_dir(ws.dir().join("inner")).expect("mkdir");
        assert_eq!(ws.resolve("loop_in/f"), Ok(ws.dir().join("inner/f")));
    }

    #[tokio::test]
    async fn session_ids_cannot_escape_the_root() {
        let root = tempfile::tempdir().expect("temp dir");
        assert!(Workspace::open(root.path(), "..").await.is_err());
        assert!(Workspace::open(root.path(), "a/b").await.is_err());
    }
}
