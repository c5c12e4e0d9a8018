//! Inside the sandbox, ordinary work still works (python3, git, cc, files written by bash and by
//! the file tools, a temporary file), and nothing a call starts outlives it: `setsid` and
//! double-forked processes are gone once the result is in or once the runner is killed,
//! and a fork bomb is bounded, cleaned up, and leaves the runner working.

mod sandbox_support;

use std::time::Duration;

use integration_tests::Store;
use sandbox_support::*;
use serde_json::json;

async fn ordinary_work(run_as: RunAs) {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    let work = r#"set -e
python3 -c "print('py', 6 * 7)"
git init -q repo && cd repo
git config --global user.email t@example.com && git config --global user.name T
echo hello > a.txt && git add a.txt && git commit -qm first && git log --oneline | wc -l
cd .. && f=$(mktemp) && echo temp > "$f" && cat "$f"
printf '#include <stdio.h>\nint main(void) { puts("compiled"); return 0; }\n' > hello.c
cc hello.c -o hello && ./hello
echo more >> notes.txt && cat notes.txt
echo from-bash > own.txt"#;
    let replies = [
        json!({"text": "Writing.", "tool_uses": [
            {"name": "write_file", "input": {"path": "notes.txt", "content": "from the file tool\n"}}
        ]}),
        bash(work),
        json!({"text": "Reading.", "tool_uses": [
            {"name": "read_file", "input": {"path": "own.txt"}},
            {"name": "edit_file", "input": {"path": "own.txt", "old": "bash", "new": "edit"}},
            {"name": "list_files", "input": {"path": "repo"}}
        ]}),
        done(),
    ];
    let runner = start(&store.url(), &replies, run_as, Options::default());
    let results = run_session(&mut client, "worker").await;
    assert_eq!(results.len(), 5, "{results:?}");
    for result in &results {
        assert!(!result.is_error, "{result:?}");
    }
    let out = &results[1].content;
    assert!(out.contains("py 42\n"), "{out}");
    assert!(out.contains("\n1\n"), "one commit: {out}");
    assert!(out.contains("temp\n"), "{out}");
    assert!(
        out.contains("compiled\n"),
        "the C compiler (the linker cargo needs) works: {out}"
    );
    assert!(out.contains("from the file tool\nmore\n"), "{out}");
    assert_eq!(results[2].content, "from-bash\n");
    assert!(results[4].content.contains("a.txt"), "{results:?}");
    assert_eq!(
        std::fs::read_to_string(runner.workspace("worker").join("own.txt"))
            .ok()
            .as_deref(),
        Some("from-edit\n")
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn ordinary_work_succeeds_inside() {
    ordinary_work(RunAs::Me).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn ordinary_work_succeeds_inside_unprivileged() {
    ordinary_work(RunAs::Unprivileged).await;
}

async fn no_survivors(run_as: RunAs) {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    // Distinct durations, so that this test finds only its own processes.
    let tag = match run_as {
        RunAs::Me => 4171,
        RunAs::Unprivileged => 4172,
    };
    let command = format!(
        "setsid sleep {tag} & (sleep {} &) ; (setsid bash -c 'sleep {}' &) ; sleep 0.2; echo started",
        tag + 10,
        tag + 20
    );
    let _runner = start(
        &store.url(),
        &[bash(&command), done()],
        run_as,
        Options::default(),
    );
    let results = run_session(&mut client, "leaver").await;
    assert!(results[0].content.contains("started"), "{results:?}");
    for sleep in [tag, tag + 10, tag + 20] {
        assert_eq!(
            processes_with(&format!("sleep {sleep}")),
            Vec::<String>::new(),
            "a process of the call outlived it"
        );
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn setsid_and_double_forked_processes_do_not_outlive_the_call() {
    no_survivors(RunAs::Me).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn setsid_and_double_forked_processes_do_not_outlive_the_call_unprivileged() {
    no_survivors(RunAs::Unprivileged).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn killing_the_runner_kills_its_running_tools() {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    let command = "setsid sleep 4281 & (sleep 4282 &) ; touch running; sleep 4283";
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

/// As root only: the bomb's tools run as a user of their own (the process limit counts per
/// user), so that tests running beside it as `nobody` keep forking.
#[tokio::test(flavor = "multi_thread")]
async fn a_fork_bomb_is_bounded_and_the_runner_keeps_working() {
    if !is_root() {
        eprintln!("skipped: needs root to give the bomb a user of its own");
        return;
    }
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    let bomb = json!({"text": "Boom.", "tool_uses": [{"name": "bash", "input": {
        "command": "bomb() { bomb | bomb & }; bomb; sleep 5", "timeout_ms": 4000}}]});
    let mut runner = start(
        &store.url(),
        &[bomb, bash("echo still-here"), done()],
        RunAs::Me,
        Options {
            args: &["--tool-user", "65533:65533"],
            env: &[],
        },
    );
    let results = run_session(&mut client, "bomber").await;
    assert_eq!(results.len(), 2, "{results:?}");
    assert!(results[0].is_error, "{results:?}");
    assert!(
        !results[1].is_error && results[1].content.contains("still-here"),
        "{results:?}"
    );
    assert!(runner.is_running());
    std::thread::sleep(Duration::from_millis(200));
    let left: Vec<String> = std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let status = std::fs::read_to_string(entry.path().join("status")).ok()?;
            status
                .lines()
                .any(|line| line.starts_with("Uid:") && line.contains("65533"))
                .then(|| entry.file_name().to_string_lossy().into_owned())
        })
        .collect();
    assert_eq!(left, Vec::<String>::new(), "processes of the bomb are left");
}
