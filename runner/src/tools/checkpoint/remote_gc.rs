//! The object store's sweep: a deleted session's checkpoints leave the bucket once no
//! session that exists (a fork) still needs them, as they leave a local area (`gc.rs`).
//!
//! What stays is exactly what the refs of the sessions that exist reach
//! (`sessions/<id>/refs/<checkpoint>`, `remote.rs`). A sweep, run by a runner's sweep after
//! its local one, and by one runner at a time (`gc/state`, [`GcState`]):
//! 1. marks itself running, until a lease's end ([`LEASE_MS`], renewed as it goes; a sweep
//!    that finds its lease lapsed stops at once, so a sweep killed or stalled holds the
//!    others up no longer than that), and reads the store's clock back, so every time below
//!    is on the store's clock;
//! 2. lists the sessions that have refs, asks the event store about each; one answered
//!    `SESSION_DELETED` is gone;
//! 3. if any is gone, adopts for every fork not adopted yet the checkpoints its copied
//!    prefix names (refs of its own, then its `adopted` marker), as the local GC does, so a
//!    fork of a gone session keeps its files; then removes the gone sessions' refs;
//! 4. marks everything the remaining refs reach, reading trees from the local area or the
//!    store. A ref whose checkpoint is not whole yet is an upload under way: every object
//!    stored since that ref, less a second of the store's clock, is kept (the upload's new
//!    objects come after its ref); such a ref older than [`STALE_REF_MS`] is one no log
//!    names (a result is appended only after a whole upload) and is removed;
//! 5. removes every object under `blobs/` and `trees/` that nothing reached and that is
//!    older than the sweep's start, then counts a generation and marks itself done.
//!
//! Crash points: each step only adds refs or removes what no ref reaches, so a sweep killed
//! anywhere leaves the store correct; the next one, after the lease, finishes the job. The
//! race with an upload that reuses an object a sweep is about to remove is closed on the
//! upload's side (`remote.rs`, its promises).

use std::collections::{HashMap, HashSet};
use std::io;

use agentlog_client::StoreClient;

use super::area::{hex, parse_hex, Hash};
use super::gc::{every_session, is_gone, GcError};
use super::remote::{now_ms, GcState, Remote};
use super::{Checkpoints, PrefixCheckpoints};

/// A sweep's lease: renewed at half its length; a lapsed one ends the sweep.
const LEASE_MS: i64 = 30 * 1000;
/// A ref whose checkpoint is still not whole after this long is one no log names.
const STALE_REF_MS: i64 = 60 * 60 * 1000;
/// The store's clock counts whole seconds on some servers: objects this close to a bound
/// are on its safe side.
const CLOCK_STEP_MS: i64 = 1000;

/// What a sweep of the object store did.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RemoteSwept {
    /// `false`: another runner's sweep is running; this one did nothing.
    pub ran: bool,
    pub sessions_forgotten: Vec<String>,
    pub forks_adopted: Vec<String>,
    pub objects_removed: usize,
    pub bytes_freed: u64,
}

/// One sweep of the object store `checkpoints` live in (see the module head).
pub async fn collect_remote_garbage(
    checkpoints: &Checkpoints,
    remote: &Remote,
    client: &StoreClient,
) -> Result<RemoteSwept, GcError> {
    let io = |e: io::Error| GcError::from(checkpoints.io_error(e));
    let state = remote.gc_state().await.map_err(io)?;
    if state.running() {
        return Ok(RemoteSwept::default());
    }
    let mut lease = Lease {
        remote,
        generation: state.generation,
        until: 0,
    };
    let started = lease.renew().await.map_err(io)?;
    let swept = sweep(checkpoints, remote, client, started, &mut lease).await;
    // Done or failed, the next sweep need not wait for this one's lease.
    let ended = GcState {
        generation: state.generation + 1,
        running_until_ms: 0,
    };
    remote.set_gc_state(&ended).await.map_err(io)?;
    swept
}

/// The running sweep's hold on `gc/state`.
struct Lease<'a> {
    remote: &'a Remote,
    generation: u64,
    /// Until when it holds (this machine's clock, ms).
    until: i64,
}

impl Lease<'_> {
    /// Holds for another [`LEASE_MS`]; returns the store's clock (ms).
    async fn renew(&mut self) -> io::Result<i64> {
        let until = now_ms() + LEASE_MS;
        let clock = self
            .remote
            .set_gc_state(&GcState {
                generation: self.generation,
                running_until_ms: until,
            })
            .await?;
        self.until = until;
        Ok(clock)
    }

    /// Renews the lease when half of it is gone; a lapsed lease is an error (another sweep
    /// may have begun, and uploads no longer wait for this one).
    async fn keep(&mut self) -> io::Result<()> {
        let now = now_ms();
        if now >= self.until {
            return Err(io::Error::other(
                "the object store's sweep outlived its lease; the next one goes on",
            ));
        }
        if now >= self.until - LEASE_MS / 2 {
            self.renew().await?;
        }
        Ok(())
    }
}

