//! Rolling back a local store: a data directory this build wrote opens in the last release
//! (its binary, from `deploy/previous-release`) and reads back event for event, what the
//! release appends then opens in this build again, and the fields of a later release that
//! this build stored are still served whole after the release had the directory. A data
//! directory a later release changed beyond this build (`release.json` naming a later
//! release) is refused at start, naming the release it needs, and left as it is.

use std::process::{Command, Stdio};

use agentlog_proto::v1::{event, Event, ForkSessionRequest, UserMessage};
use integration_tests::newer;
use integration_tests::{read_log, Store};
use testkit::previous::Build;
use tonic::transport::Channel;

fn user(id: &str, text: &str) -> Event {
    Event {
        event_id: id.into(),
        kind: Some(event::Kind::UserMessage(UserMessage { text: text.into() })),
        ..Event::default()
    }
}

async fn append(store: &Store, session: &str, events: Vec<Event>) {
    let mut client = store.client().await.expect("client");
    client
        .append(agentlog_proto::v1::AppendRequest {
            session_id: session.into(),
            events,
            ..Default::default()
        })
        .await
        .expect("append");
}

/// Every session's log, as this tree's protocol reads it.
async fn logs(store: &Store, sessions: &[&str]) -> Vec<Vec<Event>> {
    let mut client = store.client().await.expect("client");
    let mut all = Vec::new();
    for session in sessions {
        all.push(read_log(&mut client, session).await);
    }
    all
}

#[tokio::test(flavor = "multi_thread")]
async fn a_data_directory_this_build_wrote_opens_in_the_last_release_and_back() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data = dir.path().join("data");
    let sessions = ["a", "b", "newer", "fork"];

    // This build: plain turns, a later release's turn, a fork.
    let mut store = tokio::task::block_in_place(|| {
        Build::This.start_store(integration_tests::Backing::Dir(data.clone()), &[])
    })
    .expect("this build's store");
    append(&store, "a", vec![user("a1", "one"), user("a2", "two")]).await;
    append(&store, "b", vec![user("b1", "three")]).await;
    let channel = Channel::from_shared(store.url())
        .expect("url")
        .connect()
        .await
        .expect("connect");
    let later = newer::user("n1", "from a later release");
    newer::unary::<_, agentlog_proto::v1::AppendResponse>(
        &channel,
        None,
        newer::APPEND,
        newer::NewerAppendRequest {
            session_id: "newer".into(),
            events: vec![later.clone()],
            lease_epoch: None,
        },
    )
    .await
    .expect("a later release's append");
    let mut client = store.client().await.expect("client");
    client
        .fork_session(ForkSessionRequest {
            session_id: "a".into(),
            at_seq: 1,
            new_session_id: "fork".into(),
            events: vec![user("f1", "instead")],
        })
        .await
        .expect("fork");
    let before = logs(&store, &sessions).await;
    store.terminate().expect("stop");
    let readers = std::fs::read_to_string(data.join("release.json")).expect("release.json");
    assert!(readers.contains(r#""readableBy":"0.1.0""#), "{readers}");

    // The last release reads it, event for event, and appends to it.
    let mut old = tokio::task::block_in_place(|| {
        Build::Previous.start_store(integration_tests::Backing::Dir(data.clone()), &[])
    })
    .expect("the release's store on this build's data");
    assert_eq!(
        logs(&old, &sessions).await,
        before,
        "the release reads it all"
    );
    append(&old, "b", vec![user("b2", "after the rollback")]).await;
    let after_rollback = logs(&old, &sessions).await;
    old.terminate().expect("stop");

    // This build again: what the release wrote, and the later release's fields, whole.
    let store = tokio::task::block_in_place(|| {
        Build::This.start_store(integration_tests::Backing::Dir(data.clone()), &[])
    })
    .expect("this build's store again");
    assert_eq!(logs(&store, &sessions).await, after_rollback);
    let channel = Channel::from_shared(store.url())
        .expect("url")
        .connect()
        .await
        .expect("connect");
    let log = newer::read(&channel, None, "newer").await.expect("read");
    let [(served, bytes)] = &log[..] else {
        panic!("one event, not {}", log.len());
    };
    let expected = newer::stored(&later, "newer", 1, served);
    assert_eq!(served, &expected);
    assert_eq!(bytes, &prost::Message::encode_to_vec(&expected));
}

#[test]
fn a_data_directory_a_later_release_changed_is_refused_naming_that_release() {
    let dir = tempfile::tempdir().expect("temp dir");
    let marker = r#"{"readableBy":"9.9.0","openedBy":"9.9.2"}"#;
    std::fs::write(dir.path().join("release.json"), marker).expect("write");
    let out = Command::new(integration_tests::bin_path("event-store"))
        .args(["--listen", "127.0.0.1:0", "--data-dir"])
        .arg(dir.path())
        .stdin(Stdio::null())
        .output()
        .expect("run the store");
    assert!(!out.status.success(), "the store refuses to start");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("9.9.0 or later"), "{stderr}");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("release.json")).expect("still there"),
        marker,
        "the directory is left as it is"
    );
    assert!(
        !dir.path().join("log").exists(),
        "nothing else of it was made or opened"
    );
}
