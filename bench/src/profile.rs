//! Where the time goes: CPU seconds of processes during a load, syscall counts from
//! tracepoints (`perf stat`), and a sampled profile (`perf record -e cpu-clock`; this VM
//! has no hardware counters).

use std::path::Path;
use std::process::{Child, Command, Stdio};

/// User + system CPU seconds a process (all its threads) has used so far.
pub fn cpu_secs(pid: u32) -> f64 {
    stat_secs(pid, &[11, 12])
}

/// CPU seconds of a process tree: the root with the children it has reaped, plus
/// `children` while they live (or wait to be reaped). A PostgreSQL backend that exits
/// when its client disconnects moves from the second into the first, so the sum never
/// loses it.
pub fn tree_cpu_secs(root: u32, children: &[u32]) -> f64 {
    stat_secs(root, &[11, 12, 13, 14]) + children.iter().map(|&pid| cpu_secs(pid)).sum::<f64>()
}

/// The sum of the given fields of `/proc/PID/stat` (counted after the command name), in
/// seconds.
fn stat_secs(pid: u32, fields_after_name: &[usize]) -> f64 {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
        return 0.0;
    };
    // Fields after the command name, which is in parentheses and may hold spaces.
    let Some(rest) = stat.rsplit(')').next() else {
        return 0.0;
    };
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime, stime, cutime and cstime are fields 14 to 17 of the whole line: 11 to 14
    // after ')'.
    let ticks: u64 = fields_after_name
        .iter()
        .filter_map(|&i| fields.get(i).and_then(|f| f.parse::<u64>().ok()))
        .sum();
    ticks as f64 / 100.0
}

/// The process and every process whose parent it is (PostgreSQL's backends).
pub fn with_children(pid: u32) -> Vec<u32> {
    let mut pids = vec![pid];
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Ok(child) = entry.file_name().to_string_lossy().parse::<u32>() else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{child}/stat")) else {
                continue;
            };
            let parent = stat
                .rsplit(')')
                .next()
                .and_then(|rest| rest.split_whitespace().nth(1))
                .and_then(|p| p.parse::<u32>().ok());
            if parent == Some(pid) {
                pids.push(child);
            }
        }
    }
    pids
}

pub fn perf_available() -> bool {
    Command::new("perf")
        .args(["stat", "-e", "cpu-clock", "true"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// `perf stat` counting fsync-family syscalls of `pids` for a while.
pub struct SyscallCount {
    child: Child,
    out: std::path::PathBuf,
}

impl SyscallCount {
    pub fn start(pids: &[u32], out: &Path, secs: f64) -> anyhow::Result<SyscallCount> {
        let list: Vec<String> = pids.iter().map(u32::to_string).collect();
        let child = Command::new("perf")
            .args([
                "stat",
                "-x,",
                "-e",
                "syscalls:sys_enter_fdatasync,syscalls:sys_enter_fsync",
                "-o",
            ])
            .arg(out)
            .args(["-p", &list.join(","), "--", "sleep", &format!("{secs:.2}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()?;
        Ok(SyscallCount {
            child,
            out: out.to_path_buf(),
        })
    }

    /// Waits for the count to end and returns fdatasync + fsync calls.
    pub fn finish(mut self) -> anyhow::Result<u64> {
        self.child.wait()?;
        let text = std::fs::read_to_string(&self.out)?;
        Ok(text
            .lines()
            .filter_map(|l| l.split(',').next()?.trim().parse::<u64>().ok())
            .sum())
    }
}

/// What a recording shows: CPU by thread, the hottest symbols (self time), and where the
/// log-writer thread spends its CPU.
pub type Views = (String, String, String);

/// The views of a recording that could not be made, saying why.
pub fn unrecorded(why: &anyhow::Error) -> Views {
    (format!("no profile: {why:#}"), String::new(), String::new())
}

/// `perf record` of one process for a while.
pub struct Recording {
    child: Child,
    data: std::path::PathBuf,
    log: std::path::PathBuf,
}

impl Recording {
    pub fn start(pid: u32, data: &Path, secs: f64) -> anyhow::Result<Recording> {
        let log = data.with_extension("log");
        let child = Command::new("perf")
            .args(["record", "-e", "cpu-clock", "-F", "999", "-g", "-o"])
            .arg(data)
            .args(["-p", &pid.to_string(), "--", "sleep", &format!("{secs:.2}")])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()?;
        Ok(Recording {
            child,
            data: data.to_path_buf(),
            log,
        })
    }

    /// Waits for the recording to end and returns three views: CPU by thread, the
    /// hottest symbols, and where the log-writer thread spends its CPU (self time).
    /// A `perf record` that failed is an error with perf's last words: attaching to every
    /// thread of a process races with threads that end meanwhile (tantivy starts its
    /// indexing threads anew after each commit of the search index), and then perf gives
    /// up; the caller may record again.
    pub fn finish(mut self) -> anyhow::Result<Views> {
        let status = self.child.wait()?;
        if !status.success() {
            let log = std::fs::read_to_string(&self.log).unwrap_or_default();
            let last = log
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("");
            anyhow::bail!("perf record exited with {status}: {last}");
        }
        let report = |args: &[&str]| -> anyhow::Result<String> {
            let out = Command::new("perf")
                .args(["report", "--stdio", "-g", "none"])
                .args(args)
                .arg("-i")
                .arg(&self.data)
                .stderr(Stdio::null())
                .output()?;
            Ok(String::from_utf8_lossy(&out.stdout)
                .lines()
                .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
                .take(25)
                .collect::<Vec<_>>()
                .join("\n"))
        };
        Ok((
            report(&["--no-children", "--sort", "comm", "--percent-limit", "1"])?,
            report(&[
                "--no-children",
                "--sort",
                "dso,sym",
                "--percent-limit",
                "1.5",
            ])?,
            report(&[
                "--no-children",
                "--comm",
                "log-writer",
                "--percentage",
                "relative",
                "--sort",
                "dso,sym",
                "--percent-limit",
                "2",
            ])?,
        ))
    }
}
