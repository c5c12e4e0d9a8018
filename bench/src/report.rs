//! bench/RESULTS.md: the machine, the date, the exact commands, every figure as median
//! (min–max) over the runs, ratios against the baselines of the same run, and the issue's
//! goals marked met or not met.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::agentlog::Footprint;
use crate::stats::{cell, fmt_num, fmt_ratio, percentile_f64, Runs};
use crate::{Args, LoadResults, Target};

pub struct ProfileRow {
    pub target: Target,
    pub rate: f64,
    pub server_cores: f64,
    pub bench_cores: f64,
    pub server_cpu_us_per_append: f64,
    pub syncs_per_s: Option<f64>,
    pub appends_per_sync: Option<f64>,
}

/// CPU per append with every system paced at one rate.
pub struct SameRate {
    pub clients: usize,
    /// Appends/s every system was paced at.
    pub rate: f64,
    /// Per system: the rate it kept up and its server CPU µs per append.
    pub rows: Vec<(Target, f64, f64)>,
}

pub struct Profile {
    pub clients: usize,
    pub rows: Vec<ProfileRow>,
    /// The recording by thread, by symbol, and the log writer by symbol (self time).
    pub perf: Option<crate::profile::Views>,
}

/// One reader of the catch-up figure.
pub struct CatchUpRow {
    pub name: &'static str,
    /// Events per second, one per run.
    pub rates: Runs,
    /// CPU of the server (its child processes included) and of the reading process, over
    /// all runs, per event read.
    pub server_cpu_us_per_event: f64,
    pub reader_cpu_us_per_event: f64,
}

/// (system, followers, every run's delivery latencies in ms).
pub type FanOutRows = Vec<(&'static str, usize, Vec<Vec<f64>>)>;

#[derive(Default)]
pub struct Report {
    quick: bool,
    command: String,
    argv: String,
    dir: PathBuf,
    started: String,
    load_before: String,
    load_after: String,
    finished: String,
    pub versions: Vec<(&'static str, Option<String>)>,
    notes: Vec<String>,
    pub raw: Vec<(crate::disk::RawCase, Runs, Runs)>,
    pub loads: LoadResults,
    /// p50 of a loopback `Health/Check` to the store, one per run.
    pub round_trip_ms: Runs,
    pub profile: Option<Profile>,
    pub same_rate: Option<SameRate>,
    pub catch_up: (usize, Vec<CatchUpRow>),
    pub fan_out: (usize, Duration, FanOutRows),
    pub followers: Option<crate::followers::FollowersResult>,
    pub resume: Vec<crate::resume::ResumeRow>,
    pub footprint: Option<Footprint>,
    pub fork: crate::fork::ForkFigures,
    /// The same-run A/B (`--against-store`): when set, the report is that alone.
    pub ab: Option<crate::ab::AbResult>,
}

fn shell(program: &str, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "?".into())
}

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|l| l.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "?".into())
}

impl Report {
    pub fn new(args: &Args, dir: &Path) -> Report {
        Report {
            quick: args.quick,
            command: args.command.clone(),
            argv: std::env::args()
                .map(|a| if a.contains(' ') { format!("'{a}'") } else { a })
                .collect::<Vec<_>>()
                .join(" "),
            dir: dir.to_path_buf(),
            started: shell("date", &["-u", "+%Y-%m-%d %H:%M:%S UTC"]),
            load_before: loadavg(),
            ..Default::default()
        }
    }

    pub fn note(&mut self, note: String) {
        eprintln!("[bench] note: {note}");
        self.notes.push(note);
    }

    pub fn finish(&mut self) {
        self.load_after = loadavg();
        self.finished = shell("date", &["-u", "+%H:%M:%S UTC"]);
    }

    fn load(&self, target: Target, clients: usize) -> Option<&Vec<crate::load::LoadRun>> {
        self.loads.get(&(target, clients))
    }

    /// The CPU goal's figures with every system at the same rate (see
    /// [`Report::render_same_rate`]), for the goal row.
    fn same_rate_cpu(&self) -> String {
        let Some(SameRate { rate, rows, .. }) = &self.same_rate else {
            return String::new();
        };
        let us = |target: Target| {
            rows.iter()
                .find(|(t, _, _)| *t == target)
                .map(|(_, _, us)| *us)
        };
        match (us(Target::AgentlogStream), us(Target::Redis)) {
            (Some(ours), Some(redis)) => format!(
                ". All at {} appends/s: AppendStream {ours:.1} µs vs Redis {redis:.1} µs = \
                 **{}**{}",
                fmt_num(*rate),
                fmt_ratio(ours / redis),
                floors(
                    ours,
                    redis,
                    us(Target::FloorStream),
                    us(Target::DurableFloorStream)
                )
            ),
            _ => String::new(),
        }
    }

    /// Appends/s of `target` at `clients` clients, one per run.
    pub fn rate(&self, target: Target, clients: usize) -> Option<Runs> {
        self.load(target, clients)
            .map(|runs| Runs(runs.iter().map(|r| r.rate).collect()))
    }

    fn p50(&self, target: Target, clients: usize) -> Option<Runs> {
        self.load(target, clients)
            .map(|runs| Runs(runs.iter().map(|r| r.p50_ms).collect()))
    }

    fn p99(&self, target: Target, clients: usize) -> Option<Runs> {
        self.load(target, clients)
            .map(|runs| Runs(runs.iter().map(|r| r.p99_ms).collect()))
    }

