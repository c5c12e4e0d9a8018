//! `agentlog web` off loopback: it refuses to start without HTTPS and a login token; with
//! them, nothing but the login form is served until the browser holds the login cookie (or
//! a program sends the token as a bearer), the cookie is HttpOnly, SameSite=Strict and
//! Secure, and neither the login token nor the store's own token ever reaches a response.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use futures::StreamExt;
use integration_tests::bin_path;
use integration_tests::secure::{tokens_json, LoggedStore, SecureFiles, TokenSpec};
use serde_json::{json, Value};

const STORE_TOKEN: &str = "store-token-the-browser-must-never-see";
const LOGIN_TOKEN: &str = "login-token-people-type-in-once";
const PATIENCE: Duration = Duration::from_secs(30);

fn agentlog_web(args: &[&str]) -> Command {
    let mut cmd = Command::new(bin_path("agentlog"));
    cmd.args(args).stdin(Stdio::null()).stdout(Stdio::null());
    cmd
}

#[test]
fn off_loopback_it_refuses_to_start_without_https_and_a_login_token() {
    let files = SecureFiles::new();
    let login = files.write("login.token", LOGIN_TOKEN);
    let (cert, key) = (files.path("server.pem"), files.path("server.key"));
    let cert = cert.to_str().expect("utf-8");
    let key = key.to_str().expect("utf-8");
    let login = login.to_str().expect("utf-8");
    let bare = ["web", "--listen", "0.0.0.0:0"];
    for extra in [
        vec![],
        vec!["--tls-cert", cert, "--tls-key", key],
        vec!["--login-token-file", login],
    ] {
        let out = agentlog_web(&[&bare[..], &extra[..]].concat())
            .stderr(Stdio::piped())
            .output()
            .expect("run agentlog web");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "it must not start with {extra:?}");
        assert!(
            stderr.contains("--tls-cert") && stderr.contains("--login-token-file"),
            "the refusal says what to add: {stderr}"
        );
    }
    let short = files.write("short.token", "too-short");
    let out = agentlog_web(
        &[
            &bare[..],
            &["--tls-cert", cert, "--tls-key", key, "--login-token-file"],
            &[short.to_str().expect("utf-8")],
        ]
        .concat(),
    )
    .stderr(Stdio::piped())
    .output()
    .expect("run agentlog web");
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("at least 16"));
    // A key file that holds no key is named before anything is served.
    let out = agentlog_web(
        &[
            &bare[..],
            &[
                "--tls-cert",
                cert,
                "--tls-key",
                cert,
                "--login-token-file",
                login,
            ],
        ]
        .concat(),
    )
    .stderr(Stdio::piped())
    .output()
    .expect("run agentlog web");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        stderr.contains("--tls-key") && !stderr.contains("listening"),
        "{stderr}"
    );
}

struct Web(Child);

impl Drop for Web {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn listen_addr(child: &mut Child) -> SocketAddr {
    let stderr = child.stderr.take().expect("piped stderr");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut tx = Some(tx);
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("[web] {line}");
            let addr = line
                .split("listen_addr=")
                .nth(1)
                .and_then(|rest| rest.split_whitespace().next())
                .and_then(|a| a.parse::<SocketAddr>().ok());
            if let Some(addr) = addr {
                if let Some(tx) = tx.take() {
                    let _ = tx.send(addr);
                }
            }
        }
    });
    rx.recv_timeout(PATIENCE)
        .expect("agentlog web logs its address")
}

