//! A stop (the store's shutdown, the cut of the connections it leaves open) cheap enough
//! to check on every read and write of every connection.
//!
//! Polling a `CancellationToken`'s future takes the token's lock and registers the task's
//! waker, each time: 3% of an append's CPU when every read and write of every connection
//! and every AppendStream request did it (bench/RESULTS.md, "The store's own work over the
//! durable floor"). A [`StopCheck`] reads a flag instead, and where its caller is about to
//! wait it also leaves the task's waker in an `AtomicWaker` (one compare-and-swap while the
//! waker stays the same), which the stop wakes. The flag is set by a task that waits for
//! the token, so it follows any cancel of the token, from wherever, within a moment; until
//! then a read or write that goes on goes through, as one begun just before the stop would
//! have.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::task::Context;

use futures::task::AtomicWaker;
use tokio_util::sync::CancellationToken;

/// A stop that [`StopCheck`]s see.
#[derive(Clone)]
pub struct Stop {
    token: CancellationToken,
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    stopped: AtomicBool,
    /// The checks' wakers, while their checks live.
    waiting: Mutex<Vec<Weak<AtomicWaker>>>,
}

impl Stop {
    /// Follows `token`. Needs the runtime: it spawns the task that waits for the token.
    pub fn following(token: CancellationToken) -> Stop {
        let shared = Arc::new(Shared::default());
        let (waited, stopping) = (token.clone(), shared.clone());
        tokio::spawn(async move {
            waited.cancelled().await;
            stopping.stopped.store(true, Ordering::SeqCst);
            let waiting = std::mem::take(&mut *lock(&stopping.waiting));
            for waker in waiting.iter().filter_map(Weak::upgrade) {
                waker.wake();
            }
        });
        Stop { token, shared }
    }

    pub fn token(&self) -> &CancellationToken {
        &self.token
    }

    /// A check of this stop, for one connection or stream.
    pub fn check(&self) -> StopCheck {
        let waker = Arc::new(AtomicWaker::new());
        let mut waiting = lock(&self.shared.waiting);
        // Forget the checks gone since the list last doubled: it stays within twice the
        // live ones.
        if waiting.len() >= 64 && waiting.len().is_power_of_two() {
            waiting.retain(|w| w.strong_count() > 0);
        }
        waiting.push(Arc::downgrade(&waker));
        StopCheck {
            shared: self.shared.clone(),
            waker,
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// One connection's or stream's view of a [`Stop`].
pub struct StopCheck {
    shared: Arc<Shared>,
    waker: Arc<AtomicWaker>,
}

impl StopCheck {
    /// Whether the stop came, for a path that goes on.
    pub fn stopped(&self) -> bool {
        self.shared.stopped.load(Ordering::SeqCst)
    }

    /// Whether the stop came, for a path about to wait: if not, the task of `cx` is woken
    /// when it does.
    pub fn poll_stopped(&self, cx: &mut Context<'_>) -> bool {
        self.waker.register(cx.waker());
        self.stopped()
    }
}

#[cfg(test)]
mod tests {
    use std::task::Poll;
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn a_waiting_check_is_woken_by_the_stop() {
        let token = CancellationToken::new();
        let stop = Stop::following(token.clone());
        // Checks that come and go leave no trace behind.
        for _ in 0..1000 {
            drop(stop.check());
        }
        assert!(lock(&stop.shared.waiting).len() <= 64);
        let check = stop.check();
        assert!(!check.stopped());
        let waited = tokio::spawn(async move {
            std::future::poll_fn(|cx| {
                if check.poll_stopped(cx) {
                    Poll::Ready(())
                } else {
                    Poll::Pending
                }
            })
            .await
        });
        tokio::task::yield_now().await;
        token.cancel();
        tokio::time::timeout(Duration::from_secs(5), waited)
            .await
            .expect("woken by the stop")
            .expect("the waiting task");
        assert!(stop.check().stopped());
    }
}