    fn clients(&self) -> Vec<usize> {
        let mut c: Vec<usize> = self.loads.keys().map(|(_, c)| *c).collect();
        c.sort_unstable();
        c.dedup();
        c
    }

    pub fn render(&self) -> String {
        let mut md = String::new();
        let _ = self.render_into(&mut md);
        md
    }

    fn render_into(&self, md: &mut String) -> std::fmt::Result {
        writeln!(md, "# agentlog benchmark results\n")?;
        if self.quick {
            writeln!(
                md,
                "**Quick mode**: tiny runs that only check the suite still works. These numbers mean nothing.\n"
            )?;
        }
        writeln!(
            md,
            "Every figure is the **median** of the runs, with (min–max). Ratios compare medians \
             measured in this same run, on the same disk; each run visits every system in turn, \
             so all of them share the same moments of the machine. Events are 300-byte texts; \
             appends are SYNC (acknowledged after fdatasync) unless said otherwise.\n"
        )?;
        self.render_machine(md)?;
        if let Some(ab) = &self.ab {
            ab.render(md)?;
        } else {
            self.render_goals(md)?;
            self.render_limits(md)?;
            self.render_appends(md)?;
            self.render_profile(md)?;
            self.render_same_rate(md)?;
            self.render_subscribe(md)?;
            self.render_resume(md)?;
            self.render_footprint(md)?;
            self.render_fork(md)?;
            self.render_method(md)?;
        }
        if !self.notes.is_empty() {
            writeln!(md, "## Notes from this run\n")?;
            for note in &self.notes {
                writeln!(md, "- {note}")?;
            }
            writeln!(md)?;
        }
        Ok(())
    }

