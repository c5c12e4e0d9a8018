//! AppendStream's appends pipelined, per session, in order: an append is planned on top of
//! the ones queued before it on this replica and handed back as an answer to come, so that
//! a stream's next request is read while the previous ones commit.
//!
//! Each session with appends queued has a lane: the state its queued appends lead to (the
//! tip), planned with the same rules as a unary append ([`super::append`]), and a driver task that writes
//! them. The driver sends every append planned so far as one write (one row update, all
//! their events) through the batch writer, extending the row version the last write
//! committed; appends queued meanwhile gather for the next. So a session has one write in
//! flight at a time, each as large as the appends that arrived during the one before, and
//! the lane keeps them in the order they were queued.
//!
//! What cannot be planned on the tip is decided against a fresh read, in its place in the
//! order (by [`Replica::append`], after everything queued before it): the first append of
//! a session this replica has not cached, a refusal (confirmed against the database, never
//! against the cache), an event id the lane already holds, and every append behind a write
//! that did not land. A write that found the row moved on (another replica, or a unary
//! Append, wrote the session) lands nothing; it and every append planned after it are
//! decided again, in order. A write that failed (the database unreachable, a statement
//! past its deadline) answers its appends with that error, their commit in doubt as for a
//! unary Append: a retry with the same event ids settles it.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use agentlog_proto::kept::KeptEvent;
use agentlog_proto::v1::AppendResponse;
use tokio::sync::oneshot;

use super::append::plan;
use super::replica::{Cached, Replica};
use crate::backend::{AppendAnswer, AppendOp};
use crate::clock::now_unix_ms;
use crate::session::SessionMeta;
use crate::StoreError;

/// Every session's lane on this replica (a lane exists while its session has appends
/// queued).
#[derive(Default)]
pub(super) struct Lanes(Mutex<HashMap<String, Lane>>);

type Answer = oneshot::Sender<Result<AppendResponse, StoreError>>;

struct Lane {
    /// The row version the next write extends (`None`: not known, read it first).
    version: Option<i64>,
    /// The session's state after every planned append.
    tip: Arc<SessionMeta>,
    /// The event ids of the planned appends, with their seqs.
    ids: HashMap<String, u64>,
    /// Appends planned on the tip and not yet sent, in order.
    planned: Vec<Planned>,
    /// Appends to decide against a fresh read, in order; all queued after `planned`.
    unplanned: VecDeque<(AppendOp, Answer)>,
    /// One is being decided: what comes meanwhile waits to be planned on its outcome.
    deciding: bool,
}

struct Planned {
    /// The append as it came (its events are taken out for the write).
    op: AppendOp,
    /// Its events, numbered.
    fresh: Vec<KeptEvent>,
    response: AppendResponse,
    answer: Answer,
}

impl Lane {
    fn new(cached: Option<Cached>) -> Lane {
        let mut lane = Lane {
            version: None,
            tip: Arc::default(),
            ids: HashMap::new(),
            planned: Vec::new(),
            unplanned: VecDeque::new(),
            deciding: false,
        };
        lane.start_from(cached);
        lane
    }

    /// Plans from `cached` (the session's row as this replica last saw it) on.
    fn start_from(&mut self, cached: Option<Cached>) {
        debug_assert!(self.planned.is_empty());
        self.ids.clear();
        match cached {
            Some(cached) => {
                self.version = Some(cached.version);
                self.tip = cached.meta;
            }
            None => {
                self.version = None;
                self.tip = Arc::default();
            }
        }
    }

    /// Queues `op`: planned on the tip if it can be, else to be decided in its turn.
    fn queue(&mut self, op: AppendOp, answer: Answer) {
        if self.version.is_none() || self.deciding || !self.unplanned.is_empty() {
            self.unplanned.push_back((op, answer));
            return;
        }
        match plan(&op, &op.events, &self.tip, &self.ids, now_unix_ms()) {
            Ok(planned) if !planned.fresh.is_empty() && planned.fresh.len() == op.events.len() => {
                for event in &planned.fresh {
                    self.ids.insert(event.event_id.clone(), event.seq);
                }
                self.tip = Arc::new(planned.meta);
                self.planned.push(Planned {
                    op,
                    fresh: planned.fresh,
                    response: planned.response,
                    answer,
                });
            }
            _ => self.unplanned.push_back((op, answer)),
        }
    }

    /// The appends planned after a write that did not land go back to be decided, first.
    fn replan(&mut self, behind: Vec<AppendOp>, answers: Vec<Answer>) {
        let planned = std::mem::take(&mut self.planned);
        let again = behind
            .into_iter()
            .zip(answers)
            .chain(planned.into_iter().map(|p| (p.op, p.answer)));
        let mut unplanned: VecDeque<_> = again.collect();
        unplanned.append(&mut self.unplanned);
        self.unplanned = unplanned;
        self.start_from(None);
    }
}

