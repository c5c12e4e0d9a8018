//! The authorization rule: whether a caller may make a call on a session, answered with a
//! typed [`Denial`] that becomes the status the caller gets.

use agentlog_proto::kept::KeptAppendRequest;
use agentlog_proto::reason::Reason;
use tonic::{Code, Status};

use super::{Caller, Role};
use crate::session::{is_runner_kind, kind_name};
use crate::wire::Rpc;

/// Why a call is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Denial {
    /// The caller's role or prefixes do not allow the call: `PERMISSION_DENIED`, saying why.
    Forbidden(String),
    /// A read of a session outside the caller's scope: answered word for word as a session
    /// that does not exist (`NOT_FOUND`, `SESSION_NOT_FOUND`), so that the answer says
    /// nothing about whether it does.
    Hidden { session_id: String },
}

impl Denial {
    pub fn code(&self) -> Code {
        match self {
            Denial::Forbidden(_) => Code::PermissionDenied,
            Denial::Hidden { .. } => Code::NotFound,
        }
    }
}

impl From<Denial> for Status {
    fn from(denial: Denial) -> Status {
        match denial {
            Denial::Forbidden(message) => Status::permission_denied(message),
            Denial::Hidden { session_id } => {
                Reason::SessionNotFound.status(format!("session {session_id} does not exist"))
            }
        }
    }
}

/// What the auth decision needs from a request message.
#[derive(Debug, Default)]
pub struct Target {
    /// The session the request names (empty for List/Claim).
    pub session_id: String,
    /// `ForkSession`'s `new_session_id` (empty: the store names the fork within the
    /// caller's scope).
    pub new_session_id: String,
    /// For an append: each event's kind (`None`: no kind; validation refuses it) and
    /// whether its id names a replay's recorded user turn (`replay:user:<seq>`).
    pub kinds: Vec<(Option<agentlog_proto::v1::event::Kind>, bool)>,
    /// For an append: whether it names a lease epoch (a runner writing under its lease).
    pub leased: bool,
}

/// Whether `caller` may make the call `rpc` on `target`. This is the whole rule; the store
/// applies `caller.scope` to what List and Claim return.
pub fn authorize(caller: &Caller, rpc: Rpc, target: &Target) -> Result<(), Denial> {
    if caller.role == Role::Admin {
        return Ok(());
    }
    let who = &caller.name;
    if rpc == Rpc::Import {
        // An import writes sessions whole, past every rule of a session's own: an
        // operator's call.
        return Err(Denial::Forbidden(format!(
            "token {who:?} may not call Import; that needs an admin token"
        )));
    }
    let refused = match (caller.role, rpc) {
        (
            _,
            Rpc::Append
            | Rpc::AppendStream
            | Rpc::Subscribe
            | Rpc::GetSession
            | Rpc::ListSessions
            | Rpc::GetSnapshot,
        ) => None,
        // An export is a read, of the caller's scope.
        (_, Rpc::Export) => None,
        // Any role, within its scope (the backend searches only the scope's sessions).
        (_, Rpc::SearchSessions) => None,
        // What a person decides on a session's life is not a runner's to do.
        (Role::Runner, Rpc::DeleteSession | Rpc::ForkSession | Rpc::PinSession) => {
            Some(("runner", "a client"))
        }
        (Role::Runner, _) => None,
        (Role::Client, Rpc::DeleteSession | Rpc::ForkSession | Rpc::PinSession) => None,
        (Role::Client, _) => Some(("client", "a runner")),
        (Role::Admin, _) => None,
    };
    if let Some((role, needed)) = refused {
        return Err(Denial::Forbidden(format!(
            "token {who:?} (role {role}) may not call {rpc:?}; that needs {needed} or admin token"
        )));
    }
    if matches!(
        rpc,
        Rpc::ListSessions
            | Rpc::ClaimSession
            | Rpc::AppendStream
            | Rpc::PutSnapshot
            | Rpc::Export
            | Rpc::Import
    ) || rpc == Rpc::SearchSessions
    {
        return Ok(());
    }
    if !caller.scope.admits(&target.session_id) {
        return Err(if rpc.is_read() {
            Denial::Hidden {
                session_id: target.session_id.clone(),
            }
        } else {
            outside_prefixes(caller, &target.session_id)
        });
    }
    if rpc == Rpc::ForkSession
        && !target.new_session_id.is_empty()
        && !caller.scope.admits(&target.new_session_id)
    {
        return Err(outside_prefixes(caller, &target.new_session_id));
    }
    if rpc == Rpc::Append {
        check_kinds(
            caller,
            target.leased,
            target
                .kinds
                .iter()
                .map(|(kind, replayed)| (kind.as_ref(), *replayed)),
        )?;
    }
    Ok(())
}

