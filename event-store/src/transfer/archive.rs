//! `event-store --retain-idle DURATION --archive-dir DIR`: retention that keeps what it
//! deletes. Every session retention takes is first exported, alone, to a file of its own
//! in DIR (`<session id>.agentlog.jsonl`, the export format, which `agentlog import`
//! reads back), and that file made durable; only then is the session deleted, and only if
//! nothing was written to it since it was read (so the file holds all it had).
//!
//! Steps for one session, and what a crash (`kill -9`, power loss) after each leaves:
//! 1. the export written to `<name>.partial` beside its place, and fsync'd: a partial file,
//!    the session untouched (the next pass removes partial files and starts again);
//! 2. renamed into place, and the directory fsync'd: the archive, whole, and the session
//!    untouched (the next pass writes the archive again, and deletes);
//! 3. the session deleted, as retention deletes it, if it is still as it was read (else
//!    the archive is removed: the session is not idle any more).
//!
//! So a session is never deleted without its archive whole on disk; a crash leaves at most
//! an archive of a session that still exists, which the next pass replaces.
//!
//! On PostgreSQL each replica with `--archive-dir` runs these passes (a session is
//! deleted once: the deletion is version-checked); replicas that share DIR write the same
//! file in turn.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use tokio_util::sync::CancellationToken;

use super::export::{export, Out, Which};
use crate::backend::{Backend, Expiring};
use crate::clock::now_unix_ms;
use crate::error::StoreError;
use crate::retention::{Retention, BATCH};

/// The archive directory, and the retention it serves.
pub struct Archive {
    pub dir: PathBuf,
    pub retention: Retention,
}

/// How an archive file is named: the session id (ids hold no `/`) and the format's
/// extension.
pub fn file_name(session_id: &str) -> String {
    format!("{session_id}.agentlog.jsonl")
}

impl Archive {
    /// Runs a pass every `retention.interval` until `stop` fires.
    pub async fn run(self, backend: Arc<dyn Backend>, stop: CancellationToken) {
        loop {
            tokio::select! {
                _ = tokio::time::sleep(self.retention.interval) => {}
                _ = stop.cancelled() => return,
            }
            let pass = self.pass(&backend);
            let result = tokio::select! {
                result = pass => result,
                _ = stop.cancelled() => return,
            };
            if let Err(e) = result {
                tracing::warn!(error = %e, "an archive pass stopped; the next one tries again");
            }
        }
    }

    /// One pass: steps of at most [`BATCH`] sessions until none is left to take.
    pub async fn pass(&self, backend: &Arc<dyn Backend>) -> Result<(), StoreError> {
        self.remove_partial_files()?;
        loop {
            let idle_before = self.retention.idle_before(now_unix_ms());
            let expiring = backend.expiring(idle_before, BATCH).await?;
            if expiring.is_empty() {
                return Ok(());
            }
            let mut deleted = 0;
            for session in &expiring {
                if self.archive(backend, session, idle_before).await? {
                    deleted += 1;
                }
            }
            tracing::info!(
                sessions = deleted,
                dir = %self.dir.display(),
                "retention archived and deleted idle sessions"
            );
            if expiring.len() < BATCH || deleted == 0 {
                return Ok(());
            }
        }
    }

    /// Steps 1-3 of the module head for one session; whether it was deleted.
    async fn archive(
        &self,
        backend: &Arc<dyn Backend>,
        session: &Expiring,
        idle_before: i64,
    ) -> Result<bool, StoreError> {
        let target = self.dir.join(file_name(&session.session_id));
        let partial = self
            .dir
            .join(format!("{}.partial", file_name(&session.session_id)));
        let file = std::fs::File::create(&partial).map_err(|e| io(&partial, e))?;
        let mut out = FileOut {
            file: std::io::BufWriter::with_capacity(1 << 20, file),
            path: partial.clone(),
        };
        export(
            backend,
            Which::Named(vec![session.session_id.clone()]),
            &mut out,
        )
        .await?;
        let file = out
            .file
            .into_inner()
            .map_err(|e| io(&partial, e.into_error()))?;
        let path = partial.clone();
        let dir = self.dir.clone();
        let target_path = target.clone();
        tokio::task::spawn_blocking(move || -> Result<(), StoreError> {
            file.sync_all().map_err(|e| io(&path, e))?;
            drop(file);
            std::fs::rename(&path, &target_path).map_err(|e| io(&target_path, e))?;
            std::fs::File::open(&dir)
                .and_then(|d| d.sync_all())
                .map_err(|e| io(&dir, e))
        })
        .await
        .map_err(|e| StoreError::Internal(format!("the archive's sync stopped: {e}")))??;
        if backend.delete_expiring(session, idle_before).await? {
            return Ok(true);
        }
        // Written (or leased, or pinned) since it was read: it stays, and so the archive
        // of an earlier state goes.
        std::fs::remove_file(&target).map_err(|e| io(&target, e))?;
        Ok(false)
    }

    /// What a pass that stopped in the middle left (step 1).
    fn remove_partial_files(&self) -> Result<(), StoreError> {
        let entries = std::fs::read_dir(&self.dir).map_err(|e| io(&self.dir, e))?;
        for entry in entries {
            let path = entry.map_err(|e| io(&self.dir, e))?.path();
            if path.extension().is_some_and(|x| x == "partial") {
                std::fs::remove_file(&path).map_err(|e| io(&path, e))?;
            }
        }
        Ok(())
    }
}

struct FileOut {
    file: std::io::BufWriter<std::fs::File>,
    path: PathBuf,
}

#[tonic::async_trait]
impl Out for FileOut {
    async fn write(&mut self, piece: String) -> Result<(), StoreError> {
        self.file
            .write_all(piece.as_bytes())
            .map_err(|e| io(&self.path, e))
    }
}

fn io(path: &Path, e: std::io::Error) -> StoreError {
    StoreError::Internal(format!("--archive-dir: {}: {e}", path.display()))
}
