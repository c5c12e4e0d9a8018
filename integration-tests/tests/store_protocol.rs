//! The store as a network citizen: gRPC reflection in both versions (grpcurl 1.8 speaks
//! v1alpha; newer tools speak v1), health for Kubernetes probes, garbage on the port, and a
//! clean SIGTERM that keeps every acknowledged append and ends streams with UNAVAILABLE.

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write;
use std::net::TcpStream;
use std::time::Duration;

use agentlog_proto::v1::{AppendRequest, ClaimSessionRequest, Durability};
use integration_tests::{
    grpcurl, grpcurl_verb, json_seqs, json_u64, poll_until, read_log, user_event, GrpcurlChild,
    Store,
};
use prost::Message;
use serde_json::json;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
use tonic_reflection::pb::v1::ServerReflectionRequest;

const RPCS: &[&str] = &[
    "Append",
    "AppendStream",
    "Subscribe",
    "GetSession",
    "ListSessions",
    "ClaimSession",
    "AcquireLease",
    "RenewLease",
    "ReleaseLease",
    "PutSnapshot",
    "GetSnapshot",
    "DeleteSession",
    "ForkSession",
    // Sessions that move.
    "Export",
    "Import",
    "PinSession",
    "SearchSessions",
];
const BOUND: Duration = Duration::from_secs(60);

#[test]
fn grpcurl_lists_and_describes_the_services_through_reflection() {
    let store = Store::start().unwrap();
    let services = grpcurl_verb(store.addr, &["list"]);
    assert!(services.success, "{}", services.stderr);
    for service in ["agentlog.v1.EventStore", "grpc.health.v1.Health"] {
        assert!(
            services.stdout.lines().any(|l| l.trim() == service),
            "{service} missing from: {}",
            services.stdout
        );
    }

    let methods = grpcurl_verb(store.addr, &["list", "agentlog.v1.EventStore"]);
    assert!(methods.success, "{}", methods.stderr);
    let listed: BTreeSet<&str> = methods.stdout.lines().map(str::trim).collect();
    let expected: BTreeSet<String> = RPCS
        .iter()
        .map(|rpc| format!("agentlog.v1.EventStore.{rpc}"))
        .collect();
    assert_eq!(listed, expected.iter().map(String::as_str).collect());

    let service = grpcurl_verb(store.addr, &["describe", "agentlog.v1.EventStore"]);
    assert!(service.success, "{}", service.stderr);
    assert!(
        service.stdout.contains(
            "rpc Subscribe ( .agentlog.v1.SubscribeRequest ) returns ( stream .agentlog.v1.Event )"
        ),
        "{}",
        service.stdout
    );

    // Message types resolve too, with their imports (tool input is a google.protobuf.Struct).
    let event = grpcurl_verb(store.addr, &["describe", "agentlog.v1.Event"]);
    assert!(event.success, "{}", event.stderr);
    for kind in [
        "user_message",
        "assistant_message",
        "tool_started",
        "tool_result",
        "assistant_delta",
        "run_error",
    ] {
        assert!(
            event.stdout.contains(kind),
            "{kind} missing: {}",
            event.stdout
        );
    }
    let tool_use = grpcurl_verb(store.addr, &["describe", "agentlog.v1.ToolUseBlock"]);
    assert!(
        tool_use.stdout.contains(".google.protobuf.Struct input"),
        "{} {}",
        tool_use.stdout,
        tool_use.stderr
    );
}

