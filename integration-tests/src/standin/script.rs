//! Which fault a stand-in serves to a call: scripted per model (as the request's `model`
//! field names it) and per call of that model, and, beneath that, queued per turn.
//!
//! Every request that names a model takes that model's next call index, counted from 0
//! across all sessions (a request the stand-in refuses as malformed takes one too). A call
//! gets, in this order: the fault scripted for its exact index; else the model's standing
//! fault ([`FaultPlan::Always`], or [`FaultPlan::Until`] while its time has not come); else
//! the next fault queued for its turn; else its reply. Only the fault served is used up.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use serde::Deserialize;

use super::now_ms;

/// How a model fails, as [`Standin::fail_model`](super::Standin::fail_model) scripts it.
#[derive(Debug, Clone)]
pub enum FaultPlan<F> {
    /// Every call, until [`Standin::clear_model`](super::Standin::clear_model).
    Always(F),
    /// The model's next calls, one fault each in order; the calls after them are healthy.
    Calls(Vec<F>),
    /// The call with this index (counted from 0 for the model, across all sessions).
    Call(usize, F),
    /// Every call received before the instant; the model is healthy from then on.
    Until(Instant, F),
}

/// One model's script.
#[derive(Debug, Clone)]
pub struct ModelScript<F> {
    /// Faults for single calls, by call index.
    pub by_call: BTreeMap<usize, F>,
    /// A fault for every call, until the instant when one is given.
    pub standing: Option<(F, Option<Instant>)>,
}

impl<F> Default for ModelScript<F> {
    fn default() -> Self {
        ModelScript {
            by_call: BTreeMap::new(),
            standing: None,
        }
    }
}

/// Every model's script, the calls each has had, and the faults queued per turn.
#[derive(Debug)]
pub struct FaultScript<F> {
    pub models: HashMap<String, ModelScript<F>>,
    /// Calls received per model: the next call's index.
    pub calls: HashMap<String, usize>,
    pub by_turn: HashMap<usize, VecDeque<F>>,
}

impl<F> Default for FaultScript<F> {
    fn default() -> Self {
        FaultScript {
            models: HashMap::new(),
            calls: HashMap::new(),
            by_turn: HashMap::new(),
        }
    }
}

impl<F> FaultScript<F> {
    /// Adds `plan` to `model`'s script: `Always` and `Until` replace its standing fault;
    /// `Calls` and `Call` set faults for single calls (the next ones, or the one named).
    pub fn fail_model(&mut self, model: &str, plan: FaultPlan<F>) {
        let next = self.calls.get(model).copied().unwrap_or(0);
        let script = self.models.entry(model.to_string()).or_default();
        match plan {
            FaultPlan::Always(fault) => script.standing = Some((fault, None)),
            FaultPlan::Until(until, fault) => script.standing = Some((fault, Some(until))),
            FaultPlan::Call(index, fault) => {
                script.by_call.insert(index, fault);
            }
            FaultPlan::Calls(faults) => {
                script
                    .by_call
                    .extend(faults.into_iter().enumerate().map(|(i, f)| (next + i, f)));
            }
        }
    }

    /// Forgets `model`'s script (its calls keep counting).
    pub fn clear_model(&mut self, model: &str) {
        self.models.remove(model);
    }

    /// Queues `fault` for the next request for `turn`.
    pub fn inject(&mut self, turn: usize, fault: F) {
        self.by_turn.entry(turn).or_default().push_back(fault);
    }

    /// Counts a call of `model`; returns its index.
    pub fn take_call(&mut self, model: &str) -> usize {
        let calls = self.calls.entry(model.to_string()).or_default();
        *calls += 1;
        *calls - 1
    }
}

impl<F: Clone> FaultScript<F> {
    /// The fault for call `call` of `model`, asking for `turn`, received `at`.
    pub fn fault_for(&mut self, model: &str, call: usize, turn: usize, at: Instant) -> Option<F> {
        if let Some(script) = self.models.get_mut(model) {
            if let Some(fault) = script.by_call.remove(&call) {
                return Some(fault);
            }
            match &script.standing {
                Some((fault, until)) if until.is_none_or(|until| at < until) => {
                    return Some(fault.clone())
                }
                Some(_) => script.standing = None,
                None => {}
            }
        }
        self.by_turn.get_mut(&turn).and_then(VecDeque::pop_front)
    }
}

/// A plan in JSON, as the `model-standin` program takes it (`--faults`, `POST
/// /control/fail`): `{"model", "fault"}` fails every call; with `"calls": N` the next N
/// calls; with `"call": I` call I; with `"for_ms"` or `"until_unix_ms"` the calls until
/// then; `{"model", "faults": [...]}` the next calls, one fault each.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PlanRequest<F> {
    pub model: String,
    pub fault: Option<F>,
    pub faults: Option<Vec<F>>,
    #[serde(default)]
    pub calls: Option<usize>,
    #[serde(default)]
    pub call: Option<usize>,
    #[serde(default)]
    pub for_ms: Option<u64>,
    #[serde(default)]
    pub until_unix_ms: Option<i64>,
}

