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
//! - A replay's workspace follows its served results lazily: once the replay leaves the
//!   recorded path, it is moved to the checkpoint the last served result names
//!   ([`Checkpoints::move_to_served_blocking`], once per served result: `moved` marks it,
//!   durably), before anything runs in it; a served result's checkpoint is first added to
//!   the replay's `refs` ([`Checkpoints::keep_served`]), so it outlives the recording.
//! - Checkpoints go when the session whose log names them is deleted, and not before every
//!   session naming them is: see `gc.rs`.
//! - A deleted session's workspace is removed ([`Checkpoints::remove_workspace_blocking`])
//!   only once no restore of it is half-way, and a restore whose runner stopped waiting for
//!   it ([`prepare_fork`] dropped) writes nothing after that: a deleted fork's files never
//!   come back.
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
//! - a replay's move killed before `moved` is durable: nothing ran in the workspace since (a
//!   tool runs only after the move), so the next claim moves it again.
//! - the GC killed mid-sweep: it only removes what nothing names; the next run finishes.

mod area;
pub mod gc;
pub mod health;
mod ignore;
mod remote;
pub mod remote_gc;
mod restore;
mod scan;
mod tree;

use std::collections::HashMap;
use std::fs;
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

pub use area::AREA_DIR;
pub use ignore::{IgnoreRules, DEFAULT_IGNORE};
pub use remote::{Remote, StoreUrl, PARALLEL, SMALL_OBJECT};

use area::{hex, parse_hex, Area, Hash, Pending};
use scan::{Previous, Trees};

pub use crate::fold::config::LogCheckpoint;

use super::remove;
use super::sandbox::Ids;