/// grpc.reflection.v1, as newer grpcurl, Postman and grpcui ask for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reflection_v1_answers_too() {
    let store = Store::start().unwrap();
    let channel = tonic::transport::Endpoint::from_shared(store.url())
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut reflection = ServerReflectionClient::new(channel);
    let requests = vec![
        ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::ListServices(String::new())),
        },
        ServerReflectionRequest {
            host: String::new(),
            message_request: Some(MessageRequest::FileContainingSymbol(
                "agentlog.v1.EventStore".into(),
            )),
        },
    ];
    let mut responses = reflection
        .server_reflection_info(tokio_stream::iter(requests))
        .await
        .expect("grpc.reflection.v1 is served")
        .into_inner();

    let listed = responses
        .message()
        .await
        .unwrap()
        .expect("a ListServices answer");
    let Some(MessageResponse::ListServicesResponse(list)) = listed.message_response else {
        panic!("not a ListServices answer: {listed:?}");
    };
    let names: BTreeSet<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(names.contains("agentlog.v1.EventStore"), "{names:?}");
    assert!(names.contains("grpc.health.v1.Health"), "{names:?}");

    let file = responses
        .message()
        .await
        .unwrap()
        .expect("a FileContainingSymbol answer");
    let Some(MessageResponse::FileDescriptorResponse(files)) = file.message_response else {
        panic!("not a file descriptor answer: {file:?}");
    };
    let methods: BTreeSet<String> = files
        .file_descriptor_proto
        .iter()
        .map(|bytes| prost_types::FileDescriptorProto::decode(bytes.as_slice()).unwrap())
        .flat_map(|f| f.service)
        .filter(|s| s.name() == "EventStore")
        .flat_map(|s| s.method)
        .map(|m| m.name().to_string())
        .collect();
    assert_eq!(methods, RPCS.iter().map(|s| s.to_string()).collect());
}

#[test]
fn health_check_reports_serving() {
    let store = Store::start().unwrap();
    for request in ["{}", r#"{"service":"agentlog.v1.EventStore"}"#] {
        let out = grpcurl(store.addr, "grpc.health.v1.Health/Check", Some(request));
        assert_eq!(out.json()["status"], "SERVING", "{request}");
    }
}