async fn sweep(
    checkpoints: &Checkpoints,
    remote: &Remote,
    client: &StoreClient,
    started: i64,
    lease: &mut Lease<'_>,
) -> Result<RemoteSwept, GcError> {
    let io = |e: io::Error| GcError::from(checkpoints.io_error(e));
    let mut swept = RemoteSwept {
        ran: true,
        ..RemoteSwept::default()
    };
    let sessions = session_objects(remote).await.map_err(io)?;
    for session_id in sessions.keys() {
        lease.keep().await.map_err(io)?;
        if is_gone(client, session_id).await? {
            swept.sessions_forgotten.push(session_id.clone());
        }
    }
    if !swept.sessions_forgotten.is_empty() {
        for info in every_session(client).await? {
            let Some(fork) = &info.forked_from else {
                continue;
            };
            let adopted = sessions
                .get(&info.session_id)
                .is_some_and(|objects| objects.iter().any(|o| o.path.ends_with("/adopted")));
            if adopted || swept.sessions_forgotten.contains(&info.session_id) {
                continue;
            }
            lease.keep().await.map_err(io)?;
            let prefix = PrefixCheckpoints::read(client, &info.session_id, fork.seq).await?;
            for id in &prefix.named {
                if let Some(root) = parse_hex(id) {
                    remote.add_ref(&info.session_id, &root).await.map_err(io)?;
                }
            }
            remote
                .put_marker(&format!("sessions/{}/adopted", info.session_id))
                .await
                .map_err(io)?;
            swept.forks_adopted.push(info.session_id);
        }
        let gone: Vec<String> = swept
            .sessions_forgotten
            .iter()
            .flat_map(|id| sessions.get(id).into_iter().flatten())
            .map(|object| object.path.clone())
            .collect();
        lease.keep().await.map_err(io)?;
        remote.delete(&gone).await.map_err(io)?;
    }
    // Mark from the refs as they are now.
    let refs = session_objects(remote).await.map_err(io)?;
    let mut keep_after = started - CLOCK_STEP_MS;
    let mut reached_trees = HashSet::new();
    let mut reached_blobs = HashSet::new();
    let mut stale = Vec::new();
    for reference in refs.values().flatten() {
        lease.keep().await.map_err(io)?;
        let Some(root) = reference
            .path
            .rsplit_once("/refs/")
            .and_then(|(_, id)| parse_hex(id))
        else {
            continue;
        };
        let whole = mark(
            checkpoints,
            remote,
            root,
            &mut reached_trees,
            &mut reached_blobs,
        )
        .await
        .map_err(io)?;
        if !whole {
            if started - reference.modified_ms > STALE_REF_MS {
                stale.push(reference.path.clone());
            } else {
                keep_after = keep_after.min(reference.modified_ms - CLOCK_STEP_MS);
            }
        }
    }
    lease.keep().await.map_err(io)?;
    remote.delete(&stale).await.map_err(io)?;
    let mut doomed = Vec::new();
    for (dir, reached) in [("trees/", &reached_trees), ("blobs/", &reached_blobs)] {
        for object in remote.list(dir).await.map_err(io)? {
            let hash = object.path.strip_prefix(dir).and_then(parse_hex);
            let live = hash.is_some_and(|h| reached.contains(&h));
            if !live && object.modified_ms < keep_after {
                swept.bytes_freed += object.size;
                doomed.push(object.path);
            }
        }
    }
    for batch in doomed.chunks(256) {
        lease.keep().await.map_err(io)?;
        remote.delete(batch).await.map_err(io)?;
        swept.objects_removed += batch.len();
    }
    Ok(swept)
}

/// The objects under `sessions/`, by session.
async fn session_objects(
    remote: &Remote,
) -> io::Result<HashMap<String, Vec<super::remote::Listed>>> {
    let mut sessions: HashMap<String, Vec<_>> = HashMap::new();
    for object in remote.list("sessions/").await? {
        let Some(session_id) = object
            .path
            .strip_prefix("sessions/")
            .and_then(|rest| rest.split('/').next())
        else {
            continue;
        };
        sessions
            .entry(session_id.to_string())
            .or_default()
            .push(object);
    }
    Ok(sessions)
}

/// Marks the trees and blobs checkpoint `root` reaches; returns whether every tree of it
/// was found.
async fn mark(
    checkpoints: &Checkpoints,
    remote: &Remote,
    root: Hash,
    trees: &mut HashSet<Hash>,
    blobs: &mut HashSet<Hash>,
) -> io::Result<bool> {
    let mut whole = true;
    let mut stack = vec![root];
    while let Some(hash) = stack.pop() {
        if !trees.insert(hash) {
            continue;
        }
        let Some(tree) = remote.tree(&checkpoints.area, &hash).await? else {
            tracing::debug!(tree = %hex(&hash), "a checkpoint's tree is not in the store (yet)");
            trees.remove(&hash);
            whole = false;
            continue;
        };
        tree.reach(&mut stack, blobs);
    }
    Ok(whole)
}
