//! Finds the commit the binaries are built from: `AGENTLOG_COMMIT` if set (a build without
//! the repository, such as a container build from an exported tree), else `git rev-parse
//! HEAD` of this checkout, else `unknown`. Runs again whenever HEAD moves, so a binary never
//! names a commit it was not built from.

use std::path::PathBuf;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn main() {
    println!("cargo:rerun-if-env-changed=AGENTLOG_COMMIT");
    let commit = match std::env::var("AGENTLOG_COMMIT") {
        Ok(commit) if !commit.is_empty() => commit,
        _ => {
            // HEAD, the branch it points at, and the packed refs: any of them moves on a commit.
            for path in ["HEAD", "packed-refs"] {
                if let Some(p) = git(&["rev-parse", "--git-path", path]) {
                    println!("cargo:rerun-if-changed={}", absolute(p).display());
                }
            }
            if let Some(branch) = git(&["symbolic-ref", "-q", "HEAD"]) {
                if let Some(p) = git(&["rev-parse", "--git-path", &branch]) {
                    println!("cargo:rerun-if-changed={}", absolute(p).display());
                }
            }
            git(&["rev-parse", "HEAD"]).unwrap_or_else(|| "unknown".into())
        }
    };
    println!("cargo:rustc-env=AGENTLOG_COMMIT={commit}");
}

fn absolute(path: String) -> PathBuf {
    let path = PathBuf::from(path);
    if path.is_absolute() {
        path
    } else {
        std::env::current_dir()
            .map(|d| d.join(&path))
            .unwrap_or(path)
    }
}
