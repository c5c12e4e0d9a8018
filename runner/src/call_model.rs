//! One step at a trailing user turn: the model call, and everything around it when the work
//! keeps failing, as `crate::resilience` decides it from the log.
//!
//! Promise: no model call of a turn is made before the last `retry_at_unix_ms` the log
//! holds for it, by this runner or any other; a failed call worth another try is logged
//! (`model_retry`, SYNC) before any wait; a wait longer than `--park-after` releases the
//! session (the store keeps it from every claimant until it is due); a run that reaches its
//! budget or whose models kept failing past `--give-up-after` pauses (`run_paused`) instead
//! of calling. The event ids are deterministic, so a runner that takes over half-way writes
//! nothing twice:
//!
//! | event | id |
//! |---|---|
//! | the turn's `k`-th `model_retry` in the run begun at seq `r` | `retry:<r>:<turn>:<k>` |
//! | `run_paused` of that run | `paused:<r>` |
//! | streamed text of call `k` | `delta:<turn>.<epoch>.<k>:<i>` |
//!
//! A store that does not know these kinds (release 0.1.0, or a replica of it) refuses
//! them; the session then goes on as the previous release's runner did: retries in memory,
//! holding the lease, and a `run_error` once they run out.

use std::time::Duration;

use agentlog_client::refusal::is_unknown_kind;
use agentlog_client::retry::Backoff;
use agentlog_proto::release::Release;
use agentlog_proto::v1::{
    event::Kind, AssistantDelta, Durability, ModelRetry, RunError, RunPaused,
};
use tokio::sync::mpsc;
use tracing::Instrument;

use crate::context::{TurnContext, SYSTEM_PROMPT};
use crate::fold::config::SessionConfigState;
use crate::fold::run::RunState;
use crate::fold::Conversation;
use crate::lease::LeaseGuard;
use crate::model::{FailReason, Failure, MissingModel, Model, ModelError, ModelRequest, TextSink};
use crate::resilience::budget;
use crate::resilience::circuit::Admission;
use crate::resilience::schedule::{self, Chain, Next};
use crate::session_log::{Appender, InterruptSignal};
use crate::store_error::StoreError;

/// Streamed text is gathered for this long before it is appended as one delta.
const DELTA_WINDOW: Duration = Duration::from_millis(50);

/// How a model step ended.
#[derive(Debug, PartialEq, Eq)]
pub enum ModelStep {
    /// Its events are logged, or an interrupt cut it short: catch up and fold again.
    Done,
    /// The next call is due at `until` (unix ms), later than `--park-after`: let the session
    /// go.
    Parked { until: i64 },
    /// The lease was lost or the runner is stopping.
    Stopped,
}

/// The turn, folded: its number, its run, the conversation.
pub struct Turn<'a> {
    pub number: u64,
    pub run: &'a RunState,
    pub conversation: &'a Conversation,
}

/// What the turn's step will do, decided before its conversation is taken from the fold
/// (a call goes out in its model's form: a fallback of another provider folds the log
/// again in its own).
pub struct Plan {
    pub chain: Chain,
    action: Action,
}

enum Action {
    /// The store does not keep the new kinds: the previous release's in-memory retries.
    InMemory,
    /// The run reached a limit of its budget.
    Budget(String),
    Next(Next),
}

impl Plan {
    /// The model whose form the conversation must be in for this step.
    pub fn model<'m>(&self, context: &'m TurnContext) -> &'m Model {
        plan_model(context, self.spec())
    }

    /// That model's `PROVIDER:MODEL`.
    fn spec(&self) -> &str {
        match &self.action {
            Action::Next(Next::Call { index, .. }) => &self.chain.models[*index],
            _ => &self.chain.models[0],
        }
    }
}

/// Decides the step at `now`, from the fold as caught up: the session's chain (its model
/// must be one this runner has), its budget, and the schedule of its failed calls.
pub fn plan(
    context: &TurnContext,
    appender: &Appender,
    run: &RunState,
    config: &SessionConfigState,
    now: i64,
) -> Result<Plan, MissingModel> {
    let settings = &context.settings;
    context.models.get(config.model.as_deref())?;
    let head = match &config.model {
        Some(model) => model.clone(),
        None => context.models.specs()[0].to_string(),
    };
    let chain = Chain::of(
        &head,
        &config.fallback_models,
        &settings.fallback_models,
        |m| context.models.get(Some(m)).is_ok(),
    );
    let in_memory = appender
        .store_release()
        .is_some_and(|r| r < Release::new(0, 2, 0));
    let limits = budget::effective(config.budget.as_ref(), &settings.budget);
    let action = if in_memory {
        Action::InMemory
    } else if let Some(detail) = budget::reached(run, &limits, now) {
        Action::Budget(detail)
    } else {
        let circuit = |m: &str| context.circuits.peek(m, now);
        Action::Next(schedule::next(run, &chain, settings, circuit, now))
    };
    Ok(Plan { chain, action })
}

