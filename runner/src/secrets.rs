//! The runner's secrets: the model API keys and the store token. Read once at start, from a
//! file (`--anthropic-api-key-file`, `--openai-api-key-file`, `--token-file`) or else from
//! the environment variable of the same name (`ANTHROPIC_API_KEY`, `OPENAI_API_KEY`,
//! `AGENTLOG_TOKEN`), which is then removed from the environment and wiped from the
//! process's initial environment block: no child inherits it, and even a reader of
//! `/proc/<runner>/environ` (which shows that block, not the current environment) finds
//! nothing. The checkpoints' object store is configured by the standard variables of its
//! cloud (`AWS_*`, `GOOGLE_*`, `AZURE_*`): all of them are taken the same way, and wiped. The files stay where they are; keeping tools from reading them is the
//! sandbox's job (its table says which mechanism does).

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use agentlog_client::connection::TOKEN_ENV;

use crate::model::ApiKeys;

/// The variables that may hold a secret.
pub const SECRET_ENV: [&str; 3] = ["ANTHROPIC_API_KEY", "OPENAI_API_KEY", TOKEN_ENV];

/// Where each secret may come from.
#[derive(Debug, Default, Clone)]
pub struct SecretFiles {
    pub anthropic_api_key: Option<PathBuf>,
    pub openai_api_key: Option<PathBuf>,
    pub store_token: Option<PathBuf>,
}

/// The prefixes of the variables that configure an object store (endpoint, region,
/// credentials), taken from the environment whole.
pub const OBJECT_STORE_ENV: [&str; 3] = ["AWS_", "GOOGLE_", "AZURE_"];

/// The secrets, read.
pub struct Secrets {
    pub api_keys: ApiKeys,
    pub store_token: Option<String>,
    /// Every `AWS_*`, `GOOGLE_*` and `AZURE_*` variable, for the checkpoints' object store.
    pub object_store_env: Vec<(String, String)>,
    /// Whether the initial environment block could be wiped (else why not).
    pub wiped: Result<(), String>,
}

#[derive(Debug, thiserror::Error)]
pub enum SecretError {
    #[error("cannot read {flag} {path}: {source}")]
    Read {
        flag: &'static str,
        path: String,
        source: std::io::Error,
    },
    #[error("{flag} {path} is empty")]
    Empty { flag: &'static str, path: String },
}

impl Secrets {
    /// Reads every secret and scrubs the environment. Call it before any other thread
    /// exists: it changes the environment.
    pub fn take(files: &SecretFiles) -> Result<Secrets, SecretError> {
        let anthropic = read(
            files.anthropic_api_key.as_deref(),
            "--anthropic-api-key-file",
            "ANTHROPIC_API_KEY",
        )?;
        let openai = read(
            files.openai_api_key.as_deref(),
            "--openai-api-key-file",
            "OPENAI_API_KEY",
        )?;
        let store_token = read(files.store_token.as_deref(), "--token-file", TOKEN_ENV)?;
        let object_store_env: Vec<(String, String)> = std::env::vars()
            .filter(|(name, _)| OBJECT_STORE_ENV.iter().any(|p| name.starts_with(p)))
            .collect();
        let mut names: Vec<&str> = SECRET_ENV.to_vec();
        names.extend(object_store_env.iter().map(|(name, _)| name.as_str()));
        let wiped = wipe_initial_environment(&names).map_err(|e| e.to_string());
        for name in names {
            std::env::remove_var(name);
        }
        Ok(Secrets {
            api_keys: ApiKeys { anthropic, openai },
            store_token,
            object_store_env,
            wiped,
        })
    }
}

fn read(file: Option<&Path>, flag: &'static str, env: &str) -> Result<Option<String>, SecretError> {
    let Some(path) = file else {
        return Ok(std::env::var(env).ok().filter(|value| !value.is_empty()));
    };
    let text = std::fs::read_to_string(path).map_err(|source| SecretError::Read {
        flag,
        path: path.display().to_string(),
        source,
    })?;
    // Files written by `echo` or mounted from a Secret often end in a newline.
    let value = text.trim();
    if value.is_empty() {
        return Err(SecretError::Empty {
            flag,
            path: path.display().to_string(),
        });
    }
    Ok(Some(value.to_string()))
}

/// Overwrites with zeros every `NAME=value` of `names` in this process's initial
/// environment block (`env_start`..`env_end` of `/proc/self/stat`), through
/// `/proc/self/mem`. Must run before those variables are removed: while they are still in
/// the environment no one but this function touches their bytes, and once removed nothing
/// refers to them (the C library's `environ` array no longer points at them).
fn wipe_initial_environment(names: &[&str]) -> std::io::Result<()> {
    let invalid =
        |what: &str| std::io::Error::new(std::io::ErrorKind::InvalidData, what.to_string());
    let stat = std::fs::read_to_string("/proc/self/stat")?;
    // Fields after the command name's `)` start at field 3; env_start and env_end are 50, 51.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .ok_or_else(|| invalid("no `)` in /proc/self/stat"))?
        .1
        .split_whitespace()
        .collect();
    let field = |n: usize| -> std::io::Result<u64> {
        fields
            .get(n - 3)
            .and_then(|value| value.parse().ok())
            .ok_or_else(|| invalid("/proc/self/stat has no environment bounds"))
    };
    let (start, end) = (field(50)?, field(51)?);
    if end <= start || end - start > 1 << 24 {
        return Err(invalid("implausible environment bounds"));
    }
    let mem = OpenOptions::new()
        .read(true)
        .write(true)
        .open("/proc/self/mem")?;
    let mut block = vec![0u8; (end - start) as usize];
    mem.read_exact_at(&mut block, start)?;
    let mut offset = 0;
    for entry in block.split(|&byte| byte == 0) {
        let secret = names.iter().any(|name| {
            entry.len() > name.len()
                && entry.starts_with(name.as_bytes())
                && entry[name.len()] == b'='
        });
        if secret {
            // Keep `NAME=`, zero the value: the block stays well-formed.
            let value_at = start + (offset + names_len(entry)) as u64;
            let value_len = entry.len() - names_len(entry);
            mem.write_all_at(&vec![0u8; value_len], value_at)?;
        }
        offset += entry.len() + 1;
    }
    Ok(())
}

/// The length of `NAME=` in `entry`.
fn names_len(entry: &[u8]) -> usize {
    entry
        .iter()
        .position(|&byte| byte == b'=')
        .map_or(entry.len(), |at| at + 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_wins_over_the_environment_and_is_trimmed() {
        let dir = tempfile::tempdir().expect("temp dir");
        let file = dir.path().join("key");
        std::fs::write(&file, "sk-from-file\n").expect("write");
        assert_eq!(
            read(Some(&file), "--x-file", "AGENTLOG_TEST_NO_SUCH_VAR").expect("reads"),
            Some("sk-from-file".to_string())
        );
        std::fs::write(&file, "\n").expect("write");
        assert!(read(Some(&file), "--x-file", "X").is_err());
        assert!(read(Some(&dir.path().join("missing")), "--x-file", "X").is_err());
        assert_eq!(
            read(None, "--x-file", "AGENTLOG_TEST_NO_SUCH_VAR").expect("reads"),
            None
        );
    }
}
