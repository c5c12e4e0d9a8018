//! The tool sandbox holds on the nodes people run, as the runner's start-up table says: in
//! each configuration below a real runner (default flags: `--sandbox require`,
//! `--tool-network none`) works sessions whose bash calls try to get out, all at once
//! against one store and one runner per configuration:
//!
//! - `sibling`: read, list, write, rename, link, truncate and chmod another session's
//!   workspace and a checkpoint-like sibling directory of the workspaces; write outside
//!   every workspace;
//! - `attacker`: read the runner's environment, memory and token file through /proc,
//!   `ptrace` and `process_vm_readv` the runner, signal the runner, another call's process,
//!   that call's helper and everyone (`kill -1`), by pid and by pidfd;
//! - `net`: TCP (and /dev/tcp) to a loopback listener, UDP, an IPv6 socket;
//! - `leaver`: `setsid` and double-forked processes that should outlive the call;
//! - `linker`: symbolic links planted by bash, followed by the file tools;
//! - `bomber`: a fork bomb, then `after` shows the runner still works;
//! - `worker`: ordinary work (python3, git, cc, mktemp, `mv` across directories, the file
//!   tools) still succeeds.
//!
//! Each assertion is on the effect (the secret absent from the output, the file not
//! written, the process alive and not stopped, the listener with nothing accepted), not on
//! an error message. Configurations:
//!
//! - **(a)** root runner on this kernel (tools run as a uid of their own): every escape;
//! - **(b)** the runner as an unprivileged uid with no capabilities and no-new-privs, as a
//!   pod gets it (`setpriv`): every escape;
//! - **(c)** as (b) with Landlock capped at ABI 1, 2, 3 and 4 (`AGENTLOG_SANDBOX_MAX_ABI`):
//!   the escapes the cap changes (filesystem rules and truncate, signals vetted by the
//!   helper, TCP without Landlock's network rules) and ordinary work;
//! - **(d)** as (b) with the landlock_* syscalls failing with EPERM (a seccomp wrapper, as
//!   a container runtime's profile does): `require` refuses to start, naming the two
//!   filesystem protections and why; `best-effort` runs, marks every result, and every
//!   protection its table still shows as held holds.
//!
//! Each configuration checks its own table first: the rows the test relies on say `yes`.

mod sandbox_support;

use std::io::ErrorKind;
use std::net::{TcpListener, UdpSocket};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::time::Duration;

use agentlog_proto::v1::event_store_client::EventStoreClient;
use integration_tests::Store;
use sandbox_support::*;
use serde_json::{json, Value};
use tonic::transport::Channel;

const SECRET: &str = "s3cret-of-the-victim";
const LISTED: &str = "only-ls-would-show-this.txt";
const CHECKPOINT_SECRET: &str = "checkpointed-bytes-of-another-session";
const STORE_TOKEN: &str = "store-token-SECRET-of-the-runner";

/// Which escapes a configuration runs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Escapes {
    /// Everything.
    Full,
    /// What an older Landlock ABI changes, and ordinary work.
    Abi,
    /// Landlock refused: everything but the filesystem, which the table says is not held.
    NoLandlock,
}

/// The one bash command every session runs first; it does what its session is named for.
fn dispatcher(port: u16, outside: &str, tag: u32) -> String {
    format!(
        r#"S="${{IDEMPOTENCY_KEY%%/*}}"; R="$(dirname "$HOME")"; V="$R/victim"
case "$S" in
victim) echo $$ > pid
  for _ in $(seq 1200); do [ -e attack-over ] && break; sleep 0.1; done
  echo alive > alive.txt; echo survived ;;
sibling)
  cat ../victim/secret.txt; cat "$V/secret.txt"; ls -la ../victim; ls "$V"; find "$V"
  cat "$R/.checkpoints/blob"; ls "$R/.checkpoints"; echo x > "$R/.checkpoints/planted"
  echo pwned > ../victim/pwned-rel; echo pwned > "$V/pwned-abs"; mkdir ../victim/newdir
  mv ../victim/secret.txt stolen.txt; cp "$V/secret.txt" copied.txt; ln "$V/secret.txt" hardlink
  python3 -c "import os; os.truncate('$V/secret.txt', 0)"; truncate -s 0 "$V/secret.txt"
  rm -f "$V/secret.txt"; chmod 777 "$V"
  echo x > ../outside-root; echo x > "$(dirname "$R")/outside-dir"; echo x > {outside}
  echo end ;;
