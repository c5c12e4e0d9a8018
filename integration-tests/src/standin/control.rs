//! A stand-in's own HTTP endpoints, beside the API it stands in for, for a test or a bench
//! that reaches it over a network (the `model-standin` program in a container):
//!
//! - `GET /journal`: `{"requests": N, "replies": N, "violations": [...], "models": {MODEL:
//!   CALLS}, "calls": [{"model", "call", "turn", "served", "received_unix_ms"}]}`, what it
//!   has seen, in the order received.
//! - `POST /control/fail` with a [`PlanRequest`] (e.g. `{"model": "m", "fault":
//!   "never_starts", "for_ms": 30000}`): adds the plan to the model's script.
//! - `POST /control/heal` with `{"model": "m"}` (or `{}`: every model): forgets the faults
//!   scripted for it.
//! - `POST /control/clock` with `{"skew_ms": N}`: sets the provider clock's skew.
//!
//! A control request the stand-in cannot follow gets a 400 saying what to fix.

use std::collections::BTreeMap;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};

use super::{lock, PlanRequest, Shared};

/// The routes above, on `journal`.
pub fn routes<R, F>(journal: Shared<R, F>) -> Router
where
    R: Send + 'static,
    F: DeserializeOwned + Clone + Send + 'static,
{
    Router::new()
        .route("/journal", get(summary::<R, F>))
        .route("/control/fail", post(fail::<R, F>))
        .route("/control/heal", post(heal::<R, F>))
        .route("/control/clock", post(clock::<R, F>))
        .with_state(journal)
}

async fn summary<R, F>(State(journal): State<Shared<R, F>>) -> Json<Value> {
    let journal = lock(&journal);
    let replies = journal
        .requests
        .iter()
        .filter(|r| r.served == "reply")
        .count();
    let models: BTreeMap<&String, &usize> = journal.faults.calls.iter().collect();
    let calls: Vec<Value> = journal
        .requests
        .iter()
        .map(|r| {
            json!({
                "model": r.model, "call": r.call, "turn": r.turn, "served": r.served,
                "received_unix_ms": r.received_unix_ms,
            })
        })
        .collect();
    Json(json!({
        "requests": journal.requests.len(),
        "replies": replies,
        "violations": journal.violations,
        "models": models,
        "calls": calls,
    }))
}

async fn fail<R, F: DeserializeOwned + Clone>(
    State(journal): State<Shared<R, F>>,
    body: Bytes,
) -> Response {
    let planned = serde_json::from_slice::<PlanRequest<F>>(&body)
        .map_err(|e| format!("not a fault plan ({e})"))
        .and_then(PlanRequest::plan);
    match planned {
        Ok((model, plan)) => {
            lock(&journal).faults.fail_model(&model, plan);
            Json(json!({"failing": model})).into_response()
        }
        Err(message) => refuse(&message),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Heal {
    #[serde(default)]
    model: Option<String>,
}

async fn heal<R, F>(State(journal): State<Shared<R, F>>, body: Bytes) -> Response {
    let heal: Heal = match serde_json::from_slice(&body) {
        Ok(heal) => heal,
        Err(e) => return refuse(&format!("expected {{\"model\": NAME}} or {{}} ({e})")),
    };
    let mut journal = lock(&journal);
    match &heal.model {
        Some(model) => journal.faults.clear_model(model),
        None => journal.faults.models.clear(),
    }
    Json(json!({"healed": heal.model})).into_response()
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Clock {
    skew_ms: i64,
}

async fn clock<R, F>(State(journal): State<Shared<R, F>>, body: Bytes) -> Response {
    match serde_json::from_slice::<Clock>(&body) {
        Ok(Clock { skew_ms }) => {
            lock(&journal).clock.set_skew_ms(skew_ms);
            Json(json!({"skew_ms": skew_ms})).into_response()
        }
        Err(e) => refuse(&format!("expected {{\"skew_ms\": N}} ({e})")),
    }
}

fn refuse(message: &str) -> Response {
    (
        StatusCode::BAD_REQUEST,
        Json(json!({"error": {"message": message}})),
    )
        .into_response()
}
