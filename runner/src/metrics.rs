//! The runner's Prometheus metrics and the spans of a turn: model calls, tool runs, leases.
//!
//! Promise: every label value comes from a fixed, small set (a provider, a model this
//! runner was given with `--model` or `--fallback-model`, a tool name the toolbox knows, an
//! outcome, a reason); no session id, tool input or model text ever becomes a label. Each hook in the loop is one line; the observers here time the work, count its
//! outcome (a dropped observer counts as `cancelled`: an interrupt or a lost lease stopped
//! it) and carry the span it runs in. The metrics live for the process (statics), and
//! [`registry`] exposes them for `--metrics-listen`.

use std::sync::LazyLock;
use std::time::Instant;

use agentlog_proto::v1::Usage;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

use crate::tools::{Stopped, ToolOutput, Toolbox};

type Labels1 = [(&'static str, &'static str); 1];
type Labels2 = [(&'static str, &'static str); 2];
/// Labels that name a model (`PROVIDER:MODEL`, one the runner was given).
type ModelLabels = Vec<(&'static str, String)>;

struct RunnerMetrics {
    sessions_held: Gauge,
    model_calls: Family<Labels2, Counter>,
    model_seconds: Family<Labels1, Histogram>,
    first_token_seconds: Family<Labels1, Histogram>,
    tokens: Family<Labels2, Counter>,
    model_retries: Family<ModelLabels, Counter>,
    fallbacks: Family<ModelLabels, Counter>,
    circuits_open: Family<ModelLabels, Gauge>,
    sessions_parked: Counter,
    runs_paused: Family<Labels1, Counter>,
    tool_runs: Family<Labels2, Counter>,
    tool_seconds: Family<Labels1, Histogram>,
    interrupted_calls: Family<Labels1, Counter>,
    served_calls: Family<Labels1, Counter>,
    approval_requests: Counter,
    leases_lost: Counter,
    sessions_deleted: Counter,
    workspaces_removed: Counter,
    sweeps: Family<Labels1, Counter>,
}

fn seconds_histogram() -> Histogram {
    // 10 ms .. ~5.5 min: model replies and tool commands both span that range.
    Histogram::new(exponential_buckets(0.01, 2.0, 16))
}

static METRICS: LazyLock<RunnerMetrics> = LazyLock::new(|| RunnerMetrics {
    sessions_held: Gauge::default(),
    model_calls: Family::default(),
    model_seconds: Family::new_with_constructor(seconds_histogram),
    first_token_seconds: Family::new_with_constructor(seconds_histogram),
    tokens: Family::default(),
    model_retries: Family::default(),
    fallbacks: Family::default(),
    circuits_open: Family::default(),
    sessions_parked: Counter::default(),
    runs_paused: Family::default(),
    tool_runs: Family::default(),
    tool_seconds: Family::new_with_constructor(seconds_histogram),
    interrupted_calls: Family::default(),
    served_calls: Family::default(),
    approval_requests: Counter::default(),
    leases_lost: Counter::default(),
    sessions_deleted: Counter::default(),
    workspaces_removed: Counter::default(),
    sweeps: Family::default(),
});

/// Every runner metric; the usual series of each model's provider, of each model (`specs`,
/// `PROVIDER:MODEL`) and of every tool exist from the start (at 0), so rates and the
/// dashboard see them.
pub fn registry(providers: &[&'static str], specs: &[&str]) -> Registry {
    let m = &*METRICS;
    for &provider in providers {
        let _ = m
            .model_calls
            .get_or_create(&[("provider", provider), ("outcome", "ok")]);
        let _ = m.model_seconds.get_or_create(&[("provider", provider)]);
        let _ = m
            .first_token_seconds
            .get_or_create(&[("provider", provider)]);
        for direction in ["input", "output"] {
            let _ = m
                .tokens
                .get_or_create(&[("provider", provider), ("direction", direction)]);
        }
    }
    for spec in specs {
        let _ = m.circuits_open.get_or_create(&model_labels(spec));
        let _ = m
            .model_retries
            .get_or_create(&retry_labels(spec, "overloaded"));
    }
    // The usual fallbacks: from the default model to each other model the runner was given.
    if let Some((default, others)) = specs.split_first() {
        for to in others {
            let _ = m.fallbacks.get_or_create(&fallback_labels(default, to));
        }
    }
    for reason in ["budget", "gave_up"] {
        let _ = m.runs_paused.get_or_create(&[("reason", reason)]);
    }
    for tool in Toolbox::specs() {
        let _ = m
            .tool_runs
            .get_or_create(&[("tool", tool.name), ("outcome", "ok")]);
        let _ = m.tool_seconds.get_or_create(&[("tool", tool.name)]);
        let _ = m.served_calls.get_or_create(&[("tool", tool.name)]);
    }
    for action in ["rerun", "reported", "asked"] {
        let _ = m.interrupted_calls.get_or_create(&[("action", action)]);
    }
    for outcome in ["ok", "failed"] {
        let _ = m.sweeps.get_or_create(&[("outcome", outcome)]);
    }
    let mut r = Registry::default();
    r.register(
        "agentlog_runner_sessions_held",
        "Sessions this runner holds a lease on and works",
        m.sessions_held.clone(),
    );
    r.register(
        "agentlog_runner_model_calls",
        "Model call attempts by provider and outcome (ok, transient, refused, cancelled)",
        m.model_calls.clone(),
    );
    r.register(
        "agentlog_runner_model_call_duration_seconds",
        "Time of one model call attempt, request to complete reply",
        m.model_seconds.clone(),
    );
    r.register(
        "agentlog_runner_model_time_to_first_token_seconds",
        "Time from a model request to its first streamed text",
        m.first_token_seconds.clone(),
    );
    r.register(
        "agentlog_runner_model_tokens",
        "Tokens the provider reported, by direction (input or output)",
        m.tokens.clone(),
    );
    r.register(
        "agentlog_runner_model_retries",
        "Failed model calls to be tried again, by model and reason (overloaded, rate_limited, \
         server_error, timeout, stalled, cut, unreachable; circuit_open: no call was made)",
        m.model_retries.clone(),
    );
    r.register(
        "agentlog_runner_model_fallbacks",
        "Model calls a turn made on a fallback, by the session's model (from) and the one \
         called (to)",
        m.fallbacks.clone(),
    );
    r.register(
        "agentlog_runner_model_circuit_open",
        "1 while a model's circuit is open (it failed in a row: left alone, probed once per \
         cool-down), by model",
        m.circuits_open.clone(),
    );
    r.register(
        "agentlog_runner_sessions_parked",
        "Sessions let go until their next model call is due (a wait past --park-after)",
        m.sessions_parked.clone(),
    );
    r.register(
        "agentlog_runner_runs_paused",
        "Runs that paused themselves for a person, by reason (budget, gave_up)",
        m.runs_paused.clone(),
    );
    r.register(
        "agentlog_runner_tool_runs",
        "Tool runs by tool and outcome (ok, error, cancelled)",
        m.tool_runs.clone(),
    );
    r.register(
        "agentlog_runner_tool_duration_seconds",
        "Time of one tool run",
        m.tool_seconds.clone(),
    );
    r.register(
        "agentlog_runner_interrupted_calls",
        "Tool calls found started without a result, by what was done (rerun, reported, asked)",
        m.interrupted_calls.clone(),
    );
    r.register(
        "agentlog_runner_served_calls",
        "Tool calls of replays answered with their recorded result instead of running, by tool",
        m.served_calls.clone(),
    );
    r.register(
        "agentlog_runner_approval_requests",
        "Calls handed to a person (approval_requested appended; the session then waits, \
         holding no runner)",
        m.approval_requests.clone(),
    );
    r.register(
        "agentlog_runner_leases_lost",
        "Sessions dropped because the store fenced this runner off or the lease ran out",
        m.leases_lost.clone(),
    );
    r.register(
        "agentlog_runner_sessions_deleted",
        "Sessions whose work this runner stopped because they were deleted",
        m.sessions_deleted.clone(),
    );
    r.register(
        "agentlog_runner_workspaces_removed",
        "Workspaces of deleted sessions this runner removed",
        m.workspaces_removed.clone(),
    );
    r.register(
        "agentlog_runner_workspace_sweeps",
        "Sweeps for deleted sessions' workspaces and checkpoints, by outcome (ok, failed)",
        m.sweeps.clone(),
    );
    crate::tools::checkpoint::health::register(&mut r);
    r
}

/// Held while a claimed session is worked.
pub struct SessionHeld(());

impl SessionHeld {
    pub fn enter() -> SessionHeld {
        METRICS.sessions_held.inc();
        SessionHeld(())
    }
}

impl Drop for SessionHeld {
    fn drop(&mut self) {
        METRICS.sessions_held.dec();
    }
}

pub fn lease_lost() {
    METRICS.leases_lost.inc();
}

/// The store said a session this runner worked was deleted; its work stopped.
pub fn session_deleted() {
    METRICS.sessions_deleted.inc();
}

/// A deleted session's workspace was removed.
pub fn workspace_removed() {
    METRICS.workspaces_removed.inc();
}

/// A sweep for deleted sessions' workspaces ended; `outcome`: "ok" or "failed".
pub fn sweep(outcome: &'static str) {
    METRICS.sweeps.get_or_create(&[("outcome", outcome)]).inc();
}

/// A call found with `tool_started` and no result; `action`: "rerun", "reported" (an error
/// result, not run again) or "asked" (a person decides).
pub fn interrupted_call(action: &'static str) {
    METRICS
        .interrupted_calls
        .get_or_create(&[("action", action)])
        .inc();
}

/// A replay's call got its recorded result; the tool did not run.
pub fn call_served(tool: &str) {
    let tool = Toolbox::spec(tool).map_or("unknown", |spec| spec.name);
    METRICS.served_calls.get_or_create(&[("tool", tool)]).inc();
}

/// An `approval_requested` was appended: the call waits for a person.
pub fn approval_requested() {
    METRICS.approval_requests.inc();
}

fn model_labels(spec: &str) -> ModelLabels {
    vec![("model", spec.to_string())]
}

fn retry_labels(spec: &str, reason: &str) -> ModelLabels {
    vec![("model", spec.to_string()), ("reason", reason.to_string())]
}

/// A failed call of `model` (or, `circuit_open`, none) is to be tried again.
pub fn model_retry(model: &str, reason: &str) {
    METRICS
        .model_retries
        .get_or_create(&retry_labels(model, reason))
        .inc();
}

fn fallback_labels(from: &str, to: &str) -> ModelLabels {
    vec![("from", from.to_string()), ("to", to.to_string())]
}

/// A turn of a session on `from` called its fallback `to`.
pub fn fallback(from: &str, to: &str) {
    METRICS
        .fallbacks
        .get_or_create(&fallback_labels(from, to))
        .inc();
}

/// `model`'s circuit opened (or closed).
pub fn circuit(model: &str, open: bool) {
    METRICS
        .circuits_open
        .get_or_create(&model_labels(model))
        .set(i64::from(open));
}

/// A session was let go until its next model call is due.
pub fn parked() {
    METRICS.sessions_parked.inc();
}

/// A run paused itself; `reason`: "budget" or "gave_up".
pub fn run_paused(reason: &str) {
    let reason = if reason == "budget" {
        "budget"
    } else {
        "gave_up"
    };
    METRICS
        .runs_paused
        .get_or_create(&[("reason", reason)])
        .inc();
}

/// One model call attempt.
pub struct ModelCall {
    provider: &'static str,
    started: Instant,
    outcome: &'static str,
    span: tracing::Span,
}

impl ModelCall {
    /// A call of a model of `provider` (a metric label: `anthropic`, `openai`, `scripted`).
    pub fn start(provider: &'static str) -> ModelCall {
        ModelCall {
            provider,
            started: Instant::now(),
            outcome: "cancelled",
            span: tracing::info_span!(
                "model_call",
                provider,
                outcome = tracing::field::Empty,
                input_tokens = tracing::field::Empty,
                output_tokens = tracing::field::Empty,
            ),
        }
    }

    pub fn span(&self) -> &tracing::Span {
        &self.span
    }

    /// Records the attempt's outcome (`ok`, `transient` or `refused`) and, for a reply,
    /// its tokens; `first_text`: when the first streamed text arrived, if any did.
    pub fn finish(
        mut self,
        outcome: &'static str,
        usage: Option<&Usage>,
        first_text: Option<Instant>,
    ) {
        let m = &*METRICS;
        self.outcome = outcome;
        if let Some(at) = first_text {
            m.first_token_seconds
                .get_or_create(&[("provider", self.provider)])
                .observe(at.duration_since(self.started).as_secs_f64());
        }
        if let Some(usage) = usage {
            let tokens = |direction| {
                m.tokens
                    .get_or_create(&[("provider", self.provider), ("direction", direction)])
                    .clone()
            };
            tokens("input").inc_by(usage.input_tokens);
            tokens("output").inc_by(usage.output_tokens);
            self.span.record("input_tokens", usage.input_tokens);
            self.span.record("output_tokens", usage.output_tokens);
        }
    }
}

impl Drop for ModelCall {
    fn drop(&mut self) {
        let m = &*METRICS;
        m.model_calls
            .get_or_create(&[("provider", self.provider), ("outcome", self.outcome)])
            .inc();
        m.model_seconds
            .get_or_create(&[("provider", self.provider)])
            .observe(self.started.elapsed().as_secs_f64());
        self.span.record("outcome", self.outcome);
    }
}

/// Runs one tool call in its span (`tool`), timing it and counting its outcome.
pub async fn tool_run(
    name: &str,
    run: impl std::future::Future<Output = Result<ToolOutput, Stopped>>,
) -> Result<ToolOutput, Stopped> {
    let mut observer = ToolRun {
        tool: Toolbox::specs()
            .into_iter()
            .find(|spec| spec.name == name)
            .map_or("unknown", |spec| spec.name),
        started: Instant::now(),
        outcome: "cancelled",
    };
    let span = tracing::info_span!(
        "tool",
        tool = observer.tool,
        is_error = tracing::field::Empty
    );
    let output = tracing::Instrument::instrument(run, span.clone()).await?;
    span.record("is_error", output.is_error);
    observer.outcome = if output.is_error { "error" } else { "ok" };
    Ok(output)
}

struct ToolRun {
    tool: &'static str,
    started: Instant,
    outcome: &'static str,
}

impl Drop for ToolRun {
    fn drop(&mut self) {
        let m = &*METRICS;
        m.tool_runs
            .get_or_create(&[("tool", self.tool), ("outcome", self.outcome)])
            .inc();
        m.tool_seconds
            .get_or_create(&[("tool", self.tool)])
            .observe(self.started.elapsed().as_secs_f64());
    }
}
