//! The concurrent parts of the storage contract (`event_store::backend`), checked in-process
//! against both backends with random interleavings: the local log, and PostgreSQL served by
//! two backend instances on one database (two replicas).
//!
//! - Appenders on both replicas, with random batches and retried event ids: every
//!   acknowledgement matches the log, seqs are gapless, every id is in the log once and a
//!   retry gets its original seq.
//! - Pipelined appends (AppendStream's) from both replicas beside unary ones on one
//!   session: each writer's land in the order queued, a refusal among them fails only
//!   itself, and the log matches every acknowledgement.
//! - A follower on one replica, appends through both: it sees every event once, in order.
//! - Claimants on both replicas: each runnable session goes to exactly one of them.
//! - Fencing: whatever the interleaving of acquires and appends, an append is accepted only
//!   under the current epoch, and epochs only grow.
//! - A crowd of appends at once on many sessions, some refused (a wrong
//!   `expected_last_seq`), some retries, some racing for the same seq: each gets its own
//!   answer, and a refusal or a lost race never fails the others written with it.
//! - A deletion racing appends and a follower on both replicas: an append is either
//!   acknowledged or refused as deleted; every append that starts after the deletion
//!   returned is refused, on both replicas, retries of acknowledged ids included; the
//!   follower sees a gapless prefix and then the refusal.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::time::Duration;

use agentlog_proto::reason::Reason;
use agentlog_proto::v1::{event, Durability, Event, RunError, UserMessage};
use event_store::backend::local::{Store, StoreConfig};
use event_store::backend::postgres::{NotifyMode, PgBackend, PgConfig};
use event_store::backend::AppendOp;
use event_store::backend::Backend;
use event_store::scope::Scope;
use event_store::StoreError;
use testkit::pg::Postgres;
use tokio_util::sync::CancellationToken;

const SEEDS: [u64; 3] = [1, 2, 3];

/// Two handles on the same data: for the local log the same store twice (it has one
/// replica), for PostgreSQL two backends on one database.
struct Replicas {
    a: Arc<dyn Backend>,
    b: Arc<dyn Backend>,
    _keep: Option<(Postgres, tempfile::TempDir)>,
    _dir: Option<tempfile::TempDir>,
}

fn local() -> Replicas {
    let dir = tempfile::tempdir().unwrap();
    let store: Arc<dyn Backend> =
        Arc::new(Store::open(StoreConfig::in_dir(dir.path()).unwrap()).unwrap());
    Replicas {
        a: store.clone(),
        b: store,
        _keep: None,
        _dir: Some(dir),
    }
}

async fn postgres() -> Replicas {
    let dir = tempfile::tempdir().unwrap();
    let pg = tokio::task::block_in_place(|| Postgres::init(dir.path(), &[])).unwrap();
    let url = tokio::task::block_in_place(|| pg.create_database()).unwrap();
    let open = || {
        PgBackend::open(PgConfig {
            url: url.clone(),
            ca_file: None,
            pool_size: 8,
            notify: NotifyMode::Listen,
            poll_interval: Duration::from_millis(500),
            cache_bytes: 64 << 20,
            search: true,
            retention: None,
        })
    };
    let a: Arc<dyn Backend> = Arc::new(open().await.unwrap());
    let b: Arc<dyn Backend> = Arc::new(open().await.unwrap());
    Replicas {
        a,
        b,
        _keep: Some((pg, dir)),
        _dir: None,
    }
}

fn user(event_id: &str) -> Event {
    Event {
        event_id: event_id.into(),
        kind: Some(event::Kind::UserMessage(UserMessage {
            text: event_id.into(),
        })),
        ..Event::default()
    }
}

fn op(session_id: &str, events: Vec<Event>) -> AppendOp {
    AppendOp {
        session_id: session_id.into(),
        events: events.into_iter().map(Into::into).collect(),
        expected_last_seq: None,
        lease_epoch: None,
        durability: Durability::Sync,
    }
}

async fn read_all(backend: &dyn Backend, session_id: &str) -> Vec<Event> {
    let mut rx = backend.subscribe(session_id.into(), 1, false, CancellationToken::new());
    let mut events = Vec::new();
    while let Some(run) = rx.recv().await {
        events.extend(run.unwrap().into_events().unwrap());
    }
    events
}

