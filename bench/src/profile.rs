//! Where the time goes: CPU seconds of processes during a load, syscall counts from
//! tracepoints (`perf stat`), and a sampled profile (`perf record -e cpu-clock`; this VM
//! has no hardware counters).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crate::load::LoadRun;

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

/// A server is settled once it spends less than this share of a core over a
/// [`SETTLE_LOOK`]: what a load left it (the search index catching up, its merges) is done.
const SETTLED_CORES: f64 = 0.05;
const SETTLE_LOOK: Duration = Duration::from_millis(200);
/// A server still busy after this long is left busy: the next load starts anyway.
const SETTLE_AT_MOST: Duration = Duration::from_secs(20);

/// Waits until a server has done what a load left it to do (`cpu`: its CPU seconds so
/// far), so that none of it falls into the next load; a caller that reads the CPU after
/// this counts it as the load's.
pub async fn settle(cpu: impl Fn() -> f64) {
    let since = std::time::Instant::now();
    let mut before = cpu();
    while since.elapsed() < SETTLE_AT_MOST {
        tokio::time::sleep(SETTLE_LOOK).await;
        let now = cpu();
        if now - before < SETTLED_CORES * SETTLE_LOOK.as_secs_f64() {
            return;
        }
        before = now;
    }
}

/// Server CPU µs per append of `load`, from its start until the server is idle again
/// ([`settle`]): what an append defers, such as indexing it, is its cost. `cpu` reads the
/// server's CPU seconds; the appends are the load's measured rate over its whole wall time.
pub async fn cpu_per_append(
    cpu: impl Fn() -> f64,
    load: impl std::future::Future<Output = anyhow::Result<LoadRun>>,
) -> anyhow::Result<(LoadRun, f64)> {
    let before = cpu();
    let started = std::time::Instant::now();
    let result = load.await?;
    let wall = started.elapsed().as_secs_f64();
    settle(&cpu).await;
    Ok((result, (cpu() - before) * 1e6 / (result.rate * wall)))
}

/// What a recording shows: CPU by thread, the hottest symbols (self time), and where the
/// log-writer thread spends its CPU.
pub type Views = (String, String, String);

/// The views of a recording that could not be made, saying why.
pub fn unrecorded(why: &anyhow::Error) -> Views {
    (format!("no profile: {why:#}"), String::new(), String::new())
}

/// `perf record` of one process for a while. The whole machine is sampled and the views
/// keep the samples whose process is this one: attaching to the process's threads instead
/// (`-p`) races with threads that end meanwhile (tantivy starts its indexing threads anew
/// after each commit of the search index), and perf then gives up; and `perf report`'s
/// `--pid` filters whole merged entries (a `tokio-rt-worker` entry is the bench's or the
/// store's by whichever thread made it first), so the views count the samples themselves.
/// Self time only, as a cpu-clock profile without frame pointers gives it.
pub struct Recording {
    child: Child,
    pid: u32,
    data: std::path::PathBuf,
    log: std::path::PathBuf,
}

impl Recording {
    pub fn start(pid: u32, data: &Path, secs: f64) -> anyhow::Result<Recording> {
        let log = data.with_extension("log");
        let child = Command::new("perf")
            .args(["record", "-e", "cpu-clock", "-F", "999", "-a", "-o"])
            .arg(data)
            .args(["--", "sleep", &format!("{secs:.2}")])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log)?)
            .spawn()?;
        Ok(Recording {
            child,
            pid,
            data: data.to_path_buf(),
            log,
        })
    }

    /// Waits for the recording to end and returns three views of the process: CPU by
    /// thread, the hottest symbols, and where the log-writer thread spends its CPU, each
    /// relative to what it shows. A `perf record` that failed is an error with perf's last
    /// words.
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
        let out = Command::new("perf")
            .args(["script", "-F", "comm,pid,tid,ip,sym,dso", "-i"])
            .arg(&self.data)
            .stderr(Stdio::null())
            .output()?;
        anyhow::ensure!(
            out.status.success(),
            "perf script exited with {}",
            out.status
        );
        let text = String::from_utf8_lossy(&out.stdout);
        let samples: Vec<Sample> = text
            .lines()
            .filter_map(Sample::parse)
            .filter(|s| s.pid == self.pid)
            .collect();
        anyhow::ensure!(!samples.is_empty(), "no sample of process {}", self.pid);
        let writer = samples.iter().filter(|s| s.comm == "log-writer");
        Ok((
            shares(samples.iter().map(|s| s.comm.clone()), 1.0),
            shares(samples.iter().map(Sample::symbol), 1.5),
            shares(writer.map(Sample::symbol), 2.0),
        ))
    }
}