impl<F: Clone> PlanRequest<F> {
    /// The model and its plan; says what to fix when the fields do not make exactly one.
    pub fn plan(self) -> Result<(String, FaultPlan<F>), String> {
        let PlanRequest {
            model,
            fault,
            faults,
            calls,
            call,
            for_ms,
            until_unix_ms,
        } = self;
        if model.is_empty() {
            return Err("\"model\" must name the model to fail".into());
        }
        let plan =
            match (fault, faults) {
                (None, Some(faults))
                    if (calls, call, for_ms, until_unix_ms) == (None, None, None, None) =>
                {
                    FaultPlan::Calls(faults)
                }
                (Some(fault), None) => match (calls, call, for_ms, until_unix_ms) {
                    (None, None, None, None) => FaultPlan::Always(fault),
                    (Some(n), None, None, None) => FaultPlan::Calls(vec![fault; n]),
                    (None, Some(index), None, None) => FaultPlan::Call(index, fault),
                    (None, None, Some(ms), None) => {
                        FaultPlan::Until(Instant::now() + Duration::from_millis(ms), fault)
                    }
                    (None, None, None, Some(unix_ms)) => {
                        let left = Duration::from_millis((unix_ms - now_ms()).max(0) as u64);
                        FaultPlan::Until(Instant::now() + left, fault)
                    }
                    _ => return Err(
                        "give at most one of \"calls\", \"call\", \"for_ms\" and \"until_unix_ms\""
                            .into(),
                    ),
                },
                _ => return Err(
                    "give either \"fault\" (with at most one of \"calls\", \"call\", \"for_ms\", \
                     \"until_unix_ms\") or \"faults\" (a list, alone)"
                        .into(),
                ),
            };
        Ok((model, plan))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn serve(
        script: &mut FaultScript<&'static str>,
        model: &str,
        turn: usize,
    ) -> Option<&'static str> {
        let call = script.take_call(model);
        script.fault_for(model, call, turn, Instant::now())
    }

    #[test]
    fn calls_are_counted_per_model_and_scripted_by_index() {
        let mut script = FaultScript::default();
        script.fail_model("a", FaultPlan::Calls(vec!["x", "y"]));
        script.fail_model("a", FaultPlan::Call(3, "z"));
        let a: Vec<_> = (0..5).map(|_| serve(&mut script, "a", 0)).collect();
        assert_eq!(a, [Some("x"), Some("y"), None, Some("z"), None]);
        assert_eq!(serve(&mut script, "b", 0), None, "another model is healthy");
        // `Calls` counts from the model's next call, not from 0.
        script.fail_model("a", FaultPlan::Calls(vec!["w"]));
        assert_eq!(serve(&mut script, "a", 0), Some("w"));
        assert_eq!(script.calls["a"], 6);
    }

    #[test]
    fn a_call_fault_comes_first_then_the_standing_one_then_the_turn_queue() {
        let mut script = FaultScript::default();
        script.inject(0, "turn");
        script.fail_model("a", FaultPlan::Always("always"));
        script.fail_model("a", FaultPlan::Call(1, "call"));
        assert_eq!(serve(&mut script, "a", 0), Some("always"));
        assert_eq!(serve(&mut script, "a", 0), Some("call"));
        assert_eq!(serve(&mut script, "a", 0), Some("always"));
        script.clear_model("a");
        assert_eq!(
            serve(&mut script, "a", 0),
            Some("turn"),
            "not used up before"
        );
        assert_eq!(serve(&mut script, "a", 0), None);
    }

    #[test]
    fn an_until_plan_ends_at_its_instant() {
        let mut script = FaultScript::default();
        let start = Instant::now();
        script.fail_model(
            "a",
            FaultPlan::Until(start + Duration::from_secs(10), "down"),
        );
        assert_eq!(script.fault_for("a", 0, 0, start), Some("down"));
        assert_eq!(
            script.fault_for("a", 1, 0, start + Duration::from_secs(10)),
            None
        );
        assert!(script.models["a"].standing.is_none());
    }

    #[test]
    fn a_plan_request_makes_exactly_one_plan() {
        let parse = |text: &str| {
            serde_json::from_str::<PlanRequest<String>>(text)
                .map_err(|e| e.to_string())
                .and_then(PlanRequest::plan)
        };
        assert!(matches!(
            parse(r#"{"model": "m", "fault": "f"}"#),
            Ok((m, FaultPlan::Always(f))) if m == "m" && f == "f"
        ));
        assert!(matches!(
            parse(r#"{"model": "m", "fault": "f", "calls": 2}"#),
            Ok((_, FaultPlan::Calls(f))) if f.len() == 2
        ));
        assert!(matches!(
            parse(r#"{"model": "m", "faults": ["f", "g"]}"#),
            Ok((_, FaultPlan::Calls(f))) if f == ["f", "g"]
        ));
        assert!(matches!(
            parse(r#"{"model": "m", "fault": "f", "call": 4}"#),
            Ok((_, FaultPlan::Call(4, _)))
        ));
        assert!(matches!(
            parse(r#"{"model": "m", "fault": "f", "for_ms": 1000}"#),
            Ok((_, FaultPlan::Until(..)))
        ));
        assert!(parse(r#"{"model": "m", "fault": "f", "calls": 2, "for_ms": 5}"#).is_err());
        assert!(parse(r#"{"model": "m"}"#).is_err());
        assert!(parse(r#"{"model": "", "fault": "f"}"#).is_err());
        assert!(parse(r#"{"model": "m", "fault": "f", "later": 1}"#).is_err());
    }
}
