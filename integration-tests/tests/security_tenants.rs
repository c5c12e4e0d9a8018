//! A malicious tenant (a valid client token of tenant B) tries everything against tenant
//! A's sessions: append, subscribe (with follow), get, list (with queries that match A's
//! ids and titles), claim and lease, delete and fork. Nothing of A is revealed, nothing of A
//! changes, and the answers for an existing and a missing session of A are the same. A
//! runner token deletes and forks nothing, even in its own scope. A search shows a tenant
//! only its own sessions' hits: no snippet, page or token of another tenant's words.

use std::time::Duration;

use agentlog_proto::v1::SearchSessionsRequest;
use agentlog_proto::v1::{
    AcquireLeaseRequest, AppendRequest, ClaimSessionRequest, DeleteSessionRequest,
    ForkSessionRequest, GetSessionRequest, ListSessionsRequest, SubscribeRequest,
};
use integration_tests::secure::{tls_client, tokens_json, LoggedStore, SecureFiles, TokenSpec};
use integration_tests::user_event;
use tonic::Code;

const A: &str = "tenant-a-secret-token-1";
const B: &str = "tenant-b-secret-token-2";
const RUNNER_B: &str = "runner-b-secret-token-3";
const ADMIN: &str = "admin-secret-token-4";

#[tokio::test]
async fn tenant_b_learns_and_changes_nothing_of_tenant_a() {
    let files = SecureFiles::new();
    let tokens = files.write(
        "tokens.json",
        &tokens_json(&[
            TokenSpec::scoped("a", A, "client", &["acme:"]),
            TokenSpec::scoped("b", B, "client", &["beta:"]),
            TokenSpec::scoped("b-runners", RUNNER_B, "runner", &["beta:"]),
            TokenSpec::unscoped("ops", ADMIN, "admin"),
        ]),
    );
    let mut args = files.tls_args();
    args.extend(["--tokens-file".into(), tokens.into()]);
    let store = LoggedStore::start(&args).expect("store starts");
    let url = store.https_url();
    let ca = &files.ca.cert_pem;
    let a = tls_client(&url, ca, None, Some(A)).await.expect("connects");
    let b = tls_client(&url, ca, None, Some(B)).await.expect("connects");
    let runner_b = tls_client(&url, ca, None, Some(RUNNER_B))
        .await
        .expect("connects");
    let admin = tls_client(&url, ca, None, Some(ADMIN))
        .await
        .expect("connects");

    // Tenant A's runnable session, with a distinctive title.
    a.clone()
        .append(AppendRequest {
            session_id: "acme:payroll".into(),
            events: vec![user_event("u1", "quarterly payroll figures")],
            ..Default::default()
        })
        .await
        .expect("A appends");
    let before = admin
        .clone()
        .get_session(GetSessionRequest {
            session_id: "acme:payroll".into(),
        })
        .await
        .expect("admin reads")
        .into_inner();

    // Append (even with a seq expectation or an event id A used): refused, nothing written.
    for req in [
        AppendRequest {
            session_id: "acme:payroll".into(),
            events: vec![user_event("", "injected")],
            ..Default::default()
        },
        AppendRequest {
            session_id: "acme:payroll".into(),
            events: vec![user_event("u1", "replay of A's event id")],
            expected_last_seq: Some(1),
            ..Default::default()
        },
        AppendRequest {
            session_id: "acme:new".into(),
            events: vec![user_event("", "a session in A's namespace")],
            ..Default::default()
        },
    ] {
        let err = b.clone().append(req).await.expect_err("refused");
        assert_eq!(err.code(), Code::PermissionDenied, "{err:?}");
    }

    // Reads: an existing and a missing session of A answer the same (no existence leak).
    let missing_get = b
        .clone()
        .get_session(GetSessionRequest {
            session_id: "acme:nothing-here".into(),
        })
        .await
        .expect_err("not found");
    let existing_get = b
        .clone()
        .get_session(GetSessionRequest {
            session_id: "acme:payroll".into(),
        })
        .await
        .expect_err("not found");
    assert_eq!(existing_get.code(), Code::NotFound);
    assert_eq!(missing_get.code(), Code::NotFound);
    assert_eq!(
        existing_get.message().replace("acme:payroll", "ID"),
        missing_get.message().replace("acme:nothing-here", "ID")
    );
    for follow in [false, true] {
        let result = tokio::time::timeout(
            Duration::from_secs(5),
            b.clone().subscribe(SubscribeRequest {
                session_id: "acme:payroll".into(),
                from_seq: 0,
                follow,
            }),
        )
        .await
        .expect("answered at once, not left waiting");
        let err = match result {
            Err(status) => status,
            Ok(stream) => stream
                .into_inner()
                .message()
                .await
                .expect_err("no event of A is streamed"),
        };
        assert_eq!(err.code(), Code::NotFound, "follow={follow}: {err:?}");
    }

    // List: none of A's sessions, whatever the query.
    for query in ["", "acme", "payroll", "quarterly"] {
        let list = b
            .clone()
            .list_sessions(ListSessionsRequest {
                query: query.into(),
                ..Default::default()
            })
            .await
            .expect("B may list")
            .into_inner();
        assert!(
            list.sessions.is_empty(),
            "query {query:?} showed {:?}",
            list.sessions
        );
    }

    // Claim and lease: B's client cannot; B's runner pool never gets A's session.
    let err = b
        .clone()
        .claim_session(ClaimSessionRequest {
            owner: "b".into(),
            ttl_ms: 60_000,
            wait_ms: 0,
        })
        .await
        .expect_err("a client may not claim");
    assert_eq!(err.code(), Code::PermissionDenied);
    let claim = runner_b
        .clone()
        .claim_session(ClaimSessionRequest {
            owner: "b-runner".into(),
            ttl_ms: 60_000,
            wait_ms: 500,
        })
        .await
        .expect("runner B may claim")
        .into_inner();
    assert_eq!(
        claim.lease, None,
        "A's runnable session is not B's to claim"
    );
    let err = runner_b
        .clone()
        .acquire_lease(AcquireLeaseRequest {
            session_id: "acme:payroll".into(),
            owner: "b-runner".into(),
            ttl_ms: 60_000,
        })
        .await
        .expect_err("out of scope");
    assert_eq!(err.code(), Code::PermissionDenied);

    // B's own session is claimable by B's runners, while a long-poll is waiting.
    let waiting = tokio::spawn({
        let mut runner_b = runner_b.clone();
        async move {
            runner_b
                .claim_session(ClaimSessionRequest {
                    owner: "b-runner".into(),
                    ttl_ms: 60_000,
                    wait_ms: 10_000,
                })
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    b.clone()
        .append(AppendRequest {
            session_id: "beta:mine".into(),
            events: vec![user_event("", "B's own work")],
            ..Default::default()
        })
        .await
        .expect("B appends to its own session");
    let lease = waiting
        .await
        .expect("joined")
        .expect("claimed")
        .into_inner()
        .lease
        .expect("B's session is handed to B's runner");
    assert_eq!(lease.session_id, "beta:mine");

    // Delete and fork: B may not touch A's sessions, nor fork into A's prefix; B's runner
    // token may do neither, even in B's scope; B and the admin may.
    let delete = |id: &str| DeleteSessionRequest {
        session_id: id.into(),
    };
    let fork = |from: &str, to: &str| ForkSessionRequest {
        session_id: from.into(),
        at_seq: 1,
        new_session_id: to.into(),
        events: vec![],
    };
    for (who, id) in [(&b, "acme:payroll"), (&runner_b, "beta:mine")] {
        let err = who
            .clone()
            .delete_session(delete(id))
            .await
            .expect_err("refused");
        assert_eq!(err.code(), Code::PermissionDenied, "{id}: {err:?}");
    }
    for (who, from, to) in [
        (&b, "acme:payroll", "beta:copy"),
        (&b, "beta:mine", "acme:planted"),
        (&runner_b, "beta:mine", "beta:copy"),
    ] {
        let err = who
            .clone()
            .fork_session(fork(from, to))
            .await
            .expect_err("refused");
        assert_eq!(
            err.code(),
            Code::PermissionDenied,
            "{from} -> {to}: {err:?}"
        );
    }
    b.clone()
        .fork_session(fork("beta:mine", "beta:copy"))
        .await
        .expect("B forks its own session within its scope");
    b.clone()
        .delete_session(delete("beta:copy"))
        .await
        .expect("B deletes its own session");
    admin
        .clone()
        .delete_session(delete("beta:mine"))
        .await
        .expect("the admin deletes any session");

    // A's session is exactly as it was: same seq, same title, no lease.
    let after = admin
        .clone()
        .get_session(GetSessionRequest {
            session_id: "acme:payroll".into(),
        })
        .await
        .expect("admin reads")
        .into_inner();
    assert_eq!(after, before);
    assert_eq!(after.lease, None);
    let err = admin
        .clone()
        .get_session(GetSessionRequest {
            session_id: "acme:new".into(),
        })
        .await
        .expect_err("never created");
    assert_eq!(err.code(), Code::NotFound);

    let log = store.log();
    for token in [A, B, RUNNER_B, ADMIN] {
        assert!(!log.contains(token), "the store logged a token");
    }
}

#[tokio::test]
async fn a_search_shows_a_tenant_only_its_own_sessions_hits() {
    let files = SecureFiles::new();
    let tokens = files.write(
        "tokens.json",
        &tokens_json(&[
            TokenSpec::scoped("a", A, "client", &["acme:"]),
            TokenSpec::scoped("b", B, "client", &["beta:"]),
            TokenSpec::unscoped("ops", ADMIN, "admin"),
        ]),
    );
    let mut args = files.tls_args();
    args.extend(["--tokens-file".into(), tokens.into()]);
    let store = LoggedStore::start(&args).expect("store starts");
    let url = store.https_url();
    let ca = &files.ca.cert_pem;
    let a = tls_client(&url, ca, None, Some(A)).await.expect("connects");
    let b = tls_client(&url, ca, None, Some(B)).await.expect("connects");
    let admin = tls_client(&url, ca, None, Some(ADMIN))
        .await
        .expect("connects");

    // B's one session with the word, then many of A's, newer.
    b.clone()
        .append(AppendRequest {
            session_id: "beta:1".into(),
            events: vec![user_event("", "the merger memo")],
            ..Default::default()
        })
        .await
        .expect("B appends");
    for i in 0..30 {
        a.clone()
            .append(AppendRequest {
                session_id: format!("acme:{i}"),
                events: vec![user_event("", "the merger memo, acquisition secret")],
                ..Default::default()
            })
            .await
            .expect("A appends");
    }
    let search = |client: &agentlog_proto::v1::event_store_client::EventStoreClient<_>,
                  query: &str,
                  page_size: u32| {
        let mut client = client.clone();
        let query = query.to_string();
        async move {
            client
                .search_sessions(SearchSessionsRequest {
                    query,
                    page_size,
                    page_token: String::new(),
                })
                .await
                .expect("may search")
                .into_inner()
        }
    };
    // The admin sees every hit once the index has them.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while search(&admin, "merger", 100).await.hits.len() < 31 {
        assert!(
            std::time::Instant::now() < deadline,
            "the hits were never all found"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // B: its own hit alone, on the first page of one, and no token to more.
    let page = search(&b, "merger", 1).await;
    let found: Vec<&str> = page.hits.iter().map(|h| h.session_id.as_str()).collect();
    assert_eq!(found, ["beta:1"]);
    assert_eq!(page.next_page_token, "", "nothing hints at more hits");
    // A word only A wrote: nothing, and no token.
    let page = search(&b, "acquisition secret", 10).await;
    assert!(page.hits.is_empty(), "{:?}", page.hits);
    assert_eq!(page.next_page_token, "");
    // A sees only its own.
    let page = search(&a, "merger", 100).await;
    assert_eq!(page.hits.len(), 30);
    assert!(page.hits.iter().all(|h| h.session_id.starts_with("acme:")));
}