attacker) python3 attack.py; echo end ;;
net)
  python3 -c "import socket; socket.create_connection(('127.0.0.1', {port}), 3)"
  echo hi > /dev/tcp/127.0.0.1/{port}
  python3 -c "import socket; socket.socket(socket.AF_INET, socket.SOCK_DGRAM).sendto(b'x', ('127.0.0.1', {port}))"
  python3 -c "import socket; socket.socket(socket.AF_INET6)" && echo ipv6-socket-opened
  python3 -c "import socket; a, b = socket.socketpair(); a.send(b'unix-ok'); print(b.recv(9).decode())"
  echo end ;;
leaver) setsid sleep {tag} & (sleep {tag1} &) ; (setsid bash -c 'sleep {tag2}' &) ; sleep 0.2; echo started ;;
linker) ln -s ../victim v; ln -s "$V/secret.txt" abs; ln -s /etc/passwd pw; ln -s / rootlink; ln -s /proc/self/root magic; echo planted ;;
bomber) bomb() {{ bomb | bomb & }}; bomb; sleep 4; exit 3 ;;
after) echo still-here ;;
worker) set -e
  python3 -c "print('py', 6 * 7)"
  git init -q repo && cd repo
  git config --global user.email t@example.com && git config --global user.name T
  echo hello > a.txt && git add a.txt && git commit -qm first && git log --oneline | wc -l
  mkdir sub && {{ git mv a.txt sub/a.txt && git commit -qm moved && echo moved-ok || echo moved-refused; }}
  cd .. && f=$(mktemp) && echo temp > "$f" && cat "$f"
  mkdir -p d1 d2 && echo m > d1/m && mv d1/m d2/m && cat d2/m
  printf '#include <stdio.h>\nint main(void) {{ puts("compiled"); return 0; }}\n' > hello.c
  cc hello.c -o hello && ./hello
  sleep 30 & kill $!; wait $! || true; kill -0 $$; echo own-signal-ok
  echo from-bash > own.txt ;;
esac"#,
        tag1 = tag + 10,
        tag2 = tag + 20,
    )
}

/// The attacker's program: every way at the runner's secrets and at other processes.
const ATTACK: &str = r#"
import ctypes, os, signal
libc = ctypes.CDLL(None, use_errno=True)
runner, victim, helper, env_start, env_end, token = open("pids").read().split()
runner, victim, helper, env_start, env_end = map(int, (runner, victim, helper, env_start, env_end))

def attempt(what, f):
    try:
        print(what, "->", f(), flush=True)
    except Exception as e:
        print(what, "refused:", e, flush=True)

def read(path):
    with open(path, "rb") as f:
        return f.read()

attempt("environ", lambda: read(f"/proc/{runner}/environ"))
attempt("cmdline", lambda: read(f"/proc/{runner}/cmdline"))
attempt("token file", lambda: read(token))
def mem():
    with open(f"/proc/{runner}/mem", "rb") as f:
        f.seek(env_start)
        return f.read(env_end - env_start)
attempt("mem", mem)
for pid in (runner, helper):
    r = libc.ptrace(16, pid, None, None)  # PTRACE_ATTACH
    print("ptrace", pid, r, os.strerror(ctypes.get_errno()))
class iovec(ctypes.Structure):
    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]
