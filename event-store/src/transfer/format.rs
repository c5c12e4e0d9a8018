//! The export format (a contract: other programs read and write it): UTF-8 text, one JSON object a
//! line. The header `{"format":"agentlog-export","version":1,…}`; per session a line
//! `{"session":{…}}` (its `SessionInfo` in the proto3 JSON mapping, without the lease), its
//! events one a line as Subscribe gives them ([`agentlog_proto::json`]), then
//! `{"end":{"sessionId","lastSeq","events","sha256"}}`, `sha256` the lowercase hex SHA-256
//! of the session's event lines as written, each with its newline; a deleted session is
//! `{"deleted":{"sessionId","deletedUnixMs"}}`.
//!
//! Lines are written here and read back here ([`parse_line`]); a line that is not one of
//! these, or not what its kind must hold, is an error saying what is wrong with it (the
//! importer adds its number).

use agentlog_proto::json::{event_from_json_keeping, write_str};
use agentlog_proto::kept::KeptEvent;
use agentlog_proto::v1::{ForkedFrom, SessionInfo, SessionStatus};
use serde_json::{Map, Value};

/// The `format` of the header line.
pub const FORMAT: &str = "agentlog-export";
/// The format version this build writes and reads.
pub const VERSION: u64 = 1;

/// One line of an export, read.
#[derive(Debug, Clone, PartialEq)]
pub enum Line {
    Header {
        version: u64,
    },
    Session(SessionInfo),
    /// An event, with the fields of it this build does not know (its `unknownFields`).
    Event(Box<KeptEvent>),
    End(End),
    Deleted {
        session_id: String,
        deleted_unix_ms: i64,
    },
}

/// A session's closing line.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct End {
    pub session_id: String,
    pub last_seq: u64,
    pub events: u64,
    pub sha256: String,
}

/// The header line, with its newline.
pub fn header_line(exported_unix_ms: i64) -> String {
    format!(
        "{{\"format\":\"{FORMAT}\",\"version\":{VERSION},\"exportedUnixMs\":\"{exported_unix_ms}\"}}\n"
    )
}

/// A session's line, with its newline: its `SessionInfo` in the proto3 JSON mapping (fields
/// at their default left out), without the lease.
pub fn session_line(info: &SessionInfo, out: &mut Vec<u8>) {
    out.extend_from_slice(b"{\"session\":{\"sessionId\":");
    write_str(out, &info.session_id);
    let field = |out: &mut Vec<u8>, name: &str, value: i128| {
        if value != 0 {
            out.extend_from_slice(format!(",\"{name}\":\"{value}\"").as_bytes());
        }
    };
    field(out, "lastSeq", info.last_seq.into());
    field(out, "createdUnixMs", info.created_unix_ms.into());
    field(out, "updatedUnixMs", info.updated_unix_ms.into());
    if info.status != 0 {
        out.extend_from_slice(b",\"status\":");
        write_str(out, info.status().as_str_name());
    }
    if !info.title.is_empty() {
        out.extend_from_slice(b",\"title\":");
        write_str(out, &info.title);
    }
    if let Some(f) = &info.forked_from {
        out.extend_from_slice(b",\"forkedFrom\":{");
        let mut inner = Vec::new();
        if !f.session_id.is_empty() {
            inner.extend_from_slice(b"\"sessionId\":");
            write_str(&mut inner, &f.session_id);
        }
        if f.seq != 0 {
            if !inner.is_empty() {
                inner.push(b',');
            }
            inner.extend_from_slice(format!("\"seq\":\"{}\"", f.seq).as_bytes());
        }
        out.extend_from_slice(&inner);
        out.push(b'}');
    }
    if info.pinned {
        out.extend_from_slice(b",\"pinned\":true");
    }
    field(out, "notBeforeUnixMs", info.not_before_unix_ms.into());
    out.extend_from_slice(b"}}\n");
}

/// A session's end line, with its newline.
pub fn end_line(end: &End) -> String {
    let mut out = Vec::new();
    out.extend_from_slice(b"{\"end\":{\"sessionId\":");
    write_str(&mut out, &end.session_id);
    out.extend_from_slice(
        format!(
            ",\"lastSeq\":\"{}\",\"events\":\"{}\",\"sha256\":\"{}\"}}}}\n",
            end.last_seq, end.events, end.sha256
        )
        .as_bytes(),
    );
    String::from_utf8(out).expect("written as UTF-8")
}

/// A deleted session's line, with its newline (`deleted_unix_ms` 0: not known).
pub fn deleted_line(session_id: &str, deleted_unix_ms: i64) -> String {
    let mut out = Vec::new();
    out.extend_from_slice(b"{\"deleted\":{\"sessionId\":");
    write_str(&mut out, session_id);
    if deleted_unix_ms != 0 {
        out.extend_from_slice(format!(",\"deletedUnixMs\":\"{deleted_unix_ms}\"").as_bytes());
    }
    out.extend_from_slice(b"}}\n");
    String::from_utf8(out).expect("written as UTF-8")
}

