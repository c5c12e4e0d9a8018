//! Leases and ClaimSession against the real `event-store`, driven with grpcurl: acquire,
//! renew, release; fencing (a holder whose lease expired and was re-granted can neither
//! write nor renew); runner-written kinds need the current epoch; and ClaimSession hands
//! each runnable session to exactly one claimant, again after a lease expires, never an
//! idle one.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use agentlog_proto::reason::Reason;
use agentlog_proto::v1::{
    event, AcquireLeaseRequest, AppendRequest, ClaimSessionRequest, Event, GetSessionRequest,
    ReleaseLeaseRequest, RenewLeaseRequest, ToolResult,
};
use integration_tests::{
    grpcurl, json_u64, poll_until, user_event, GrpcurlChild, GrpcurlOutput, Store,
};
use serde_json::{json, Value};

const BOUND: Duration = Duration::from_secs(60);

fn call(store: &Store, method: &str, request: Value) -> GrpcurlOutput {
    grpcurl(
        store.addr,
        &format!("agentlog.v1.EventStore/{method}"),
        Some(&request.to_string()),
    )
}

fn user_message(store: &Store, session_id: &str, text: &str) {
    call(
        store,
        "Append",
        json!({ "session_id": session_id, "events": [{ "user_message": { "text": text } }] }),
    )
    .json();
}

fn acquire(store: &Store, session_id: &str, owner: &str, ttl_ms: u64) -> GrpcurlOutput {
    call(
        store,
        "AcquireLease",
        json!({ "session_id": session_id, "owner": owner, "ttl_ms": ttl_ms }),
    )
}

fn renew(store: &Store, session_id: &str, owner: &str, epoch: u64, ttl_ms: u64) -> GrpcurlOutput {
    call(
        store,
        "RenewLease",
        json!({ "session_id": session_id, "owner": owner, "epoch": epoch, "ttl_ms": ttl_ms }),
    )
}

/// Appends one runner-written event under `epoch`.
fn runner_append(store: &Store, session_id: &str, epoch: u64, event: Value) -> GrpcurlOutput {
    call(
        store,
        "Append",
        json!({ "session_id": session_id, "lease_epoch": epoch, "events": [event] }),
    )
}

fn tool_result(id: &str) -> Value {
    json!({ "tool_result": { "tool_use_id": id, "content": "ok" } })
}

fn final_reply() -> Value {
    json!({ "assistant_message": { "content": [{ "text": { "text": "done" } }], "stop_reason": "end_turn" } })
}

fn tool_use_reply(id: &str) -> Value {
    json!({ "assistant_message": {
        "content": [{ "tool_use": { "id": id, "name": "bash", "input": { "command": "ls" } } }],
        "stop_reason": "tool_use" } })
}

fn session(store: &Store, session_id: &str) -> Value {
    call(store, "GetSession", json!({ "session_id": session_id })).json()
}

fn last_seq(store: &Store, session_id: &str) -> u64 {
    json_u64(&session(store, session_id)["lastSeq"])
}

fn claim(store: &Store, owner: &str, ttl_ms: u64, wait_ms: u64) -> Value {
    call(
        store,
        "ClaimSession",
        json!({ "owner": owner, "ttl_ms": ttl_ms, "wait_ms": wait_ms }),
    )
    .json()
}

fn assert_code(out: &GrpcurlOutput, code: &str) {
    assert_eq!(out.code().as_deref(), Some(code), "stderr: {}", out.stderr);
}

