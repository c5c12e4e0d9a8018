//! The store's Prometheus metrics: appends, the group commit, subscribers, leases, and
//! deletions with the reclamation of their space.
//!
//! Promise: every label value comes from a fixed, small set (a durability, an outcome, a
//! lease operation); no session id, owner or event text ever becomes a label. Recording is
//! a few atomic operations, and the hooks in the store are one line each, so that reading
//! the code for what it does is not disturbed by what it reports. The metrics live for the
//! process (statics), and [`registry`] exposes them for `--metrics-listen`.

use std::future::Future;
use std::path::PathBuf;
use std::sync::LazyLock;
use std::time::Instant;

use agentlog_proto::kept::KeptAppendRequest;
use agentlog_proto::v1::{AppendResponse, Durability};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;
use tracing::Instrument;

use tonic::Code;

use crate::error::StoreError;

type Labels1 = [(&'static str, &'static str); 1];
type Labels2 = [(&'static str, &'static str); 2];

struct StoreMetrics {
    appends: Family<Labels2, Counter>,
    append_requests: Family<Labels1, Counter>,
    read_requests: Family<Labels1, Counter>,
    append_seconds: Family<Labels1, Histogram>,
    fsync_seconds: Histogram,
    fsync_events: Histogram,
    fsync_bytes: Histogram,
    fsyncs: Counter,
    subscribers: Family<Labels1, Gauge>,
    lease_grants: Family<Labels1, Counter>,
    lease_renewals: Counter,
    fencing_refusals: Family<Labels1, Counter>,
    claims_waiting: Gauge,
    sessions_deleted: Family<Labels1, Counter>,
    sessions_imported: Family<Labels1, Counter>,
    sessions_exported: Counter,
    reclaim_dead_bytes: Gauge,
    session_cache_bytes: Gauge,
    reclaim_runs: Counter,
    reclaimed_bytes: Counter,
    reclaim_seconds: Counter<f64, std::sync::atomic::AtomicU64>,
    pg_statement_seconds: Family<Labels1, Histogram>,
    pg_batch_appends: Histogram,
    /// The series every append touches, looked up once.
    append_series: AppendSeries,
}

/// The series every append request touches (and an accepted one's outcome), taken from
/// their families at the start: counting one is then an atomic add and a histogram's
/// observation, with no lookup of its labels (a lock, a hash of the label set and its
/// comparison: three a request, every request). Each array is indexed by
/// [`durability_slot`] or [`AppendCall::slot`].
struct AppendSeries {
    ok: [Counter; 2],
    requests: [Counter; 2],
    seconds: [Histogram; 2],
}

/// The durabilities' labels, in the order of [`AppendSeries`]' arrays.
const DURABILITIES: [&str; 2] = ["sync", "buffered"];
/// The append calls' `rpc` labels, in the order of [`AppendSeries::requests`] (as
/// [`AppendCall::slot`]).
const APPEND_CALLS: [&str; 2] = ["append", "append_stream"];

static METRICS: LazyLock<StoreMetrics> = LazyLock::new(|| {
    let appends: Family<Labels2, Counter> = Family::default();
    let append_requests: Family<Labels1, Counter> = Family::default();
    let append_seconds: Family<Labels1, Histogram> =
        Family::new_with_constructor(|| Histogram::new(exponential_buckets(0.000_1, 2.0, 16)));
    let append_series = AppendSeries {
        ok: DURABILITIES
            .map(|d| appends.get_or_create_owned(&[("durability", d), ("outcome", "ok")])),
        requests: APPEND_CALLS.map(|rpc| append_requests.get_or_create_owned(&[("rpc", rpc)])),
        seconds: DURABILITIES.map(|d| append_seconds.get_or_create_owned(&[("durability", d)])),
    };
    StoreMetrics {
        appends,
        append_requests,
        read_requests: Family::default(),
        append_seconds,
        fsync_seconds: Histogram::new(exponential_buckets(0.000_05, 2.0, 16)),
        fsync_events: Histogram::new(exponential_buckets(1.0, 2.0, 14)),
        fsync_bytes: Histogram::new(exponential_buckets(64.0, 4.0, 12)),
        fsyncs: Counter::default(),
        subscribers: Family::default(),
        lease_grants: Family::default(),
        lease_renewals: Counter::default(),
        fencing_refusals: Family::default(),
        claims_waiting: Gauge::default(),
        sessions_deleted: Family::default(),
        sessions_imported: Family::default(),
        sessions_exported: Counter::default(),
        reclaim_dead_bytes: Gauge::default(),
        session_cache_bytes: Gauge::default(),
        reclaim_runs: Counter::default(),
        reclaimed_bytes: Counter::default(),
        reclaim_seconds: Counter::default(),
        pg_statement_seconds: Family::new_with_constructor(|| {
            Histogram::new(exponential_buckets(0.000_1, 2.0, 16))
        }),
        pg_batch_appends: Histogram::new(exponential_buckets(1.0, 2.0, 10)),
        append_series,
    }
});

