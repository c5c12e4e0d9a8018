//! Crash: the real `event-store`, SIGKILLed again and again while several clients append
//! concurrently, each restart recovering from what is on disk. After every restart:
//! - every acknowledged append is there, at the seq it was acknowledged with;
//! - every session's seqs are gapless from 1, and GetSession agrees with the log;
//! - re-sending every unacknowledged append with its event_ids never duplicates an event
//!   (what made it to the log comes back with its seq, the rest is appended once).
//!
//! SIGKILL ends the process, not the machine: whatever the store handed to the kernel with
//! `write` is in the page cache and survives. So here even DURABILITY_BUFFERED appends,
//! acknowledged only after their `write` returned, must survive; losing unsynced bytes is
//! power loss, which event-store/tests/power_loss.rs simulates through the storage trait.

use std::collections::HashMap;
use std::time::Duration;

use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::{AppendRequest, Durability, GetSessionRequest};
use integration_tests::{read_log, user_event, Store};
use tonic::transport::Channel;
use tonic::Code;

const SESSIONS: [&str; 3] = ["crash-a", "crash-b", "crash-c"];
const CLIENTS: usize = 8;
const KILLS: usize = 9;
/// A client stops by itself after this many appends if the kill never came (it always does).
const MAX_APPENDS_PER_CLIENT: usize = 5_000;

/// One append as a client sent it.
#[derive(Clone, Debug)]
struct Attempt {
    session: &'static str,
    ids: Vec<String>,
    durability: Durability,
}

impl Attempt {
    fn request(&self) -> AppendRequest {
        AppendRequest {
            session_id: self.session.to_string(),
            events: self.ids.iter().map(|id| user_event(id, id)).collect(),
            durability: self.durability as i32,
            ..Default::default()
        }
    }
}

