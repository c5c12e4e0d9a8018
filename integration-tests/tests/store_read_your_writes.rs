//! Read-your-writes: once a SYNC append is acknowledged, every read path shows it at once
//! (Subscribe without follow, GetSession), even while other clients append concurrently.

use agentlog_proto::v1::{
    event, AppendRequest, Event, GetSessionRequest, SubscribeRequest, UserMessage,
};
use integration_tests::Store;

fn user(text: String) -> Event {
    Event {
        kind: Some(event::Kind::UserMessage(UserMessage { text })),
        ..Default::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_acknowledged_append_is_visible_to_the_next_read() {
    let store = Store::start().expect("store starts");
    let mut tasks = Vec::new();
    for w in 0..8 {
        let mut client = store.client().await.expect("connect");
        tasks.push(tokio::spawn(async move {
            let session_id = format!("ryw-{}", w % 3);
            for i in 0..150 {
                let resp = client
                    .append(AppendRequest {
                        session_id: session_id.clone(),
                        events: vec![user(format!("{w}-{i}"))],
                        ..Default::default()
                    })
                    .await
                    .expect("append")
                    .into_inner();
                let info = client
                    .get_session(GetSessionRequest {
                        session_id: session_id.clone(),
                    })
                    .await
                    .expect("get")
                    .into_inner();
                assert!(
                    info.last_seq >= resp.last_seq,
                    "GetSession at {} after ack of {}",
                    info.last_seq,
                    resp.last_seq
                );
                let mut stream = client
                    .subscribe(SubscribeRequest {
                        session_id: session_id.clone(),
                        from_seq: resp.last_seq,
                        follow: false,
                    })
                    .await
                    .expect("subscribe")
                    .into_inner();
                let first = stream
                    .message()
                    .await
                    .expect("stream")
                    .expect("the acknowledged event");
                assert_eq!(first.seq, resp.last_seq);
            }
        }));
    }
    for t in tasks {
        t.await.expect("writer task");
    }
}
