//! Deleted sessions' workspaces and checkpoints leave the disk, whoever deleted them and
//! whenever.
//!
//! Promises:
//! - A workspace is removed only once the store has said its session was deleted (`NOT_FOUND`
//!   with the reason `SESSION_DELETED`, which nothing undoes). A directory whose session the
//!   store does not know (a bare `NOT_FOUND`: never written, or outside the token's scope) or
//!   cannot tell about is left alone.
//! - The runner that holds a session when it is deleted removes its workspace as soon as its
//!   work has stopped (`worker.rs`: the tool's process tree killed and reaped, a fork
//!   restore in flight finished or abandoned), then asks for a sweep ([`Sweeper::kick`]) so
//!   that the checkpoints go too.
//! - Every runner sweeps when it starts, every `--sweep-every` after, and when kicked
//!   ([`Sweeper::run`]). A sweep runs the checkpoints' GC
//!   (`tools::checkpoint::gc::collect_garbage`: forks adopt what they still need, then the
//!   deleted sessions' checkpoints go), with an object store the store's sweep
//!   (`tools::checkpoint::remote_gc`), and removes the workspaces of the sessions it
//!   forgot; it then asks the store about every other workspace directory (one with no
//!   checkpoint, or made again by a runner that had not yet heard of the deletion) and
//!   removes those of deleted sessions; last, it empties what earlier removals left in the
//!   area's `removing/`. So whatever a stopping runner or a crash left behind goes by the
//!   next sweep of any runner sharing the workspace root.
//! - Removal itself (`Checkpoints::remove_workspace_blocking`) moves the workspace aside
//!   first and never follows a link inside it.

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use agentlog_client::refusal::is_session_deleted;
use agentlog_client::StoreClient;
use agentlog_proto::v1::GetSessionRequest;
use tokio::sync::Notify;

use crate::tools::checkpoint::gc::{self, GcError};
use crate::tools::checkpoint::remote_gc;
use crate::tools::checkpoint::{CheckpointError, Checkpoints};

/// The pause before a sweep that failed (the store unreachable, say) is tried again.
const RETRY_AFTER: Duration = Duration::from_secs(30);

/// What one sweep did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct SweepReport {
    /// Deleted sessions whose workspaces were removed.
    pub workspaces_removed: Vec<String>,
    /// Deleted sessions whose checkpoints the GC forgot.
    pub checkpoints_forgotten: Vec<String>,
    /// Leftovers of earlier removals cleared from `removing/`.
    pub leftovers_removed: usize,
}