#[test]
fn acquire_renew_and_release_a_lease() {
    let store = Store::start().unwrap();
    user_message(&store, "s", "work");

    let lease = acquire(&store, "s", "runner-a", 60_000).json();
    assert_eq!(lease["sessionId"], "s");
    assert_eq!(lease["owner"], "runner-a");
    assert_eq!(json_u64(&lease["epoch"]), 1);
    let expires = json_u64(&lease["expiresUnixMs"]);
    let info = session(&store, "s");
    assert_eq!(info["lease"]["owner"], "runner-a");
    assert_eq!(json_u64(&info["lease"]["epoch"]), 1);

    // Someone else cannot take a live lease.
    let out = acquire(&store, "s", "runner-b", 60_000);
    assert_code(&out, "FailedPrecondition");

    // The holder writes under its epoch.
    runner_append(&store, "s", 1, tool_result("t0")).json();
    assert_eq!(last_seq(&store, "s"), 2);

    // Renew extends it; only the holder can.
    let renewed = renew(&store, "s", "runner-a", 1, 300_000).json();
    assert_eq!(json_u64(&renewed["epoch"]), 1);
    assert!(json_u64(&renewed["expiresUnixMs"]) > expires);
    assert_code(
        &renew(&store, "s", "runner-b", 1, 60_000),
        "FailedPrecondition",
    );

    // Release gives it up at once: the epoch can no longer write, someone else can acquire.
    call(
        &store,
        "ReleaseLease",
        json!({ "session_id": "s", "owner": "runner-a", "epoch": 1 }),
    )
    .json();
    assert!(
        session(&store, "s").get("lease").is_none(),
        "released lease still shown"
    );
    assert_code(
        &runner_append(&store, "s", 1, tool_result("t1")),
        "FailedPrecondition",
    );
    assert_eq!(last_seq(&store, "s"), 2);
    let next = acquire(&store, "s", "runner-b", 60_000).json();
    assert_eq!(json_u64(&next["epoch"]), 2, "every grant gets a new epoch");
    assert_code(
        &renew(&store, "s", "runner-a", 1, 60_000),
        "FailedPrecondition",
    );
}