/// What the clients were told, across every kill.
#[derive(Default)]
struct Ledger {
    /// event_id → (session, seq) as acknowledged: must survive SIGKILL.
    acked: HashMap<String, (&'static str, u64)>,
    /// Sent but never acknowledged (the store died under them).
    unacked: Vec<Attempt>,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn acknowledged_appends_survive_repeated_sigkill() {
    let seed = std::env::var("CRASH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(0xc4a5_4000);
    eprintln!("CRASH_SEED={seed}");
    let mut rng = fastrand::Rng::with_seed(seed);
    let data = tempfile::tempdir().expect("temp dir");
    let mut store = Store::start_in(data.path()).expect("start event-store");
    let listen = store.addr.to_string();
    let mut ledger = Ledger::default();

    for kill in 0..KILLS {
        // Load: every client appends 1-3 events at a time, a quarter of them BUFFERED, to
        // a random session, until the store stops answering.
        let mut clients = Vec::new();
        for c in 0..CLIENTS {
            let mut client = store.client().await.expect("connect");
            let mut rng = fastrand::Rng::with_seed(rng.u64(..));
            clients.push(tokio::spawn(async move {
                let mut acked = Vec::new();
                for i in 0..MAX_APPENDS_PER_CLIENT {
                    let attempt = Attempt {
                        session: SESSIONS[rng.usize(..SESSIONS.len())],
                        ids: (0..rng.usize(1..=3))
                            .map(|k| format!("k{kill}-c{c}-{i}-{k}"))
                            .collect(),
                        durability: if rng.u8(0..4) == 0 {
                            Durability::Buffered
                        } else {
                            Durability::Sync
                        },
                    };
                    match client.append(attempt.request()).await {
                        Ok(resp) => acked.push((attempt, resp.into_inner().seqs)),
                        Err(status) => {
                            assert_transport_failure(&status);
                            return (acked, Some(attempt));
                        }
                    }
                }
                (acked, None)
            }));
        }
        tokio::time::sleep(Duration::from_millis(rng.u64(100..400))).await;
        store.kill9();

        for client in clients {
            let (acked, failed) = client.await.expect("client task");
            for (attempt, seqs) in acked {
                assert_eq!(seqs.len(), attempt.ids.len(), "one seq per event");
                for (id, seq) in attempt.ids.into_iter().zip(seqs) {
                    ledger.acked.insert(id, (attempt.session, seq));
                }
            }
            ledger.unacked.extend(failed);
        }

        // Same data dir, same address: what a supervisor's restart does.
        store = Store::start_on(data.path(), &listen).expect("restart event-store");
        let mut client = store.client().await.expect("connect after restart");
        let unacked = ledger.unacked.len();
        let reached =
            check_after_restart(&mut client, &mut ledger, &format!("after kill {kill}")).await;
        eprintln!(
            "kill {kill}: {} events acknowledged so far; {unacked} appends cut off, {reached} \
             of which had reached the log",
            ledger.acked.len()
        );
    }
    eprintln!(
        "{KILLS} SIGKILLs survived with {} events acknowledged",
        ledger.acked.len()
    );
}

/// A client's append may fail only because the store died under it, never with a verdict
/// on the request itself.
fn assert_transport_failure(status: &tonic::Status) {
    assert!(
        matches!(
            status.code(),
            Code::Unavailable | Code::Unknown | Code::Cancelled | Code::Internal
        ),
        "an append failed for a reason other than the kill: {status:?}"
    );
}

/// Checks the restarted store against the ledger, re-sends every unacknowledged append,
/// then checks that the log holds exactly the ledger. Returns how many unacknowledged
/// appends had (at least partly) reached the log.
async fn check_after_restart(
    client: &mut EventStoreClient<Channel>,
    ledger: &mut Ledger,
    context: &str,
) -> usize {
    let found = read_all(client, context).await;
    for (id, place) in &ledger.acked {
        assert_eq!(
            found.get(id),
            Some(place),
            "{context}: acknowledged event {id} is not where it was acknowledged"
        );
    }

    let mut reached = 0;
    // A BUFFERED re-send is acknowledged once written, before its fsync; readers see it
    // only after: the highest seq of each session acknowledged that way.
    let mut buffered: HashMap<&'static str, u64> = HashMap::new();
    for attempt in std::mem::take(&mut ledger.unacked) {
        reached += usize::from(attempt.ids.iter().any(|id| found.contains_key(id)));
        let resp = client
            .append(attempt.request())
            .await
            .unwrap_or_else(|e| panic!("{context}: re-sending {:?}: {e}", attempt.ids))
            .into_inner();
        for (id, seq) in attempt.ids.iter().zip(resp.seqs) {
            if let Some(at) = found.get(id) {
                assert_eq!(
                    *at,
                    (attempt.session, seq),
                    "{context}: re-sent {id} must come back with its seq"
                );
            }
            ledger.acked.insert(id.clone(), (attempt.session, seq));
            if attempt.durability == Durability::Buffered {
                let highest = buffered.entry(attempt.session).or_default();
                *highest = (*highest).max(seq);
            }
        }
    }
    for (session, seq) in buffered {
        wait_until_readable(client, session, seq, context).await;
    }

    let found = read_all(client, context).await;
    assert_eq!(
        found.len(),
        ledger.acked.len(),
        "{context}: the log holds each event ever sent exactly once"
    );
    for (id, place) in &ledger.acked {
        assert_eq!(
            found.get(id),
            Some(place),
            "{context}: event {id} after re-sends"
        );
    }
    reached
}

/// Waits (a few seconds at most) until `session`'s events through `seq` are readable: the
/// fsync a BUFFERED acknowledgement promises follows within milliseconds.
async fn wait_until_readable(
    client: &mut EventStoreClient<Channel>,
    session: &str,
    seq: u64,
    context: &str,
) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let info = client
            .get_session(GetSessionRequest {
                session_id: session.to_string(),
            })
            .await
            .unwrap_or_else(|e| panic!("{context}: GetSession({session}): {e}"))
            .into_inner();
        if info.last_seq >= seq {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{context}: {session} seq {seq} was acknowledged BUFFERED and is still not \
             readable (last_seq {})",
            info.last_seq
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

/// Reads every session back: gapless from 1, each event_id once, GetSession in step.
/// Returns event_id → (session, seq).
async fn read_all(
    client: &mut EventStoreClient<Channel>,
    context: &str,
) -> HashMap<String, (&'static str, u64)> {
    let mut found = HashMap::new();
    for session in SESSIONS {
        let events = read_log(client, session).await;
        for (i, event) in events.iter().enumerate() {
            assert_eq!(event.seq, i as u64 + 1, "{context}: {session} has a gap");
            let twice = found.insert(event.event_id.clone(), (session, event.seq));
            assert_eq!(
                twice, None,
                "{context}: event {} is in the log twice",
                event.event_id
            );
        }
        let last_seq = match client
            .get_session(GetSessionRequest {
                session_id: session.to_string(),
            })
            .await
        {
            Ok(info) => info.into_inner().last_seq,
            Err(status) if status.code() == Code::NotFound => 0,
            Err(status) => panic!("{context}: GetSession({session}): {status:?}"),
        };
        assert_eq!(
            last_seq,
            events.len() as u64,
            "{context}: GetSession({session}).last_seq vs. the log"
        );
    }
    found
}
