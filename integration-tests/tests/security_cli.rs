//! The `agentlog` CLI as a TLS client of a store that checks tokens: it trusts `--tls-ca`,
//! sends the token from `--token-file` or `AGENTLOG_TOKEN`, sees only its tenant's
//! sessions, and says what is wrong when the CA or the token is.

use std::process::{Command, Output};

use agentlog_proto::v1::AppendRequest;
use integration_tests::secure::{tls_client, tokens_json, LoggedStore, SecureFiles, TokenSpec};
use integration_tests::{bin_path, user_event};

const A: &str = "cli-tenant-a-token-1";
const ADMIN: &str = "cli-admin-token-2";

fn agentlog(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(bin_path("agentlog"));
    cmd.args(args)
        .env_remove("AGENTLOG_TOKEN")
        .env_remove("AGENTLOG_ADDR");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().expect("agentlog runs")
}

fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[tokio::test]
async fn the_cli_speaks_tls_with_a_token_and_sees_only_its_tenant() {
    let files = SecureFiles::new();
    let tokens = files.write(
        "tokens.json",
        &tokens_json(&[
            TokenSpec::scoped("a", A, "client", &["acme:"]),
            TokenSpec::unscoped("ops", ADMIN, "admin"),
        ]),
    );
    let mut args = files.tls_args();
    args.extend(["--tokens-file".into(), tokens.into()]);
    let store = LoggedStore::start(&args).expect("store starts");
    let url = store.https_url();
    let admin = tls_client(&url, &files.ca.cert_pem, None, Some(ADMIN))
        .await
        .expect("connects");
    for (session, text) in [("acme:s1", "acme payroll"), ("beta:s1", "beta secrets")] {
        admin
            .clone()
            .append(AppendRequest {
                session_id: session.into(),
                events: vec![user_event("u1", text)],
                ..Default::default()
            })
            .await
            .expect("admin appends");
    }
    let ca = files.path("ca.pem");
    let ca = ca.to_str().expect("utf-8 path");
    let token_file = files.write("a.token", A);
    let token_file = token_file.to_str().expect("utf-8 path");

    // The token from a file: tenant A's session only.
    let out = agentlog(
        &[
            "--addr",
            &url,
            "--tls-ca",
            ca,
            "--token-file",
            token_file,
            "--json",
            "ls",
        ],
        &[],
    );
    assert!(out.status.success(), "ls failed: {}", stderr(&out));
    assert!(stdout(&out).contains("acme:s1"), "{}", stdout(&out));
    assert!(
        !stdout(&out).contains("beta"),
        "another tenant leaked: {}",
        stdout(&out)
    );

    // The token from the environment; the transcript of A's session.
    let out = agentlog(
        &["--addr", &url, "--tls-ca", ca, "show", "acme:s1"],
        &[("AGENTLOG_TOKEN", A)],
    );
    assert!(out.status.success(), "show failed: {}", stderr(&out));
    assert!(stdout(&out).contains("acme payroll"), "{}", stdout(&out));

    // Another tenant's session reads as missing.
    let out = agentlog(
        &["--addr", &url, "--tls-ca", ca, "show", "beta:s1"],
        &[("AGENTLOG_TOKEN", A)],
    );
    assert!(!out.status.success());
    assert!(!stdout(&out).contains("beta secrets"));

    // No token: refused, and the error says so; the token never appears in output.
    let out = agentlog(&["--addr", &url, "--tls-ca", ca, "ls"], &[]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("Unauthenticated") || stderr(&out).contains("token"),
        "{}",
        stderr(&out)
    );

    // A CA that did not sign the store's certificate: no connection.
    let other = SecureFiles::new();
    let other_ca = other.path("ca.pem");
    let out = agentlog(
        &[
            "--addr",
            &url,
            "--tls-ca",
            other_ca.to_str().expect("utf-8"),
            "ls",
        ],
        &[("AGENTLOG_TOKEN", A)],
    );
    assert!(!out.status.success(), "a foreign CA must not connect");
    for out_text in [stdout(&out), stderr(&out), store.log()] {
        assert!(!out_text.contains(A), "the token leaked");
    }
}