/// One line of `perf script -F comm,pid,tid,ip,sym,dso`:
/// `<comm> <pid>/<tid> <ip> <symbol> (<dso path>)`; a thread name and a symbol may hold
/// spaces.
struct Sample {
    pid: u32,
    comm: String,
    dso: String,
    sym: String,
}

impl Sample {
    fn parse(line: &str) -> Option<Sample> {
        let (head, dso) = line.trim_end().rsplit_once(" (")?;
        let dso = dso.strip_suffix(')')?;
        let tokens: Vec<&str> = head.split_whitespace().collect();
        // The first `<pid>/<tid>` token ends the thread name.
        let (at, pid) = tokens.iter().enumerate().find_map(|(at, token)| {
            let (pid, tid) = token.split_once('/')?;
            tid.parse::<u32>().ok()?;
            Some((at, pid.parse::<u32>().ok()?))
        })?;
        Some(Sample {
            pid,
            comm: tokens[..at].join(" "),
            dso: dso.rsplit('/').next().unwrap_or(dso).to_string(),
            sym: tokens.get(at + 2..)?.join(" "),
        })
    }

    /// `dso  [k] symbol` (kernel) or `dso  [.] symbol`, as `perf report` shows it.
    fn symbol(&self) -> String {
        let space = if self.dso.starts_with("[kernel") {
            "[k]"
        } else {
            "[.]"
        };
        format!("{}  {space} {}", self.dso, self.sym)
    }
}

/// Each distinct key's share of all keys, largest first, those of at least `min_percent`,
/// at most 25 lines.
fn shares(keys: impl Iterator<Item = String>, min_percent: f64) -> String {
    let mut counts: std::collections::HashMap<String, usize> = Default::default();
    let mut total = 0usize;
    for key in keys {
        *counts.entry(key).or_default() += 1;
        total += 1;
    }
    let mut counts: Vec<(String, usize)> = counts.into_iter().collect();
    counts.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    counts
        .into_iter()
        .map(|(key, n)| (key, 100.0 * n as f64 / total.max(1) as f64))
        .filter(|(_, percent)| *percent >= min_percent)
        .take(25)
        .map(|(key, percent)| format!("{percent:>9.2}%  {key}"))
        .collect::<Vec<_>>()
        .join("\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sample_line_keeps_spaces_in_thread_names_and_symbols() {
        let line = "  my worker 1 15460/15464      55d08f38ae70 <core::hash::sip::Hasher<S> as \
                    core::hash::Hasher>::write (/work/target/release/event-store)";
        let s = Sample::parse(line).expect("a sample");
        assert_eq!(s.pid, 15460);
        assert_eq!(s.comm, "my worker 1");
        assert_eq!(s.dso, "event-store");
        assert_eq!(
            s.symbol(),
            "event-store  [.] <core::hash::sip::Hasher<S> as core::hash::Hasher>::write"
        );
        let kernel = Sample::parse(
            "     log-writer 15460/15464 ffffffff8224f5f9 iowrite16 ([kernel.kallsyms])",
        )
        .expect("a sample");
        assert_eq!(kernel.symbol(), "[kernel.kallsyms]  [k] iowrite16");
        assert!(Sample::parse("\tffffffff815fe9ed unmap_page_range").is_none());
    }

    #[test]
    fn shares_are_largest_first_and_cut_below_the_limit() {
        let keys = ["a", "b", "a", "c", "a", "b"]
            .into_iter()
            .chain(std::iter::repeat_n("d", 94))
            .map(String::from);
        assert_eq!(
            shares(keys, 2.0),
            "    94.00%  d\n     3.00%  a\n     2.00%  b"
        );
    }
}
