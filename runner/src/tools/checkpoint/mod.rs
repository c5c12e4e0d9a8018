//! Workspace checkpoints: after every tool call, before its `tool_result` is appended, the
//! state of the session's workspace is recorded, and the result names it
//! (`ToolResult.workspace_checkpoint`). A fork's workspace is restored from the last
//! checkpoint its copied log names, so it starts with the files exactly as they were at the
//! fork point, changes made by `bash` included.
//!
//! Promises:
//! - A checkpoint id names the workspace as it was when it was recorded: files (content,
//!   mode, mtime), directories (empty ones too), symbolic links (their targets), and the
//!   paths it left out (`runner --checkpoint-ignore`) or could not keep (FIFOs, sockets,
//!   unreadable files), by name. It is content-addressed (`area.rs`): a file is read only if
//!   its metadata moved since the session's previous checkpoint (`scan.rs`), and stored only
//!   if no checkpoint holds its content yet.
//! - Everything a checkpoint needs is durable before its id is returned, so no event ever
//!   names a checkpoint a crash can take back.
//! - The area lies beside the workspaces (`<workspace-root>/.checkpoints/`, mode 0700, the
//!   runner's): no tool reaches it (a tool runs as the tool user, confined by the sandbox
//!   to its own workspace).
//! - A fork's workspace is restored once (`restored` marks it, durably), before any tool
//!   runs in it; what could not be restored is said in the runner's log and, prefixed to
//!   the fork's next tool result, to the model.
//! - Checkpoints go when the session whose log names them is deleted, and not before every
//!   session naming them is: see `gc.rs`.
//!
//! Crash points, and what the next runner finds:
//! - a checkpoint killed before its objects are renamed into place: temporary files, which
//!   the GC removes; nothing names them.
//! - after its objects, before the session's `refs` line: objects nothing names; the GC
//!   removes them.
//! - after the `refs` line, before the `tool_result` (killed -9 there): a checkpoint no
//!   event names, kept until the session is deleted. The next runner's guard settles the
//!   call as always (re-run, report or ask), and its checkpoint compares against `last`,
//!   which names either that checkpoint or the one before: both are true records, so the
//!   new one is exact either way (`runner/tests/tool_guard.rs`, `integration-tests/tests/runner_fork_crash.rs`).
//! - a restore killed before `restored` is durable: no tool has run in the fork's
//!   workspace, so the next claim moves what is there aside and restores again.
//! - the GC killed mid-sweep: it only removes what nothing names; the next run finishes.

mod area;
pub mod gc;
mod ignore;
mod restore;
mod scan;
mod tree;

use std::collections::HashMap;
use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

pub use area::AREA_DIR;
pub use ignore::{IgnoreRules, DEFAULT_IGNORE};

use area::{hex, parse_hex, Area, Hash, Pending};
use scan::{Previous, Trees};

use super::sandbox::Ids;

/// Sessions whose last checkpoint's trees are kept in memory for the next checkpoint.
const KEPT_SESSIONS: usize = 16;

#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    #[error("the checkpoint area {dir}: {source}")]
    Io { dir: PathBuf, source: io::Error },
    #[error("the checkpoint task failed: {0}")]
    Task(String),
}

/// A recorded checkpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Checkpoint {
    /// The id `tool_result.workspace_checkpoint` carries.
    pub id: String,
    pub files_read: usize,
    pub bytes_read: u64,
    /// What a fork's restore could not restore, for the model, until a result carries it.
    pub note: Option<String>,
}

/// The workspaces' checkpoints under one workspace root.
#[derive(Debug)]
pub struct Checkpoints {
    root: PathBuf,
    area: Area,
    ignore: IgnoreRules,
    /// The tool user, who owns restored files.
    owner: Option<Ids>,
    kept: Mutex<Kept>,
}

#[derive(Debug, Default)]
struct Kept {
    tick: u64,
    sessions: HashMap<String, (Hash, Arc<Trees>, u64)>,
}