n = env_end - env_start
buf = ctypes.create_string_buffer(n)
local, remote = iovec(ctypes.cast(buf, ctypes.c_void_p), n), iovec(env_start, n)
r = libc.process_vm_readv(runner, ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
print("process_vm_readv", r, os.strerror(ctypes.get_errno()), buf.raw[:max(r, 0)])
for pid, sig in ((runner, signal.SIGTERM), (runner, signal.SIGKILL), (victim, signal.SIGKILL),
                 (victim, signal.SIGSTOP), (helper, signal.SIGKILL)):
    attempt(f"kill {pid} {sig}", lambda: os.kill(pid, sig))
for pid in (runner, victim, helper):
    attempt(f"pidfd {pid}", lambda: signal.pidfd_send_signal(os.pidfd_open(pid), signal.SIGKILL))
    attempt(f"procfd {pid}", lambda: signal.pidfd_send_signal(
        os.open(f"/proc/{pid}", os.O_RDONLY | os.O_DIRECTORY), signal.SIGKILL))
# Last: where the call's own processes may be signalled this ends the call's shell too.
print("kill -1", flush=True)
attempt("kill -1", lambda: os.kill(-1, signal.SIGKILL))
"#;

/// The file-tool calls every session makes second (only `linker` and `worker` care).
fn file_calls() -> Value {
    json!({"text": "Using the files.", "tool_uses": [
        {"name": "read_file", "input": {"path": "v/secret.txt"}},
        {"name": "read_file", "input": {"path": "abs"}},
        {"name": "read_file", "input": {"path": "pw"}},
        {"name": "read_file", "input": {"path": "magic/etc/passwd"}},
        {"name": "write_file", "input": {"path": "v/evil", "content": "x"}},
        {"name": "write_file", "input": {"path": "rootlink/tmp/agentlog-sandbox-evil", "content": "x"}},
        {"name": "edit_file", "input": {"path": "abs", "old": SECRET, "new": "gone"}},
        {"name": "list_files", "input": {"path": "v"}},
        {"name": "read_file", "input": {"path": "own.txt"}},
        {"name": "edit_file", "input": {"path": "own.txt", "old": "bash", "new": "edit"}},
        {"name": "list_files", "input": {"path": "repo"}}
    ]})
}

/// Runs `session` to its end and returns its tool results.
async fn session(mut client: EventStoreClient<Channel>, session: &'static str) -> Vec<ToolResult> {
    run_session(&mut client, session).await
}

/// The table's row for `protection`, which must say `yes`.
fn assert_held(table: &str, protection: &str) {
    let row = table
        .lines()
        .find(|line| line.contains(protection))
        .unwrap_or_else(|| panic!("no row {protection:?} in:\n{table}"));
    assert!(row.contains(" yes "), "{protection} is not held:\n{table}");
}

/// The runner's `env_start env_end` (fields 50 and 51 of its stat).
fn env_bounds(pid: u32) -> (String, String) {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .expect(")")
        .1
        .split_whitespace()
        .collect();
    (fields[47].to_string(), fields[48].to_string())
}

fn parent_of(pid: &str) -> String {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("stat");
    stat.rsplit_once(')')
        .expect(")")
        .1
        .split_whitespace()
        .nth(1)
        .expect("ppid")
        .to_string()
}

fn state_of(pid: u32) -> String {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    stat.rsplit_once(')')
        .map(|(_, rest)| rest.trim().chars().take(1).collect())
        .unwrap_or_default()
}

/// Every process of `uid` but `except`.
fn processes_of(uid: u32, except: u32) -> Vec<String> {
    std::fs::read_dir("/proc")
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|entry| {
            let pid: u32 = entry.file_name().to_str()?.parse().ok()?;
            let status = std::fs::read_to_string(entry.path().join("status")).ok()?;
            let owner = status.lines().find(|line| line.starts_with("Uid:"))?;
            let real = owner.split_whitespace().nth(1)?.parse::<u32>().ok()?;
            (real == uid && pid != except).then(|| format!("{pid}: {status:.40}"))
        })
        .collect()
}