async fn appenders(replicas: &Replicas, seed: u64) {
    let session = format!("s{seed}");
    let mut tasks = Vec::new();
    for w in 0..6u64 {
        let backend = if w % 2 == 0 {
            replicas.a.clone()
        } else {
            replicas.b.clone()
        };
        let session = session.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(seed * 100 + w);
            let mut acked: Vec<(String, u64)> = Vec::new();
            for i in 0..15 {
                let mut events = Vec::new();
                for j in 0..rng.usize(1..4) {
                    // Now and then retry an id this writer was already acknowledged for.
                    let id = match acked.get(rng.usize(..acked.len().max(1))) {
                        Some((id, _)) if rng.u8(..4) == 0 => id.clone(),
                        _ => format!("w{w}-{i}-{j}"),
                    };
                    events.push(user(&id));
                }
                let ids: Vec<String> = events.iter().map(|e| e.event_id.clone()).collect();
                let resp = backend.append(op(&session, events)).await.unwrap();
                assert_eq!(resp.seqs.len(), ids.len());
                for (id, seq) in ids.into_iter().zip(resp.seqs) {
                    if let Some((_, first)) = acked.iter().find(|(known, _)| *known == id) {
                        assert_eq!(*first, seq, "a retried id gets its original seq");
                    }
                    acked.push((id, seq));
                }
            }
            acked
        }));
    }
    log_holds_what_was_acknowledged(replicas.a.as_ref(), &session, tasks).await;
}

/// The writers' acknowledgements (each id with its seq; a retried id may come twice, with
/// the same seq) against the session's log read once they are all done: gapless, every
/// acknowledged id once, where it was acknowledged, and nothing else.
async fn log_holds_what_was_acknowledged(
    backend: &dyn Backend,
    session: &str,
    tasks: Vec<tokio::task::JoinHandle<Vec<(String, u64)>>>,
) {
    let mut acked: HashMap<String, u64> = HashMap::new();
    for task in tasks {
        for (id, seq) in task.await.unwrap() {
            assert_eq!(*acked.entry(id).or_insert(seq), seq);
        }
    }
    let log = read_all(backend, session).await;
    let seqs: Vec<u64> = log.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=log.len() as u64).collect::<Vec<_>>(), "gapless");
    let by_id: HashMap<&str, u64> = log.iter().map(|e| (e.event_id.as_str(), e.seq)).collect();
    assert_eq!(by_id.len(), log.len(), "every id is in the log once");
    assert_eq!(
        by_id.len(),
        acked.len(),
        "every acknowledged id, nothing else"
    );
    for (id, seq) in &acked {
        assert_eq!(
            by_id.get(id.as_str()),
            Some(seq),
            "{id} is where it was acknowledged"
        );
    }
}

async fn follower_sees_everything(replicas: &Replicas, seed: u64) {
    let session = format!("f{seed}");
    let (tx, mut rx) = tokio::sync::mpsc::channel(1024);
    let cancel = CancellationToken::new();
    let mut stream = replicas
        .b
        .subscribe(session.clone(), 0, true, cancel.clone());
    tokio::spawn(async move {
        while let Some(run) = stream.recv().await {
            for event in run.unwrap().into_events().unwrap() {
                if tx.send(event.seq).await.is_err() {
                    return;
                }
            }
        }
    });
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut total = 0u64;
    for i in 0..40 {
        let n = rng.usize(1..5);
        let events = (0..n).map(|j| user(&format!("e{i}-{j}"))).collect();
        let replica = if rng.bool() { &replicas.a } else { &replicas.b };
        replica.append(op(&session, events)).await.unwrap();
        total += n as u64;
    }
    let mut seen = Vec::new();
    while (seen.len() as u64) < total {
        let seq = tokio::time::timeout(Duration::from_secs(20), rx.recv())
            .await
            .expect("the follower sees every event within 20 s")
            .expect("the stream stays open");
        seen.push(seq);
    }
    cancel.cancel();
    assert_eq!(seen, (1..=total).collect::<Vec<_>>(), "once each, in order");
}

