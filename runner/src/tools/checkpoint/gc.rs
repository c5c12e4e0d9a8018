//! The checkpoints' lifetime: a checkpoint stays while some session whose log names it
//! exists, and goes once none does.
//!
//! Each session's `refs` lists the checkpoints its log may name: the runner adds each one it
//! records, and a fork *adopts* the ones its copied prefix names (at its restore, or here,
//! whichever comes first). So the objects to keep are exactly those reachable from the
//! `refs` of the sessions that exist, and [`collect_garbage`]:
//! 1. asks the store about every session the area holds `refs` for; one answered with the
//!    reason `SESSION_DELETED` is gone (a bare `NOT_FOUND` is not evidence: a token's scope
//!    answers the same);
//! 2. if any is gone, lists every session and adopts each fork not adopted yet, reading
//!    its prefix. A fork is made from an existing parent, so every fork of a gone session
//!    already existed when the listing began and is found (the listing pages by
//!    `(updated, id)`, and sessions updated while it runs are read again from the top);
//! 3. removes the gone sessions' `refs` and sweeps, under the area's exclusive lock, every
//!    object, temporary file and staged restore nothing reachable names.
//!
//! Crash points: each step only adds references (adoption) or removes what nothing names,
//! so a GC killed anywhere leaves the area correct and the next run finishes the job.
//!
//! With an object store, the runner's sweep then sweeps the store (`remote_gc.rs`).
//!
//! A runner's sweep (`runner/src/sweep.rs`) calls [`collect_garbage`] (the store client and
//! the toolbox's [`Checkpoints`] are all it needs) and then removes the workspaces of the
//! sessions in [`Collected::forgotten`].

use std::collections::HashSet;
use std::fs;
use std::io;
use std::sync::Arc;

use agentlog_client::StoreClient;
use agentlog_proto::reason::Reason;
use agentlog_proto::v1::{
    GetSessionRequest, ListSessionsRequest, ListSessionsResponse, SessionInfo,
};

use super::area::{parse_hex, Hash, Kind};
use super::tree::Tree;
use super::{CheckpointError, Checkpoints, PrefixCheckpoints};
use crate::tools::remove::remove_tree;

/// ListSessions pages of this size.
const PAGE: u32 = 1000;
/// Sessions updated within this long before the listing began are read again after it
/// (the store's clocks may differ between replicas).
const CLOCK_MARGIN_MS: i64 = 60_000;

/// What a sweep removed.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Swept {
    pub trees_removed: usize,
    pub blobs_removed: usize,
    pub bytes_freed: u64,
}

/// What [`collect_garbage`] did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Collected {
    /// Sessions the store says are deleted, whose checkpoints were forgotten.
    pub forgotten: Vec<String>,
    /// Forks whose prefix's checkpoints were adopted on the way.
    pub adopted: Vec<String>,
    pub swept: Swept,
}