/// Every store metric, plus the log's size on disk read from `log_dir` at each scrape.
pub fn registry(log_dir: Option<PathBuf>) -> Registry {
    let m = &*METRICS;
    // The usual series exist from the start (at 0), so rates and the dashboard see them
    // (an append's usual series are made with their families, `AppendSeries`).
    for rpc in READS {
        let _ = m.read_requests.get_or_create(&[("rpc", rpc)]);
    }
    for state in ["live", "catching_up"] {
        let _ = m.subscribers.get_or_create(&[("state", state)]);
    }
    for how in ["claim", "acquire"] {
        let _ = m.lease_grants.get_or_create(&[("how", how)]);
    }
    for op in ["append", "renew"] {
        let _ = m.fencing_refusals.get_or_create(&[("op", op)]);
    }
    for how in ["request", "retention"] {
        let _ = m.sessions_deleted.get_or_create(&[("how", how)]);
    }
    for outcome in ["imported", "unchanged", "refused", "deleted"] {
        let _ = m.sessions_imported.get_or_create(&[("outcome", outcome)]);
    }
    let mut r = Registry::default();
    r.register(
        "agentlog_store_appends",
        "Append requests (unary, or one of an AppendStream) by durability and outcome (ok, or \
         the gRPC status they got)",
        m.appends.clone(),
    );
    r.register(
        "agentlog_store_append_requests",
        "Append requests by the call that carried them: append (unary Append) or append_stream \
         (one request of an AppendStream)",
        m.append_requests.clone(),
    );
    r.register(
        "agentlog_store_read_requests",
        "Read requests by call (subscribe, get_session, list_sessions, get_snapshot)",
        m.read_requests.clone(),
    );
    r.register(
        "agentlog_store_append_duration_seconds",
        "Append latency in the store, from the request reaching the handler to its answer",
        m.append_seconds.clone(),
    );
    r.register(
        "agentlog_store_fsync_duration_seconds",
        "Time of each fdatasync of the log (one per group-commit batch)",
        m.fsync_seconds.clone(),
    );
    r.register(
        "agentlog_store_fsync_batch_records",
        "Records (events and lease grants) made durable by one fdatasync",
        m.fsync_events.clone(),
    );
    r.register(
        "agentlog_store_fsync_batch_bytes",
        "Bytes made durable by one fdatasync",
        m.fsync_bytes.clone(),
    );
    r.register(
        "agentlog_store_fsyncs",
        "fdatasync calls of the log",
        m.fsyncs.clone(),
    );
    r.register(
        "agentlog_store_subscribers",
        "Open Subscribe streams: live, or catching up from disk (history, or after lagging)",
        m.subscribers.clone(),
    );
    r.register(
        "agentlog_store_lease_grants",
        "Leases granted, by how (claim or acquire)",
        m.lease_grants.clone(),
    );
    r.register(
        "agentlog_store_lease_renewals",
        "Leases renewed",
        m.lease_renewals.clone(),
    );
    r.register(
        "agentlog_store_fencing_refusals",
        "Writes refused because their lease epoch is no longer current (append or renew)",
        m.fencing_refusals.clone(),
    );
    r.register(
        "agentlog_store_claims_waiting",
        "ClaimSession long-polls waiting for a runnable session",
        m.claims_waiting.clone(),
    );
    r.register(
        "agentlog_store_sessions_deleted",
        "Sessions deleted (tombstones made), by how: request (DeleteSession) or retention \
         (--retain-idle)",
        m.sessions_deleted.clone(),
    );
    r.register(
        "agentlog_store_sessions_imported",
        "Sessions (and deleted ids) read by Import, by outcome: imported, unchanged, refused \
         or deleted",
        m.sessions_imported.clone(),
    );
    r.register(
        "agentlog_store_sessions_exported",
        "Sessions written by Export and by the archive of --archive-dir",
        m.sessions_exported.clone(),
    );
    r.register(
        "agentlog_store_reclaim_dead_bytes",
        "Local backend: bytes of deleted sessions' events still in the log, awaiting \
         reclamation",
        m.reclaim_dead_bytes.clone(),
    );
    r.register(
        "agentlog_store_session_cache_bytes",
        "Bytes of sessions' states kept in memory (bounded by --session-cache; the other \
         sessions are read from the index or the database when needed)",
        m.session_cache_bytes.clone(),
    );
    r.register(
        "agentlog_store_reclaim_runs",
        "Local backend: reclamation passes run (segments rewritten without deleted \
         sessions' records)",
        m.reclaim_runs.clone(),
    );
    r.register(
        "agentlog_store_reclaimed_bytes",
        "Local backend: bytes of disk given back by reclamation",
        m.reclaimed_bytes.clone(),
    );
    r.register(
        "agentlog_store_reclaim_seconds",
        "Local backend: seconds spent in reclamation passes",
        m.reclaim_seconds.clone(),
    );
    r.register(
        "agentlog_store_pg_statement_duration_seconds",
        "PostgreSQL backend: time of one database round trip, by what it does",
        m.pg_statement_seconds.clone(),
    );
    r.register(
        "agentlog_store_pg_batch_appends",
        "PostgreSQL backend: appends written by one batch statement (one commit)",
        m.pg_batch_appends.clone(),
    );
    if let Some(dir) = log_dir {
        r.register_collector(Box::new(LogOnDisk { dir }));
    }
    r
}

