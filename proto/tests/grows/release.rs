//! The last release and its proto, as the repository records them.
//!
//! [`last_release`] reads `CHANGELOG.md`: the last release is the first heading from the
//! top of the form `## X.Y.Z — <full commit hash>` (a heading such as `## 0.2.0 (not
//! released yet)` names no commit and is skipped; any other text after a version is an
//! error, so that a mistyped release is never passed over for an older one). [`release_proto`] takes the `.proto`
//! files under `proto/agentlog/` at that commit out of git history and compiles them with
//! protox, as `build.rs` compiles the tree's. Anything missing (git itself, the commit in a
//! shallow clone, a release heading that cannot be read) is an error that says what to fix,
//! never an empty proto that would pass every check.

use std::io;
use std::path::{Path, PathBuf};
use std::process::Command;

use prost_types::FileDescriptorSet;

/// The include root of the proto files, as `build.rs` compiles them.
const PROTO_ROOT: &str = "proto";
/// Every `.proto` file under it is part of a release's proto.
const PROTO_DIR: &str = "proto/agentlog";

/// A release named in `CHANGELOG.md`: its version and full commit hash.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Release {
    pub version: String,
    pub commit: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ReleaseError {
    #[error("cannot read {path}: {source}")]
    ReadChangelog { path: PathBuf, source: io::Error },
    #[error(
        "CHANGELOG.md names no release: the last release is its first heading of the form \
         `## X.Y.Z — <full commit hash>`"
    )]
    NoRelease,
    #[error(
        "CHANGELOG.md line {line}: `{text}` names a version but not a full 40-hex commit after \
         a dash; write `## X.Y.Z — <full commit hash>` for a release, or \
         `## X.Y.Z (not released yet)`"
    )]
    MalformedRelease { line: usize, text: String },
    #[error(
        "cannot run git ({source}): the check reads the last release's proto from git history, \
         so git must be installed and on PATH"
    )]
    GitMissing { source: io::Error },
    #[error(
        "{} is not a git checkout ({stderr}): the check reads the last release's proto \
         from git history, so it runs in a clone (with full history), not an exported tree",
        path.display()
    )]
    NotARepository { path: PathBuf, stderr: String },
    #[error(
        "commit {commit} of release {version} (CHANGELOG.md) is not in this clone's history: \
         a shallow clone lacks it (`git fetch --unshallow`), or the commit is mistyped"
    )]
    CommitMissing { version: String, commit: String },
    #[error("`git {args}` failed: {stderr}")]
    GitFailed { args: String, stderr: String },
    #[error("release {version} (commit {commit}) has no .proto file under proto/agentlog/")]
    NoProtoFiles { version: String, commit: String },
    #[error("cannot write the release's proto to a temporary directory: {0}")]
    TempDir(#[from] io::Error),
    #[error("release {version}'s proto does not compile: {source}")]
    Compile {
        version: String,
        source: protox::Error,
    },
}

/// The last release named in `changelog` (the text of `CHANGELOG.md`).
pub fn last_release(changelog: &str) -> Result<Release, ReleaseError> {
    for (index, line) in changelog.lines().enumerate() {
        let Some(heading) = line.strip_prefix("## ") else {
            continue;
        };
        let heading = heading.trim();
        let (version, rest) = heading.split_once(' ').unwrap_or((heading, ""));
        if !is_version(version) {
            continue;
        }
        let rest = rest.trim_start();
        if rest.is_empty() || rest.starts_with('(') {
            // `## 0.2.0 (not released yet)`: no commit, not a release.
            continue;
        }
        let commit = rest.strip_prefix(['—', '–', '-']).map(str::trim);
        let Some(commit) =
            commit.filter(|c| c.len() == 40 && c.bytes().all(|b| b.is_ascii_hexdigit()))
        else {
            return Err(ReleaseError::MalformedRelease {
                line: index + 1,
                text: line.to_owned(),
            });
        };
        return Ok(Release {
            version: version.to_owned(),
            commit: commit.to_ascii_lowercase(),
        });
    }
    Err(ReleaseError::NoRelease)
}

/// `X.Y.Z`, three decimal numbers.
fn is_version(text: &str) -> bool {
    let parts: Vec<&str> = text.split('.').collect();
    parts.len() == 3
        && parts
            .iter()
            .all(|part| !part.is_empty() && part.bytes().all(|b| b.is_ascii_digit()))
}

/// The last release named in the repository's `CHANGELOG.md`.
pub fn read_last_release(repository: &Path) -> Result<Release, ReleaseError> {
    let path = repository.join("CHANGELOG.md");
    let changelog = std::fs::read_to_string(&path)
        .map_err(|source| ReleaseError::ReadChangelog { path, source })?;
    last_release(&changelog)
}

