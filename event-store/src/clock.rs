//! The store's wall clock: event timestamps, lease expiry and retention all read it, so a
//! test that moves it moves them together.
//!
//! Test-only: with `AGENTLOG_TEST_CLOCK_FILE=PATH` the binary runs its clock ahead of the
//! system's by the signed number of milliseconds in that file, re-read every 100 ms (see
//! [`follow_offset_file`]); `integration-tests/tests/store_retention.rs` jumps a store a
//! month ahead this way. Without it (always, in production) the clock is the system's.

use std::path::PathBuf;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

/// How far ahead of the system clock the store's clock runs (0 but in tests).
static OFFSET_MS: AtomicI64 = AtomicI64::new(0);

/// Milliseconds since the Unix epoch, by the store's clock.
pub fn now_unix_ms() -> i64 {
    let system = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64);
    system.saturating_add(OFFSET_MS.load(Ordering::Relaxed))
}

/// Runs the store's clock `offset_ms` ahead of the system's (test-only).
pub fn set_offset_ms(offset_ms: i64) {
    OFFSET_MS.store(offset_ms, Ordering::Relaxed);
}

/// Keeps the clock's offset at the number in `path` (read now, then every 100 ms, for the
/// life of the process); a missing or unreadable file means 0. Test-only.
pub fn follow_offset_file(path: PathBuf) {
    let read = move || {
        std::fs::read_to_string(&path)
            .ok()
            .and_then(|s| s.trim().parse::<i64>().ok())
            .unwrap_or(0)
    };
    set_offset_ms(read());
    std::thread::Builder::new()
        .name("test-clock".into())
        .spawn(move || loop {
            std::thread::sleep(Duration::from_millis(100));
            set_offset_ms(read());
        })
        .expect("a thread for the test clock");
}
