//! Shared by the mixed-version tests (`skew_*.rs`): the last release and this build side by
//! side (`testkit::previous`), as a rolling update or a rollback leaves them for as long as
//! it is paused. A [`Skew`] is store replicas of either build over one backing, runners of
//! either build (each working through one replica), the Anthropic stand-in scripting bash
//! calls that report each run to a counter outside the sessions, a client appending user
//! turns through every replica, and a follower of two sessions on every replica. Its faults
//! are SIGKILLs: a replica started again as the other build on the same data and address,
//! a runner killed in the middle of a call and replaced by one of the other build.
//!
//! [`Skew::finish`] checks what no mix of the two releases may break: every acknowledged
//! append is in its log at its seq (gapless), read back through every replica; every
//! replica serves the same events, read whole and followed live; every work session
//! finished; no call ran twice, except again after a kill (each run has a `tool_started` of
//! its own, attempts numbered on); and the model was sent only well-formed requests.
#![allow(dead_code)] // each test file uses its own subset

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use agentlog_client::follow::{follow, Flow, Refusals};
use agentlog_client::{BearerToken, StoreClient, StoreConnection};
use agentlog_proto::v1::{
    event::Kind, AppendRequest, Event, GetSessionRequest, SessionInfo, SessionStatus,
};
use integration_tests::anthropic_standin::{AnthropicStandin, StandinReply};
use integration_tests::appender::Appender;
use integration_tests::newer;
use integration_tests::secure::{tokens_json, TokenSpec};
use integration_tests::side_effects::Counter;
use integration_tests::{user_event, Backing, Store};
use serde_json::json;
use testkit::previous::Build;

use crate::runner_support::{
    assert_exactly_once, kinds, start_runner_binary, tool_use_ids, RunnerProc,
};

/// The lease TTL of the runners: short, so a killed runner's sessions are taken over soon.
pub const TTL_MS: u64 = 2000;
const MAX_SESSIONS: usize = 4;
/// Bash calls per work session, before its final reply.
pub const STEPS: usize = 3;
/// How long anything that must happen may take on a loaded machine.
const PATIENCE: Duration = Duration::from_secs(90);

const ADMIN_TOKEN: &str = "skew-test-admin-token-0123456789";
/// The runners' token: `work:` sessions only, so the `load:` sessions stay the appender's.
const RUNNER_TOKEN: &str = "skew-test-runner-token-0123456789";

/// A store replica, and the build it runs.
pub struct Replica {
    pub store: Store,
    pub build: Build,
}

/// A runner, the build it runs and the replica it works through.
struct Runner {
    proc: RunnerProc,
    build: Build,
    replica: usize,
}

pub struct Skew {
    pub replicas: Vec<Replica>,
    runners: Vec<Runner>,
    /// An admin client per replica (each reconnects to its replica's address).
    clients: Vec<StoreClient>,
    standin: AnthropicStandin,
    counter: Counter,
    appender: Appender,
    followers: Vec<Follower>,
    /// Every work session started.
    work: Vec<String>,
    started_runners: usize,
    /// What was done, one line a step, printed by [`Skew::finish`].
    story: Vec<String>,
    workspaces: tempfile::TempDir,
    secrets: tempfile::TempDir,
    /// The later release's turns appended by [`Skew::no_field_dropped`], by session.
    newer: Vec<(String, newer::NewerEvent)>,
}

fn script(counter: &Counter) -> Vec<StandinReply> {
    let command = format!("sleep 0.5; {}", counter.report());
    let mut replies: Vec<StandinReply> = (0..STEPS)
        .map(|i| {
            StandinReply::text(&format!("Step {i}: reporting this call's key."))
                .slow(10)
                .tool("bash", json!({ "command": command }))
        })
        .collect();
    replies.push(StandinReply::text("Every step is done.").slow(10));
    replies
}

