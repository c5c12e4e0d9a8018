//! Whether this replica's database answers, as health reports it: SERVING while it does,
//! NOT_SERVING from the moment a call finds it gone (or its probe goes unanswered for
//! [`DB_ANSWER`]) until the probe finds it answering again.
//!
//! Promises:
//! - A database failure becomes the call's error once, here ([`Health::db_error`],
//!   [`Health::timed_error`]): a lost database or a statement past its deadline is
//!   `UNAVAILABLE` (retry) and turns health NOT_SERVING, a conflict between transactions is
//!   `UNAVAILABLE` alone, anything else `INTERNAL`.
//! - While NOT_SERVING, appends are answered at once (see [`super::batch`]), not each
//!   after waiting out the bound again; the probe looks every half second, so the replica
//!   serves again within about that of the database answering, by itself.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{watch, Notify};
use tokio_postgres::error::SqlState;
use tokio_util::sync::CancellationToken;

use super::connection::{Connector, Timed, DB_ANSWER, STATEMENT_DEADLINE};
use crate::StoreError;

/// Whether the database answers: health turns NOT_SERVING when a call finds it gone, until
/// [`watch_health`] sees it answer again.
pub(super) struct Health {
    pub(super) serving: watch::Sender<bool>,
    /// Asks [`watch_health`] to check at once.
    check: Notify,
}

impl Health {
    /// Whether the database answered the last call or probe.
    pub(super) fn serving_now(&self) -> bool {
        *self.serving.borrow()
    }

    /// The database failed us: report NOT_SERVING until the health check passes again.
    pub(super) fn lost(&self) {
        self.serving
            .send_if_modified(|up| std::mem::replace(up, false));
        self.check.notify_one();
    }

    fn db_error(&self, e: &tokio_postgres::Error) -> StoreError {
        let contended = matches!(
            e.code(),
            Some(&SqlState::T_R_SERIALIZATION_FAILURE) | Some(&SqlState::T_R_DEADLOCK_DETECTED)
        );
        let lost = match e.code() {
            None => true,
            Some(code) => {
                let c = code.code();
                c.starts_with("08")
                    || c.starts_with("57P")
                    || c.starts_with("53")
                    || *code == SqlState::READ_ONLY_SQL_TRANSACTION
            }
        };
        if contended {
            StoreError::Unavailable(format!("the database failed the call ({e}); retry"))
        } else if lost {
            self.lost();
            StoreError::Unavailable(format!("the database failed the call ({e}); retry"))
        } else {
            StoreError::Internal(format!("database: {e}"))
        }
    }

    pub(super) fn timed_error(&self, e: Timed) -> StoreError {
        match e {
            Timed::Db(e) => self.db_error(&e),
            Timed::Elapsed => {
                self.lost();
                StoreError::Unavailable(format!(
                    "the database did not answer within {} s; retry",
                    STATEMENT_DEADLINE.as_secs()
                ))
            }
        }
    }
}

/// Starts the probe ([`watch_health`]) until `shutdown`; health starts SERVING.
pub(super) fn start(connector: Arc<Connector>, shutdown: CancellationToken) -> Arc<Health> {
    let health = Arc::new(Health {
        serving: watch::channel(true).0,
        check: Notify::new(),
    });
    tokio::spawn(watch_health(connector, health.clone(), shutdown));
    health
}

/// Keeps `serving` true while the database answers: a `SELECT 1` answered within
/// [`DB_ANSWER`] on a connection of the probe's own (so that a busy pool is not taken for a
/// lost database, nor a pooled connection for a live one), every second, and at once (then
/// every half second until it answers) when a call found the database gone.
async fn watch_health(connector: Arc<Connector>, health: Arc<Health>, shutdown: CancellationToken) {
    let mut probe: Option<tokio_postgres::Client> = None;
    loop {
        let answered = tokio::time::timeout(DB_ANSWER, async {
            let client = match probe.take().filter(|c| !c.is_closed()) {
                Some(client) => client,
                None => {
                    let (client, connection) =
                        connector.pg_config.connect(connector.tls.clone()).await?;
                    tokio::spawn(connection);
                    client
                }
            };
            client.simple_query("SELECT 1").await?;
            Ok::<_, tokio_postgres::Error>(client)
        })
        .await;
        let up = match answered {
            Ok(Ok(client)) => {
                probe = Some(client);
                true
            }
            // Dropped: a connection that did not answer in time is not asked again.
            Ok(Err(_)) | Err(_) => false,
        };
        if health
            .serving
            .send_if_modified(|now| std::mem::replace(now, up) != up)
        {
            if up {
                tracing::info!("the database answers again: serving");
            } else {
                tracing::warn!(
                    "the database is unreachable: NOT_SERVING, appends answer UNAVAILABLE"
                );
            }
        }
        let wait = if up {
            Duration::from_secs(1)
        } else {
            Duration::from_millis(500)
        };
        tokio::select! {
            _ = tokio::time::sleep(wait) => {}
            _ = health.check.notified() => {}
            _ = shutdown.cancelled() => return,
        }
    }
}
