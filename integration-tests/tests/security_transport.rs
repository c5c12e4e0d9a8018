//! Transport security of the real `event-store`: mutual TLS refuses clients without a
//! certificate or with one from another CA; certificates and the tokens file are reloaded
//! without a restart (on change, and on SIGHUP); plaintext and open access are refused on a
//! non-loopback address unless explicitly allowed.

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use agentlog_proto::v1::{GetSessionRequest, ListSessionsRequest};
use integration_tests::secure::{
    grpcurl_tls, tls_client, tokens_json, write_atomically, Ca, GrpcurlTls, LoggedStore,
    SecureFiles, TokenSpec,
};
use integration_tests::{bin_path, signal, Signal};
use tonic::Code;

/// Polls an async check until it holds; panics naming `what` after `bound`.
async fn eventually<F, Fut>(what: &str, bound: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + bound;
    while !check().await {
        assert!(Instant::now() < deadline, "gave up waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Whether a TLS client trusting `ca` (presenting `id`) can make a call.
async fn can_call(
    url: &str,
    ca: &str,
    id: Option<&integration_tests::secure::CertPair>,
    token: Option<&str>,
) -> bool {
    match tls_client(url, ca, id, token).await {
        Err(_) => false,
        Ok(mut c) => c
            .list_sessions(ListSessionsRequest::default())
            .await
            .is_ok(),
    }
}

#[tokio::test]
async fn mtls_refuses_clients_without_a_cert_or_with_another_cas() {
    let files = SecureFiles::new();
    let client_ca = Ca::new("client CA");
    let other_ca = Ca::new("someone else's CA");
    files.write("client-ca.pem", &client_ca.cert_pem);
    let good = client_ca.client_cert("runner-1");
    let foreign = other_ca.client_cert("intruder");
    let mut args = files.tls_args();
    args.extend(["--tls-client-ca".into(), files.path("client-ca.pem").into()]);
    let store = LoggedStore::start(&args).expect("store starts");
    let url = store.https_url();
    let ca = &files.ca.cert_pem;

    assert!(
        can_call(&url, ca, Some(&good), None).await,
        "a client of the CA is served"
    );
    assert!(
        !can_call(&url, ca, None, None).await,
        "no client certificate: refused"
    );
    assert!(
        !can_call(&url, ca, Some(&foreign), None).await,
        "a certificate of another CA: refused"
    );

    // The same through grpcurl's -cacert/-cert/-key.
    let good_cert = files.write("good.pem", &good.cert_pem);
    let good_key = files.write("good.key", &good.key_pem);
    let bad_cert = files.write("bad.pem", &foreign.cert_pem);
    let bad_key = files.write("bad.key", &foreign.key_pem);
    let list = |cert: Option<(&std::path::Path, &std::path::Path)>| {
        grpcurl_tls(
            store.addr,
            &GrpcurlTls {
                cacert: Some(files.path("ca.pem")),
                cert: cert.map(|c| c.0.to_path_buf()),
                key: cert.map(|c| c.1.to_path_buf()),
            },
            None,
            "agentlog.v1.EventStore/ListSessions",
            "{}",
        )
    };
    let out = list(Some((&good_cert, &good_key)));
    assert!(out.success, "{out:?}");
    assert!(!list(None).success);
    assert!(!list(Some((&bad_cert, &bad_key))).success);
}

#[tokio::test]
async fn certificates_reload_on_change_and_on_sighup() {
    let files = SecureFiles::new();
    let mut args = files.tls_args();
    args.extend(["--reload-interval-ms".into(), "200".into()]);
    let store = LoggedStore::start(&args).expect("store starts");
    let pid = store.pid();
    let url = store.https_url();
    let first_ca = files.ca.cert_pem.clone();
    assert!(can_call(&url, &first_ca, None, None).await);

    // Rotate to a certificate from a new CA, as cert-manager + a Secret mount would.
    let second_ca = Ca::new("rotated CA");
    let second = second_ca.server_cert();
    write_atomically(&files.path("server.key"), &second.key_pem);
    write_atomically(&files.path("server.pem"), &second.cert_pem);
    eventually(
        "the new certificate to be served",
        Duration::from_secs(10),
        || can_call(&url, &second_ca.cert_pem, None, None),
    )
    .await;
    assert!(
        !can_call(&url, &first_ca, None, None).await,
        "the old certificate is no longer served"
    );

    // A broken file is refused and the current certificate stays.
    write_atomically(&files.path("server.pem"), "not a certificate");
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(can_call(&url, &second_ca.cert_pem, None, None).await);
    assert!(store.log().contains("reload refused"));

    // SIGHUP reloads at once, whatever the polling interval.
    let third_ca = Ca::new("third CA");
    let third = third_ca.server_cert();
    let slow = SecureFiles::new();
    let mut args = slow.tls_args();
    args.extend(["--reload-interval-ms".into(), "3600000".into()]);
    let slow_store = LoggedStore::start(&args).expect("store starts");
    let slow_url = slow_store.https_url();
    write_atomically(&slow.path("server.key"), &third.key_pem);
    write_atomically(&slow.path("server.pem"), &third.cert_pem);
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(
        !can_call(&slow_url, &third_ca.cert_pem, None, None).await,
        "not polled within the hour-long interval"
    );
    signal(slow_store.pid(), Signal::SIGHUP);
    eventually(
        "SIGHUP to reload the certificate",
        Duration::from_secs(10),
        || can_call(&slow_url, &third_ca.cert_pem, None, None),
    )
    .await;

    // Neither store restarted.
    assert_eq!(store.pid(), pid);
    assert_eq!(store.log().matches("event store serving").count(), 1);
    assert_eq!(slow_store.log().matches("event store serving").count(), 1);
}

#[tokio::test]
async fn tokens_file_reloads_without_a_restart() {
    let files = SecureFiles::new();
    let old = "old-admin-token-9f8e7d";
    let new = "new-admin-token-1a2b3c";
    let spec = |token| tokens_json(&[TokenSpec::unscoped("ops", token, "admin")]);
    let tokens = files.write("tokens.json", &spec(old));
    let mut args = files.tls_args();
    args.extend([
        "--tokens-file".into(),
        tokens.clone().into(),
        "--reload-interval-ms".into(),
        "200".into(),
    ]);
    let store = LoggedStore::start(&args).expect("store starts");
    let url = store.https_url();
    let ca = files.ca.cert_pem.clone();
    assert!(can_call(&url, &ca, None, Some(old)).await);
    assert!(!can_call(&url, &ca, None, Some(new)).await);

    // Rotate: the new token works, the old one is refused, on the same connection too.
    let mut kept = tls_client(&url, &ca, None, Some(old))
        .await
        .expect("connects");
    write_atomically(&tokens, &spec(new));
    eventually(
        "the new token to be accepted",
        Duration::from_secs(10),
        || can_call(&url, &ca, None, Some(new)),
    )
    .await;
    let err = kept
        .get_session(GetSessionRequest {
            session_id: "s1".into(),
        })
        .await
        .expect_err("revoked");
    assert_eq!(err.code(), Code::Unauthenticated);

    // A broken tokens file keeps the tokens in force.
    write_atomically(&tokens, "{ not json");
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(can_call(&url, &ca, None, Some(new)).await);
    let log = store.log();
    assert!(log.contains("reload refused"), "the bad file is reported");
    assert!(
        !log.contains(old) && !log.contains(new),
        "no token is logged"
    );
    assert_eq!(log.matches("event store serving").count(), 1);
}

/// Runs `event-store` with `args` until it exits or serves; returns (exit status or None
/// if it served, stderr).
fn try_start(args: &[&str]) -> (Option<std::process::ExitStatus>, String) {
    let data = tempfile::tempdir().expect("temp dir");
    let mut child = Command::new(bin_path("event-store"))
        .arg("--data-dir")
        .arg(data.path())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    // A refusal comes at once; a store that serves is still running after this.
    let deadline = Instant::now() + Duration::from_millis(1500);
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait") {
            break Some(status);
        }
        if Instant::now() > deadline {
            break None;
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let _ = child.kill();
    let out = child.wait_with_output().expect("output");
    (status, String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn non_loopback_needs_tls_and_tokens_or_explicit_waivers() {
    let (status, err) = try_start(&["--listen", "0.0.0.0:0"]);
    assert!(status.is_some_and(|s| !s.success()), "{err}");
    assert!(err.contains("--insecure-plaintext"), "{err}");

    let (status, err) = try_start(&["--listen", "0.0.0.0:0", "--insecure-plaintext"]);
    assert!(status.is_some_and(|s| !s.success()), "{err}");
    assert!(err.contains("--allow-unauthenticated"), "{err}");

    let (status, err) = try_start(&[
        "--listen",
        "0.0.0.0:0",
        "--insecure-plaintext",
        "--allow-unauthenticated",
    ]);
    assert!(status.is_none(), "serves when both are waived: {err}");
    assert!(
        err.contains("PLAINTEXT") && err.contains("WITHOUT AUTHENTICATION"),
        "{err}"
    );

    // Loopback: plaintext and open, as the README's quickstart runs it.
    let (status, err) = try_start(&["--listen", "127.0.0.1:0"]);
    assert!(status.is_none(), "{err}");
    assert!(!err.contains("WARN"), "{err}");

    // TLS files that are not there: a clear error, not a plaintext fallback.
    let (status, err) = try_start(&[
        "--listen",
        "127.0.0.1:0",
        "--tls-cert",
        "/nonexistent/cert.pem",
        "--tls-key",
        "/nonexistent/key.pem",
    ]);
    assert!(status.is_some_and(|s| !s.success()), "{err}");
    assert!(err.contains("--tls-cert"), "{err}");
}
