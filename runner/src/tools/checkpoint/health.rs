//! The checkpoint store's own metrics: whether it answers, the bytes moved to and from an
//! object store, the checkpoints a log names that it lacks. Kept here, beside what counts
//! them, and registered with the runner's other metrics by `runner/src/metrics.rs`.

use std::sync::LazyLock;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

struct StoreMetrics {
    up: Gauge,
    bytes: Family<[(&'static str, &'static str); 1], Counter>,
    missing: Counter,
}

static METRICS: LazyLock<StoreMetrics> = LazyLock::new(|| StoreMetrics {
    up: Gauge::default(),
    bytes: Family::default(),
    missing: Counter::default(),
});

/// Whether the checkpoints' store answers.
pub fn up(up: bool) {
    METRICS.up.set(i64::from(up));
}

/// Checkpoint bytes moved to or from the object store; `direction`: "uploaded" or "fetched".
pub fn bytes(direction: &'static str, bytes: u64) {
    METRICS
        .bytes
        .get_or_create(&[("direction", direction)])
        .inc_by(bytes);
}

/// A checkpoint a log names is not in the checkpoint store.
pub fn missing() {
    METRICS.missing.inc();
}

/// Registers the metrics above in `r` (the store answers until it is seen not to).
pub fn register(r: &mut Registry) {
    let m = &*METRICS;
    for direction in ["uploaded", "fetched"] {
        let _ = m.bytes.get_or_create(&[("direction", direction)]);
    }
    m.up.set(1);
    r.register(
        "agentlog_runner_checkpoint_store_up",
        "1 while the checkpoints' store answers; 0 while its requests are retried (no call \
         ends meanwhile)",
        m.up.clone(),
    );
    r.register(
        "agentlog_runner_checkpoint_store_bytes",
        "Checkpoint objects' bytes sent to the object store (uploaded) and brought from it \
         (fetched)",
        m.bytes.clone(),
    );
    r.register(
        "agentlog_runner_checkpoints_missing",
        "Checkpoints a log names that the checkpoint store does not hold (the workspace goes on \
         as it is)",
        m.missing.clone(),
    );
}