/// Reads one line (without its newline).
pub fn parse_line(text: &str) -> Result<Line, String> {
    let value: Value = serde_json::from_str(text).map_err(|e| format!("not JSON: {e}"))?;
    let Value::Object(object) = &value else {
        return Err("not a JSON object".into());
    };
    if object.contains_key("format") {
        return header(object);
    }
    let single = |name: &str| object.len() == 1 && object.contains_key(name);
    if single("session") {
        return session(&object["session"]).map(Line::Session);
    }
    if single("end") {
        return end(&object["end"]).map(Line::End);
    }
    if single("deleted") {
        let mut f = Fields::of(&object["deleted"], "deleted")?;
        let session_id = f.string("sessionId")?;
        let deleted_unix_ms = f.integer("deletedUnixMs")?;
        f.done()?;
        return Ok(Line::Deleted {
            session_id,
            deleted_unix_ms: i64::try_from(deleted_unix_ms)
                .map_err(|_| "deleted: `deletedUnixMs` is out of range".to_string())?,
        });
    }
    let (event, unknown) =
        event_from_json_keeping(&value).map_err(|e| format!("not an event: {e}"))?;
    KeptEvent::from_event(event, &unknown)
        .map(|event| Line::Event(Box::new(event)))
        .map_err(|e| format!("not an event: its unknownFields do not fit it: {e}"))
}

fn header(object: &Map<String, Value>) -> Result<Line, String> {
    if object.get("format").and_then(Value::as_str) != Some(FORMAT) {
        return Err(format!("not an export header: `format` is not {FORMAT:?}"));
    }
    let version = match object.get("version") {
        Some(Value::Number(n)) => n.as_u64(),
        Some(Value::String(s)) => s.parse().ok(),
        _ => None,
    }
    .ok_or("the header has no `version`")?;
    if version != VERSION {
        return Err(format!(
            "the export is of format version {version}; this store reads version {VERSION}"
        ));
    }
    Ok(Line::Header { version })
}

fn session(value: &Value) -> Result<SessionInfo, String> {
    let mut f = Fields::of(value, "session")?;
    let status = match f.take("status") {
        None | Some(Value::Null) => 0,
        Some(Value::String(name)) => SessionStatus::from_str_name(&name)
            .ok_or_else(|| format!("session: `status` {name:?} is not a session status"))?
            as i32,
        Some(Value::Number(n)) => n
            .as_i64()
            .and_then(|n| i32::try_from(n).ok())
            .filter(|n| SessionStatus::try_from(*n).is_ok())
            .ok_or_else(|| format!("session: `status` {n} is not a session status"))?,
        Some(other) => return Err(format!("session: `status` must be a string, not {other}")),
    };
    let forked_from = match f.take("forkedFrom") {
        None | Some(Value::Null) => None,
        Some(value) => {
            let mut g = Fields::of(&value, "forkedFrom")?;
            let forked = ForkedFrom {
                session_id: g.string("sessionId")?,
                seq: u64::try_from(g.integer("seq")?)
                    .map_err(|_| "forkedFrom: `seq` is out of range".to_string())?,
            };
            g.done()?;
            Some(forked)
        }
    };
    let range = |name: &str| format!("session: `{name}` is out of range");
    let info = SessionInfo {
        session_id: f.string("sessionId")?,
        last_seq: u64::try_from(f.integer("lastSeq")?).map_err(|_| range("lastSeq"))?,
        created_unix_ms: i64::try_from(f.integer("createdUnixMs")?)
            .map_err(|_| range("createdUnixMs"))?,
        updated_unix_ms: i64::try_from(f.integer("updatedUnixMs")?)
            .map_err(|_| range("updatedUnixMs"))?,
        status,
        lease: None,
        title: f.string("title")?,
        forked_from,
        pinned: f.bool("pinned")?,
        not_before_unix_ms: i64::try_from(f.integer("notBeforeUnixMs")?)
            .map_err(|_| range("notBeforeUnixMs"))?,
    };
    // An export carries no lease; one written by hand is not taken.
    f.take("lease");
    f.done()?;
    Ok(info)
}

fn end(value: &Value) -> Result<End, String> {
    let mut f = Fields::of(value, "end")?;
    let end = End {
        session_id: f.string("sessionId")?,
        last_seq: u64::try_from(f.integer("lastSeq")?)
            .map_err(|_| "end: `lastSeq` is out of range".to_string())?,
        events: u64::try_from(f.integer("events")?)
            .map_err(|_| "end: `events` is out of range".to_string())?,
        sha256: f.string("sha256")?,
    };
    f.done()?;
    Ok(end)
}