async fn claimants(replicas: &Replicas, seed: u64) {
    let sessions: Vec<String> = (0..12).map(|i| format!("c{seed}-{i}")).collect();
    for id in &sessions {
        replicas.a.append(op(id, vec![user("go")])).await.unwrap();
    }
    let mut tasks = Vec::new();
    for c in 0..6 {
        let backend = if c % 2 == 0 {
            replicas.a.clone()
        } else {
            replicas.b.clone()
        };
        tasks.push(tokio::spawn(async move {
            let mut got = Vec::new();
            let cancel = CancellationToken::new();
            while let Some(lease) = backend
                .claim(
                    format!("runner-{c}"),
                    60_000,
                    Duration::from_millis(200),
                    &cancel,
                    &Scope::prefixes(vec![format!("c{seed}-")]),
                )
                .await
                .unwrap()
            {
                got.push(lease);
            }
            got
        }));
    }
    let mut claimed: BTreeMap<String, String> = BTreeMap::new();
    for task in tasks {
        for lease in task.await.unwrap() {
            assert_eq!(lease.epoch, 1);
            let previous = claimed.insert(lease.session_id.clone(), lease.owner.clone());
            assert!(
                previous.is_none(),
                "{} went to two claimants",
                lease.session_id
            );
        }
    }
    let want: BTreeMap<String, String> = sessions
        .iter()
        .map(|s| (s.clone(), String::new()))
        .collect();
    assert_eq!(
        claimed.keys().collect::<Vec<_>>(),
        want.keys().collect::<Vec<_>>(),
        "every runnable session was claimed"
    );
}

/// Two runners race for one session through random acquire/append/release steps on either
/// replica: an append lands only under the live, current epoch; epochs only grow.
async fn fencing(replicas: &Replicas, seed: u64) {
    let session = format!("l{seed}");
    replicas
        .a
        .append(op(&session, vec![user("go")]))
        .await
        .unwrap();
    let mut rng = fastrand::Rng::with_seed(seed);
    let mut held: HashMap<&str, u64> = HashMap::new();
    // The newest epoch, its holder, and whether it is still live (not released).
    let (mut newest, mut owner, mut live) = (0u64, "", false);
    for step in 0..80 {
        let who = if rng.bool() { "r1" } else { "r2" };
        let replica = if rng.bool() { &replicas.a } else { &replicas.b };
        match rng.u8(..3) {
            0 => {
                let allowed = !live || owner == who;
                match replica
                    .acquire_lease(session.clone(), who.into(), 60_000)
                    .await
                {
                    Ok(lease) => {
                        assert!(allowed, "acquired while someone else's lease was live");
                        assert_eq!(lease.epoch, newest + 1, "epochs grow by one");
                        (newest, owner, live) = (lease.epoch, who, true);
                        held.insert(who, lease.epoch);
                    }
                    Err(StoreError::Refused(Reason::LeaseHeld, _)) => assert!(!allowed),
                    Err(e) => panic!("acquire: {e}"),
                }
            }
            1 => {
                let Some(&epoch) = held.get(who) else {
                    continue;
                };
                let mut append = op(
                    &session,
                    vec![Event {
                        event_id: format!("x{step}"),
                        kind: Some(event::Kind::RunError(RunError::default())),
                        ..Event::default()
                    }],
                );
                append.lease_epoch = Some(epoch);
                let current = epoch == newest && live;
                match replica.append(append).await {
                    Ok(_) => assert!(current, "an append under epoch {epoch} was accepted"),
                    Err(StoreError::Refused(Reason::LeaseFenced, _)) => {
                        assert!(!current, "the live, current epoch {epoch} was refused")
                    }
                    Err(e) => panic!("append: {e}"),
                }
            }
            _ => {
                let Some(&epoch) = held.get(who) else {
                    continue;
                };
                let released = replica
                    .release_lease(session.clone(), who.into(), epoch)
                    .await;
                assert_eq!(
                    released.is_ok(),
                    epoch == newest,
                    "release of epoch {epoch}"
                );
                if epoch == newest {
                    live = false;
                }
            }
        }
    }
}

