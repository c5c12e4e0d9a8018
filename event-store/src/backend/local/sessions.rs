//! The writer's sessions: a cache of the states it decides against, bounded in bytes
//! (`event-store --session-cache`), over the index, which holds every session's state.
//!
//! The writer loads a session's state before it decides an op of that session
//! ([`Sessions::load`]) and changes it in place. A state changed since the index last
//! absorbed is the only copy of that change outside the log, so the cache gives back room
//! only right after an absorb ([`Sessions::shrink`]), when every state it holds is also in
//! the index; until then it may run over its budget by what one absorb window touched.
//! An idle session therefore costs the store no memory: only its entries in the index.

use std::collections::HashMap;

use crate::backend::local::index::{Index, IndexError};
use crate::session::{shrink_cache, SessionMeta};

/// `--session-cache` when not given.
pub const DEFAULT_CACHE_BYTES: usize = 64 << 20;

pub struct Sessions {
    states: HashMap<String, SessionMeta>,
    index: Index,
    /// What `states` takes, by [`cost`].
    bytes: usize,
    budget: usize,
}

fn cost(session_id: &str, meta: &SessionMeta) -> usize {
    meta.cached_bytes(session_id)
}

impl Sessions {
    pub fn new(index: Index, budget: usize) -> Sessions {
        Sessions {
            states: HashMap::new(),
            index,
            bytes: 0,
            budget,
        }
    }

    /// Makes sure the session's state is at hand, if the session exists.
    pub fn load(&mut self, session_id: &str) -> Result<(), IndexError> {
        if self.states.contains_key(session_id) {
            return Ok(());
        }
        if let Some(meta) = self.index.session(session_id)? {
            self.bytes += cost(session_id, &meta);
            self.states.insert(session_id.to_string(), meta);
        }
        Ok(())
    }

    /// The state of a session [`Sessions::load`]ed in this batch, if it exists.
    pub fn get(&self, session_id: &str) -> Option<&SessionMeta> {
        self.states.get(session_id)
    }

    /// Changes a loaded session's state (a new one starts empty).
    pub fn update<T>(&mut self, session_id: &str, f: impl FnOnce(&mut SessionMeta) -> T) -> T {
        let (meta, before) = match self.states.get_mut(session_id) {
            Some(meta) => {
                let before = cost(session_id, meta);
                (meta, before)
            }
            None => (self.states.entry(session_id.to_string()).or_default(), 0),
        };
        let out = f(meta);
        self.bytes = self.bytes - before.min(self.bytes) + cost(session_id, meta);
        out
    }

    /// Right after an absorb (every state here is in the index): gives back states until
    /// the cache is within three quarters of its budget, so that it does not do so at
    /// every absorb. Which ones go is the map's order: a hot session that goes is read
    /// back at its next op.
    pub fn shrink(&mut self) {
        self.bytes = shrink_cache(&mut self.states, self.bytes, self.budget, |m| m);
    }

    /// The states at hand, for the index's absorb (it writes those its batch touched) and
    /// the published view.
    pub fn states(&self) -> &HashMap<String, SessionMeta> {
        &self.states
    }

    #[cfg(test)]
    fn bytes(&self) -> usize {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use agentlog_proto::v1::Event;

    use super::*;
    use crate::backend::local::index::IndexBatch;
    use crate::backend::local::log::{LogTail, Position, Record};

    #[test]
    fn the_cache_gives_back_room_after_an_absorb_and_reads_back_what_it_gave_up() {
        let dir = tempfile::tempdir().unwrap();
        let index = Index::open(dir.path()).unwrap();
        let mut sessions = Sessions::new(index.clone(), 10_000);
        let mut batch = IndexBatch::default();
        for i in 0..1000u64 {
            let id = format!("s-{i}");
            let event = Event {
                session_id: id.clone(),
                seq: 1,
                event_id: format!("e-{i}"),
                ts_unix_ms: i as i64,
                ..Default::default()
            };
            sessions.update(&id, |m| m.apply_event(&event));
            let position = Position {
                offset: i * 100,
                len: 100,
            };
            batch.add(position, &Record::Event(event.into()));
        }
        assert!(sessions.bytes() > 10_000, "over budget until the absorb");
        index
            .apply(
                batch,
                sessions.states(),
                LogTail {
                    end: 100_000,
                    last_record: None,
                },
            )
            .unwrap();
        sessions.shrink();
        assert!(sessions.bytes() <= 7_500, "{}", sessions.bytes());
        assert!(sessions.states().len() < 1000);
        for i in [0u64, 500, 999] {
            let id = format!("s-{i}");
            sessions.load(&id).unwrap();
            let meta = sessions.get(&id).expect("read back from the index");
            assert_eq!((meta.last_seq, meta.updated_unix_ms), (1, i as i64));
        }
        sessions.load("never-was").unwrap();
        assert!(sessions.get("never-was").is_none());
    }
}
