//! `/metrics` of the real binaries after a scripted session: the counters moved by exactly
//! what the session did (appends by durability, tool runs, model calls and tokens, leases),
//! and a stale lease epoch shows up as a fencing refusal.

mod runner_support;
mod telemetry_support;

use std::time::Duration;

use agentlog_proto::v1::event::Kind;
use agentlog_proto::v1::{
    AcquireLeaseRequest, AppendRequest, Durability, Event, ReleaseLeaseRequest, RenewLeaseRequest,
    RunError, SubscribeRequest,
};
use integration_tests::anthropic_standin::{AnthropicStandin, StandinReply};
use integration_tests::poll_until;
use runner_support::{user_says, wait_idle};
use serde_json::json;
use telemetry_support::{start_runner, start_store};
use tokio_stream::StreamExt;

#[tokio::test(flavor = "multi_thread")]
async fn counters_follow_a_scripted_session_and_a_fencing_refusal() {
    let data = tempfile::tempdir().expect("temp dir");
    let store = start_store(data.path(), &[]);
    let mut client = agentlog_proto::v1::event_store_client::EventStoreClient::connect(store.url())
        .await
        .expect("client");
    let standin = AnthropicStandin::start(vec![
        StandinReply::text("Writing two things.")
            .tool("bash", json!({"command": "echo hi"}))
            .tool("write_file", json!({"path": "a.txt", "content": "a"})),
        StandinReply::text("Done."),
    ])
    .await
    .expect("stand-in");
    let workspaces = tempfile::tempdir().expect("temp dir");
    let runner = start_runner(&store.url(), workspaces.path(), &standin.url(), &[]);

    user_says(&mut client, "s1", "write two things").await;
    let events = wait_idle(&mut client, "s1", 0, Duration::from_secs(60)).await;

    // The runner: two model calls, one run of each tool, and the tokens the provider reported.
    let (input, output) = events
        .iter()
        .filter_map(|e| match &e.kind {
            Some(Kind::AssistantMessage(m)) => m.usage.as_ref(),
            _ => None,
        })
        .fold((0.0, 0.0), |(i, o), u| {
            (i + u.input_tokens as f64, o + u.output_tokens as f64)
        });
    let metrics = poll_until(
        "the runner to let the session go",
        Duration::from_secs(10),
        || {
            let m = runner.scrape();
            (m.get("agentlog_runner_sessions_held") == 0.0).then_some(m)
        },
    );
    for (series, value) in [
        (
            r#"agentlog_runner_model_calls_total{provider="anthropic",outcome="ok"}"#,
            2.0,
        ),
        (
            r#"agentlog_runner_model_call_duration_seconds_count{provider="anthropic"}"#,
            2.0,
        ),
        (
            r#"agentlog_runner_tool_runs_total{tool="bash",outcome="ok"}"#,
            1.0,
        ),
        (
            r#"agentlog_runner_tool_runs_total{tool="write_file",outcome="ok"}"#,
            1.0,
        ),
        (
            r#"agentlog_runner_tool_runs_total{tool="read_file",outcome="ok"}"#,
            0.0,
        ),
        (
            r#"agentlog_runner_tool_duration_seconds_count{tool="bash"}"#,
            1.0,
        ),
        (
            r#"agentlog_runner_model_tokens_total{provider="anthropic",direction="input"}"#,
            input,
        ),
        (
            r#"agentlog_runner_model_tokens_total{provider="anthropic",direction="output"}"#,
            output,
        ),
        ("agentlog_runner_leases_lost_total", 0.0),
    ] {
        assert_eq!(metrics.get(series), value, "{series} in\n{}", metrics.text);
    }
    assert!(input > 0.0 && output > 0.0, "the stand-in reports usage");
    assert!(
        !metrics.text.contains("s1"),
        "a session id leaked into the runner's metrics:\n{}",
        metrics.text
    );

    // The store: the seven SYNC appends of the session (user turn, two replies, two
    // tool_started, two tool_result) and one BUFFERED append per streamed delta.
    let deltas = events
        .iter()
        .filter(|e| matches!(e.kind, Some(Kind::AssistantDelta(_))))
        .count() as f64;
    let metrics = store.scrape();
    for (series, value) in [
        (
            r#"agentlog_store_appends_total{durability="sync",outcome="ok"}"#,
            7.0,
        ),
        (
            r#"agentlog_store_appends_total{durability="buffered",outcome="ok"}"#,
            deltas,
        ),
        (
            r#"agentlog_store_append_duration_seconds_count{durability="sync"}"#,
            7.0,
        ),
        // The user's turn came as a unary Append (this test's client); every runner append
        // as a request of an AppendStream.
        (r#"agentlog_store_append_requests_total{rpc="append"}"#, 1.0),
        (
            r#"agentlog_store_append_requests_total{rpc="append_stream"}"#,
            6.0 + deltas,
        ),
        (r#"agentlog_store_lease_grants_total{how="claim"}"#, 1.0),
        (r#"agentlog_store_lease_grants_total{how="acquire"}"#, 0.0),
        (r#"agentlog_store_fencing_refusals_total{op="append"}"#, 0.0),
    ] {
        assert_eq!(metrics.get(series), value, "{series} in\n{}", metrics.text);
    }
    assert!(deltas > 0.0, "the reply text was streamed");
    assert!(metrics.get("agentlog_store_lease_renewals_total") >= 1.0);
    // Every event and the claim's lease record went through some fsync's batch.
    let fsyncs = metrics.get("agentlog_store_fsyncs_total");
    assert!(fsyncs >= 1.0);
    assert_eq!(
        metrics.get("agentlog_store_fsync_duration_seconds_count"),
        fsyncs
    );
    assert!(metrics.get("agentlog_store_fsync_batch_records_sum") >= events.len() as f64 + 1.0);
    assert!(metrics.get("agentlog_store_log_bytes") > 0.0);
    assert!(metrics.get("agentlog_store_log_segments") >= 1.0);
    assert!(
        !metrics.text.contains("s1"),
        "a session id leaked:\n{}",
        metrics.text
    );

    // A writer fenced off: a's lease is released and b takes a newer one; a's append and
    // renewal under the old epoch are refused, and counted.
    let lease_a = client
        .acquire_lease(AcquireLeaseRequest {
            session_id: "s1".into(),
            owner: "a".into(),
            ttl_ms: 60_000,
        })
        .await
        .expect("lease a")
        .into_inner();
    client
        .release_lease(ReleaseLeaseRequest {
            session_id: "s1".into(),
            owner: "a".into(),
            epoch: lease_a.epoch,
        })
        .await
        .expect("release a");
    client
        .acquire_lease(AcquireLeaseRequest {
            session_id: "s1".into(),
            owner: "b".into(),
            ttl_ms: 60_000,
        })
        .await
        .expect("lease b");
    let refused = client
        .append(AppendRequest {
            session_id: "s1".into(),
            events: vec![Event {
                kind: Some(Kind::RunError(RunError {
                    message: "stale".into(),
                    retryable: false,
                })),
                ..Event::default()
            }],
            lease_epoch: Some(lease_a.epoch),
            durability: Durability::Sync as i32,
            ..AppendRequest::default()
        })
        .await
        .expect_err("a stale epoch is refused");
    assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
    let renewal = client
        .renew_lease(RenewLeaseRequest {
            session_id: "s1".into(),
            owner: "a".into(),
            epoch: lease_a.epoch,
            ttl_ms: 60_000,
        })
        .await
        .expect_err("a stale renewal is refused");
    assert_eq!(renewal.code(), tonic::Code::FailedPrecondition);

    // A follower that has read the history counts as a live subscriber.
    let mut follower = client
        .clone()
        .subscribe(SubscribeRequest {
            session_id: "s1".into(),
            from_seq: 1,
            follow: true,
        })
        .await
        .expect("subscribe")
        .into_inner();
    for _ in &events {
        follower.next().await.expect("history").expect("event");
    }
    let metrics = poll_until("the follower to be live", Duration::from_secs(10), || {
        let m = store.scrape();
        (m.get(r#"agentlog_store_subscribers{state="live"}"#) == 1.0).then_some(m)
    });
    for (series, value) in [
        (r#"agentlog_store_fencing_refusals_total{op="append"}"#, 1.0),
        (r#"agentlog_store_fencing_refusals_total{op="renew"}"#, 1.0),
        (
            r#"agentlog_store_appends_total{durability="sync",outcome="failed_precondition"}"#,
            1.0,
        ),
        (
            r#"agentlog_store_appends_total{durability="sync",outcome="ok"}"#,
            7.0,
        ),
        (r#"agentlog_store_lease_grants_total{how="acquire"}"#, 2.0),
        (r#"agentlog_store_subscribers{state="catching_up"}"#, 0.0),
    ] {
        assert_eq!(metrics.get(series), value, "{series} in\n{}", metrics.text);
    }
}

/// Over PostgreSQL the store also shows its connection pool and the time of its database
/// round trips, and an append moves the `append` statement's count.
#[tokio::test(flavor = "multi_thread")]
async fn the_postgres_backend_shows_its_pool_and_statement_latency() {
    let pg = integration_tests::pg::shared().expect("a PostgreSQL server");
    let url = pg.create_database().expect("a database");
    let store = telemetry_support::start_store_on_database(&url, &["--database-pool-size", "4"]);
    let mut client = agentlog_proto::v1::event_store_client::EventStoreClient::connect(store.url())
        .await
        .expect("client");
    let before = store.scrape();
    let appends = "agentlog_store_pg_statement_duration_seconds_count{statement=\"append\"}";
    user_says(&mut client, "pg1", "hello").await;
    user_says(&mut client, "pg1", "again").await;

    let after = store.scrape();
    assert_eq!(
        after.get(appends) - before.get(appends),
        2.0,
        "{}",
        after.text
    );
    assert_eq!(after.get("agentlog_store_pg_pool_connections_max"), 4.0);
    let open = after.get("agentlog_store_pg_pool_connections_idle")
        + after.get("agentlog_store_pg_pool_connections_in_use");
    assert!((1.0..=4.0).contains(&open), "{}", after.text);
    assert_eq!(after.get("agentlog_store_pg_pool_waiting"), 0.0);
    // The appends themselves are counted at the service edge, whatever the backend.
    assert_eq!(
        after.get("agentlog_store_appends_total{durability=\"sync\",outcome=\"ok\"}")
            - before.get("agentlog_store_appends_total{durability=\"sync\",outcome=\"ok\"}"),
        2.0
    );
}