    fn render_machine(&self, md: &mut String) -> std::fmt::Result {
        let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
        let cpu = cpuinfo
            .lines()
            .find(|l| l.starts_with("model name"))
            .and_then(|l| l.split(':').nth(1))
            .unwrap_or("?")
            .trim()
            .to_string();
        let cores = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(0);
        let mem = std::fs::read_to_string("/proc/meminfo")
            .ok()
            .and_then(|m| {
                m.lines()
                    .find(|l| l.starts_with("MemTotal"))
                    .and_then(|l| l.split_whitespace().nth(1))
                    .and_then(|kb| kb.parse::<f64>().ok())
            })
            .map(|kb| format!("{:.1} GiB", kb / 1024.0 / 1024.0))
            .unwrap_or_else(|| "?".into());
        let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .to_string();
        let dir = self.dir.to_string_lossy().to_string();
        let fs = shell("findmnt", &["-no", "SOURCE,FSTYPE,OPTIONS", "-T", &dir]);
        let commit = shell("git", &["rev-parse", "--short", "HEAD"]);
        let dirty = if shell("git", &["status", "--porcelain"]).is_empty() {
            ""
        } else {
            " (with uncommitted changes)"
        };
        writeln!(md, "## Machine and run\n")?;
        writeln!(md, "| | |\n|---|---|")?;
        writeln!(md, "| date | {} → {} |", self.started, self.finished)?;
        writeln!(
            md,
            "| CPU | {cpu}, {cores} cores (shared by the stores and the load generator) |"
        )?;
        writeln!(md, "| memory | {mem} |")?;
        writeln!(md, "| kernel | Linux {kernel} |")?;
        writeln!(
            md,
            "| data disk | `{dir}` on `{fs}` (every store's data, and the raw test, on it) |"
        )?;
        writeln!(
            md,
            "| load average (1, 5, 15 min) | before: {}; after: {} |",
            self.load_before, self.load_after
        )?;
        let build = if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        };
        writeln!(md, "| agentlog | commit {commit}{dirty}, {build} build |")?;
        writeln!(md, "| rustc | {} |", shell("rustc", &["--version"]))?;
        for (name, version) in &self.versions {
            writeln!(
                md,
                "| {name} | {} |",
                version.as_deref().unwrap_or("not measured in this run")
            )?;
        }
        writeln!(md)?;
        writeln!(md, "Commands:\n")?;
        writeln!(md, "```sh")?;
        if !self.command.is_empty() {
            writeln!(md, "{}", self.command)?;
            writeln!(md, "# which ran:")?;
        }
        writeln!(md, "{}", self.argv)?;
        writeln!(md, "```\n")?;
        Ok(())
    }

    fn render_goals(&self, md: &mut String) -> std::fmt::Result {
        writeln!(md, "## Goals\n")?;
        writeln!(md, "| goal | measured | met? |\n|---|---|---|")?;
        let c64 = if self.clients().contains(&64) {
            64
        } else {
            *self.clients().last().unwrap_or(&1)
        };
        // Every goal is for the best path the store offers: unary Append or AppendStream.
        let paths = [Target::Agentlog, Target::AgentlogStream];
        let best_rate = |clients: usize| {
            paths
                .into_iter()
                .filter_map(|t| self.rate(t, clients).map(|r| r.median()))
                .reduce(f64::max)
        };
        let ours64 = best_rate(c64);
        for (target, name, goal) in [
            (Target::Postgres, "PostgreSQL", 3.0),
            (Target::Redis, "Redis (appendfsync always)", 1.0),
            (Target::Etcd, "etcd", 3.0),
        ] {
            let theirs = self.rate(target, c64).map(|r| r.median());
            let (mut measured, met) = rate_goal(ours64, theirs, "appends/s", goal);
            if target == Target::Redis {
                let floor = self
                    .rate(Target::DurableFloorStream, c64)
                    .map(|r| r.median());
                measured += &durable_floor_rate(ours64, theirs, floor);
            }
            writeln!(
                md,
                "| {c64} clients (Append or AppendStream): ≥ {goal}× {name} | {measured} | {met} |"
            )?;
        }
        let cpu_of = |target: Target| {
            self.profile.as_ref().and_then(|p| {
                p.rows
                    .iter()
                    .find(|r| r.target == target)
                    .map(|r| (p.clients, r.server_cpu_us_per_append))
            })
        };
        // The goal is for the best path; the unary `Append` is reported beside it.
        let ours_cpu = [Target::AgentlogStream, Target::Agentlog]
            .into_iter()
            .filter_map(cpu_of)
            .map(|(_, us)| us)
            .reduce(f64::min);
        // What the contract's transport alone costs, on its best path: the floor; and with a
        // group-committed fdatasync, the least any durable store over it costs.
        let floor_cpu = [Target::FloorStream, Target::Floor]
            .into_iter()
            .filter_map(cpu_of)
            .map(|(_, us)| us)
            .reduce(f64::min);
        let durable_floor_cpu = cpu_of(Target::DurableFloorStream).map(|(_, us)| us);
        let (measured, ok) = match (ours_cpu, cpu_of(Target::Redis)) {
            (Some(ours), Some((clients, redis))) => {
                let paths = [
                    (Target::AgentlogStream, "AppendStream"),
                    (Target::Agentlog, "unary Append"),
                ]
                .into_iter()
                .filter_map(|(t, name)| cpu_of(t).map(|(_, us)| format!("{us:.1} µs ({name})")))
                .collect::<Vec<_>>()
                .join(", ");
                let floor = floors(ours, redis, floor_cpu, durable_floor_cpu);
                (
                    format!(
                        "{paths} vs Redis {redis:.1} µs, at {clients} clients = **{}**{floor}{}",
                        fmt_ratio(ours / redis),
                        self.same_rate_cpu()
                    ),
                    met(ours / redis <= 1.2),
                )
            }
            _ => ("not measured (no Redis in this run)".into(), "–".into()),
        };
        writeln!(
            md,
            "| store CPU per durable append (Append or AppendStream) ≤ 1.2× Redis's per \
             append (`appendfsync always`) | {measured} | {ok} |"
        )?;
        let rows = &self.catch_up.1;
        let catch_up = |prefix: &str| {
            rows.iter()
                .find(|row| row.name.starts_with(prefix))
                .map(|row| row.rates.median())
        };
        let (measured, ok) = rate_goal(
            catch_up("agentlog"),
            catch_up("PostgreSQL"),
            "events/s",
            2.0,
        );
        writeln!(
            md,
            "| catch-up: ≥ 2× PostgreSQL `SELECT … ORDER BY seq` | {measured} | {ok} |"
        )?;
        // The paused loop: its fdatasync follows a pause as long as a round trip, as the
        // store's do at one client. A networked store adds one loopback round trip to it.
        let raw_sync = self
            .raw
            .iter()
            .find(|(case, _, _)| {
                case.layout == crate::disk::RawFile::Preallocated
                    && case.batch == 1
                    && !case.idle.is_zero()
            })
            .map(|(_, _, ms)| ms.median());
        let round_trip = (!self.round_trip_ms.is_empty()).then(|| self.round_trip_ms.median());
        let ours1 = paths
            .into_iter()
            .filter_map(|t| self.p50(t, 1).map(|r| r.median()))
            .reduce(f64::min);
        let (measured, ok) = match (ours1, raw_sync, round_trip) {
            (Some(o), Some(r), Some(rt)) => (
                format!(
                    "p50 {o:.3} ms vs raw write+fdatasync (preallocated, paused) p50 {r:.3} ms + \
                     loopback gRPC round trip (`Health/Check`) p50 {rt:.3} ms = **{}**",
                    fmt_ratio(o / (r + rt))
                ),
                met(o / (r + rt) <= 1.5),
            ),
            _ => ("not measured".into(), "–".into()),
        };
        writeln!(
            md,
            "| 1 client (Append or AppendStream): latency ≤ 1.5× the paused raw fdatasync plus \
             one loopback gRPC round trip | {measured} | {ok} |"
        )?;
        // The ceiling: the best path with fsync skipped, in this run.
        let ceiling64 = [Target::Ceiling, Target::CeilingStream]
            .into_iter()
            .filter_map(|t| self.rate(t, c64).map(|r| r.median()))
            .reduce(f64::max);
        let (measured, ok) = match (ours64, ceiling64) {
            (Some(o), Some(c)) => (
                format!(
                    "{} vs {} appends/s = **{:.0}%**",
                    fmt_num(o),
                    fmt_num(c),
                    100.0 * o / c
                ),
                met(o / c >= 0.8),
            ),
            _ => ("not measured (no fsync-skipped build)".into(), "–".into()),
        };
        writeln!(
            md,
            "| {c64} clients (Append or AppendStream): durable ≥ 80% of the fsync-skipped \
             ceiling (Append or AppendStream), same run | {measured} | {ok} |"
        )?;
        writeln!(md)?;
        Ok(())
    }

    fn render_limits(&self, md: &mut String) -> std::fmt::Result {
        writeln!(
            md,
            "## 1. The limits: the disk, and the gRPC path without fsync\n"
        )?;
        writeln!(
            md,
            "`write(n × 300 B)` + `fdatasync` in a loop on one file in the data dir, measured \
             before anything else. *Preallocated* overwrites zero-filled, synced blocks, as the \
             store's segments do (the fdatasync persists only data); *appending* grows the \
             file, so every fdatasync also persists its size, as the naive JSONL log does. The \
             goals use the preallocated figure, the faster of the two, back to back. The last \
             row sleeps before each write about as long as one append's round trip at one \
             client takes (answer out, next request in): a store's fdatasync follows such a \
             pause, the back-to-back loop's never does, and on a virtual machine the pause \
             makes the next fdatasync slower. The ceiling of the gRPC path (fsync skipped) is \
             in the next table.\n"
        )?;
        writeln!(
            md,
            "| file | records per fdatasync | records/s | fdatasync p50 ms |\n|---|---|---|---|"
        )?;
        for (case, rates, ms) in &self.raw {
            writeln!(
                md,
                "| {} | {} | {} | {} |",
                case.describe(),
                case.batch,
                cell(rates),
                cell_ms(ms)
            )?;
        }
        writeln!(md)?;
        Ok(())
    }

    fn render_appends(&self, md: &mut String) -> std::fmt::Result {
        let clients = self.clients();
        writeln!(
            md,
            "## 2–3. Durable appends: agentlog through gRPC, the ceiling, and the baselines\n"
        )?;
        writeln!(
            md,
            "Closed loop: each client sends its next append when the previous one is acknowledged. \
             Appends/s of all clients together, median (min–max):\n"
        )?;
        let header: Vec<String> = clients
            .iter()
            .map(|&c| format!("{c} client{}", if c == 1 { "" } else { "s" }))
            .collect();
        writeln!(md, "| system | {} |", header.join(" | "))?;
        writeln!(md, "|---|{}", "---|".repeat(clients.len()))?;
        let targets = Target::ALL;
        for target in targets {
            if !clients.iter().any(|&c| self.load(target, c).is_some()) {
                continue;
            }
            let cells: Vec<String> = clients
                .iter()
                .map(|&c| {
                    self.rate(target, c)
                        .map(|r| cell(&r))
                        .unwrap_or_else(|| "–".into())
                })
                .collect();
            writeln!(md, "| {} | {} |", target.label(), cells.join(" | "))?;
        }
        writeln!(md)?;
        writeln!(
            md,
            "Latency per append, p50 / p99 in ms (each the median over the runs):\n"
        )?;
        writeln!(md, "| system | {} |", header.join(" | "))?;
        writeln!(md, "|---|{}", "---|".repeat(clients.len()))?;
        for target in targets {
            if !clients.iter().any(|&c| self.load(target, c).is_some()) {
                continue;
            }
            let cells: Vec<String> = clients
                .iter()
                .map(|&c| match (self.p50(target, c), self.p99(target, c)) {
                    (Some(p50), Some(p99)) => format!("{:.2} / {:.2}", p50.median(), p99.median()),
                    _ => "–".into(),
                })
                .collect();
            writeln!(md, "| {} | {} |", target.label(), cells.join(" | "))?;
        }
        writeln!(md)?;
        writeln!(
            md,
            "agentlog (one session per client) as a multiple of each baseline's appends/s:\n"
        )?;
        writeln!(md, "| vs | {} |", header.join(" | "))?;
        writeln!(md, "|---|{}", "---|".repeat(clients.len()))?;
        for target in [
            Target::Ceiling,
            Target::Naive,
            Target::Postgres,
            Target::Redis,
            Target::Etcd,
        ] {
            if !clients.iter().any(|&c| self.load(target, c).is_some()) {
                continue;
            }
            let cells: Vec<String> = clients
                .iter()
                .map(
                    |&c| match (self.rate(Target::Agentlog, c), self.rate(target, c)) {
                        (Some(o), Some(t)) => fmt_ratio(o.median() / t.median()),
                        _ => "–".into(),
                    },
                )
                .collect();
            writeln!(md, "| {} | {} |", target.label(), cells.join(" | "))?;
        }
        writeln!(md)?;
        Ok(())
    }

    /// CPU per append with every system paced at one rate ([`Report::same_rate`]).
    fn render_same_rate(&self, md: &mut String) -> std::fmt::Result {
        let Some(SameRate {
            clients,
            rate,
            rows,
        }) = &self.same_rate
        else {
            return Ok(());
        };
        writeln!(md, "### CPU per append at one rate\n")?;
        writeln!(
            md,
            "{clients} clients together paced at {} appends/s ({:.0}% of the slower of the \
             store's AppendStream and Redis in the closed loop above), each system in turn, \
             server CPU from the load's start until the server is idle again. CPU per append \
             falls as the rate rises (more appends share each wake-up, read and fsync), so \
             systems at their own closed-loop rates are not doing the same work; here they \
             are:\n",
            fmt_num(*rate),
            crate::SAME_RATE_SHARE * 100.0
        )?;
        let redis = rows
            .iter()
            .find(|(t, _, _)| *t == Target::Redis)
            .map(|(_, _, us)| *us);
        writeln!(
            md,
            "| system | appends/s kept | server CPU µs/append | × Redis's |\n|---|---|---|---|"
        )?;
        for (target, kept, us) in rows {
            writeln!(
                md,
                "| {} | {} | {us:.1} | {} |",
                target.label(),
                fmt_num(*kept),
                redis.map_or("–".into(), |r| fmt_ratio(us / r)),
            )?;
        }
        writeln!(md)?;
        Ok(())
    }

    fn render_profile(&self, md: &mut String) -> std::fmt::Result {
        let Some(p) = &self.profile else {
            return Ok(());
        };
        writeln!(md, "### Where the time goes at {} clients\n", p.clients)?;
        writeln!(
            md,
            "One more run per system with its server's CPU time (/proc, all threads and child \
             processes) and its fdatasync/fsync calls counted by `perf stat` tracepoints. Each \
             run starts once the server is idle (under 5% of a core); its CPU per append \
             counts from the load's start until the server is idle again, so what an append \
             defers (the store's search indexing) is its cost and never the next system's. \
             \"appends per sync\" is the group-commit batch. The gRPC floor is tonic serving \
             the store's service, answering each append at once from memory \
             (`agentlog-bench-floor`): what the contract's transport costs before the store \
             does anything. The durable floor is the same server handing each append to one \
             thread that writes whatever is queued to a preallocated file, calls fdatasync \
             once for it and then answers (`agentlog-bench-floor --durable`): the least any \
             store that acknowledges after an fsync costs over this transport on this disk.\n"
        )?;
        writeln!(
            md,
            "| system | appends/s | server cores | load-generator cores | server CPU µs/append | syncs/s | appends per sync |\n|---|---|---|---|---|---|---|"
        )?;
        for r in &p.rows {
            writeln!(
                md,
                "| {} | {} | {:.2} | {:.2} | {:.1} | {} | {} |",
                r.target.label(),
                fmt_num(r.rate),
                r.server_cores,
                r.bench_cores,
                r.server_cpu_us_per_append,
                r.syncs_per_s.map(fmt_num).unwrap_or_else(|| "–".into()),
                r.appends_per_sync
                    .map(fmt_num)
                    .unwrap_or_else(|| "–".into()),
            )?;
        }
        writeln!(md)?;
        if let Some((threads, symbols, writer)) = &p.perf {
            writeln!(
                md,
                "`perf record -e cpu-clock -a` (the whole machine) during the AppendStream run, the \
                 store's samples, CPU by thread:\n"
            )?;
            writeln!(md, "```\n{threads}\n```\n")?;
            writeln!(md, "Hottest symbols (self time):\n")?;
            writeln!(md, "```\n{symbols}\n```\n")?;
            writeln!(
                md,
                "The `log-writer` thread (the single writer: validate, write, fdatasync, sled \
                 index, publish), self CPU time by symbol, relative to that thread (the release \
                 build has no frame pointers, so inclusive times are not reliable; off-CPU time \
                 waiting for the disk is not in a cpu-clock profile):\n"
            )?;
            writeln!(md, "```\n{writer}\n```\n")?;
        }
        Ok(())
    }

    fn render_subscribe(&self, md: &mut String) -> std::fmt::Result {
        let (n, rows) = &self.catch_up;
        writeln!(md, "## 4. Subscribe\n")?;
        writeln!(
            md,
            "Catch-up: read a whole session of {} events from the start (events/s):\n",
            fmt_num(*n as f64)
        )?;
        writeln!(
            md,
            "| reader | events/s | agentlog × | server CPU µs per event | reader CPU µs per event |\n\
             |---|---|---|---|---|"
        )?;
        let ours = rows.first().map(|row| row.rates.median());
        for row in rows {
            let ratio = ours
                .map(|o| fmt_ratio(o / row.rates.median()))
                .unwrap_or_default();
            writeln!(
                md,
                "| {} | {} | {ratio} | {:.2} | {:.2} |",
                row.name,
                cell(&row.rates),
                row.server_cpu_us_per_event,
                row.reader_cpu_us_per_event
            )?;
        }
        writeln!(
            md,
            "\nCPU over all runs (/proc user + system; the server's includes its child \
             processes; the reader's is the bench process).\n"
        )?;
        let (events, interval, fan) = &self.fan_out;
        if fan.is_empty() {
            return self.render_followers(md);
        }
        writeln!(
            md,
            "Live fan-out: N followers on one session; a writer appends {events} events, one every {} ms; \
             latency = received − acknowledged, over every delivery (ms; negative means the \
             follower had it before the writer's acknowledgement arrived):\n",
            interval.as_millis()
        )?;
        writeln!(
            md,
            "| followers | system | p50 ms | p99 ms | max ms |\n|---|---|---|---|---|"
        )?;
        for (name, followers, runs) in fan {
            let p50 = Runs(runs.iter().map(|r| percentile_f64(r, 0.5)).collect());
            let p99 = Runs(runs.iter().map(|r| percentile_f64(r, 0.99)).collect());
            let max = Runs(runs.iter().map(|r| percentile_f64(r, 1.0)).collect());
            writeln!(
                md,
                "| {followers} | {name} | {} | {} | {} |",
                cell_ms(&p50),
                cell_ms(&p99),
                cell_ms(&max)
            )?;
        }
        writeln!(md)?;
        self.render_followers(md)
    }

    fn render_followers(&self, md: &mut String) -> std::fmt::Result {
        let Some(f) = &self.followers else {
            return Ok(());
        };
        let n = fmt_num(f.followers as f64);
        writeln!(
            md,
            "Followers at scale: {n} sessions of one event on a fresh store, each followed by \
             one idle `Subscribe(follow)` stream (100 per HTTP/2 connection). The store's RSS \
             before the followers and with all of them live; then events appended one every \
             {} ms, {} to the first session while it alone was followed, and as many spread \
             over the {n} sessions once every one was, each timed from the append's sending to \
             its follower's receipt (ms, one run; the append's own commit included).\n",
            f.interval.as_millis(),
            f.alone_ms.len()
        )?;
        let delta = f.rss_after.saturating_sub(f.rss_before);
        writeln!(
            md,
            "| store RSS before | with {n} followers | per follower |\n|---|---|---|"
        )?;
        writeln!(
            md,
            "| {:.1} MiB | {:.1} MiB | **{:.1} KiB** |\n",
            f.rss_before as f64 / (1 << 20) as f64,
            f.rss_after as f64 / (1 << 20) as f64,
            delta as f64 / f.followers.max(1) as f64 / 1024.0
        )?;
        writeln!(
            md,
            "| an append reaches its follower | p50 ms | p99 ms | max ms |\n|---|---|---|---|"
        )?;
        for (name, ms) in [
            ("the only follower".to_string(), &f.alone_ms),
            (format!("one of {n} followers"), &f.among_ms),
        ] {
            writeln!(
                md,
                "| {name} | {:.3} | {:.3} | {:.3} |",
                percentile_f64(ms, 0.5),
                percentile_f64(ms, 0.99),
                percentile_f64(ms, 1.0)
            )?;
        }
        let ratio = |q| fmt_ratio(percentile_f64(&f.among_ms, q) / percentile_f64(&f.alone_ms, q));
        writeln!(
            md,
            "| among {n} / alone | **{}** | {} | |\n",
            ratio(0.5),
            ratio(0.99)
        )?;
        Ok(())
    }

    fn render_resume(&self, md: &mut String) -> std::fmt::Result {
        if self.resume.is_empty() {
            return Ok(());
        }
        writeln!(md, "## 5. Resume\n")?;
        writeln!(
            md,
            "A session built with appends (cycles of user turn, reply with a `bash` tool_use, \
             tool_started, tool_result, final reply), idle. A `runner` (scripted model) waits in \
             ClaimSession. Each resume appends a user turn and times, from its acknowledgement, \
             the runner's claim → read → fold → model → first append (its first streamed delta, \
             BUFFERED) and its durable reply (SYNC). *Cold*: a runner process that never worked \
             the session (a new process each run, `--snapshot-every 0`) reads and folds the whole \
             log. *Warm*: the same runner claims the session again; it kept the session's fold \
             and reads only the events since. *Snapshot*: a new runner process with snapshots on \
             (the default) restores the fold from the snapshot a runner left in the store \
             (sessions of 1,000 events or more) and reads only the events after it. The 10-event \
             row is the fixed cost.\n"
        )?;
        writeln!(
            md,
            "| events in the session | cold: first new action ms | snapshot: first new action ms \
             | warm: first new action ms | cold ÷ snapshot | cold: reply durable ms | snapshot: \
             reply durable ms | warm: reply durable ms |\n|---|---|---|---|---|---|---|---|"
        )?;
        for row in &self.resume {
            let ratio = if row.cold_first.is_empty() || row.snapshot_first.is_empty() {
                "–".to_string()
            } else {
                fmt_ratio(row.cold_first.median() / row.snapshot_first.median())
            };
            writeln!(
                md,
                "| {} | {} | {} | {} | {} | {} | {} | {} |",
                fmt_int(row.size),
                cell_ms(&row.cold_first),
                cell_ms(&row.snapshot_first),
                cell_ms(&row.warm_first),
                ratio,
                cell_ms(&row.cold_reply),
                cell_ms(&row.snapshot_reply),
                cell_ms(&row.warm_reply)
            )?;
        }
        writeln!(md)?;
        Ok(())
    }

    fn render_fork(&self, md: &mut String) -> std::fmt::Result {
        let f = &self.fork;
        let Some(plan) = f.plan else {
            return Ok(());
        };
        writeln!(
            md,
            "## 7. Forks: workspace checkpoints, restores, ForkSession\n"
        )?;
        writeln!(
            md,
            "A workspace of {} files of random content ({} MB in all, 100 to a directory), \
             with a git index beside it (`--git-dir` outside the tree). Each run rewrites {} \
             files (same sizes, new content) as a tool call would, then times the runner's \
             checkpoint (what the guard records before the `tool_result`) and `git status \
             --porcelain` on the same tree, in turn. The session's first checkpoint, which \
             reads and stores every file, took {:.0} ms. The restore is the runner's fork \
             restore (staged beside the workspaces, every byte synced with one `syncfs`, \
             moved into place, marked) against `cp -a` of the tree, and `cp -a` then \
             `sync -f`. The fork is `ForkSession` of a session of {} events (300-byte user \
             turns) at its last seq, against a `Subscribe` that reads the same events from the \
             same store: once on the local log, once on PostgreSQL (a private server).\n",
            fmt_int(plan.files),
            plan.bytes >> 20,
            plan.changed,
            f.first_checkpoint_ms,
            fmt_int(plan.events)
        )?;
        writeln!(
            md,
            "| figure | agentlog ms | baseline | baseline ms | ratio |\n|---|---|---|---|---|"
        )?;
        let rows = [
            (
                "checkpoint after a tool call",
                &f.checkpoint_ms,
                "git status",
                &f.git_status_ms,
            ),
            (
                "checkpoint, nothing changed (the walk alone)",
                &f.unchanged_ms,
                "git status",
                &f.git_status_ms,
            ),
            ("restore for a fork", &f.restore_ms, "cp -a", &f.cp_ms),
            (
                "restore for a fork",
                &f.restore_ms,
                "cp -a && sync -f",
                &f.cp_sync_ms,
            ),
            (
                "ForkSession, local log",
                &f.fork_ms,
                "Subscribe of the same events",
                &f.subscribe_ms,
            ),
            (
                "ForkSession, PostgreSQL",
                &f.pg_fork_ms,
                "Subscribe of the same events",
                &f.pg_subscribe_ms,
            ),
        ];
        for (what, ours, baseline, theirs) in rows {
            let ratio = if ours.is_empty() || theirs.is_empty() {
                "–".to_string()
            } else {
                fmt_ratio(ours.median() / theirs.median())
            };
            writeln!(
                md,
                "| {what} | {} | {baseline} | {} | {ratio} |",
                cell_ms(ours),
                cell_ms(theirs)
            )?;
        }
        writeln!(
            md,
            "\nFiles the checkpoint read per run (the changed ones, and any it could not trust \
             by their metadata): median {:.0}.\n",
            f.files_read.median()
        )?;
        Ok(())
    }

    fn render_footprint(&self, md: &mut String) -> std::fmt::Result {
        let Some(f) = &self.footprint else {
            return Ok(());
        };
        let mib = |b: u64| b as f64 / 1024.0 / 1024.0;
        writeln!(md, "## 6. Memory and disk\n")?;
        writeln!(
            md,
            "A fresh store filled with {} events (one append of a session's events per \
             session, 64 writers), then measured; then restarted (recovery) and measured again. \
             Single run.\n",
            fmt_num(f.events as f64),
        )?;
        writeln!(md, "| | |\n|---|---|")?;
        writeln!(
            md,
            "| the fill | {:.1} s = {} events/s; the store used {:.1} CPU s = {:.0} µs per event |",
            f.fill_secs,
            fmt_num(f.events as f64 / f.fill_secs),
            f.fill_cpu_secs,
            f.fill_cpu_secs * 1e6 / f.events as f64
        )?;
        writeln!(
            md,
            "| store RSS after the fill | {:.0} MiB (peak {:.0} MiB) |",
            mib(f.rss_bytes),
            mib(f.peak_rss_bytes)
        )?;
        writeln!(
            md,
            "| store RSS after a restart | {:.0} MiB |",
            mib(f.rss_after_restart_bytes)
        )?;
        writeln!(md, "| restart until serving | {:.2} s |", f.restart_secs)?;
        writeln!(
            md,
            "| log on disk | {:.1} MiB = {:.0} bytes per event (payload 300) |",
            mib(f.log_bytes),
            f.log_bytes as f64 / f.events as f64
        )?;
        writeln!(
            md,
            "| index (sled) and the rest on disk | {:.1} MiB = {:.0} bytes per event |",
            mib(f.index_bytes),
            f.index_bytes as f64 / f.events as f64
        )?;
        writeln!(
            md,
            "| total bytes on disk per event | {:.0} |",
            (f.log_bytes + f.index_bytes) as f64 / f.events as f64
        )?;
        writeln!(md)?;
        Ok(())
    }

    fn render_method(&self, md: &mut String) -> std::fmt::Result {
        writeln!(md, "## How each system is driven\n")?;
        writeln!(
            md,
            "- **agentlog**: the real `event-store` release binary, `Append` of one event per \
             request over tonic, one HTTP/2 connection per client; *AppendStream*: the same \
             appends, each sent once the previous one is answered, on one `AppendStream` call \
             per client. The ceiling is the same binary built with `--features unsafe-skip-fsync` into its own target dir \
             (`LogWriter::sync` does nothing), started beside it and driven both ways, unary and \
             `AppendStream`; the ceiling goal compares the best durable path with the best \
             fsync-skipped one, both in this run. The gRPC floor (`agentlog-bench-floor`) is \
             tonic serving the same generated `EventStore` server, `TCP_NODELAY` as the store, \
             answering each `Append` or `AppendStream` request at once from memory (no layers, \
             no validation, nothing stored), driven by the same clients.\n\
             - **naive**: one process appends a JSON line to a file and calls `fsync` per event \
             (what most agent harnesses do).\n\
             - **PostgreSQL 15**: a private cluster (initdb in the bench dir, 127.0.0.1, \
             `fsync=on`, `synchronous_commit=on`, `full_page_writes=on`, shared_buffers 256MB), \
             one autocommit `INSERT` per event into `events(session, seq, body)` with primary key \
             `(session, seq)`, tokio-postgres, one connection per client.\n\
             - **Redis**: Debian's `redis-server` with `appendonly yes`, `appendfsync always`, \
             no RDB snapshots; `XADD` per event, `XREAD` to catch up and `XREAD BLOCK` to follow; \
             redis-rs, one connection per client.\n\
             - **etcd**: Debian's `etcd-server`, one node, WAL fdatasync'd per commit; `Put` per \
             event (key `s/<session>/<seq>`), `Range` pages to catch up, `Watch` from a revision \
             to follow; etcd's own gRPC API through tonic (messages declared by hand in \
             bench/src/baselines/etcd.rs), one connection per client.\n\
             - Clients are written in Rust in the bench crate, all in one process on the same 2 \
             cores as the servers; every server listens on 127.0.0.1 only and keeps its data \
             under the data dir above. Baselines run one session (stream, key prefix) per client; \
             only agentlog is also measured with all clients on one session.\n\
             - NATS JetStream is not measured: Debian's nats-server 2.9 has no per-write fsync, \
             so it would not be a durable baseline.\n"
        )?;
        Ok(())
    }
}