/// Makes the planned step: a call (its reply logged, or its failure), a wait, a park or a
/// pause.
pub async fn step(
    context: &TurnContext,
    appender: &Appender,
    lease: &LeaseGuard,
    interrupt: &InterruptSignal,
    turn: Turn<'_>,
    plan: Plan,
) -> Result<ModelStep, StoreError> {
    let chain = &plan.chain;
    let head = chain.models[0].as_str();
    let next = match plan.action {
        Action::InMemory => {
            return in_memory(context, head, appender, lease, interrupt, &turn, None).await
        }
        Action::Budget(detail) => return pause(appender, &turn, "budget", detail).await,
        Action::Next(next) => next,
    };
    match next {
        Next::GiveUp { detail } => pause(appender, &turn, "gave_up", detail).await,
        Next::Wait { until } => wait(context, lease, interrupt, until).await,
        Next::CircuitOpen { index, until } => {
            let retry = schedule::circuit_open(turn.run, chain, index, until);
            crate::metrics::model_retry(&retry.model, &retry.reason);
            if !log_retry(appender, &turn, retry).await? {
                return in_memory(context, head, appender, lease, interrupt, &turn, None).await;
            }
            Ok(ModelStep::Done)
        }
        Next::Call { index, .. } => {
            let spec = &chain.models[index];
            let now = now_ms();
            if let Admission::Wait { until } = context.circuits.admit(spec, now) {
                // Another session took the probe meanwhile: look again soon.
                return wait(context, lease, interrupt, until.min(now + 1_000)).await;
            }
            if index > 0 {
                crate::metrics::fallback(&chain.models[0], spec);
            }
            let model = plan_model(context, spec);
            call(
                context, model, spec, appender, lease, interrupt, &turn, chain, index,
            )
            .await
        }
    }
}

fn plan_model<'m>(context: &'m TurnContext, spec: &str) -> &'m Model {
    context
        .models
        .get(Some(spec))
        .expect("a chain holds only models this runner was given")
}

/// One call of model `index` of the chain; its reply logged, or its failure.
#[allow(clippy::too_many_arguments)]
async fn call(
    context: &TurnContext,
    model: &Model,
    spec: &str,
    appender: &Appender,
    lease: &LeaseGuard,
    interrupt: &InterruptSignal,
    turn: &Turn<'_>,
    chain: &Chain,
    index: usize,
) -> Result<ModelStep, StoreError> {
    let k = turn.run.retries.len() + 1;
    let reply = match stream(context, model, appender, lease, interrupt, turn, k).await? {
        Streamed::Reply(reply) => reply,
        Streamed::Cut(step) => {
            context.circuits.abandoned(spec);
            return Ok(step);
        }
    };
    let now = now_ms();
    let failure = match reply {
        Ok(reply) => {
            context.circuits.succeeded(spec);
            tracing::info!(turn = turn.number, model = spec, stop_reason = %reply.stop_reason, "model replied");
            appender
                .append(
                    format!("reply:{}", turn.number),
                    Kind::AssistantMessage(reply),
                    Durability::Sync,
                )
                .await?;
            return Ok(ModelStep::Done);
        }
        Err(ModelError::Refused(message)) => {
            return end_turn(appender, turn.number, message, false).await;
        }
        // A billing refusal: this model's share of the turn is used up, if another follows.
        Err(ModelError::Unusable(message)) if index + 1 < chain.models.len() => Failure {
            reason: FailReason::RateLimited,
            message,
            wait: None,
        },
        Err(ModelError::Unusable(message)) => {
            return end_turn(appender, turn.number, message, false).await;
        }
        Err(ModelError::Transient(failure)) => {
            context.circuits.failed(spec, now);
            failure
        }
    };
    let retry = schedule::after_failure(turn.run, chain, &context.settings, index, &failure, now);
    tracing::warn!(
        turn = turn.number,
        model = spec,
        reason = %retry.reason,
        attempt = retry.attempt,
        message = %retry.message,
        retry_in_ms = retry.retry_at_unix_ms - now,
        "model call failed; logged its retry"
    );
    crate::metrics::model_retry(&retry.model, &retry.reason);
    if !log_retry(appender, turn, retry).await? {
        return in_memory(
            context,
            spec,
            appender,
            lease,
            interrupt,
            turn,
            Some(failure),
        )
        .await;
    }
    Ok(ModelStep::Done)
}