/// Where a durability's series are in [`AppendSeries`]' arrays and [`DURABILITIES`].
fn durability_slot(durability: Durability) -> usize {
    match durability {
        Durability::Buffered => 1,
        _ => 0,
    }
}

fn outcome_label<T>(result: &Result<T, StoreError>) -> &'static str {
    match result {
        Ok(_) => "ok",
        Err(e) => match e.code() {
            Code::InvalidArgument => "invalid_argument",
            Code::Aborted => "aborted",
            Code::FailedPrecondition => "failed_precondition",
            Code::NotFound => "not_found",
            Code::ResourceExhausted => "resource_exhausted",
            Code::Unavailable => "unavailable",
            _ => "internal",
        },
    }
}

/// The call an append request came in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AppendCall {
    /// A unary `Append`.
    Unary,
    /// One request of an `AppendStream`.
    Stream,
}

impl AppendCall {
    /// Where the call's series is in [`AppendSeries::requests`] and [`APPEND_CALLS`].
    fn slot(self) -> usize {
        match self {
            AppendCall::Unary => 0,
            AppendCall::Stream => 1,
        }
    }
}

/// Times one append request (a unary Append, or one request of an AppendStream) from its
/// arrival to its answer and counts its outcome (a request refused by validation too); its
/// span (`append`, a child of the current span) records the seqs it got.
pub struct AppendObserver {
    /// The request's durability, as [`durability_slot`].
    durability_slot: usize,
    call: AppendCall,
    started: Instant,
    span: tracing::Span,
}

impl AppendObserver {
    pub fn start(append: &KeptAppendRequest, call: AppendCall) -> AppendObserver {
        let request = &append.request;
        let slot = durability_slot(request.durability());
        let durability = DURABILITIES[slot];
        // Not validated yet: a span never holds more of an id than a valid one can have.
        let id = &request.session_id;
        let cut = (0..=id.len().min(128))
            .rev()
            .find(|&i| id.is_char_boundary(i));
        let session_id = &id[..cut.unwrap_or(0)];
        let events = append.events.len();
        // Exported, the span is the append in the trace; otherwise it would only prefix
        // log lines, which the default filter (`info`) does not ask for: made at debug.
        let span = if telemetry::exporting() {
            tracing::info_span!(
                "append",
                session_id,
                events,
                durability,
                first_seq = tracing::field::Empty,
                last_seq = tracing::field::Empty,
                outcome = tracing::field::Empty,
            )
        } else {
            tracing::debug_span!("append", session_id, events, durability)
        };
        AppendObserver {
            durability_slot: slot,
            call,
            started: Instant::now(),
            span,
        }
    }

    /// The span the append runs in (the writer traces the fsync it waits for under it).
    pub fn span(&self) -> &tracing::Span {
        &self.span
    }