/// The fields of one of the format's own objects, taken by name; one left over is unknown.
struct Fields {
    what: &'static str,
    fields: Map<String, Value>,
}

impl Fields {
    fn of(value: &Value, what: &'static str) -> Result<Fields, String> {
        match value {
            Value::Object(fields) => Ok(Fields {
                what,
                fields: fields.clone(),
            }),
            other => Err(format!("{what} must be a JSON object, not {other}")),
        }
    }

    fn take(&mut self, name: &str) -> Option<Value> {
        self.fields.remove(name)
    }

    fn string(&mut self, name: &str) -> Result<String, String> {
        match self.take(name) {
            None | Some(Value::Null) => Ok(String::new()),
            Some(Value::String(s)) => Ok(s),
            Some(other) => Err(format!(
                "{}: `{name}` must be a string, not {other}",
                self.what
            )),
        }
    }

    fn bool(&mut self, name: &str) -> Result<bool, String> {
        match self.take(name) {
            None | Some(Value::Null) => Ok(false),
            Some(Value::Bool(b)) => Ok(b),
            Some(other) => Err(format!(
                "{}: `{name}` must be true or false, not {other}",
                self.what
            )),
        }
    }

    fn integer(&mut self, name: &str) -> Result<i128, String> {
        match self.take(name) {
            None | Some(Value::Null) => Ok(0),
            Some(Value::String(s)) => s
                .parse()
                .map_err(|_| format!("{}: `{name}` must be an integer, not {s:?}", self.what)),
            Some(Value::Number(n)) => n
                .as_i64()
                .map(i128::from)
                .or_else(|| n.as_u64().map(i128::from))
                .ok_or_else(|| format!("{}: `{name}` must be an integer, not {n}", self.what)),
            Some(other) => Err(format!(
                "{}: `{name}` must be an integer, not {other}",
                self.what
            )),
        }
    }

    fn done(self) -> Result<(), String> {
        match self.fields.keys().next() {
            None => Ok(()),
            Some(unknown) => Err(format!(
                "{} has a field this store does not know: `{unknown}`",
                self.what
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_line_reads_back_as_written() {
        let info = SessionInfo {
            session_id: "acme:s1".into(),
            last_seq: 12,
            created_unix_ms: 1_700_000_000_000,
            updated_unix_ms: 1_700_000_000_500,
            status: SessionStatus::Waiting as i32,
            lease: None,
            title: "fix the \"build\"\n".into(),
            forked_from: Some(ForkedFrom {
                session_id: "acme:s0".into(),
                seq: 4,
            }),
            pinned: true,
            not_before_unix_ms: 1_700_000_009_000,
        };
        let mut line = Vec::new();
        session_line(&info, &mut line);
        let text = String::from_utf8(line).expect("UTF-8");
        assert!(
            text.ends_with("}}\n") && text.matches('\n').count() == 1,
            "{text}"
        );
        assert_eq!(parse_line(text.trim_end()), Ok(Line::Session(info.clone())));
        let bare = SessionInfo {
            session_id: "s".into(),
            ..SessionInfo::default()
        };
        let mut line = Vec::new();
        session_line(&bare, &mut line);
        assert_eq!(
            String::from_utf8_lossy(&line),
            "{\"session\":{\"sessionId\":\"s\"}}\n"
        );
        assert_eq!(
            parse_line(String::from_utf8_lossy(&line).trim_end()),
            Ok(Line::Session(bare))
        );
        let end = End {
            session_id: "acme:s1".into(),
            last_seq: 12,
            events: 12,
            sha256: "ab".repeat(32),
        };
        assert_eq!(parse_line(end_line(&end).trim_end()), Ok(Line::End(end)));
        assert_eq!(
            parse_line(deleted_line("gone", 7).trim_end()),
            Ok(Line::Deleted {
                session_id: "gone".into(),
                deleted_unix_ms: 7
            })
        );
        assert_eq!(
            parse_line(header_line(5).trim_end()),
            Ok(Line::Header { version: 1 })
        );
    }

    #[test]
    fn a_bad_line_says_what_is_wrong_with_it() {
        for (line, says) in [
            (
                "{\"format\":\"agentlog-export\",\"version\":2}",
                "version 2",
            ),
            ("{\"format\":\"tar\",\"version\":1}", "not an export header"),
            ("not json", "not JSON"),
            ("[]", "not a JSON object"),
            (
                "{\"session\":{\"status\":\"BUSY\"}}",
                "not a session status",
            ),
            ("{\"end\":{\"lastSeq\":\"x\"}}", "must be an integer"),
            ("{\"session\":{\"colour\":\"red\"}}", "`colour`"),
            ("{\"seq\":\"1\",\"sessionSettings\":{}}", "sessionSettings"),
        ] {
            let e = parse_line(line).expect_err(line);
            assert!(e.contains(says), "{line}: {e}");
        }
    }
}
