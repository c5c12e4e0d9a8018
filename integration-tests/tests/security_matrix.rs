//! Every RPC × every kind of caller → the expected status, over real TLS (certificates made
//! here) against the real `event-store` binary with a tokens file; part of it driven with
//! tonic, part with grpcurl (`-cacert`, `-H 'authorization: Bearer …'`). Statuses other than
//! the auth ones (FAILED_PRECONDITION for a made-up lease epoch) show the call got past
//! authorization to the store's own rules.

use agentlog_proto::v1::{
    event, AcquireLeaseRequest, AppendRequest, ClaimSessionRequest, Event, GetSessionRequest,
    ListSessionsRequest, ReleaseLeaseRequest, RenewLeaseRequest, RunError, SubscribeRequest,
};
use integration_tests::secure::{
    grpcurl_tls, tls_client, tokens_json, GrpcurlTls, LoggedStore, SecureFiles, TlsClient,
    TokenSpec,
};
use integration_tests::user_event;
use tonic::Code;

const A_TOKEN: &str = "tok-tenant-a-7f3c9d2e";
const B_TOKEN: &str = "tok-tenant-b-1a8e4b6f";
const RUNNER_TOKEN: &str = "tok-runner-5d2a9c1b";
const RUNNER_B_TOKEN: &str = "tok-runner-b-8e1f3a7d";
const ADMIN_TOKEN: &str = "tok-admin-3b7e2f9a";
const BAD_TOKEN: &str = "tok-nobody-0000";
const ALL_TOKENS: [&str; 6] = [
    A_TOKEN,
    B_TOKEN,
    RUNNER_TOKEN,
    RUNNER_B_TOKEN,
    ADMIN_TOKEN,
    BAD_TOKEN,
];

/// The callers of the matrix: (name, token).
const CALLERS: [(&str, Option<&str>); 7] = [
    ("no token", None),
    ("bad token", Some(BAD_TOKEN)),
    ("client A", Some(A_TOKEN)),
    ("client B", Some(B_TOKEN)),
    ("runner", Some(RUNNER_TOKEN)),
    ("runner B", Some(RUNNER_B_TOKEN)),
    ("admin", Some(ADMIN_TOKEN)),
];

pub fn tokens_file() -> String {
    tokens_json(&[
        TokenSpec::scoped("tenant-a", A_TOKEN, "client", &["a:"]),
        TokenSpec::scoped("tenant-b", B_TOKEN, "client", &["b:"]),
        TokenSpec::unscoped("runners", RUNNER_TOKEN, "runner"),
        TokenSpec::scoped("runners-b", RUNNER_B_TOKEN, "runner", &["b:"]),
        TokenSpec::unscoped("ops", ADMIN_TOKEN, "admin"),
    ])
}

fn code<T>(result: &Result<T, tonic::Status>) -> Code {
    match result {
        Ok(_) => Code::Ok,
        Err(status) => status.code(),
    }
}

use Code::{FailedPrecondition as FP, NotFound as NF, Ok as OK, PermissionDenied as PD};
const UA: Code = Code::Unauthenticated;

/// Expected codes per caller, in the order of [`CALLERS`].
type Row = [Code; 7];

