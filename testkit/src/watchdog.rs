//! A test that hangs says where: past its time limit, every thread's stack is printed (by
//! `gdb`, when the machine has it; the threads' names and kernel wait channels otherwise)
//! and the process aborts, instead of the run waiting out its whole CI budget with nothing
//! to show for it.

use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// Armed while it lives: dropping it (the test ended) disarms it.
pub struct Watchdog {
    _disarm: mpsc::Sender<()>,
}

/// Aborts the test process, with every thread's stack on stderr, if it is still running
/// after `limit`. Hold the guard for as long as the test runs.
pub fn watchdog(test: &'static str, limit: Duration) -> Watchdog {
    let (disarm, disarmed) = mpsc::channel::<()>();
    std::thread::Builder::new()
        .name("watchdog".into())
        .spawn(move || {
            if let Err(mpsc::RecvTimeoutError::Timeout) = disarmed.recv_timeout(limit) {
                eprintln!("{test} is still running after {limit:?}: its threads' stacks follow");
                print_stacks();
                std::process::abort();
            }
        })
        .expect("watchdog thread");
    Watchdog { _disarm: disarm }
}

fn print_stacks() {
    let pid = std::process::id().to_string();
    let gdb = Command::new("gdb")
        .args(["-batch", "-nx", "-p", &pid])
        .args(["-ex", "set pagination off", "-ex", "thread apply all bt"])
        .stdin(Stdio::null())
        .stdout(Stdio::inherit())
        .stderr(Stdio::inherit())
        .status();
    if gdb.is_ok_and(|s| s.success()) {
        return;
    }
    eprintln!("(no gdb here: the threads' names and where the kernel has them waiting)");
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return;
    };
    for task in tasks.flatten() {
        let read = |file: &str| {
            std::fs::read_to_string(task.path().join(file))
                .unwrap_or_default()
                .trim()
                .to_string()
        };
        eprintln!(
            "{:?} {} wchan={}",
            task.file_name(),
            read("comm"),
            read("wchan")
        );
    }
}
