//! AppendStream: many appends on one call. Each request is answered in the order sent with
//! what Append would have answered (its response, or its error status), a refused request
//! does not end the stream, and what was acknowledged is in the log.

use agentlog_proto::v1::{append_stream_response, AppendRequest, AppendStreamResponse};
use integration_tests::{read_log, user_event, Store};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;

fn append(id: &str, expected_last_seq: Option<u64>) -> AppendRequest {
    AppendRequest {
        session_id: "stream-1".into(),
        events: vec![user_event(id, id)],
        expected_last_seq,
        ..Default::default()
    }
}

fn seqs(response: &AppendStreamResponse) -> Option<Vec<u64>> {
    match &response.result {
        Some(append_stream_response::Result::Response(r)) => Some(r.seqs.clone()),
        _ => None,
    }
}

fn code(response: &AppendStreamResponse) -> Option<Code> {
    match &response.result {
        Some(append_stream_response::Result::Error(e)) => Some(Code::from(e.code)),
        _ => None,
    }
}

fn reason(response: &AppendStreamResponse) -> Option<&str> {
    match &response.result {
        Some(append_stream_response::Result::Error(e)) => Some(&e.reason),
        _ => None,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_come_in_order_and_a_refused_request_does_not_end_the_stream() {
    let store = Store::start().expect("store starts");
    let mut client = store.client().await.expect("connect");
    let no_events = AppendRequest {
        session_id: "stream-1".into(),
        ..Default::default()
    };
    let requests = vec![
        append("a", Some(0)),
        append("b", None),
        no_events,
        append("c", Some(1)),
        append("a", None),
        append("d", Some(2)),
    ];
    let (tx, rx) = tokio::sync::mpsc::channel(16);
    for request in requests {
        tx.send(request).await.expect("queued");
    }
    drop(tx);
    let mut responses = client
        .append_stream(ReceiverStream::new(rx))
        .await
        .expect("AppendStream")
        .into_inner();
    let mut answers = Vec::new();
    while let Some(response) = responses.message().await.expect("the stream goes on") {
        answers.push(response);
    }
    assert_eq!(answers.len(), 6, "one answer per request: {answers:?}");
    assert_eq!(seqs(&answers[0]), Some(vec![1]));
    assert_eq!(seqs(&answers[1]), Some(vec![2]));
    assert_eq!(code(&answers[2]), Some(Code::InvalidArgument));
    assert_eq!(
        code(&answers[3]),
        Some(Code::Aborted),
        "expected_last_seq 1 is stale"
    );
    assert_eq!(
        reason(&answers[3]),
        Some("SEQ_CONFLICT"),
        "the refusal's reason, as Append sends it in ErrorInfo"
    );
    assert_eq!(
        reason(&answers[2]),
        Some(""),
        "a malformed request has none"
    );
    assert_eq!(
        seqs(&answers[4]),
        Some(vec![1]),
        "a repeated event_id is deduplicated"
    );
    assert_eq!(seqs(&answers[5]), Some(vec![3]));

    let log = read_log(&mut client, "stream-1").await;
    let ids: Vec<&str> = log.iter().map(|e| e.event_id.as_str()).collect();
    assert_eq!(ids, ["a", "b", "d"]);
}

/// More requests than the store keeps unanswered per stream (1,024), all sent before any
/// answer is read, on two streams at once, with refusals among them: every request is
/// answered, in the order sent, and the log holds exactly the accepted ones in that order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_beyond_the_in_flight_bound_are_all_answered_in_order() {
    const REQUESTS: u64 = 2_500;
    let store = Store::start().expect("store starts");
    let mut streams = Vec::new();
    for session in ["stream-many-1", "stream-many-2"] {
        let mut client = store.client().await.expect("connect");
        let (tx, rx) = tokio::sync::mpsc::channel(REQUESTS as usize);
        for i in 0..REQUESTS {
            let id = format!("e{i}");
            // Every 10th names a stale expected_last_seq and is refused.
            let stale = (i % 10 == 9).then_some(0);
            tx.send(AppendRequest {
                session_id: session.into(),
                events: vec![user_event(&id, &id)],
                expected_last_seq: stale,
                ..Default::default()
            })
            .await
            .expect("queued");
        }
        drop(tx);
        let responses = client
            .append_stream(ReceiverStream::new(rx))
            .await
            .expect("AppendStream")
            .into_inner();
        streams.push((session, client, responses));
    }
    for (session, mut client, mut responses) in streams {
        let mut next_seq = 1;
        let mut answered = 0;
        while let Some(response) = responses.message().await.expect("the stream goes on") {
            if answered % 10 == 9 {
                assert_eq!(code(&response), Some(Code::Aborted), "request {answered}");
            } else {
                assert_eq!(seqs(&response), Some(vec![next_seq]), "request {answered}");
                next_seq += 1;
            }
            answered += 1;
        }
        assert_eq!(answered, REQUESTS, "one answer per request");
        let log = read_log(&mut client, session).await;
        let ids: Vec<String> = log.into_iter().map(|e| e.event_id).collect();
        let accepted: Vec<String> = (0..REQUESTS)
            .filter(|i| i % 10 != 9)
            .map(|i| format!("e{i}"))
            .collect();
        assert_eq!(ids, accepted);
    }
}