/// Many appends at once through both replicas (PostgreSQL writes those waiting together in
/// one statement): each is answered for itself.
async fn crowd(replicas: &Replicas, seed: u64) {
    const SESSIONS: usize = 24;
    let session = |i: usize| format!("crowd{seed}-{i}");
    for i in 0..SESSIONS {
        replicas
            .a
            .append(op(&session(i), vec![user("first")]))
            .await
            .unwrap();
    }
    let mut tasks = Vec::new();
    for i in 0..SESSIONS {
        // Racing for seq 2 of the same session: two appends, both expecting seq 1.
        let racers = if i % 4 == 3 { 2 } else { 1 };
        for r in 0..racers {
            let backend = if (i + r) % 2 == 0 {
                replicas.a.clone()
            } else {
                replicas.b.clone()
            };
            let mut append = match i % 4 {
                // A retry of the first event: nothing written, its original seq.
                1 => op(&session(i), vec![user("first")]),
                _ => op(&session(i), vec![user(&format!("second-{r}"))]),
            };
            append.expected_last_seq = match i % 4 {
                0 => Some(7),
                1 => None,
                _ => Some(1),
            };
            tasks.push(tokio::spawn(
                async move { (i, backend.append(append).await) },
            ));
        }
    }
    let mut won: HashMap<usize, usize> = HashMap::new();
    for task in tasks {
        let (i, answer) = task.await.unwrap();
        match (i % 4, answer) {
            (0, Err(StoreError::Refused(Reason::SeqConflict, why))) => {
                assert!(why.ends_with("is at seq 1"), "{why}")
            }
            (1, Ok(resp)) => assert_eq!(resp.seqs, vec![1], "a retry gets its original seq"),
            (2 | 3, Ok(resp)) => {
                assert_eq!(resp.seqs, vec![2]);
                *won.entry(i).or_default() += 1;
            }
            (3, Err(StoreError::Refused(Reason::SeqConflict, why))) => {
                assert!(why.ends_with("is at seq 2"), "{why}")
            }
            (kind, answer) => panic!("session {i} (case {kind}): {answer:?}"),
        }
    }
    for i in 0..SESSIONS {
        let log = read_all(replicas.b.as_ref(), &session(i)).await;
        let expected = if i % 4 >= 2 { 2 } else { 1 };
        assert_eq!(log.len(), expected, "session {i}");
        if i % 4 >= 2 {
            assert_eq!(won.get(&i), Some(&1), "one append won seq 2 of session {i}");
        }
    }
}

/// AppendStream's path: writers on both replicas queue appends (`enqueue_append`) without
/// waiting for the ones before, beside unary appends to the same session. Each writer's
/// appends land in the order it queued them, a refusal in the middle (a wrong
/// `expected_last_seq`) fails only its own, retried ids get their original seq, and the
/// log is gapless and holds every acknowledged id where it was acknowledged.
async fn pipelined(replicas: &Replicas, seed: u64) {
    let session = format!("p{seed}");
    let mut tasks = Vec::new();
    for w in 0..5u64 {
        let backend = if w % 2 == 0 {
            replicas.a.clone()
        } else {
            replicas.b.clone()
        };
        let session = session.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = fastrand::Rng::with_seed(seed * 1000 + w);
            let mut acked: Vec<(String, u64)> = Vec::new();
            let mut last_new = 0;
            for round in 0..6 {
                // The unary writer (w == 4) appends one at a time.
                let queued = if w == 4 { 1 } else { rng.usize(1..40) };
                let mut answers = Vec::new();
                for i in 0..queued {
                    // (An append of ids all known is answered with their seqs whatever it
                    // expects: a refused one carries a new id.)
                    let refused = rng.u8(..8) == 0;
                    let mut events = Vec::new();
                    for j in 0..rng.usize(1..3) {
                        let id = match acked.get(rng.usize(..acked.len().max(1))) {
                            Some((id, _)) if !refused && rng.u8(..6) == 0 => id.clone(),
                            _ => format!("w{w}-{round}-{i}-{j}"),
                        };
                        events.push(user(&id));
                    }
                    let ids: Vec<String> = events.iter().map(|e| e.event_id.clone()).collect();
                    let mut append = op(&session, events);
                    if refused {
                        append.expected_last_seq = Some(1 << 40);
                    }
                    let answer = if w == 4 {
                        let answer = backend.append(append).await;
                        Box::pin(std::future::ready(answer))
                    } else {
                        backend.enqueue_append(append).await.unwrap()
                    };
                    answers.push((ids, refused, answer));
                }
                for (ids, refused, answer) in answers {
                    match answer.await {
                        Err(StoreError::Refused(Reason::SeqConflict, _)) if refused => {}
                        Ok(resp) if !refused => {
                            assert_eq!(resp.seqs.len(), ids.len());
                            for (id, seq) in ids.into_iter().zip(resp.seqs) {
                                match acked.iter().find(|(known, _)| *known == id) {
                                    Some((_, first)) => {
                                        assert_eq!(
                                            *first, seq,
                                            "a retried id gets its original seq"
                                        )
                                    }
                                    None => {
                                        assert!(
                                            seq > last_new,
                                            "writer {w}: {id} at {seq} after {last_new}"
                                        );
                                        last_new = seq;
                                    }
                                }
                                acked.push((id, seq));
                            }
                        }
                        other => panic!("writer {w} (refused: {refused}): {other:?}"),
                    }
                }
            }
            acked
        }));
    }
    log_holds_what_was_acknowledged(replicas.b.as_ref(), &session, tasks).await;
}