    /// Runs the append in the span, then counts and times its outcome.
    pub async fn observe(
        self,
        append: impl Future<Output = Result<AppendResponse, StoreError>>,
    ) -> Result<AppendResponse, StoreError> {
        let result = append.instrument(self.span.clone()).await;
        self.finish(&result);
        result
    }

    /// Counts and times the append's outcome, `result`, and records it in the span.
    pub fn finish(self, result: &Result<AppendResponse, StoreError>) {
        let m = &*METRICS;
        let outcome = outcome_label(result);
        let series = &m.append_series;
        if result.is_ok() {
            series.ok[self.durability_slot].inc();
        } else {
            let durability = DURABILITIES[self.durability_slot];
            m.appends
                .get_or_create(&[("durability", durability), ("outcome", outcome)])
                .inc();
        }
        series.requests[self.call.slot()].inc();
        series.seconds[self.durability_slot].observe(self.started.elapsed().as_secs_f64());
        self.span.record("outcome", outcome);
        if let Ok(response) = result {
            if let (Some(first), Some(last)) = (response.seqs.first(), response.seqs.last()) {
                self.span.record("first_seq", first);
                self.span.record("last_seq", last);
            }
        }
    }
}

/// One group-commit fdatasync: started before the call, observed after it. When spans
/// are exported, each SYNC append waiting for it gets an `fsync` child span covering it,
/// so an append's trace shows the fsync it waited for and the batch it shared.
pub struct FsyncObserver {
    records: usize,
    bytes: u64,
    started: Instant,
    spans: Vec<tracing::Span>,
}

impl FsyncObserver {
    /// `records` and `bytes`: the batch just written; `waiting`: the spans of the appends
    /// that are acknowledged only after this fsync.
    pub fn start(records: usize, bytes: u64, waiting: &[tracing::Span]) -> FsyncObserver {
        let spans = if telemetry::exporting() {
            let batch = |parent| tracing::info_span!(parent: parent, "fsync", records, bytes);
            waiting.iter().map(batch).collect()
        } else {
            Vec::new()
        };
        FsyncObserver {
            records,
            bytes,
            started: Instant::now(),
            spans,
        }
    }

    pub fn done(self) {
        let m = &*METRICS;
        m.fsync_seconds
            .observe(self.started.elapsed().as_secs_f64());
        m.fsync_events.observe(self.records as f64);
        m.fsync_bytes.observe(self.bytes as f64);
        m.fsyncs.inc();
        drop(self.spans);
    }
}

/// Held by every Subscribe stream for its life: counts it as live.
pub struct Subscriber(());

impl Subscriber {
    pub fn open() -> Subscriber {
        subscribers("live").inc();
        Subscriber(())
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        subscribers("live").dec();
    }
}

/// Held while a stream reads from disk: counts it as catching up rather than live.
pub struct CatchingUp(());

impl CatchingUp {
    pub fn enter() -> CatchingUp {
        subscribers("live").dec();
        subscribers("catching_up").inc();
        CatchingUp(())
    }
}

impl Drop for CatchingUp {
    fn drop(&mut self) {
        subscribers("catching_up").dec();
        subscribers("live").inc();
    }
}

fn subscribers(state: &'static str) -> Gauge {
    METRICS
        .subscribers
        .get_or_create(&[("state", state)])
        .clone()
}

/// Held by a ClaimSession call while it waits.
pub struct ClaimWaiting(());

impl ClaimWaiting {
    pub fn enter() -> ClaimWaiting {
        METRICS.claims_waiting.inc();
        ClaimWaiting(())
    }
}

impl Drop for ClaimWaiting {
    fn drop(&mut self) {
        METRICS.claims_waiting.dec();
    }
}

/// Counts a lease granted (`how`: "claim" or "acquire").
pub fn lease_granted(how: &'static str) {
    METRICS.lease_grants.get_or_create(&[("how", how)]).inc();
}

/// Counts a lease renewed (refused renewals are counted as fencing refusals).
pub fn lease_renewed() {
    METRICS.lease_renewals.inc();
}

/// A write under an epoch that is no longer the session's live lease (`op`: "append" or
/// "renew").
pub fn fencing_refused(op: &'static str) {
    METRICS.fencing_refusals.get_or_create(&[("op", op)]).inc();
}

/// `count` sessions deleted (`how`: "request" or "retention"); a repeated deletion, which
/// changes nothing, counts 0.
/// Sessions an import finished with `outcome` (imported, unchanged, refused, deleted).
pub fn sessions_imported(outcome: &'static str, count: usize) {
    METRICS
        .sessions_imported
        .get_or_create(&[("outcome", outcome)])
        .inc_by(count as u64);
}