/// Sessions whose last checkpoint's trees are kept in memory for the next checkpoint.
const KEPT_SESSIONS: usize = 16;
/// `sessions/<id>/at`: the checkpoint a log names that the workspace was last at (recorded
/// or restored), for [`Checkpoints::bring_to_log`].
const AT: &str = "at";
/// `sessions/<id>/uploaded`: a checkpoint whose objects the object store holds, so the
/// session's next upload does not ask about them.
const UPLOADED: &str = "uploaded";

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
    /// The object store checkpoints live in (`None`: the local area is where they live).
    remote: Option<Remote>,
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
            remote: None,
        }
    }

    /// The same checkpoints kept where `store` says (`runner --checkpoint-store`): a local
    /// area elsewhere than beside the workspaces (it must be on their file system: a restore
    /// is staged in it and renamed into place), or an object store, with the local area as
    /// its cache.
    pub fn in_store(self, store: &StoreUrl) -> Result<Checkpoints, String> {
        let env: Vec<(String, String)> = std::env::vars().collect();
        self.in_store_with(store, &env)
    }

    /// [`Checkpoints::in_store`], the object store configured by `env` (the variables the
    /// runner took from its environment at start: `secrets.rs`) instead of the environment.
    pub fn in_store_with(
        mut self,
        store: &StoreUrl,
        env: &[(String, String)],
    ) -> Result<Checkpoints, String> {
        match store {
            StoreUrl::Local(None) => {}
            StoreUrl::Local(Some(dir)) => {
                use std::os::unix::fs::MetadataExt;
                let device = |path: &Path| {
                    fs::metadata(path)
                        .map(|m| m.dev())
                        .map_err(|e| format!("--checkpoint-store: {}: {e}", path.display()))
                };
                let parent = dir.parent().unwrap_or(dir);
                if device(parent)? != device(&self.root)? {
                    return Err(format!(
                        "--checkpoint-store file://{}: the checkpoint area must be on the \
                         workspaces' file system ({}), where restores are moved into place",
                        dir.display(),
                        self.root.display()
                    ));
                }
                self.area = Area::at(dir.clone());
            }
            StoreUrl::Object { .. } => self.remote = Some(Remote::open(store, env)?),
        }
        Ok(self)
    }

    /// The object store checkpoints live in, if they live in one.
    pub fn remote(&self) -> Option<&Remote> {
        self.remote.as_ref()
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

    /// [`Checkpoints::record_blocking`] on the blocking pool; with an object store, returns
    /// only once the store has acknowledged every object the checkpoint names (retried
    /// without limit: drop the future to stop).
    pub async fn record(self: &Arc<Self>, session_id: &str) -> Result<Checkpoint, CheckpointError> {
        let this = self.clone();
        let session = session_id.to_string();
        let checkpoint = tokio::task::spawn_blocking(move || this.record_blocking(&session))
            .await
            .map_err(|e| CheckpointError::Task(e.to_string()))??;
        if let Some(remote) = &self.remote {
            let root = parse_hex(&checkpoint.id).expect("a checkpoint id is a hash");
            let base = self.marker(session_id, UPLOADED);
            let sent = remote
                .upload(&self.area, session_id, &root, base.as_ref())
                .await
                .map_err(|e| self.io_error(e))?;
            tracing::debug!(checkpoint = %checkpoint.id, bytes = sent, "stored the checkpoint in the object store");
            self.set_marker(session_id, UPLOADED, &root);
        }
        Ok(checkpoint)
    }

    /// A checkpoint a session's marker file names: [`AT`] or [`UPLOADED`].
    fn marker(&self, session_id: &str, name: &str) -> Option<Hash> {
        let text = fs::read_to_string(self.area.session_dir(session_id).join(name)).ok()?;
        parse_hex(text.trim())
    }

    /// Names `root` in a session's marker file. Not synced: a marker lost in a crash costs
    /// a restore or some `HEAD`s, never a wrong workspace.
    fn set_marker(&self, session_id: &str, name: &str, root: &Hash) {
        let written = self.area.ensure_session_dir(session_id).and_then(|dir| {
            let (temp, file) = self.area.create_temp()?;
            drop(file);
            fs::write(&temp, format!("{}\n", hex(root)))?;
            fs::rename(&temp, dir.join(name))
        });
        if let Err(e) = written {
            tracing::warn!(session_id, marker = name, error = %e, "could not write a checkpoint marker");
        }
    }

    /// Brings the workspace of `session_id` to what its log says, before a runner that has
    /// just claimed it acts, to `latest`, the checkpoint its last `tool_result` names
    /// ([`LogCheckpoint`]; before any, an empty workspace):
    /// - when a dangling call (`tool_started` without a result) is to be re-run
    ///   (`rerun`), with any store, so it runs on the workspace as its `tool_started` found
    ///   it, nothing of the interrupted attempt left in it (a call reported to the model or
    ///   interrupted leaves the workspace as the attempt did);
    /// - with an object store, also when this runner's workspace is not at `latest` (another
    ///   runner worked the session since, or this one never did). With the local area the
    ///   workspaces are shared, and one is where its last holder left it.
    ///
    /// A checkpoint the store does not hold (lost, or from before checkpoints) is logged and
    /// counted, and the workspace is left as it is. Returns what the runner should log.
    pub async fn bring_to_log(
        self: &Arc<Self>,
        session_id: &str,
        latest: &LogCheckpoint,
        rerun: bool,
    ) -> Result<Option<String>, CheckpointError> {
        let source = match latest {
            // The last result names no checkpoint: nothing tells what the workspace was.
            LogCheckpoint::Unnamed => return Ok(None),
            LogCheckpoint::NoneYet => None,
            LogCheckpoint::Named(id) => Some(parse_hex(id).ok_or_else(|| {
                self.io_error(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("the log names {id:?}, which is not a checkpoint id"),
                ))
            })?),
        };
        let elsewhere = self.remote.is_some() && {
            let at = self.marker(session_id, AT);
            let there = fs::symlink_metadata(self.root.join(session_id)).is_ok();
            at != source || (!there && source.is_some())
        };
        if !rerun && !elsewhere {
            return Ok(None);
        }
        if let (Some(remote), Some(root)) = (&self.remote, &source) {
            self.fetch_referenced(remote, session_id, root).await?;
        }
        if let Some(root) = source.filter(|root| !self.area.has(area::Kind::Tree, root)) {
            health::missing();
            return Ok(Some(format!(
                "the log's checkpoint {} is not in the checkpoint store ({}): the workspace \
                 goes on as it is",
                hex(&root),
                self.remote.as_ref().map_or("the local area", |r| r.url())
            )));
        }
        let this = self.clone();
        let session = session_id.to_string();
        let restored = tokio::task::spawn_blocking(move || -> io::Result<_> {
            check_session_id(&session)?;
            this.area.ensure()?;
            let _lock = this.area.lock_shared()?;
            let dir = this.area.ensure_session_dir(&session)?;
            let _restoring = area::lock_file(&dir.join("restoring"))?;
            let restored = this.replace_workspace_keeping(&session, source.as_ref(), true)?;
            this.keep(&session, restored.root, restored.trees.clone());
            Ok(restored)
        })
        .await
        .map_err(|e| CheckpointError::Task(e.to_string()))?
        .map_err(|e| self.io_error(e))?;
        if let Some(root) = &source {
            self.set_marker(session_id, AT, root);
            if self.remote.is_some() {
                self.set_marker(session_id, UPLOADED, root);
            }
        }
        let mut report = format!(
            "brought the workspace to {} ({} files, {} bytes){}",
            match &source {
                Some(root) => format!("checkpoint {}", hex(root)),
                None => "an empty workspace (no checkpoint yet)".to_string(),
            },
            restored.files,
            restored.bytes,
            if rerun {
                ", where the interrupted call began"
            } else {
                ""
            }
        );
        for line in &restored.not_restored {
            report.push_str("; not restored: ");
            report.push_str(line);
        }
        Ok(Some(report))
    }

    /// Records in the object store, if checkpoints live in one, that `session_id`'s log
    /// names checkpoint `id` (a fork's prefix, a replay's served result), then brings its
    /// objects into the local area, where a restore reads them.
    pub async fn fetch_for(&self, session_id: &str, id: &str) -> Result<(), CheckpointError> {
        if let (Some(remote), Some(root)) = (&self.remote, parse_hex(id)) {
            remote
                .add_ref(session_id, &root)
                .await
                .map_err(|e| self.io_error(e))?;
            self.fetch_referenced(remote, session_id, &root).await?;
        }
        Ok(())
    }

    /// Fetches checkpoint `root` into the local area, named first in the session's local
    /// `refs`, so that no local sweep removes what is fetched before the restore uses it.
    async fn fetch_referenced(
        &self,
        remote: &Remote,
        session_id: &str,
        root: &Hash,
    ) -> Result<(), CheckpointError> {
        let referenced = || -> io::Result<()> {
            check_session_id(session_id)?;
            self.area.ensure()?;
            let _lock = self.area.lock_shared()?;
            self.area.add_refs(session_id, &[*root])
        };
        referenced().map_err(|e| self.io_error(e))?;
        remote
            .fetch(&self.area, root)
            .await
            .map_err(|e| self.io_error(e))?;
        Ok(())
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
        self.set_marker(session_id, AT, &recorded.root);
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
        self.restore_fork_unless(
            session_id,
            parent,
            fork_seq,
            prefix,
            &AtomicBool::new(false),
        )
    }

    /// [`Checkpoints::restore_fork_blocking`], unless `abandoned` is set by the time the
    /// restore holds the session's `restoring` lock (then it writes nothing and fails).
    fn restore_fork_unless(
        &self,
        session_id: &str,
        parent: &str,
        fork_seq: u64,
        prefix: &PrefixCheckpoints,
        abandoned: &AtomicBool,
    ) -> Result<Option<String>, CheckpointError> {
        self.restore_fork_inner(session_id, parent, fork_seq, prefix, abandoned)
            .map_err(|e| self.io_error(e))
    }

    fn restore_fork_inner(
        &self,
        session_id: &str,
        parent: &str,
        fork_seq: u64,
        prefix: &PrefixCheckpoints,
        abandoned: &AtomicBool,
    ) -> io::Result<Option<String>> {
        check_session_id(session_id)?;
        self.area.ensure()?;
        let _lock = self.area.lock_shared()?;
        // One restore of a session at a time, even by a runner whose lease ran out mid-way;
        // a removal of the workspace waits for this lock too.
        let dir = self.area.ensure_session_dir(session_id)?;
        let _restoring = area::lock_file(&dir.join("restoring"))?;
        if self.is_restored(session_id) {
            return Ok(None);
        }
        if abandoned.load(Ordering::SeqCst) {
            return Err(io::Error::new(
                io::ErrorKind::Interrupted,
                "the restore was abandoned before it began (the session's work stopped)",
            ));
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
        let restored = self.replace_workspace(session_id, source.as_ref())?;
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
        if let Some(root) = &source {
            self.set_marker(session_id, AT, root);
            if self.remote.is_some() {
                self.set_marker(session_id, UPLOADED, root);
            }
        }
        self.keep(session_id, restored.root, restored.trees);
        Ok(Some(report))
    }

    /// Replaces the workspace of `session_id` with checkpoint `source` (an empty one for
    /// `None`): staged beside the workspaces, every byte durable, then moved into place whole;
    /// the session's `refs` and `last` name it. Call it holding the area's shared lock and the
    /// session's `restoring` lock.
    fn replace_workspace(
        &self,
        session_id: &str,
        source: Option<&Hash>,
    ) -> io::Result<restore::Restored> {
        self.replace_workspace_keeping(session_id, source, false)
    }

    /// [`Checkpoints::replace_workspace`]; with `keep_left_out`, the trees checkpoints leave
    /// out (`--checkpoint-ignore`: `node_modules/`, `target/`, ...) are moved over from the
    /// workspace being replaced, as no checkpoint could bring them back.
    fn replace_workspace_keeping(
        &self,
        session_id: &str,
        source: Option<&Hash>,
        keep_left_out: bool,
    ) -> io::Result<restore::Restored> {
        // Staged beside the workspaces, then moved into place whole.
        let staging = self
            .area
            .tmp_dir()
            .join(format!("restore-{:016x}", fastrand::u64(..)));
        fs::DirBuilder::new().mode(0o700).create(&staging)?;
        let mut pending = Pending::default();
        let restored = {
            let target = restore::open_dir(&staging)?;
            let restored = match source {
                Some(root) => {
                    restore::restore(&self.area, root, &target, self.owner, &mut pending)?
                }
                None => restore::restore_empty(&self.area, &mut pending)?,
            };
            if let Some(ids) = self.owner {
                std::os::unix::fs::chown(&staging, Some(ids.uid), Some(ids.gid))?;
            }
            // Every restored byte durable before the workspace is marked restored or moved.
            nix::unistd::syncfs(&target)?;
            restored
        };
        let workspace = self.root.join(session_id);
        if keep_left_out {
            for path in self.ignore.left_out_in(&workspace)? {
                match fs::rename(workspace.join(&path), staging.join(&path)) {
                    Ok(()) => {}
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                    Err(e) => return Err(e),
                }
            }
        }
        if fs::symlink_metadata(&workspace).is_ok() {
            // Left by a restore that died before it was marked (no tool ran in it), the
            // replay's workspace from before its move (no tool runs in it meanwhile), or
            // one being brought back to its log's checkpoint (no tool runs in it yet).
            let aside = self
                .area
                .tmp_dir()
                .join(format!("aside-{:016x}", fastrand::u64(..)));
            fs::rename(&workspace, &aside)?;
            let _ = remove::remove_tree(&aside);
        }
        fs::rename(&staging, &workspace)?;
        area::sync_dir(&self.root)?;
        self.area.sync(pending)?;
        self.area.add_refs(session_id, &[restored.root])?;
        self.set_last(session_id, &restored.root)?;
        Ok(restored)
    }

    /// Keeps checkpoint `id` for `session_id` as long as the session lives: a replay's served
    /// result names its recording's checkpoint, which must outlive the recording. Returns
    /// whether this area holds it.
    pub fn keep_served(&self, session_id: &str, id: &str) -> Result<bool, CheckpointError> {
        let inner = || -> io::Result<bool> {
            check_session_id(session_id)?;
            self.area.ensure()?;
            let _lock = self.area.lock_shared()?;
            match parse_hex(id) {
                Some(hash) if self.area.has(area::Kind::Tree, &hash) => {
                    self.area.add_refs(session_id, &[hash])?;
                    Ok(true)
                }
                _ => Ok(false),
            }
        };
        inner().map_err(|e| self.io_error(e))
    }

    /// Moves the workspace of replay `session_id` to `checkpoint`, what its served result at
    /// `served_seq` names (the recording's workspace right after that call), unless it was
    /// moved there already (`moved` marks it, durably). Called once the replay leaves the
    /// recorded path, before anything runs in or records the workspace. Returns what the
    /// runner should log, once; what could not be restored goes to the model with the next
    /// tool result, as for a fork.
    pub fn move_to_served_blocking(
        &self,
        session_id: &str,
        served_seq: u64,
        checkpoint: Option<&str>,
    ) -> Result<Option<String>, CheckpointError> {
        self.move_inner(session_id, served_seq, checkpoint)
            .map_err(|e| self.io_error(e))
    }

    /// [`Checkpoints::move_to_served_blocking`] on the blocking pool.
    pub async fn move_to_served(
        self: &Arc<Self>,
        session_id: &str,
        served_seq: u64,
        checkpoint: Option<String>,
    ) -> Result<Option<String>, CheckpointError> {
        if let Some(id) = &checkpoint {
            self.fetch_for(session_id, id).await?;
        }
        let this = self.clone();
        let session_id = session_id.to_string();
        tokio::task::spawn_blocking(move || {
            this.move_to_served_blocking(&session_id, served_seq, checkpoint.as_deref())
        })
        .await
        .map_err(|e| CheckpointError::Task(e.to_string()))?
    }

    fn move_inner(
        &self,
        session_id: &str,
        served_seq: u64,
        checkpoint: Option<&str>,
    ) -> io::Result<Option<String>> {
        check_session_id(session_id)?;
        self.area.ensure()?;
        let _lock = self.area.lock_shared()?;
        let dir = self.area.ensure_session_dir(session_id)?;
        let _restoring = area::lock_file(&dir.join("restoring"))?;
        let marker = dir.join("moved");
        let done = fs::read_to_string(&marker)
            .ok()
            .and_then(|text| text.trim().parse::<u64>().ok());
        if done == Some(served_seq) {
            return Ok(None);
        }
        let mut missing = Vec::new();
        let source = match checkpoint {
            None => {
                missing.push(format!(
                    "every file: the recorded result served at seq {served_seq} names no checkpoint"
                ));
                None
            }
            Some(id) => match parse_hex(id) {
                Some(hash) if self.area.has(area::Kind::Tree, &hash) => Some(hash),
                _ => {
                    missing.push(format!(
                        "every file: checkpoint {id} (served at seq {served_seq}) is not in this \
                         runner's checkpoint area {}",
                        self.area.dir().display()
                    ));
                    None
                }
            },
        };
        let restored = self.replace_workspace(session_id, source.as_ref())?;
        missing.extend(restored.not_restored.iter().cloned());
        let mut report = format!(
            "This replay left the recorded path after the call served at seq {served_seq}; its \
             workspace was moved to {} ({} files, {} bytes).",
            match &source {
                Some(root) => format!("the recorded checkpoint {}", hex(root)),
                None => "an empty workspace".to_string(),
            },
            restored.files,
            restored.bytes
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
            .write_file_durably(&marker, served_seq.to_string().as_bytes())?;
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

    /// Removes the workspace of `session_id`, a deleted session, if there is one (returns
    /// whether there was). It is first moved aside, into the area's `removing/`, while no
    /// restore of the session is half-way (its `restoring` lock held), so the name is free at
    /// once and nothing can restore into it after; then removed without following a link
    /// ([`remove::remove_tree`]). A removal that fails half-way leaves the rest in
    /// `removing/`, which [`Checkpoints::empty_removing_blocking`] empties. Blocking.
    pub fn remove_workspace_blocking(&self, session_id: &str) -> Result<bool, CheckpointError> {
        self.remove_workspace_inner(session_id)
            .map_err(|e| self.io_error(e))
    }

    fn remove_workspace_inner(&self, session_id: &str) -> io::Result<bool> {
        check_session_id(session_id)?;
        let workspace = self.root.join(session_id);
        let aside = {
            self.area.ensure()?;
            let _lock = self.area.lock_shared()?;
            let dir = self.area.session_dir(session_id);
            let _restoring = if dir.is_dir() {
                Some(area::lock_file(&dir.join("restoring"))?)
            } else {
                None
            };
            if fs::symlink_metadata(&workspace).is_err() {
                return Ok(false);
            }
            let removing = self.area.removing_dir();
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&removing)?;
            let aside = removing.join(format!("{session_id}.{:016x}", fastrand::u64(..)));
            match fs::rename(&workspace, &aside) {
                Ok(()) => aside,
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
                // Another file system (the workspace is a mount): removed where it is.
                Err(e) if e.raw_os_error() == Some(nix::libc::EXDEV) => workspace,
                Err(e) => return Err(e),
            }
        };
        remove::remove_tree(&aside)?;
        Ok(true)
    }

    /// Removes what removals that failed or were cut short left in `removing/`. Blocking.
    pub fn empty_removing_blocking(&self) -> Result<usize, CheckpointError> {
        let inner = || -> io::Result<usize> {
            let entries = match fs::read_dir(self.area.removing_dir()) {
                Ok(entries) => entries,
                Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(0),
                Err(e) => return Err(e),
            };
            let mut removed = 0;
            for entry in entries {
                remove::remove_tree(&entry?.path())?;
                removed += 1;
            }
            Ok(removed)
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
    if let Some((_, id)) = &prefix.latest {
        checkpoints.fetch_for(session_id, id).await?;
    }
    let this = checkpoints.clone();
    let (session, parent, seq) = (
        session_id.to_string(),
        forked_from.session_id.clone(),
        forked_from.seq,
    );
    // Dropped with this future (the session's work stopped), it tells a restore that has
    // not begun to write nothing; one already writing holds the lock a removal waits for.
    let abandon = Abandon(Arc::new(AtomicBool::new(false)));
    let abandoned = abandon.0.clone();
    let report = tokio::task::spawn_blocking(move || {
        this.restore_fork_unless(&session, &parent, seq, &prefix, &abandoned)
    })
    .await
    .map_err(|e| CheckpointError::Task(e.to_string()))??;
    drop(abandon);
    if let Some(report) = report {
        if report.contains("Not restored") {
            tracing::warn!(%report, "restored the fork's workspace, not all of it");
        } else {
            tracing::info!(%report, "restored the fork's workspace");
        }
    }
    Ok(())
}

/// Sets its flag when dropped.
struct Abandon(Arc<AtomicBool>);

impl Drop for Abandon {
    fn drop(&mut self) {
        self.0.store(true, Ordering::SeqCst);
    }
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
