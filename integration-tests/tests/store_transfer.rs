//! Export and Import against the real `event-store` (either backend:
//! `AGENTLOG_TEST_BACKEND`), as the README's "Sessions that move" promises:
//! - an export of every session imported into another store recreates each exactly (the
//!   same `SessionInfo` but the lease, the same events, a fork with its `forkedFrom`, a pin,
//!   a deleted id that stays deleted), and each goes on there as if it had always lived
//!   there: dedup of its event ids, seqs going on;
//! - importing again changes nothing, also once a session went on after the export; a
//!   session whose log differs is refused for itself alone (`ALREADY_EXISTS`, naming it);
//! - a line that does not parse, a seq gap, a missing end line or a wrong checksum refuses
//!   that session, naming the line, and the others go on; a text that is no export is
//!   refused whole;
//! - the store killed (`kill -9`) in the middle of a session's import leaves nothing of it
//!   visible, and the same import then goes through.

use std::time::Duration;

use agentlog_proto::reason::Reason;
use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::{
    content_block::Block, event, AcquireLeaseRequest, AppendRequest, ApprovalRequested,
    AssistantMessage, ContentBlock, DeleteSessionRequest, Event, ExportRequest, ForkSessionRequest,
    GetSessionRequest, ImportChunk, ImportOutcome, ImportResult, ListSessionsRequest,
    PinSessionRequest, SessionInfo, TextBlock, ToolResult, ToolStarted, ToolUseBlock, Usage,
};
use anyhow::{bail, Context, Result};
use integration_tests::{read_log, user_event, Store};
use tonic::transport::Channel;
use tonic::Code;

type Client = EventStoreClient<Channel>;

/// The whole export the store gives for `req`.
async fn export(client: &mut Client, session_ids: &[&str], all: bool) -> Result<String> {
    let mut stream = client
        .clone()
        .max_decoding_message_size(16 << 20)
        .export(ExportRequest {
            session_ids: session_ids.iter().map(|s| s.to_string()).collect(),
            all,
        })
        .await?
        .into_inner();
    let mut text = String::new();
    while let Some(piece) = stream.message().await? {
        text.push_str(&piece.text);
    }
    Ok(text)
}

/// Imports `text`, sent in pieces of `piece` bytes (cut anywhere between characters), and
/// returns every result, or the status that refused the whole import.
async fn import(
    client: &mut Client,
    text: &str,
    piece: usize,
) -> Result<Vec<ImportResult>, tonic::Status> {
    let mut pieces = Vec::new();
    let mut rest = text;
    while !rest.is_empty() {
        let mut cut = piece.min(rest.len());
        while !rest.is_char_boundary(cut) {
            cut += 1;
        }
        pieces.push(ImportChunk {
            text: rest[..cut].to_string(),
        });
        rest = &rest[cut..];
    }
    let mut results = client
        .import(tokio_stream::iter(pieces))
        .await?
        .into_inner();
    let mut all = Vec::new();
    while let Some(result) = results.message().await? {
        all.push(result);
    }
    Ok(all)
}

fn outcomes(results: &[ImportResult]) -> Vec<(String, ImportOutcome)> {
    let mut outcomes: Vec<(String, ImportOutcome)> = results
        .iter()
        .map(|r| (r.session_id.clone(), r.outcome()))
        .collect();
    outcomes.sort();
    outcomes
}

async fn info(client: &mut Client, id: &str) -> Result<SessionInfo, tonic::Status> {
    Ok(client
        .get_session(GetSessionRequest {
            session_id: id.into(),
        })
        .await?
        .into_inner())
}

fn without_lease(mut info: SessionInfo) -> SessionInfo {
    info.lease = None;
    info
}

fn runner(id: &str, kind: event::Kind) -> Event {
    Event {
        event_id: id.into(),
        kind: Some(kind),
        ..Event::default()
    }
}