/// Logs the turn's next `model_retry`; `false` when the store does not know the kind.
async fn log_retry(
    appender: &Appender,
    turn: &Turn<'_>,
    retry: ModelRetry,
) -> Result<bool, StoreError> {
    let k = turn.run.retries.len() + 1;
    let id = format!("retry:{}:{}:{k}", turn.run.started_seq, turn.number);
    match appender
        .append(id, Kind::ModelRetry(retry), Durability::Sync)
        .await
    {
        Ok(_) => Ok(true),
        Err(StoreError::Failed(status)) if is_unknown_kind(&status) => {
            tracing::warn!("the store does not keep model_retry (an older release): retrying in memory, as that release's runner did");
            Ok(false)
        }
        Err(e) => Err(e),
    }
}

/// The run stops itself and waits for a person (`run_paused`); a store that does not know
/// the kind gets the previous release's `run_error` instead.
async fn pause(
    appender: &Appender,
    turn: &Turn<'_>,
    reason: &str,
    detail: String,
) -> Result<ModelStep, StoreError> {
    tracing::warn!(turn = turn.number, reason, %detail, "the run pauses");
    crate::metrics::run_paused(reason);
    let paused = Kind::RunPaused(RunPaused {
        reason: reason.to_string(),
        detail: detail.clone(),
    });
    let id = format!("paused:{}", turn.run.started_seq);
    match appender.append(id, paused, Durability::Sync).await {
        Ok(_) => Ok(ModelStep::Done),
        Err(StoreError::Failed(status)) if is_unknown_kind(&status) => {
            end_turn(appender, turn.number, detail, reason == "gave_up").await
        }
        Err(e) => Err(e),
    }
}

/// No call before `until`: parked when that is more than `--park-after` away, else waited
/// out here (an interrupt or a stop ends the wait).
async fn wait(
    context: &TurnContext,
    lease: &LeaseGuard,
    interrupt: &InterruptSignal,
    until: i64,
) -> Result<ModelStep, StoreError> {
    let left = Duration::from_millis(until.saturating_sub(now_ms()).max(0) as u64);
    if left > context.settings.park_after {
        return Ok(ModelStep::Parked { until });
    }
    tokio::select! {
        _ = lease.cancelled().cancelled() => Ok(ModelStep::Stopped),
        _ = lease.drain_begun() => Ok(ModelStep::Stopped),
        _ = interrupt.arrived() => Ok(ModelStep::Done),
        _ = tokio::time::sleep(left) => Ok(ModelStep::Done),
    }
}

/// What streaming one call gave.
enum Streamed {
    Reply(Result<agentlog_proto::v1::AssistantMessage, ModelError>),
    /// Stopped or interrupted before it ended: the step's outcome.
    Cut(ModelStep),
}

/// Streams one call of `model`, its text appended as deltas of call `k`.
async fn stream(
    context: &TurnContext,
    model: &Model,
    appender: &Appender,
    lease: &LeaseGuard,
    interrupt: &InterruptSignal,
    turn: &Turn<'_>,
    k: usize,
) -> Result<Streamed, StoreError> {
    let request = ModelRequest {
        system: SYSTEM_PROMPT,
        conversation: turn.conversation,
        tools: &context.tools,
        max_tokens: context.max_tokens,
        idle_timeout: context.settings.model_idle_timeout,
    };
    let turn_id = format!("{}.{}.{k}", turn.number, lease.epoch());
    let (sender, receiver) = mpsc::channel(256);
    let deltas = tokio::spawn(write_deltas(appender.clone(), turn_id, receiver).in_current_span());
    let sink = TextSink::new(sender);
    let observed = crate::metrics::ModelCall::start(model.provider());
    let span = observed.span().clone();
    let reply = tokio::select! {
        _ = lease.cancelled().cancelled() => {
            deltas.abort();
            return Ok(Streamed::Cut(ModelStep::Stopped));
        }
        _ = interrupt.arrived() => {
            deltas.abort();
            tracing::info!(turn = turn.number, "interrupt: the model stream was dropped");
            return Ok(Streamed::Cut(ModelStep::Done));
        }
        reply = model.stream_reply(request, &sink).instrument(span) => reply,
    };
    let outcome = match &reply {
        Ok(_) => "ok",
        Err(ModelError::Transient(_)) => "transient",
        Err(ModelError::Refused(_) | ModelError::Unusable(_)) => "refused",
    };
    let usage = reply.as_ref().ok().and_then(|r| r.usage.as_ref());
    observed.finish(outcome, usage, sink.first_text());
    // Closing the sink lets the delta writer flush and finish.
    drop(sink);
    // The deltas land before the reply, so a reader never sees text after its turn ended.
    match deltas.await {
        Ok(Err(e @ (StoreError::LeaseLost | StoreError::SessionDeleted))) => return Err(e),
        Ok(Err(e)) => tracing::warn!(error = %e, "some streamed text was not logged"),
        Ok(Ok(())) | Err(_) => {}
    }
    Ok(Streamed::Reply(reply))
}