/// One configuration: a store, a runner as `config` says, the escapes of `escapes`.
/// `tool_uid` is the uid tools run as (for the fork bomb's leftovers).
async fn run_configuration(name: &str, config: Config, tool_uid: u32, escapes: Escapes, tag: u32) {
    let store = Store::start().expect("store");
    let client = store.client().await.expect("client");
    let listener = TcpListener::bind("127.0.0.1:0").expect("listen");
    listener.set_nonblocking(true).expect("nonblocking");
    let port = listener.local_addr().expect("addr").port();
    let udp = UdpSocket::bind(("127.0.0.1", port)).expect("udp");
    udp.set_nonblocking(true).expect("nonblocking");
    let outside = format!("/tmp/agentlog-sandbox-escape-{name}");
    let _ = std::fs::remove_file(&outside);

    // The runner's store token, in a file only the runner's user may read, where Landlock
    // keeps tools out (not under a system directory or the workspace root).
    let secrets = tempfile::tempdir().expect("temp dir");
    std::fs::set_permissions(secrets.path(), std::fs::Permissions::from_mode(0o755))
        .expect("chmod");
    let token = secrets.path().join("token");
    let abi_1 = config.max_abi == Some(1);
    let mut config = config;
    if escapes == Escapes::NoLandlock {
        // Without Landlock or a separate uid a token file is the tools' to read (the table
        // says so: `d_landlock_refused_with_eperm`): the token comes in the environment.
        config
            .env
            .push(("AGENTLOG_TOKEN".into(), STORE_TOKEN.into()));
    } else {
        std::fs::write(&token, STORE_TOKEN).expect("write the token");
        std::fs::set_permissions(&token, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        let runner_uid = config.uid.unwrap_or(0);
        std::os::unix::fs::chown(&token, Some(runner_uid), Some(runner_uid)).expect("chown");
        config
            .args
            .extend(["--token-file".to_string(), token.display().to_string()]);
    }

    let replies = [bash(&dispatcher(port, &outside, tag)), file_calls(), done()];
    let mut runner = start_config(&store.url(), &replies, &config);
    runner.wait_for_log("runner started");
    let table = runner.table();
    eprintln!("configuration {name}:\n{table}");
    for held in [
        "the runner's secrets",
        "signals to the runner",
        "network egress",
        "processes left behind",
        "resource limits",
    ] {
        assert_held(&table, held);
    }
    if escapes != Escapes::NoLandlock {
        assert_held(&table, "workspace only");
        assert_held(&table, "other sessions' workspaces");
    }

    let plant = |session: &str, file: &str, content: &str| {
        runner.plant_as(tool_uid, session, file, content)
    };
    plant("victim", "secret.txt", SECRET);
    plant("victim", LISTED, "x");
    let checkpoints = runner.workspaces.join(".checkpoints");
    std::fs::create_dir_all(&checkpoints).expect("mkdir");
    std::fs::write(checkpoints.join("blob"), CHECKPOINT_SECRET).expect("write");
    for path in [checkpoints.clone(), checkpoints.join("blob")] {
        std::os::unix::fs::chown(&path, Some(tool_uid), Some(tool_uid)).expect("chown");
    }
    plant("attacker", "attack.py", ATTACK);

    let mut victim_client = client.clone();
    let victim_seq = user_says(&mut victim_client, "victim", "go").await;
    let pid_file = runner.workspace("victim").join("pid");
    let victim_pid = wait_for_file(&pid_file).trim().to_string();
    let helper_pid = parent_of(&victim_pid);
    let (env_start, env_end) = env_bounds(runner.pid());
    plant(
        "attacker",
        "pids",
        &format!(
            "{} {victim_pid} {helper_pid} {env_start} {env_end} {}",
            runner.pid(),
            token.display()
        ),
    );

    let mut names = vec!["attacker", "net", "worker"];
    match escapes {
        Escapes::Full => names.extend(["sibling", "leaver", "linker"]),
        Escapes::Abi => names.push("sibling"),
        Escapes::NoLandlock => names.push("leaver"),
    }
    let runs: Vec<_> = names
        .iter()
        .map(|&name| tokio::spawn(session(client.clone(), name)))
        .collect();
    let mut results = std::collections::HashMap::new();
    for (name, run) in names.iter().zip(runs) {
        results.insert(*name, run.await.expect("session"));
    }
    let first = |name: &str| results[name][0].content.clone();

    // The runner's secrets and signals.
    let out = first("attacker");
    eprintln!("{name}: the attacker saw:\n{out}");
    assert!(
        out.contains("kill -1"),
        "{name}: the attack ran to its end: {out}"
    );
    for secret in [MODEL_KEY, STORE_TOKEN] {
        assert!(
            !out.contains(secret),
            "{name}: the attacker saw a secret: {out}"
        );
    }
    for refused in [
        format!("ptrace {} -1", runner.pid()),
        format!("ptrace {helper_pid} -1"),
        "process_vm_readv -1".into(),
    ] {
        assert!(out.contains(&refused), "{name}: no {refused:?} in {out}");
    }
    assert!(runner.is_running(), "{name}: the runner survived: {out}");
    let state = state_of(runner.pid());
    assert!(
        state != "t" && state != "T",
        "{name}: the runner is stopped ({state})"
    );
    runner.plant_as(tool_uid, "victim", "attack-over", "");
    let victim = wait_idle(
        &mut victim_client.clone(),
        "victim",
        victim_seq,
        Duration::from_secs(90),
    )
    .await;
    let victim_out = victim
        .iter()
        .find_map(|e| match &e.kind {
            Some(agentlog_proto::v1::event::Kind::ToolResult(r)) => Some(r.clone()),
            _ => None,
        })
        .expect("the victim's result");
    assert!(
        !victim_out.is_error && victim_out.content.contains("survived"),
        "{name}: the victim's call was signalled: {victim_out:?} (attacker: {out})"
    );

    // The network.
    let out = first("net");
    assert!(
        out.contains("end") && out.contains("unix-ok"),
        "{name}: {out}"
    );
    assert!(!out.contains("ipv6-socket-opened"), "{name}: {out}");
    assert!(
        matches!(listener.accept(), Err(e) if e.kind() == ErrorKind::WouldBlock),
        "{name}: the listener accepted a connection: {out}"
    );
    let mut buf = [0u8; 16];
    assert!(
        matches!(udp.recv_from(&mut buf), Err(e) if e.kind() == ErrorKind::WouldBlock),
        "{name}: a datagram arrived: {out}"
    );

    // Ordinary work.
    let worker = &results["worker"];
    let out = &worker[0].content;
    assert!(!worker[0].is_error, "{name}: {out}");
    for expected in [
        "py 42\n",
        "\n1\n",
        "temp\n",
        "m\n",
        "compiled\n",
        "own-signal-ok\n",
    ] {
        assert!(out.contains(expected), "{name}: no {expected:?} in {out}");
    }
    // Landlock ABI 1 refuses every rename into another directory, as its table row says.
    let moved = if abi_1 {
        "moved-refused\n"
    } else {
        "moved-ok\n"
    };
    assert!(out.contains(moved), "{name}: no {moved:?} in {out}");
    if abi_1 {
        assert!(
            table.contains("at ABI 1 a rename or link into another directory fails"),
            "{table}"
        );
    }
    assert!(
        !worker[9].is_error && worker[9].content.contains("from-bash"),
        "{name}: {worker:?}"
    );
    assert!(!worker[10].is_error, "{name}: {worker:?}");
    assert!(worker[11].content.contains("sub/"), "{name}: {worker:?}");
    assert_eq!(
        std::fs::read_to_string(runner.workspace("worker").join("own.txt"))
            .ok()
            .as_deref(),
        Some("from-edit\n"),
        "{name}"
    );

    if results.contains_key("sibling") {
        let out = first("sibling");
        assert!(out.contains("end"), "{name}: {out}");
        for leaked in [SECRET, LISTED, CHECKPOINT_SECRET] {
            assert!(
                !out.contains(leaked),
                "{name}: read a sibling's bytes: {out}"
            );
        }
        let victim = runner.workspace("victim");
        assert_eq!(
            std::fs::read_to_string(victim.join("secret.txt"))
                .ok()
                .as_deref(),
            Some(SECRET),
            "{name}: the victim's file is intact: {out}"
        );
        for file in ["pwned-rel", "pwned-abs", "newdir"] {
            assert!(
                !victim.join(file).exists(),
                "{name}: {file} was written: {out}"
            );
        }
        assert!(!checkpoints.join("planted").exists(), "{name}: {out}");
        let attacker = runner.workspace("sibling");
        for file in ["stolen.txt", "copied.txt", "hardlink"] {
            assert!(
                !attacker.join(file).exists(),
                "{name}: {file} exists: {out}"
            );
        }
        assert!(
            !runner.workspaces.join("outside-root").exists(),
            "{name}: {out}"
        );
        let parent = runner.workspaces.parent().expect("parent");
        assert!(!parent.join("outside-dir").exists(), "{name}: {out}");
        assert!(!Path::new(&outside).exists(), "{name}: {out}");
    }
    if results.contains_key("leaver") {
        assert!(first("leaver").contains("started"), "{name}");
        for sleep in [tag, tag + 10, tag + 20] {
            assert_eq!(
                processes_with(&format!("sleep {sleep}")),
                Vec::<String>::new(),
                "{name}: a process of the call outlived it"
            );
        }
    }
    if let Some(linker) = results.get("linker") {
        assert!(linker[0].content.contains("planted"), "{name}: {linker:?}");
        for result in &linker[1..9] {
            assert!(result.is_error, "{name}: {result:?}");
            assert!(
                result.content.contains("outside the workspace"),
                "{name}: {result:?}"
            );
            for leaked in [SECRET, LISTED, "root:x:0"] {
                assert!(!result.content.contains(leaked), "{name}: {result:?}");
            }
        }
        assert!(!runner.workspace("victim").join("evil").exists(), "{name}");
        assert!(!Path::new("/tmp/agentlog-sandbox-evil").exists(), "{name}");
    }

    // Last, alone: the fork bomb, bounded by the process limit of the tool user, cleaned up,
    // and the runner still works.
    if escapes == Escapes::Full {
        let bomb = session(client.clone(), "bomber").await;
        assert!(bomb[0].is_error, "{name}: {bomb:?}");
        let after = session(client.clone(), "after").await;
        assert!(
            !after[0].is_error && after[0].content.contains("still-here"),
            "{name}: {after:?}"
        );
        assert!(runner.is_running(), "{name}");
        assert_eq!(
            processes_of(tool_uid, runner.pid()),
            Vec::<String>::new(),
            "{name}: processes of the bomb are left"
        );
    }
    if escapes == Escapes::NoLandlock {
        for result in results.values().flatten() {
            assert!(
                result.content.starts_with(
                    "[sandbox: best-effort, not enforced on this node: workspace only"
                ),
                "{name}: {result:?}"
            );
        }
    }
    assert!(runner.is_running(), "{name}");
}

/// The unprivileged uids, one per configuration, so that a configuration's process limit
/// (which counts per user) and leftovers are its own.
const UID_A_TOOLS: u32 = 20100;
const UID_B: u32 = 20101;
const UID_C: u32 = 20110;
const UID_D: u32 = 20120;

fn as_pod(uid: u32) -> Config {
    Config {
        uid: Some(uid),
        max_abi: None,
        landlock_eperm: false,
        args: Vec::new(),
        env: Vec::new(),
        workspace_owner: None,
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn a_root_runner_on_the_full_kernel() {
    if !is_root() {
        eprintln!("skipped: needs root");
        return;
    }
    let config = Config {
        uid: None,
        args: vec!["--tool-user".into(), format!("{UID_A_TOOLS}:{UID_A_TOOLS}")],
        workspace_owner: Some(UID_A_TOOLS),
        ..as_pod(0)
    };
    run_configuration("a", config, UID_A_TOOLS, Escapes::Full, 4100).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn b_an_unprivileged_runner_as_a_pod_gets_it() {
    if !is_root() {
        eprintln!("skipped: needs root for setpriv");
        return;
    }
    run_configuration("b", as_pod(UID_B), UID_B, Escapes::Full, 4200).await;
}

async fn capped(abi: u32) {
    if !is_root() {
        eprintln!("skipped: needs root for setpriv");
        return;
    }
    let uid = UID_C + abi;
    let config = Config {
        max_abi: Some(abi),
        ..as_pod(uid)
    };
    run_configuration(
        &format!("c{abi}"),
        config,
        uid,
        Escapes::Abi,
        4300 + abi * 30,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread")]
async fn c1_landlock_capped_at_abi_1() {
    capped(1).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn c2_landlock_capped_at_abi_2() {
    capped(2).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn c3_landlock_capped_at_abi_3() {
    capped(3).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn c4_landlock_capped_at_abi_4() {
    capped(4).await;
}

#[tokio::test(flavor = "multi_thread")]
async fn d_landlock_refused_with_eperm() {
    if !is_root() {
        eprintln!("skipped: needs root for setpriv");
        return;
    }
    let store = Store::start().expect("store");
    // `require`, with a token file the tools could read: refused, with the reasons.
    let secrets = tempfile::tempdir().expect("temp dir");
    std::fs::set_permissions(secrets.path(), std::fs::Permissions::from_mode(0o755))
        .expect("chmod");
    let token = secrets.path().join("token");
    std::fs::write(&token, STORE_TOKEN).expect("write");
    std::os::unix::fs::chown(&token, Some(UID_D), Some(UID_D)).expect("chown");
    let refused = Config {
        landlock_eperm: true,
        args: vec!["--token-file".into(), token.display().to_string()],
        ..as_pod(UID_D)
    };
    let mut runner = start_config(&store.url(), &[done()], &refused);
    assert!(!runner.wait_exit().success());
    let log = runner.log();
    eprintln!("configuration d, --sandbox require:\n{log}");
    assert!(!log.contains("runner started"), "{log}");
    assert!(
        log.contains("nothing enforces workspace only (read and write), other sessions' workspaces, the runner's secrets:"),
        "{log}"
    );
    assert!(
        log.contains("landlock_* system calls are refused (EPERM"),
        "{log}"
    );
    assert!(
        log.contains(&format!(
            "a tool can read the secret file {}",
            token.display()
        )),
        "{log}"
    );
    assert!(log.contains("--sandbox best-effort"), "{log}");
    drop(runner);
    drop(store);

    let config = Config {
        landlock_eperm: true,
        args: vec!["--sandbox".into(), "best-effort".into()],
        ..as_pod(UID_D)
    };
    run_configuration("d", config, UID_D, Escapes::NoLandlock, 4500).await;
}