/// A session of every shape the format must carry: a user turn with awkward text, a reply
/// with thinking, text and a tool call whose input has numbers of every kind, the call's
/// start and result, a final reply; then a fork of it, a pinned one, one waiting for a
/// person, and one deleted.
async fn fill(client: &mut Client) -> Result<()> {
    client
        .append(AppendRequest {
            session_id: "tr-chat".into(),
            events: vec![user_event(
                "u1",
                "fix the \"build\"\n\ttabs, \u{1F600} and \\ slashes",
            )],
            ..Default::default()
        })
        .await?;
    let lease = client
        .acquire_lease(AcquireLeaseRequest {
            session_id: "tr-chat".into(),
            owner: "r1".into(),
            ttl_ms: 60_000,
        })
        .await?
        .into_inner();
    let input = serde_json::json!({"command": "make -j4", "timeout_ms": 5000, "ratio": 0.1,
        "nested": {"list": [1, 2.5, null, true, "x"]}});
    let input =
        agentlog_client::json::object_to_struct(input.as_object().cloned().context("an object")?);
    let call = event::Kind::AssistantMessage(AssistantMessage {
        content: vec![
            ContentBlock {
                block: Some(Block::Thinking(agentlog_proto::v1::ThinkingBlock {
                    thinking: "let me see".into(),
                    signature: "c2lnbmF0dXJl".into(),
                })),
            },
            ContentBlock {
                block: Some(Block::Text(TextBlock {
                    text: "running it".into(),
                })),
            },
            ContentBlock {
                block: Some(Block::ToolUse(ToolUseBlock {
                    id: "toolu_1".into(),
                    name: "bash".into(),
                    input: Some(input),
                })),
            },
        ],
        stop_reason: "tool_use".into(),
        model: "scripted:test".into(),
        usage: Some(Usage {
            input_tokens: 12,
            output_tokens: 7,
            ..Usage::default()
        }),
        message_id: "msg_1".into(),
    });
    let events = vec![
        runner("reply:1", call),
        runner(
            "started:toolu_1:1",
            event::Kind::ToolStarted(ToolStarted {
                tool_use_id: "toolu_1".into(),
                idempotency_key: "tr-chat/toolu_1".into(),
                attempt: 1,
            }),
        ),
        runner(
            "result:toolu_1",
            event::Kind::ToolResult(ToolResult {
                tool_use_id: "toolu_1".into(),
                content: "ok\n".into(),
                is_error: false,
                workspace_checkpoint: Some("abc123".into()),
                served_from: None,
            }),
        ),
        runner(
            "reply:2",
            event::Kind::AssistantMessage(AssistantMessage {
                content: vec![ContentBlock {
                    block: Some(Block::Text(TextBlock {
                        text: "done".into(),
                    })),
                }],
                stop_reason: "end_turn".into(),
                ..AssistantMessage::default()
            }),
        ),
    ];
    client
        .append(AppendRequest {
            session_id: "tr-chat".into(),
            events,
            lease_epoch: Some(lease.epoch),
            ..Default::default()
        })
        .await?;
    client
        .fork_session(ForkSessionRequest {
            session_id: "tr-chat".into(),
            at_seq: 5,
            new_session_id: "tr-fork".into(),
            events: vec![user_event("f1", "and now the tests")],
        })
        .await?;
    for id in ["tr-pinned", "tr-gone", "tr-waiting"] {
        client
            .append(AppendRequest {
                session_id: id.into(),
                events: vec![user_event("", &format!("hello {id}"))],
                ..Default::default()
            })
            .await?;
    }
    client
        .pin_session(PinSessionRequest {
            session_id: "tr-pinned".into(),
            pinned: true,
        })
        .await?;
    client
        .delete_session(DeleteSessionRequest {
            session_id: "tr-gone".into(),
        })
        .await?;
    let lease = client
        .acquire_lease(AcquireLeaseRequest {
            session_id: "tr-waiting".into(),
            owner: "r1".into(),
            ttl_ms: 60_000,
        })
        .await?
        .into_inner();
    client
        .append(AppendRequest {
            session_id: "tr-waiting".into(),
            events: vec![runner(
                "approval:toolu_9:1",
                event::Kind::ApprovalRequested(ApprovalRequested {
                    tool_use_id: "toolu_9".into(),
                    tool_name: "bash".into(),
                    input: None,
                    reason: "bash needs a yes".into(),
                }),
            )],
            lease_epoch: Some(lease.epoch),
            ..Default::default()
        })
        .await?;
    Ok(())
}