#[derive(Debug, thiserror::Error)]
pub enum SweepError {
    #[error("the checkpoints' GC: {0}")]
    Gc(#[from] GcError),
    #[error(transparent)]
    Area(#[from] CheckpointError),
    #[error("the workspace root {dir}: {source}")]
    Root {
        dir: PathBuf,
        source: std::io::Error,
    },
    #[error("the event store: {0}")]
    Store(#[from] tonic::Status),
}

/// Removes deleted sessions' workspaces under one workspace root.
#[derive(Debug)]
pub struct Sweeper {
    root: PathBuf,
    checkpoints: Arc<Checkpoints>,
    client: StoreClient,
    kicked: Notify,
}

impl Sweeper {
    /// The sweeper of the workspaces under `root`, whose checkpoints are `checkpoints`.
    pub fn new(root: PathBuf, checkpoints: Arc<Checkpoints>, client: StoreClient) -> Sweeper {
        Sweeper {
            root,
            checkpoints,
            client,
            kicked: Notify::new(),
        }
    }

    /// Asks [`Sweeper::run`] for a sweep soon; kicks while one runs make one more, not many.
    pub fn kick(&self) {
        self.kicked.notify_one();
    }

    /// Sweeps now, then every `every` (never again if it is zero) and whenever kicked, for as
    /// long as it is polled. A sweep that fails is logged and tried again after
    /// [`RETRY_AFTER`] (or the next kick). Dropped mid-sweep, it leaves nothing wrong: the
    /// GC is safe to stop anywhere, and a removal's leftovers wait in `removing/`.
    pub async fn run(&self, every: Duration) {
        loop {
            let pause = match self.sweep().await {
                Ok(swept) => {
                    if swept != SweepReport::default() {
                        tracing::info!(
                            workspaces_removed = ?swept.workspaces_removed,
                            checkpoints_forgotten = ?swept.checkpoints_forgotten,
                            leftovers_removed = swept.leftovers_removed,
                            "swept deleted sessions' workspaces"
                        );
                    }
                    crate::metrics::sweep("ok");
                    every
                }
                Err(e) => {
                    tracing::warn!(error = %e, "sweeping deleted sessions' workspaces failed; trying again later");
                    crate::metrics::sweep("failed");
                    if every.is_zero() {
                        every
                    } else {
                        every.min(RETRY_AFTER)
                    }
                }
            };
            let next = async {
                if pause.is_zero() {
                    std::future::pending::<()>().await
                } else {
                    tokio::time::sleep(pause).await
                }
            };
            tokio::select! {
                _ = self.kicked.notified() => {}
                _ = next => {}
            }
        }
    }

    /// One sweep (see the module's promises).
    pub async fn sweep(&self) -> Result<SweepReport, SweepError> {
        let known: HashSet<String> = self.checkpoints.sessions()?.into_iter().collect();
        let collected = gc::collect_garbage(&self.checkpoints, &self.client).await?;
        if let Some(remote) = self.checkpoints.remote() {
            let swept =
                remote_gc::collect_remote_garbage(&self.checkpoints, remote, &self.client).await?;
            if swept.objects_removed > 0 || !swept.sessions_forgotten.is_empty() {
                tracing::info!(
                    store = %remote.url(),
                    sessions = ?swept.sessions_forgotten,
                    forks_adopted = swept.forks_adopted.len(),
                    objects_removed = swept.objects_removed,
                    bytes_freed = swept.bytes_freed,
                    "swept the object store"
                );
            }
        }
        let mut swept = SweepReport {
            checkpoints_forgotten: collected.forgotten.clone(),
            ..SweepReport::default()
        };
        for session_id in &collected.forgotten {
            if self.remove_workspace(session_id).await? {
                swept.workspaces_removed.push(session_id.clone());
            }
        }
        // The GC asked about every session in `known`; the other workspaces are asked here.
        for session_id in self.workspace_dirs().await? {
            if known.contains(&session_id) || collected.forgotten.contains(&session_id) {
                continue;
            }
            let asked = self
                .client
                .clone()
                .get_session(GetSessionRequest {
                    session_id: session_id.clone(),
                })
                .await;
            match asked {
                Err(status) if is_session_deleted(&status) => {
                    if self.remove_workspace(&session_id).await? {
                        swept.workspaces_removed.push(session_id);
                    }
                }
                Ok(_) => {}
                Err(status) if status.code() == tonic::Code::NotFound => {}
                Err(status) => return Err(status.into()),
            }
        }
        let checkpoints = self.checkpoints.clone();
        swept.leftovers_removed =
            tokio::task::spawn_blocking(move || checkpoints.empty_removing_blocking())
                .await
                .map_err(|e| CheckpointError::Task(e.to_string()))??;
        Ok(swept)
    }

    /// Removes the workspace of `session_id`, which the store said was deleted; returns
    /// whether there was one.
    pub async fn remove_workspace(&self, session_id: &str) -> Result<bool, CheckpointError> {
        let checkpoints = self.checkpoints.clone();
        let session_id = session_id.to_string();
        let removed =
            tokio::task::spawn_blocking(move || checkpoints.remove_workspace_blocking(&session_id))
                .await
                .map_err(|e| CheckpointError::Task(e.to_string()))??;
        if removed {
            crate::metrics::workspace_removed();
        }
        Ok(removed)
    }

    /// The names of the directories under the root that can be sessions' workspaces (a
    /// session id never starts with a dot; the checkpoint area does).
    async fn workspace_dirs(&self) -> Result<Vec<String>, SweepError> {
        let root = self.root.clone();
        let listed = tokio::task::spawn_blocking(move || -> std::io::Result<Vec<String>> {
            let mut names = Vec::new();
            for entry in std::fs::read_dir(&root)? {
                let entry = entry?;
                let Some(name) = entry.file_name().to_str().map(str::to_string) else {
                    continue;
                };
                if !name.starts_with('.') && entry.file_type()?.is_dir() {
                    names.push(name);
                }
            }
            Ok(names)
        })
        .await
        .map_err(|e| CheckpointError::Task(e.to_string()))?;
        listed.map_err(|source| SweepError::Root {
            dir: self.root.clone(),
            source,
        })
    }
}