impl Skew {
    /// Replicas of `replicas`' builds over `backing` (started in that order: the first one
    /// makes a fresh database's schema), and runners of `runners`' builds, each working
    /// through the replica named beside it.
    pub async fn start(backing: Backing, replicas: &[Build], runners: &[(Build, usize)]) -> Skew {
        let secrets = tempfile::tempdir().expect("temp dir");
        let tokens = secrets.path().join("tokens.json");
        std::fs::write(
            &tokens,
            tokens_json(&[
                TokenSpec::unscoped("ops", ADMIN_TOKEN, "admin"),
                TokenSpec::scoped("runners", RUNNER_TOKEN, "runner", &["work:"]),
            ]),
        )
        .expect("write the tokens file");
        std::fs::write(secrets.path().join("runner-token"), RUNNER_TOKEN).expect("write");
        let tokens = tokens.display().to_string();
        let replicas: Vec<Replica> = tokio::task::block_in_place(|| {
            replicas
                .iter()
                .map(|&build| Replica {
                    store: build
                        .start_store(backing.clone(), &["--tokens-file", &tokens])
                        .unwrap_or_else(|e| panic!("a store of {build} starts: {e:#}")),
                    build,
                })
                .collect()
        });
        let clients: Vec<StoreClient> = replicas.iter().map(|r| admin(&r.store)).collect();
        let counter = Counter::start();
        let standin = AnthropicStandin::start(script(&counter))
            .await
            .expect("stand-in");
        let appender = Appender::start(clients.clone());
        let followers = clients
            .iter()
            .enumerate()
            .map(|(i, client)| Follower::start(client.clone(), i, "load:0"))
            .collect();
        let mut skew = Skew {
            replicas,
            runners: Vec::new(),
            clients,
            standin,
            counter,
            appender,
            followers,
            work: Vec::new(),
            started_runners: 0,
            story: Vec::new(),
            workspaces: tempfile::tempdir().expect("temp dir"),
            secrets,
            newer: Vec::new(),
        };
        let builds: Vec<String> = skew.replicas.iter().map(|r| r.build.to_string()).collect();
        skew.note(format!("replicas of {}", builds.join(" and ")));
        for &(build, replica) in runners {
            let runner = skew.start_runner(build, replica);
            skew.note(format!(
                "{} works through replica {replica}",
                runner.proc.id
            ));
            skew.runners.push(runner);
        }
        skew
    }

    fn note(&mut self, line: String) {
        eprintln!("SKEW: {line}");
        self.story.push(line);
    }

    fn start_runner(&mut self, build: Build, replica: usize) -> Runner {
        let id = format!("runner-{}-{build}", self.started_runners);
        self.started_runners += 1;
        let token = self.secrets.path().join("runner-token");
        let proc = start_runner_binary(
            &build.bin_path("runner"),
            &self.replicas[replica].store.url(),
            &id,
            self.workspaces.path(),
            &self.standin.url(),
            TTL_MS,
            MAX_SESSIONS,
            &[
                "--token-file",
                token.to_str().expect("a UTF-8 path"),
                "--tool-network",
                "all",
            ],
        );
        Runner {
            proc,
            build,
            replica,
        }
    }

    /// Starts `n` work sessions `work:NAME-<i>`, through the replicas in turn. The first
    /// one of all is followed through every replica.
    pub async fn start_work(&mut self, name: &str, n: usize) {
        for i in 0..n {
            let session = format!("work:{name}-{i}");
            if self.work.is_empty() {
                for (replica, client) in self.clients.iter().enumerate() {
                    self.followers
                        .push(Follower::start(client.clone(), replica, &session));
                }
            }
            let replica = self.work.len() % self.clients.len();
            self.append_retried(replica, &session, user_event("ask", &session))
                .await;
            self.work.push(session);
        }
    }