enum Job {
    Write {
        version: i64,
        meta: Arc<SessionMeta>,
        appends: Vec<Planned>,
    },
    Decide(AppendOp, Answer),
}

impl Lanes {
    /// Queues an AppendStream append behind the session's others on `replica`; see the
    /// module head.
    pub(super) fn enqueue(
        self: &Arc<Self>,
        replica: &Arc<Replica>,
        mut op: AppendOp,
    ) -> AppendAnswer {
        for event in &mut op.events {
            if event.event_id.is_empty() {
                event.set_event_id(crate::ids::random_uuid().to_string());
            }
        }
        let (answer, answered) = oneshot::channel();
        let session_id = op.session_id.clone();
        let start_driver = {
            let mut lanes = self.0.lock().unwrap_or_else(|p| p.into_inner());
            match lanes.get_mut(&session_id) {
                Some(lane) => {
                    lane.queue(op, answer);
                    false
                }
                None => {
                    let mut lane = Lane::new(replica.cached(&session_id));
                    lane.queue(op, answer);
                    lanes.insert(session_id.clone(), lane);
                    true
                }
            }
        };
        if start_driver {
            tokio::spawn(self.clone().drive(replica.clone(), session_id));
        }
        Box::pin(async move {
            answered.await.unwrap_or_else(|_| {
                Err(StoreError::Unavailable(
                    "the store is shutting down; retry".into(),
                ))
            })
        })
    }

    /// Writes the session's queued appends until none is left, then ends (and the lane
    /// with it).
    async fn drive(self: Arc<Self>, replica: Arc<Replica>, session_id: String) {
        loop {
            let job = {
                let mut lanes = self.0.lock().unwrap_or_else(|p| p.into_inner());
                let Some(lane) = lanes.get_mut(&session_id) else {
                    return;
                };
                match (lane.version, lane.planned.is_empty()) {
                    (Some(version), false) => Job::Write {
                        version,
                        meta: lane.tip.clone(),
                        appends: std::mem::take(&mut lane.planned),
                    },
                    _ => match lane.unplanned.pop_front() {
                        Some((op, answer)) => {
                            lane.deciding = true;
                            Job::Decide(op, answer)
                        }
                        None => {
                            lanes.remove(&session_id);
                            return;
                        }
                    },
                }
            };
            match job {
                Job::Write {
                    version,
                    meta,
                    mut appends,
                } => {
                    let events: Vec<KeptEvent> = appends
                        .iter_mut()
                        .flat_map(|a| std::mem::take(&mut a.fresh))
                        .collect();
                    let now = now_unix_ms();
                    let written = replica
                        .write_events(&session_id, version, &meta, events)
                        .await;
                    if let Ok(Some(version)) = written {
                        replica.remember(
                            &session_id,
                            &Cached {
                                version,
                                meta: meta.clone(),
                            },
                        );
                        replica.changed(&session_id, &meta, now);
                    }
                    let mut lanes = self.0.lock().unwrap_or_else(|p| p.into_inner());
                    let Some(lane) = lanes.get_mut(&session_id) else {
                        return;
                    };
                    match written {
                        Ok(Some(version)) => {
                            lane.version = Some(version);
                            for append in &appends {
                                for event in &append.op.events {
                                    lane.ids.remove(&event.event_id);
                                }
                            }
                            drop(lanes);
                            for append in appends {
                                let _ = append.answer.send(Ok(append.response));
                            }
                        }
                        Ok(None) => {
                            let (ops, answers) =
                                appends.into_iter().map(|a| (a.op, a.answer)).unzip();
                            lane.replan(ops, answers);
                        }
                        Err(e) => {
                            lane.replan(Vec::new(), Vec::new());
                            drop(lanes);
                            for append in appends {
                                let _ = append.answer.send(Err(e.clone()));
                            }
                        }
                    }
                }
                Job::Decide(op, answer) => {
                    let _ = answer.send(replica.append(op).await);
                    // The append read the session's row (or found it as cached): plan what
                    // waits on it, from there.
                    let cached = replica.cached(&session_id);
                    let mut lanes = self.0.lock().unwrap_or_else(|p| p.into_inner());
                    let Some(lane) = lanes.get_mut(&session_id) else {
                        return;
                    };
                    lane.deciding = false;
                    lane.start_from(cached);
                    for (op, answer) in std::mem::take(&mut lane.unplanned) {
                        lane.queue(op, answer);
                    }
                }
            }
        }
    }
}
