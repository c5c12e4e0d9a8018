//! How the store wakes its background threads (retention, reclamation, the search indexer):
//! to stop for good, or to look for work now. The writer nudges them after commits; they
//! hold nothing of the writer's.

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

/// Wakes one background thread: to stop (for good), or to look for work now.
#[derive(Clone, Default)]
pub struct Signal(Arc<(Mutex<Woken>, Condvar)>);

#[derive(Default)]
struct Woken {
    stopped: bool,
    nudged: bool,
    /// A thread is in [`Signal::wait`], which a nudge ends.
    waiting: bool,
}

impl Signal {
    pub fn stop(&self) {
        let (woken, wake) = &*self.0;
        woken.lock().unwrap_or_else(|p| p.into_inner()).stopped = true;
        wake.notify_all();
    }

    /// There may be work: the thread's wait ends now. The writer nudges after every commit,
    /// before it answers: the condvar is woken (a `futex` call, ~1 µs of an append's
    /// latency) only when a thread waits for a nudge that it has not had yet.
    pub fn nudge(&self) {
        let (woken, wake) = &*self.0;
        let mut woken = woken.lock().unwrap_or_else(|p| p.into_inner());
        let wakes = woken.waiting && !woken.nudged;
        woken.nudged = true;
        drop(woken);
        if wakes {
            wake.notify_all();
        }
    }

    /// Waits up to `wait`, or until nudged or stopped; whether the store is stopping.
    pub fn wait(&self, wait: Duration) -> bool {
        let (woken, wake) = &*self.0;
        let mut guard = woken.lock().unwrap_or_else(|p| p.into_inner());
        guard.waiting = true;
        let (mut guard, _) = wake
            .wait_timeout_while(guard, wait, |w| !w.stopped && !w.nudged)
            .unwrap_or_else(|p| p.into_inner());
        guard.waiting = false;
        guard.nudged = false;
        guard.stopped
    }

    /// Waits up to `wait`, or until stopped (a nudge does not end it); whether the store is
    /// stopping.
    pub fn rest(&self, wait: Duration) -> bool {
        let (woken, wake) = &*self.0;
        let guard = woken.lock().unwrap_or_else(|p| p.into_inner());
        let (guard, _) = wake
            .wait_timeout_while(guard, wait, |w| !w.stopped)
            .unwrap_or_else(|p| p.into_inner());
        guard.stopped
    }

    pub fn is_stopped(&self) -> bool {
        self.0 .0.lock().unwrap_or_else(|p| p.into_inner()).stopped
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::Signal;

    /// Long enough that a wait which ends did so because it was woken (a lost wake-up hangs
    /// the test instead).
    const FOREVER: Duration = Duration::from_secs(3600);

    fn waiting(signal: &Signal) -> bool {
        signal.0 .0.lock().unwrap().waiting
    }

    fn wait_in_thread(signal: &Signal) -> std::thread::JoinHandle<bool> {
        let waiter = signal.clone();
        let thread = std::thread::spawn(move || waiter.wait(FOREVER));
        while !waiting(signal) {
            std::thread::yield_now();
        }
        thread
    }

    #[test]
    fn a_nudge_ends_the_wait_in_progress_or_else_the_next_one() {
        let signal = Signal::default();
        signal.nudge();
        signal.nudge();
        assert!(!signal.wait(FOREVER), "nudged before it waited: no wait");

        let waiter = wait_in_thread(&signal);
        signal.nudge();
        assert!(!waiter.join().unwrap(), "woken by the nudge, not stopping");

        let waiter = wait_in_thread(&signal);
        signal.stop();
        assert!(waiter.join().unwrap(), "woken by the stop");
    }
}
