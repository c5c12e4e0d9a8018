//! What a request must be before any backend sees it: ids, owners, formats, ttls, and an
//! append's counts, sizes and kinds. Each refusal names the field and what to fix.

use agentlog_proto::kept::{Kept, KeptAppendRequest, KeptForkRequest};
use agentlog_proto::v1::{event, AppendRequest, Durability, SearchSessionsRequest, SessionConfig};

use crate::backend::{AppendOp, ForkOp, SearchOp};
use crate::error::StoreError;
use crate::scope::Scope;
use crate::wire::{
    MAX_APPEND_BYTES, MAX_EVENTS_PER_APPEND, MAX_EVENT_BYTES, MAX_EVENT_ID_LEN, MAX_ID_LEN,
    MAX_TTL_MS,
};

const MAX_FORMAT_LEN: usize = 64;

pub(super) fn invalid(message: String) -> StoreError {
    StoreError::InvalidArgument(message)
}

/// Quotes a caller's value in an error message without echoing a megabyte back.
fn shown(value: &str) -> String {
    let mut s: String = value.chars().take(40).collect();
    if s.len() < value.len() {
        s.push('…');
    }
    format!("{s:?}")
}

/// A session id: 1-128 chars of `[A-Za-z0-9._:-]`, starting with a letter or digit.
pub fn validate_session_id(id: &str) -> Result<(), StoreError> {
    validate_id_field("session_id", id)
}

fn validate_id_field(field: &str, id: &str) -> Result<(), StoreError> {
    if crate::session::is_valid_id(id) {
        Ok(())
    } else {
        Err(invalid(format!(
            "{field}: {} is not valid; use 1-128 characters of [A-Za-z0-9._:-] starting \
             with a letter or digit",
            shown(id)
        )))
    }
}

pub(super) fn validate_owner(owner: &str) -> Result<(), StoreError> {
    if owner.is_empty() || owner.len() > MAX_ID_LEN || owner.chars().any(char::is_control) {
        return Err(invalid(format!(
            "owner: {} is not valid; name the lease holder in 1-128 printable characters",
            shown(owner)
        )));
    }
    Ok(())
}

/// A snapshot format: 1-64 chars of `[A-Za-z0-9._-]`, starting with a letter or digit.
pub(super) fn validate_format(format: &str) -> Result<(), StoreError> {
    let ok = !format.is_empty()
        && format.len() <= MAX_FORMAT_LEN
        && format.as_bytes()[0].is_ascii_alphanumeric()
        && format
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
    if ok {
        Ok(())
    } else {
        Err(invalid(format!(
            "format: {} is not valid; use 1-{MAX_FORMAT_LEN} characters of [A-Za-z0-9._-] \
             starting with a letter or digit",
            shown(format)
        )))
    }
}

pub(super) fn validate_ttl(ttl_ms: u64) -> Result<(), StoreError> {
    if ttl_ms == 0 || ttl_ms > MAX_TTL_MS {
        return Err(invalid(format!(
            "ttl_ms: {ttl_ms} is out of range; use 1 to {MAX_TTL_MS} milliseconds"
        )));
    }
    Ok(())
}

/// Every kind an event may have, by its field name, for the refusal of an event with none.
const KINDS: &str = "user_message, assistant_message, tool_started, tool_result, \
                     assistant_delta, run_error, interrupt, interrupted, approval_requested, \
                     approval_decision, session_config";

/// Checks everything about an append that needs no state: ids, counts, sizes, kinds. An
/// event's size is that of its bytes as they came (a field this build does not know
/// counts).
pub fn validate_append(req: KeptAppendRequest) -> Result<AppendOp, StoreError> {
    let total = req.encoded_len();
    let Kept {
        request: req,
        events,
    } = req;
    validate_session_id(&req.session_id)?;
    if total > MAX_APPEND_BYTES {
        return Err(StoreError::ResourceExhausted(format!(
            "the append request is {total} bytes, over the limit of {MAX_APPEND_BYTES} (4 MiB); \
             split it into several appends"
        )));
    }
    if events.is_empty() || events.len() > MAX_EVENTS_PER_APPEND {
        return Err(invalid(format!(
            "events: {} given; an append carries 1 to {MAX_EVENTS_PER_APPEND} events",
            events.len()
        )));
    }
    let durability = Durability::try_from(req.durability).map_err(|_| {
        invalid(format!(
            "durability: {} is not a Durability (use DURABILITY_SYNC or DURABILITY_BUFFERED)",
            req.durability
        ))
    })?;
    for (i, event) in events.iter().enumerate() {
        let size = event.encoded_len();
        if size > MAX_EVENT_BYTES {
            return Err(StoreError::ResourceExhausted(format!(
                "events[{i}]: {size} bytes, over the limit of {MAX_EVENT_BYTES} (1 MiB) per event"
            )));
        }
        if event.kind.is_none() {
            return Err(match event.unknown_kind() {
                // A newer writer's kind: refused for now, not for good, so that a writer of a
                // later release goes on as its previous release would until this store knows it.
                Some(number) => StoreError::UnknownKind {
                    field_number: number,
                    message: format!(
                        "events[{i}]: the kind of field number {number} is not one this store \
                         knows (it is release {}); append it to a store of a later release, or \
                         write what the previous release wrote",
                        agentlog_proto::release::VERSION
                    ),
                },
                None => invalid(format!(
                    "events[{i}].kind: an event needs exactly one kind ({KINDS})"
                )),
            });
        }
        if let Some(event::Kind::SessionConfig(config)) = &event.kind {
            validate_session_config(i, config)?;
        }
        if !event.session_id.is_empty() && event.session_id != req.session_id {
            return Err(invalid(format!(
                "events[{i}].session_id: {} differs from the request's session_id {}; leave it \
                 empty",
                shown(&event.session_id),
                shown(&req.session_id)
            )));
        }
        if event.event_id.len() > MAX_EVENT_ID_LEN || event.event_id.chars().any(char::is_control) {
            return Err(invalid(format!(
                "events[{i}].event_id: {} is not valid; use up to {MAX_EVENT_ID_LEN} bytes of \
                 printable characters",
                shown(&event.event_id)
            )));
        }
    }
    Ok(AppendOp {
        session_id: req.session_id,
        events,
        expected_last_seq: req.expected_last_seq,
        lease_epoch: req.lease_epoch,
        durability,
    })
}

