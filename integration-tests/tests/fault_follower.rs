//! A reconnecting follower cut off at random points: `agentlog --json tail` follows a
//! session through a TCP proxy that resets every connection at random moments — during
//! the history replay and while new events are being appended — and must end with exactly
//! the full log, byte-identical to a fresh read (`agentlog --json show` straight to the
//! store): nothing shown twice, nothing missed, nothing out of order.

mod fault_support;

use std::time::Duration;

use agentlog_proto::v1::AppendRequest;
use fault_support::{agentlog, CliProc, Faults, TcpProxy};
use integration_tests::{poll_until, user_event, Store};

const SESSION: &str = "follow-me";

/// A text of varied length and content (multi-byte characters included).
fn text(i: usize) -> String {
    let len = 50 + (i * 7919) % 1500;
    let mut t = format!("event {i}: ");
    while t.len() < len {
        t.push_str("naïve café — ✓ ");
    }
    t
}

#[tokio::test(flavor = "multi_thread")]
async fn a_follower_reset_at_random_points_ends_with_exactly_the_full_log() {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    let proxy = TcpProxy::start(store.addr).await;
    let faults = Faults::default();

    // Some history first, so that resets also land in the middle of the replay.
    let mut appended = 0usize;
    for _ in 0..10 {
        let events = (0..60)
            .map(|k| user_event("", &text(appended + k)))
            .collect();
        appended += 60;
        client
            .append(AppendRequest {
                session_id: SESSION.into(),
                events,
                ..AppendRequest::default()
            })
            .await
            .expect("append history");
    }

    let tail = CliProc::spawn(&["--json", "--addr", &proxy.url(), "tail", SESSION]);

    // Reset every connection through the proxy at random moments while events keep coming.
    let resetter = {
        let faults = faults.clone();
        let proxy_resets = std::sync::Arc::new(proxy);
        let proxy = proxy_resets.clone();
        let task = tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(fastrand::u64(20..250))).await;
                proxy.reset_all();
                faults.add("connection_reset");
            }
        });
        (task, proxy_resets)
    };
    for _ in 0..60 {
        let n = fastrand::usize(1..40);
        let events = (0..n)
            .map(|k| user_event("", &text(appended + k)))
            .collect();
        appended += n;
        client
            .append(AppendRequest {
                session_id: SESSION.into(),
                events,
                ..AppendRequest::default()
            })
            .await
            .expect("append live");
        tokio::time::sleep(Duration::from_millis(fastrand::u64(0..60))).await;
    }
    // Keep resetting a little past the last append, then let the follower finish.
    tokio::time::sleep(Duration::from_millis(300)).await;
    resetter.0.abort();

    let total = appended;
    poll_until(
        "the follower shows every event",
        Duration::from_secs(60),
        || (tail.lines().len() >= total).then_some(()),
    );
    // A moment more: anything shown twice would arrive now.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let followed = tail.stdout();
    let reconnects = tail.stderr().matches("reconnected").count();
    drop(tail);

    let fresh = agentlog(&["--json", "--addr", &store.url(), "show", SESSION]);
    assert!(fresh.status.success(), "show failed: {fresh:?}");
    let fresh = String::from_utf8(fresh.stdout).expect("utf-8");
    assert_eq!(
        fresh.lines().count(),
        total,
        "the fresh read has every event"
    );
    let seqs: Vec<u64> = followed
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).expect("a JSON line");
            integration_tests::json_u64(&v["seq"])
        })
        .collect();
    assert_eq!(
        seqs,
        (1..=total as u64).collect::<Vec<_>>(),
        "every seq exactly once, in order"
    );
    assert!(
        followed == fresh,
        "the followed log is byte-identical to a fresh read"
    );
    let resets = faults.count("connection_reset");
    assert!(resets >= 5, "too few resets were injected: {resets}");
    assert!(reconnects >= 1, "the follower never had to reconnect");
    faults.report(
        "a_follower_reset_at_random_points_ends_with_exactly_the_full_log",
        &format!(
            "{total} events followed across {reconnects} reconnects, byte-identical to a fresh read"
        ),
    );
}
