//! The storage contract the gRPC service runs over, session by session. Two backends keep
//! it: the local log ([`local::Store`], one replica on one volume) and PostgreSQL
//! ([`postgres::PgBackend`], any number of replicas over one database).
//!
//! What every backend keeps, whichever replica a call reaches:
//! - **Appends are atomic.** Every event of an append is written, or none is.
//! - **Seqs are gapless from 1** per session, assigned by the backend, never reused.
//! - **`event_id` dedup is permanent.** An event whose id the session already holds writes
//!   nothing and is answered with the seq it got the first time, however long ago.
//! - **`expected_last_seq` and the lease epoch are checked atomically with the write**: no
//!   other write to the session can land between the check and the append.
//! - **Epochs never repeat**, across crashes and restarts of the backend too: a grant is
//!   durable before it is returned, and the next grant is always one higher.
//! - **`DURABILITY_SYNC` means durable on return**; `DURABILITY_BUFFERED` may be
//!   acknowledged before that, and is durable within milliseconds.
//! - **A subscription has no gap and no duplicate** across the switch from history to live,
//!   and only ever shows durable events.
//! - **A claim goes to exactly one claimant**: a runnable session is granted to one caller.
//! - The derived session state (status, title, pending approvals) follows the rules in
//!   [`crate::session`], the same functions in every backend.
//! - **A fork is one atomic step** ([`Backend::fork`]): the new session holds the parent's
//!   events `1..=at_seq` (ids, times and contents as they were; its own session id) and the
//!   request's events, or nothing; from then on it is a session like any other, sharing
//!   nothing with its parent. What may be forked where is [`crate::rules::ForkPoint`] and
//!   [`crate::rules::plan_fork`], the same for every backend.
//! - **Snapshots are derived, never the truth.** A [`Snapshot`] is kept per (session,
//!   format) only for the session's live lease holder and a seq within the log
//!   ([`crate::rules::check_snapshot`]); a newer seq replaces an older one, never the reverse. The backend
//!   never reads the data; nothing in the log depends on a snapshot being there.
//! - **A deletion is for good.** [`Backend::delete_session`] replaces the session by a
//!   small tombstone ([`crate::session::SessionMeta::tombstone`], decided by
//!   [`crate::rules::delete`]) and returns once the tombstone is durable. From then on, on
//!   every replica: `GetSession`, `Append`/`AppendStream`, `Subscribe`, the lease calls and
//!   `PutSnapshot`/`GetSnapshot` answer `NOT_FOUND` with reason `SESSION_DELETED`;
//!   `ListSessions` and `ClaimSession` never show it; a live subscription ends with that
//!   status (on another replica too, within its wake-up or safety poll); and nothing writes
//!   it again: not a retried append with its old event ids, not the holder of an old
//!   epoch, not after a restart between the tombstone and the reclamation (the tombstone is
//!   read before any other rule, [`crate::rules::check_writer`]). Deleting a deleted
//!   session succeeds and changes nothing; one that never existed is `NOT_FOUND`
//!   (`SESSION_NOT_FOUND`). Its events, title, snapshots and lease then leave the storage:
//!   the local log rewrites the segments that hold them (`local::reclaim`), PostgreSQL
//!   deletes the rows in bounded transactions and its vacuum frees them.
//! - **Search follows the log** ([`Backend::search`], the rules in [`crate::search`]): an
//!   event is found within 1 s of its acknowledgement, never before it is durable; a
//!   deleted session is never found from the moment `delete_session` returns, and its words
//!   leave the index as its events leave the storage; a crash loses no hit and brings none
//!   back.
//! - **Retention** (`--retain-idle`) deletes, as `delete_session` does, every session whose
//!   last event is older than the span and that holds no live lease
//!   ([`crate::rules::expired`]), in bounded batches that appends pass between, and on
//!   PostgreSQL on one replica at a time.
//!
//! - **A pin keeps a session from retention** ([`Backend::pin`]): `SessionInfo.pinned`, a
//!   state change like a lease's, durable on return; [`crate::rules::expired`] skips it.
//! - **An import is visible only when whole** ([`Backend::begin_import`]): a session's
//!   events are staged where no call can see them, each with its seq, event id, time and
//!   content as the export gives them, and the session appears in one atomic step
//!   ([`Staging::commit`]) with the state folded from them by the rules every append
//!   follows ([`crate::rules::adopt_imported`]): from then on it is a session like any
//!   other, dedup and seqs going on. A crash (the store's `kill -9` included) at any moment
//!   before that step leaves nothing of it visible, and nothing in the way of importing it
//!   again; a session made here meanwhile under the same id is left as it is
//!   (`SESSION_EXISTS`). A deleted id imported as deleted stays deleted here for good
//!   ([`Backend::import_deletion`]).
//! - **Every id can be walked** ([`Backend::session_ids`]): in id order, deleted ones too,
//!   so that `Export --all` visits every session exactly once however the sessions change
//!   meanwhile.
//!
//! The integration suites `store_append`, `store_leases`, `store_subscribe`,
//! `store_bad_input`, `store_protocol` and `store_delete` run against each backend through
//! the real binary,
//! and `event-store/tests/backend_props.rs` checks the concurrent parts of the contract
//! in-process against both.

