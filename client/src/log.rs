//! A session's whole log as it is now: one non-follow subscription from seq 1.

use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::{Event, SubscribeRequest};
use tonic::client::GrpcService;

/// Every event of `session_id`, in seq order (none for a session that does not exist).
pub async fn read_log<T>(
    client: &mut EventStoreClient<T>,
    session_id: &str,
) -> Result<Vec<Event>, tonic::Status>
where
    T: GrpcService<tonic::body::Body>,
    T::Error: Into<tonic::codegen::StdError>,
    T::ResponseBody: tonic::codegen::Body<Data = tonic::codegen::Bytes> + Send + 'static,
    <T::ResponseBody as tonic::codegen::Body>::Error: Into<tonic::codegen::StdError> + Send,
{
    let mut stream = client
        .subscribe(SubscribeRequest {
            session_id: session_id.to_string(),
            from_seq: 1,
            follow: false,
        })
        .await?
        .into_inner();
    let mut events = Vec::new();
    while let Some(event) = stream.message().await? {
        events.push(event);
    }
    Ok(events)
}
