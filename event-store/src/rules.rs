//! The rules of appends, leases and a session's end, as pure functions of a session's state
//! ([`SessionMeta`]) and the time: who may write, which epoch a grant gets, which events of
//! an append are new and what seqs they get, when `expected_last_seq` or an approval
//! decision refuses an append, what a deletion leaves and which sessions retention takes.
//! Both backends (`backend::local::writer` for the local log, `backend::postgres`) decide
//! through these functions and only add how they make the outcome durable, so they cannot
//! drift apart; every refusal carries its [`Reason`].
//!
//! A deleted session refuses everything for good ([`Reason::SessionDeleted`]): its
//! tombstone is checked before any other rule, so no retried append (whatever its event
//! ids) and no holder of an old epoch can write it again.

use std::collections::HashMap;

use agentlog_proto::kept::KeptEvent;
use agentlog_proto::reason::Reason;
use agentlog_proto::v1::{event, Event, SessionInfo};

use crate::error::StoreError;
use crate::session::{is_runner_kind, kind_name, SessionMeta, SCHEMA_VERSION};
use crate::session::{ForkRecord, LeaseRecord};
use agentlog_proto::settled::SettledPoints;

/// The session, if any event was ever appended to it (leases exist only on such sessions)
/// and it was not deleted.
pub fn existing<'a>(
    meta: Option<&'a SessionMeta>,
    session_id: &str,
) -> Result<&'a SessionMeta, StoreError> {
    match meta {
        Some(m) if m.is_deleted() => Err(session_deleted(session_id)),
        Some(m) if m.last_seq > 0 => Ok(m),
        _ => Err(session_not_found(session_id)),
    }
}

/// The refusal for a session that was deleted: for good, whatever the call.
pub fn session_deleted(session_id: &str) -> StoreError {
    StoreError::Refused(
        Reason::SessionDeleted,
        format!("session {session_id} was deleted; it can be neither read nor written again"),
    )
}

/// Refuses a deleted session (one that never existed passes: an append creates it).
pub fn not_deleted(meta: &SessionMeta, session_id: &str) -> Result<(), StoreError> {
    if meta.is_deleted() {
        return Err(session_deleted(session_id));
    }
    Ok(())
}

/// What DeleteSession does to a session.
#[derive(Debug, Clone, PartialEq)]
pub enum Deletion {
    /// Replace the session by this tombstone: its events, title, snapshots and lease go.
    Tombstone(Box<SessionMeta>),
    /// It was deleted before: nothing changes, and the call succeeds.
    AlreadyDeleted,
}

/// DeleteSession at `now`: a session that never existed is `NOT_FOUND`
/// ([`Reason::SessionNotFound`]); a live lease does not stop a deletion (its holder is
/// refused from then on, like everyone).
pub fn delete(
    meta: Option<&SessionMeta>,
    session_id: &str,
    now: i64,
) -> Result<Deletion, StoreError> {
    match meta {
        Some(m) if m.is_deleted() => Ok(Deletion::AlreadyDeleted),
        Some(m) if m.last_seq > 0 => Ok(Deletion::Tombstone(Box::new(SessionMeta::tombstone(now)))),
        _ => Err(session_not_found(session_id)),
    }
}

/// Whether retention (`--retain-idle`) deletes the session at `now`: its last event is
/// older than `idle_before` (a time, `now` minus the idle span), it holds no live lease,
/// and it is not pinned.
pub fn expired(meta: &SessionMeta, idle_before: i64, now: i64) -> bool {
    !meta.is_deleted()
        && !meta.pinned
        && meta.last_seq > 0
        && meta.updated_unix_ms < idle_before
        && meta.live_lease(now).is_none()
}

/// `PinSession`: the session's state with `pinned` set as asked, or `None` when it is so
/// already (nothing to write). Only an existing, live session is pinned.
pub fn pin(
    meta: Option<&SessionMeta>,
    session_id: &str,
    pinned: bool,
) -> Result<Option<SessionMeta>, StoreError> {
    let meta = existing(meta, session_id)?;
    if meta.pinned == pinned {
        return Ok(None);
    }
    let mut changed = meta.clone();
    changed.pinned = pinned;
    Ok(Some(changed))
}

/// What an imported `deleted` line leaves: the tombstone of the id, deleted at the time the
/// line gives (the id may never have existed here: it is dead here from now on too), or
/// nothing when it is deleted here already.
pub fn delete_imported(meta: Option<&SessionMeta>, deleted_unix_ms: i64) -> Deletion {
    match meta {
        Some(m) if m.is_deleted() => Deletion::AlreadyDeleted,
        _ => Deletion::Tombstone(Box::new(SessionMeta::tombstone(deleted_unix_ms))),
    }
}

/// An imported session's state, made visible once its events are all staged: the state
/// folded from them (`staged`, by the rules every append follows, so the session goes on
/// as if it had always lived here), with the times, `forked_from` and `pinned` of its
/// session line (`line`), no lease. Refused (`INVALID_ARGUMENT`, for the caller to name the
/// line) when the line says otherwise than its events: its last seq, status or title.
pub fn adopt_imported(staged: &SessionMeta, line: &SessionInfo) -> Result<SessionMeta, StoreError> {
    let differs = |field: &str, said: &dyn std::fmt::Debug, found: &dyn std::fmt::Debug| {
        StoreError::InvalidArgument(format!(
            "the session line of {} says {field} {said:?}, but its events make it {found:?}",
            line.session_id
        ))
    };
    if staged.last_seq != line.last_seq {
        return Err(differs("lastSeq", &line.last_seq, &staged.last_seq));
    }
    if staged.status != line.status {
        return Err(differs("status", &line.status(), &staged.status()));
    }
    if staged.title() != line.title {
        return Err(differs("title", &line.title, &staged.title()));
    }
    // An export of release 0.1.0 does not say it.
    if line.not_before_unix_ms != 0 && staged.not_before_unix_ms != line.not_before_unix_ms {
        return Err(differs(
            "notBeforeUnixMs",
            &line.not_before_unix_ms,
            &staged.not_before_unix_ms,
        ));
    }
    let mut adopted = staged.clone();
    adopted.created_unix_ms = line.created_unix_ms;
    adopted.updated_unix_ms = line.updated_unix_ms;
    adopted.forked_from = line.forked_from.clone();
    adopted.pinned = line.pinned;
    adopted.lease = None;
    Ok(adopted)
}