/// The fencing scenario (ARCHITECTURE.md, invariants): A's lease runs out (a GC pause, SIGSTOP, a partition),
/// B acquires; A wakes up and can neither write nor renew nor release B's lease.
#[test]
fn an_expired_holder_is_fenced_off_once_someone_else_acquires() {
    let store = Store::start().unwrap();
    user_message(&store, "f", "work");
    let a = acquire(&store, "f", "runner-a", 60_000).json();
    let a_epoch = json_u64(&a["epoch"]);
    runner_append(&store, "f", a_epoch, tool_result("t1")).json();

    // A shortens its own lease and then "pauses": wait until the store shows it expired.
    renew(&store, "f", "runner-a", a_epoch, 200).json();
    poll_until("A's lease to expire", BOUND, || {
        session(&store, "f").get("lease").is_none().then_some(())
    });
    // Expired, not yet re-granted: A can no longer write.
    let out = runner_append(&store, "f", a_epoch, tool_result("t2"));
    assert_code(&out, "FailedPrecondition");
    assert!(out.message().contains("lease_epoch"), "{}", out.message());

    let b = acquire(&store, "f", "runner-b", 60_000).json();
    let b_epoch = json_u64(&b["epoch"]);
    assert_eq!(b_epoch, a_epoch + 1);
    let before = last_seq(&store, "f");

    // A wakes up.
    assert_code(
        &runner_append(&store, "f", a_epoch, tool_result("t2")),
        "FailedPrecondition",
    );
    assert_code(
        &renew(&store, "f", "runner-a", a_epoch, 60_000),
        "FailedPrecondition",
    );
    let _ = call(
        &store,
        "ReleaseLease",
        json!({ "session_id": "f", "owner": "runner-a", "epoch": a_epoch }),
    );
    let info = session(&store, "f");
    assert_eq!(
        json_u64(&info["lastSeq"]),
        before,
        "A's append wrote nothing"
    );
    assert_eq!(
        info["lease"]["owner"], "runner-b",
        "A's release did not touch B's lease"
    );
    assert_eq!(json_u64(&info["lease"]["epoch"]), b_epoch);

    // B writes.
    runner_append(&store, "f", b_epoch, tool_result("t2")).json();
    let log = grpcurl(
        store.addr,
        "agentlog.v1.EventStore/Subscribe",
        Some(r#"{"session_id":"f"}"#),
    )
    .json_stream();
    let results: Vec<&str> = log
        .iter()
        .filter_map(|e| e["toolResult"]["toolUseId"].as_str())
        .collect();
    assert_eq!(results, vec!["t1", "t2"]);
    assert_eq!(json_u64(&log.last().unwrap()["seq"]), before + 1);
}

#[test]
fn runner_written_kinds_need_the_current_lease_epoch() {
    let store = Store::start().unwrap();
    user_message(&store, "r", "work");
    let epoch = json_u64(&acquire(&store, "r", "runner-a", 120_000).json()["epoch"]);
    let kinds = [
        ("assistant_message", tool_use_reply("t1")),
        (
            "tool_started",
            json!({ "tool_started": { "tool_use_id": "t1", "idempotency_key": "r/t1", "attempt": 1 } }),
        ),
        ("tool_result", tool_result("t1")),
        (
            "assistant_delta",
            json!({ "assistant_delta": { "turn_id": "turn-1", "text": "thinking..." } }),
        ),
        (
            "run_error",
            json!({ "run_error": { "message": "provider refused", "retryable": false } }),
        ),
    ];
    for (name, event) in &kinds {
        let out = call(
            &store,
            "Append",
            json!({ "session_id": "r", "events": [event] }),
        );
        assert_code(&out, "FailedPrecondition");
        assert!(
            out.message().contains("lease_epoch"),
            "{name}: {}",
            out.message()
        );
    }
    // A wrong epoch is refused as well.
    assert_code(
        &runner_append(&store, "r", epoch + 1, tool_result("t1")),
        "FailedPrecondition",
    );
    assert_eq!(
        last_seq(&store, "r"),
        1,
        "nothing was written without the lease"
    );

    // Clients write user messages without a lease, even while a runner holds one.
    user_message(&store, "r", "more");
    for (_, event) in &kinds {
        runner_append(&store, "r", epoch, event.clone()).json();
    }
    assert_eq!(last_seq(&store, "r"), 2 + kinds.len() as u64);
}

/// N runnable sessions, M > N concurrent ClaimSession calls (grpcurl and tonic): each
/// session goes to exactly one claimant, the rest get no lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_claimants_each_get_a_different_session() {
    const SESSIONS: usize = 3;
    const GRPCURL_CLAIMANTS: usize = 4;
    const TONIC_CLAIMANTS: usize = 4;
    let store = Store::start().unwrap();
    for i in 0..SESSIONS {
        user_message(&store, &format!("job-{i}"), "please run");
    }

    let mut claims = Vec::new();
    for c in 0..GRPCURL_CLAIMANTS {
        let addr = store.addr;
        claims.push(tokio::task::spawn_blocking(move || {
            let owner = format!("grpcurl-{c}");
            let request = json!({ "owner": owner, "ttl_ms": 60_000, "wait_ms": 3_000 });
            let out = grpcurl(
                addr,
                "agentlog.v1.EventStore/ClaimSession",
                Some(&request.to_string()),
            )
            .json();
            let lease = out.get("lease").map(|l| {
                assert_eq!(l["owner"], owner.as_str());
                (
                    l["sessionId"].as_str().unwrap().to_string(),
                    json_u64(&l["epoch"]),
                )
            });
            (owner, lease)
        }));
    }
    for c in 0..TONIC_CLAIMANTS {
        let mut client = store.client().await.unwrap();
        claims.push(tokio::spawn(async move {
            let owner = format!("tonic-{c}");
            let lease = client
                .claim_session(ClaimSessionRequest {
                    owner: owner.clone(),
                    ttl_ms: 60_000,
                    wait_ms: 3_000,
                })
                .await
                .unwrap()
                .into_inner()
                .lease
                .map(|l| {
                    assert_eq!(l.owner, owner);
                    (l.session_id, l.epoch)
                });
            (owner, lease)
        }));
    }
    let mut granted: BTreeMap<String, String> = BTreeMap::new();
    let mut without = 0;
    for claim in claims {
        match claim.await.unwrap() {
            (owner, Some((session_id, epoch))) => {
                assert_eq!(epoch, 1);
                if let Some(other) = granted.insert(session_id.clone(), owner.clone()) {
                    panic!("{session_id} was granted to both {other} and {owner}");
                }
            }
            (_, None) => without += 1,
        }
    }
    let expected: Vec<String> = (0..SESSIONS).map(|i| format!("job-{i}")).collect();
    assert_eq!(granted.keys().cloned().collect::<Vec<_>>(), expected);
    assert_eq!(without, GRPCURL_CLAIMANTS + TONIC_CLAIMANTS - SESSIONS);
    for (session_id, owner) in &granted {
        assert_eq!(
            session(&store, session_id)["lease"]["owner"],
            owner.as_str()
        );
    }
}

