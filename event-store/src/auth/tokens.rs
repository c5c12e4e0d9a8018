//! The tokens file: SHA-256 of each token with its name, role and scope; re-read when it
//! changes (see [`TokensFileWatch`]).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};

use serde::Deserialize;

use super::{Caller, Role};
use crate::scope::Scope;

#[derive(Debug, thiserror::Error)]
pub enum TokensError {
    #[error("cannot read the tokens file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    /// Deliberately without serde's message, which may quote values from the file.
    #[error("the tokens file {path} is not valid JSON of the documented shape (line {line}, column {column}); see `event-store --help` and the README")]
    Parse {
        path: String,
        line: usize,
        column: usize,
    },
    #[error("the tokens file {path}: token #{index}: {problem}")]
    Entry {
        path: String,
        index: usize,
        problem: String,
    },
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokensFile {
    tokens: Vec<TokenEntry>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TokenEntry {
    name: String,
    sha256: String,
    role: Role,
    #[serde(default)]
    prefixes: Option<Vec<String>>,
}

/// The tokens in force: SHA-256 of the token → the caller it authenticates.
#[derive(Debug, Default)]
pub struct TokenSet {
    by_hash: HashMap<[u8; 32], Caller>,
}

impl TokenSet {
    /// Parses and checks a tokens file's text (`path` only names it in errors).
    pub fn parse(text: &str, path: &str) -> Result<TokenSet, TokensError> {
        let file: TokensFile = serde_json::from_str(text).map_err(|e| TokensError::Parse {
            path: path.to_string(),
            line: e.line(),
            column: e.column(),
        })?;
        let mut set = TokenSet::default();
        let mut names = std::collections::HashSet::new();
        for (index, entry) in file.tokens.into_iter().enumerate() {
            let bad = |problem: String| TokensError::Entry {
                path: path.to_string(),
                index,
                problem,
            };
            if entry.name.is_empty()
                || entry.name.len() > 128
                || entry.name.chars().any(|c| c.is_control())
            {
                return Err(bad(
                    "name: give each token 1-128 printable characters".into()
                ));
            }
            if !names.insert(entry.name.clone()) {
                return Err(bad(format!("name {:?} is used twice", entry.name)));
            }
            let hash = parse_sha256(&entry.sha256).ok_or_else(|| {
                bad(format!(
                    "sha256 of {:?} is not 64 hex digits (store `printf %s TOKEN | sha256sum`, \
                     never the token itself)",
                    entry.name
                ))
            })?;
            if set.by_hash.contains_key(&hash) {
                return Err(bad(format!(
                    "{:?} has the same sha256 as another token",
                    entry.name
                )));
            }
            let scope = match (entry.role, entry.prefixes) {
                (Role::Admin, Some(_)) => {
                    return Err(bad(format!(
                        "{:?}: an admin sees every session; drop `prefixes` or use role \
                         runner/client",
                        entry.name
                    )))
                }
                (Role::Client, None) => {
                    return Err(bad(format!(
                        "{:?}: a client needs `prefixes` (its tenant, e.g. [\"acme:\"])",
                        entry.name
                    )))
                }
                (_, None) => Scope::everything(),
                (_, Some(prefixes)) => {
                    if prefixes.is_empty() || prefixes.iter().any(|p| !valid_prefix(p)) {
                        return Err(bad(format!(
                            "{:?}: prefixes must be non-empty strings of [A-Za-z0-9._:-] \
                             starting with a letter or digit",
                            entry.name
                        )));
                    }
                    Scope::prefixes(prefixes)
                }
            };
            set.by_hash.insert(
                hash,
                Caller {
                    name: entry.name.into(),
                    role: entry.role,
                    scope,
                    authenticated: true,
                },
            );
        }
        Ok(set)
    }

    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }

    /// The caller a presented token authenticates, if any. The lookup is by the token's
    /// SHA-256, so its timing says nothing useful about the token.
    pub fn authenticate(&self, token: &str) -> Option<&Caller> {
        self.by_hash.get(&sha256(token.as_bytes()))
    }
}

fn sha256(bytes: &[u8]) -> [u8; 32] {
    let digest = ring::digest::digest(&ring::digest::SHA256, bytes);
    let mut out = [0u8; 32];
    out.copy_from_slice(digest.as_ref());
    out
}

fn parse_sha256(hex: &str) -> Option<[u8; 32]> {
    let hex = hex.trim();
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

fn valid_prefix(prefix: &str) -> bool {
    !prefix.is_empty()
        && prefix.len() <= 128
        && prefix.as_bytes()[0].is_ascii_alphanumeric()
        && prefix
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
}

/// The tokens file, re-read when its content changes (Kubernetes swaps mounted secrets in
/// place) or on SIGHUP. A file that no longer parses is reported and the previous tokens
/// stay in force.
pub struct TokensFileWatch {
    path: PathBuf,
    current: RwLock<Arc<TokenSet>>,
    /// Digest of the content last tried (loaded or refused), so a bad file is reported once.
    last_seen: Mutex<[u8; 32]>,
}

impl TokensFileWatch {
    pub fn open(path: &Path) -> Result<TokensFileWatch, TokensError> {
        let text = read(path)?;
        let set = TokenSet::parse(&text, &path.display().to_string())?;
        Ok(TokensFileWatch {
            path: path.to_path_buf(),
            current: RwLock::new(Arc::new(set)),
            last_seen: Mutex::new(sha256(text.as_bytes())),
        })
    }

    pub fn current(&self) -> Arc<TokenSet> {
        self.current
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn len(&self) -> usize {
        self.current().len()
    }

    pub fn is_empty(&self) -> bool {
        self.current().is_empty()
    }
}

impl crate::tls::Reload for TokensFileWatch {
    fn what(&self) -> &'static str {
        "tokens file"
    }

    fn reload(&self, forced: bool) -> Result<Option<String>, String> {
        let text = read(&self.path).map_err(|e| e.to_string())?;
        let digest = sha256(text.as_bytes());
        {
            let mut last = self.last_seen.lock().unwrap_or_else(|p| p.into_inner());
            if *last == digest && !forced {
                return Ok(None);
            }
            *last = digest;
        }
        let set = TokenSet::parse(&text, &self.path.display().to_string())
            .map_err(|e| format!("{e}; the previous tokens stay in force"))?;
        let n = set.len();
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(set);
        Ok(Some(format!("{n} tokens")))
    }
}

fn read(path: &Path) -> Result<String, TokensError> {
    std::fs::read_to_string(path).map_err(|source| TokensError::Read {
        path: path.display().to_string(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"{"tokens": [
        {"name": "acme", "sha256": "SHA_A", "role": "client", "prefixes": ["acme:"]},
        {"name": "pool", "sha256": "SHA_R", "role": "runner"},
        {"name": "ops", "sha256": "SHA_O", "role": "admin"}
    ]}"#;

    fn hex(token: &str) -> String {
        sha256(token.as_bytes())
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    fn set() -> TokenSet {
        let text = FILE
            .replace("SHA_A", &hex("tok-a"))
            .replace("SHA_R", &hex("tok-r"))
            .replace("SHA_O", &hex("tok-o"));
        TokenSet::parse(&text, "tokens.json").expect("valid file")
    }

    #[test]
    fn tokens_authenticate_by_their_hash_only() {
        let set = set();
        assert_eq!(set.len(), 3);
        let acme = set.authenticate("tok-a").expect("known");
        assert_eq!((&*acme.name, acme.role), ("acme", Role::Client));
        assert!(set.authenticate("tok-x").is_none());
        assert!(
            set.authenticate(&hex("tok-a")).is_none(),
            "the hash is not a token"
        );
    }

    #[test]
    fn bad_files_are_refused_without_quoting_values() {
        let raw = r#"{"tokens": [{"name": "x", "sha256": "my-secret-token", "role": "admin"}]}"#;
        let err = TokenSet::parse(raw, "t.json")
            .expect_err("not a hash")
            .to_string();
        assert!(!err.contains("my-secret-token"), "{err}");
        let raw = r#"{"tokens": [{"name": "x", "token": "my-secret-token", "role": "admin"}]}"#;
        let err = TokenSet::parse(raw, "t.json")
            .expect_err("unknown field")
            .to_string();
        assert!(!err.contains("my-secret-token"), "{err}");
        let raw = format!(
            r#"{{"tokens": [{{"name": "x", "sha256": "{}", "role": "client"}}]}}"#,
            hex("t")
        );
        assert!(
            TokenSet::parse(&raw, "t.json").is_err(),
            "a client needs prefixes"
        );
    }
}
