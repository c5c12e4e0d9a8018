//! SearchSessions against the real `event-store` (over PostgreSQL with
//! `AGENTLOG_TEST_BACKEND=postgres`). The invariants:
//! - **What is found:** every word of the query in one event, whole words, any case, no
//!   stemming; `prefix*`; "phrases" in order; in user text, assistant text, tool inputs and
//!   tool outputs, never in deltas; newest first; pages that together hold every hit once.
//! - **Fresh:** an acknowledged event is found (eventually here: how soon is the bench's,
//!   `bench/RESULTS.md`).
//! - **Forgotten:** a deleted session is never found from the moment `DeleteSession`
//!   returns, across a `kill -9` right after it too; its words then leave the index's files
//!   (local: no file of the data directory holds them; PostgreSQL: no row of it is left).
//! - **Crash-proof:** after a `kill -9` in the middle of appends, every acknowledged event
//!   is found as soon as the restarted store answers, and no hit names an event its log
//!   does not hold; an index removed whole is rebuilt from the log (on every core: what a
//!   session deleted in it held is forgotten there too).
//! - **Forks:** a fork's prefix is found in the fork, and stays found when its parent goes.
//! - **Imports:** an imported session is found as it would be where it was written, under
//!   its own id only (never under the staging session its events went through).
//! - **Bad input** is `INVALID_ARGUMENT` saying which: an empty query, an unclosed quote, a
//!   query over 1 KiB, a page size over 100, a token not ours. The store refuses to start
//!   with a commit period of the index (the bench's `--search-commit-every`) of no time, or
//!   where there is no local index to commit.
//!
//! Tenancy (a token sees only its scope's hits) is in `security_tenants.rs`.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::{
    content_block, event, AcquireLeaseRequest, AppendRequest, AssistantDelta, AssistantMessage,
    ContentBlock, DeleteSessionRequest, Event, ExportRequest, ForkSessionRequest, ImportChunk,
    ImportOutcome, SearchHit, SearchSessionsRequest, TextBlock, ToolResult, ToolUseBlock,
};
use anyhow::{ensure, Context, Result};
use integration_tests::{bin_path, read_log, test_backend_is_postgres, user_event, Backing, Store};
use tonic::transport::Channel;
use tonic::Code;

/// A bound for what must happen eventually (never an assertion on speed).
const BOUND: Duration = Duration::from_secs(20);

type Client = EventStoreClient<Channel>;

async fn search_page(
    client: &mut Client,
    query: &str,
    page_size: u32,
    page_token: &str,
) -> Result<(Vec<SearchHit>, String), tonic::Status> {
    let page = client
        .search_sessions(SearchSessionsRequest {
            query: query.into(),
            page_size,
            page_token: page_token.into(),
        })
        .await?
        .into_inner();
    Ok((page.hits, page.next_page_token))
}

/// Every hit of `query`, page after page of `page_size`.
async fn search_all(client: &mut Client, query: &str, page_size: u32) -> Result<Vec<SearchHit>> {
    let mut hits = Vec::new();
    let mut token = String::new();
    loop {
        let (page, next) = search_page(client, query, page_size, &token).await?;
        hits.extend(page);
        if next.is_empty() {
            return Ok(hits);
        }
        token = next;
    }
}

/// Where `query` is found: (session, seq) of each hit, in order.
async fn found(client: &mut Client, query: &str) -> Result<Vec<(String, u64)>> {
    Ok(search_all(client, query, 100)
        .await?
        .into_iter()
        .map(|h| (h.session_id, h.seq))
        .collect())
}

/// Waits until `query` finds exactly `want` (in that order, or in any with `any_order`:
/// events of the same time in two sessions, such as a fork's prefix, may come either way).
async fn eventually_found(client: &mut Client, query: &str, want: &[(&str, u64)]) -> Result<()> {
    eventually_found_in(client, query, want, false).await
}