#[derive(Debug, thiserror::Error)]
pub enum GcError {
    #[error(transparent)]
    Area(#[from] CheckpointError),
    #[error("the event store: {0}")]
    Store(#[from] tonic::Status),
}

/// Forgets the checkpoints of the sessions the store says are deleted (after adopting, for
/// every fork, what its log still names) and sweeps what nothing names any more.
pub async fn collect_garbage(
    checkpoints: &Arc<Checkpoints>,
    client: &StoreClient,
) -> Result<Collected, GcError> {
    let mut gone = Vec::new();
    for session_id in checkpoints.sessions()? {
        if is_gone(client, &session_id).await? {
            gone.push(session_id)
        }
    }
    let mut adopted = Vec::new();
    if !gone.is_empty() {
        for info in every_session(client).await? {
            let Some(fork) = &info.forked_from else {
                continue;
            };
            if checkpoints.is_adopted(&info.session_id) {
                continue;
            }
            let prefix = PrefixCheckpoints::read(client, &info.session_id, fork.seq).await?;
            checkpoints.adopt(&info.session_id, &prefix.named)?;
            adopted.push(info.session_id);
        }
    }
    let this = checkpoints.clone();
    let forget = gone.clone();
    let swept = tokio::task::spawn_blocking(move || this.forget_and_sweep(&forget))
        .await
        .map_err(|e| CheckpointError::Task(e.to_string()))??;
    Ok(Collected {
        forgotten: gone,
        adopted,
        swept,
    })
}

/// Whether the store says `session_id` was deleted (a bare `NOT_FOUND` is not evidence: a
/// token's scope answers the same).
pub(super) async fn is_gone(client: &StoreClient, session_id: &str) -> Result<bool, tonic::Status> {
    let asked = client
        .clone()
        .get_session(GetSessionRequest {
            session_id: session_id.to_string(),
        })
        .await;
    match asked {
        Ok(_) => Ok(false),
        Err(status) if Reason::of(&status) == Some(Reason::SessionDeleted) => Ok(true),
        Err(status) if status.code() == tonic::Code::NotFound => Ok(false),
        Err(status) => Err(status),
    }
}

/// One page of `ListSessions` from `token` on.
async fn page(client: &StoreClient, token: &str) -> Result<ListSessionsResponse, tonic::Status> {
    Ok(client
        .clone()
        .list_sessions(ListSessionsRequest {
            page_size: PAGE,
            page_token: token.to_string(),
            ..ListSessionsRequest::default()
        })
        .await?
        .into_inner())
}

/// Every session that exists throughout the listing (and some that came or went).
pub(super) async fn every_session(client: &StoreClient) -> Result<Vec<SessionInfo>, tonic::Status> {
    let mut sessions = Vec::new();
    let mut token = String::new();
    let mut since: Option<i64> = None;
    loop {
        let page = page(client, &token).await?;
        if since.is_none() {
            since = Some(
                page.sessions
                    .first()
                    .map_or(i64::MIN, |s| s.updated_unix_ms - CLOCK_MARGIN_MS),
            );
        }
        sessions.extend(page.sessions);
        if page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    // A session updated while the pages were read moved ahead of them: read the top again.
    let since = since.unwrap_or(i64::MIN);
    let mut token = String::new();
    loop {
        let page = page(client, &token).await?;
        let recent = page.sessions.iter().all(|s| s.updated_unix_ms >= since);
        sessions.extend(
            page.sessions
                .into_iter()
                .filter(|s| s.updated_unix_ms >= since),
        );
        if !recent || page.next_page_token.is_empty() {
            break;
        }
        token = page.next_page_token;
    }
    Ok(sessions)
}

impl Checkpoints {
    /// Removes what the area keeps for `gone` (sessions that no longer exist) and sweeps
    /// every object, temporary file and staged restore that no remaining session's `refs`
    /// reaches. Holds the area's exclusive lock meanwhile, so no checkpoint or restore is
    /// half-way. Blocking.
    pub fn forget_and_sweep(&self, gone: &[String]) -> Result<Swept, CheckpointError> {
        self.forget_and_sweep_inner(gone)
            .map_err(|e| self.io_error(e))
    }

    fn forget_and_sweep_inner(&self, gone: &[String]) -> io::Result<Swept> {
        self.area.ensure()?;
        let _lock = self.area.lock_exclusive()?;
        for session_id in gone {
            remove_tree(&self.area.session_dir(session_id))?;
            self.forget_kept(session_id);
        }
        let mut live_trees = HashSet::new();
        let mut live_blobs = HashSet::new();
        for entry in fs::read_dir(self.area.sessions_dir())? {
            let session_id = entry?.file_name().to_string_lossy().into_owned();
            for root in self.area.refs(&session_id)? {
                self.mark(root, &mut live_trees, &mut live_blobs)?;
            }
        }
        let mut swept = Swept::default();
        for (kind, live) in [(Kind::Tree, &live_trees), (Kind::Blob, &live_blobs)] {
            for entry in fs::read_dir(self.area.objects_dir(kind))? {
                let entry = entry?;
                let keep = entry
                    .file_name()
                    .to_str()
                    .and_then(parse_hex)
                    .is_some_and(|hash| live.contains(&hash));
                if keep {
                    continue;
                }
                swept.bytes_freed += entry.metadata().map(|m| m.len()).unwrap_or(0);
                remove_tree(&entry.path())?;
                match kind {
                    Kind::Tree => swept.trees_removed += 1,
                    Kind::Blob => swept.blobs_removed += 1,
                }
            }
        }
        // Nothing is being written: what is here was left by a crash.
        for entry in fs::read_dir(self.area.tmp_dir())? {
            remove_tree(&entry?.path())?;
        }
        Ok(swept)
    }

    /// Marks the trees and blobs reachable from `root`.
    fn mark(
        &self,
        root: Hash,
        trees: &mut HashSet<Hash>,
        blobs: &mut HashSet<Hash>,
    ) -> io::Result<()> {
        let mut stack = vec![root];
        while let Some(hash) = stack.pop() {
            if !trees.insert(hash) {
                continue;
            }
            let bytes = match self.area.read(Kind::Tree, &hash) {
                Ok(bytes) => bytes,
                Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            let Ok(tree) = Tree::from_bytes(&bytes) else {
                continue;
            };
            tree.reach(&mut stack, blobs);
        }
        Ok(())
    }
}