#[tokio::test]
async fn every_rpc_by_every_caller_over_tls() {
    let files = SecureFiles::new();
    let tokens = files.write("tokens.json", &tokens_file());
    let mut args = files.tls_args();
    args.extend(["--tokens-file".into(), tokens.into()]);
    let store = LoggedStore::start(&args).expect("store starts");
    let url = store.https_url();
    let ca = files.ca.cert_pem.clone();
    let mut clients: Vec<TlsClient> = Vec::new();
    for (_, token) in CALLERS {
        clients.push(
            tls_client(&url, &ca, None, token)
                .await
                .expect("TLS connects"),
        );
    }
    let admin = clients[6].clone();

    // Tenant A's and tenant B's sessions, written by their owners.
    for (i, sid) in [(2, "a:s1"), (3, "b:s1")] {
        clients[i]
            .clone()
            .append(AppendRequest {
                session_id: sid.into(),
                events: vec![user_event("seed", &format!("hello from {sid}"))],
                ..Default::default()
            })
            .await
            .expect("the owner appends");
    }

    let mut failures = Vec::new();
    let mut check = |rpc: &str, got: Vec<Code>, want: Row| {
        for (i, (caller, _)) in CALLERS.iter().enumerate() {
            if got[i] != want[i] {
                failures.push(format!(
                    "{rpc} by {caller}: got {:?}, want {:?}",
                    got[i], want[i]
                ));
            }
        }
    };

    // Append user_message to tenant A's session.
    let mut got = Vec::new();
    for (i, c) in clients.iter().enumerate() {
        let r = c
            .clone()
            .append(AppendRequest {
                session_id: "a:s1".into(),
                events: vec![user_event(&format!("m{i}"), "more")],
                ..Default::default()
            })
            .await;
        got.push(code(&r));
    }
    check("Append(user_message)", got, [UA, UA, OK, PD, PD, PD, OK]);

    // Append a runner-written kind with a made-up lease epoch.
    let mut got = Vec::new();
    for c in &clients {
        let r = c
            .clone()
            .append(AppendRequest {
                session_id: "a:s1".into(),
                lease_epoch: Some(999),
                events: vec![Event {
                    event_id: "err".into(),
                    kind: Some(event::Kind::RunError(RunError {
                        message: "x".into(),
                        retryable: false,
                    })),
                    ..Default::default()
                }],
                ..Default::default()
            })
            .await;
        got.push(code(&r));
    }
    check("Append(run_error)", got, [UA, UA, PD, PD, FP, PD, FP]);

    // Subscribe to tenant A's session (history only).
    let mut got = Vec::new();
    for c in &clients {
        let r = c
            .clone()
            .subscribe(SubscribeRequest {
                session_id: "a:s1".into(),
                from_seq: 0,
                follow: false,
            })
            .await;
        let r = match r {
            Ok(stream) => {
                let mut stream = stream.into_inner();
                let mut n = 0;
                let mut result = Ok(());
                loop {
                    match stream.message().await {
                        Ok(Some(_)) => n += 1,
                        Ok(None) => break,
                        Err(status) => {
                            result = Err(status);
                            break;
                        }
                    }
                }
                result.map(|_| assert!(n >= 1, "an allowed reader sees the history"))
            }
            Err(status) => Err(status),
        };
        got.push(code(&r));
    }
    check("Subscribe", got, [UA, UA, OK, NF, OK, NF, OK]);

    // GetSession of tenant A's session.
    let mut got = Vec::new();
    for c in &clients {
        let r = c
            .clone()
            .get_session(GetSessionRequest {
                session_id: "a:s1".into(),
            })
            .await;
        got.push(code(&r));
    }
    check("GetSession", got, [UA, UA, OK, NF, OK, NF, OK]);

    // ListSessions: allowed for every authenticated caller, but only in scope.
    let mut got = Vec::new();
    let mut seen = Vec::new();
    for c in &clients {
        let r = c
            .clone()
            .list_sessions(ListSessionsRequest::default())
            .await;
        got.push(code(&r));
        let mut ids: Vec<String> = r
            .map(|r| {
                r.into_inner()
                    .sessions
                    .into_iter()
                    .map(|s| s.session_id)
                    .collect()
            })
            .unwrap_or_default();
        ids.sort();
        seen.push(ids);
    }
    check("ListSessions", got, [UA, UA, OK, OK, OK, OK, OK]);
    let all = vec!["a:s1".to_string(), "b:s1".to_string()];
    assert_eq!(seen[2], vec!["a:s1".to_string()], "client A lists only A");
    assert_eq!(seen[3], vec!["b:s1".to_string()], "client B lists only B");
    assert_eq!(seen[4], all, "the runner lists all");
    assert_eq!(seen[5], vec!["b:s1".to_string()], "runner B lists only B");
    assert_eq!(seen[6], all, "the admin lists all");

    // AcquireLease on tenant A's session (the same owner name each time: a re-grant).
    let mut got = Vec::new();
    for c in &clients {
        let r = c
            .clone()
            .acquire_lease(AcquireLeaseRequest {
                session_id: "a:s1".into(),
                owner: "matrix".into(),
                ttl_ms: 60_000,
            })
            .await;
        got.push(code(&r));
    }
    check("AcquireLease", got, [UA, UA, PD, PD, OK, PD, OK]);

    // RenewLease / ReleaseLease with a made-up epoch.
    let mut renew = Vec::new();
    let mut release = Vec::new();
    for c in &clients {
        renew.push(code(
            &c.clone()
                .renew_lease(RenewLeaseRequest {
                    session_id: "a:s1".into(),
                    owner: "matrix".into(),
                    epoch: 999,
                    ttl_ms: 60_000,
                })
                .await,
        ));
        release.push(code(
            &c.clone()
                .release_lease(ReleaseLeaseRequest {
                    session_id: "a:s1".into(),
                    owner: "matrix".into(),
                    epoch: 999,
                })
                .await,
        ));
    }
    check("RenewLease", renew, [UA, UA, PD, PD, FP, PD, FP]);
    check("ReleaseLease", release, [UA, UA, PD, PD, FP, PD, FP]);

    // ClaimSession: runners and admins only; runner B only ever gets a b: session.
    let mut got = Vec::new();
    let mut claimed = Vec::new();
    for c in &clients {
        let r = c
            .clone()
            .claim_session(ClaimSessionRequest {
                owner: "claimer".into(),
                ttl_ms: 60_000,
                wait_ms: 0,
            })
            .await;
        got.push(code(&r));
        claimed.push(
            r.ok()
                .and_then(|r| r.into_inner().lease)
                .map(|l| l.session_id),
        );
    }
    check("ClaimSession", got, [UA, UA, PD, PD, OK, OK, OK]);
    // a:s1 is leased (AcquireLease above), so the runner gets b:s1, and nothing is left.
    assert_eq!(claimed[4].as_deref(), Some("b:s1"), "{claimed:?}");
    assert_eq!(
        claimed[5], None,
        "runner B: b:s1 is taken, a:s1 is not in scope"
    );
    assert_eq!(claimed[6], None);

    assert!(
        failures.is_empty(),
        "matrix mismatches:\n{}",
        failures.join("\n")
    );

    // Health stays open for probes: no token needed.
    let channel = tonic::transport::Endpoint::from_shared(url.clone())
        .expect("url")
        .tls_config(
            tonic::transport::ClientTlsConfig::new()
                .ca_certificate(tonic::transport::Certificate::from_pem(&ca)),
        )
        .expect("tls")
        .connect()
        .await
        .expect("connects");
    let health = tonic_health::pb::health_client::HealthClient::new(channel)
        .check(tonic_health::pb::HealthCheckRequest::default())
        .await
        .expect("health needs no token")
        .into_inner();
    assert_eq!(health.status, 1, "SERVING");

    // The admin sees exactly the writes that were allowed: the seed, client A's and the
    // admin's user messages; no runner-kind event got in.
    let info = admin
        .clone()
        .get_session(GetSessionRequest {
            session_id: "a:s1".into(),
        })
        .await
        .expect("admin reads")
        .into_inner();
    assert_eq!(info.last_seq, 3);

    // No token (nor a prefix of one) in any log line.
    let log = store.log();
    for token in ALL_TOKENS {
        assert!(!log.contains(token), "the store logged a token");
    }
}