/// The descriptor set of `release`'s proto, compiled from the files git holds for it.
pub fn release_proto(
    repository: &Path,
    release: &Release,
) -> Result<FileDescriptorSet, ReleaseError> {
    let git = Git { repository };
    let object = format!("{}^{{commit}}", release.commit);
    match git.run(&["cat-file", "-e", &object]) {
        Ok(_) => {}
        Err(ReleaseError::GitFailed { .. }) => {
            if let Err(ReleaseError::GitFailed { stderr, .. }) =
                git.run(&["rev-parse", "--git-dir"])
            {
                return Err(ReleaseError::NotARepository {
                    path: repository.to_owned(),
                    stderr,
                });
            }
            return Err(ReleaseError::CommitMissing {
                version: release.version.clone(),
                commit: release.commit.clone(),
            });
        }
        Err(other) => return Err(other),
    }
    let listing = git.run(&[
        "ls-tree",
        "-r",
        "--name-only",
        &release.commit,
        "--",
        PROTO_DIR,
    ])?;
    let listing = String::from_utf8_lossy(&listing);
    let paths: Vec<&str> = listing
        .lines()
        .filter(|path| path.ends_with(".proto"))
        .collect();
    if paths.is_empty() {
        return Err(ReleaseError::NoProtoFiles {
            version: release.version.clone(),
            commit: release.commit.clone(),
        });
    }
    let dir = tempfile::tempdir()?;
    let mut files = Vec::new();
    for path in paths {
        // Under the include root, as build.rs names them: `agentlog/v1/events.proto`.
        let relative =
            Path::new(path)
                .strip_prefix(PROTO_ROOT)
                .map_err(|_| ReleaseError::GitFailed {
                    args: format!("ls-tree -r --name-only {} -- {PROTO_DIR}", release.commit),
                    stderr: format!("listed {path}, which is outside {PROTO_ROOT}/"),
                })?;
        let text = git.run(&["show", &format!("{}:{path}", release.commit)])?;
        let target = dir.path().join(relative);
        if let Some(parent) = target.parent() {
            std::fs::create_dir_all(parent)?;
        }
        std::fs::write(&target, text)?;
        files.push(relative.to_owned());
    }
    protox::compile(&files, [dir.path()]).map_err(|source| ReleaseError::Compile {
        version: release.version.clone(),
        source,
    })
}

struct Git<'a> {
    repository: &'a Path,
}

impl Git<'_> {
    /// `git args` in the repository; its standard output, or an error with its stderr.
    fn run(&self, args: &[&str]) -> Result<Vec<u8>, ReleaseError> {
        let output = Command::new("git")
            // The repository is the one this test was built from, so its owner is trusted
            // even when it is not the user running the test (root in a CI container).
            .args(["-c", "safe.directory=*", "-C"])
            .arg(self.repository)
            .args(args)
            .output()
            .map_err(|source| ReleaseError::GitMissing { source })?;
        if !output.status.success() {
            return Err(ReleaseError::GitFailed {
                args: args.join(" "),
                stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
            });
        }
        Ok(output.stdout)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_release_is_the_first_heading_with_a_commit() {
        let changelog = "# Changelog\n\n## 0.3.0 (not released yet)\n\n### Upgrading\n\
            ## 0.2.0 — 1111111111111111111111111111111111111111\n\n\
            ## 0.1.0 — c4ac4f312d1731eac9ebbff0551b87f72e079e98\n";
        let release = last_release(changelog).expect("a release");
        assert_eq!(
            release,
            Release {
                version: "0.2.0".into(),
                commit: "1111111111111111111111111111111111111111".into(),
            }
        );
    }

    #[test]
    fn a_changelog_without_a_release_is_an_error() {
        let changelog = "# Changelog\n\n## 0.1.0 (not released yet)\n";
        assert!(matches!(
            last_release(changelog),
            Err(ReleaseError::NoRelease)
        ));
    }

    #[test]
    fn a_release_heading_that_cannot_be_read_is_an_error_not_skipped() {
        // Skipping it would check the tree against an older release than the last one.
        let headings = [
            "## 0.2.0 — c4ac4f3",
            "## 0.2.0 1111111111111111111111111111111111111111",
        ];
        for heading in headings {
            let changelog =
                format!("{heading}\n\n## 0.1.0 — c4ac4f312d1731eac9ebbff0551b87f72e079e98\n");
            let error = last_release(&changelog).expect_err(heading);
            assert!(
                matches!(error, ReleaseError::MalformedRelease { line: 1, .. }),
                "{error}"
            );
        }
    }
}