/// The refusal for an import whose session was made here (or deleted here) while it was
/// staged: nothing of the import is kept.
pub fn imported_taken(session_id: &str, deleted: bool) -> StoreError {
    if deleted {
        return session_deleted(session_id);
    }
    imported_differs(
        session_id,
        "it was made here while the import was under way; import it again to compare",
    )
}

/// The refusal for an imported session that is here already with another log.
pub fn imported_differs(session_id: &str, detail: &str) -> StoreError {
    StoreError::Refused(
        Reason::SessionExists,
        format!(
            "session {session_id} already exists here with another log ({detail}); nothing of \
             it was changed"
        ),
    )
}

/// The refusal for a session no event was ever appended to.
pub fn session_not_found(session_id: &str) -> StoreError {
    StoreError::Refused(
        Reason::SessionNotFound,
        format!("session {session_id} does not exist (no event was ever appended to it)"),
    )
}

/// Whether a claim may take the session now: it has work, no live lease (a tombstone has
/// neither), and no `model_retry` due later (a durable timer, held on every replica and
/// across restarts because it is the session's state).
pub fn claimable(meta: &SessionMeta, now: i64) -> bool {
    !meta.is_deleted()
        && meta.is_runnable()
        && meta.live_lease(now).is_none()
        && meta.not_before_unix_ms <= now
}

/// A new lease for `owner`, one epoch above every lease the session ever had.
pub fn grant(
    meta: &SessionMeta,
    session_id: &str,
    owner: String,
    ttl_ms: u64,
    now: i64,
) -> LeaseRecord {
    LeaseRecord {
        session_id: session_id.to_string(),
        owner,
        epoch: meta.next_epoch(),
        expires_unix_ms: now.saturating_add(ttl_ms as i64),
        released: false,
    }
}

/// AcquireLease: a new grant, unless someone else's lease is live (the holder itself may
/// acquire again: it gets a new epoch).
pub fn acquire(
    meta: &SessionMeta,
    session_id: &str,
    owner: String,
    ttl_ms: u64,
    now: i64,
) -> Result<LeaseRecord, StoreError> {
    if let Some(live) = meta.live_lease(now) {
        if live.owner != owner {
            return Err(StoreError::Refused(
                Reason::LeaseHeld,
                format!(
                    "session {session_id} is leased by {} (epoch {}) until {} ms",
                    live.owner, live.epoch, live.expires_unix_ms
                ),
            ));
        }
    }
    Ok(grant(meta, session_id, owner, ttl_ms, now))
}

/// RenewLease: `owner`'s lease of `epoch`, expiring `ttl_ms` from now, if it is still the
/// session's newest lease and not released. (An expired lease nobody took since may be
/// renewed: no one else has written under a newer epoch.)
pub fn renew(
    meta: &SessionMeta,
    session_id: &str,
    owner: &str,
    epoch: u64,
    ttl_ms: u64,
    now: i64,
) -> Result<LeaseRecord, StoreError> {
    let current = current_lease(meta, session_id, owner, epoch)?;
    if current.released {
        return Err(StoreError::Refused(
            Reason::LeaseFenced,
            format!("the lease of epoch {epoch} on session {session_id} was released"),
        ));
    }
    let mut record = current.clone();
    record.expires_unix_ms = now.saturating_add(ttl_ms as i64);
    Ok(record)
}

/// ReleaseLease: the released record to write, or `None` if it was released already
/// (releasing twice is not an error).
pub fn release(
    meta: &SessionMeta,
    session_id: &str,
    owner: &str,
    epoch: u64,
    now: i64,
) -> Result<Option<LeaseRecord>, StoreError> {
    let current = current_lease(meta, session_id, owner, epoch)?;
    if current.released {
        return Ok(None);
    }
    let mut record = current.clone();
    record.released = true;
    record.expires_unix_ms = now;
    Ok(Some(record))
}

/// The session's newest lease, if it is `epoch` and held by `owner`.
fn current_lease<'a>(
    meta: &'a SessionMeta,
    session_id: &str,
    owner: &str,
    epoch: u64,
) -> Result<&'a LeaseRecord, StoreError> {
    match &meta.lease {
        Some(l) if l.epoch == epoch && l.owner == owner => Ok(l),
        Some(l) if l.epoch == epoch => Err(StoreError::Refused(
            Reason::LeaseHeld,
            format!(
                "the lease of epoch {epoch} on session {session_id} belongs to {}, not {owner}",
                l.owner
            ),
        )),
        Some(l) => Err(StoreError::Refused(
            Reason::LeaseFenced,
            format!(
                "epoch {epoch} is not the current lease of session {session_id} (current epoch \
                 is {}): this holder has been fenced off",
                l.epoch
            ),
        )),
        None => Err(StoreError::Refused(
            Reason::LeaseFenced,
            format!("session {session_id} has no lease"),
        )),
    }
}

