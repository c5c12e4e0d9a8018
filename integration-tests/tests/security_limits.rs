//! Per-caller limits of the real `event-store`: one caller over its subscription count or
//! request rate, or one address over its connection count, is answered RESOURCE_EXHAUSTED,
//! and other callers are not affected.

use std::ffi::OsString;
use std::time::Duration;

use agentlog_proto::v1::{GetSessionRequest, SubscribeRequest};
use integration_tests::secure::{tls_client, tokens_json, LoggedStore, SecureFiles, TokenSpec};
use tonic::Code;

const A: &str = "limits-tenant-a-token";
const B: &str = "limits-tenant-b-token";

fn store(extra: &[&str]) -> (SecureFiles, LoggedStore) {
    let files = SecureFiles::new();
    let tokens = files.write(
        "tokens.json",
        &tokens_json(&[
            TokenSpec::scoped("a", A, "client", &["a:"]),
            TokenSpec::scoped("b", B, "client", &["b:"]),
        ]),
    );
    let mut args = files.tls_args();
    args.extend(["--tokens-file".into(), tokens.into()]);
    args.extend(extra.iter().map(OsString::from));
    let store = LoggedStore::start(&args).expect("store starts");
    (files, store)
}

fn follow(session: &str) -> SubscribeRequest {
    SubscribeRequest {
        session_id: session.into(),
        from_seq: 0,
        follow: true,
    }
}

#[tokio::test]
async fn subscriptions_are_limited_per_caller() {
    let (files, store) = store(&["--max-subscriptions-per-caller", "2"]);
    let url = store.https_url();
    let ca = &files.ca.cert_pem;
    let mut a = tls_client(&url, ca, None, Some(A)).await.expect("connects");
    let mut b = tls_client(&url, ca, None, Some(B)).await.expect("connects");
    let first = a.subscribe(follow("a:1")).await.expect("first");
    let _second = a.subscribe(follow("a:2")).await.expect("second");
    let err = a.subscribe(follow("a:3")).await.expect_err("third");
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    // Another tenant is not affected.
    let _b1 = b.subscribe(follow("b:1")).await.expect("B subscribes");
    // Closing a stream frees its slot.
    drop(first);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match a.subscribe(follow("a:3")).await {
            Ok(_) => break,
            Err(e) if e.code() == Code::ResourceExhausted => {
                assert!(
                    std::time::Instant::now() < deadline,
                    "the slot was never freed"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("{e:?}"),
        }
    }
}

#[tokio::test]
async fn request_rate_is_limited_per_caller() {
    let (files, store) = store(&["--max-requests-per-sec", "5", "--request-burst", "10"]);
    let url = store.https_url();
    let ca = &files.ca.cert_pem;
    let mut a = tls_client(&url, ca, None, Some(A)).await.expect("connects");
    let mut b = tls_client(&url, ca, None, Some(B)).await.expect("connects");
    let get = |id: &str| GetSessionRequest {
        session_id: id.into(),
    };
    let mut exhausted = None;
    for i in 0..100 {
        match a.get_session(get("a:x")).await {
            Err(e) if e.code() == Code::ResourceExhausted => {
                exhausted = Some(i);
                break;
            }
            Err(e) => assert_eq!(e.code(), Code::NotFound),
            Ok(_) => {}
        }
    }
    let n = exhausted.expect("a flood is cut off");
    assert!(n >= 10, "the burst is allowed ({n})");
    // B's budget is its own.
    let err = b.get_session(get("b:x")).await.expect_err("not found");
    assert_eq!(err.code(), Code::NotFound);
}

#[tokio::test]
async fn connections_are_limited_per_address() {
    let (files, store) = store(&["--max-connections-per-peer", "2"]);
    let url = store.https_url();
    let ca = &files.ca.cert_pem;
    let mut clients = Vec::new();
    for _ in 0..2 {
        let mut c = tls_client(&url, ca, None, Some(A)).await.expect("connects");
        let err = c
            .get_session(GetSessionRequest {
                session_id: "a:x".into(),
            })
            .await
            .expect_err("not found");
        assert_eq!(err.code(), Code::NotFound);
        clients.push(c);
    }
    let mut third = tls_client(&url, ca, None, Some(A)).await.expect("connects");
    let err = third
        .get_session(GetSessionRequest {
            session_id: "a:x".into(),
        })
        .await
        .expect_err("over the limit");
    assert_eq!(err.code(), Code::ResourceExhausted, "{err:?}");
    // Closing one makes room.
    drop(clients.pop());
    drop(third);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let mut c = tls_client(&url, ca, None, Some(A)).await.expect("connects");
        match c
            .get_session(GetSessionRequest {
                session_id: "a:x".into(),
            })
            .await
        {
            Err(e) if e.code() == Code::NotFound => break,
            Err(e) if e.code() == Code::ResourceExhausted => {
                assert!(std::time::Instant::now() < deadline, "{e:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => panic!("{other:?}"),
        }
    }
}