/// A tiny deterministic generator of garbage bytes.
fn garbage(seed: u64, len: usize) -> Vec<u8> {
    let mut x = seed.max(1);
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

const HTTP2_PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";

#[test]
fn garbage_on_the_port_leaves_the_store_serving_with_its_data() {
    let mut store = Store::start().unwrap();
    for text in ["one", "two", "three"] {
        grpcurl(
            store.addr,
            "agentlog.v1.EventStore/Append",
            Some(
                &json!({ "session_id": "keep", "events": [{ "user_message": { "text": text } }] })
                    .to_string(),
            ),
        )
        .json();
    }

    let mut held = Vec::new();
    // Random bytes: some connections close after them, some stay open.
    for seed in 1..=6u64 {
        let mut conn = TcpStream::connect(store.addr).unwrap();
        let _ = conn.write_all(&garbage(seed, 64 * 1024));
        if seed % 2 == 0 {
            held.push(conn);
        }
    }
    // Random bytes after a valid preface.
    let mut conn = TcpStream::connect(store.addr).unwrap();
    let _ = conn.write_all(HTTP2_PREFACE);
    let _ = conn.write_all(&garbage(99, 16 * 1024));
    drop(conn);
    // A bare HTTP/2 preface, then nothing.
    let mut bare = TcpStream::connect(store.addr).unwrap();
    bare.write_all(HTTP2_PREFACE).unwrap();
    held.push(bare);
    // A preface, an empty SETTINGS frame, then a frame header claiming 16 MiB of DATA.
    let mut oversized = TcpStream::connect(store.addr).unwrap();
    let _ = oversized.write_all(HTTP2_PREFACE);
    let _ = oversized.write_all(&[0, 0, 0, 0x4, 0, 0, 0, 0, 0]);
    let _ = oversized.write_all(&[0xff, 0xff, 0xff, 0x0, 0, 0, 0, 0, 1]);
    let _ = oversized.write_all(&garbage(7, 32 * 1024));
    held.push(oversized);
    // 50 half-open connections: connected, silent.
    for _ in 0..50 {
        held.push(TcpStream::connect(store.addr).unwrap());
    }

    // With all of that still attached, the store serves and its data is intact.
    let check = |store: &Store, text: &str, seq: u64| {
        let out = grpcurl(
            store.addr,
            "agentlog.v1.EventStore/Append",
            Some(
                &json!({ "session_id": "keep", "events": [{ "user_message": { "text": text } }] })
                    .to_string(),
            ),
        );
        assert_eq!(json_u64(&out.json()["seqs"][0]), seq);
        let log = grpcurl(
            store.addr,
            "agentlog.v1.EventStore/Subscribe",
            Some(r#"{"session_id":"keep"}"#),
        )
        .json_stream();
        assert_eq!(json_seqs(&log), (1..=seq).collect::<Vec<_>>());
        assert_eq!(log[0]["userMessage"]["text"], "one");
        assert_eq!(log[2]["userMessage"]["text"], "three");
        let health = grpcurl(store.addr, "grpc.health.v1.Health/Check", Some("{}"));
        assert_eq!(health.json()["status"], "SERVING");
    };
    check(&store, "four", 4);
    assert!(store.is_running());

    drop(held);
    check(&store, "five", 5);
    assert!(store.is_running());
}

/// SIGTERM while clients append, a follower streams and a claim long-polls: the store
/// ends the streams, finishes and fsyncs in-flight appends, exits 0, and after a restart on
/// the same data dir every acknowledged event is there at the seq it was acknowledged with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_exits_zero_and_every_acknowledged_append_survives_a_restart() {
    const WRITERS: usize = 3;
    let mut store = Store::start().unwrap();

    let follower = GrpcurlChild::spawn(
        store.addr,
        &["-max-time", "120"],
        "agentlog.v1.EventStore/Subscribe",
        r#"{"session_id":"w0","follow":true}"#,
    );
    let mut claim_client = store.client().await.unwrap();
    let claim = tokio::spawn(async move {
        claim_client
            .claim_session(ClaimSessionRequest {
                owner: "waiting-runner".into(),
                ttl_ms: 60_000,
                wait_ms: 5 * 60 * 1000,
            })
            .await
    });

    let acks = std::sync::Arc::new(std::sync::Mutex::new(vec![0usize; WRITERS]));
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let mut client = store.client().await.unwrap();
        let acks = acks.clone();
        writers.push(tokio::spawn(async move {
            let mut acked = BTreeMap::new();
            for i in 0u64.. {
                let id = format!("w{w}-{i}");
                // Alternate durabilities: a clean shutdown keeps both.
                let durability = if i % 2 == 0 {
                    Durability::Sync
                } else {
                    Durability::Buffered
                };
                let resp = tokio::time::timeout(
                    BOUND,
                    client.append(AppendRequest {
                        session_id: format!("w{w}"),
                        events: vec![user_event(&id, "during shutdown")],
                        durability: durability as i32,
                        ..Default::default()
                    }),
                )
                .await
                .expect("an append hung across shutdown");
                match resp {
                    Ok(resp) => {
                        acked.insert(resp.into_inner().seqs[0], id);
                        acks.lock().unwrap()[w] += 1;
                    }
                    Err(_) => break, // the store has gone away
                }
            }
            acked
        }));
    }

    poll_until(
        "every writer to have some acknowledged appends",
        BOUND,
        || acks.lock().unwrap().iter().all(|&n| n >= 20).then_some(()),
    );
    let status = tokio::task::block_in_place(|| store.terminate()).unwrap();
    assert!(status.success(), "SIGTERM exit status: {status:?}");

    let mut acked_by_session = Vec::new();
    for writer in writers {
        acked_by_session.push(writer.await.unwrap());
    }
    // The long-poll was answered (no lease, or an error from the closing store), not left hanging.
    let _ = tokio::time::timeout(BOUND, claim)
        .await
        .expect("claim left hanging");
    let follower = tokio::task::block_in_place(|| follower.finish());
    assert!(
        !follower.stderr.contains("DeadlineExceeded"),
        "the follow stream was not ended by shutdown: {}",
        follower.stderr
    );

    let restarted = store.restart().unwrap();
    let mut client = restarted.client().await.unwrap();
    for (w, acked) in acked_by_session.iter().enumerate() {
        assert!(acked.len() >= 20);
        let log = read_log(&mut client, &format!("w{w}")).await;
        let seqs: Vec<u64> = log.iter().map(|e| e.seq).collect();
        assert_eq!(seqs, (1..=log.len() as u64).collect::<Vec<_>>(), "gapless");
        for (seq, id) in acked {
            let event = log
                .get(*seq as usize - 1)
                .unwrap_or_else(|| panic!("acknowledged seq {seq} of w{w} lost"));
            assert_eq!(&event.event_id, id, "seq {seq} of w{w}");
        }
    }
}