/// Asserts that no secret is in `text`, naming where it was seen.
fn no_secrets(where_: &str, text: &str) {
    assert!(
        !text.contains(STORE_TOKEN),
        "the store token leaked in {where_}"
    );
    assert!(
        !text.contains(LOGIN_TOKEN),
        "the login token leaked in {where_}"
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn off_loopback_it_serves_https_behind_a_login_and_keeps_every_token_to_itself() {
    let files = SecureFiles::new();
    let tokens = files.write(
        "tokens.json",
        &tokens_json(&[TokenSpec::scoped("web", STORE_TOKEN, "client", &["acme:"])]),
    );
    let mut args = files.tls_args();
    args.extend(["--tokens-file".into(), tokens.into()]);
    let store = LoggedStore::start(&args).expect("secured store");
    let store_token = files.write("store.token", STORE_TOKEN);
    let login = files.write("login.token", &format!("{LOGIN_TOKEN}\n"));
    let ca = files.path("ca.pem");
    let mut child = agentlog_web(&[
        "--addr",
        &store.https_url(),
        "--tls-ca",
        ca.to_str().expect("utf-8"),
        "--token-file",
        store_token.to_str().expect("utf-8"),
        "web",
        "--listen",
        "0.0.0.0:0",
        "--tls-cert",
        files.path("server.pem").to_str().expect("utf-8"),
        "--tls-key",
        files.path("server.key").to_str().expect("utf-8"),
        "--login-token-file",
        login.to_str().expect("utf-8"),
    ])
    .stderr(Stdio::piped())
    .spawn()
    .expect("spawn agentlog web");
    let port = listen_addr(&mut child).port();
    let _web = Web(child);
    let base = format!("https://localhost:{port}");
    let client = reqwest::Client::builder()
        .add_root_certificate(
            reqwest::Certificate::from_pem(files.ca.cert_pem.as_bytes()).expect("CA"),
        )
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .expect("client");

    // Plain HTTP gets nothing: the port speaks TLS only.
    let plain = reqwest::Client::new()
        .get(format!("http://localhost:{port}/v1/sessions"))
        .timeout(PATIENCE)
        .send()
        .await;
    assert!(plain.is_err(), "plain HTTP must not be served: {plain:?}");

    // Signed out: the API says 401, pages send people to the login form.
    let response = client
        .get(format!("{base}/v1/sessions"))
        .send()
        .await
        .expect("GET");
    assert_eq!(response.status(), 401);
    let response = client.get(format!("{base}/")).send().await.expect("GET /");
    assert!(response.status().is_redirection());
    assert_eq!(response.headers()["location"], "/login");
    let response = client
        .get(format!("{base}/login"))
        .send()
        .await
        .expect("GET /login");
    assert_eq!(response.status(), 200);
    no_secrets("the login page", &response.text().await.expect("body"));
    let response = client
        .get(format!("{base}/v1/sessions"))
        .bearer_auth("not-the-login-token")
        .send()
        .await
        .expect("GET");
    assert_eq!(response.status(), 401);

    // The login form: a wrong token is refused; the right one sets the cookie.
    let login_post = |token: &str| {
        client
            .post(format!("{base}/login"))
            .header("X-Agentlog-Request", "1")
            .json(&json!({ "token": token }))
            .send()
    };
    assert_eq!(
        login_post("wrong-token-wrong-token")
            .await
            .expect("POST")
            .status(),
        401
    );
    let response = login_post(LOGIN_TOKEN).await.expect("POST /login");
    assert_eq!(response.status(), 204);
    let set_cookie = response.headers()["set-cookie"]
        .to_str()
        .expect("ascii")
        .to_string();
    for attribute in ["HttpOnly", "SameSite=Strict", "Secure", "Path=/"] {
        assert!(
            set_cookie.contains(attribute),
            "{attribute} in {set_cookie}"
        );
    }
    no_secrets("the login cookie", &set_cookie);
    let cookie = set_cookie
        .split(';')
        .next()
        .expect("name=value")
        .to_string();

    // Signed in: the web server reaches the secured store with its own token.
    let response = client
        .post(format!("{base}/v1/sessions/acme:s1/messages"))
        .header("Cookie", &cookie)
        .header("X-Agentlog-Request", "1")
        .json(&json!({"text": "hello through the web"}))
        .send()
        .await
        .expect("POST");
    assert_eq!(response.status(), 201);
    let mut seen = String::new();
    for path in [
        "/",
        "/sessions/acme:s1",
        "/assets/session.js",
        "/v1/sessions",
        "/v1/sessions/acme:s1",
    ] {
        let response = client
            .get(format!("{base}{path}"))
            .header("Cookie", &cookie)
            .send()
            .await
            .expect("GET");
        assert_eq!(response.status(), 200, "{path}");
        let headers = format!("{:?}", response.headers());
        let body = response.text().await.expect("body");
        no_secrets(path, &format!("{headers}\n{body}"));
        seen.push_str(&body);
    }
    assert!(
        seen.contains("hello through the web"),
        "the session is listed"
    );
    let list: Value = client
        .get(format!("{base}/v1/sessions"))
        .bearer_auth(LOGIN_TOKEN)
        .send()
        .await
        .expect("GET with a bearer")
        .json()
        .await
        .expect("JSON");
    assert_eq!(
        list["sessions"][0]["sessionId"], "acme:s1",
        "programs use the bearer"
    );

    let response = client
        .get(format!("{base}/v1/sessions/acme:s1/events"))
        .header("Cookie", &cookie)
        .send()
        .await
        .expect("GET events");
    assert_eq!(response.status(), 200);
    let mut body = response.bytes_stream();
    let mut text = String::new();
    while !text.contains("caught_up") {
        let chunk = tokio::time::timeout(PATIENCE, body.next())
            .await
            .expect("events within the patience bound")
            .expect("the stream goes on")
            .expect("a chunk");
        text.push_str(&String::from_utf8_lossy(&chunk));
    }
    assert!(text.contains("event: user_message") && text.contains("hello through the web"));
    no_secrets("the event stream", &text);
}

/// `--as-loopback` (a container whose port the host publishes on its own loopback): off
/// loopback it serves plaintext with no login, and answers only requests that name a
/// loopback host, so a page of another site reaching it by DNS rebinding gets nothing.
#[tokio::test(flavor = "multi_thread")]
async fn as_loopback_serves_plaintext_without_login_only_to_loopback_names() {
    let mut child = agentlog_web(&["web", "--listen", "0.0.0.0:0", "--as-loopback"])
        .stderr(Stdio::piped())
        .spawn()
        .expect("start agentlog web");
    let addr = listen_addr(&mut child);
    let _web = Web(child);
    let port = addr.port();
    let http = reqwest::Client::new();
    let page = http
        .get(format!("http://127.0.0.1:{port}/"))
        .send()
        .await
        .expect("GET /");
    assert_eq!(page.status(), 200, "no login is asked for");
    let rebound = http
        .get(format!("http://127.0.0.1:{port}/"))
        .header("host", format!("evil.example:{port}"))
        .send()
        .await
        .expect("GET / as another site");
    assert_eq!(rebound.status(), 421);
    let body: Value = rebound.json().await.expect("a JSON error");
    assert!(
        body["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("localhost")),
        "{body}"
    );
}
