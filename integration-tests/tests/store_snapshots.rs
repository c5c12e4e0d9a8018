//! PutSnapshot and GetSnapshot against the real store (either backend, see
//! `AGENTLOG_TEST_BACKEND`): a snapshot is kept only for the session's live lease holder and
//! a seq within the log, a newer one replaces an older one and never the reverse, it comes
//! back byte for byte across chunks and a restart of the store, and bad requests get a clear
//! status and change nothing.

use agentlog_proto::v1::event_store_client::EventStoreClient;
use agentlog_proto::v1::{
    event::Kind, AcquireLeaseRequest, AppendRequest, Event, GetSnapshotRequest,
    ReleaseLeaseRequest, SnapshotChunk, UserMessage,
};
use integration_tests::{grpcurl, Store};
use tonic::transport::Channel;
use tonic::Code;

const FORMAT: &str = "test-fold";
const MIB: usize = 1 << 20;

async fn append_user(client: &mut EventStoreClient<Channel>, session: &str, n: usize) -> u64 {
    let events = (0..n)
        .map(|i| Event {
            kind: Some(Kind::UserMessage(UserMessage {
                text: format!("turn {i}"),
            })),
            ..Event::default()
        })
        .collect();
    client
        .append(AppendRequest {
            session_id: session.into(),
            events,
            ..AppendRequest::default()
        })
        .await
        .expect("append")
        .into_inner()
        .last_seq
}

/// Puts `data` in chunks of at most `chunk` bytes.
async fn put(
    client: &mut EventStoreClient<Channel>,
    session: &str,
    epoch: u64,
    seq: u64,
    format: &str,
    data: &[u8],
    chunk: usize,
) -> Result<u64, tonic::Status> {
    let mut chunks: Vec<SnapshotChunk> = data
        .chunks(chunk)
        .map(|part| SnapshotChunk {
            data: part.to_vec().into(),
            ..SnapshotChunk::default()
        })
        .collect();
    if chunks.is_empty() {
        chunks.push(SnapshotChunk::default());
    }
    chunks[0].session_id = session.into();
    chunks[0].lease_epoch = epoch;
    chunks[0].seq = seq;
    chunks[0].format = format.into();
    client
        .put_snapshot(tokio_stream::iter(chunks))
        .await
        .map(|r| r.into_inner().seq)
}

async fn get(
    client: &mut EventStoreClient<Channel>,
    session: &str,
) -> Result<(u64, Vec<u8>), tonic::Status> {
    let mut stream = client
        .get_snapshot(GetSnapshotRequest {
            session_id: session.into(),
            format: FORMAT.into(),
        })
        .await?
        .into_inner();
    let first = stream.message().await?.expect("a first chunk");
    assert_eq!(first.format, FORMAT);
    assert_eq!(first.session_id, session);
    let mut data = first.data.to_vec();
    while let Some(chunk) = stream.message().await? {
        data.extend_from_slice(&chunk.data);
    }
    Ok((first.seq, data))
}

async fn lease(client: &mut EventStoreClient<Channel>, session: &str) -> u64 {
    client
        .acquire_lease(AcquireLeaseRequest {
            session_id: session.into(),
            owner: "snapshot-test".into(),
            ttl_ms: 60_000,
        })
        .await
        .expect("acquire lease")
        .into_inner()
        .epoch
}

async fn release(client: &mut EventStoreClient<Channel>, session: &str, epoch: u64) {
    client
        .release_lease(ReleaseLeaseRequest {
            session_id: session.into(),
            owner: "snapshot-test".into(),
            epoch,
        })
        .await
        .expect("release lease");
}

