//! The same-run A/B of the write path (`bash bench/run --against REV`): the store built
//! from this tree (the candidate) against another build of it (the base, e.g. REV's), both
//! started fresh side by side on the same disk and loaded in turns.
//!
//! One machine's append rates swing by a third from one run to the next, so a ratio of two
//! medians measured minutes apart says little. Here each round measures every load point on
//! both builds back to back (the base first in even rounds, the candidate first in odd
//! ones, so a drift along the run falls on both alike), and the figure is the round's
//! ratio candidate ÷ base: two loads seconds apart. The report gives the median of the
//! rounds' ratios with an interval that holds it whatever the distribution (two order
//! statistics of the ratios, with their coverage), the rounds the candidate was ahead in,
//! each build's own median and range, and its store CPU per append. After each load the
//! store is left to settle (its CPU back near zero) before the next one starts: work a load
//! defers, such as indexing what it appended, is counted as its own and never runs in the
//! other build's turn.

use std::path::Path;
use std::time::Duration;

use testkit::Store;

use crate::appenders::{AgentlogAppender, AgentlogStreamAppender};
use crate::load::{closed_loop, Window};
use crate::profile;
use crate::stats::{cell, fmt_ratio, Runs};
use crate::Target;

/// The load points of an A/B: the 64-client goal on both paths, and one client.
pub const POINTS: [(Target, usize); 4] = [
    (Target::AgentlogStream, 64),
    (Target::Agentlog, 64),
    (Target::AgentlogStream, 1),
    (Target::Agentlog, 1),
];

/// One load point of both builds, one value per round.
#[derive(Debug, Clone)]
pub struct AbPoint {
    pub target: Target,
    pub clients: usize,
    pub candidate: Runs,
    pub base: Runs,
    /// candidate ÷ base, round by round.
    pub ratios: Runs,
    /// Store CPU µs per acknowledged append, round by round.
    pub candidate_cpu_us: Runs,
    pub base_cpu_us: Runs,
}

/// A `perf record` of each build under the same load (CPU by thread, and the hottest
/// symbols), when asked for.
#[derive(Debug, Clone)]
pub struct AbProfile {
    pub clients: usize,
    pub candidate: profile::Views,
    pub base: profile::Views,
}

#[derive(Debug, Clone)]
pub struct AbResult {
    pub base_label: String,
    pub rounds: usize,
    pub window: Window,
    pub points: Vec<AbPoint>,
    pub profile: Option<AbProfile>,
}