async fn deletion_races(replicas: &Replicas, seed: u64) {
    use std::sync::atomic::{AtomicBool, Ordering};
    let session = format!("del{seed}");
    replicas
        .a
        .append(op(&session, vec![user("first")]))
        .await
        .unwrap();
    let mut follower = replicas
        .b
        .subscribe(session.clone(), 1, true, CancellationToken::new());
    let deleted = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for w in 0..4u64 {
        let backend = if w % 2 == 0 {
            replicas.a.clone()
        } else {
            replicas.b.clone()
        };
        let (session, deleted) = (session.clone(), deleted.clone());
        tasks.push(tokio::spawn(async move {
            let mut acked: Vec<String> = Vec::new();
            let mut refusals_after = 0;
            for i in 0.. {
                let started_after = deleted.load(Ordering::SeqCst);
                // Now and then a retry of an id already acknowledged.
                let id = match acked.get(i % 7) {
                    Some(id) if i % 3 == 0 => id.clone(),
                    _ => format!("w{w}-{i}"),
                };
                match backend.append(op(&session, vec![user(&id)])).await {
                    Ok(_) => {
                        assert!(!started_after, "an append after the deletion was accepted");
                        acked.push(id);
                    }
                    Err(e) => {
                        assert_eq!(e.reason(), Some(Reason::SessionDeleted), "{e}");
                        if started_after {
                            refusals_after += 1;
                            if refusals_after == 3 {
                                return;
                            }
                        }
                    }
                }
            }
        }));
    }
    let mut rng = fastrand::Rng::with_seed(seed);
    tokio::time::sleep(Duration::from_millis(rng.u64(5..60))).await;
    replicas.a.delete_session(&session).await.unwrap();
    deleted.store(true, Ordering::SeqCst);
    for task in tasks {
        task.await.unwrap();
    }
    let mut next = 1;
    let end = loop {
        match follower
            .recv()
            .await
            .expect("the follower ends with a refusal")
        {
            Ok(run) => {
                for event in run.into_events().unwrap() {
                    assert_eq!(event.seq, next, "the follower's events are gapless");
                    next += 1;
                }
            }
            Err(e) => break e,
        }
    };
    assert_eq!(end.reason(), Some(Reason::SessionDeleted), "{end}");
    for backend in [&replicas.a, &replicas.b] {
        let got = backend.get_session(&session).await.unwrap_err();
        assert_eq!(got.reason(), Some(Reason::SessionDeleted));
        backend.delete_session(&session).await.unwrap();
    }
}

async fn contract(replicas: Replicas) {
    for seed in SEEDS {
        appenders(&replicas, seed).await;
        pipelined(&replicas, seed).await;
        follower_sees_everything(&replicas, seed).await;
        claimants(&replicas, seed).await;
        fencing(&replicas, seed).await;
        crowd(&replicas, seed).await;
        deletion_races(&replicas, seed).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_local_log_keeps_the_contract() {
    contract(local()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgresql_keeps_the_contract_across_two_replicas() {
    contract(postgres().await).await;
}