/// Who may append `events`: nobody to a deleted session; with a `lease_epoch`, only under
/// the session's current, unexpired lease; without one, only the kinds a person writes. A
/// user message named as a replay's recorded turn (`replay:user:<seq>`, the one user turn
/// a runner appends) must name a seq of the session's recording.
pub fn check_writer<'a>(
    meta: &SessionMeta,
    session_id: &str,
    lease_epoch: Option<u64>,
    events: impl IntoIterator<Item = &'a Event>,
    now: i64,
) -> Result<(), StoreError> {
    not_deleted(meta, session_id)?;
    let events: Vec<&Event> = events.into_iter().collect();
    check_replayed_turns(meta, session_id, &events)?;
    let Some(epoch) = lease_epoch else {
        let runner_kind = events
            .iter()
            .filter_map(|e| e.kind.as_ref())
            .find(|k| is_runner_kind(k));
        return match runner_kind {
            Some(kind) => Err(StoreError::Refused(
                Reason::LeaseRequired,
                format!(
                    "lease_epoch: required to append {} (a runner-written kind); acquire a \
                     lease on session {session_id} and pass its epoch",
                    kind_name(kind),
                ),
            )),
            None => Ok(()),
        };
    };
    match meta.live_lease(now) {
        Some(l) if l.epoch == epoch => Ok(()),
        Some(l) => Err(StoreError::Refused(
            Reason::LeaseFenced,
            format!(
                "lease_epoch {epoch} is not the current lease of session {session_id} (epoch {} \
                 held by {}): this writer has been fenced off",
                l.epoch, l.owner
            ),
        )),
        None => Err(StoreError::Refused(
            Reason::LeaseFenced,
            format!(
                "lease_epoch {epoch}: session {session_id} has no live lease (it expired or \
                 was released); acquire a new one"
            ),
        )),
    }
}

/// A user message named as a replay's recorded turn names a seq of the session's
/// recording (its latest `session_config`'s replay, or a config in the same append).
fn check_replayed_turns(
    meta: &SessionMeta,
    session_id: &str,
    events: &[&Event],
) -> Result<(), StoreError> {
    let mut replay = meta.replay.clone();
    for event in events {
        match &event.kind {
            Some(event::Kind::SessionConfig(c)) if !c.model.is_empty() => {
                replay = c.replay.as_ref().map(|r| crate::session::ReplayRange {
                    session_id: r.session_id.clone(),
                    after_seq: r.after_seq,
                    through_seq: r.through_seq,
                })
            }
            Some(event::Kind::UserMessage(_)) => {
                let Some(seq) = agentlog_proto::replay::user_seq_of(&event.event_id) else {
                    continue;
                };
                let recorded = match &replay {
                    Some(r) => r.after_seq < seq && seq <= r.through_seq,
                    // A session release 0.1.0 began: its replay, if any, is not known here.
                    None => !meta.tracks_replay,
                };
                if !recorded {
                    return Err(StoreError::InvalidArgument(format!(
                        "event_id {:?}: session {session_id} replays no recording whose seq \
                         {seq} it could be; a replay's recorded turn is the only user message \
                         a runner appends",
                        event.event_id
                    )));
                }
            }
            _ => {}
        }
    }
    Ok(())
}

/// Who may keep a snapshot of the session at `seq`: the holder of its live lease of
/// `lease_epoch` (as for a runner-written append), and only at a seq the log holds.
pub fn check_snapshot(
    meta: &SessionMeta,
    session_id: &str,
    lease_epoch: u64,
    seq: u64,
    now: i64,
) -> Result<(), StoreError> {
    check_writer(meta, session_id, Some(lease_epoch), std::iter::empty(), now)?;
    if seq == 0 || seq > meta.last_seq {
        return Err(StoreError::InvalidArgument(format!(
            "seq: {seq} is outside session {session_id}'s log (seqs 1 to {}); a snapshot is \
             taken at a seq the log holds",
            meta.last_seq
        )));
    }
    Ok(())
}

/// The events of an append with dedup applied: `seqs` answers the caller (one per event,
/// the original seq for one the session already holds), `fresh` is what to write.
#[derive(Debug, Default, PartialEq)]
pub struct Numbered {
    pub seqs: Vec<u64>,
    pub fresh: Vec<KeptEvent>,
}

/// Dedup, then seqs from `last_seq + 1` for what is new: an event whose id `known` finds
/// (or that repeats an id earlier in this append) is answered with that seq and not
/// written. New events get the session id, `now` and the schema version. An event without
/// an id is always new (the backend names it).
pub fn number<E>(
    session_id: &str,
    events: impl IntoIterator<Item = KeptEvent>,
    last_seq: u64,
    now: i64,
    mut known: impl FnMut(&str) -> Result<Option<u64>, E>,
) -> Result<Numbered, E> {
    let events = events.into_iter();
    let count = events.size_hint().0;
    let mut numbered = Numbered {
        seqs: Vec::with_capacity(count),
        fresh: Vec::with_capacity(count),
    };
    // The ids of this append's new events (a single event cannot repeat one).
    let mut in_append: HashMap<String, u64> = HashMap::new();
    let mut next = last_seq + 1;
    for mut event in events {
        if !event.event_id.is_empty() {
            let seq = match in_append.get(&event.event_id) {
                Some(seq) => Some(*seq),
                None => known(&event.event_id)?,
            };
            if let Some(seq) = seq {
                numbered.seqs.push(seq);
                continue;
            }
            if count > 1 {
                in_append.insert(event.event_id.clone(), next);
            }
        }
        event.place(session_id, next, now, SCHEMA_VERSION);
        numbered.seqs.push(next);
        numbered.fresh.push(event);
        next += 1;
    }
    Ok(numbered)
}

/// What must hold for the new events of an append (`fresh`, none if all were duplicates):
/// `expected_last_seq`, if given, is the session's last seq; every approval decision
/// answers a pending request, once.
pub fn check_fresh(
    meta: &SessionMeta,
    session_id: &str,
    expected_last_seq: Option<u64>,
    fresh: &[KeptEvent],
) -> Result<(), StoreError> {
    if fresh.is_empty() {
        return Ok(());
    }
    if let Some(expected) = expected_last_seq {
        if expected != meta.last_seq {
            return Err(StoreError::Refused(
                Reason::SeqConflict,
                format!(
                    "expected_last_seq is {expected} but session {session_id} is at seq {}",
                    meta.last_seq
                ),
            ));
        }
    }
    check_approval_decisions(
        session_id,
        &meta.pending_approvals,
        fresh.iter().map(KeptEvent::event),
    )
}