/// The same rules through grpcurl, as an operator would type it.
#[tokio::test]
async fn grpcurl_with_cacert_and_bearer_header() {
    let files = SecureFiles::new();
    let tokens = files.write("tokens.json", &tokens_file());
    let mut args = files.tls_args();
    args.extend(["--tokens-file".into(), tokens.into()]);
    let store = LoggedStore::start(&args).expect("store starts");
    let tls = GrpcurlTls {
        cacert: Some(files.path("ca.pem")),
        ..Default::default()
    };
    let append = r#"{"session_id":"a:g1","events":[{"user_message":{"text":"hi"}}]}"#;
    let get = r#"{"session_id":"a:g1"}"#;
    let call = |token: Option<&str>, method: &str, data: &str| {
        grpcurl_tls(
            store.addr,
            &tls,
            token,
            &format!("agentlog.v1.EventStore/{method}"),
            data,
        )
    };

    let out = call(Some(A_TOKEN), "Append", append);
    assert_eq!(out.json()["lastSeq"], "1", "{out:?}");
    let expectations: [(Option<&str>, &str, &str, Option<&str>); 8] = [
        (None, "Append", append, Some("Unauthenticated")),
        (Some(BAD_TOKEN), "GetSession", get, Some("Unauthenticated")),
        (Some(B_TOKEN), "Append", append, Some("PermissionDenied")),
        (Some(B_TOKEN), "GetSession", get, Some("NotFound")),
        (Some(B_TOKEN), "Subscribe", get, Some("NotFound")),
        (Some(A_TOKEN), "GetSession", get, None),
        (Some(RUNNER_TOKEN), "GetSession", get, None),
        (Some(ADMIN_TOKEN), "ListSessions", "{}", None),
    ];
    for (token, method, data, want) in expectations {
        let out = call(token, method, data);
        assert_eq!(out.code().as_deref(), want, "{method}: {out:?}");
        assert_eq!(out.success, want.is_none(), "{method}: {out:?}");
        for t in ALL_TOKENS {
            assert!(!out.stderr.contains(t), "an error message quoted a token");
        }
    }
    // Plaintext to the TLS port fails.
    let plain = integration_tests::grpcurl_args(
        store.addr,
        &["-connect-timeout", "1"],
        "grpc.health.v1.Health/Check",
        None,
    );
    assert!(!plain.success);
}
