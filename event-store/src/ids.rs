//! The random part of the ids the store makes for events appended without one.
//!
//! Drawn from the operating system's source 4 KiB at a time, per thread: one `getrandom`
//! call per 256 ids rather than one per id (the call was an eighth of the local writer's
//! time, and one in a hundred samples of a PostgreSQL-backed store, when every event came
//! without an id).

use std::cell::RefCell;

thread_local! {
    static POOL: RefCell<Pool> = RefCell::new(Pool::default());
}

/// A random (version 4) UUID.
pub fn random_uuid() -> uuid::Uuid {
    POOL.with(|pool| pool.borrow_mut().uuid_v4())
}

struct Pool {
    bytes: Box<[u8; 4096]>,
    used: usize,
}

impl Default for Pool {
    fn default() -> Pool {
        let bytes = Box::new([0; 4096]);
        // Nothing drawn yet: the first id fills the pool.
        let used = bytes.len();
        Pool { bytes, used }
    }
}

impl Pool {
    fn uuid_v4(&mut self) -> uuid::Uuid {
        if self.used + 16 > self.bytes.len() {
            ring::rand::SecureRandom::fill(&ring::rand::SystemRandom::new(), &mut self.bytes[..])
                .expect("the operating system's random source works");
            self.used = 0;
        }
        let mut bytes = [0; 16];
        bytes.copy_from_slice(&self.bytes[self.used..self.used + 16]);
        self.used += 16;
        uuid::Builder::from_random_bytes(bytes).into_uuid()
    }
}

#[cfg(test)]
mod tests {
    use super::random_uuid;

    #[test]
    fn the_ids_random_parts_are_version_4_uuids_and_never_repeat() {
        // Several refills of the pool.
        let ids: Vec<uuid::Uuid> = (0..1_000).map(|_| random_uuid()).collect();
        assert!(ids.iter().all(|id| id.get_version_num() == 4));
        let distinct: std::collections::HashSet<_> = ids.iter().collect();
        assert_eq!(distinct.len(), ids.len());
    }
}