const LIVE: [&str; 4] = ["tr-chat", "tr-fork", "tr-pinned", "tr-waiting"];

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_export_imported_elsewhere_is_the_same_sessions_and_they_go_on() -> Result<()> {
    let source = Store::start()?;
    let mut a = source.client().await?;
    fill(&mut a).await?;
    let text = export(&mut a, &[], true).await?;
    let lines: Vec<&str> = text.lines().collect();
    assert!(
        lines[0].starts_with("{\"format\":\"agentlog-export\",\"version\":1"),
        "{}",
        lines[0]
    );
    for line in &lines {
        serde_json::from_str::<serde_json::Value>(line).context("every line is JSON")?;
    }
    assert!(
        text.contains("{\"deleted\":{\"sessionId\":\"tr-gone\""),
        "{text}"
    );

    let target = Store::start()?;
    let mut b = target.client().await?;
    // Pieces of 7 bytes: lines and characters cut anywhere between them.
    let results = import(&mut b, &text, 7).await?;
    assert_eq!(
        outcomes(&results),
        vec![
            ("tr-chat".into(), ImportOutcome::Imported),
            ("tr-fork".into(), ImportOutcome::Imported),
            ("tr-gone".into(), ImportOutcome::Deleted),
            ("tr-pinned".into(), ImportOutcome::Imported),
            ("tr-waiting".into(), ImportOutcome::Imported),
        ],
        "{results:?}"
    );
    for id in LIVE {
        let here = without_lease(info(&mut b, id).await?);
        let there = without_lease(info(&mut a, id).await?);
        assert_eq!(here, there, "{id}'s SessionInfo");
        assert_eq!(
            read_log(&mut b, id).await,
            read_log(&mut a, id).await,
            "{id}'s events"
        );
    }
    assert!(info(&mut b, "tr-pinned").await?.pinned);
    assert_eq!(
        info(&mut b, "tr-fork")
            .await?
            .forked_from
            .map(|f| (f.session_id, f.seq)),
        Some(("tr-chat".to_string(), 5))
    );
    let gone = info(&mut b, "tr-gone").await.expect_err("deleted");
    assert_eq!(Reason::of(&gone), Some(Reason::SessionDeleted), "{gone:?}");
    let listed = b
        .list_sessions(ListSessionsRequest::default())
        .await?
        .into_inner()
        .sessions;
    let mut ids: Vec<&str> = listed.iter().map(|s| s.session_id.as_str()).collect();
    ids.sort_unstable();
    assert_eq!(ids, LIVE, "listed exactly the imported sessions");

    // It goes on as if it had always lived here: an event id it holds is deduplicated to
    // its seq, a new one gets the next seq; the deleted id takes nothing.
    let dup = b
        .append(AppendRequest {
            session_id: "tr-chat".into(),
            events: vec![user_event("u1", "a retry of the first message")],
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!((dup.seqs, dup.last_seq), (vec![1], 5));
    let fork_dup = b
        .append(AppendRequest {
            session_id: "tr-fork".into(),
            events: vec![user_event("u1", "the parent's id, in the fork")],
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!((fork_dup.seqs, fork_dup.last_seq), (vec![1], 6));
    let next = b
        .append(AppendRequest {
            session_id: "tr-chat".into(),
            events: vec![user_event("u2", "next")],
            ..Default::default()
        })
        .await?
        .into_inner();
    assert_eq!(next.seqs, vec![6]);
    let dead = b
        .append(AppendRequest {
            session_id: "tr-gone".into(),
            events: vec![user_event("", "back?")],
            ..Default::default()
        })
        .await
        .expect_err("deleted for good");
    assert_eq!(Reason::of(&dead), Some(Reason::SessionDeleted));

    // Again: nothing changes, tr-chat's going on included.
    let again = import(&mut b, &text, 1 << 20).await?;
    assert!(
        again
            .iter()
            .all(|r| r.outcome() == ImportOutcome::Unchanged),
        "{again:?}"
    );
    assert_eq!(info(&mut b, "tr-chat").await?.last_seq, 6);

    // A named export is the same lines as in the export of all.
    let named = export(&mut a, &["tr-fork"], false).await?;
    let fork_lines: Vec<&str> = named.lines().skip(1).collect();
    let start = lines
        .iter()
        .position(|l| l.starts_with("{\"session\":{\"sessionId\":\"tr-fork\""))
        .context("tr-fork's session line")?;
    assert_eq!(fork_lines, &lines[start..start + fork_lines.len()]);

    // A third store where tr-chat has another log: refused for itself alone, naming it.
    let other = Store::start()?;
    let mut c = other.client().await?;
    c.append(AppendRequest {
        session_id: "tr-chat".into(),
        events: vec![user_event("u1", "something else entirely")],
        ..Default::default()
    })
    .await?;
    let results = import(&mut c, &text, 4096).await?;
    let chat = results
        .iter()
        .find(|r| r.session_id == "tr-chat")
        .context("a result for tr-chat")?;
    assert_eq!(chat.outcome(), ImportOutcome::Refused, "{chat:?}");
    assert_eq!(Code::from_i32(chat.code), Code::AlreadyExists, "{chat:?}");
    assert!(chat.message.contains("tr-chat"), "{chat:?}");
    assert_eq!(
        read_log(&mut c, "tr-chat").await.len(),
        1,
        "nothing of it changed"
    );
    assert_eq!(
        results
            .iter()
            .filter(|r| r.outcome() == ImportOutcome::Imported)
            .count(),
        3,
        "{results:?}"
    );
    Ok(())
}

/// The export of three plain sessions, for the bad-input cases.
async fn three_sessions() -> Result<(Store, String)> {
    let source = Store::start()?;
    let mut a = source.client().await?;
    for id in ["bad-1", "bad-2", "bad-3", "bad-4", "bad-5"] {
        for i in 0..3 {
            a.append(AppendRequest {
                session_id: id.into(),
                events: vec![user_event(&format!("e{i}"), &format!("{id} message {i}"))],
                ..Default::default()
            })
            .await?;
        }
    }
    let text = export(&mut a, &[], true).await?;
    Ok((source, text))
}

/// The line numbers (from 1) of each session's lines: its session line and its end line.
fn spans(text: &str, id: &str) -> (usize, usize) {
    let lines: Vec<&str> = text.lines().collect();
    let start = lines
        .iter()
        .position(|l| l.starts_with(&format!("{{\"session\":{{\"sessionId\":\"{id}\"")))
        .expect("its session line");
    let end = lines
        .iter()
        .position(|l| l.starts_with(&format!("{{\"end\":{{\"sessionId\":\"{id}\"")))
        .expect("its end line");
    (start + 1, end + 1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_line_refuses_its_session_naming_the_line_and_the_others_go_on() -> Result<()> {
    let (_source, text) = three_sessions().await?;
    let mut lines: Vec<String> = text.lines().map(str::to_string).collect();
    let (s1, _) = spans(&text, "bad-1");
    let (s2, _) = spans(&text, "bad-2");
    let (s3, _) = spans(&text, "bad-3");
    let (s5, e5) = spans(&text, "bad-5");
    // bad-1: an event's text changed, its checksum not: the end line is refused.
    lines[s1 + 1] = lines[s1 + 1].replace("bad-1 message 1", "bad-1 message X");
    // bad-2: a line that does not parse.
    lines[s2 + 1] = "{\"seq\": \"2\", \"userMessage\": ".into();
    // bad-3: its second event left out: a seq gap.
    lines[s3 + 1] = String::new();
    // bad-5: the last session, its end line gone.
    lines.truncate(e5 - 1);
    let broken: String = lines
        .iter()
        .filter(|l| !l.is_empty())
        .map(|l| format!("{l}\n"))
        .collect();
    // The line numbers in the broken text (bad-3's missing line moves what follows).
    let target = Store::start()?;
    let mut b = target.client().await?;
    let results = import(&mut b, &broken, 100).await?;
    let by_id = |id: &str| {
        results
            .iter()
            .find(|r| r.session_id == id)
            .unwrap_or_else(|| panic!("a result for {id}: {results:?}"))
            .clone()
    };
    let (_, e1) = spans(&broken, "bad-1");
    let checksum = by_id("bad-1");
    assert_eq!(checksum.outcome(), ImportOutcome::Refused);
    assert_eq!(checksum.line, e1 as u64, "{checksum:?}");
    assert!(checksum.message.contains("checksum"), "{checksum:?}");
    let unparsed = by_id("bad-2");
    assert_eq!(unparsed.outcome(), ImportOutcome::Refused);
    assert_eq!(unparsed.line, s2 as u64 + 2, "{unparsed:?}");
    assert!(
        unparsed.message.contains(&format!("line {}", s2 + 2)),
        "{unparsed:?}"
    );
    let gap = by_id("bad-3");
    assert_eq!(gap.outcome(), ImportOutcome::Refused);
    assert_eq!(gap.line, s3 as u64 + 2, "{gap:?}");
    assert!(gap.message.contains("seq 3 where 2 was next"), "{gap:?}");
    let unended = by_id("bad-5");
    assert_eq!(unended.outcome(), ImportOutcome::Refused);
    assert!(unended.message.contains("end line"), "{unended:?}");
    assert!(s5 > 0);
    assert_eq!(by_id("bad-4").outcome(), ImportOutcome::Imported);
    for id in ["bad-1", "bad-2", "bad-3", "bad-5"] {
        let missing = info(&mut b, id).await.expect_err("refused: not here");
        assert_eq!(Reason::of(&missing), Some(Reason::SessionNotFound), "{id}");
    }
    assert_eq!(read_log(&mut b, "bad-4").await.len(), 3);
    // The refused sessions import once they are whole.
    let results = import(&mut b, &text, 1 << 20).await?;
    assert_eq!(
        results
            .iter()
            .filter(|r| r.outcome() == ImportOutcome::Imported)
            .count(),
        4,
        "{results:?}"
    );

    // Not an export at all: the whole import is refused, and says what it wants.
    let refused = import(&mut b, "hello\n", 1024)
        .await
        .expect_err("no header");
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert!(refused.message().contains("line 1"), "{refused:?}");
    Ok(())
}

/// A session of `n` events, each about 300 bytes of text, exported.
async fn long_session(n: usize) -> Result<(Store, String)> {
    let source = Store::start()?;
    let mut a = source.client().await?;
    let text = "x".repeat(300);
    for batch in 0..n.div_ceil(1000) {
        let events = (batch * 1000..((batch + 1) * 1000).min(n))
            .map(|i| user_event(&format!("e{i}"), &text))
            .collect();
        a.append(AppendRequest {
            session_id: "tr-long".into(),
            events,
            ..Default::default()
        })
        .await?;
    }
    let exported = export(&mut a, &["tr-long"], false).await?;
    Ok((source, exported))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_import_killed_in_the_middle_of_a_session_leaves_nothing_and_goes_again() -> Result<()> {
    const EVENTS: usize = 20_000;
    let (_source, text) = long_session(EVENTS).await?;
    let mut target = Store::start()?;
    // Kill the store at several points of the session's import: after a few pieces, about
    // half of it, and all but its end line.
    let end_line = text.trim_end().rfind('\n').context("an end line")? + 1;
    for sent_until in [64 << 10, text.len() / 2, end_line] {
        let mut b = target.client().await?;
        let (tx, rx) = tokio::sync::mpsc::channel(4);
        let call = tokio::spawn(async move {
            b.import(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
                .map(|r| r.into_inner())
        });
        for chunk in text.as_bytes()[..sent_until].chunks(16 << 10) {
            let chunk = std::str::from_utf8(chunk).context("the text is ASCII")?;
            tx.send(ImportChunk {
                text: chunk.to_string(),
            })
            .await?;
        }
        // Let the store stage what it has, then kill it with the import open.
        tokio::time::sleep(Duration::from_millis(500)).await;
        target.kill9();
        drop(tx);
        let _ = call.await;
        target = target.restart()?;
        let mut b = target.client().await?;
        let missing = info(&mut b, "tr-long").await.expect_err("nothing of it");
        assert_eq!(
            Reason::of(&missing),
            Some(Reason::SessionNotFound),
            "killed after {sent_until} bytes: {missing:?}"
        );
        let listed = b
            .list_sessions(ListSessionsRequest::default())
            .await?
            .into_inner()
            .sessions;
        assert!(listed.is_empty(), "{listed:?}");
        let empty = read_log(&mut b, "tr-long").await;
        assert!(empty.is_empty(), "{} events visible", empty.len());
    }
    // And then the import goes through, whole.
    let mut b = target.client().await?;
    let results = import(&mut b, &text, 1 << 20).await?;
    assert_eq!(
        outcomes(&results),
        vec![("tr-long".into(), ImportOutcome::Imported)],
        "{results:?}"
    );
    let log = read_log(&mut b, "tr-long").await;
    assert_eq!(log.len(), EVENTS);
    assert!(log.iter().enumerate().all(|(i, e)| e.seq == i as u64 + 1
        && e.event_id == format!("e{i}")
        && e.session_id == "tr-long"));
    // After another restart too (the local log replays the commit record).
    target.kill9();
    let target = target.restart()?;
    let mut b = target.client().await?;
    if read_log(&mut b, "tr-long").await.len() != EVENTS {
        bail!("the imported session is not whole after a restart");
    }
    Ok(())
}