impl Checkpoints {
    /// Checkpoints of the workspaces `<workspace_root>/<session_id>/`, leaving out what
    /// `ignore` matches; restored files go to `owner`.
    pub fn new(workspace_root: &Path, ignore: IgnoreRules, owner: Option<Ids>) -> Checkpoints {
        Checkpoints {
            root: workspace_root.to_path_buf(),
            area: Area::new(workspace_root),
            ignore,
            owner,
            kept: Mutex::new(Kept::default()),
        }
    }

    /// `<workspace-root>/.checkpoints`.
    pub fn area_dir(&self) -> &Path {
        self.area.dir()
    }

    fn io_error(&self, source: io::Error) -> CheckpointError {
        CheckpointError::Io {
            dir: self.area.dir().to_path_buf(),
            source,
        }
    }

    /// Records the workspace of `session_id` as it is now (blocking: call it off the async
    /// runtime, as [`Checkpoints::record`] does).
    pub fn record_blocking(&self, session_id: &str) -> Result<Checkpoint, CheckpointError> {
        self.record_inner(session_id).map_err(|e| self.io_error(e))
    }

    /// [`Checkpoints::record_blocking`] on the blocking pool.
    pub async fn record(self: &Arc<Self>, session_id: &str) -> Result<Checkpoint, CheckpointError> {
        let this = self.clone();
        let session_id = session_id.to_string();
        tokio::task::spawn_blocking(move || this.record_blocking(&session_id))
            .await
            .map_err(|e| CheckpointError::Task(e.to_string()))?
    }

    fn record_inner(&self, session_id: &str) -> io::Result<Checkpoint> {
        check_session_id(session_id)?;
        self.area.ensure()?;
        let _lock = self.area.lock_shared()?;
        let last = self.last(session_id);
        let kept = last.and_then(|(root, _)| self.kept_trees(session_id, &root));
        let empty = Trees::new();
        let previous = last.map(|(root, racy_limit_ns)| Previous {
            root,
            trees: kept.as_deref().unwrap_or(&empty),
            racy_limit_ns,
        });
        let mut pending = Pending::default();
        let recorded = scan::record(
            &self.area,
            &self.root.join(session_id),
            &self.ignore,
            previous.as_ref(),
            &mut pending,
        )?;
        // The refs line and the objects are made durable at once (see `sync_alongside`).
        let new_root = last.map(|(root, _)| root) != Some(recorded.root);
        self.area.sync_alongside(pending, || {
            if new_root {
                self.area.add_refs(session_id, &[recorded.root])?;
            }
            Ok(())
        })?;
        self.set_last(session_id, &recorded.root)?;
        self.keep(session_id, recorded.root, recorded.trees);
        Ok(Checkpoint {
            id: hex(&recorded.root),
            files_read: recorded.files_read,
            bytes_read: recorded.bytes_read,
            note: fs::read_to_string(self.area.session_dir(session_id).join("note")).ok(),
        })
    }

    /// The session's newest checkpoint and the file system's time after it was scanned.
    fn last(&self, session_id: &str) -> Option<(Hash, i64)> {
        let path = self.area.session_dir(session_id).join("last");
        let text = fs::read_to_string(&path).ok()?;
        let root = parse_hex(text.trim())?;
        let meta = fs::metadata(&path).ok()?;
        Some((root, meta.mtime() * 1_000_000_000 + meta.mtime_nsec()))
    }

    /// Names `root` as the session's newest checkpoint. Written after the scan, so its
    /// mtime is the file system's clock past every ctime the scan trusted. Not synced: a
    /// `last` lost in a crash only makes the next checkpoint read more.
    fn set_last(&self, session_id: &str, root: &Hash) -> io::Result<()> {
        let dir = self.area.ensure_session_dir(session_id)?;
        let (temp, file) = self.area.create_temp()?;
        drop(file);
        fs::write(&temp, format!("{}\n", hex(root)))?;
        fs::rename(&temp, dir.join("last"))
    }

