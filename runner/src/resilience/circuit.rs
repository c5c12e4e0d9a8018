//! A circuit per model, in each runner: a model whose calls failed `--circuit-failures`
//! times in a row, across all of the runner's sessions, is left alone for a cool-down (30 s,
//! doubling up to 5 min while its probes fail). Once a cool-down has passed, one call probes
//! it; until a probe succeeds, the sessions with a fallback go straight to the fallback and
//! the others wait for the probe's time (`model_retry` with reason `circuit_open`). A
//! dead model so receives a bounded number of calls however many sessions need it.
//!
//! This is the runner's own state, not the log's: a runner that starts knows no model as
//! failing. Times are the caller's (unix ms), so the rules are tested without a clock.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

/// The first cool-down of a circuit that opens.
pub const FIRST_COOL_DOWN: Duration = Duration::from_secs(30);
/// The longest cool-down, however many probes failed.
pub const MAX_COOL_DOWN: Duration = Duration::from_secs(300);
/// How long a probe may be out before another call may probe again (its session was
/// stopped, or its call hangs until the idle timeout).
const PROBE_PATIENCE: Duration = Duration::from_secs(150);

/// Every model's circuit.
#[derive(Debug)]
pub struct Circuits {
    failures_to_open: u32,
    models: Mutex<HashMap<String, Circuit>>,
}

#[derive(Debug, Clone, Default)]
struct Circuit {
    /// Failed calls in a row.
    failures: u32,
    open: Option<Open>,
}

#[derive(Debug, Clone)]
struct Open {
    /// When the next probe may be made.
    probe_at: i64,
    cool_down: Duration,
    /// A probe is out since then.
    probing_since: Option<i64>,
}

/// Whether a call of a model may be made now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admission {
    /// Closed: call.
    Call,
    /// Open and its cool-down passed: this call is the probe (tell the outcome).
    Probe,
    /// Open: no call before this time (unix ms).
    Wait { until: i64 },
}

impl Circuits {
    pub fn new(failures_to_open: u32) -> Circuits {
        Circuits {
            failures_to_open: failures_to_open.max(1),
            models: Mutex::new(HashMap::new()),
        }
    }

    /// Whether `model` may be called now, without taking the probe (for a plan).
    pub fn peek(&self, model: &str, now: i64) -> Admission {
        let models = self.models.lock().unwrap_or_else(|p| p.into_inner());
        admission(models.get(model), now)
    }

    /// Whether `model` may be called now; a probe is taken by this call.
    pub fn admit(&self, model: &str, now: i64) -> Admission {
        let mut models = self.models.lock().unwrap_or_else(|p| p.into_inner());
        let circuit = models.entry(model.to_string()).or_default();
        let admitted = admission(Some(circuit), now);
        if admitted == Admission::Probe {
            if let Some(open) = &mut circuit.open {
                open.probing_since = Some(now);
            }
        }
        admitted
    }

    /// A call of `model` answered: its circuit closes.
    pub fn succeeded(&self, model: &str) {
        let mut models = self.models.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(circuit) = models.get_mut(model) {
            if circuit.open.is_some() {
                tracing::info!(model, "the model answered its probe: its circuit closes");
                crate::metrics::circuit(model, false);
            }
            *circuit = Circuit::default();
        }
    }

    /// A call of `model` failed at `now`: one more in a row; the circuit opens at
    /// `--circuit-failures`, and a failed probe opens it again for twice as long.
    pub fn failed(&self, model: &str, now: i64) {
        let mut models = self.models.lock().unwrap_or_else(|p| p.into_inner());
        let circuit = models.entry(model.to_string()).or_default();
        circuit.failures = circuit.failures.saturating_add(1);
        let cool_down = match &circuit.open {
            Some(open) if open.probing_since.is_some() => (open.cool_down * 2).min(MAX_COOL_DOWN),
            // Calls made before it opened fail later: they change nothing.
            Some(_) => return,
            None if circuit.failures >= self.failures_to_open => FIRST_COOL_DOWN,
            None => return,
        };
        tracing::warn!(
            model,
            failures = circuit.failures,
            cool_down_s = cool_down.as_secs(),
            "the model keeps failing: its circuit is open"
        );
        crate::metrics::circuit(model, true);
        circuit.open = Some(Open {
            probe_at: now.saturating_add(cool_down.as_millis() as i64),
            cool_down,
            probing_since: None,
        });
    }