impl AbResult {
    pub fn render(&self, md: &mut String) -> std::fmt::Result {
        use std::fmt::Write;
        writeln!(
            md,
            "## Write path: this build against {}\n",
            self.base_label
        )?;
        writeln!(
            md,
            "{} rounds; each measures every point on both builds back to back ({:.1} s after \
             {:.1} s of warm-up, the base first in even rounds), so a round's ratio compares two \
             loads seconds apart. SYNC appends of one 300-byte event, each sent once the \
             previous one is acknowledged, one session per client. \"interval\": two order \
             statistics of the rounds' ratios that hold their median with the probability \
             given, whatever their distribution. Store CPU per append counts until the store is \
             idle again after the load (what it deferred, such as indexing, included).\n",
            self.rounds,
            self.window.measure.as_secs_f64(),
            self.window.warmup.as_secs_f64(),
        )?;
        writeln!(
            md,
            "| path | clients | this build, appends/s | base, appends/s | ratio, median of rounds | interval | ahead in | store CPU µs/append, this ÷ base |\n|---|---|---|---|---|---|---|---|"
        )?;
        for p in &self.points {
            let path = if p.target == Target::AgentlogStream {
                "AppendStream"
            } else {
                "unary Append"
            };
            let interval = match median_interval(&p.ratios.0) {
                Some((lo, hi, coverage)) => format!(
                    "{}–{} ({:.0}%)",
                    fmt_ratio(lo),
                    fmt_ratio(hi),
                    coverage * 100.0
                ),
                None => "–".into(),
            };
            let ahead = p.ratios.0.iter().filter(|&&r| r > 1.0).count();
            writeln!(
                md,
                "| {path} | {} | {} | {} | **{}** | {interval} | {ahead} of {} | {:.1} ÷ {:.1} = {} |",
                p.clients,
                cell(&p.candidate),
                cell(&p.base),
                fmt_ratio(p.ratios.median()),
                p.ratios.0.len(),
                p.candidate_cpu_us.median(),
                p.base_cpu_us.median(),
                fmt_ratio(p.candidate_cpu_us.median() / p.base_cpu_us.median()),
            )?;
        }
        writeln!(md)?;
        if let Some(profile) = &self.profile {
            writeln!(
                md,
                "`perf record -e cpu-clock -a`, the samples of each store under {} clients on AppendStream, \
                 one after the other:\n",
                profile.clients
            )?;
            for (name, (threads, symbols, writer)) in [
                ("This build", &profile.candidate),
                ("The base", &profile.base),
            ] {
                writeln!(md, "{name}, CPU by thread:\n\n```\n{threads}\n```\n")?;
                writeln!(
                    md,
                    "{name}, hottest symbols (self time):\n\n```\n{symbols}\n```\n"
                )?;
                writeln!(
                    md,
                    "{name}, the `log-writer` thread by symbol (self time, relative to the \
                     thread):\n\n```\n{writer}\n```\n"
                )?;
            }
        }
        Ok(())
    }
}

/// Which build a measurement is of.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Build {
    Candidate,
    Base,
}

/// Runs `rounds` rounds of every point of [`POINTS`] on both stores, and with `perf_dir`
/// a profile of each under 64 clients on `AppendStream` at the end.
pub async fn run(
    candidate: &Store,
    base: &Store,
    base_label: &str,
    rounds: usize,
    window: Window,
    perf_dir: Option<&Path>,
) -> anyhow::Result<AbResult> {
    let mut points: Vec<AbPoint> = POINTS
        .iter()
        .map(|&(target, clients)| AbPoint {
            target,
            clients,
            candidate: Runs::default(),
            base: Runs::default(),
            ratios: Runs::default(),
            candidate_cpu_us: Runs::default(),
            base_cpu_us: Runs::default(),
        })
        .collect();
    for round in 0..rounds {
        crate::progress(&format!("A/B round {} of {rounds}", round + 1));
        let order = if round % 2 == 0 {
            [Build::Base, Build::Candidate]
        } else {
            [Build::Candidate, Build::Base]
        };
        for point in points.iter_mut() {
            let mut rates = [0.0; 2];
            for build in order {
                let store = if build == Build::Candidate {
                    candidate
                } else {
                    base
                };
                let session = format!("ab-{round}-{}", point.clients);
                let (rate, cpu_us) =
                    load(store, point.target, point.clients, &session, window).await?;
                let i = usize::from(build == Build::Base);
                rates[i] = rate;
                if build == Build::Candidate {
                    point.candidate.push(rate);
                    point.candidate_cpu_us.push(cpu_us);
                } else {
                    point.base.push(rate);
                    point.base_cpu_us.push(cpu_us);
                }
            }
            point.ratios.push(rates[0] / rates[1]);
        }
    }
    let profile = match perf_dir {
        Some(dir) if profile::perf_available() => {
            let clients = 64;
            let window = Window {
                warmup: window.warmup,
                measure: window.measure.max(Duration::from_secs(3)),
            };
            let mut recorded = Vec::new();
            for (store, name) in [(candidate, "candidate"), (base, "base")] {
                crate::progress(&format!("A/B profile: {name}"));
                let appenders =
                    stream_appenders(store, clients, &format!("ab-perf-{name}")).await?;
                let load = tokio::spawn(closed_loop(appenders, window));
                tokio::time::sleep(window.warmup).await;
                let recording = profile::Recording::start(
                    store.pid(),
                    &dir.join(format!("ab-{name}.perf.data")),
                    window.measure.as_secs_f64(),
                )?;
                load.await??;
                let views = tokio::task::block_in_place(|| recording.finish())
                    .unwrap_or_else(|e| profile::unrecorded(&e));
                recorded.push(views);
            }
            let base = recorded.pop().expect("two recordings");
            let candidate = recorded.pop().expect("two recordings");
            Some(AbProfile {
                clients,
                candidate,
                base,
            })
        }
        _ => None,
    };
    Ok(AbResult {
        base_label: base_label.to_string(),
        rounds,
        window,
        points,
        profile,
    })
}