/// The previous release's way, for a store that does not keep `model_retry`: retries in
/// memory (attempt counts and waits are this runner's alone), holding the lease, and a
/// retryable `run_error` once `Backoff::MODEL`'s attempts run out. `failed`: the call that
/// just failed, if one did (its wait comes first).
async fn in_memory(
    context: &TurnContext,
    spec: &str,
    appender: &Appender,
    lease: &LeaseGuard,
    interrupt: &InterruptSignal,
    turn: &Turn<'_>,
    failed: Option<Failure>,
) -> Result<ModelStep, StoreError> {
    let backoff = Backoff::MODEL;
    let model = plan_model(context, spec);
    let mut attempt = 1;
    if let Some(failure) = failed {
        if let Some(step) = wait_in_memory(lease, interrupt, backoff.delay(1, failure.wait)).await {
            return Ok(step);
        }
        attempt = 2;
    }
    let (message, retryable) = loop {
        let k = turn.run.retries.len() + attempt as usize;
        let reply = match stream(context, model, appender, lease, interrupt, turn, k).await? {
            Streamed::Reply(reply) => reply,
            Streamed::Cut(step) => return Ok(step),
        };
        match reply {
            Ok(reply) => {
                appender
                    .append(
                        format!("reply:{}", turn.number),
                        Kind::AssistantMessage(reply),
                        Durability::Sync,
                    )
                    .await?;
                return Ok(ModelStep::Done);
            }
            Err(ModelError::Refused(message) | ModelError::Unusable(message)) => {
                break (message, false)
            }
            Err(ModelError::Transient(failure)) => {
                if attempt >= backoff.max_attempts {
                    break (
                        format!("gave up after {attempt} attempts: {}", failure.message),
                        true,
                    );
                }
                crate::metrics::model_retry(spec, failure.reason.name());
                let wait = backoff.delay(attempt, failure.wait);
                if let Some(step) = wait_in_memory(lease, interrupt, wait).await {
                    return Ok(step);
                }
                attempt += 1;
            }
        }
    };
    end_turn(appender, turn.number, message, retryable).await
}

/// Waits `wait` holding the lease; the step's outcome if a stop or an interrupt ended it.
async fn wait_in_memory(
    lease: &LeaseGuard,
    interrupt: &InterruptSignal,
    wait: Duration,
) -> Option<ModelStep> {
    if lease.draining() {
        return Some(ModelStep::Stopped);
    }
    tokio::select! {
        _ = lease.cancelled().cancelled() => Some(ModelStep::Stopped),
        _ = lease.drain_begun() => Some(ModelStep::Stopped),
        _ = interrupt.arrived() => Some(ModelStep::Done),
        _ = tokio::time::sleep(wait) => None,
    }
}

/// Ends turn `turn` with a `run_error` saying `message`.
async fn end_turn(
    appender: &Appender,
    turn: u64,
    message: String,
    retryable: bool,
) -> Result<ModelStep, StoreError> {
    tracing::warn!(turn, %message, retryable, "the turn failed; logging run_error");
    appender
        .append(
            format!("error:{turn}"),
            Kind::RunError(RunError { message, retryable }),
            Durability::Sync,
        )
        .await?;
    Ok(ModelStep::Done)
}

/// Appends streamed text as `assistant_delta`s, gathered over [`DELTA_WINDOW`], buffered
/// durability: losing some in a crash costs nothing, the reply is the record.
async fn write_deltas(
    appender: Appender,
    turn_id: String,
    mut receiver: mpsc::Receiver<String>,
) -> Result<(), StoreError> {
    let mut index = 0;
    while let Some(first) = receiver.recv().await {
        let mut text = first;
        let window = tokio::time::sleep(DELTA_WINDOW);
        tokio::pin!(window);
        let mut open = true;
        while open {
            tokio::select! {
                _ = &mut window => break,
                piece = receiver.recv() => match piece {
                    Some(piece) => text.push_str(&piece),
                    None => open = false,
                },
            }
        }
        appender
            .append(
                format!("delta:{turn_id}:{index}"),
                Kind::AssistantDelta(AssistantDelta {
                    turn_id: turn_id.clone(),
                    text,
                }),
                Durability::Buffered,
            )
            .await?;
        index += 1;
        if !open {
            break;
        }
    }
    Ok(())
}

/// The runner's clock, as the log's times are (unix ms).
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}
