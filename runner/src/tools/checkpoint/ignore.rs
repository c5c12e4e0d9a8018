//! `runner --checkpoint-ignore GLOB`: the paths a workspace checkpoint leaves out, as a
//! small subset of `.gitignore` patterns.
//!
//! - A trailing `/` matches directories only (`target/`).
//! - A pattern with no other `/` matches an entry's name at any depth (`node_modules/`,
//!   `*.pyc`); one with a `/` inside is anchored at the workspace (`build/out`, `/dist/`).
//! - `*` matches any run of characters but `/`, `?` one character but `/`, and `**` any
//!   run including `/` (`docs/**/*.tmp`).
//!
//! An empty pattern matches nothing (`--checkpoint-ignore ''` keeps every path).

/// The patterns in force when `runner --checkpoint-ignore` is not given.
pub const DEFAULT_IGNORE: [&str; 3] = ["node_modules/", "target/", ".venv/"];

#[derive(Debug, Clone, PartialEq, Eq)]
struct Pattern {
    /// As given, for the note that says what was left out.
    text: String,
    glob: Vec<u8>,
    anchored: bool,
    dirs_only: bool,
}

/// The set of `--checkpoint-ignore` patterns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IgnoreRules {
    patterns: Vec<Pattern>,
}

impl Default for IgnoreRules {
    fn default() -> IgnoreRules {
        IgnoreRules::new(DEFAULT_IGNORE)
    }
}

impl IgnoreRules {
    pub fn new<S: AsRef<str>>(patterns: impl IntoIterator<Item = S>) -> IgnoreRules {
        let patterns = patterns
            .into_iter()
            .filter_map(|text| {
                let text = text.as_ref().trim();
                let dirs_only = text.ends_with('/');
                let body = text.trim_end_matches('/');
                let anchored = body.contains('/');
                let body = body.trim_start_matches('/');
                (!body.is_empty()).then(|| Pattern {
                    text: text.to_string(),
                    glob: body.as_bytes().to_vec(),
                    anchored,
                    dirs_only,
                })
            })
            .collect();
        IgnoreRules { patterns }
    }

    /// The pattern that leaves out the entry `name` at `path` (relative to the workspace,
    /// `/`-separated, ending in `name`), if any.
    pub fn matching(&self, path: &[u8], name: &[u8], is_dir: bool) -> Option<&str> {
        self.patterns
            .iter()
            .find(|p| {
                (is_dir || !p.dirs_only)
                    && if p.anchored {
                        glob_matches(&p.glob, path)
                    } else {
                        glob_matches(&p.glob, name)
                    }
            })
            .map(|p| p.text.as_str())
    }

    /// The paths under `dir` these rules leave out, relative to it (the outermost of each
    /// tree; symbolic links are not followed).
    pub fn left_out_in(&self, dir: &std::path::Path) -> std::io::Result<Vec<std::path::PathBuf>> {
        use std::os::unix::ffi::OsStrExt;
        let mut found = Vec::new();
        let mut stack = vec![std::path::PathBuf::new()];
        while let Some(rel) = stack.pop() {
            let entries = match std::fs::read_dir(dir.join(&rel)) {
                Ok(entries) => entries,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            for entry in entries {
                let entry = entry?;
                let is_dir = entry.file_type()?.is_dir();
                let path = rel.join(entry.file_name());
                let name = entry.file_name();
                if self
                    .matching(path.as_os_str().as_bytes(), name.as_bytes(), is_dir)
                    .is_some()
                {
                    found.push(path);
                } else if is_dir {
                    stack.push(path);
                }
            }
        }
        Ok(found)
    }
}

/// Whether `text` matches `glob` whole (`*`, `?` within a path segment; `**` across them).
fn glob_matches(glob: &[u8], text: &[u8]) -> bool {
    match glob.split_first() {
        None => text.is_empty(),
        Some((b'*', rest)) if rest.first() == Some(&b'*') => {
            let rest = &rest[1..];
            // `**/` also matches no directory at all.
            let rest_after_slash = rest.strip_prefix(b"/").unwrap_or(rest);
            (0..=text.len()).any(|i| {
                glob_matches(rest, &text[i..])
                    || (rest.len() != rest_after_slash.len()
                        && glob_matches(rest_after_slash, &text[i..]))
            })
        }
        Some((b'*', rest)) => {
            let segment_end = text.iter().position(|&b| b == b'/').unwrap_or(text.len());
            (0..=segment_end).any(|i| glob_matches(rest, &text[i..]))
        }
        Some((b'?', rest)) => {
            matches!(text.first(), Some(&c) if c != b'/') && glob_matches(rest, &text[1..])
        }
        Some((&c, rest)) => text.first() == Some(&c) && glob_matches(rest, &text[1..]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn left_out(rules: &IgnoreRules, path: &str, is_dir: bool) -> bool {
        let name = path.rsplit('/').next().unwrap_or(path);
        rules
            .matching(path.as_bytes(), name.as_bytes(), is_dir)
            .is_some()
    }

    #[test]
    fn the_defaults_leave_out_dependency_and_build_trees_at_any_depth() {
        let rules = IgnoreRules::default();
        assert!(left_out(&rules, "node_modules", true));
        assert!(left_out(&rules, "web/node_modules", true));
        assert!(left_out(&rules, "target", true));
        assert!(left_out(&rules, ".venv", true));
        // Directories only: a file of that name is kept.
        assert!(!left_out(&rules, "target", false));
        assert!(!left_out(&rules, "src/main.rs", false));
    }

    #[test]
    fn names_anchors_and_wildcards() {
        let rules = IgnoreRules::new(["*.pyc", "/dist/", "docs/**/*.tmp", "build/o?t", ""]);
        assert!(left_out(&rules, "a/b/c.pyc", false));
        assert!(!left_out(&rules, "a/b/c.pyc.txt", false));
        assert!(left_out(&rules, "dist", true));
        assert!(!left_out(&rules, "web/dist", true));
        assert!(left_out(&rules, "docs/x.tmp", false));
        assert!(left_out(&rules, "docs/a/b/x.tmp", false));
        assert!(!left_out(&rules, "src/docs/x.tmp", false));
        assert!(left_out(&rules, "build/out", false));
        assert!(!left_out(&rules, "build/a/t", false));
        assert!(!left_out(&rules, "", true));
        // `*` stays within a segment.
        assert!(!glob_matches(b"a*c", b"ab/c"));
        assert!(glob_matches(b"a**c", b"ab/c"));
    }

    #[test]
    fn an_empty_list_keeps_everything() {
        let rules = IgnoreRules::new([""]);
        assert!(!left_out(&rules, "node_modules", true));
        assert_eq!(rules.matching(b"x", b"x", true), None);
    }
}