use std::time::Duration;

use agentlog_proto::kept::KeptEvent;
use agentlog_proto::v1::{
    AppendResponse, Durability, Event, ForkSessionResponse, Lease, ListSessionsRequest,
    ListSessionsResponse, SearchSessionsResponse, SessionInfo,
};
use tokio::sync::{mpsc, watch};
use tokio_util::sync::CancellationToken;

use crate::scope::Scope;
use crate::StoreError;

pub mod framed;
pub mod local;
pub mod postgres;

pub use framed::FramedEvents;

/// A validated append request (session id syntax and sizes were checked at the edge).
pub struct AppendOp {
    pub session_id: String,
    pub events: Vec<KeptEvent>,
    pub expected_last_seq: Option<u64>,
    pub lease_epoch: Option<u64>,
    pub durability: Durability,
}

/// A validated fork request (ids checked, the new one made if the caller left it empty,
/// the events' sizes and ids checked).
pub struct ForkOp {
    pub parent: String,
    pub at_seq: u64,
    pub new_session_id: String,
    pub events: Vec<KeptEvent>,
}

/// A validated `SearchSessions` request.
pub struct SearchOp {
    pub query: crate::search::Query,
    /// 1 to [`crate::search::MAX_PAGE_SIZE`].
    pub page_size: usize,
    /// Empty for the first page; else a backend's own token from a previous page.
    pub page_token: String,
}

/// A run of a subscription's events, consecutive and ascending, as Subscribe sends them.
#[derive(Clone, Debug)]
pub enum EventRun {
    /// Events in memory (published live), each kept as its writer encoded it.
    Decoded(Vec<KeptEvent>),
    /// Events read from the local log, already in their wire form.
    Framed(FramedEvents),
}

impl EventRun {
    /// How many events.
    pub fn len(&self) -> usize {
        match self {
            EventRun::Decoded(events) => events.len(),
            EventRun::Framed(framed) => framed.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The events themselves (for callers in this process; the service sends the bytes).
    pub fn into_events(self) -> Result<Vec<Event>, StoreError> {
        match self {
            EventRun::Decoded(events) => {
                Ok(events.into_iter().map(KeptEvent::into_event).collect())
            }
            EventRun::Framed(framed) => framed.decode(),
        }
    }
}

/// Runs of events queued between a subscription and the service: enough that the next
/// chunk of history is read while the service sends the one before, few enough that a
/// stalled reader holds little memory (a run is at most one chunk).
pub const QUEUED_RUNS: usize = 4;

/// The largest snapshot a backend keeps.
pub const MAX_SNAPSHOT_BYTES: usize = 64 << 20;

/// A kept snapshot as a backend hands it out: its seq, then its data in pieces, in order,
/// read as the caller takes them (a snapshot of tens of MiB is never held whole).
pub struct SnapshotRead {
    pub seq: u64,
    pub pieces: SnapshotPieces,
}

pub type SnapshotPieces =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<bytes::Bytes, StoreError>> + Send>>;

/// A record derived from a session's log up to `seq`, in a format its writer chose.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Snapshot {
    pub session_id: String,
    pub format: String,
    pub seq: u64,
    pub data: Vec<u8>,
}

/// A session-level store. Requests reach it already validated by [`crate::service`] (ids,
/// sizes, counts); the rules that need state (seqs, leases, dedup, approvals) are the
/// backend's.
#[tonic::async_trait]
pub trait Backend: Send + Sync + 'static {
    /// Appends the events of `op` atomically; see the module head for what is promised.
    async fn append(&self, op: AppendOp) -> Result<AppendResponse, StoreError>;

