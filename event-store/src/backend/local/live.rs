//! The live fan-out: what the writer publishes goes to each followed session's followers
//! through that session's ring, and the ring costs only what is in it.
//!
//! A ring holds the batches published to its session that some follower has not read yet,
//! each with the count of followers still to read it: a batch every follower has read is
//! dropped at once, and an empty ring holds no buffer (a follower of a session that gets
//! nothing costs its entry here and nothing more). A ring grows as far as the slowest
//! follower lags, up to [`LIVE_BUFFER_BATCHES`]; past that the oldest batch is dropped and a
//! follower that had not read it is told it lagged (it then catches up from disk, as a
//! follower of tokio's broadcast channel of that capacity did: nothing falls back to disk
//! sooner). A ring goes when its last follower does.
//!
//! Publishing never blocks on a follower: it takes the ring's lock for a push and wakes the
//! followers waiting.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex, Weak};

use agentlog_proto::kept::KeptEvent;
use tokio::sync::Notify;

/// Live batches kept per session for its slowest follower before it counts as lagging.
pub const LIVE_BUFFER_BATCHES: usize = 1024;
/// A ring that grew past this many slots gives its buffer back once it is empty again (a
/// small one keeps it, so that a busy session with quick followers allocates nothing per
/// batch).
const KEPT_SLOTS: usize = 16;

/// What a session's followers are told.
#[derive(Clone, Debug)]
pub enum Live {
    /// Durable events, ascending.
    Events(Arc<[KeptEvent]>),
    /// The session was deleted: the last word.
    Deleted,
}

/// Why [`Follower::recv`] has no batch.
#[derive(Debug, PartialEq, Eq)]
pub enum RecvError {
    /// This many batches were dropped before the follower read them; the next ones follow.
    Lagged(u64),
    /// The session was deleted and its last batch read.
    Closed,
}

/// Every followed session's ring.
#[derive(Default)]
pub struct Hub {
    rings: Mutex<HashMap<Arc<str>, Arc<Ring>>>,
}

struct Ring {
    state: Mutex<Slots>,
    published: Notify,
}

struct Slots {
    /// The number of the first batch in `slots` (batches are numbered from 0 as published).
    first: u64,
    slots: VecDeque<Slot>,
    followers: usize,
    /// The session was deleted: nothing more comes.
    closed: bool,
}

struct Slot {
    live: Live,
    /// Followers that have not read it yet.
    unread: usize,
}

impl Slots {
    /// Drops the batches every follower has read.
    fn release(&mut self) {
        while self.slots.front().is_some_and(|s| s.unread == 0) {
            self.slots.pop_front();
            self.first += 1;
        }
        if self.slots.is_empty() && self.slots.capacity() > KEPT_SLOTS {
            self.slots = VecDeque::new();
        }
    }

    fn push(&mut self, live: Live) {
        if self.slots.len() >= LIVE_BUFFER_BATCHES {
            self.slots.pop_front();
            self.first += 1;
        }
        self.slots.push_back(Slot {
            live,
            unread: self.followers,
        });
    }
}

/// One follower of a session: batches published after it started, in order.
pub struct Follower {
    ring: Arc<Ring>,
    session_id: Arc<str>,
    hub: Weak<Hub>,
    /// The number of the next batch it reads.
    next: u64,
}

impl Hub {
    /// A follower of the session, from the next batch published to it on.
    pub fn subscribe(self: &Arc<Self>, session_id: &str) -> Follower {
        let mut rings = self.rings.lock().unwrap_or_else(|p| p.into_inner());
        let ring = match rings.get(session_id) {
            Some(ring) => ring.clone(),
            None => {
                let ring = Arc::new(Ring {
                    state: Mutex::new(Slots {
                        first: 0,
                        slots: VecDeque::new(),
                        followers: 0,
                        closed: false,
                    }),
                    published: Notify::new(),
                });
                rings.insert(session_id.into(), ring.clone());
                ring
            }
        };
        let mut slots = ring.state.lock().unwrap_or_else(|p| p.into_inner());
        slots.followers += 1;
        let next = slots.first + slots.slots.len() as u64;
        drop(slots);
        Follower {
            session_id: session_id.into(),
            ring,
            hub: Arc::downgrade(self),
            next,
        }
    }

