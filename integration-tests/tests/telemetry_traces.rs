//! OTLP traces of the real binaries, received by an in-test collector (a tonic server of
//! the OpenTelemetry protocol's `TraceService`): one runner turn is one trace, and it spans
//! both processes — the store's request spans are children of the runner's spans through
//! the W3C trace context in gRPC metadata — down to the fsync each append waited for. The
//! runner's appends go on one `AppendStream`, opened in the turn's trace: each is an `append`
//! span under that call on the store's side.

mod runner_support;
mod telemetry_support;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use integration_tests::anthropic_standin::{AnthropicStandin, StandinReply};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use runner_support::{user_says, wait_idle};
use serde_json::json;
use telemetry_support::{start_runner, start_store};

/// What the collector received, one entry per span.
#[derive(Debug, Clone)]
struct ReceivedSpan {
    service: String,
    name: String,
    trace_id: Vec<u8>,
    span_id: Vec<u8>,
    parent_span_id: Vec<u8>,
    attributes: HashMap<String, String>,
}

#[derive(Clone, Default)]
struct Collector(Arc<Mutex<Vec<ReceivedSpan>>>);

#[tonic::async_trait]
impl TraceService for Collector {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut received = self.0.lock().unwrap_or_else(|p| p.into_inner());
        for resource_spans in request.into_inner().resource_spans {
            let service = resource_spans
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "service.name")
                .map(|kv| shown(kv.value.as_ref().and_then(|v| v.value.as_ref())))
                .unwrap_or_default();
            for span in resource_spans.scope_spans.into_iter().flat_map(|s| s.spans) {
                received.push(ReceivedSpan {
                    service: service.clone(),
                    name: span.name,
                    trace_id: span.trace_id,
                    span_id: span.span_id,
                    parent_span_id: span.parent_span_id,
                    attributes: span
                        .attributes
                        .iter()
                        .map(|kv| {
                            (
                                kv.key.clone(),
                                shown(kv.value.as_ref().and_then(|v| v.value.as_ref())),
                            )
                        })
                        .collect(),
                });
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

fn shown(value: Option<&Value>) -> String {
    match value {
        Some(Value::StringValue(s)) => s.clone(),
        Some(Value::IntValue(i)) => i.to_string(),
        Some(Value::BoolValue(b)) => b.to_string(),
        Some(Value::DoubleValue(d)) => d.to_string(),
        other => format!("{other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread")]
async fn one_turn_is_one_trace_across_runner_and_store() {
    let collector = Collector::default();
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the collector");
    let endpoint = format!("http://{}", listener.local_addr().expect("address"));
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(collector.clone()))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ];

    let data = tempfile::tempdir().expect("temp dir");
    let mut store = start_store(data.path(), &env);
    let mut client = agentlog_proto::v1::event_store_client::EventStoreClient::connect(store.url())
        .await
        .expect("client");
    let standin = AnthropicStandin::start(vec![
        StandinReply::text("Listing.").tool("list_files", json!({})),
        StandinReply::text("Nothing here."),
    ])
    .await
    .expect("stand-in");
    let workspaces = tempfile::tempdir().expect("temp dir");
    let mut runner = start_runner(&store.url(), workspaces.path(), &standin.url(), &env);
    user_says(&mut client, "s1", "what is here?").await;
    let events = wait_idle(&mut client, "s1", 0, Duration::from_secs(60)).await;
    // Both flush their last spans on a clean exit.
    assert!(runner.terminate().success());
    assert!(store.terminate().success());

    let spans = collector
        .0
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let turns: Vec<_> = spans
        .iter()
        .filter(|s| s.service == "runner" && s.name == "turn")
        .collect();
    assert_eq!(turns.len(), 1, "one claimed turn: {spans:#?}");
    let turn = turns[0];
    assert!(
        turn.parent_span_id.is_empty(),
        "the turn is the root of its trace"
    );
    let in_trace: Vec<_> = spans
        .iter()
        .filter(|s| s.trace_id == turn.trace_id)
        .collect();
    let count = |service: &str, name: &str| {
        in_trace
            .iter()
            .filter(|s| s.service == service && s.name == name)
            .count()
    };

    // The runner's side of the turn: the claim, a fold per step, both model calls, the
    // tool run, and every append it made (the log minus the user's own turn).
    assert_eq!(count("runner", "claim"), 1);
    assert!(count("runner", "fold") >= 3);
    assert_eq!(count("runner", "model_call"), 2);
    assert_eq!(count("runner", "tool"), 1);
    let runner_appends = count("runner", "append");
    assert_eq!(runner_appends, events.len() - 1, "{in_trace:#?}");

    // The store's side, in the same trace: the runner's appends reached the store on one
    // AppendStream call whose parent is a runner span, none as a unary Append, and each is
    // an `append` span under that call, with the seqs it got.
    let runner_span_ids: Vec<_> = in_trace
        .iter()
        .filter(|s| s.service == "runner")
        .map(|s| &s.span_id)
        .collect();
    let streams: Vec<_> = in_trace
        .iter()
        .filter(|s| s.service == "event-store" && s.name == "agentlog.v1.EventStore/AppendStream")
        .collect();
    assert_eq!(streams.len(), 1, "{in_trace:#?}");
    assert!(runner_span_ids.contains(&&streams[0].parent_span_id));
    assert_eq!(count("event-store", "agentlog.v1.EventStore/Append"), 0);
    let store_appends: Vec<_> = in_trace
        .iter()
        .filter(|s| s.service == "event-store" && s.name == "append")
        .collect();
    assert_eq!(store_appends.len(), runner_appends, "{in_trace:#?}");
    for append in &store_appends {
        assert_eq!(append.parent_span_id, streams[0].span_id, "{append:#?}");
    }
    let mut seqs: Vec<u64> = store_appends
        .iter()
        .map(|s| {
            s.attributes
                .get("first_seq")
                .and_then(|v| v.parse().ok())
                .expect("first_seq")
        })
        .collect();
    seqs.sort_unstable();
    let logged: Vec<u64> = events.iter().skip(1).map(|e| e.seq).collect();
    assert_eq!(seqs, logged, "each append span carries the seq it got");
    // Each SYNC append shows the fsync it waited for (and the batch it shared); a BUFFERED
    // one was acknowledged before its fsync and has none.
    for append in &store_appends {
        let fsyncs: Vec<_> = in_trace
            .iter()
            .filter(|s| s.name == "fsync" && s.parent_span_id == append.span_id)
            .collect();
        match append.attributes.get("durability").map(String::as_str) {
            Some("sync") => {
                assert_eq!(fsyncs.len(), 1, "{append:#?}");
                let records: u64 = fsyncs[0].attributes["records"].parse().expect("records");
                assert!(records >= 1);
            }
            _ => assert!(fsyncs.is_empty(), "{append:#?}"),
        }
    }
    // The turn also read the log and renewed its lease through the store.
    assert!(count("event-store", "agentlog.v1.EventStore/Subscribe") >= 1);
    assert!(count("event-store", "agentlog.v1.EventStore/RenewLease") >= 1);
    // The user's own append carried no trace context: it is in a trace of its own.
    assert!(spans
        .iter()
        .any(|s| s.name == "agentlog.v1.EventStore/Append" && s.trace_id != turn.trace_id));
}