fn data(len: usize, fill: u8) -> Vec<u8> {
    (0..len)
        .map(|i| fill.wrapping_add((i % 251) as u8))
        .collect()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_lease_holder_keeps_the_newest_snapshot_and_everyone_reads_it_back() {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    let session = "snap-1";
    assert_eq!(
        get(&mut client, session).await.unwrap_err().code(),
        Code::NotFound
    );
    let last = append_user(&mut client, session, 10).await;
    let epoch = lease(&mut client, session).await;

    // 2.5 MiB in 1 MiB chunks, read back byte for byte.
    let big = data(5 * MIB / 2, 7);
    assert_eq!(
        put(&mut client, session, epoch, 8, FORMAT, &big, MIB)
            .await
            .unwrap(),
        8
    );
    assert_eq!(get(&mut client, session).await.unwrap(), (8, big.clone()));

    // An older one is dropped, a newer one replaces it.
    assert_eq!(
        put(&mut client, session, epoch, 5, FORMAT, b"older", MIB)
            .await
            .unwrap(),
        8
    );
    assert_eq!(get(&mut client, session).await.unwrap(), (8, big));
    assert_eq!(
        put(&mut client, session, epoch, last, FORMAT, b"newest", MIB)
            .await
            .unwrap(),
        last
    );
    assert_eq!(
        get(&mut client, session).await.unwrap(),
        (last, b"newest".to_vec())
    );

    // Other formats are kept apart.
    put(&mut client, session, epoch, 3, "other-1", b"other", MIB)
        .await
        .unwrap();
    assert_eq!(
        get(&mut client, session).await.unwrap(),
        (last, b"newest".to_vec())
    );
    release(&mut client, session, epoch).await;

    // grpcurl reads it as users do (the data in the proto3 JSON mapping: base64).
    let out = grpcurl(
        store.addr,
        "agentlog.v1.EventStore/GetSnapshot",
        Some(&format!(
            r#"{{"session_id":"{session}","format":"{FORMAT}"}}"#
        )),
    );
    assert!(out.success, "{}", out.stderr);
    let chunk = out.json();
    assert_eq!(chunk["seq"].as_str(), Some(last.to_string().as_str()));
    assert_eq!(chunk["data"].as_str(), Some("bmV3ZXN0"));

    // The snapshot outlives a restart of the store.
    let mut store = store;
    store.terminate().expect("terminate");
    let store = store.restart().expect("restart");
    let mut client = store.client().await.expect("client");
    assert_eq!(
        get(&mut client, session).await.unwrap(),
        (last, b"newest".to_vec())
    );
}

#[tokio::test(flavor = "multi_thread")]
async fn puts_without_the_live_lease_or_outside_the_log_are_refused_and_change_nothing() {
    let store = Store::start().expect("store");
    let mut client = store.client().await.expect("client");
    let session = "snap-2";

    // No session yet.
    let refused = put(&mut client, session, 1, 1, FORMAT, b"x", MIB).await;
    assert_eq!(refused.unwrap_err().code(), Code::NotFound);

    let last = append_user(&mut client, session, 3).await;
    // No lease.
    let refused = put(&mut client, session, 1, last, FORMAT, b"x", MIB).await;
    assert_eq!(refused.unwrap_err().code(), Code::FailedPrecondition);

    let epoch = lease(&mut client, session).await;
    put(&mut client, session, epoch, 2, FORMAT, b"kept", MIB)
        .await
        .expect("the holder puts");
    // A stale epoch, after the lease was released and granted again.
    release(&mut client, session, epoch).await;
    let newer = lease(&mut client, session).await;
    let refused = put(&mut client, session, epoch, last, FORMAT, b"stale", MIB).await;
    let status = refused.unwrap_err();
    assert_eq!(status.code(), Code::FailedPrecondition, "{status:?}");

    // Seqs outside the log, a bad format, a bad session id, an empty stream.
    for (seq, format, sid) in [
        (last + 1, FORMAT, session),
        (0, FORMAT, session),
        (last, "", session),
        (last, ".hidden", session),
        (last, "a/b", session),
        (last, FORMAT, "../etc"),
    ] {
        let refused = put(&mut client, sid, newer, seq, format, b"bad", MIB).await;
        let status = refused.unwrap_err();
        assert_eq!(
            status.code(),
            Code::InvalidArgument,
            "seq {seq} format {format:?} session {sid:?}: {status:?}"
        );
    }
    let empty = client
        .put_snapshot(tokio_stream::iter(Vec::<SnapshotChunk>::new()))
        .await;
    assert_eq!(empty.unwrap_err().code(), Code::InvalidArgument);

    // Over 64 MiB: RESOURCE_EXHAUSTED, naming the limit.
    let huge = vec![0u8; 64 * MIB + 1];
    let status = put(&mut client, session, newer, last, FORMAT, &huge, 4 * MIB)
        .await
        .unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("64 MiB"), "{status:?}");

    // None of it changed the kept snapshot.
    assert_eq!(
        get(&mut client, session).await.unwrap(),
        (2, b"kept".to_vec())
    );
}