async fn eventually_found_in(
    client: &mut Client,
    query: &str,
    want: &[(&str, u64)],
    any_order: bool,
) -> Result<()> {
    let mut want: Vec<(String, u64)> = want.iter().map(|(s, q)| (s.to_string(), *q)).collect();
    if any_order {
        want.sort();
    }
    let deadline = Instant::now() + BOUND;
    loop {
        let mut got = found(client, query).await?;
        if any_order {
            got.sort();
        }
        if got == want {
            return Ok(());
        }
        ensure!(
            Instant::now() < deadline,
            "{query:?} finds {got:?}, not {want:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn append(
    client: &mut Client,
    session_id: &str,
    events: Vec<Event>,
    epoch: Option<u64>,
) -> Result<u64> {
    Ok(client
        .append(AppendRequest {
            session_id: session_id.into(),
            events,
            lease_epoch: epoch,
            ..Default::default()
        })
        .await?
        .into_inner()
        .last_seq)
}

async fn lease(client: &mut Client, session_id: &str) -> Result<u64> {
    Ok(client
        .acquire_lease(AcquireLeaseRequest {
            session_id: session_id.into(),
            owner: "test-runner".into(),
            ttl_ms: 60_000,
        })
        .await?
        .into_inner()
        .epoch)
}

fn kind(kind: event::Kind) -> Event {
    Event {
        kind: Some(kind),
        ..Default::default()
    }
}

fn reply(text: &str, command: Option<&str>) -> Event {
    let mut content = vec![ContentBlock {
        block: Some(content_block::Block::Text(TextBlock { text: text.into() })),
    }];
    if let Some(command) = command {
        content.push(ContentBlock {
            block: Some(content_block::Block::ToolUse(ToolUseBlock {
                id: "toolu_1".into(),
                name: "bash".into(),
                input: Some(prost_types::Struct {
                    fields: [(
                        "command".to_string(),
                        prost_types::Value {
                            kind: Some(prost_types::value::Kind::StringValue(command.into())),
                        },
                    )]
                    .into(),
                }),
            })),
        });
    }
    kind(event::Kind::AssistantMessage(AssistantMessage {
        content,
        stop_reason: if command.is_some() {
            "tool_use"
        } else {
            "end_turn"
        }
        .into(),
        ..Default::default()
    }))
}

fn tool_output(text: &str) -> Event {
    kind(event::Kind::ToolResult(ToolResult {
        tool_use_id: "toolu_1".into(),
        content: text.into(),
        ..Default::default()
    }))
}

fn delta(text: &str) -> Event {
    kind(event::Kind::AssistantDelta(AssistantDelta {
        turn_id: "1".into(),
        text: text.into(),
    }))
}

/// A session of a user turn, a delta, a reply calling bash, its output and a final reply.
async fn incident(client: &mut Client, session_id: &str) -> Result<()> {
    append(
        client,
        session_id,
        vec![user_event("u1", "Please clean up the Staging cluster")],
        None,
    )
    .await?;
    let epoch = lease(client, session_id).await?;
    append(
        client,
        session_id,
        vec![
            delta("thinking about deltaonlyword"),
            reply("Running it now.", Some("terraform destroy -auto-approve")),
            tool_output("Destroy complete! Resources: 12 destroyed."),
            reply(
                "The staging cluster is gone; the tests were flaky anyway.",
                None,
            ),
        ],
        Some(epoch),
    )
    .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn words_phrases_and_prefixes_are_found_in_what_people_read_newest_first() -> Result<()> {
    let store = Store::start()?;
    let mut client = store.client().await?;
    incident(&mut client, "ops-1").await?;
    // Seqs: 1 user, 2 delta, 3 reply with the bash call, 4 output, 5 final reply.
    eventually_found(&mut client, "terraform", &[("ops-1", 3)]).await?;

    // The same event's tool input and output are found by what a person would type.
    assert_eq!(
        found(&mut client, "TERRAFORM destroy").await?,
        [("ops-1".into(), 3)]
    );
    assert_eq!(
        found(&mut client, "\"terraform destroy\"").await?,
        [("ops-1".into(), 3)]
    );
    assert_eq!(found(&mut client, "\"destroy terraform\"").await?, []);
    assert_eq!(
        found(&mut client, "terraform-destroy").await?,
        [("ops-1".into(), 3)]
    );
    assert_eq!(
        found(&mut client, "destroyed resources").await?,
        [("ops-1".into(), 4)]
    );
    // All words in one event: "cluster" and "complete" are in different events.
    assert_eq!(found(&mut client, "cluster complete").await?, []);
    // Whole words, no stemming; a prefix with *.
    assert_eq!(found(&mut client, "terra").await?, []);
    assert_eq!(found(&mut client, "test").await?, []);
    assert_eq!(found(&mut client, "flak*").await?, [("ops-1".into(), 5)]);
    // Newest first: "staging" is in the user turn and the final reply.
    assert_eq!(
        found(&mut client, "staging").await?,
        [("ops-1".into(), 5), ("ops-1".into(), 1)]
    );
    // Never in deltas.
    assert_eq!(found(&mut client, "deltaonlyword").await?, []);

    let hits = search_all(&mut client, "destroy", 100).await?;
    let kinds: Vec<&str> = hits.iter().map(|h| h.kind.as_str()).collect();
    assert_eq!(kinds, ["tool_result", "assistant_message"]);
    assert!(
        hits[0].snippet.contains("Destroy complete"),
        "{:?}",
        hits[0].snippet
    );
    assert!(
        hits[1].snippet.contains("terraform destroy -auto-approve"),
        "{:?}",
        hits[1].snippet
    );
    assert!(hits.iter().all(|h| h.ts_unix_ms > 0));

    // Pages: three sessions, each with the word twice; pages of two hold every hit once,
    // newest first.
    for i in 0..3 {
        let id = format!("page-{i}");
        append(
            &mut client,
            &id,
            vec![user_event("", "pagedword one")],
            None,
        )
        .await?;
        append(
            &mut client,
            &id,
            vec![user_event("", "pagedword two")],
            None,
        )
        .await?;
    }
    eventually_found(
        &mut client,
        "pagedword",
        &[
            ("page-2", 2),
            ("page-2", 1),
            ("page-1", 2),
            ("page-1", 1),
            ("page-0", 2),
            ("page-0", 1),
        ],
    )
    .await?;
    let paged: Vec<(String, u64)> = search_all(&mut client, "pagedword", 2)
        .await?
        .into_iter()
        .map(|h| (h.session_id, h.seq))
        .collect();
    assert_eq!(paged, found(&mut client, "pagedword").await?);
    let (first, token) = search_page(&mut client, "pagedword", 1, "").await?;
    assert_eq!(first.len(), 1);
    assert!(!token.is_empty());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_queries_are_invalid_argument_saying_which() -> Result<()> {
    let store = Store::start()?;
    let mut client = store.client().await?;
    for (query, page_size, token, says) in [
        ("", 0, "", "empty"),
        ("   \t ", 0, "", "empty"),
        ("\"terraform destroy", 0, "", "not closed"),
        (&"x".repeat(1025) as &str, 0, "", "over the limit of 1024"),
        ("!!! ***", 0, "", "no word"),
        ("word", 101, "", "page_size"),
        ("word", 0, "not-a-token", "page_token"),
    ] {
        let status = search_page(&mut client, query, page_size, token)
            .await
            .expect_err("refused");
        assert_eq!(
            status.code(),
            Code::InvalidArgument,
            "{query:?}: {status:?}"
        );
        assert!(
            status.message().contains(says),
            "{query:?}: {}",
            status.message()
        );
    }
    // A query of exactly 1 KiB is fine.
    search_page(&mut client, &"x ".repeat(512), 0, "")
        .await
        .expect("1 KiB is allowed");
    Ok(())
}

/// The words of `text` that must be gone from the store's files (local) or rows
/// (PostgreSQL) once `session_id` is erased.
#[test]
fn a_commit_period_of_no_time_or_without_a_local_index_is_refused_at_start() {
    let dir = tempfile::tempdir().expect("tempdir");
    let data = dir.path().to_str().expect("utf-8");
    for (args, says) in [
        (
            vec!["--data-dir", data, "--search-commit-every", "0ms"],
            "no time at all",
        ),
        (
            vec![
                "--data-dir",
                data,
                "--search-commit-every",
                "1s",
                "--no-search-index",
            ],
            "cannot be used with",
        ),
        (
            vec![
                "--database-url",
                "postgres://u@h/db",
                "--search-commit-every",
                "1s",
            ],
            "cannot be used with",
        ),
    ] {
        let out = std::process::Command::new(bin_path("event-store"))
            .args(&args)
            .stdin(std::process::Stdio::null())
            .output()
            .expect("run event-store");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "it started with {args:?}");
        assert!(
            stderr.contains("--search-commit-every") && stderr.contains(says),
            "{args:?}: {stderr}"
        );
    }
}

async fn words_left(store: &Store, session_id: &str, word: &str) -> Result<Vec<String>> {
    Ok(match &store.backing {
        Backing::Dir(dir) => holding(dir, word),
        Backing::Database(url, Some(pg)) => {
            let db = url.rsplit('/').next().unwrap_or_default();
            let rows = pg.psql(
                db,
                &format!(
                    "SELECT count(*) FROM agentlog_search WHERE session_id = '{session_id}' \
                     OR words @@ '{word}'::tsquery"
                ),
            )?;
            if rows == "0" {
                Vec::new()
            } else {
                vec![format!("{rows} rows")]
            }
        }
        Backing::Database(_, None) => anyhow::bail!("no server to look into"),
    })
}

/// Every file under `dir` holding `word`, as written or backwards (a term dictionary may
/// store a word's bytes in either order).
fn holding(dir: &std::path::Path, word: &str) -> Vec<String> {
    let forward = word.as_bytes().to_vec();
    let backward: Vec<u8> = forward.iter().rev().copied().collect();
    let mut found = Vec::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if let Ok(bytes) = std::fs::read(&path) {
                if bytes
                    .windows(forward.len())
                    .any(|w| w == forward || w == backward)
                {
                    found.push(path.display().to_string());
                }
            }
        }
    }
    found
}

/// The documents the committed segments of a local index hold, and how many of them are
/// marked deleted (read from tantivy's `meta.json`).
fn documents_in(search_dir: &std::path::Path) -> Result<(u64, u64)> {
    let meta: serde_json::Value =
        serde_json::from_slice(&std::fs::read(search_dir.join("meta.json"))?)?;
    let segments = meta["segments"].as_array().context("meta.json: segments")?;
    Ok(segments.iter().fold((0, 0), |(documents, deleted), s| {
        (
            documents + s["max_doc"].as_u64().unwrap_or(0),
            deleted + s["deletes"]["num_deleted_docs"].as_u64().unwrap_or(0),
        )
    }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_session_is_never_found_again_and_its_words_leave_the_index() -> Result<()> {
    // The local log reclaims the session's records soon, so that only the index could
    // still hold its words.
    let mut store = Store::start_with(&["--reclaim-after", "100ms", "--segment-bytes", "65536"])?;
    let mut client = store.client().await?;
    append(
        &mut client,
        "keep",
        vec![user_event("", "quokkaword stays")],
        None,
    )
    .await?;
    append(
        &mut client,
        "doomed",
        vec![user_event("", "xylophonezebra was typed here quokkaword")],
        None,
    )
    .await?;
    eventually_found(&mut client, "quokkaword", &[("doomed", 1), ("keep", 1)]).await?;
    ensure!(
        !words_left(&store, "doomed", "xylophonezebra")
            .await?
            .is_empty(),
        "the look for the word in the index finds it before the deletion"
    );

    client
        .delete_session(DeleteSessionRequest {
            session_id: "doomed".into(),
        })
        .await?;
    // From the moment DeleteSession returns.
    assert_eq!(found(&mut client, "xylophonezebra").await?, []);
    assert_eq!(
        found(&mut client, "quokkaword").await?,
        [("keep".into(), 1)]
    );

    // A kill -9 right after it brings nothing back.
    store.kill9();
    let store = store.restart()?;
    let mut client = store.client().await?;
    assert_eq!(found(&mut client, "xylophonezebra").await?, []);
    assert_eq!(
        found(&mut client, "quokkaword").await?,
        [("keep".into(), 1)]
    );

    let deadline = Instant::now() + Duration::from_secs(40);
    loop {
        let left = words_left(&store, "doomed", "xylophonezebra").await?;
        if left.is_empty() {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "the deleted session's word is still in {left:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The other session's word is still there, and found.
    ensure!(
        !words_left(&store, "keep", "quokkaword").await?.is_empty() || test_backend_is_postgres()
    );
    assert_eq!(
        found(&mut client, "quokkaword").await?,
        [("keep".into(), 1)]
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_a_kill_9_mid_appends_every_acknowledged_event_is_found_and_nothing_else(
) -> Result<()> {
    let mut store = Store::start()?;
    let mut acked: BTreeMap<String, (String, u64)> = BTreeMap::new();
    let writers: Vec<_> = (0..4)
        .map(|w| {
            let url = store.url();
            tokio::spawn(async move {
                let mut client = EventStoreClient::connect(url).await?;
                let mut acked = Vec::new();
                for i in 0.. {
                    let word = format!("crashword{w}x{i}");
                    let session = format!("crash-{w}");
                    match append(
                        &mut client,
                        &session,
                        vec![user_event("", &format!("{word} common"))],
                        None,
                    )
                    .await
                    {
                        Ok(seq) => acked.push((word, (session, seq))),
                        Err(_) => break,
                    }
                }
                Ok::<_, anyhow::Error>(acked)
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(1500)).await;
    store.kill9();
    for writer in writers {
        acked.extend(writer.await??);
    }
    ensure!(
        acked.len() > 20,
        "only {} appends were acknowledged",
        acked.len()
    );

    let store = store.restart()?;
    let mut client = store.client().await?;
    // Found as soon as the store answers: the index caught up with the log at open.
    for (word, (session, seq)) in &acked {
        assert_eq!(
            found(&mut client, word).await?,
            [(session.clone(), *seq)],
            "{word}"
        );
    }
    // No phantom: every hit of the common word is an event of its session's log.
    let hits = found(&mut client, "common").await?;
    let mut logs: BTreeMap<String, Vec<u64>> = BTreeMap::new();
    for w in 0..4 {
        let session = format!("crash-{w}");
        let log = read_log(&mut client, &session).await;
        logs.insert(session, log.iter().map(|e| e.seq).collect());
    }
    for (session, seq) in &hits {
        ensure!(
            logs[session].contains(seq),
            "a hit {session}/{seq} its log does not hold"
        );
    }
    let total: usize = logs.values().map(Vec::len).sum();
    assert_eq!(hits.len(), total, "every event of the logs is found once");

    // An index removed whole (local) is rebuilt from the log at the next start.
    if let Backing::Dir(dir) = store.backing.clone() {
        let mut store = store;
        store.kill9();
        std::fs::remove_dir_all(dir.join("search")).context("removing the index")?;
        let store = store.restart()?;
        let mut client = store.client().await?;
        assert_eq!(found(&mut client, "common").await?.len(), total);
        let (word, (session, seq)) = acked.iter().next().expect("one acked");
        assert_eq!(found(&mut client, word).await?, [(session.clone(), *seq)]);
    }
    Ok(())
}

/// A rebuild of a log over a MiB runs on every core (local), with its merges left to the
/// writer that follows the log after it: it finds every event the log holds once, none of a
/// session deleted in the middle of it (the tombstone among the others' appends, right
/// after the session's own), whose words then leave the index's files, and what is appended
/// after it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rebuild_on_every_core_finds_the_log_and_forgets_what_was_deleted_in_it() -> Result<()> {
    if test_backend_is_postgres() {
        return Ok(());
    }
    let mut store = Store::start()?;
    let mut client = store.client().await?;
    // ~7 KB of words an event, over 400 events: ~3 MiB of log.
    let filler = (0..1_000)
        .map(|i| format!("filler{}", i % 97))
        .collect::<Vec<_>>()
        .join(" ");
    let mut kept = Vec::new();
    for i in 0..400 {
        let session = format!("long-{}", i % 4);
        let word = format!("longword{i}");
        let text = format!("{word} {filler} everywhere");
        let seq = append(&mut client, &session, vec![user_event("", &text)], None).await?;
        kept.push((word, session, seq));
        if i == 200 {
            for _ in 0..3 {
                let text = format!("gonewordqx {filler} everywhere");
                append(&mut client, "gone", vec![user_event("", &text)], None).await?;
            }
            client
                .delete_session(DeleteSessionRequest {
                    session_id: "gone".into(),
                })
                .await?;
        }
    }
    let dir = store.data_dir.clone();
    store.kill9();
    std::fs::remove_dir_all(dir.join("search")).context("removing the index")?;

    let store = store.restart()?;
    let mut client = store.client().await?;
    for (word, session, seq) in kept.iter().step_by(7) {
        assert_eq!(
            found(&mut client, word).await?,
            [(session.clone(), *seq)],
            "{word}"
        );
    }
    assert_eq!(found(&mut client, "gonewordqx").await?, []);
    assert_eq!(
        search_all(&mut client, "everywhere", 100).await?.len(),
        kept.len(),
        "every event of the log found once"
    );
    // The deleted session's documents leave the files: the index's segments hold the kept
    // events and nothing else, none of them marked deleted.
    let deadline = Instant::now() + BOUND;
    loop {
        let (documents, deleted) = documents_in(&dir.join("search"))?;
        if (documents, deleted) == (kept.len() as u64, 0) {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "the index's segments hold {documents} documents, {deleted} of them deleted, \
             not the {} kept events alone",
            kept.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    append(
        &mut client,
        "long-0",
        vec![user_event("", "afterwordqz everywhere")],
        None,
    )
    .await?;
    eventually_found(&mut client, "afterwordqz", &[("long-0", 101)]).await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_forks_prefix_is_found_in_the_fork_and_outlives_its_parent() -> Result<()> {
    let store = Store::start()?;
    let mut client = store.client().await?;
    append(
        &mut client,
        "parent",
        vec![user_event("", "pangolinword at the start")],
        None,
    )
    .await?;
    append(
        &mut client,
        "parent",
        vec![user_event("", "later words")],
        None,
    )
    .await?;
    client
        .fork_session(ForkSessionRequest {
            session_id: "parent".into(),
            at_seq: 1,
            new_session_id: "child".into(),
            events: vec![user_event("", "pangolinword in the fork")],
        })
        .await?;
    eventually_found_in(
        &mut client,
        "pangolinword",
        &[("child", 2), ("child", 1), ("parent", 1)],
        true,
    )
    .await?;
    client
        .delete_session(DeleteSessionRequest {
            session_id: "parent".into(),
        })
        .await?;
    assert_eq!(
        found(&mut client, "pangolinword").await?,
        [("child".into(), 2), ("child".into(), 1)]
    );
    let hits = search_all(&mut client, "pangolinword start", 10).await?;
    assert_eq!(hits.len(), 1);
    assert_eq!((hits[0].session_id.as_str(), hits[0].seq), ("child", 1));
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_9_at_any_moment_of_an_erasure_brings_nothing_back() -> Result<()> {
    // Killed at a spread of moments after DeleteSession returned: before the index read the
    // tombstone, between its delete's commit and the merge, in the merge, after it.
    let mut store = Store::start_with(&["--reclaim-after", "100ms", "--segment-bytes", "65536"])?;
    let mut rng = fastrand::Rng::with_seed(39);
    for i in 0..6 {
        let mut client = store.client().await?;
        let word = format!("vanishword{i}q");
        append(
            &mut client,
            &format!("gone-{i}"),
            vec![user_event("", &format!("{word} alpacaword"))],
            None,
        )
        .await?;
        append(
            &mut client,
            &format!("kept-{i}"),
            vec![user_event("", "alpacaword kept")],
            None,
        )
        .await?;
        eventually_found_in(
            &mut client,
            "alpacaword",
            &(0..=i)
                .map(|k| (format!("kept-{k}"), 1))
                .chain(std::iter::once((format!("gone-{i}"), 1)))
                .collect::<Vec<_>>()
                .iter()
                .map(|(s, q)| (s.as_str(), *q))
                .collect::<Vec<_>>(),
            true,
        )
        .await?;
        client
            .delete_session(DeleteSessionRequest {
                session_id: format!("gone-{i}"),
            })
            .await?;
        tokio::time::sleep(Duration::from_millis(rng.u64(0..600))).await;
        store.kill9();
        store = store.restart()?;
        let mut client = store.client().await?;
        for k in 0..=i {
            assert_eq!(
                found(&mut client, &format!("vanishword{k}q")).await?,
                [],
                "gone-{k} came back"
            );
        }
        assert_eq!(found(&mut client, "alpacaword").await?.len(), i + 1);
    }
    let deadline = Instant::now() + Duration::from_secs(40);
    for i in 0..6 {
        let word = format!("vanishword{i}q");
        loop {
            let left = words_left(&store, &format!("gone-{i}"), &word).await?;
            if left.is_empty() {
                break;
            }
            ensure!(Instant::now() < deadline, "{word} is still in {left:?}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_imported_session_is_found_under_its_own_id_only() -> Result<()> {
    let source = Store::start()?;
    let mut from = source.client().await?;
    append(
        &mut from,
        "moved",
        vec![user_event("", "okapiword travelled here")],
        None,
    )
    .await?;
    let mut export = from
        .export(ExportRequest {
            session_ids: vec!["moved".into()],
            all: false,
        })
        .await?
        .into_inner();
    let mut text = String::new();
    while let Some(piece) = export.message().await? {
        text.push_str(&piece.text);
    }
    let target = Store::start()?;
    let mut to = target.client().await?;
    let mut results = to
        .import(tokio_stream::iter(vec![ImportChunk { text }]))
        .await?
        .into_inner();
    let result = results.message().await?.context("an import result")?;
    ensure!(
        result.outcome == ImportOutcome::Imported as i32,
        "imported: {result:?}"
    );
    eventually_found(&mut to, "okapiword", &[("moved", 1)]).await?;
    // The indexer has passed the staging session's events by now: none of them is a hit.
    append(
        &mut to,
        "after",
        vec![user_event("", "okapiword later")],
        None,
    )
    .await?;
    eventually_found(&mut to, "okapiword", &[("after", 1), ("moved", 1)]).await?;
    Ok(())
}

/// PostgreSQL only (the local index rebuilt from its log is tested above): a database
/// migrated to the search schema (version 9) holds no search rows for the sessions written
/// before it, only their names in `agentlog_search_backfill`. A store started on it writes
/// their rows in the background: every event is found, one session longer than a backfill
/// statement's read included, and a deleted session listed there never is.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sessions_written_before_the_search_schema_are_found_once_backfilled() -> Result<()> {
    if !test_backend_is_postgres() {
        return Ok(());
    }
    let mut store = Store::start()?;
    let mut client = store.client().await?;
    // 1,200 events: more than one backfill statement reads (1,000).
    for batch in 0..12u64 {
        let events = (1..=100u64)
            .map(|i| {
                let seq = batch * 100 + i;
                let word = if seq == 1 || seq == 1_200 {
                    " numbatword"
                } else {
                    ""
                };
                user_event("", &format!("event {seq}{word}"))
            })
            .collect();
        append(&mut client, "long-before", events, None).await?;
    }
    append(
        &mut client,
        "tools-before",
        vec![user_event("", "where is numbatword?")],
        None,
    )
    .await?;
    let epoch = lease(&mut client, "tools-before").await?;
    append(
        &mut client,
        "tools-before",
        vec![
            reply("let me look", Some("grep -r numbatword .")),
            tool_output("./notes: numbatword"),
        ],
        Some(epoch),
    )
    .await?;
    append(
        &mut client,
        "gone-before",
        vec![user_event("", "numbatword")],
        None,
    )
    .await?;
    client
        .delete_session(DeleteSessionRequest {
            session_id: "gone-before".into(),
        })
        .await?;
    let want = [
        ("tools-before", 3),
        ("tools-before", 2),
        ("tools-before", 1),
        ("long-before", 1_200),
        ("long-before", 1),
    ];
    eventually_found(&mut client, "numbatword", &want).await?;
    store.terminate()?;

    // What the migration to version 9 leaves of a database written before it, with the
    // deleted session listed too (an older replica may delete one after the listing).
    let Backing::Database(url, Some(pg)) = &store.backing else {
        anyhow::bail!("a PostgreSQL-backed store without its server");
    };
    let db = url.rsplit('/').next().unwrap_or_default();
    pg.psql(
        db,
        "DELETE FROM agentlog_search; \
         INSERT INTO agentlog_search_backfill (session_id) \
             SELECT session_id FROM agentlog_sessions ON CONFLICT DO NOTHING",
    )?;
    ensure!(pg.psql(db, "SELECT count(*) FROM agentlog_search_backfill")? == "3");

    let store = store.restart()?;
    let mut client = store.client().await?;
    eventually_found(&mut client, "numbatword", &want).await?;
    let deadline = Instant::now() + BOUND;
    while pg.psql(db, "SELECT count(*) FROM agentlog_search_backfill")? != "0" {
        ensure!(Instant::now() < deadline, "sessions are left to backfill");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The deleted session: no rows written for it, or, deleted while its rows were being
    // written, none left once its erasure has run.
    let left = "SELECT count(*) FROM agentlog_search WHERE session_id = 'gone-before'";
    while pg.psql(db, left)? != "0" {
        ensure!(
            Instant::now() < deadline,
            "a deleted session's rows were written back"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Ok(())
}