/// SIGTERM while AppendStreams keep many appends in flight and a follower streams: every
/// request the store read is answered (acknowledged only once durable: each acknowledged
/// event is there after a restart, at its seq), and the streams end with UNAVAILABLE, so
/// that their clients go elsewhere, never with an OK a reader would take for the end.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_ends_streams_unavailable_and_answers_what_it_read() {
    use agentlog_proto::v1::{append_stream_response, SubscribeRequest};
    use tokio_stream::StreamExt;

    const STREAMS: usize = 2;
    let mut store = Store::start().unwrap();
    let mut follower = store.client().await.unwrap();
    let mut follow = follower
        .subscribe(SubscribeRequest {
            session_id: "as0".into(),
            from_seq: 1,
            follow: true,
        })
        .await
        .unwrap()
        .into_inner();
    let followed = tokio::spawn(async move {
        let mut seen = 0u64;
        loop {
            match follow.next().await {
                Some(Ok(event)) => seen = event.seq,
                Some(Err(status)) => return (seen, Some(status)),
                None => return (seen, None),
            }
        }
    });

    let answered = std::sync::Arc::new(std::sync::Mutex::new(vec![0usize; STREAMS]));
    let mut writers = Vec::new();
    for w in 0..STREAMS {
        let mut client = store.client().await.unwrap();
        let answered = answered.clone();
        writers.push(tokio::spawn(async move {
            let (tx, rx) = tokio::sync::mpsc::channel(64);
            let feeder = tokio::spawn(async move {
                for i in 0u64.. {
                    let request = AppendRequest {
                        session_id: format!("as{w}"),
                        events: vec![user_event(&format!("as{w}-{i}"), "in flight")],
                        ..Default::default()
                    };
                    if tx.send(request).await.is_err() {
                        return;
                    }
                }
            });
            let mut answers = client
                .append_stream(tokio_stream::wrappers::ReceiverStream::new(rx))
                .await
                .unwrap()
                .into_inner();
            let mut acked = BTreeMap::new();
            let mut i = 0u64;
            let end = loop {
                match tokio::time::timeout(BOUND, answers.next())
                    .await
                    .expect("an AppendStream hung across shutdown")
                {
                    Some(Ok(answer)) => {
                        match answer.result {
                            Some(append_stream_response::Result::Response(r)) => {
                                acked.insert(r.seqs[0], format!("as{w}-{i}"));
                            }
                            other => panic!("request {i} refused: {other:?}"),
                        }
                        i += 1;
                        answered.lock().unwrap()[w] += 1;
                    }
                    Some(Err(status)) => break Some(status),
                    None => break None,
                }
            };
            feeder.abort();
            (acked, end)
        }));
    }
    poll_until("every stream to have answers", BOUND, || {
        answered
            .lock()
            .unwrap()
            .iter()
            .all(|&n| n >= 50)
            .then_some(())
    });
    let status = tokio::task::block_in_place(|| store.terminate()).unwrap();
    assert!(status.success(), "SIGTERM exit status: {status:?}");

    let mut acked_by_stream = Vec::new();
    for writer in writers {
        let (acked, end) = writer.await.unwrap();
        let end = end.expect("the stream ended with a status");
        assert_eq!(
            end.code(),
            tonic::Code::Unavailable,
            "the AppendStream ends UNAVAILABLE: {end:?}"
        );
        assert!(!acked.is_empty());
        acked_by_stream.push(acked);
    }
    let (seen, end) = followed.await.unwrap();
    let end = end.expect("the follow stream ended with a status");
    assert_eq!(
        end.code(),
        tonic::Code::Unavailable,
        "the follow ends UNAVAILABLE: {end:?}"
    );

    let restarted = store.restart().unwrap();
    let mut client = restarted.client().await.unwrap();
    for (w, acked) in acked_by_stream.iter().enumerate() {
        let log = read_log(&mut client, &format!("as{w}")).await;
        for (seq, id) in acked {
            let event = log
                .get(*seq as usize - 1)
                .unwrap_or_else(|| panic!("acknowledged seq {seq} of as{w} lost"));
            assert_eq!(&event.event_id, id, "seq {seq} of as{w}");
        }
        if w == 0 {
            assert!(
                seen <= log.len() as u64,
                "the follower saw only durable events"
            );
        }
    }
}