/// Whether `caller` may make this append (one request of an `AppendStream`): the rule of
/// [`authorize`] for [`Rpc::Append`], read from the message itself.
pub fn authorize_append(caller: &Caller, append: &KeptAppendRequest) -> Result<(), Denial> {
    if caller.role == Role::Admin {
        return Ok(());
    }
    let request = &append.request;
    if !caller.scope.admits(&request.session_id) {
        return Err(outside_prefixes(caller, &request.session_id));
    }
    check_kinds(
        caller,
        request.lease_epoch.is_some(),
        append
            .events
            .iter()
            .map(|e| (e.kind.as_ref(), is_replayed_turn(&e.event_id))),
    )
}

/// Whether `caller` (admitted to [`Rpc::PutSnapshot`] by role in [`authorize`]) may keep
/// a snapshot of `session_id`: the session must be within the token's prefixes.
pub fn authorize_snapshot_put(caller: &Caller, session_id: &str) -> Result<(), Denial> {
    if caller.role == Role::Admin || caller.scope.admits(session_id) {
        return Ok(());
    }
    Err(outside_prefixes(caller, session_id))
}

/// Whether an event id names a replay's recorded user turn (`replay:user:<seq>`).
pub fn is_replayed_turn(event_id: &str) -> bool {
    agentlog_proto::replay::user_seq_of(event_id).is_some()
}

/// Clients append a person's kinds only (a user message, an interrupt, an approval
/// decision, a session config), runners the runner-written kinds only: never a person's,
/// but for one user message, a replay's recorded turn, which the runner appends under its
/// lease once the replay's previous turn ended (its id `replay:user:<seq>`, and its seq one
/// the session's replay holds: `crate::rules::check_replayed_turns`).
fn check_kinds<'a>(
    caller: &Caller,
    leased: bool,
    kinds: impl Iterator<Item = (Option<&'a agentlog_proto::v1::event::Kind>, bool)>,
) -> Result<(), Denial> {
    if caller.role == Role::Admin {
        return Ok(());
    }
    let who = &caller.name;
    let client = caller.role == Role::Client;
    for (i, (kind, replayed)) in kinds.enumerate() {
        let Some(kind) = kind else { continue };
        let replayed_turn = !client
            && leased
            && replayed
            && matches!(kind, agentlog_proto::v1::event::Kind::UserMessage(_));
        if is_runner_kind(kind) == client && !replayed_turn {
            return Err(Denial::Forbidden(format!(
                "events[{i}]: token {who:?} (role {}) may not append {}; {}",
                if client { "client" } else { "runner" },
                kind_name(kind),
                if client {
                    "clients append user_message, interrupt, approval_decision and session_config \
                     only"
                } else {
                    "runners append the runner-written kinds only (assistant_message, \
                     tool_started, tool_result, assistant_delta, run_error, interrupted, \
                     approval_requested, model_retry, run_paused; and under their lease a \
                     replay's recorded user_message, as replay:user:<seq>)"
                }
            )));
        }
    }
    Ok(())
}

