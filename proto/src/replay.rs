//! The event ids of a replay's own appends that every writer of it must agree on: the
//! recording's user turns, appended once each (by the runner when a turn ends, or by
//! `agentlog replay` when the fork point ends a turn), so that whoever appends one again
//! writes nothing.

/// The event id of the recording's user message at `recorded_seq`, replayed.
pub fn user_event_id(recorded_seq: u64) -> String {
    format!("replay:user:{recorded_seq}")
}

/// The recorded seq a replayed user message's event id names.
pub fn user_seq_of(event_id: &str) -> Option<u64> {
    event_id.strip_prefix("replay:user:")?.parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_id_names_its_recorded_seq() {
        assert_eq!(user_seq_of(&user_event_id(42)), Some(42));
        assert_eq!(user_seq_of("user:42"), None);
        assert_eq!(user_seq_of("replay:user:x"), None);
    }
}