/// "100,000" for a count.
fn fmt_int(n: usize) -> String {
    if n < 100 {
        n.to_string()
    } else {
        fmt_num(n as f64)
    }
}

/// The CPU goal's floors beside the store's CPU an append (`ours`, µs) and Redis's: the
/// gRPC floor (the transport alone) and the durable floor (the transport and a
/// group-committed fdatasync: the least any store that acknowledges after an fsync costs
/// over it), each as a multiple of Redis's, and what the store costs over each.
fn floors(ours: f64, redis: f64, floor: Option<f64>, durable: Option<f64>) -> String {
    let mut out = String::new();
    if let Some(f) = floor {
        out += &format!(
            "; the gRPC floor (appends answered from memory) {f:.1} µs = {} Redis's, the store \
             {:.1} µs over it",
            fmt_ratio(f / redis),
            ours - f
        );
    }
    if let Some(d) = durable {
        out += &beside_durable_floor(&format!("{d:.1} µs"), d / redis, ours / d);
    }
    out
}

/// The Redis goal row's addition: the durable floor's appends/s (`floor`) as a multiple of
/// Redis's and the store's (`ours`) as a multiple of it, empty unless the run measured all
/// three. The floor is how far a store that acknowledges after a group-committed fdatasync
/// and does nothing else gets over the contract's transport on this machine: where it is
/// below Redis, no store over this transport meets that goal here.
fn durable_floor_rate(ours: Option<f64>, redis: Option<f64>, floor: Option<f64>) -> String {
    match (ours, redis, floor) {
        (Some(o), Some(r), Some(f)) => {
            beside_durable_floor(&format!("{} appends/s", fmt_num(f)), f / r, o / f)
        }
        _ => String::new(),
    }
}