#[test]
fn claim_hands_out_the_oldest_runnable_session_first() {
    let store = Store::start().unwrap();
    // Ids in reverse alphabetical order, so that order of ids cannot pass for age.
    for id in ["c-first", "b-second", "a-third"] {
        user_message(&store, id, "run me");
    }
    let order: Vec<String> = (0..3)
        .map(|_| {
            claim(&store, "runner", 60_000, 0)["lease"]["sessionId"]
                .as_str()
                .expect("a lease")
                .to_string()
        })
        .collect();
    assert_eq!(order, vec!["c-first", "b-second", "a-third"]);
}

#[test]
fn an_expired_lease_makes_the_session_claimable_again() {
    let store = Store::start().unwrap();
    user_message(&store, "crashy", "work");
    let first = claim(&store, "runner-that-dies", 300, 0);
    assert_eq!(first["lease"]["sessionId"], "crashy");
    assert_eq!(json_u64(&first["lease"]["epoch"]), 1);

    // The runner never renews. A claim that waits gets the session once the lease lapses.
    let second = claim(&store, "runner-2", 60_000, 30_000);
    assert_eq!(second["lease"]["sessionId"], "crashy", "{second}");
    assert_eq!(second["lease"]["owner"], "runner-2");
    assert_eq!(json_u64(&second["lease"]["epoch"]), 2);
}

#[test]
fn a_claim_with_nothing_runnable_waits_and_returns_no_lease() {
    let store = Store::start().unwrap();
    let started = Instant::now();
    let out = claim(&store, "runner", 60_000, 1_000);
    assert!(out.get("lease").is_none(), "{out}");
    // A lower bound, not a speed claim: the store held the call for wait_ms.
    assert!(started.elapsed() >= Duration::from_millis(1_000));

    // A session that is leased is not runnable-and-unleased either.
    user_message(&store, "taken", "work");
    acquire(&store, "taken", "someone", 60_000).json();
    assert!(claim(&store, "runner", 60_000, 300).get("lease").is_none());
}

