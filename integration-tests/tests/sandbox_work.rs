//! Nothing a call starts outlives its runner: killing the runner (SIGKILL) kills the call's
//! helper by its parent-death signal, and the helper every process of the call, `setsid`
//! and double-forked ones included. (Ordinary work, leftovers after a call and the fork
//! bomb are in `sandbox_escapes`, in every node configuration.)

mod sandbox_support;

use std::time::Duration;

use integration_tests::Store;
use sandbox_support::*;

#[tokio::test(flavor = "multi_thread")]
async fn killing_the_runner_kills_its_running_tools() {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    let command = "setsid sleep 4281 & (sleep 4282 &) ; echo yes > running; sleep 4283";
    let mut runner = start(
        &store.url(),
        &[bash(command), done()],
        RunAs::Me,
        Options::default(),
    );
    user_says(&mut client, "orphan", "go").await;
    wait_for_file(&runner.workspace("orphan").join("running"));
    // The sleepers, and the helper and bash whose command lines hold the command.
    assert!(
        processes_with("sleep 428").len() >= 3,
        "the call is running"
    );
    runner.kill9();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !processes_with("sleep 428").is_empty() {
        assert!(
            std::time::Instant::now() < deadline,
            "the call outlived its runner: {:?}",
            processes_with("sleep 428")
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