/// The durable floor's `figure` in a goal row, as a multiple of Redis's and with the
/// store's as a multiple of it.
fn beside_durable_floor(figure: &str, of_redis: f64, store_of_it: f64) -> String {
    format!(
        "; the durable floor (appends written and fdatasync'd in groups, nothing else) {figure} \
         = {} Redis's, the store {} of it",
        fmt_ratio(of_redis),
        fmt_ratio(store_of_it)
    )
}

/// A goal row's "measured" and "met?" cells for `ours` against `theirs` (rates in `unit`):
/// met when ours is at least `goal` times theirs.
fn rate_goal(ours: Option<f64>, theirs: Option<f64>, unit: &str, goal: f64) -> (String, String) {
    match (ours, theirs) {
        (Some(o), Some(t)) => (
            format!(
                "{} vs {} {unit} = **{}**",
                fmt_num(o),
                fmt_num(t),
                fmt_ratio(o / t)
            ),
            met(o / t >= goal),
        ),
        _ => ("not measured".into(), "–".into()),
    }
}

fn met(ok: bool) -> String {
    if ok { "**met**" } else { "**not met**" }.into()
}

/// Milliseconds with three significant decimals where small.
fn cell_ms(runs: &Runs) -> String {
    if runs.is_empty() {
        return "–".into();
    }
    let f = |v: f64| {
        if v.abs() < 10.0 {
            format!("{v:.3}")
        } else {
            fmt_num(v)
        }
    };
    if runs.0.len() == 1 {
        return f(runs.median());
    }
    format!("{} ({}–{})", f(runs.median()), f(runs.min()), f(runs.max()))
}