#[test]
fn a_session_appended_while_a_claim_waits_is_handed_to_it() {
    let store = Store::start().unwrap();
    let waiting = GrpcurlChild::spawn(
        store.addr,
        &["-max-time", "60"],
        "agentlog.v1.EventStore/ClaimSession",
        r#"{"owner":"waiter","ttl_ms":60000,"wait_ms":30000}"#,
    );
    // Not an assertion: time for the claim to reach its wait, so that the append below
    // has to wake it. (Should it come later, the claim finds the session at once.) If the
    // wake-up is broken the claim returns no lease after wait_ms and the test fails.
    std::thread::sleep(Duration::from_millis(1_500));
    user_message(&store, "new-work", "hello");
    let out = waiting.finish();
    let response: Value = serde_json::from_str(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {} {}", out.stdout, out.stderr));
    assert_eq!(response["lease"]["sessionId"], "new-work", "{response}");
    assert_eq!(response["lease"]["owner"], "waiter");
}

/// A session whose last event is a final reply (or a run_error) has no work: no claim gets
/// it. A tool_use reply, or a new user message, makes it runnable again.
#[test]
fn an_idle_session_is_not_claimable() {
    let store = Store::start().unwrap();
    user_message(&store, "chat", "list the files");
    let lease = claim(&store, "runner", 60_000, 0)["lease"].clone();
    assert_eq!(lease["sessionId"], "chat");
    let epoch = json_u64(&lease["epoch"]);

    runner_append(&store, "chat", epoch, tool_use_reply("t1")).json();
    runner_append(&store, "chat", epoch, tool_result("t1")).json();
    assert_eq!(session(&store, "chat")["status"], "SESSION_STATUS_RUNNABLE");
    runner_append(&store, "chat", epoch, final_reply()).json();
    assert_eq!(session(&store, "chat")["status"], "SESSION_STATUS_IDLE");
    call(
        &store,
        "ReleaseLease",
        json!({ "session_id": "chat", "owner": "runner", "epoch": epoch }),
    )
    .json();
    assert!(claim(&store, "runner-2", 60_000, 500)
        .get("lease")
        .is_none());

    // The user comes back: runnable and claimable again.
    user_message(&store, "chat", "now delete them");
    let again = claim(&store, "runner-2", 60_000, 0);
    assert_eq!(again["lease"]["sessionId"], "chat");
    let epoch = json_u64(&again["lease"]["epoch"]);
    assert_eq!(epoch, 2);

    // run_error also ends the turn.
    runner_append(
        &store,
        "chat",
        epoch,
        json!({ "run_error": { "message": "provider refused", "retryable": false } }),
    )
    .json();
    assert_eq!(session(&store, "chat")["status"], "SESSION_STATUS_IDLE");
    call(
        &store,
        "ReleaseLease",
        json!({ "session_id": "chat", "owner": "runner-2", "epoch": epoch }),
    )
    .json();
    assert!(claim(&store, "runner-3", 60_000, 300)
        .get("lease")
        .is_none());
}

/// The reason a refused call carries (its message is never empty).
fn reason<T: std::fmt::Debug>(result: Result<tonic::Response<T>, tonic::Status>) -> Option<Reason> {
    let status = result.expect_err("refused");
    assert!(!status.message().is_empty(), "{status:?}");
    Reason::of(&status)
}

/// Every lease refusal carries its reason (`google.rpc.ErrorInfo`) over the wire, beside
/// the code and the human message of the tests above: what clients decide on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_lease_refusal_carries_its_reason() {
    let store = Store::start().expect("store starts");
    let mut client = store.client().await.expect("connect");
    let acquire = |session_id: &str, owner: &str| AcquireLeaseRequest {
        session_id: session_id.into(),
        owner: owner.into(),
        ttl_ms: 60_000,
    };
    let renew = |owner: &str, epoch: u64| RenewLeaseRequest {
        session_id: "why".into(),
        owner: owner.into(),
        epoch,
        ttl_ms: 60_000,
    };
    let runner_append = |lease_epoch: Option<u64>| AppendRequest {
        session_id: "why".into(),
        events: vec![Event {
            kind: Some(event::Kind::ToolResult(ToolResult {
                tool_use_id: "t1".into(),
                ..ToolResult::default()
            })),
            ..Event::default()
        }],
        lease_epoch,
        ..AppendRequest::default()
    };

    let nowhere = client.acquire_lease(acquire("nowhere", "runner-a")).await;
    assert_eq!(reason(nowhere), Some(Reason::SessionNotFound));
    let info = client
        .get_session(GetSessionRequest {
            session_id: "nowhere".into(),
        })
        .await;
    assert_eq!(reason(info), Some(Reason::SessionNotFound));

    client
        .append(AppendRequest {
            session_id: "why".into(),
            events: vec![user_event("u1", "work")],
            ..AppendRequest::default()
        })
        .await
        .expect("a user message needs no lease");
    let lease = client
        .acquire_lease(acquire("why", "runner-a"))
        .await
        .expect("acquire")
        .into_inner();
    let taken = client.acquire_lease(acquire("why", "runner-b")).await;
    assert_eq!(reason(taken), Some(Reason::LeaseHeld));
    let not_theirs = client.renew_lease(renew("runner-b", lease.epoch)).await;
    assert_eq!(reason(not_theirs), Some(Reason::LeaseHeld));
    let without = client.append(runner_append(None)).await;
    assert_eq!(reason(without), Some(Reason::LeaseRequired));
    let wrong_epoch = client.append(runner_append(Some(lease.epoch + 1))).await;
    assert_eq!(reason(wrong_epoch), Some(Reason::LeaseFenced));

    client
        .release_lease(ReleaseLeaseRequest {
            session_id: "why".into(),
            owner: "runner-a".into(),
            epoch: lease.epoch,
        })
        .await
        .expect("release");
    let released = client.append(runner_append(Some(lease.epoch))).await;
    assert_eq!(reason(released), Some(Reason::LeaseFenced));
    let renew_released = client.renew_lease(renew("runner-a", lease.epoch)).await;
    assert_eq!(reason(renew_released), Some(Reason::LeaseFenced));
    client
        .acquire_lease(acquire("why", "runner-b"))
        .await
        .expect("acquire after release");
    let superseded = client.renew_lease(renew("runner-a", lease.epoch)).await;
    assert_eq!(reason(superseded), Some(Reason::LeaseFenced));
}