/// One closed-loop load of `clients` clients on `target`'s path: acknowledged appends per
/// second, and the store's CPU µs per append over the whole load and until the store has
/// settled (work an append defers, such as indexing it, is the append's cost).
async fn load(
    store: &Store,
    target: Target,
    clients: usize,
    session: &str,
    window: Window,
) -> anyhow::Result<(f64, f64)> {
    // What the load left the store to do falls in this turn, not the other build's.
    let load = async {
        if target == Target::AgentlogStream {
            closed_loop(stream_appenders(store, clients, session).await?, window).await
        } else {
            let mut appenders = Vec::with_capacity(clients);
            for c in 0..clients {
                appenders.push(
                    AgentlogAppender::connect(&store.url(), format!("{session}-u{c}")).await?,
                );
            }
            closed_loop(appenders, window).await
        }
    };
    let (result, us) = profile::cpu_per_append(|| profile::cpu_secs(store.pid()), load).await?;
    Ok((result.rate, us))
}

async fn stream_appenders(
    store: &Store,
    clients: usize,
    session: &str,
) -> anyhow::Result<Vec<AgentlogStreamAppender>> {
    let mut appenders = Vec::with_capacity(clients);
    for c in 0..clients {
        appenders
            .push(AgentlogStreamAppender::connect(&store.url(), format!("{session}-s{c}")).await?);
    }
    Ok(appenders)
}

/// The narrowest interval between two order statistics of `values` that holds their true
/// median with a probability of at least 0.9 (with too few values, the widest one): (the
/// k-th smallest, the k-th largest, that probability). Distribution-free: how many values
/// fall below the median is Binomial(n, ½).
pub fn median_interval(values: &[f64]) -> Option<(f64, f64, f64)> {
    let n = values.len();
    if n < 2 {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(|a, b| a.total_cmp(b));
    // P(Binomial(n, ½) < k), for k = 1, 2, …
    let below = |k: usize| -> f64 {
        let mut choose = 1.0;
        let mut sum = 0.0;
        for i in 0..k {
            if i > 0 {
                choose = choose * (n - i + 1) as f64 / i as f64;
            }
            sum += choose;
        }
        sum / 2f64.powi(n as i32)
    };
    let mut k = 1;
    while k < n / 2 && 1.0 - 2.0 * below(k + 1) >= 0.9 {
        k += 1;
    }
    Some((sorted[k - 1], sorted[n - k], 1.0 - 2.0 * below(k)))
}

#[cfg(test)]
mod tests {
    use super::median_interval;

    #[test]
    fn the_interval_narrows_as_rounds_grow_and_keeps_its_coverage() {
        let nine: Vec<f64> = (1..=9).map(f64::from).collect();
        let (lo, hi, coverage) = median_interval(&nine).unwrap();
        // k = 2: 1 − 2·(1 + 9)/512.
        assert_eq!((lo, hi), (2.0, 8.0));
        assert!((coverage - 0.9609).abs() < 1e-3, "{coverage}");
        let three = [3.0, 1.0, 2.0];
        let (lo, hi, coverage) = median_interval(&three).unwrap();
        assert_eq!((lo, hi), (1.0, 3.0));
        assert!((coverage - 0.75).abs() < 1e-9);
        assert!(median_interval(&[1.0]).is_none());
    }
}
