//! Who may move sessions, on a store that checks tokens: a client token exports only its
//! scope (`--all` walks its prefixes alone, a named session outside them is answered as
//! one that does not exist), only an admin token imports, and a runner pins nothing.

use agentlog_proto::v1::{AppendRequest, ExportRequest, ImportChunk, PinSessionRequest};
use integration_tests::secure::{tls_client, tokens_json, LoggedStore, SecureFiles, TokenSpec};
use integration_tests::user_event;
use tonic::Code;

const A: &str = "tenant-a-secret-token-1";
const B: &str = "tenant-b-secret-token-2";
const RUNNER_B: &str = "runner-b-secret-token-3";
const ADMIN: &str = "admin-secret-token-4";

async fn export_all(client: &mut integration_tests::secure::TlsClient) -> String {
    let mut stream = client
        .export(ExportRequest {
            session_ids: vec![],
            all: true,
        })
        .await
        .expect("export starts")
        .into_inner();
    let mut text = String::new();
    while let Some(piece) = stream.message().await.expect("export goes on") {
        text.push_str(&piece.text);
    }
    text
}

#[tokio::test]
async fn a_client_exports_its_scope_and_only_an_admin_imports() {
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
    let mut a = tls_client(&url, ca, None, Some(A)).await.expect("connects");
    let mut b = tls_client(&url, ca, None, Some(B)).await.expect("connects");
    let mut runner_b = tls_client(&url, ca, None, Some(RUNNER_B))
        .await
        .expect("connects");
    let mut admin = tls_client(&url, ca, None, Some(ADMIN))
        .await
        .expect("connects");
    for (client, id, text) in [
        (&mut a, "acme:payroll", "quarterly payroll figures"),
        (&mut b, "beta:notes", "meeting notes"),
    ] {
        client
            .append(AppendRequest {
                session_id: id.into(),
                events: vec![user_event("u1", text)],
                ..Default::default()
            })
            .await
            .expect("appends in its scope");
    }

    let theirs = export_all(&mut b).await;
    assert!(theirs.contains("beta:notes"), "{theirs}");
    assert!(
        !theirs.contains("acme:") && !theirs.contains("payroll"),
        "{theirs}"
    );
    let hidden = b
        .export(ExportRequest {
            session_ids: vec!["acme:payroll".into()],
            all: false,
        })
        .await
        .expect_err("outside B's scope");
    assert_eq!(hidden.code(), Code::NotFound, "{hidden:?}");
    let everything = export_all(&mut admin).await;
    assert!(everything.contains("acme:payroll") && everything.contains("beta:notes"));

    for (who, client) in [("client", &mut a), ("runner", &mut runner_b)] {
        let chunks = vec![ImportChunk {
            text: everything.clone(),
        }];
        let refused = client
            .import(tokio_stream::iter(chunks))
            .await
            .expect_err("only an admin imports");
        assert_eq!(refused.code(), Code::PermissionDenied, "{who}: {refused:?}");
        assert!(refused.message().contains("admin"), "{refused:?}");
    }
    let pin = |id: &str| PinSessionRequest {
        session_id: id.into(),
        pinned: true,
    };
    let refused = runner_b
        .pin_session(pin("beta:notes"))
        .await
        .expect_err("a runner pins nothing");
    assert_eq!(refused.code(), Code::PermissionDenied);
    let refused = b
        .pin_session(pin("acme:payroll"))
        .await
        .expect_err("outside B's scope");
    assert_eq!(refused.code(), Code::PermissionDenied);
    assert!(
        b.pin_session(pin("beta:notes"))
            .await
            .expect("its own")
            .into_inner()
            .pinned
    );

    // The admin's import of the store's own export changes nothing.
    let chunks = vec![ImportChunk { text: everything }];
    let mut results = admin
        .import(tokio_stream::iter(chunks))
        .await
        .expect("an admin imports")
        .into_inner();
    let mut outcomes = Vec::new();
    while let Some(r) = results.message().await.expect("results") {
        outcomes.push((r.session_id.clone(), r.outcome()));
    }
    outcomes.sort();
    use agentlog_proto::v1::ImportOutcome::Unchanged;
    assert_eq!(
        outcomes,
        vec![
            ("acme:payroll".to_string(), Unchanged),
            ("beta:notes".to_string(), Unchanged)
        ]
    );
}
