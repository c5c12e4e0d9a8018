//! The last release and this build over one PostgreSQL database, as a rolling update leaves
//! them (the real binaries of both: `deploy/previous-release` builds the release's). Store
//! replicas of both serve one database; runners of both work `work:` sessions of bash calls
//! through either replica, while a client appends user turns through both. Then, one at a
//! time and under that load, each kind of process is SIGKILLed and replaced by the other
//! build: the release's replica started again as this build (an upgrade), a runner of this
//! build killed in the middle of a call and one of the release started in its place, this
//! build's replica started again as the release (a rollback), and a runner of the release
//! killed in the middle of a call for one of this build. `skew_support` checks that nothing
//! acknowledged was lost, no call ran twice, no session was left stuck and every replica
//! serves the same events.

mod runner_support;
mod skew_support;

use std::time::Duration;

use integration_tests::Backing;
use skew_support::Skew;
use testkit::previous::Build::{Previous, This};

#[tokio::test(flavor = "multi_thread")]
async fn both_releases_over_one_database_lose_nothing_and_run_no_call_twice() {
    let _watchdog = testkit::watchdog(
        "both_releases_over_one_database_lose_nothing_and_run_no_call_twice",
        Duration::from_secs(300),
    );
    let backing = tokio::task::block_in_place(Backing::fresh_database).expect("a database");
    // Replica 0 is the release's (it made the schema: the database was the release's first);
    // the release's runner works through this build's replica and the other way round.
    let mut skew = Skew::start(backing, &[Previous, This], &[(Previous, 1), (This, 0)]).await;
    skew.no_field_dropped().await;
    skew.start_work("first", 6).await;
    skew.appended(20).await;

    skew.replace_replica(0, This).await;
    skew.kill_runner_mid_call(1, Previous).await;
    skew.replace_replica(1, Previous).await;
    skew.kill_runner_mid_call(0, This).await;

    skew.finish().await;
}