/// Checks the approval decisions among `events` against the approvals pending before them
/// (requests and results earlier in the same append count too).
fn check_approval_decisions<'a>(
    session_id: &str,
    pending: &[String],
    events: impl IntoIterator<Item = &'a Event>,
) -> Result<(), StoreError> {
    let mut pending: Vec<&str> = pending.iter().map(String::as_str).collect();
    for event in events {
        match &event.kind {
            Some(event::Kind::ApprovalRequested(r)) => pending.push(&r.tool_use_id),
            Some(event::Kind::ToolResult(r)) => pending.retain(|id| *id != r.tool_use_id),
            Some(event::Kind::ApprovalDecision(d)) => {
                let Some(at) = pending.iter().position(|id| *id == d.tool_use_id) else {
                    return Err(StoreError::Refused(
                        Reason::ApprovalNotPending,
                        format!(
                            "approval_decision for tool_use_id {:?}: session {session_id} has \
                             no pending approval request for that call (never requested, \
                             already decided, or already answered)",
                            d.tool_use_id
                        ),
                    ));
                };
                pending.remove(at);
            }
            _ => {}
        }
    }
    Ok(())
}

/// Whether `at_seq` of a parent's log is a settled point ([`SettledPoints`]), decided from
/// the log read from seq 1: feed events in order until [`ForkPoint::apply`] says the answer
/// is known (at `at_seq` if it is settled, else at the next settled seq), or the log ends;
/// then ask [`ForkPoint::verdict`].
#[derive(Debug, Clone)]
pub struct ForkPoint {
    at_seq: u64,
    points: SettledPoints,
    before: Option<u64>,
    settled: bool,
    after: Option<u64>,
}

impl ForkPoint {
    pub fn new(at_seq: u64) -> ForkPoint {
        ForkPoint {
            at_seq,
            points: SettledPoints::default(),
            before: None,
            settled: false,
            after: None,
        }
    }

    /// Takes the parent's next event; true once no more are needed.
    pub fn apply(&mut self, event: &Event) -> bool {
        let settled = self.points.apply(event);
        match event.seq.cmp(&self.at_seq) {
            std::cmp::Ordering::Less => {
                if settled {
                    self.before = Some(event.seq);
                }
                false
            }
            std::cmp::Ordering::Equal => {
                self.settled = settled;
                settled
            }
            std::cmp::Ordering::Greater => {
                if settled {
                    self.after = Some(event.seq);
                }
                settled
            }
        }
    }

    /// Whether the fork may be made at `at_seq` of `parent`, whose last seq is `last_seq`:
    /// `FAILED_PRECONDITION` naming the nearest settled seqs if it is not a settled point.
    pub fn verdict(&self, parent: &str, last_seq: u64) -> Result<(), StoreError> {
        let at = self.at_seq;
        if at == 0 || at > last_seq {
            return Err(StoreError::InvalidArgument(format!(
                "at_seq: {at} is outside session {parent}'s log (seqs 1 to {last_seq}); name \
                 the last seq the fork takes"
            )));
        }
        if self.settled {
            return Ok(());
        }
        let nearest = match (self.before, self.after) {
            (Some(b), Some(a)) => format!("the nearest settled seqs are {b} and {a}"),
            (Some(b), None) => format!("the nearest settled seq is {b}"),
            (None, Some(a)) => format!("the nearest settled seq is {a}"),
            (None, None) => "the log has no settled point yet".to_string(),
        };
        Err(StoreError::Refused(
            Reason::ForkPointUnsettled,
            format!(
                "seq {at} of session {parent} is not a settled point: a fork is made after a \
                 user message, a final assistant message, an interrupted, or the tool result \
                 that answers the last open call, so that no call is left without its \
                 result; {nearest}"
            ),
        ))
    }
}

/// A fork as both backends write it: its first record, the parent's prefix (each backend
/// copies it in its own form, with the fork's session id), then the request's new events,
/// numbered; and the state they make.
#[derive(Debug)]
pub struct ForkPlan {
    pub record: ForkRecord,
    /// The request's events that are new, numbered after the prefix.
    pub fresh: Vec<KeptEvent>,
    /// The fork's state at the fork point (the prefix folded, before `fresh`).
    pub at_fork: SessionMeta,
    pub meta: SessionMeta,
    /// One per event of the request: its seq (the prefix's, for an id the prefix holds).
    pub seqs: Vec<u64>,
}

/// The state of a fork taking its parent's prefix in, event by event (in seq order): what
/// [`plan_fork`] starts from. A backend feeds it the prefix in whatever form it reads it,
/// with what the state needs of each event (its seq, id, time and kind; a user message's
/// text only while [`ForkPrefix::wants_text`]).
#[derive(Debug)]
pub struct ForkPrefix {
    record: ForkRecord,
    meta: SessionMeta,
    /// The request's event ids, to be answered with the prefix's seq if it holds them.
    wanted: HashMap<String, Option<u64>>,
}

impl ForkPrefix {
    /// The fork `new_id` of `parent` at `at_seq`, made at `now`; `extra`: the request's
    /// events.
    pub fn new(
        new_id: &str,
        parent: &str,
        at_seq: u64,
        extra: &[KeptEvent],
        now: i64,
    ) -> ForkPrefix {
        let record = ForkRecord {
            session_id: new_id.to_string(),
            parent: parent.to_string(),
            seq: at_seq,
            ts_unix_ms: now,
            state: None,
        };
        let mut meta = SessionMeta::default();
        meta.apply_fork(&record);
        let wanted = extra
            .iter()
            .filter(|e| !e.event_id.is_empty())
            .map(|e| (e.event_id.clone(), None))
            .collect();
        ForkPrefix {
            record,
            meta,
            wanted,
        }
    }