    /// A probe of `model` ended without an outcome (its session stopped): another call may
    /// probe.
    pub fn abandoned(&self, model: &str) {
        let mut models = self.models.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(open) = models.get_mut(model).and_then(|c| c.open.as_mut()) {
            open.probing_since = None;
        }
    }
}

fn admission(circuit: Option<&Circuit>, now: i64) -> Admission {
    let Some(open) = circuit.and_then(|c| c.open.as_ref()) else {
        return Admission::Call;
    };
    let probe_out = open
        .probing_since
        .is_some_and(|since| now < since.saturating_add(PROBE_PATIENCE.as_millis() as i64));
    if now < open.probe_at {
        Admission::Wait {
            until: open.probe_at,
        }
    } else if probe_out {
        // Another session's probe is out: look again a little later.
        Admission::Wait {
            until: now.saturating_add(1_000),
        }
    } else {
        Admission::Probe
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const S: i64 = 1_000;

    #[test]
    fn a_model_failing_in_a_row_is_left_alone_and_probed_once_per_cool_down() {
        let circuits = Circuits::new(3);
        for _ in 0..2 {
            circuits.failed("m", 0);
        }
        assert_eq!(circuits.admit("m", 0), Admission::Call, "two in a row");
        circuits.failed("m", 0);
        assert_eq!(circuits.admit("m", 0), Admission::Wait { until: 30 * S });
        assert_eq!(circuits.peek("other", 0), Admission::Call, "per model");
        // The cool-down passed: one call probes, the others wait for it.
        assert_eq!(circuits.peek("m", 30 * S), Admission::Probe);
        assert_eq!(circuits.admit("m", 30 * S), Admission::Probe);
        assert_eq!(
            circuits.admit("m", 30 * S),
            Admission::Wait { until: 31 * S }
        );
        // The probe failed: twice as long.
        circuits.failed("m", 31 * S);
        assert_eq!(
            circuits.admit("m", 31 * S),
            Admission::Wait { until: 91 * S }
        );
        assert_eq!(circuits.admit("m", 91 * S), Admission::Probe);
        circuits.succeeded("m");
        assert_eq!(circuits.admit("m", 91 * S), Admission::Call);
        // A success resets the count.
        circuits.failed("m", 92 * S);
        circuits.succeeded("m");
        circuits.failed("m", 93 * S);
        circuits.failed("m", 94 * S);
        assert_eq!(circuits.admit("m", 94 * S), Admission::Call);
    }

    #[test]
    fn the_cool_down_doubles_up_to_five_minutes_and_an_abandoned_probe_frees_the_next() {
        let circuits = Circuits::new(1);
        circuits.failed("m", 0);
        let mut now = 0;
        let mut cool_down = FIRST_COOL_DOWN;
        for _ in 0..6 {
            now += cool_down.as_millis() as i64;
            assert_eq!(circuits.admit("m", now), Admission::Probe);
            circuits.failed("m", now);
            cool_down = (cool_down * 2).min(MAX_COOL_DOWN);
            assert_eq!(
                circuits.peek("m", now),
                Admission::Wait {
                    until: now + cool_down.as_millis() as i64
                }
            );
        }
        assert_eq!(cool_down, MAX_COOL_DOWN);
        now += cool_down.as_millis() as i64;
        assert_eq!(circuits.admit("m", now), Admission::Probe);
        circuits.abandoned("m");
        assert_eq!(circuits.admit("m", now), Admission::Probe);
    }
}