/// A session written by an export (or an archive).
pub fn session_exported() {
    METRICS.sessions_exported.inc();
}

pub fn sessions_deleted(how: &'static str, count: usize) {
    if count > 0 {
        METRICS
            .sessions_deleted
            .get_or_create(&[("how", how)])
            .inc_by(count as u64);
    }
}

/// Bytes of deleted sessions' events still in the log.
pub fn reclaim_dead_bytes(bytes: u64) {
    METRICS
        .reclaim_dead_bytes
        .set(bytes.min(i64::MAX as u64) as i64);
}

/// What the cache of sessions' states takes now (`crate::session::shrink_cache`).
pub fn session_cache_bytes(bytes: usize) {
    METRICS
        .session_cache_bytes
        .set(bytes.min(i64::MAX as usize) as i64);
}

/// One reclamation pass: the disk bytes it gave back and how long it took.
pub fn reclaimed(bytes: u64, seconds: f64) {
    let m = &*METRICS;
    m.reclaim_runs.inc();
    m.reclaimed_bytes.inc_by(bytes);
    m.reclaim_seconds.inc_by(seconds);
}

/// One database round trip of the PostgreSQL backend (`statement`: what it does, from a
/// fixed set), failed ones included.
pub fn pg_statement(statement: &'static str, seconds: f64) {
    METRICS
        .pg_statement_seconds
        .get_or_create(&[("statement", statement)])
        .observe(seconds);
}

/// One batch of appends written by the PostgreSQL backend in one statement.
pub fn pg_batch(appends: usize) {
    METRICS.pg_batch_appends.observe(appends as f64);
}

/// The PostgreSQL backend's connection pool, read at each scrape.
#[derive(Debug)]
pub struct PgPool(pub deadpool_postgres::Pool);

impl Collector for PgPool {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let status = self.0.status();
        let gauges = [
            (
                "agentlog_store_pg_pool_connections_in_use",
                "PostgreSQL backend: pool connections running a statement",
                status.size.saturating_sub(status.available),
            ),
            (
                "agentlog_store_pg_pool_connections_idle",
                "PostgreSQL backend: open pool connections waiting for work",
                status.available,
            ),
            (
                "agentlog_store_pg_pool_connections_max",
                "PostgreSQL backend: the pool's size limit (--database-pool-size)",
                status.max_size,
            ),
            (
                "agentlog_store_pg_pool_waiting",
                "PostgreSQL backend: calls waiting for a free pool connection",
                status.waiting,
            ),
        ];
        for (name, help, value) in gauges {
            let gauge = ConstGauge::new(value as i64);
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        Ok(())
    }
}

/// The segment files under the log directory, counted and sized at each scrape.
#[derive(Debug)]
struct LogOnDisk {
    dir: PathBuf,
}

impl Collector for LogOnDisk {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let (mut segments, mut bytes) = (0i64, 0i64);
        if let Ok(entries) = std::fs::read_dir(&self.dir) {
            // Segment files only: not the reserve, nor a rewrite in progress.
            let segment_files = entries
                .flatten()
                .filter(|e| e.file_name().to_string_lossy().ends_with(".seg"));
            for meta in segment_files.filter_map(|e| e.metadata().ok()) {
                if meta.is_file() {
                    segments += 1;
                    bytes += meta.len() as i64;
                }
            }
        }
        let gauge = ConstGauge::new(segments);
        gauge.encode(encoder.encode_descriptor(
            "agentlog_store_log_segments",
            "Segment files of the log",
            None,
            gauge.metric_type(),
        )?)?;
        let gauge = ConstGauge::new(bytes);
        gauge.encode(encoder.encode_descriptor(
            "agentlog_store_log_bytes",
            "Bytes of the log's segment files on disk (preallocated zeros included)",
            None,
            gauge.metric_type(),
        )?)?;
        Ok(())
    }
}

/// The read calls counted by `agentlog_store_read_requests`.
pub const READS: [&str; 4] = ["subscribe", "get_session", "list_sessions", "get_snapshot"];

/// A read request reached its handler (`rpc`: one of [`READS`]).
pub fn read_request(rpc: &'static str) {
    METRICS.read_requests.get_or_create(&[("rpc", rpc)]).inc();
}
