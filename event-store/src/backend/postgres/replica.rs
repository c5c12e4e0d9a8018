//! One replica's state, shared by every call it serves: its connections, the sessions'
//! states it keeps at hand, its wake-ups, its health and its background tasks; and the
//! steps every optimistic write takes on them.
//!
//! Promises:
//! - A cached state is a hint, never the truth: a write names the row `version` its state
//!   was read at and lands only if that is still the row's; a write that finds it moved on
//!   re-reads the row ([`Replica::refresh`]) and decides again, up to [`MAX_ATTEMPTS`]
//!   times. A refusal is only ever decided against a state read fresh.
//! - The cache is bounded in bytes (`--session-cache`, [`StateCache`]): any state may
//!   go, the database holds every one.
//! - Every write that lands tells the followers and claimants on every replica
//!   ([`Replica::changed`]); the background tasks stop when the replica is dropped.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use super::batch;
use super::connection::{timed, Connector, Timed};
use super::health::Health;
use super::rows::{decode_meta, line_cte, Columns};
use super::wake::Board;
use crate::clock::now_unix_ms;
use crate::rules;
use crate::session::SessionMeta;
use crate::StoreError;

/// Attempts of an optimistic write before answering UNAVAILABLE (only reached when one
/// session is written by very many callers at once).
pub(super) const MAX_ATTEMPTS: usize = 64;

/// The states a replica keeps at hand, bounded in bytes: past its budget it gives back
/// states (the map's order decides which) down to three quarters of it. Any state may go:
/// the database holds every one, and an append whose state is not at hand reads it with
/// its row.
pub(super) struct StateCache {
    states: HashMap<String, Cached>,
    /// What `states` takes ([`SessionMeta::cached_bytes`]).
    bytes: usize,
    budget: usize,
}

impl StateCache {
    /// An empty cache of `budget` bytes.
    pub(super) fn new(budget: usize) -> StateCache {
        StateCache {
            states: HashMap::new(),
            bytes: 0,
            budget,
        }
    }

    fn shrink(&mut self) {
        self.bytes =
            crate::session::shrink_cache(&mut self.states, self.bytes, self.budget, |c| &c.meta);
    }
}

#[derive(Clone)]
pub(super) struct Cached {
    pub(super) version: i64,
    /// Shared: reading the cache copies no state, and an append copies it once, to fold
    /// its events into.
    pub(super) meta: Arc<SessionMeta>,
}

/// One replica: what the backend's calls share (see the module head).
pub(super) struct Replica {
    pub(super) connector: Arc<Connector>,
    pub(super) board: Arc<Board>,
    /// Wake-ups for the other replicas (absent in poll mode).
    pub(super) notify: Option<mpsc::UnboundedSender<(String, bool)>>,
    pub(super) cache: Mutex<StateCache>,
    /// Appends ready to write, for the batch writer ([`batch`]).
    pub(super) writes: mpsc::UnboundedSender<batch::Write>,
    pub(super) health: Arc<Health>,
    pub(super) poll_interval: Duration,
    /// Stops the background tasks when the backend is dropped.
    pub(super) tasks: CancellationToken,
    /// Whether appends write their searchable text (`PgConfig::search`).
    pub(super) search: bool,
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.tasks.cancel();
    }
}

impl Replica {
    pub(super) async fn client(&self) -> Result<deadpool_postgres::Object, StoreError> {
        match self.connector.pool.get().await {
            Ok(client) => Ok(client),
            Err(e) => {
                self.health.lost();
                Err(StoreError::Unavailable(format!(
                    "the database is unreachable ({e}); retry"
                )))
            }
        }
    }

    pub(super) fn timed_error(&self, e: Timed) -> StoreError {
        self.health.timed_error(e)
    }

    pub(super) fn cached(&self, session_id: &str) -> Option<Cached> {
        let cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        cache.states.get(session_id).cloned()
    }

    pub(super) fn remember(&self, session_id: &str, state: &Cached) {
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        let bytes = state.meta.cached_bytes(session_id);
        match cache.states.get_mut(session_id) {
            Some(cached) => {
                let before = cached.meta.cached_bytes(session_id);
                *cached = state.clone();
                cache.bytes = cache.bytes - before.min(cache.bytes) + bytes;
            }
            None => {
                cache.states.insert(session_id.to_string(), state.clone());
                cache.bytes += bytes;
            }
        }
        cache.shrink();
    }

    /// Tells followers and claimants here and on the other replicas that the session
    /// changed.
    pub(super) fn changed(&self, session_id: &str, meta: &SessionMeta, now: i64) {
        let claimable = rules::claimable(meta, now);
        self.board.wake(session_id, claimable);
        if let Some(notify) = &self.notify {
            let _ = notify.send((session_id.to_string(), claimable));
        }
    }