    /// Appends until acknowledged, through `replica` first and the others after a failure
    /// (the same event id each time: a retry is deduplicated).
    async fn append_retried(&self, replica: usize, session: &str, event: Event) -> u64 {
        let deadline = Instant::now() + PATIENCE;
        let mut attempt = 0;
        loop {
            let mut client = self.clients[(replica + attempt) % self.clients.len()].clone();
            let request = AppendRequest {
                session_id: session.into(),
                events: vec![event.clone()],
                ..Default::default()
            };
            match tokio::time::timeout(Duration::from_secs(5), client.append(request)).await {
                Ok(Ok(answer)) => return answer.into_inner().last_seq,
                failed => {
                    assert!(
                        Instant::now() < deadline,
                        "{session}: no replica acknowledged an append: {failed:?}"
                    );
                }
            }
            attempt += 1;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The session as the first replica that answers sees it.
    async fn session(&self, session: &str) -> Option<SessionInfo> {
        for client in &self.clients {
            let answer = client
                .clone()
                .get_session(GetSessionRequest {
                    session_id: session.into(),
                })
                .await;
            if let Ok(answer) = answer {
                return Some(answer.into_inner());
            }
        }
        None
    }

    /// Waits until the appender has `more` acknowledgements beyond now.
    pub async fn appended(&self, more: usize) {
        self.appender.wait_more(more, PATIENCE).await;
    }

    /// SIGKILLs replica `i` and starts it again as `build` on the same data and address,
    /// under load; returns once appends are acknowledged again.
    pub async fn replace_replica(&mut self, i: usize, build: Build) {
        self.appended(10).await;
        let before = self.appender.count();
        let was = self.replicas[i].build;
        let store =
            tokio::task::block_in_place(|| build.replace_store(&mut self.replicas[i].store))
                .unwrap_or_else(|e| panic!("replica {i} starts again as {build}: {e:#}"));
        self.replicas[i] = Replica { store, build };
        self.appended(20).await;
        let after = self.appender.count();
        self.note(format!(
            "replica {i} ({was}) SIGKILLed, started again as {build}; appends acknowledged meanwhile {}, retried {}",
            after.0 - before.0,
            after.1 - before.1
        ));
    }

    /// Starts rounds of work sessions until runner `i` holds one in the middle of a call,
    /// SIGKILLs it, and starts a runner of `build` on the same replica in its place.
    pub async fn kill_runner_mid_call(&mut self, i: usize, build: Build) {
        let id = self.runners[i].proc.id.clone();
        let deadline = Instant::now() + PATIENCE;
        let mut round = 0;
        let mut next_round = Instant::now();
        let held = 'held: loop {
            if Instant::now() >= next_round {
                self.start_work(&format!("{id}-{round}"), 3).await;
                round += 1;
                next_round = Instant::now() + Duration::from_secs(6);
            }
            for session in &self.work {
                let held = self
                    .session(session)
                    .await
                    .and_then(|info| info.lease)
                    .is_some_and(|lease| lease.owner == id);
                if !held {
                    continue;
                }
                let events = self.log_anywhere(session).await;
                let last = events
                    .iter()
                    .rev()
                    .find(|e| !matches!(e.kind, Some(Kind::AssistantDelta(_))));
                if matches!(
                    last.and_then(|e| e.kind.as_ref()),
                    Some(Kind::ToolStarted(_))
                ) {
                    break 'held session.clone();
                }
            }
            assert!(
                Instant::now() < deadline,
                "{id} never held a session in the middle of a call"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        self.runners[i].proc.kill9();
        let (was, replica) = (self.runners[i].build, self.runners[i].replica);
        let runner = self.start_runner(build, replica);
        self.note(format!(
            "{id} ({was}) SIGKILLed in the middle of a call of {held}; {} ({build}) in its place",
            runner.proc.id
        ));
        self.runners[i] = runner;
    }

    async fn log_anywhere(&self, session: &str) -> Vec<Event> {
        for client in &self.clients {
            if let Ok(events) = agentlog_client::log::read_log(&mut client.clone(), session).await {
                return events;
            }
        }
        Vec::new()
    }

    /// No field is dropped: a later release's user turn, carrying fields this build's
    /// protocol does not know (`integration_tests::newer`), appended through each replica of
    /// this build, is served back whole, byte for byte, through every replica of this build.
    /// [`Skew::finish`] reads them again, after replicas of the release served the same
    /// storage (a replica of 0.1.0 drops such fields from what it serves, never from what
    /// is stored).
    pub async fn no_field_dropped(&mut self) {
        for (i, replica) in self.replicas.iter().enumerate() {
            if replica.build != Build::This {
                continue;
            }
            let session = format!("load:newer-{i}");
            let channel = channel_of(&replica.store).await;
            let turn = newer::user(&format!("newer-{i}"), "a turn from a later release");
            newer::unary::<_, agentlog_proto::v1::AppendResponse>(
                &channel,
                Some(ADMIN_TOKEN),
                newer::APPEND,
                newer::NewerAppendRequest {
                    session_id: session.clone(),
                    events: vec![turn.clone()],
                    lease_epoch: None,
                },
            )
            .await
            .unwrap_or_else(|e| panic!("append a later release's turn through replica {i}: {e}"));
            self.newer.push((session, turn));
        }
        self.newer_served_whole(&self.replicas).await;
        self.note("later releases' fields appended and served whole".into());
    }

    /// Each turn [`Skew::no_field_dropped`] appended, read through every replica of this
    /// build: its bytes are what the later release sent, with the store's fields.
    async fn newer_served_whole(&self, replicas: &[Replica]) {
        for (session, sent) in &self.newer {
            for (i, replica) in replicas.iter().enumerate() {
                if replica.build != Build::This {
                    continue;
                }
                let channel = channel_of(&replica.store).await;
                let log = newer::read(&channel, Some(ADMIN_TOKEN), session)
                    .await
                    .unwrap_or_else(|e| panic!("read {session} through replica {i}: {e}"));
                let [(served, bytes)] = &log[..] else {
                    panic!(
                        "{session} through replica {i}: one event, not {}",
                        log.len()
                    );
                };
                let expected = newer::stored(sent, session, 1, served);
                assert_eq!(served, &expected, "{session} through replica {i}");
                assert_eq!(
                    bytes,
                    &prost::Message::encode_to_vec(&expected),
                    "{session} through replica {i}: byte for byte"
                );
            }
        }
    }

    /// Stops the load, waits for every work session to finish, and checks the whole run
    /// (the module's head says what).
    pub async fn finish(self) {
        self.newer_served_whole(&self.replicas).await;
        let Skew {
            replicas,
            mut runners,
            clients,
            standin,
            counter,
            appender,
            followers,
            work,
            mut story,
            ..
        } = self;
        let this = SkewEnd {
            replicas: &replicas,
            clients,
        };
        let acked = appender.finish().await;

        // Every work session finishes, and ran each call once (again only after a kill).
        for session in &work {
            this.wait_idle(session).await;
        }
        let reported = counter.counts();
        let mut calls = BTreeSet::new();
        let mut reruns = 0;
        for session in &work {
            let events = this.log(0, session).await;
            let starts = assert_exactly_once(&events);
            let ids = tool_use_ids(&events);
            assert_eq!(ids.len(), STEPS, "{session}: {:?}", kinds(&events));
            for id in ids {
                let key = format!("{session}/{id}");
                let ran = reported.get(&key).copied().unwrap_or(0);
                let started = starts.get(&id).copied().unwrap_or(0);
                assert!(
                    ran <= started,
                    "{key} ran {ran} times but was started {started} times: a run again needs \
                     a tool_started of its own: {:?}",
                    kinds(&events)
                );
                assert!(ran >= 1 || started > 1, "{key} never completed a run");
                let attempts: Vec<u32> = events
                    .iter()
                    .filter_map(|e| match &e.kind {
                        Some(Kind::ToolStarted(s)) if s.tool_use_id == id => Some(s.attempt),
                        _ => None,
                    })
                    .collect();
                assert_eq!(
                    attempts,
                    (1..=started as u32).collect::<Vec<_>>(),
                    "{key}: each run again is the next attempt"
                );
                reruns += started - 1;
                calls.insert(key);
            }
        }
        let strays: Vec<&String> = reported.keys().filter(|k| !calls.contains(*k)).collect();
        assert!(strays.is_empty(), "runs of calls no log holds: {strays:?}");
        assert_eq!(standin.violations(), Vec::<String>::new());

        // Every acknowledged append, through every replica; every replica the same events.
        let mut total = 0;
        for (session, ids) in &acked {
            for replica in 0..replicas.len() {
                let events = this.log(replica, session).await;
                integration_tests::assert_log_holds(
                    &format!("{session} through replica {replica}"),
                    &events,
                    ids,
                );
            }
            total += ids.len();
        }
        let sessions: Vec<&String> = acked.keys().chain(work.iter()).collect();
        for session in &sessions {
            let first = this.log(0, session).await;
            for replica in 1..replicas.len() {
                assert!(
                    this.log(replica, session).await == first,
                    "{session}: replicas 0 and {replica} serve different events"
                );
            }
        }
        for follower in &followers {
            let log = this.log(follower.replica, &follower.session).await;
            follower.wait_for(&log).await;
        }

        for runner in &mut runners {
            runner.proc.kill9();
        }
        story.push(format!(
            "{total} appends acknowledged, each in its log at its seq through {} replica(s); \
             {} sessions worked, {} calls, none run twice ({reruns} started again after a \
             kill); {} followers saw every event",
            replicas.len(),
            work.len(),
            calls.len(),
            followers.len()
        ));
        println!("SKEW ({} beside {}):", Build::This, Build::Previous);
        for line in &story {
            println!("  {line}");
        }
    }
}

/// What [`Skew::finish`] reads through, once the load has stopped.
struct SkewEnd<'a> {
    replicas: &'a [Replica],
    clients: Vec<StoreClient>,
}

impl SkewEnd<'_> {
    async fn log(&self, replica: usize, session: &str) -> Vec<Event> {
        agentlog_client::log::read_log(&mut self.clients[replica].clone(), session)
            .await
            .unwrap_or_else(|e| {
                panic!(
                    "{session}: read through replica {replica} ({}): {e}",
                    self.replicas[replica].build
                )
            })
    }

    /// Waits until the session is idle with its final reply logged.
    async fn wait_idle(&self, session: &str) {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let info = self.clients[0]
                .clone()
                .get_session(GetSessionRequest {
                    session_id: session.into(),
                })
                .await
                .map(|r| r.into_inner());
            if info
                .as_ref()
                .is_ok_and(|i| i.status == SessionStatus::Idle as i32)
            {
                let events = self.log(0, session).await;
                let last = events
                    .iter()
                    .rev()
                    .find(|e| !matches!(e.kind, Some(Kind::AssistantDelta(_))));
                if matches!(last.and_then(|e| e.kind.as_ref()), Some(Kind::AssistantMessage(m)) if m.stop_reason == "end_turn")
                {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "{session} is stuck: not idle within {PATIENCE:?}: {:?}",
                kinds(&self.log(0, session).await)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// An admin client of `store`, reconnecting to its address whenever it is gone.
fn admin(store: &Store) -> StoreClient {
    StoreConnection {
        url: store.url(),
        token: Some(BearerToken::new(ADMIN_TOKEN).expect("a token")),
        ..StoreConnection::default()
    }
    .client()
    .expect("a client")
}

/// A live follower of one session through one replica (the client's reconnecting one),
/// keeping every event it was handed.
struct Follower {
    replica: usize,
    session: String,
    events: Arc<Mutex<Vec<Event>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Follower {
    fn start(client: StoreClient, replica: usize, session: &str) -> Follower {
        let events = Arc::new(Mutex::new(Vec::new()));
        let kept = events.clone();
        let name = session.to_string();
        let task = tokio::spawn(async move {
            let _ = follow(
                &client,
                &name,
                1,
                Refusals::Retry,
                |_| {},
                |event| {
                    lock(&kept).push(event);
                    async { Ok::<_, std::convert::Infallible>(Flow::Continue) }
                },
            )
            .await;
        });
        Follower {
            replica,
            session: session.into(),
            events,
            task,
        }
    }

    /// Waits until it was handed the whole of `log`, and checks it was handed exactly that.
    async fn wait_for(&self, log: &[Event]) {
        let deadline = Instant::now() + PATIENCE;
        while lock(&self.events).len() < log.len() {
            assert!(
                Instant::now() < deadline,
                "the follower of {} through replica {} has {} of {} events",
                self.session,
                self.replica,
                lock(&self.events).len(),
                log.len()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(
            lock(&self.events).as_slice() == log,
            "the follower of {} through replica {} was handed other events than the log holds",
            self.session,
            self.replica
        );
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(|p| p.into_inner())
}

/// A plain channel to `store` (for the later release's writer, which speaks raw gRPC).
async fn channel_of(store: &Store) -> tonic::transport::Channel {
    tonic::transport::Channel::from_shared(store.url())
        .expect("a store's URL")
        .connect()
        .await
        .expect("connect to the store")
}