    fn kept_trees(&self, session_id: &str, root: &Hash) -> Option<Arc<Trees>> {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        kept.tick += 1;
        let tick = kept.tick;
        match kept.sessions.get_mut(session_id) {
            Some((kept_root, trees, used)) if kept_root == root => {
                *used = tick;
                Some(trees.clone())
            }
            _ => None,
        }
    }

    fn keep(&self, session_id: &str, root: Hash, trees: Trees) {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        kept.tick += 1;
        let tick = kept.tick;
        kept.sessions
            .insert(session_id.to_string(), (root, Arc::new(trees), tick));
        while kept.sessions.len() > KEPT_SESSIONS {
            let oldest = kept
                .sessions
                .iter()
                .min_by_key(|(_, (_, _, used))| *used)
                .map(|(id, _)| id.clone());
            match oldest {
                Some(id) => kept.sessions.remove(&id),
                None => break,
            };
        }
    }

    fn forget_kept(&self, session_id: &str) {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        kept.sessions.remove(session_id);
    }

    /// The note of [`Checkpoint::note`] is in a logged tool result: it is not given again.
    pub async fn note_delivered(&self, session_id: &str) {
        let _ = tokio::fs::remove_file(self.area.session_dir(session_id).join("note")).await;
    }

    /// Whether the workspace of fork `session_id` has been restored.
    pub fn is_restored(&self, session_id: &str) -> bool {
        self.area.session_dir(session_id).join("restored").exists()
    }

    /// Whether the fork's `refs` hold every checkpoint its copied prefix names.
    pub fn is_adopted(&self, session_id: &str) -> bool {
        self.area.session_dir(session_id).join("adopted").exists()
    }

    /// Records that fork `session_id`'s log names the checkpoints `ids` (its copied prefix):
    /// from now on they stay until the fork is deleted, whatever becomes of its parent.
    pub fn adopt(&self, session_id: &str, ids: &[String]) -> Result<(), CheckpointError> {
        self.adopt_inner(session_id, ids)
            .map_err(|e| self.io_error(e))
    }

    fn adopt_inner(&self, session_id: &str, ids: &[String]) -> io::Result<()> {
        check_session_id(session_id)?;
        self.area.ensure()?;
        let _lock = self.area.lock_shared()?;
        self.adopt_locked(session_id, ids)
    }

    fn adopt_locked(&self, session_id: &str, ids: &[String]) -> io::Result<()> {
        if self.is_adopted(session_id) {
            return Ok(());
        }
        let hashes: Vec<Hash> = ids.iter().filter_map(|id| parse_hex(id)).collect();
        self.area.add_refs(session_id, &hashes)?;
        let dir = self.area.ensure_session_dir(session_id)?;
        self.area.write_file_durably(&dir.join("adopted"), b"")
    }

    /// Restores the workspace of fork `session_id` (forked from `parent` at `fork_seq`)
    /// from `prefix`, what its copied log names, unless that was done before. Returns what
    /// the runner should log, once.
    pub fn restore_fork_blocking(
        &self,
        session_id: &str,
        parent: &str,
        fork_seq: u64,
        prefix: &PrefixCheckpoints,
    ) -> Result<Option<String>, CheckpointError> {
        self.restore_fork_inner(session_id, parent, fork_seq, prefix)
            .map_err(|e| self.io_error(e))
    }