    /// Takes in the parent's next event of the prefix.
    pub fn apply(&mut self, event: &Event) {
        self.meta.apply_event(event);
        if self.wanted.is_empty() {
            return;
        }
        if let Some(seq) = self.wanted.get_mut(&event.event_id) {
            *seq = Some(event.seq);
        }
    }

    /// Whether the next user message's text matters (the title is not known yet).
    pub fn wants_text(&self) -> bool {
        self.meta.first_user_text.is_empty()
    }
}

/// The fork planned from its `prefix` (taken in whole, checked settled) and `extra` (the
/// request's events: a person's kinds only, as an append without a lease; an id the prefix
/// holds is answered with its seq and not written again). The copied events keep their ids,
/// times and contents; only their session id changes.
pub fn plan_fork(
    prefix: ForkPrefix,
    extra: Vec<KeptEvent>,
    now: i64,
) -> Result<ForkPlan, StoreError> {
    let ForkPrefix {
        record,
        mut meta,
        wanted,
    } = prefix;
    let new_id = record.session_id.clone();
    check_writer(
        &SessionMeta::default(),
        &new_id,
        None,
        extra.iter().map(KeptEvent::event),
        now,
    )?;
    let numbered = number(&new_id, extra, record.seq, now, |id| {
        Ok::<_, StoreError>(wanted.get(id).copied().flatten())
    })?;
    check_fresh(&meta, &new_id, None, &numbered.fresh)?;
    let at_fork = meta.clone();
    for event in &numbered.fresh {
        meta.apply_event(event);
    }
    Ok(ForkPlan {
        record,
        fresh: numbered.fresh,
        at_fork,
        meta,
        seqs: numbered.seqs,
    })
}

/// Whether a fork may take the id `session_id`: not one of a session that exists, nor one
/// of a session that was deleted (its id is dead for good).
pub fn fork_target(meta: Option<&SessionMeta>, session_id: &str) -> Result<(), StoreError> {
    match meta {
        Some(m) if m.is_deleted() => Err(session_deleted(session_id)),
        Some(m) if m.last_seq > 0 => Err(session_exists(session_id)),
        _ => Ok(()),
    }
}

