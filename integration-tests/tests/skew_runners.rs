//! Runners of the last release and of this build working one store on the local backend
//! (over PostgreSQL with `AGENTLOG_TEST_BACKEND=postgres`; the real binaries of both:
//! `deploy/previous-release` builds the release's), under a client's appends. In the first test the store is this build's, and each runner is
//! SIGKILLed in the middle of a call and replaced by one of the other build, and the store
//! itself is SIGKILLed and started again. In the second the store starts as the release's
//! and is replaced, SIGKILLed, by this build on the release's data while runners
//! of both work through it. `skew_support` checks that nothing acknowledged was lost, no
//! call ran twice, no session was left stuck and followers saw every event.

mod runner_support;
mod skew_support;

use std::time::Duration;

use integration_tests::{test_backend_is_postgres, Backing};
use skew_support::Skew;
use testkit::previous::Build::{Previous, This};

/// A fresh data directory (kept while the returned guard lives), or a fresh database.
fn backing() -> (Backing, Option<tempfile::TempDir>) {
    if test_backend_is_postgres() {
        let database = tokio::task::block_in_place(Backing::fresh_database);
        return (database.expect("a database"), None);
    }
    let data = tempfile::tempdir().expect("temp dir");
    (Backing::Dir(data.path().to_path_buf()), Some(data))
}

#[tokio::test(flavor = "multi_thread")]
async fn runners_of_both_releases_over_a_store_of_this_build_run_no_call_twice() {
    let _watchdog = testkit::watchdog(
        "runners_of_both_releases_over_a_store_of_this_build_run_no_call_twice",
        Duration::from_secs(300),
    );
    let (backing, _data) = backing();
    let mut skew = Skew::start(backing, &[This], &[(Previous, 0), (This, 0)]).await;
    skew.start_work("first", 6).await;
    skew.appended(20).await;

    skew.kill_runner_mid_call(0, This).await;
    skew.kill_runner_mid_call(1, Previous).await;
    skew.replace_replica(0, This).await;
    skew.kill_runner_mid_call(0, Previous).await;

    skew.finish().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_store_of_the_release_upgraded_under_runners_of_both_loses_nothing() {
    let _watchdog = testkit::watchdog(
        "a_store_of_the_release_upgraded_under_runners_of_both_loses_nothing",
        Duration::from_secs(300),
    );
    let (backing, _data) = backing();
    let mut skew = Skew::start(backing, &[Previous], &[(Previous, 0), (This, 0)]).await;
    skew.start_work("first", 6).await;
    skew.appended(20).await;

    skew.replace_replica(0, This).await;
    skew.kill_runner_mid_call(1, Previous).await;

    skew.finish().await;
}

/// A runner of this build over a store of the release, whose model fails: the store answers
/// without `agentlog-release`, so the runner writes none of its release's new kinds and goes
/// on as the release's runner did (its retries in memory), and the session finishes.
#[tokio::test(flavor = "multi_thread")]
async fn a_runner_of_this_build_over_a_store_of_the_release_retries_in_memory() {
    use integration_tests::anthropic_standin::{AnthropicStandin, Fault, StandinReply};
    use integration_tests::standin::{FaultPlan, RetryAfter};
    use runner_support::{kinds, start_runner_binary, user_says, wait_idle};

    let (backing, _data) = backing();
    let store = tokio::task::block_in_place(|| Previous.start_store(backing, &[]))
        .expect("the release's store");
    let mut client = store.client().await.expect("client");
    let standin = AnthropicStandin::start(vec![StandinReply::text("Answered.")])
        .await
        .expect("stand-in");
    standin.fail_model(
        "standin-1",
        FaultPlan::Calls(vec![
            Fault::OverloadedRetryAfter(RetryAfter::Seconds(1)),
            Fault::ServerError(500),
        ]),
    );
    let workspaces = tempfile::tempdir().expect("temp dir");
    let _runner = start_runner_binary(
        &This.bin_path("runner"),
        &store.url(),
        "this",
        workspaces.path(),
        &standin.url(),
        3000,
        2,
        &[],
    );
    user_says(&mut client, "s", "go").await;
    let events = wait_idle(&mut client, "s", 0, Duration::from_secs(60)).await;
    assert_eq!(kinds(&events), ["user", "reply(end_turn)"]);
    assert_eq!(
        standin.calls_of("standin-1"),
        3,
        "two failed calls, retried in memory"
    );
}
