//! What arrives on the wire, worked out once per request and shared by the layers and the
//! service: which call a request is ([`Route`], from its path; the auth layer puts it in
//! the request extensions for the limits layer and the service), and how big a request and
//! its fields may be.

/// Events in one append, at most.
pub const MAX_EVENTS_PER_APPEND: usize = 1000;
/// One event's encoded size, at most.
pub const MAX_EVENT_BYTES: usize = 1 << 20;
/// One append request's encoded size, at most.
pub const MAX_APPEND_BYTES: usize = 4 << 20;
/// Frames up to this size are decoded so that an oversized append gets our clear
/// RESOURCE_EXHAUSTED; beyond it the transport refuses the frame itself.
pub const MAX_DECODED_FRAME_BYTES: usize = 16 << 20;
/// Session ids and lease owners, in bytes.
pub const MAX_ID_LEN: usize = 128;
pub const MAX_EVENT_ID_LEN: usize = 256;
pub const MAX_TTL_MS: u64 = 10 * 60 * 1000;
pub const MAX_WAIT_MS: u64 = 5 * 60 * 1000;

/// The RPCs of `agentlog.v1.EventStore`, by what they touch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rpc {
    Append,
    /// Authorized per request, in the service, as [`Rpc::Append`] (see
    /// [`authorize_append`]).
    AppendStream,
    Subscribe,
    GetSession,
    ListSessions,
    ClaimSession,
    AcquireLease,
    RenewLease,
    ReleaseLease,
    /// Streamed: the role is checked by the auth layer, the session by the service on the
    /// first chunk (see `authorize_snapshot_put`).
    PutSnapshot,
    GetSnapshot,
    DeleteSession,
    /// Names two sessions: the parent (field 1, checked by the auth layer) and the fork,
    /// checked by the service.
    ForkSession,
    // Sessions that move.
    /// A read: the role is checked by the auth layer, the sessions it names (or, with
    /// `all`, walks) by the service against the caller's scope.
    Export,
    /// Streamed; admin tokens only.
    Import,
    PinSession,
    /// Names no session: the service searches within the caller's scope.
    SearchSessions,
}

impl Rpc {
    pub const ALL: [Rpc; 17] = [
        Rpc::Append,
        Rpc::AppendStream,
        Rpc::Subscribe,
        Rpc::GetSession,
        Rpc::ListSessions,
        Rpc::ClaimSession,
        Rpc::AcquireLease,
        Rpc::RenewLease,
        Rpc::ReleaseLease,
        Rpc::PutSnapshot,
        Rpc::GetSnapshot,
        Rpc::DeleteSession,
        Rpc::ForkSession,
        Rpc::Export,
        Rpc::Import,
        Rpc::PinSession,
        Rpc::SearchSessions,
    ];

    pub fn from_method(method: &str) -> Option<Rpc> {
        Some(match method {
            "Append" => Rpc::Append,
            "AppendStream" => Rpc::AppendStream,
            "Subscribe" => Rpc::Subscribe,
            "GetSession" => Rpc::GetSession,
            "ListSessions" => Rpc::ListSessions,
            "ClaimSession" => Rpc::ClaimSession,
            "AcquireLease" => Rpc::AcquireLease,
            "RenewLease" => Rpc::RenewLease,
            "ReleaseLease" => Rpc::ReleaseLease,
            "PutSnapshot" => Rpc::PutSnapshot,
            "GetSnapshot" => Rpc::GetSnapshot,
            "DeleteSession" => Rpc::DeleteSession,
            "ForkSession" => Rpc::ForkSession,
            "Export" => Rpc::Export,
            "Import" => Rpc::Import,
            "PinSession" => Rpc::PinSession,
            "SearchSessions" => Rpc::SearchSessions,
            _ => return None,
        })
    }

    /// Reads answer `NOT_FOUND` outside the scope (no existence leak); writes
    /// `PERMISSION_DENIED`.
    pub fn is_read(self) -> bool {
        matches!(
            self,
            Rpc::Subscribe | Rpc::GetSession | Rpc::ListSessions | Rpc::GetSnapshot | Rpc::Export
        ) || self == Rpc::SearchSessions
    }
}

/// What a request is, from its path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// Health: open, for probes.
    Open,
    /// Reflection, or a path that names no RPC of ours: any valid token.
    AnyCaller,
    Store(Rpc),
}

pub fn route(path: &str) -> Route {
    if path.starts_with("/grpc.health.v1.Health/") {
        return Route::Open;
    }
    match path.strip_prefix("/agentlog.v1.EventStore/") {
        Some(method) => Rpc::from_method(method).map_or(Route::AnyCaller, Route::Store),
        None => Route::AnyCaller,
    }
}

impl Route {
    /// The route the auth layer worked out for `request`, or (without that layer) from
    /// its path.
    pub fn of<B>(request: &tonic::codegen::http::Request<B>) -> Route {
        request
            .extensions()
            .get::<Route>()
            .copied()
            .unwrap_or_else(|| route(request.uri().path()))
    }
}
