//! Shared by the fork tests: a side-effect counter outside every session
//! (`integration_tests::side_effects`), copies of workspaces taken while the model is being
//! asked (nothing runs in a workspace then), and a comparison of two directory trees byte
//! for byte.
#![allow(dead_code)] // each test file uses its own subset

use std::collections::BTreeMap;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Arc, Mutex};

use serde_json::Value;

/// Copies of the workspaces under a root, one per model request: `copies/<i>/<session>`.
#[derive(Clone)]
pub struct Copies {
    pub dir: PathBuf,
    /// Per request: how many tool results it carried.
    pub taken: Arc<Mutex<Vec<usize>>>,
}

impl Copies {
    /// Copies every workspace under `root` (not the checkpoint area) at each request.
    pub fn hook(root: &Path, dir: &Path) -> (Copies, impl Fn(&Value) + Send + Sync + 'static) {
        let copies = Copies {
            dir: dir.to_path_buf(),
            taken: Arc::new(Mutex::new(Vec::new())),
        };
        let (root, this) = (root.to_path_buf(), copies.clone());
        let hook = move |request: &Value| {
            let mut taken = this.taken.lock().unwrap_or_else(|p| p.into_inner());
            let into = this.dir.join(taken.len().to_string());
            std::fs::create_dir_all(&into).expect("copy dir");
            for entry in std::fs::read_dir(&root).expect("workspace root").flatten() {
                if entry.file_name() == ".checkpoints" {
                    continue;
                }
                let status = Command::new("cp")
                    .arg("-a")
                    .arg(entry.path())
                    .arg(&into)
                    .status()
                    .expect("cp -a");
                assert!(status.success(), "cp -a {}", entry.path().display());
            }
            taken.push(tool_results(request));
        };
        (copies, hook)
    }

    pub fn count(&self) -> usize {
        self.taken.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    /// The copy of `session` at request `i` (an empty map if it had no workspace yet).
    pub fn of(&self, i: usize, session: &str, left_out: &[&str]) -> BTreeMap<String, String> {
        describe(&self.dir.join(i.to_string()).join(session), left_out)
    }

    /// The first request that carried `results` tool results.
    pub fn first_with(&self, results: usize) -> Option<usize> {
        let taken = self.taken.lock().unwrap_or_else(|p| p.into_inner());
        taken.iter().position(|&n| n == results)
    }
}

/// How many `tool_result` blocks an Anthropic request carries.
fn tool_results(request: &Value) -> usize {
    request["messages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["content"].as_array())
        .flatten()
        .filter(|b| b["type"] == "tool_result")
        .count()
}

/// A tree as a fork must bring it back, per path: kind, mode, content or link target, and a
/// file's mtime. `left_out`: names skipped at any depth (trees a checkpoint leaves out).
pub fn describe(dir: &Path, left_out: &[&str]) -> BTreeMap<String, String> {
    fn walk(base: &Path, dir: &Path, left_out: &[&str], out: &mut BTreeMap<String, String>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if left_out.contains(&name.as_str()) {
                continue;
            }
            let path = entry.path();
            let rel = path
                .strip_prefix(base)
                .expect("below")
                .to_string_lossy()
                .into_owned();
            let meta = std::fs::symlink_metadata(&path).expect("metadata");
            let mode = meta.permissions().mode() & 0o7777;
            let what = if meta.file_type().is_symlink() {
                format!(
                    "link -> {}",
                    std::fs::read_link(&path).expect("link").display()
                )
            } else if meta.is_dir() {
                walk(base, &path, left_out, out);
                format!("dir {mode:o}")
            } else {
                format!(
                    "file {mode:o} mtime {}.{:09} {:?}",
                    meta.mtime(),
                    meta.mtime_nsec(),
                    String::from_utf8_lossy(&std::fs::read(&path).expect("read"))
                )
            };
            out.insert(rel, what);
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, left_out, &mut out);
    out
}

/// [`describe`]'s view without files' mtimes: for trees made by the same calls at other
/// times.
pub fn ignoring_times(tree: BTreeMap<String, String>) -> BTreeMap<String, String> {
    tree.into_iter()
        .map(|(path, what)| {
            let what = match what.split_once(" mtime ") {
                Some((head, rest)) => {
                    format!("{head} {}", rest.split_once(' ').map_or("", |(_, c)| c))
                }
                None => what,
            };
            (path, what)
        })
        .collect()
}