    /// The session's row as the database has it now (version 0: no row), and the seqs of
    /// those of `event_ids` it already holds (in its own rows or the prefix it shares with
    /// its base), in one round trip.
    pub(super) async fn refresh(
        &self,
        client: &deadpool_postgres::Object,
        session_id: &str,
        event_ids: &[&str],
    ) -> Result<(Cached, HashMap<String, u64>), StoreError> {
        let row = client
            .prepare_cached("SELECT version, meta FROM agentlog_sessions WHERE session_id = $1");
        let known = client.prepare_cached(concat!(
            line_cte!(),
            "SELECT e.event_id, e.seq FROM line l CROSS JOIN LATERAL (\
             SELECT event_id, seq FROM agentlog_events WHERE session_id = l.sid \
             AND event_id = ANY($2::text[]) AND seq <= l.hi) e"
        ));
        let (row, known) = timed("read_session", async { tokio::try_join!(row, known) })
            .await
            .map_err(|e| self.timed_error(e))?;
        let ids: Vec<&str> = event_ids.to_vec();
        let row_params: [&(dyn tokio_postgres::types::ToSql + Sync); 1] = [&session_id];
        let known_params: [&(dyn tokio_postgres::types::ToSql + Sync); 2] = [&session_id, &ids];
        let (row, known) = timed("read_session", async {
            tokio::try_join!(client.query_opt(&row, &row_params), async {
                if ids.is_empty() {
                    Ok(Vec::new())
                } else {
                    client.query(&known, &known_params).await
                }
            })
        })
        .await
        .map_err(|e| self.timed_error(e))?;
        let state = match row {
            None => Cached {
                version: 0,
                meta: Arc::default(),
            },
            Some(row) => Cached {
                version: row.get(0),
                meta: Arc::new(decode_meta(row.get(1))?),
            },
        };
        if state.version > 0 {
            self.remember(session_id, &state);
        }
        let known = known
            .iter()
            .map(|r| (r.get::<_, String>(0), r.get::<_, i64>(1) as u64))
            .collect();
        Ok((state, known))
    }
}

impl Replica {
    /// Runs a rule (a lease's, a pin's) against the session's state and writes the outcome, re-reading
    /// and re-running while the state it used was stale. `rule` returns the new state to
    /// write (or `None`: nothing to write) and the answer.
    pub(super) async fn change_session<T>(
        &self,
        session_id: &str,
        rule: impl Fn(&SessionMeta, i64) -> Result<(Option<SessionMeta>, T), StoreError>,
    ) -> Result<T, StoreError> {
        let client = self.client().await?;
        let mut state = self.cached(session_id);
        let mut fresh = false;
        for _ in 0..MAX_ATTEMPTS {
            let current = state.take();
            if let Err(e) = rules::existing(current.as_ref().map(|s| &*s.meta), session_id) {
                if fresh {
                    return Err(e);
                }
                state = Some(self.refresh(&client, session_id, &[]).await?.0);
                fresh = true;
                continue;
            }
            let current = current.expect("checked above");
            let now = now_unix_ms();
            match rule(&current.meta, now) {
                Ok((Some(meta), answer)) => {
                    if let Some(version) = self
                        .write_meta(&client, session_id, current.version, &meta)
                        .await?
                    {
                        let meta = Arc::new(meta);
                        self.remember(
                            session_id,
                            &Cached {
                                version,
                                meta: meta.clone(),
                            },
                        );
                        self.changed(session_id, &meta, now);
                        return Ok(answer);
                    }
                }
                Ok((None, answer)) if fresh => return Ok(answer),
                Err(e) if fresh => return Err(e),
                Ok(_) | Err(_) => {}
            }
            state = Some(self.refresh(&client, session_id, &[]).await?.0);
            fresh = true;
        }
        Err(contended(session_id))
    }

    /// Writes `meta` over the session's row if it is still at `version`; the new version,
    /// or `None` if someone wrote in between.
    async fn write_meta(
        &self,
        client: &deadpool_postgres::Object,
        session_id: &str,
        version: i64,
        meta: &SessionMeta,
    ) -> Result<Option<i64>, StoreError> {
        let columns = Columns::of(meta);
        let result = timed("write_session", async {
            let stmt = client
                .prepare_cached(
                    "UPDATE agentlog_sessions SET version = version + 1, meta = $3, \
                     last_seq = $4, updated_unix_ms = $5, status = $6, \
                     lease_expires_unix_ms = $7, pinned = $9, \
                     first_user_text = CASE first_user_text WHEN '' THEN $8 \
                     ELSE first_user_text END \
                     WHERE session_id = $1 AND version = $2 RETURNING version",
                )
                .await?;
            client
                .query_opt(
                    &stmt,
                    &[
                        &session_id,
                        &version,
                        &columns.meta,
                        &columns.last_seq,
                        &columns.updated,
                        &columns.status,
                        &columns.lease_expires,
                        &columns.first_user_text,
                        &columns.pinned,
                    ],
                )
                .await
        })
        .await;
        match result {
            Ok(row) => Ok(row.map(|r| r.get(0))),
            Err(e) => Err(self.timed_error(e)),
        }
    }
}

pub(super) fn contended(session_id: &str) -> StoreError {
    StoreError::Unavailable(format!(
        "session {session_id} is being written by many callers at once; retry"
    ))
}