/// Whether `model` names one as `PROVIDER:MODEL`.
fn is_model(model: &str) -> bool {
    model
        .split_once(':')
        .is_some_and(|(provider, name)| !provider.is_empty() && !name.is_empty())
        && !model.chars().any(char::is_control)
}

/// A `session_config`: a model as `PROVIDER:MODEL` (or none, keeping the earlier one, when
/// it sets fallbacks or a budget), fallbacks likewise, and a replay that names a model, a
/// session and a range of its seqs.
fn validate_session_config(i: usize, config: &SessionConfig) -> Result<(), StoreError> {
    let not_a_model = |field: String, model: &str| {
        invalid(format!(
            "{field}: {} is not PROVIDER:MODEL (anthropic:MODEL, openai:MODEL or scripted:FILE)",
            shown(model)
        ))
    };
    let sets_other = !config.fallback_models.is_empty() || config.budget.is_some();
    let keeps_model = config.model.is_empty() && sets_other && config.replay.is_none();
    if !keeps_model && !is_model(&config.model) {
        return Err(not_a_model(
            format!("events[{i}].session_config.model"),
            &config.model,
        ));
    }
    for (j, model) in config.fallback_models.iter().enumerate() {
        if !is_model(model) {
            return Err(not_a_model(
                format!("events[{i}].session_config.fallback_models[{j}]"),
                model,
            ));
        }
    }
    if let Some(replay) = &config.replay {
        validate_id_field(
            &format!("events[{i}].session_config.replay.session_id"),
            &replay.session_id,
        )?;
        if replay.through_seq < replay.after_seq {
            return Err(invalid(format!(
                "events[{i}].session_config.replay: through_seq {} is before after_seq {}; the \
                 recording is the seqs after after_seq up to through_seq",
                replay.through_seq, replay.after_seq
            )));
        }
    }
    Ok(())
}

/// Checks a fork request and names the fork if the caller did not: `fork-<uuid>` after the
/// first of the caller's prefixes that holds the parent, so the new id is in its scope too.
pub fn validate_fork(req: KeptForkRequest, scope: &Scope) -> Result<ForkOp, StoreError> {
    let Kept {
        request: req,
        events,
    } = req;
    validate_session_id(&req.session_id)?;
    if req.at_seq == 0 {
        return Err(invalid(
            "at_seq: 0 names no event; give the last seq of the parent the fork takes (a \
             settled point)"
                .into(),
        ));
    }
    let new_session_id = if req.new_session_id.is_empty() {
        let prefix = scope
            .prefix_list()
            .and_then(|prefixes| {
                prefixes
                    .iter()
                    .find(|p| req.session_id.starts_with(p.as_str()))
            })
            .map_or("", String::as_str);
        let made = format!("{prefix}fork-{}", crate::ids::random_uuid().simple());
        validate_id_field("new_session_id", &made).map_err(|_| {
            invalid(format!(
                "new_session_id: the id the store would make ({made}) is too long; name one"
            ))
        })?;
        made
    } else {
        validate_id_field("new_session_id", &req.new_session_id)?;
        req.new_session_id
    };
    let events = if events.is_empty() {
        Vec::new()
    } else {
        // The same limits and checks as an append of them to the fork.
        validate_append(Kept {
            request: AppendRequest {
                session_id: new_session_id.clone(),
                ..AppendRequest::default()
            },
            events,
        })?
        .events
    };
    Ok(ForkOp {
        parent: req.session_id,
        at_seq: req.at_seq,
        new_session_id,
        events,
    })
}

/// A search: its query parsed (an empty one, an unclosed quote, one over 1 KiB or without a
/// word is refused, saying which), its page size within bounds.
pub fn validate_search(req: SearchSessionsRequest) -> Result<SearchOp, StoreError> {
    let query = crate::search::parse(&req.query).map_err(|e| invalid(e.to_string()))?;
    let page_size = match req.page_size as usize {
        0 => crate::search::DEFAULT_PAGE_SIZE,
        n if n <= crate::search::MAX_PAGE_SIZE => n,
        n => {
            return Err(invalid(format!(
                "page_size: {n} is over the limit of {}",
                crate::search::MAX_PAGE_SIZE
            )))
        }
    };
    Ok(SearchOp {
        query,
        page_size,
        page_token: req.page_token,
    })
}
