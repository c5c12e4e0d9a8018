//! A stalled subscriber: a grpcurl follower is frozen with SIGSTOP (it reads nothing; its
//! socket and HTTP/2 windows fill up) while 10,000 events of 2 KiB are appended. The
//! appends complete, two other live subscribers receive every event, and after SIGCONT the
//! stalled one catches up completely: every seq once, in order.

mod fault_support;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use agentlog_proto::v1::{AppendRequest, SubscribeRequest};
use fault_support::Faults;
use integration_tests::{json_seqs, poll_until, signal, user_event, GrpcurlChild, Signal, Store};
use tokio_stream::StreamExt;

const SESSION: &str = "firehose";
const EVENTS: u64 = 10_000;
const BATCH: u64 = 100;
const WRITERS: u64 = 4;

#[tokio::test(flavor = "multi_thread")]
async fn a_stalled_subscriber_slows_nothing_and_then_catches_up() {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    let faults = Faults::default();
    // seq 1, so that the stalled subscriber is surely subscribed before it is frozen.
    client
        .append(AppendRequest {
            session_id: SESSION.into(),
            events: vec![user_event("first", "the first event")],
            ..AppendRequest::default()
        })
        .await
        .expect("append the first event");

    let mut stalled = GrpcurlChild::spawn(
        store.addr,
        &["-max-time", "300", "-max-msg-sz", "67108864"],
        "agentlog.v1.EventStore/Subscribe",
        &format!(r#"{{"session_id":"{SESSION}","from_seq":1,"follow":true}}"#),
    );
    stalled.wait_for_messages(1, Duration::from_secs(30));
    signal(stalled.pid(), Signal::SIGSTOP);
    faults.add("subscriber_sigstop");

    // Two live subscribers, each on its own connection, each counting what it has seen.
    let mut live = Vec::new();
    for _ in 0..2 {
        let mut client = store.client().await.expect("client");
        let seen = Arc::new(AtomicU64::new(0));
        let counter = seen.clone();
        let task = tokio::spawn(async move {
            let mut stream = client
                .subscribe(SubscribeRequest {
                    session_id: SESSION.into(),
                    from_seq: 1,
                    follow: true,
                })
                .await
                .expect("subscribe")
                .into_inner();
            while let Some(event) = stream.next().await {
                let event = event.expect("live event");
                let expected = counter.load(Ordering::SeqCst) + 1;
                assert_eq!(event.seq, expected, "live subscriber: gapless, in order");
                counter.store(event.seq, Ordering::SeqCst);
            }
        });
        live.push((seen, task));
    }

    // 10,000 events of 2 KiB: 4 concurrent writers, batches of 100.
    let payload = "x".repeat(2048);
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let mut client = store.client().await.expect("client");
        let payload = payload.clone();
        writers.push(tokio::spawn(async move {
            for b in 0..EVENTS / BATCH / WRITERS {
                let events = (0..BATCH)
                    .map(|i| user_event(&format!("w{w}-b{b}-{i}"), &payload))
                    .collect();
                client
                    .append(AppendRequest {
                        session_id: SESSION.into(),
                        events,
                        ..AppendRequest::default()
                    })
                    .await
                    .expect("append while a subscriber is stalled");
            }
        }));
    }
    for writer in writers {
        writer.await.expect("writer");
    }
    let last = EVENTS + 1;
    poll_until(
        "the live subscribers to see every event while one is stalled",
        Duration::from_secs(60),
        || {
            live.iter()
                .all(|(seen, _)| seen.load(Ordering::SeqCst) == last)
                .then_some(())
        },
    );
    assert!(!stalled.exited(), "the stalled subscriber is still there");

    signal(stalled.pid(), Signal::SIGCONT);
    stalled.wait_for_output(&format!("\"seq\": \"{last}\""), Duration::from_secs(120));
    let seqs = json_seqs(&stalled.messages());
    assert_eq!(
        seqs,
        (1..=last).collect::<Vec<_>>(),
        "the stalled subscriber caught up with every event, once, in order"
    );
    for (_, task) in live {
        task.abort();
    }
    faults.report(
        "a_stalled_subscriber_slows_nothing_and_then_catches_up",
        &format!("{EVENTS} appends acknowledged, 2 live subscribers kept up, the stalled one caught up on all {last}"),
    );
}