    /// Streams the session from `from_seq` (history, then live with `follow`) into a bounded
    /// channel, in runs of consecutive events; a slow reader only ever delays itself. Ends
    /// when `cancel` fires.
    fn subscribe(
        &self,
        session_id: String,
        from_seq: u64,
        follow: bool,
        cancel: CancellationToken,
    ) -> mpsc::Receiver<Result<EventRun, StoreError>>;

    /// `NOT_FOUND` if no event was ever appended to the session.
    async fn get_session(&self, session_id: &str) -> Result<SessionInfo, StoreError>;

    /// Sessions in `scope`, most recently updated first, paged by `page_token`.
    async fn list_sessions(
        &self,
        req: &ListSessionsRequest,
        scope: &Scope,
    ) -> Result<ListSessionsResponse, StoreError>;

    /// A lease on a named session; refused while someone else's lease is live.
    async fn acquire_lease(
        &self,
        session_id: String,
        owner: String,
        ttl_ms: u64,
    ) -> Result<Lease, StoreError>;

    /// Extends `owner`'s lease of `epoch`; refused once a newer epoch exists.
    async fn renew_lease(
        &self,
        session_id: String,
        owner: String,
        epoch: u64,
        ttl_ms: u64,
    ) -> Result<Lease, StoreError>;

    /// Gives the lease up at once (releasing twice is not an error).
    async fn release_lease(
        &self,
        session_id: String,
        owner: String,
        epoch: u64,
    ) -> Result<(), StoreError>;

    /// Waits up to `wait` for a runnable session in `scope` without a live lease and leases
    /// it to `owner`; `None` if none came (or `cancel` fired).
    async fn claim(
        &self,
        owner: String,
        ttl_ms: u64,
        wait: Duration,
        cancel: &CancellationToken,
        scope: &Scope,
    ) -> Result<Option<Lease>, StoreError>;

    /// Keeps `snapshot` (see the module head); returns the seq of the snapshot now kept.
    async fn put_snapshot(&self, snapshot: Snapshot, lease_epoch: u64) -> Result<u64, StoreError>;

    /// The kept snapshot of `format` for the session, if any.
    async fn get_snapshot(
        &self,
        session_id: &str,
        format: &str,
    ) -> Result<Option<SnapshotRead>, StoreError>;

    /// Deletes the session for good, as the module head says: the tombstone is durable on
    /// return. `NOT_FOUND` if it never existed; deleting it again succeeds.
    async fn delete_session(&self, session_id: &str) -> Result<(), StoreError>;

    /// `ForkSession`: the session `op.new_session_id` made of the parent's prefix and
    /// `op.events` in one atomic step (see the module head); `SESSION_EXISTS` if that
    /// session holds events (`SESSION_DELETED` if it was deleted: its id is dead for good),
    /// `FORK_POINT_UNSETTLED` unless `at_seq` is a settled point.
    async fn fork(&self, op: ForkOp) -> Result<ForkSessionResponse, StoreError>;

    /// Whether the backend can acknowledge appends now (health reports NOT_SERVING while
    /// it cannot); changes as it loses and regains its storage.
    fn serving(&self) -> watch::Receiver<bool>;

    /// Queues an append and returns its answer to come, for `AppendStream`: appends to a
    /// session queued one after another are applied in that order, so the next may be
    /// queued before the previous one is answered (a stream's requests are read while the
    /// ones before them commit). Waits only for room in the backend's queue, never for a
    /// commit. The append goes on whether or not its answer is polled: the answer only
    /// receives the outcome.
    async fn enqueue_append(&self, op: AppendOp) -> Result<AppendAnswer, StoreError>;

    // Sessions that move: export, import, pin (see the module head).