/// The refusal for a fork whose `new_session_id` exists.
pub fn session_exists(session_id: &str) -> StoreError {
    StoreError::Refused(
        Reason::SessionExists,
        format!(
            "new_session_id: session {session_id} already exists; name a new one, or leave it              empty for the store to make one"
        ),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::session::test_events::*;
    use agentlog_proto::v1::ToolResult;

    const NOW: i64 = 1_000_000;

    fn with_id(id: &str, kind: event::Kind) -> Event {
        Event {
            event_id: id.into(),
            kind: Some(kind),
            ..Event::default()
        }
    }
    fn result(id: &str) -> event::Kind {
        event::Kind::ToolResult(ToolResult {
            tool_use_id: id.into(),
            ..ToolResult::default()
        })
    }
    /// A session with one user message and, if given, a lease record.
    fn session(lease: Option<(&str, u64, i64, bool)>) -> SessionMeta {
        let mut meta = SessionMeta::default();
        meta.apply_event(&ev(1, user("go")));
        if let Some((owner, epoch, expires_unix_ms, released)) = lease {
            meta.apply_lease(&LeaseRecord {
                session_id: "s".into(),
                owner: owner.into(),
                epoch,
                expires_unix_ms,
                released,
            });
        }
        meta
    }
    fn reason<T: std::fmt::Debug>(result: Result<T, StoreError>) -> Reason {
        result
            .expect_err("refused")
            .reason()
            .expect("a refusal has a reason")
    }

    #[test]
    fn a_session_exists_once_an_event_was_appended() {
        assert_eq!(reason(existing(None, "s")), Reason::SessionNotFound);
        let empty = SessionMeta::default();
        assert_eq!(reason(existing(Some(&empty), "s")), Reason::SessionNotFound);
        assert!(existing(Some(&session(None)), "s").is_ok());
    }

    #[test]
    fn a_deleted_session_is_a_tombstone_that_refuses_everything_for_good() {
        let leased = session(Some(("a", 3, NOW + 10_000, false)));
        let Deletion::Tombstone(tombstone) = delete(Some(&leased), "s", NOW).unwrap() else {
            panic!("a live session is deleted, even under a live lease");
        };
        assert!(tombstone.is_deleted());
        assert_eq!(
            *tombstone,
            SessionMeta::tombstone(NOW),
            "the tombstone keeps nothing else"
        );
        assert!(tombstone.title().is_empty() && tombstone.lease.is_none());
        // Deleting again changes nothing; a session that never existed is not found.
        assert_eq!(
            delete(Some(&tombstone), "s", NOW + 1).unwrap(),
            Deletion::AlreadyDeleted
        );
        assert_eq!(reason(delete(None, "s", NOW)), Reason::SessionNotFound);
        assert_eq!(
            reason(delete(Some(&SessionMeta::default()), "s", NOW)),
            Reason::SessionNotFound
        );
        // Every rule refuses it: reads, leases, and any append, by a person or by the holder
        // of the old epoch, with any event id.
        let t = &tombstone;
        assert_eq!(reason(existing(Some(t), "s")), Reason::SessionDeleted);
        let person = [with_id("e1", user("again"))];
        assert_eq!(
            reason(check_writer(t, "s", None, &person, NOW)),
            Reason::SessionDeleted
        );
        let zombie = [with_id("result:t", result("t"))];
        assert_eq!(
            reason(check_writer(t, "s", Some(3), &zombie, NOW)),
            Reason::SessionDeleted
        );
        assert_eq!(
            reason(check_snapshot(t, "s", 3, 1, NOW)),
            Reason::SessionDeleted
        );
        assert!(!claimable(t, NOW) && !expired(t, NOW, NOW));
    }

    #[test]
    fn a_fork_takes_neither_a_live_nor_a_deleted_sessions_id() {
        assert!(fork_target(None, "f").is_ok());
        assert!(fork_target(Some(&SessionMeta::default()), "f").is_ok());
        assert_eq!(
            reason(fork_target(Some(&session(None)), "f")),
            Reason::SessionExists
        );
        assert_eq!(
            reason(fork_target(Some(&SessionMeta::tombstone(NOW)), "f")),
            Reason::SessionDeleted
        );
    }

    #[test]
    fn retention_takes_sessions_idle_since_before_the_cutoff_without_a_live_lease() {
        let mut idle = session(None);
        idle.updated_unix_ms = NOW - 100;
        assert!(expired(&idle, NOW - 50, NOW));
        assert!(
            !expired(&idle, NOW - 100, NOW),
            "idle exactly that long: kept"
        );
        let mut leased = session(Some(("a", 1, NOW + 1, false)));
        leased.updated_unix_ms = NOW - 100;
        assert!(!expired(&leased, NOW - 50, NOW), "a live lease keeps it");
        let mut lapsed = session(Some(("a", 1, NOW, false)));
        lapsed.updated_unix_ms = NOW - 100;
        assert!(expired(&lapsed, NOW - 50, NOW), "an expired lease does not");
        assert!(!expired(&SessionMeta::default(), NOW, NOW), "no session");
        let mut pinned = idle.clone();
        pinned.pinned = true;
        assert!(!expired(&pinned, NOW - 50, NOW), "a pinned session is kept");
    }

    #[test]
    fn a_pin_changes_only_a_live_session_and_only_when_it_differs() {
        let live = session(None);
        let pinned = pin(Some(&live), "s1", true)
            .expect("live")
            .expect("changed");
        assert!(pinned.pinned && pinned.last_seq == live.last_seq);
        assert_eq!(pin(Some(&pinned), "s1", true).expect("live"), None);
        assert!(pin(Some(&pinned), "s1", false)
            .expect("live")
            .is_some_and(|m| !m.pinned));
        let tombstone = SessionMeta::tombstone(NOW);
        assert_eq!(
            pin(Some(&tombstone), "s1", true)
                .expect_err("deleted")
                .reason(),
            Some(Reason::SessionDeleted)
        );
        assert_eq!(
            pin(None, "s1", true).expect_err("none").reason(),
            Some(Reason::SessionNotFound)
        );
        assert!(
            matches!(delete_imported(None, 5), Deletion::Tombstone(t) if t.deleted_unix_ms == 5)
        );
        assert!(matches!(
            delete_imported(Some(&tombstone), 5),
            Deletion::AlreadyDeleted
        ));
    }

    #[test]
    fn acquire_is_refused_only_while_someone_else_holds_a_live_lease() {
        let first = acquire(&session(None), "s", "a".into(), 100, NOW).expect("free");
        assert_eq!((first.epoch, first.expires_unix_ms), (1, NOW + 100));
        let held = session(Some(("a", 1, NOW + 10, false)));
        assert_eq!(
            reason(acquire(&held, "s", "b".into(), 100, NOW)),
            Reason::LeaseHeld
        );
        // The holder may acquire again, and gets a new epoch.
        assert_eq!(acquire(&held, "s", "a".into(), 100, NOW).unwrap().epoch, 2);
        // Expired or released: anyone, one epoch up.
        let expired = session(Some(("a", 4, NOW, false)));
        assert_eq!(acquire(&expired, "s", "b".into(), 1, NOW).unwrap().epoch, 5);
        let released = session(Some(("a", 4, NOW + 10, true)));
        assert_eq!(
            acquire(&released, "s", "b".into(), 1, NOW).unwrap().epoch,
            5
        );
    }

    #[test]
    fn renew_extends_only_the_holders_newest_unreleased_lease() {
        let held = session(Some(("a", 3, NOW + 10, false)));
        let renewed = renew(&held, "s", "a", 3, 500, NOW).expect("the holder renews");
        assert_eq!((renewed.epoch, renewed.expires_unix_ms), (3, NOW + 500));
        assert_eq!(
            reason(renew(&held, "s", "b", 3, 500, NOW)),
            Reason::LeaseHeld
        );
        assert_eq!(
            reason(renew(&held, "s", "a", 2, 500, NOW)),
            Reason::LeaseFenced
        );
        let released = session(Some(("a", 3, NOW, true)));
        assert_eq!(
            reason(renew(&released, "s", "a", 3, 500, NOW)),
            Reason::LeaseFenced
        );
        assert_eq!(
            reason(renew(&session(None), "s", "a", 1, 500, NOW)),
            Reason::LeaseFenced
        );
        // Expired but not superseded: nobody wrote under a newer epoch, so it may go on.
        let expired = session(Some(("a", 3, NOW - 1, false)));
        assert!(renew(&expired, "s", "a", 3, 500, NOW).is_ok());
    }

    #[test]
    fn release_ends_the_lease_now_and_twice_is_no_error() {
        let held = session(Some(("a", 3, NOW + 10, false)));
        let released = release(&held, "s", "a", 3, NOW).unwrap().expect("a record");
        assert!(released.released);
        assert_eq!((released.epoch, released.expires_unix_ms), (3, NOW));
        let again = session(Some(("a", 3, NOW, true)));
        assert_eq!(release(&again, "s", "a", 3, NOW).unwrap(), None);
        assert_eq!(reason(release(&held, "s", "b", 3, NOW)), Reason::LeaseHeld);
        assert_eq!(
            reason(release(&held, "s", "a", 2, NOW)),
            Reason::LeaseFenced
        );
    }

    #[test]
    fn runner_kinds_need_the_current_live_epoch_and_person_kinds_need_none() {
        let held = session(Some(("a", 2, NOW + 10, false)));
        let person = [ev(0, user("hi")), ev(0, decision("t"))];
        let runner = [ev(0, user("hi")), ev(0, result("t"))];
        assert!(check_writer(&held, "s", None, &person, NOW).is_ok());
        assert_eq!(
            reason(check_writer(&held, "s", None, &runner, NOW)),
            Reason::LeaseRequired
        );
        assert!(check_writer(&held, "s", Some(2), &runner, NOW).is_ok());
        // An epoch given is checked whatever the kinds.
        assert_eq!(
            reason(check_writer(&held, "s", Some(1), &person, NOW)),
            Reason::LeaseFenced
        );
        let expired = session(Some(("a", 2, NOW, false)));
        assert_eq!(
            reason(check_writer(&expired, "s", Some(2), &runner, NOW)),
            Reason::LeaseFenced
        );
        let released = session(Some(("a", 2, NOW + 10, true)));
        assert_eq!(
            reason(check_writer(&released, "s", Some(2), &runner, NOW)),
            Reason::LeaseFenced
        );
    }

    #[test]
    fn a_session_is_claimable_when_runnable_and_unleased() {
        assert!(claimable(&session(None), NOW));
        assert!(!claimable(&session(Some(("a", 1, NOW + 1, false))), NOW));
        assert!(claimable(&session(Some(("a", 1, NOW, false))), NOW));
        let mut idle = session(None);
        idle.status = agentlog_proto::v1::SessionStatus::Idle as i32;
        assert!(!claimable(&idle, NOW));
    }

    #[test]
    fn numbering_dedups_known_and_repeated_ids_and_numbers_the_rest_from_last_seq() {
        let known: HashMap<&str, u64> = [("old", 2)].into();
        let events = vec![
            with_id("new", user("a")),
            with_id("old", user("b")),
            with_id("new", user("c")),
            with_id("", user("d")),
            with_id("", user("e")),
        ];
        let numbered = number("s", events.into_iter().map(KeptEvent::new), 5, NOW, |id| {
            Ok::<_, StoreError>(known.get(id).copied())
        })
        .unwrap();
        assert_eq!(numbered.seqs, vec![6, 2, 6, 7, 8]);
        let fresh: Vec<(u64, &str)> = numbered
            .fresh
            .iter()
            .map(|e| (e.seq, e.event_id.as_str()))
            .collect();
        assert_eq!(fresh, vec![(6, "new"), (7, ""), (8, "")]);
        assert!(numbered.fresh.iter().all(|e| e.session_id == "s"
            && e.ts_unix_ms == NOW
            && e.schema_version == SCHEMA_VERSION));
        // A failed lookup is the caller's error.
        let failed = number(
            "s",
            [KeptEvent::new(with_id("x", user("a")))],
            0,
            NOW,
            |_| Err::<Option<u64>, _>("index down"),
        );
        assert_eq!(failed, Err("index down"));
    }

    #[test]
    fn expected_last_seq_is_checked_only_when_something_is_new() {
        let meta = session(None);
        let fresh = [KeptEvent::new(ev(2, user("x")))];
        assert!(check_fresh(&meta, "s", Some(1), &fresh).is_ok());
        assert!(check_fresh(&meta, "s", None, &fresh).is_ok());
        let stale = check_fresh(&meta, "s", Some(0), &fresh);
        assert_eq!(
            stale.as_ref().unwrap_err().to_string(),
            "expected_last_seq is 0 but session s is at seq 1"
        );
        assert_eq!(reason(stale), Reason::SeqConflict);
        // A retry of an append that landed is all duplicates: answered, not refused.
        assert!(check_fresh(&meta, "s", Some(0), &[]).is_ok());
    }

    #[test]
    fn a_decision_must_answer_a_pending_request_once() {
        let pending = vec!["a".to_string()];
        let events = [ev(0, decision("a"))];
        assert!(check_approval_decisions("s", &pending, &events).is_ok());
        let twice = [ev(0, decision("a")), ev(0, decision("a"))];
        assert!(check_approval_decisions("s", &pending, &twice).is_err());
        assert_eq!(
            reason(check_approval_decisions("s", &[], &events)),
            Reason::ApprovalNotPending
        );
        // A request earlier in the same append counts; a result closes the request.
        let same_append = [ev(0, request("b")), ev(0, decision("b"))];
        assert!(check_approval_decisions("s", &[], &same_append).is_ok());
        let answered = [ev(0, result("a")), ev(0, decision("a"))];
        assert!(check_approval_decisions("s", &pending, &answered).is_err());
    }

    /// user(1), a reply with calls a and b(2), started a(3), result a(4), started b(5),
    /// result b(6), a final reply(7), user(8), interrupt(9), interrupted(10).
    fn forkable_log() -> Vec<Event> {
        use agentlog_proto::v1::{
            content_block::Block, AssistantMessage, ContentBlock, Interrupt, Interrupted,
            ToolStarted, ToolUseBlock,
        };
        let call = |id: &str| ContentBlock {
            block: Some(Block::ToolUse(ToolUseBlock {
                id: id.into(),
                ..ToolUseBlock::default()
            })),
        };
        let reply = |calls: Vec<ContentBlock>| {
            event::Kind::AssistantMessage(AssistantMessage {
                content: calls,
                ..AssistantMessage::default()
            })
        };
        let started = |id: &str| {
            event::Kind::ToolStarted(ToolStarted {
                tool_use_id: id.into(),
                ..ToolStarted::default()
            })
        };
        let kinds = vec![
            user("go"),
            reply(vec![call("a"), call("b")]),
            started("a"),
            result("a"),
            started("b"),
            result("b"),
            reply(vec![]),
            user("next"),
            event::Kind::Interrupt(Interrupt::default()),
            event::Kind::Interrupted(Interrupted::default()),
        ];
        kinds
            .into_iter()
            .enumerate()
            .map(|(i, kind)| Event {
                event_id: format!("e{}", i + 1),
                ts_unix_ms: 100 + i as i64,
                ..ev(i as u64 + 1, kind)
            })
            .collect()
    }

    fn fork_at(log: &[Event], at_seq: u64) -> Result<(), StoreError> {
        let mut point = ForkPoint::new(at_seq);
        for event in log {
            if point.apply(event) {
                break;
            }
        }
        point.verdict("p", log.len() as u64)
    }

    #[test]
    fn a_fork_is_made_only_at_a_settled_point_and_a_refusal_names_the_nearest() {
        let log = forkable_log();
        assert_eq!(SettledPoints::of(&log), vec![1, 6, 7, 8, 10]);
        for at in [1, 6, 7, 8, 10] {
            assert!(fork_at(&log, at).is_ok(), "seq {at}");
        }
        let refused = fork_at(&log, 4).expect_err("a call is still open at 4");
        assert_eq!(refused.reason(), Some(Reason::ForkPointUnsettled));
        assert!(refused.to_string().contains("are 1 and 6"), "{refused}");
        assert!(
            refused
                .to_string()
                .contains("made after a user message, a final assistant"),
            "one space between words: {refused}"
        );
        let refused = fork_at(&log, 9).expect_err("an interrupt waits for its answer");
        assert!(refused.to_string().contains("are 8 and 10"), "{refused}");
        let refused = fork_at(&log[..9], 9).expect_err("nothing settled after it yet");
        assert!(refused.to_string().contains("seq is 8"), "{refused}");
        for outside in [0, 11] {
            let refused = fork_at(&log, outside).expect_err("outside the log");
            assert!(matches!(refused, StoreError::InvalidArgument(_)));
            assert!(!refused.to_string().contains("  "), "{refused}");
        }
    }

    #[test]
    fn a_user_message_sent_while_calls_are_open_is_not_a_settled_point() {
        let mut log = forkable_log();
        log.truncate(2);
        log.push(ev(3, user("also")));
        assert_eq!(SettledPoints::of(&log), vec![1]);
    }

    fn prefix_of(log: &[Event], extra: &[KeptEvent]) -> ForkPrefix {
        let mut prefix = ForkPrefix::new("f", "p", log.len() as u64, extra, NOW);
        for event in log {
            prefix.apply(event);
        }
        prefix
    }

    #[test]
    fn a_forks_state_is_the_prefix_then_the_new_events() {
        let log = forkable_log();
        let extra = vec![
            KeptEvent::new(with_id("e2", user("a repeat of a prefix id"))),
            KeptEvent::new(with_id("x1", user("edited"))),
        ];
        let plan = plan_fork(prefix_of(&log[..8], &extra), extra, NOW).expect("fork");
        assert_eq!(plan.seqs, vec![2, 9]);
        assert_eq!(plan.fresh.len(), 1);
        let fresh = &plan.fresh[0];
        assert_eq!(
            (fresh.session_id.as_str(), fresh.seq, fresh.ts_unix_ms),
            ("f", 9, NOW)
        );
        assert_eq!(plan.meta.last_seq, 9);
        assert_eq!(plan.meta.created_unix_ms, NOW);
        assert!(plan.meta.is_runnable());
        let from = plan.meta.info("f", NOW).forked_from.expect("a fork");
        assert_eq!((from.session_id.as_str(), from.seq), ("p", 8));

        let runner_kind = vec![KeptEvent::new(ev(
            0,
            event::Kind::RunError(agentlog_proto::v1::RunError::default()),
        ))];
        let refused = plan_fork(prefix_of(&log[..8], &runner_kind), runner_kind, NOW);
        assert_eq!(reason(refused), Reason::LeaseRequired);
    }

    #[test]
    fn a_replayed_user_turn_must_name_a_seq_of_the_sessions_recording() {
        let turn = |seq: u64| Event {
            event_id: agentlog_proto::replay::user_event_id(seq),
            kind: Some(user("recorded")),
            ..Event::default()
        };
        let mut plain = SessionMeta::default();
        plain.apply_event(&ev(1, user("go")));
        let refused = check_writer(&plain, "s", None, [&turn(3)], NOW);
        assert!(
            matches!(refused, Err(StoreError::InvalidArgument(_))),
            "{refused:?}"
        );
        let mut replay = SessionMeta::default();
        replay.apply_event(&ev(
            1,
            event::Kind::SessionConfig(agentlog_proto::v1::SessionConfig {
                model: "openai:m".into(),
                replay: Some(agentlog_proto::v1::Replay {
                    session_id: "rec".into(),
                    after_seq: 2,
                    through_seq: 9,
                    ..Default::default()
                }),
                ..Default::default()
            }),
        ));
        assert!(check_writer(&replay, "s", None, [&turn(3)], NOW).is_ok());
        assert!(check_writer(&replay, "s", None, [&turn(2)], NOW).is_err());
        assert!(check_writer(&replay, "s", None, [&turn(10)], NOW).is_err());
        // A state release 0.1.0 began says nothing of a replay: taken on trust.
        let legacy = SessionMeta {
            tracks_replay: false,
            ..plain.clone()
        };
        assert!(check_writer(&legacy, "s", None, [&turn(3)], NOW).is_ok());
        // Any other user message is a person's, whatever its id.
        let typed = Event {
            event_id: "u2".into(),
            kind: Some(user("hello")),
            ..Event::default()
        };
        assert!(check_writer(&plain, "s", None, [&typed], NOW).is_ok());
    }
}
