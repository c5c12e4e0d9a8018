//! Append: one statement per try, landing only on the state it was planned against.
//!
//! An append is planned ([`plan`]) by the rules of the local writer, through the same
//! functions ([`crate::rules`]), against the session's state as this replica has it (its
//! [`SessionMeta`] and row `version`, see [`super::replica`]), then queued for the batch
//! writer ([`super::batch`]), which writes it with the other appends waiting, in one
//! statement that lands only if the session row is still at that version and none of the
//! event ids exists: it bumps the version, stores the new state and inserts the events.
//!
//! Promises:
//! - Seqs are gapless because each write names the version (and so the last seq) it
//!   extends; dedup and the lease epoch are checked atomically with the write for the same
//!   reason. If the state was stale, the append re-reads the row (and which of its event
//!   ids the session holds, with their seqs, down its line of bases) and plans again.
//! - A refusal, or an append all of whose events the session already holds (answered
//!   with their original seqs), is decided only against a state read fresh, never against
//!   the cache.
//! - An acknowledgement means committed (with `synchronous_commit` on); a write whose
//!   commit is in doubt is answered `UNAVAILABLE` and settled by its retry with the same
//!   event ids.

use std::collections::HashMap;
use std::sync::Arc;

use agentlog_proto::kept::KeptEvent;
use agentlog_proto::v1::AppendResponse;
use tokio::sync::oneshot;

use super::batch;
use super::replica::{contended, Cached, Replica, MAX_ATTEMPTS};
use super::rows::Columns;
use crate::backend::AppendOp;
use crate::clock::now_unix_ms;
use crate::rules;
use crate::session::SessionMeta;
use crate::StoreError;

/// What an append does against one state of the session: the rules of the local writer,
/// through the same functions.
pub(super) struct Plan {
    pub(super) fresh: Vec<KeptEvent>,
    pub(super) meta: SessionMeta,
    pub(super) response: AppendResponse,
}

pub(super) fn plan(
    op: &AppendOp,
    events: &[KeptEvent],
    meta: &SessionMeta,
    known: &HashMap<String, u64>,
    now: i64,
) -> Result<Plan, StoreError> {
    let session_id = &op.session_id;
    rules::check_writer(
        meta,
        session_id,
        op.lease_epoch,
        events.iter().map(KeptEvent::event),
        now,
    )?;
    let numbered = rules::number(
        session_id,
        events.iter().cloned(),
        meta.last_seq,
        now,
        |id| Ok::<_, StoreError>(known.get(id).copied()),
    )?;
    rules::check_fresh(meta, session_id, op.expected_last_seq, &numbered.fresh)?;
    let mut meta = meta.clone();
    for event in &numbered.fresh {
        meta.apply_event(event);
    }
    Ok(Plan {
        fresh: numbered.fresh,
        response: AppendResponse {
            seqs: numbered.seqs,
            last_seq: meta.last_seq,
        },
        meta,
    })
}

impl Replica {
    pub(super) async fn append(&self, mut op: AppendOp) -> Result<AppendResponse, StoreError> {
        let mut events = std::mem::take(&mut op.events);
        for event in &mut events {
            if event.event_id.is_empty() {
                event.set_event_id(crate::ids::random_uuid().to_string());
            }
        }
        let mut state = self.cached(&op.session_id);
        let mut known = HashMap::new();
        let mut fresh_state = false;
        for _ in 0..MAX_ATTEMPTS {
            let now = now_unix_ms();
            let current = state.take().unwrap_or_else(|| Cached {
                version: 0,
                meta: Arc::default(),
            });
            match plan(&op, &events, &current.meta, &known, now) {
                Ok(plan) if plan.fresh.is_empty() && fresh_state => return Ok(plan.response),
                Ok(plan) if !plan.fresh.is_empty() => {
                    let written = self
                        .write_events(&op.session_id, current.version, &plan.meta, plan.fresh)
                        .await?;
                    if let Some(version) = written {
                        let meta = Arc::new(plan.meta);
                        self.remember(
                            &op.session_id,
                            &Cached {
                                version,
                                meta: meta.clone(),
                            },
                        );
                        self.changed(&op.session_id, &meta, now);
                        return Ok(plan.response);
                    }
                }
                Err(e) if fresh_state => return Err(e),
                Ok(_) | Err(_) => {}
            }
            let ids: Vec<&str> = events.iter().map(|e| e.event_id.as_str()).collect();
            let client = self.client().await?;
            let (refreshed, ids_known) = self.refresh(&client, &op.session_id, &ids).await?;
            state = Some(refreshed);
            known = ids_known;
            fresh_state = true;
        }
        Err(contended(&op.session_id))
    }

    /// Appends `fresh` (already numbered) with the session's new state, if the row is still
    /// at `version` and none of their ids exists: queued for the batch writer, which writes
    /// it together with the other appends waiting. The new version, or `None`.
    pub(super) async fn write_events(
        &self,
        session_id: &str,
        version: i64,
        meta: &SessionMeta,
        fresh: Vec<KeptEvent>,
    ) -> Result<Option<i64>, StoreError> {
        let (answer, written) = oneshot::channel();
        let write = batch::Write {
            session_id: session_id.to_string(),
            version,
            columns: Columns::of(meta),
            events: fresh,
            answer,
        };
        let stopped = || StoreError::Unavailable("the store is shutting down; retry".into());
        self.writes.send(write).map_err(|_| stopped())?;
        written.await.map_err(|_| stopped())?
    }
}
