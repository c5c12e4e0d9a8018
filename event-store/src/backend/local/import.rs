//! Imports on the local log: a session's events are staged where no call can see them, and
//! the session appears, whole, with one record.
//!
//! A session of any length cannot be one atomic append (an append never spans segments),
//! so its events go, in appends of their own, into a **staging session**: a session whose
//! id (`~<boot>.<n>`, [`STAGING_PREFIX`]) no client can name, which is never listed nor
//! claimed, and whose events are stored exactly as the export gives them (seqs, ids,
//! times, contents; only the session id is the staging one). The commit is one record, the
//! session's start as a fork's (`writer::Op::Adopt`): its state, folded from the staged
//! events by the rules every append follows, naming the staging session as the base of all
//! its seqs. From then on the session reads them through it, as a fork reads its shared
//! prefix (each given the session's id), dedups against them, and goes on from its last
//! seq; deleting the session deletes its staging session with it, and the reclamation
//! materializes the prefix of any fork of it first, as for any fork.
//!
//! Crash points (a `kill -9` of the store, or power loss, anywhere in an import):
//! - before the commit record is durable: the session does not exist; its staging session
//!   holds some of its events, invisibly. At the next open the reclaimer deletes every
//!   staging session of an earlier run that no session reads through
//!   ([`Index::unfinished_stagings`]), and its records leave the log as a deleted
//!   session's do. Importing the session again stages it anew.
//! - after it: the session is whole (the commit is one record, after every staged event
//!   was durable).
//!
//! An import cut short while the store runs (a refused line, a client gone) deletes its
//! staging session at once ([`Staging::abandon`]).
//!
//! [`Index::unfinished_stagings`]: super::index::Index::unfinished_stagings

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use agentlog_proto::kept::KeptEvent;
use agentlog_proto::v1::SessionInfo;
use tokio::sync::{mpsc, oneshot};

use super::index::STAGING_PREFIX;
use super::writer::{Adopt, DeleteOp, Op, Stage};
use crate::backend::{StageError, Staging};
use crate::error::StoreError;

/// Names the staging sessions of one run of the store: `~<boot>.<n>`, `boot` random per
/// open, so that the reclaimer's look for unfinished imports of earlier runs never takes
/// one of this run's.
pub(crate) struct StagingNames {
    boot: String,
    next: AtomicU64,
}

impl StagingNames {
    pub(crate) fn new() -> StagingNames {
        StagingNames {
            boot: crate::ids::random_uuid().simple().to_string(),
            next: AtomicU64::new(1),
        }
    }

    fn next(&self) -> String {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        format!("{STAGING_PREFIX}{}.{n}", self.boot)
    }

    /// Whether `staging` was named by this run.
    pub(crate) fn is_this_runs(&self, staging: &str) -> bool {
        staging
            .strip_prefix(STAGING_PREFIX)
            .and_then(|rest| rest.strip_prefix(self.boot.as_str()))
            .is_some_and(|rest| rest.starts_with('.'))
    }
}

/// One import on the local log (see the module head).
pub(crate) struct LocalStaging {
    queue: mpsc::Sender<Op>,
    session_id: String,
    staging: String,
}

impl LocalStaging {
    pub(crate) fn begin(
        queue: mpsc::Sender<Op>,
        names: &Arc<StagingNames>,
        session_id: &str,
    ) -> LocalStaging {
        LocalStaging {
            queue,
            session_id: session_id.to_string(),
            staging: names.next(),
        }
    }

    async fn ask<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<Result<T, StoreError>>) -> Op,
    ) -> Result<T, StoreError> {
        let (tx, rx) = oneshot::channel();
        self.queue.send(make(tx)).await.map_err(|_| gone())?;
        rx.await.map_err(|_| gone())?
    }
}

#[tonic::async_trait]
impl Staging for LocalStaging {
    async fn stage(&mut self, events: Vec<KeptEvent>) -> Result<(), StageError> {
        let stage = Stage {
            staging: self.staging.clone(),
            events,
        };
        match self.ask(|tx| Op::Stage(Box::new(stage), tx)).await? {
            None => Ok(()),
            Some((seq, earlier, event_id)) => Err(StageError::Repeated {
                seq,
                earlier,
                event_id,
            }),
        }
    }

    async fn commit(self: Box<Self>, line: SessionInfo) -> Result<(), StoreError> {
        let adopt = Adopt {
            session_id: self.session_id.clone(),
            staging: self.staging.clone(),
            line,
        };
        let committed = self.ask(|tx| Op::Adopt(Box::new(adopt), tx)).await;
        if committed.is_err() {
            self.drop_staged().await;
        }
        committed
    }

    async fn abandon(self: Box<Self>) {
        self.drop_staged().await
    }
}

impl LocalStaging {
    /// Deletes the staging session (nothing staged yet: nothing to delete).
    async fn drop_staged(&self) {
        let staging = self.staging.clone();
        match self
            .ask(|tx| Op::Delete(DeleteOp::Session(staging), tx))
            .await
        {
            Ok(_) => {}
            Err(e) if e.reason() == Some(agentlog_proto::reason::Reason::SessionNotFound) => {}
            Err(e) => tracing::warn!(
                session_id = self.session_id,
                error = %e,
                "an abandoned import's staged events stay until the next open removes them"
            ),
        }
    }
}

fn gone() -> StoreError {
    StoreError::Unavailable("the store is shutting down (or its disk failed); retry".into())
}