    /// Whether anyone follows the session live.
    pub fn follows(&self, session_id: &str) -> bool {
        let rings = self.rings.lock().unwrap_or_else(|p| p.into_inner());
        rings.contains_key(session_id)
    }

    /// Hands durable events of one session (at least one, ascending) to its followers;
    /// never blocks.
    pub fn publish(&self, events: Vec<KeptEvent>) {
        let Some(first) = events.first() else { return };
        let ring = {
            let rings = self.rings.lock().unwrap_or_else(|p| p.into_inner());
            match rings.get(first.session_id.as_str()) {
                Some(ring) => ring.clone(),
                None => return,
            }
        };
        ring.state
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(Live::Events(events.into()));
        ring.published.notify_waiters();
    }

    /// The session was deleted (durably): its followers are told, and its ring goes (a
    /// follower that subscribes later finds the tombstone instead).
    pub fn end(&self, session_id: &str) {
        let ring = self
            .rings
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(session_id);
        if let Some(ring) = ring {
            let mut slots = ring.state.lock().unwrap_or_else(|p| p.into_inner());
            slots.push(Live::Deleted);
            slots.closed = true;
            drop(slots);
            ring.published.notify_waiters();
        }
    }

    /// Sessions followed now (for the tests of the ring's memory).
    #[cfg(test)]
    fn rings(&self) -> usize {
        self.rings.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

impl Follower {
    /// The next batch; waits for one to be published.
    pub async fn recv(&mut self) -> Result<Live, RecvError> {
        let ring = self.ring.clone();
        loop {
            // Registered before looking, so that a batch published after the look wakes it.
            let published = ring.published.notified();
            tokio::pin!(published);
            published.as_mut().enable();
            if let Some(result) = self.try_recv() {
                return result;
            }
            published.await;
        }
    }

    fn try_recv(&mut self) -> Option<Result<Live, RecvError>> {
        let mut slots = self.ring.state.lock().unwrap_or_else(|p| p.into_inner());
        if self.next < slots.first {
            let skipped = slots.first - self.next;
            self.next = slots.first;
            return Some(Err(RecvError::Lagged(skipped)));
        }
        let at = (self.next - slots.first) as usize;
        if let Some(slot) = slots.slots.get_mut(at) {
            slot.unread -= 1;
            let live = slot.live.clone();
            self.next += 1;
            slots.release();
            return Some(Ok(live));
        }
        slots.closed.then_some(Err(RecvError::Closed))
    }
}

impl Drop for Follower {
    /// Gives up its share of the batches it had not read, and the ring goes with its last
    /// follower.
    fn drop(&mut self) {
        let last = {
            let mut slots = self.ring.state.lock().unwrap_or_else(|p| p.into_inner());
            let from = self.next.saturating_sub(slots.first) as usize;
            for slot in slots.slots.iter_mut().skip(from) {
                slot.unread -= 1;
            }
            slots.release();
            slots.followers -= 1;
            slots.followers == 0
        };
        let Some(hub) = self.hub.upgrade().filter(|_| last) else {
            return;
        };
        let mut rings = hub.rings.lock().unwrap_or_else(|p| p.into_inner());
        // Another follower may have come meanwhile (then the ring stays), or the session's
        // ring may be a newer one.
        let idle = rings.get(&self.session_id).is_some_and(|ring| {
            Arc::ptr_eq(ring, &self.ring)
                && ring
                    .state
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .followers
                    == 0
        });
        if idle {
            rings.remove(&self.session_id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batch(session: &str, seq: u64) -> Vec<KeptEvent> {
        vec![KeptEvent::new(agentlog_proto::v1::Event {
            session_id: session.into(),
            seq,
            ..Default::default()
        })]
    }

    fn seq_of(live: Live) -> u64 {
        match live {
            Live::Events(events) => events[0].seq,
            Live::Deleted => 0,
        }
    }

    fn buffered(hub: &Hub, session: &str) -> (usize, usize) {
        let rings = hub.rings.lock().unwrap();
        let slots = rings[session].state.lock().unwrap();
        (slots.slots.len(), slots.slots.capacity())
    }

    #[tokio::test]
    async fn an_idle_follower_holds_no_buffer_and_its_ring_goes_with_it() {
        let hub = Arc::new(Hub::default());
        let follower = hub.subscribe("s");
        assert!(hub.follows("s"));
        assert_eq!(
            buffered(&hub, "s"),
            (0, 0),
            "nothing allocated for a follower"
        );
        drop(follower);
        assert!(!hub.follows("s"));
        assert_eq!(hub.rings(), 0);
    }

    #[tokio::test]
    async fn a_batch_is_dropped_once_every_follower_read_it() {
        let hub = Arc::new(Hub::default());
        let mut a = hub.subscribe("s");
        let mut b = hub.subscribe("s");
        hub.publish(batch("s", 1));
        hub.publish(batch("s", 2));
        assert_eq!(seq_of(a.recv().await.unwrap()), 1);
        assert_eq!(seq_of(a.recv().await.unwrap()), 2);
        assert_eq!(buffered(&hub, "s").0, 2, "b has read neither");
        assert_eq!(seq_of(b.recv().await.unwrap()), 1);
        assert_eq!(buffered(&hub, "s").0, 1);
        drop(b);
        assert_eq!(buffered(&hub, "s").0, 0, "b's share goes with it");
        // A follower that comes later starts with the next batch.
        let mut c = hub.subscribe("s");
        hub.publish(batch("s", 3));
        assert_eq!(seq_of(c.recv().await.unwrap()), 3);
        assert_eq!(seq_of(a.recv().await.unwrap()), 3);
        assert_eq!(buffered(&hub, "s").0, 0);
    }

    #[tokio::test]
    async fn a_follower_lags_only_past_the_full_buffer_and_the_ring_shrinks_after() {
        let hub = Arc::new(Hub::default());
        let mut slow = hub.subscribe("s");
        let mut quick = hub.subscribe("s");
        let total = LIVE_BUFFER_BATCHES as u64 + 10;
        for seq in 1..=total {
            hub.publish(batch("s", seq));
            assert_eq!(seq_of(quick.recv().await.unwrap()), seq);
        }
        assert_eq!(buffered(&hub, "s").0, LIVE_BUFFER_BATCHES);
        assert_eq!(slow.recv().await.unwrap_err(), RecvError::Lagged(10));
        for seq in 11..=total {
            assert_eq!(seq_of(slow.recv().await.unwrap()), seq);
        }
        assert_eq!(buffered(&hub, "s"), (0, 0), "the buffer is given back");
        // One batch short of the buffer: nobody lags.
        for seq in total + 1..total + LIVE_BUFFER_BATCHES as u64 {
            hub.publish(batch("s", seq));
        }
        assert_eq!(seq_of(slow.recv().await.unwrap()), total + 1);
    }

    #[tokio::test]
    async fn a_deletion_is_the_last_word_and_a_waiting_follower_wakes() {
        let hub = Arc::new(Hub::default());
        let mut follower = hub.subscribe("s");
        let waiting = tokio::spawn(async move {
            let first = follower.recv().await.map(seq_of);
            let second = follower.recv().await.map(seq_of);
            let third = follower.recv().await.map(seq_of);
            (first, second, third)
        });
        tokio::task::yield_now().await;
        hub.publish(batch("s", 1));
        hub.end("s");
        assert!(!hub.follows("s"));
        let (first, second, third) = waiting.await.unwrap();
        assert_eq!(first, Ok(1));
        assert_eq!(second, Ok(0), "Deleted");
        assert_eq!(third, Err(RecvError::Closed));
    }
}