    fn restore_fork_inner(
        &self,
        session_id: &str,
        parent: &str,
        fork_seq: u64,
        prefix: &PrefixCheckpoints,
    ) -> io::Result<Option<String>> {
        check_session_id(session_id)?;
        self.area.ensure()?;
        let _lock = self.area.lock_shared()?;
        // One restore of a session at a time, even by a runner whose lease ran out mid-way.
        let dir = self.area.ensure_session_dir(session_id)?;
        let _restoring = area::lock_file(&dir.join("restoring"))?;
        if self.is_restored(session_id) {
            return Ok(None);
        }
        self.adopt_locked(session_id, &prefix.named)?;
        let mut missing = Vec::new();
        let source = match (&prefix.latest, prefix.last_result_seq) {
            (None, None) => None,
            (None, Some(seq)) => {
                missing.push(format!(
                    "every file: no tool result up to seq {seq} names a checkpoint"
                ));
                None
            }
            (Some((seq, id)), last) => {
                if let Some(last) = last.filter(|last| last > seq) {
                    missing.push(format!(
                        "the changes of the calls answered after seq {seq} (up to seq {last}): \
                         their results name no checkpoint"
                    ));
                }
                match parse_hex(id) {
                    Some(hash) if self.area.has(area::Kind::Tree, &hash) => Some(hash),
                    _ => {
                        missing.push(format!(
                            "every file: checkpoint {id} (seq {seq}) is not in this runner's \
                             checkpoint area {}",
                            self.area.dir().display()
                        ));
                        None
                    }
                }
            }
        };
        // Staged beside the workspaces, then moved into place whole.
        let staging = self
            .area
            .tmp_dir()
            .join(format!("restore-{:016x}", fastrand::u64(..)));
        fs::DirBuilder::new().mode(0o700).create(&staging)?;
        let mut pending = Pending::default();
        let restored = {
            let target = restore::open_dir(&staging)?;
            let restored = match &source {
                Some(root) => {
                    restore::restore(&self.area, root, &target, self.owner, &mut pending)?
                }
                None => restore::restore_empty(&self.area, &mut pending)?,
            };
            if let Some(ids) = self.owner {
                std::os::unix::fs::chown(&staging, Some(ids.uid), Some(ids.gid))?;
            }
            // Every restored byte durable before the fork is marked restored.
            nix::unistd::syncfs(&target)?;
            restored
        };
        let workspace = self.root.join(session_id);
        if fs::symlink_metadata(&workspace).is_ok() {
            // Left by a restore that died before it was marked: no tool ran in it.
            let aside = self
                .area
                .tmp_dir()
                .join(format!("aside-{:016x}", fastrand::u64(..)));
            fs::rename(&workspace, &aside)?;
            let _ = restore::remove_tree(&aside);
        }
        fs::rename(&staging, &workspace)?;
        area::sync_dir(&self.root)?;
        self.area.sync(pending)?;
        self.area.add_refs(session_id, &[restored.root])?;
        self.set_last(session_id, &restored.root)?;
        missing.extend(restored.not_restored.iter().cloned());
        let from = match &source {
            Some(root) => format!("checkpoint {}", hex(root)),
            None => "an empty workspace".to_string(),
        };
        let mut report = format!(
            "This session is a fork of {parent} at seq {fork_seq}; its workspace was restored \
             from {from} ({} files, {} bytes).",
            restored.files, restored.bytes
        );
        if !missing.is_empty() {
            report.push_str(" Not restored:");
            for line in &missing {
                report.push_str("\n- ");
                report.push_str(line);
            }
            self.area
                .write_file_durably(&dir.join("note"), format!("[{report}]").as_bytes())?;
        }
        self.area
            .write_file_durably(&dir.join("restored"), report.as_bytes())?;
        self.keep(session_id, restored.root, restored.trees);
        Ok(Some(report))
    }

    /// Restores checkpoint `id` into `target` (a directory that must not exist yet), owned
    /// by the tool user; returns what could not be restored. For tools and benchmarks that
    /// want a checkpoint's files outside any session.
    pub fn materialize(&self, id: &str, target: &Path) -> Result<Vec<String>, CheckpointError> {
        let root = parse_hex(id).ok_or_else(|| {
            self.io_error(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("{id:?} is not a checkpoint id"),
            ))
        })?;
        let inner = || -> io::Result<Vec<String>> {
            let _lock = self.area.lock_shared()?;
            fs::DirBuilder::new().mode(0o700).create(target)?;
            let dir = restore::open_dir(target)?;
            let mut pending = Pending::default();
            let restored = restore::restore(&self.area, &root, &dir, self.owner, &mut pending)?;
            self.area.sync(pending)?;
            Ok(restored.not_restored)
        };
        inner().map_err(|e| self.io_error(e))
    }

    /// The sessions the area keeps anything for.
    pub fn sessions(&self) -> Result<Vec<String>, CheckpointError> {
        let list = || -> io::Result<Vec<String>> {
            match fs::read_dir(self.area.sessions_dir()) {
                Ok(entries) => entries
                    .map(|entry| Ok(entry?.file_name().to_string_lossy().into_owned()))
                    .collect(),
                Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(Vec::new()),
                Err(e) => Err(e),
            }
        };
        list().map_err(|e| self.io_error(e))
    }
}