    /// The session ids in `scope` after `after`, in id order (bytewise), at most `limit`,
    /// deleted ones too: what `Export --all` walks.
    async fn session_ids(
        &self,
        after: &str,
        limit: usize,
        scope: &Scope,
    ) -> Result<Vec<ListedId>, StoreError>;

    /// `PinSession`: pins or unpins a live session (durable on return) and answers it as it
    /// is now.
    async fn pin(&self, session_id: &str, pinned: bool) -> Result<SessionInfo, StoreError>;

    /// Starts the import of `session_id`, which the caller found absent here: its events go
    /// to a [`Staging`], invisible until committed.
    async fn begin_import(&self, session_id: &str) -> Result<Box<dyn Staging>, StoreError>;

    /// An imported `deleted` line: the id is deleted here from now on (a live session of
    /// that id as by [`Backend::delete_session`]; an id never seen here gets its tombstone
    /// too). Whether anything changed (false: it was deleted here already).
    async fn import_deletion(
        &self,
        session_id: &str,
        deleted_unix_ms: i64,
    ) -> Result<bool, StoreError>;

    /// Up to `max` sessions retention would delete now (idle since before `idle_before`,
    /// [`crate::rules::expired`]), least recently updated first, each with the state it
    /// was read at: what the archive of `--archive-dir` exports before it deletes them.
    async fn expiring(&self, idle_before: i64, max: usize) -> Result<Vec<Expiring>, StoreError>;

    /// Deletes the session as retention does, but only if it is still as
    /// [`Backend::expiring`] read it (nothing written since, still expired): what was
    /// archived is then all it held. Whether it did.
    async fn delete_expiring(
        &self,
        expiring: &Expiring,
        idle_before: i64,
    ) -> Result<bool, StoreError>;

    /// `SearchSessions`: one page of the events in `scope` that match `op.query`, newest
    /// first. Each hit was checked against the event's text and the session's state at the
    /// time of the call: a deleted session is never shown, nor a session outside `scope`
    /// (nor counted). An event is found within 1 s of its acknowledgement. `UNAVAILABLE` on
    /// a store whose index is turned off.
    async fn search(
        &self,
        op: SearchOp,
        scope: &Scope,
    ) -> Result<SearchSessionsResponse, StoreError>;
}

/// A session retention would delete, as it was read ([`Backend::expiring`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Expiring {
    pub session_id: String,
    /// The state it was read at: its last seq (local log) or row version (PostgreSQL).
    pub read_at: i64,
}

/// A session id as [`Backend::session_ids`] walks them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedId {
    pub session_id: String,
    /// When it was deleted (0: it is live).
    pub deleted_unix_ms: i64,
}

/// Why events could not be staged.
#[derive(Debug)]
pub enum StageError {
    /// The event of `seq` has the event id of the session's event `earlier`.
    Repeated {
        seq: u64,
        earlier: u64,
        event_id: String,
    },
    Store(StoreError),
}

impl From<StoreError> for StageError {
    fn from(e: StoreError) -> StageError {
        StageError::Store(e)
    }
}

/// One session's import in progress ([`Backend::begin_import`]).
#[tonic::async_trait]
pub trait Staging: Send + Sync {
    /// Stages the next events, as the export gives them (the caller checked that their seqs
    /// go on from the last one staged, from 1, each with an event id); an event id that
    /// repeats one of the session's is [`StageError::Repeated`]. Staged events are durable
    /// on return, and invisible.
    async fn stage(&mut self, events: Vec<KeptEvent>) -> Result<(), StageError>;

    /// Makes the session visible, whole, in one atomic step: its state folded from the
    /// staged events, with the times, `forked_from` and `pinned` of `line`
    /// ([`crate::rules::adopt_imported`], which also refuses a line that disagrees with the
    /// events). `SESSION_EXISTS` or `SESSION_DELETED` if the id was taken here meanwhile:
    /// then nothing of it changed.
    async fn commit(self: Box<Self>, line: SessionInfo) -> Result<(), StoreError>;

    /// Drops what was staged (a refused or cut-off import).
    async fn abandon(self: Box<Self>);
}

/// The answer to a queued append.
pub type AppendAnswer =
    std::pin::Pin<Box<dyn std::future::Future<Output = Result<AppendResponse, StoreError>> + Send>>;