fn outside_prefixes(caller: &Caller, session_id: &str) -> Denial {
    Denial::Forbidden(format!(
        "token {:?} may not write to session {session_id:?}: it is outside the token's \
         prefixes",
        caller.name
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scope::Scope;

    fn acme() -> Caller {
        Caller {
            name: "acme".into(),
            role: Role::Client,
            scope: Scope::prefixes(vec!["acme:".into()]),
            authenticated: true,
        }
    }

    fn pool() -> Caller {
        Caller {
            name: "pool".into(),
            role: Role::Runner,
            scope: Scope::everything(),
            authenticated: true,
        }
    }

    #[test]
    fn each_request_of_an_append_stream_is_authorized_like_an_append() {
        let (acme, pool) = (&acme(), &pool());
        let request = |id: &str, kind: agentlog_proto::v1::event::Kind| KeptAppendRequest {
            request: agentlog_proto::v1::AppendRequest {
                session_id: id.into(),
                ..Default::default()
            },
            events: vec![agentlog_proto::kept::KeptEvent::new(
                agentlog_proto::v1::Event {
                    kind: Some(kind),
                    ..Default::default()
                },
            )],
        };
        let user = || agentlog_proto::v1::event::Kind::UserMessage(Default::default());
        let result = || agentlog_proto::v1::event::Kind::ToolResult(Default::default());
        let code = |r: Result<(), Denial>| r.err().map(|s| s.code());
        use tonic::Code::*;
        assert_eq!(
            code(authorize(acme, Rpc::AppendStream, &Target::default())),
            None
        );
        assert_eq!(
            code(authorize_append(acme, &request("acme:1", user()))),
            None
        );
        assert_eq!(
            code(authorize_append(acme, &request("acme:1", result()))),
            Some(PermissionDenied)
        );
        assert_eq!(
            code(authorize_append(acme, &request("beta:1", user()))),
            Some(PermissionDenied)
        );
        assert_eq!(
            code(authorize_append(pool, &request("beta:1", result()))),
            None
        );
        assert_eq!(
            code(authorize_append(pool, &request("beta:1", user()))),
            Some(PermissionDenied)
        );
    }

    #[test]
    fn each_role_appends_its_own_kinds_only_a_runner_a_person_s_turn_only_as_a_replay_s() {
        use agentlog_proto::v1::event::Kind;
        let (acme, pool) = (&acme(), &pool());
        let target = |kind: Kind, replayed: bool, leased: bool| Target {
            session_id: "beta:1".into(),
            kinds: vec![(Some(kind), replayed)],
            leased,
            ..Target::default()
        };
        let allowed = |caller: &Caller, t: Target| authorize(caller, Rpc::Append, &t).is_ok();
        let user = || Kind::UserMessage(Default::default());
        // A runner under its lease: a user message only as a replay's recorded turn.
        assert!(!allowed(pool, target(user(), false, true)));
        assert!(allowed(pool, target(user(), true, true)));
        assert!(!allowed(pool, target(user(), true, false)));
        for person in [
            Kind::Interrupt(Default::default()),
            Kind::ApprovalDecision(Default::default()),
            Kind::SessionConfig(Default::default()),
        ] {
            assert!(!allowed(pool, target(person, false, true)));
        }
        // A client: none of the runner's kinds, the new ones included.
        let acme_target = |kind: Kind| Target {
            session_id: "acme:1".into(),
            kinds: vec![(Some(kind), false)],
            ..Target::default()
        };
        for runner in [
            Kind::ModelRetry(Default::default()),
            Kind::RunPaused(Default::default()),
            Kind::AssistantMessage(Default::default()),
        ] {
            assert!(!allowed(acme, acme_target(runner)));
        }
        assert!(allowed(acme, acme_target(user())));
    }

    #[test]
    fn roles_and_scopes() {
        let (acme, pool) = (&acme(), &pool());
        let user = Some(agentlog_proto::v1::event::Kind::UserMessage(
            Default::default(),
        ));
        let result = Some(agentlog_proto::v1::event::Kind::ToolResult(
            Default::default(),
        ));
        let append = |id: &str, kinds: Vec<Option<agentlog_proto::v1::event::Kind>>| Target {
            session_id: id.into(),
            kinds: kinds.into_iter().map(|k| (k, false)).collect(),
            ..Target::default()
        };
        let code = |r: Result<(), Denial>| r.err().map(|s| s.code());
        use tonic::Code::*;
        assert_eq!(
            code(authorize(
                acme,
                Rpc::Append,
                &append("acme:1", vec![user.clone()])
            )),
            None
        );
        assert_eq!(
            code(authorize(
                acme,
                Rpc::Append,
                &append("acme:1", vec![result.clone()])
            )),
            Some(PermissionDenied)
        );
        assert_eq!(
            code(authorize(
                acme,
                Rpc::Append,
                &append("beta:1", vec![user.clone()])
            )),
            Some(PermissionDenied)
        );
        assert_eq!(
            code(authorize(acme, Rpc::GetSession, &append("beta:1", vec![]))),
            Some(NotFound)
        );
        assert_eq!(
            code(authorize(acme, Rpc::ClaimSession, &Target::default())),
            Some(PermissionDenied)
        );
        assert_eq!(
            code(authorize(
                pool,
                Rpc::Append,
                &append("beta:1", vec![result])
            )),
            None
        );
        assert_eq!(
            code(authorize(pool, Rpc::Append, &append("beta:1", vec![user]))),
            Some(PermissionDenied)
        );
        assert_eq!(
            code(authorize(
                pool,
                Rpc::AcquireLease,
                &append("beta:1", vec![])
            )),
            None
        );
        // Snapshots: runners keep them, clients and runners read them within their scope.
        assert_eq!(
            code(authorize(acme, Rpc::PutSnapshot, &Target::default())),
            Some(PermissionDenied)
        );
        assert_eq!(
            code(authorize(pool, Rpc::PutSnapshot, &Target::default())),
            None
        );
        assert_eq!(
            code(authorize(acme, Rpc::GetSnapshot, &append("acme:1", vec![]))),
            None
        );
        assert_eq!(
            code(authorize(acme, Rpc::GetSnapshot, &append("beta:1", vec![]))),
            Some(NotFound)
        );
    }

    #[test]
    fn a_fork_needs_a_client_whose_scope_holds_the_parent_and_the_fork() {
        let (acme, pool) = (&acme(), &pool());
        let fork = |parent: &str, new: &str| Target {
            session_id: parent.into(),
            new_session_id: new.into(),
            ..Target::default()
        };
        let code = |r: Result<(), Denial>| r.err().map(|s| s.code());
        use tonic::Code::*;
        assert_eq!(
            code(authorize(acme, Rpc::ForkSession, &fork("acme:1", "acme:2"))),
            None
        );
        // Left empty, the store names the fork within the caller's scope.
        assert_eq!(
            code(authorize(acme, Rpc::ForkSession, &fork("acme:1", ""))),
            None
        );
        assert_eq!(
            code(authorize(acme, Rpc::ForkSession, &fork("acme:1", "beta:2"))),
            Some(PermissionDenied)
        );
        assert_eq!(
            code(authorize(acme, Rpc::ForkSession, &fork("beta:1", "acme:2"))),
            Some(PermissionDenied)
        );
        assert_eq!(
            code(authorize(pool, Rpc::ForkSession, &fork("s1", "s2"))),
            Some(PermissionDenied)
        );
    }

    #[test]
    fn a_snapshot_is_kept_only_within_the_runners_prefixes() {
        let scoped = Caller {
            name: "acme-runners".into(),
            role: Role::Runner,
            scope: Scope::prefixes(vec!["acme:".into()]),
            authenticated: true,
        };
        assert_eq!(authorize_snapshot_put(&scoped, "acme:1"), Ok(()));
        assert_eq!(
            authorize_snapshot_put(&scoped, "beta:1").map_err(|d| d.code()),
            Err(Code::PermissionDenied)
        );
        assert_eq!(authorize_snapshot_put(&pool(), "beta:1"), Ok(()));
    }
}