/// Restores the workspace of the fork `session_id` if that was not done yet: reads what its
/// copied prefix names from the store, then restores (on the blocking pool). Call it before
/// any tool runs in the session.
pub async fn prepare_fork(
    checkpoints: &Arc<Checkpoints>,
    client: &agentlog_client::StoreClient,
    session_id: &str,
    forked_from: &agentlog_proto::v1::ForkedFrom,
) -> Result<(), ForkError> {
    if checkpoints.is_restored(session_id) {
        return Ok(());
    }
    let prefix = PrefixCheckpoints::read(client, session_id, forked_from.seq).await?;
    let this = checkpoints.clone();
    let (session, parent, seq) = (
        session_id.to_string(),
        forked_from.session_id.clone(),
        forked_from.seq,
    );
    let report = tokio::task::spawn_blocking(move || {
        this.restore_fork_blocking(&session, &parent, seq, &prefix)
    })
    .await
    .map_err(|e| CheckpointError::Task(e.to_string()))??;
    if let Some(report) = report {
        if report.contains("Not restored") {
            tracing::warn!(%report, "restored the fork's workspace, not all of it");
        } else {
            tracing::info!(%report, "restored the fork's workspace");
        }
    }
    Ok(())
}

#[derive(Debug, thiserror::Error)]
pub enum ForkError {
    #[error(transparent)]
    Area(#[from] CheckpointError),
    #[error("reading the fork's log: {0}")]
    Store(#[from] tonic::Status),
}

/// A session id as a directory name: the store only accepts ids that can be one, checked
/// again because it becomes a path.
fn check_session_id(session_id: &str) -> io::Result<()> {
    if session_id.is_empty()
        || session_id.starts_with('.')
        || session_id.contains(['/', '\\', '\0'])
    {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("session id {session_id:?} cannot name a workspace directory"),
        ));
    }
    Ok(())
}

/// What a fork's copied prefix says about checkpoints: read from its log by
/// [`PrefixCheckpoints::read`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PrefixCheckpoints {
    /// Every checkpoint id the prefix names, in log order.
    pub named: Vec<String>,
    /// The seq and id of the last `tool_result` in the prefix that names one.
    pub latest: Option<(u64, String)>,
    /// The seq of the last `tool_result` in the prefix.
    pub last_result_seq: Option<u64>,
}

impl PrefixCheckpoints {
    /// Takes in one event of the prefix.
    pub fn apply(&mut self, event: &agentlog_proto::v1::Event) {
        if let Some(agentlog_proto::v1::event::Kind::ToolResult(result)) = &event.kind {
            self.last_result_seq = Some(event.seq);
            if let Some(id) = &result.workspace_checkpoint {
                self.named.push(id.clone());
                self.latest = Some((event.seq, id.clone()));
            }
        }
    }

    /// Reads `session_id`'s log through `through_seq`.
    pub async fn read(
        client: &agentlog_client::StoreClient,
        session_id: &str,
        through_seq: u64,
    ) -> Result<PrefixCheckpoints, tonic::Status> {
        let mut stream = client
            .clone()
            .subscribe(agentlog_proto::v1::SubscribeRequest {
                session_id: session_id.to_string(),
                from_seq: 1,
                follow: false,
            })
            .await?
            .into_inner();
        let mut prefix = PrefixCheckpoints::default();
        while let Some(event) = stream.message().await? {
            if event.seq > through_seq {
                break;
            }
            prefix.apply(&event);
        }
        Ok(prefix)
    }
}

#[cfg(test)]
mod tests;
