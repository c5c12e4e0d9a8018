//! A run of the log's records made into Subscribe's wire form in the buffer it was read
//! into ([`FramedEvents`]): each record's checksum verified and its session and seq
//! checked, then its stored `Event` message moved behind a gRPC message header in place.

use super::log::record::StoredEvent;
use super::log::{LogError, ReadRun};
use crate::backend::framed::{FramedEvents, MESSAGE_HEADER_LEN};
use crate::StoreError;

/// The records of `run`, which must be the session's events from `first_seq` on, one
/// after the other: each record's checksum is verified and its session and seq
/// checked, then its `Event` message is moved behind a gRPC message header, in the
/// buffer it was read into. A header is 4 bytes shorter than a record's (its frame
/// header and kind byte), so messages only ever move towards the front, over bytes
/// already dealt with.
pub fn from_stored(
    run: ReadRun,
    session_id: &str,
    first_seq: u64,
) -> Result<FramedEvents, StoreError> {
    let mut run = run;
    let (start, records) = (run.start, run.records);
    let bytes = &mut run.bytes;
    let mut framed = 0;
    for (seq, &position) in (first_seq..).zip(records) {
        let at = (position.offset - start) as usize;
        let frame = &bytes[at..at + position.len as usize];
        let stored = StoredEvent::from_frame(frame).map_err(|reason| LogError::BadRecord {
            offset: position.offset,
            reason,
        })?;
        if stored.seq != seq || stored.session_id != session_id.as_bytes() {
            return Err(StoreError::Internal(format!(
                "index entry {session_id}/{seq} points at another record"
            )));
        }
        let message = at + stored.message.start..at + stored.message.end;
        let len = message.len();
        bytes[framed] = 0;
        bytes[framed + 1..framed + MESSAGE_HEADER_LEN].copy_from_slice(&(len as u32).to_be_bytes());
        bytes.copy_within(message, framed + MESSAGE_HEADER_LEN);
        framed += MESSAGE_HEADER_LEN + len;
    }
    Ok(FramedEvents::new(run.into_bytes(framed), records.len()))
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::FileExt;
    use std::sync::Arc;

    use agentlog_proto::kept::KeptEvent;
    use agentlog_proto::v1::{event, Event, UserMessage};
    use prost::Message;

    use super::*;
    use crate::backend::local::log::storage::FsStorage;
    use crate::backend::local::log::{LogConfig, LogReader, LogTail, LogWriter, Position, Record};
    use crate::session::LeaseRecord;

    fn event(session_id: &str, seq: u64, text: &str) -> Event {
        Event {
            session_id: session_id.into(),
            seq,
            event_id: format!("e{seq}"),
            ts_unix_ms: 1_700_000_000_000 + seq as i64,
            schema_version: 1,
            kind: Some(event::Kind::UserMessage(UserMessage { text: text.into() })),
        }
    }

    /// A log in `dir` holding session `s`'s events 7, 8, 9 (texts of several sizes) with a
    /// lease record and another session's event between them: the events, the log's reader
    /// and the positions of `s`'s events.
    fn stored(dir: &std::path::Path) -> (Vec<Event>, Arc<LogReader>, Vec<Position>) {
        let ours = vec![
            event("s", 7, "short"),
            event("s", 8, &"a longer text ".repeat(40)),
            event("s", 9, ""),
        ];
        let records = [
            Record::Event(ours[0].clone().into()),
            Record::Lease(LeaseRecord {
                session_id: "s".into(),
                owner: "runner".into(),
                epoch: 3,
                ..Default::default()
            }),
            Record::Event(ours[1].clone().into()),
            Record::Event(event("other", 8, "not ours").into()),
            Record::Event(ours[2].clone().into()),
        ];
        let storage = Arc::new(FsStorage::open_dir(dir).unwrap());
        let mut log =
            LogWriter::open(storage, LogConfig::default(), LogTail::default(), |_| {}).unwrap();
        let positions = log
            .write(records.iter().map(|r| (r, false)))
            .unwrap()
            .into_iter()
            .enumerate()
            .filter(|(i, _)| [0, 2, 4].contains(i))
            .map(|(_, p)| p)
            .collect();
        (ours, log.reader(), positions)
    }

    /// The events at `positions` framed, as a subscription reads them.
    fn framed(
        log: &LogReader,
        positions: &[Position],
        session_id: &str,
        first_seq: u64,
    ) -> Result<(Vec<u8>, usize), StoreError> {
        let (mut bytes, mut count) = (Vec::new(), 0);
        let mut seq = first_seq;
        log.read_runs(positions, |run| {
            let n = run.records.len() as u64;
            let framed = from_stored(run, session_id, seq)?;
            assert_eq!(framed.decode()?.len(), framed.len());
            count += framed.len();
            bytes.extend_from_slice(&framed.into_bytes());
            seq += n;
            Ok::<_, StoreError>(())
        })?;
        Ok((bytes, count))
    }

    #[test]
    fn stored_events_go_out_as_one_grpc_message_each() {
        let dir = tempfile::tempdir().unwrap();
        let (events, log, positions) = stored(dir.path());
        // Each message: flag 0 (uncompressed), its length, the event's own encoding.
        let mut expected = Vec::new();
        for event in &events {
            expected.push(0);
            expected.extend_from_slice(&(event.encoded_len() as u32).to_be_bytes());
            expected.extend_from_slice(&event.encode_to_vec());
        }
        // Read again and again: the buffers a read leaves behind are used for the next.
        for _ in 0..3 {
            assert_eq!(framed(&log, &positions, "s", 7), Ok((expected.clone(), 3)));
        }
        // Events in memory go out in the same form.
        let kept: Vec<_> = events.into_iter().map(KeptEvent::new).collect();
        assert_eq!(FramedEvents::encode(&kept).into_bytes(), expected);
    }

    #[test]
    fn a_damaged_or_misplaced_record_is_never_framed() {
        let dir = tempfile::tempdir().unwrap();
        let (_, log, positions) = stored(dir.path());
        let segment = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(dir.path().join(format!("{:020}.seg", 0)))
            .unwrap();
        for p in &positions {
            for at in p.offset..p.offset + u64::from(p.len) {
                let mut byte = [0];
                segment.read_exact_at(&mut byte, at).unwrap();
                segment.write_all_at(&[byte[0] ^ 0x04], at).unwrap();
                assert!(
                    framed(&log, &positions, "s", 7).is_err(),
                    "a flipped bit at offset {at} went unnoticed"
                );
                segment.write_all_at(&byte, at).unwrap();
            }
        }
        assert!(framed(&log, &positions, "s", 7).is_ok(), "all restored");
        assert!(framed(&log, &positions, "s", 6).is_err(), "seqs shifted");
        assert!(framed(&log, &positions, "t", 7).is_err(), "another session");
        let lease = Position {
            offset: positions[0].offset + u64::from(positions[0].len),
            len: (positions[1].offset - positions[0].offset) as u32 - positions[0].len,
        };
        assert!(
            framed(&log, &[positions[0], lease], "s", 7).is_err(),
            "a lease record"
        );
    }
}