/// The sections of a previous bench/RESULTS.md that `bench/run` does not write (their
/// headings say "hand-run"), in their order: kept after a new report, so that a full run
/// does not erase the figures of the hand-run benches.
pub fn hand_run_sections(previous: &str) -> String {
    let mut kept = String::new();
    let mut keeping = false;
    for line in previous.split_inclusive('\n') {
        if line.starts_with("## ") {
            keeping = line.contains("(hand-run");
        }
        if keeping {
            kept.push_str(line);
        }
    }
    kept
}

#[cfg(test)]
mod tests {
    use super::{durable_floor_rate, hand_run_sections};

    #[test]
    fn only_the_hand_run_sections_are_kept_whole_and_in_order() {
        let previous = "# results\n\n## Machine and run\n\nfigures\n\n\
            ## Replay (hand-run; `x`)\n\nkept 1\n### sub\n\nkept 2\n\n\
            ## How each system is driven\n\ngone\n\n\
            ## Search (hand-run; `y`)\n\nkept 3\n";
        assert_eq!(
            hand_run_sections(previous),
            "## Replay (hand-run; `x`)\n\nkept 1\n### sub\n\nkept 2\n\n\
             ## Search (hand-run; `y`)\n\nkept 3\n"
        );
        assert_eq!(hand_run_sections("# results\n\n## 1. Limits\n"), "");
    }

    #[test]
    fn the_redis_goal_names_the_durable_floor_beside_it_when_the_run_has_one() {
        assert_eq!(
            durable_floor_rate(Some(44_000.0), Some(57_000.0), Some(55_000.0)),
            "; the durable floor (appends written and fdatasync'd in groups, nothing else) \
             55,000 appends/s = 0.96× Redis's, the store 0.80× of it"
        );
        assert_eq!(durable_floor_rate(Some(44_000.0), Some(57_000.0), None), "");
    }
}
