//! Checkpoints in an object store (`runner --checkpoint-store s3://BUCKET/PREFIX`, `gs://`,
//! `az://`), so that runners share no volume: each keeps the checkpoint area beside its own
//! workspaces as a cache, and the object store is where a checkpoint lives.
//!
//! Layout, every name under `PREFIX/` (nothing else of the bucket is read or written):
//!
//! | object | what |
//! |---|---|
//! | `blobs/<sha256>` | a file's content, as in the local area |
//! | `trees/<sha256>` | a directory's entries; a checkpoint's id is its root tree's |
//! | `sessions/<id>/refs/<checkpoint>` | empty: the session's log may name that checkpoint |
//! | `sessions/<id>/adopted` | a fork's refs hold every checkpoint its copied prefix names |
//! | `gc/state` | the sweep's generation and, while one runs, until when (`remote_gc.rs`) |
//!
//! Promises:
//! - [`Remote::upload`] returns only once the store has acknowledged every object the
//!   checkpoint names, so a `tool_result` naming it is appended only then. An object the
//!   store holds already is neither uploaded nor rewritten (asked with `HEAD`); an object of
//!   the checkpoint the session's previous upload sent is not even asked about.
//! - Against the sweep (`remote_gc.rs`), which removes what no session's refs reach: the
//!   reference is stored before any object, and an object not uploaded because the store
//!   held it (content another session stored) is asked about again, and stored again if
//!   gone, until no sweep ran or was running from before the first `HEAD` until after the
//!   last ([`GcState`]); so a sweep that missed the new reference never removes what the
//!   checkpoint reuses.
//! - [`Remote::fetch`] brings every object of a checkpoint the local area lacks, checking
//!   each against its hash before it is kept: a corrupt object is never restored.
//! - A store that does not answer is retried without limit (backoff from 0.2 s to 10 s),
//!   and [`Remote::healthy`] says so meanwhile; the caller's future is dropped when the
//!   session's work stops, which ends the retries.
//! - Credentials come from the standard variables (`AWS_*`, `GOOGLE_*`, `AZURE_*`), which
//!   the runner takes from its environment at start and wipes (`secrets.rs`): no tool, log
//!   line or event sees them.

use std::collections::HashSet;
use std::fmt;
use std::future::Future;
use std::io;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::stream::{self, StreamExt, TryStreamExt};
use object_store::path::Path as ObjectPath;
use object_store::{
    ClientOptions, ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload, RetryConfig,
};

use super::area::{hex, sha256, Area, Hash, Kind, Pending};
use super::health;
use super::tree::{EntryKind, Tree};

/// Requests in flight at once during an upload or a fetch (also the parallelism of
/// `agentlog-bench-checkpoints`' baseline download, which it is measured against).
pub const PARALLEL: usize = 16;
/// The first and the longest wait between two tries of a request the store did not answer.
const FIRST_BACKOFF: Duration = Duration::from_millis(200);
const LONGEST_BACKOFF: Duration = Duration::from_secs(10);
/// A request unanswered this long marks the store unhealthy (it is still waited for, up to
/// the client's timeout).
const SLOW: Duration = Duration::from_secs(5);
/// Objects up to this size are stored with one conditional `PUT` instead of `HEAD`, `PUT`.
pub const SMALL_OBJECT: u64 = 64 * 1024;

/// Where checkpoints live (`runner --checkpoint-store`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreUrl {
    /// `file://` (the checkpoint area beside the workspaces, `<workspace-root>/.checkpoints`)
    /// or `file:///PATH` (the area at `PATH`, on the workspaces' file system).
    Local(Option<PathBuf>),
    /// `s3://`, `gs://` or `az://`: an object store.
    Object {
        scheme: Scheme,
        bucket: String,
        prefix: String,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    S3,
    Gcs,
    Azure,
}

impl StoreUrl {
    /// Reads `--checkpoint-store`; the error says what is wrong and what is accepted.
    pub fn parse(text: &str) -> Result<StoreUrl, String> {
        let accepted = "file://, s3://BUCKET/PREFIX, gs://BUCKET/PREFIX or az://CONTAINER/PREFIX";
        let (scheme, rest) = text
            .split_once("://")
            .ok_or_else(|| format!("--checkpoint-store {text:?} is not a URL: use {accepted}"))?;
        let scheme = match scheme {
            "file" => {
                return match rest {
                    "" => Ok(StoreUrl::Local(None)),
                    path if path.starts_with('/') => Ok(StoreUrl::Local(Some(path.into()))),
                    _ => Err(format!(
                        "--checkpoint-store {text:?}: a file:// URL names an absolute path \
                         (file:///PATH) or none (file://)"
                    )),
                };
            }
            "s3" => Scheme::S3,
            "gs" => Scheme::Gcs,
            "az" => Scheme::Azure,
            other => {
                return Err(format!(
                    "--checkpoint-store {text:?}: unknown scheme {other:?}: use {accepted}"
                ))
            }
        };
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if bucket.is_empty() {
            return Err(format!("--checkpoint-store {text:?} names no bucket"));
        }
        let prefix = prefix.trim_matches('/');
        if prefix.split('/').any(|part| part == "." || part == "..") || prefix.contains("//") {
            return Err(format!(
                "--checkpoint-store {text:?}: the prefix {prefix:?} holds an empty, `.` or `..` part"
            ));
        }
        Ok(StoreUrl::Object {
            scheme,
            bucket: bucket.to_string(),
            prefix: prefix.to_string(),
        })
    }
}

impl fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StoreUrl::Local(None) => write!(f, "file://"),
            StoreUrl::Local(Some(path)) => write!(f, "file://{}", path.display()),
            StoreUrl::Object {
                scheme,
                bucket,
                prefix,
            } => {
                let scheme = match scheme {
                    Scheme::S3 => "s3",
                    Scheme::Gcs => "gs",
                    Scheme::Azure => "az",
                };
                write!(f, "{scheme}://{bucket}/{prefix}")
            }
        }
    }
}

/// The object store checkpoints live in.
#[derive(Clone)]
pub struct Remote {
    store: Arc<dyn ObjectStore>,
    prefix: String,
    url: String,
    healthy: Arc<AtomicBool>,
    /// Whether the store has answered a listing of the prefix ([`Remote::reach`]).
    reached: Arc<AtomicBool>,
    /// Whether the store takes `If-None-Match: *` writes (until it says it does not).
    conditional_puts: Arc<AtomicBool>,
}

impl fmt::Debug for Remote {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Remote").field("url", &self.url).finish()
    }
}

impl Remote {
    /// The object store `url` names, configured by `env`: the standard variables of its
    /// cloud (`AWS_*`, `GOOGLE_*`, `AZURE_*`, as the runner took them from its environment
    /// at start). With `AWS_ENDPOINT_URL` set its scheme is used as given (plain `http://`
    /// for a local server), with path-style requests. Builds the client only: nothing is
    /// asked yet.
    pub fn open(url: &StoreUrl, env: &[(String, String)]) -> Result<Remote, String> {
        let StoreUrl::Object {
            scheme,
            bucket,
            prefix,
        } = url
        else {
            return Err("file:// is the local checkpoint area, not an object store".into());
        };
        // Each request: its own timeout, a few quick tries inside the client; the retries
        // without limit are this module's (`retrying`), which also tell the health.
        let options = ClientOptions::new()
            .with_connect_timeout(Duration::from_secs(5))
            .with_timeout(Duration::from_secs(30));
        let retry = RetryConfig {
            max_retries: 2,
            retry_timeout: Duration::from_secs(30),
            ..RetryConfig::default()
        };
        let settings = |prefix: &str| -> Vec<(String, String)> {
            env.iter()
                .filter(|(name, _)| name.starts_with(prefix))
                .map(|(name, value)| (name.to_ascii_lowercase(), value.clone()))
                .collect()
        };
        let store: Arc<dyn ObjectStore> = match scheme {
            Scheme::S3 => {
                let mut builder = object_store::aws::AmazonS3Builder::new();
                for (key, value) in settings("AWS_") {
                    if let Ok(key) = key.parse() {
                        builder = builder.with_config(key, value);
                    }
                }
                builder = builder
                    .with_bucket_name(bucket)
                    .with_client_options(options)
                    .with_retry(retry);
                let endpoint = env.iter().find(|(name, _)| name == "AWS_ENDPOINT_URL");
                if let Some((_, endpoint)) = endpoint {
                    builder = builder
                        .with_endpoint(endpoint)
                        .with_allow_http(endpoint.starts_with("http://"))
                        .with_virtual_hosted_style_request(false);
                }
                Arc::new(builder.build().map_err(|e| e.to_string())?)
            }
            Scheme::Gcs => {
                let mut builder = object_store::gcp::GoogleCloudStorageBuilder::new();
                for (key, value) in settings("GOOGLE_") {
                    if let Ok(key) = key.parse() {
                        builder = builder.with_config(key, value);
                    }
                }
                let built = builder
                    .with_bucket_name(bucket)
                    .with_client_options(options)
                    .with_retry(retry)
                    .build();
                Arc::new(built.map_err(|e| e.to_string())?)
            }
            Scheme::Azure => {
                let mut builder = object_store::azure::MicrosoftAzureBuilder::new();
                for (key, value) in settings("AZURE_") {
                    if let Ok(key) = key.parse() {
                        builder = builder.with_config(key, value);
                    }
                }
                let built = builder
                    .with_container_name(bucket)
                    .with_client_options(options)
                    .with_retry(retry)
                    .build();
                Arc::new(built.map_err(|e| e.to_string())?)
            }
        };
        Ok(Remote {
            store,
            prefix: prefix.clone(),
            url: url.to_string(),
            healthy: Arc::new(AtomicBool::new(true)),
            reached: Arc::new(AtomicBool::new(false)),
            conditional_puts: Arc::new(AtomicBool::new(true)),
        })
    }

    /// The store's URL, for logs.
    pub fn url(&self) -> &str {
        &self.url
    }

    /// The object store client, configured as [`Remote::open`] made it: for
    /// `agentlog-bench-checkpoints`, which measures the store's own requests through the
    /// same client beside the checkpoints' use of it.
    pub fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.store
    }

    /// Whether the store answered the last request (false while requests are retried).
    pub fn healthy(&self) -> bool {
        self.healthy.load(Ordering::Relaxed)
    }

    /// Lists the prefix until the store answers with a listing, at start: a store that is
    /// unreachable, refuses the credentials or has no such bucket is seen before the first
    /// checkpoint needs it, and the runner is not ready meanwhile ([`Remote::readiness`]).
    pub async fn reach(&self) {
        let prefix = (!self.prefix.is_empty()).then(|| ObjectPath::from(self.prefix.as_str()));
        loop {
            let listing = self
                .retrying("list the prefix", || {
                    self.store.list_with_delimiter(prefix.as_ref())
                })
                .await;
            match listing {
                Ok(_) => {
                    self.reached.store(true, Ordering::Relaxed);
                    tracing::info!(store = %self.url, "the checkpoint store answers");
                    return;
                }
                // An answer, but not a listing (no such bucket, say): asked again later.
                Err(e) => {
                    tracing::error!(store = %self.url, error = %e, "the checkpoint store cannot list its prefix; asking again in {LONGEST_BACKOFF:?}");
                    tokio::time::sleep(LONGEST_BACKOFF).await;
                }
            }
        }
    }

    /// For the runner's `/ready`: not ready until the store has answered a listing
    /// ([`Remote::reach`]), nor while its requests are retried (no call can end then).
    pub fn readiness(&self) -> Result<(), String> {
        if !self.reached.load(Ordering::Relaxed) {
            Err(format!(
                "the checkpoint store {} has not answered yet",
                self.url
            ))
        } else if !self.healthy() {
            Err(format!("the checkpoint store {} does not answer", self.url))
        } else {
            Ok(())
        }
    }

    fn path(&self, tail: &str) -> ObjectPath {
        if self.prefix.is_empty() {
            ObjectPath::from(tail)
        } else {
            ObjectPath::from(format!("{}/{tail}", self.prefix))
        }
    }

    fn object_path(&self, kind: Kind, hash: &Hash) -> ObjectPath {
        let dir = match kind {
            Kind::Blob => "blobs",
            Kind::Tree => "trees",
        };
        self.path(&format!("{dir}/{}", hex(hash)))
    }

    /// Runs `request` until the store answers it: an answer (`NotFound` and
    /// `AlreadyExists` and `NotImplemented` are answers) is returned; anything else is logged and tried again,
    /// without limit, the health down meanwhile.
    async fn retrying<T, F, Fut>(&self, what: &str, request: F) -> Result<T, object_store::Error>
    where
        F: Fn() -> Fut,
        Fut: Future<Output = Result<T, object_store::Error>>,
    {
        let mut wait = FIRST_BACKOFF;
        loop {
            let attempt = request();
            tokio::pin!(attempt);
            // A request unanswered for a while says the store is down, and is waited for on.
            let answer = tokio::select! {
                answer = &mut attempt => answer,
                _ = tokio::time::sleep(SLOW) => {
                    if self.healthy.swap(false, Ordering::Relaxed) {
                        health::up(false);
                        tracing::warn!(store = %self.url, %what, "the checkpoint store does not answer within {SLOW:?}; waiting");
                    }
                    attempt.await
                }
            };
            match answer {
                Err(e) if !is_answer(&e) => {
                    if self.healthy.swap(false, Ordering::Relaxed) {
                        health::up(false);
                        tracing::warn!(store = %self.url, error = %e, "the checkpoint store does not answer; retrying until it does");
                    } else {
                        tracing::debug!(store = %self.url, %what, error = %e, "retrying");
                    }
                    tokio::time::sleep(wait.mul_f64(0.5 + fastrand::f64())).await;
                    wait = (wait * 2).min(LONGEST_BACKOFF);
                }
                answer => {
                    if !self.healthy.swap(true, Ordering::Relaxed) {
                        health::up(true);
                        tracing::info!(store = %self.url, "the checkpoint store answers again");
                    }
                    return answer;
                }
            }
        }
    }

    /// Stores every object of checkpoint `root` (from `area`) that the store lacks, and
    /// the session's reference to it. `base` is a checkpoint whose objects the store is
    /// known to hold (the session's previous upload): its trees and blobs are not asked
    /// about. Returns the bytes uploaded.
    pub async fn upload(
        &self,
        area: &Area,
        session_id: &str,
        root: &Hash,
        base: Option<&Hash>,
    ) -> io::Result<u64> {
        // The reference first: a sweep that sees it never removes what it names.
        self.add_ref(session_id, root).await?;
        let mut before = self.gc_state().await?;
        let known = match base {
            Some(base) => closure(area, base, &HashSet::new())?,
            None => Closure::default(),
        };
        let wanted = closure(area, root, &known.trees)?;
        // All at once: nothing names the checkpoint before every object is stored, and a
        // sweep keeps what an unfinished upload sends (`remote_gc.rs`).
        let mut objects: Vec<(Kind, Hash)> = wanted
            .blobs
            .iter()
            .filter(|blob| !known.blobs.contains(*blob))
            .map(|blob| (Kind::Blob, *blob))
            .collect();
        objects.extend(wanted.trees_in_order.iter().map(|tree| (Kind::Tree, *tree)));
        let (mut uploaded, mut reused) = self.put_all(area, &objects).await?;
        // What the store held already must have outlived every sweep that could have missed
        // the reference (see the module's promises).
        while !reused.is_empty() {
            let after = self.gc_state().await?;
            if after.generation == before.generation && !after.running() {
                break;
            }
            before = self.gc_state_once_idle().await?;
            let (sent, still) = self.put_all(area, &reused).await?;
            uploaded += sent;
            reused = still;
        }
        Ok(uploaded)
    }

    /// Stores each object the store lacks; returns the bytes sent and the objects the store
    /// held already.
    async fn put_all(
        &self,
        area: &Area,
        objects: &[(Kind, Hash)],
    ) -> io::Result<(u64, Vec<(Kind, Hash)>)> {
        let outcomes: Vec<((Kind, Hash), Option<u64>)> = stream::iter(objects.iter().copied())
            .map(|(kind, hash)| async move {
                Ok::<_, io::Error>(((kind, hash), self.put_missing(area, kind, hash).await?))
            })
            .buffer_unordered(PARALLEL)
            .try_collect()
            .await?;
        let mut sent = 0;
        let mut held = Vec::new();
        for (object, outcome) in outcomes {
            match outcome {
                Some(bytes) => sent += bytes,
                None => held.push(object),
            }
        }
        Ok((sent, held))
    }

    /// Stores one object unless the store holds it; returns the bytes sent, `None` when the
    /// store held it. A small object is one conditional `PUT` (`If-None-Match: *`: the store
    /// refuses it if it holds the object, which it then keeps as it was); a large one, or
    /// any with a store that does not take conditional writes, is asked about (`HEAD`)
    /// before its bytes are sent.
    async fn put_missing(&self, area: &Area, kind: Kind, hash: Hash) -> io::Result<Option<u64>> {
        let path = self.object_path(kind, &hash);
        let size = std::fs::metadata(area.object_path(kind, &hash))?.len();
        if size <= SMALL_OBJECT && self.conditional_puts.load(Ordering::Relaxed) {
            let bytes = bytes::Bytes::from(area.read(kind, &hash)?);
            let create = PutOptions::from(PutMode::Create);
            let put = self
                .retrying("put if absent", || {
                    self.store.put_opts(
                        &path,
                        PutPayload::from_bytes(bytes.clone()),
                        create.clone(),
                    )
                })
                .await;
            match put {
                Ok(_) => {
                    health::bytes("uploaded", size);
                    return Ok(Some(size));
                }
                Err(object_store::Error::AlreadyExists { .. }) => return Ok(None),
                Err(object_store::Error::NotImplemented { .. }) => {
                    tracing::info!(store = %self.url, "the checkpoint store takes no conditional writes: asking before each upload");
                    self.conditional_puts.store(false, Ordering::Relaxed);
                }
                Err(e) => return Err(to_io(e)),
            }
        }
        match self.retrying("head", || self.store.head(&path)).await {
            Ok(_) => return Ok(None),
            Err(object_store::Error::NotFound { .. }) => {}
            Err(e) => return Err(to_io(e)),
        }
        let bytes = bytes::Bytes::from(area.read(kind, &hash)?);
        let length = bytes.len() as u64;
        self.retrying("put", || {
            self.store.put(&path, PutPayload::from_bytes(bytes.clone()))
        })
        .await
        .map_err(to_io)?;
        health::bytes("uploaded", length);
        Ok(Some(length))
    }

    /// Records that `session_id`'s log may name checkpoint `root`.
    pub async fn add_ref(&self, session_id: &str, root: &Hash) -> io::Result<()> {
        let reference = self.path(&format!("sessions/{session_id}/refs/{}", hex(root)));
        self.retrying("put a reference", || {
            self.store.put(&reference, PutPayload::default())
        })
        .await
        .map_err(to_io)?;
        Ok(())
    }

    /// The sweep's state, as stored (none yet: generation 0, not running).
    pub async fn gc_state(&self) -> io::Result<GcState> {
        let path = self.path(GC_STATE);
        let got = self
            .retrying("get the sweep's state", || async {
                self.store.get(&path).await?.bytes().await
            })
            .await;
        match got {
            Ok(bytes) => Ok(GcState::parse(&String::from_utf8_lossy(&bytes))),
            Err(object_store::Error::NotFound { .. }) => Ok(GcState::default()),
            Err(e) => Err(to_io(e)),
        }
    }

    /// [`Remote::gc_state`], once no sweep is running (polled each second).
    async fn gc_state_once_idle(&self) -> io::Result<GcState> {
        loop {
            let state = self.gc_state().await?;
            if !state.running() {
                return Ok(state);
            }
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
    }

    /// Stores the sweep's state; returns the store's clock when it was stored (ms), read
    /// back from the object, so that the sweep compares objects' times on one clock.
    pub async fn set_gc_state(&self, state: &GcState) -> io::Result<i64> {
        let path = self.path(GC_STATE);
        let text = bytes::Bytes::from(state.to_string());
        self.retrying("put the sweep's state", || {
            self.store.put(&path, PutPayload::from_bytes(text.clone()))
        })
        .await
        .map_err(to_io)?;
        let meta = self
            .retrying("head the sweep's state", || self.store.head(&path))
            .await
            .map_err(to_io)?;
        Ok(meta.last_modified.timestamp_millis())
    }

    /// Every object under `PREFIX/<under>`, with its path below the prefix and its time on
    /// the store's clock (ms).
    pub async fn list(&self, under: &str) -> io::Result<Vec<Listed>> {
        let prefix = self.path(under);
        let listed: Vec<object_store::ObjectMeta> = self
            .retrying("list", || self.store.list(Some(&prefix)).try_collect())
            .await
            .map_err(to_io)?;
        let strip = if self.prefix.is_empty() {
            String::new()
        } else {
            format!("{}/", self.prefix)
        };
        Ok(listed
            .into_iter()
            .filter_map(|meta| {
                let path = meta.location.as_ref().strip_prefix(&strip)?.to_string();
                Some(Listed {
                    path,
                    modified_ms: meta.last_modified.timestamp_millis(),
                    size: meta.size,
                })
            })
            .collect())
    }

    /// Removes the objects at `paths` (below the prefix); one already gone is no error.
    pub async fn delete(&self, paths: &[String]) -> io::Result<()> {
        stream::iter(paths.iter().cloned())
            .map(|tail| async move {
                let path = self.path(&tail);
                match self.retrying("delete", || self.store.delete(&path)).await {
                    Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
                    Err(e) => Err(to_io(e)),
                }
            })
            .buffer_unordered(PARALLEL)
            .try_collect::<Vec<()>>()
            .await?;
        Ok(())
    }

    /// Stores an empty object at `tail` (below the prefix): a marker.
    pub async fn put_marker(&self, tail: &str) -> io::Result<()> {
        let path = self.path(tail);
        self.retrying("put a marker", || {
            self.store.put(&path, PutPayload::default())
        })
        .await
        .map_err(to_io)?;
        Ok(())
    }

    /// Tree `hash`, from `area` or else from the store (not kept); `None` if neither has it.
    pub async fn tree(&self, area: &Area, hash: &Hash) -> io::Result<Option<Tree>> {
        let bytes = match area.read(Kind::Tree, hash) {
            Ok(bytes) => Some(bytes),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                self.get_checked(Kind::Tree, hash).await?
            }
            Err(e) => return Err(e),
        };
        bytes.map(|bytes| decode(hash, &bytes)).transpose()
    }

    /// Brings every object of checkpoint `root` that `area` lacks from the store, each
    /// checked against its hash. An object the store does not hold is left missing (the
    /// restore lists what it could not make). Returns the bytes fetched. The area is made
    /// if missing: a runner's first claim can come before anything else made it.
    pub async fn fetch(&self, area: &Area, root: &Hash) -> io::Result<u64> {
        area.ensure()?;
        let mut fetched = 0u64;
        let mut level = vec![*root];
        while !level.is_empty() {
            let mut pending = Pending::default();
            let mut blobs = Vec::new();
            let mut next = Vec::new();
            let trees: Vec<(Hash, Option<Vec<u8>>)> = stream::iter(level)
                .map(|tree| async move {
                    if area.has(Kind::Tree, &tree) {
                        return Ok::<_, io::Error>((tree, Some(area.read(Kind::Tree, &tree)?)));
                    }
                    Ok((tree, self.get_checked(Kind::Tree, &tree).await?))
                })
                .buffer_unordered(PARALLEL)
                .try_collect()
                .await?;
            for (hash, bytes) in trees {
                let Some(bytes) = bytes else { continue };
                if !area.has(Kind::Tree, &hash) {
                    fetched += bytes.len() as u64;
                    area.put_bytes(Kind::Tree, &bytes, &mut pending)?;
                }
                let tree = decode(&hash, &bytes)?;
                for entry in &tree.entries {
                    match (entry.kind(), entry.object_hash()) {
                        (EntryKind::File, Some(blob)) if !area.has(Kind::Blob, &blob) => {
                            blobs.push(blob)
                        }
                        (EntryKind::Dir, Some(subtree)) => next.push(subtree),
                        _ => {}
                    }
                }
            }
            blobs.sort_unstable();
            blobs.dedup();
            // Each blob written as it arrives, the next ones downloading meanwhile: at most
            // `PARALLEL` blobs in memory.
            let mut got = stream::iter(blobs)
                .map(|blob| async move { self.get_checked(Kind::Blob, &blob).await })
                .buffer_unordered(PARALLEL);
            while let Some(bytes) = got.try_next().await? {
                if let Some(bytes) = bytes {
                    fetched += bytes.len() as u64;
                    area.put_reader(&mut bytes.as_slice(), &mut pending)?;
                }
            }
            area.sync(pending)?;
            next.sort_unstable();
            next.dedup();
            level = next;
        }
        Ok(fetched)
    }

    /// The object's bytes, if the store holds it; an object whose bytes do not hash to its
    /// name is an error.
    async fn get_checked(&self, kind: Kind, hash: &Hash) -> io::Result<Option<Vec<u8>>> {
        let path = self.object_path(kind, hash);
        let got = self
            .retrying("get", || async {
                self.store.get(&path).await?.bytes().await
            })
            .await;
        match got {
            Ok(bytes) if sha256(&bytes) == *hash => {
                health::bytes("fetched", bytes.len() as u64);
                Ok(Some(bytes.to_vec()))
            }
            Ok(_) => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("object {path} in the checkpoint store does not match its hash"),
            )),
            Err(object_store::Error::NotFound { .. }) => Ok(None),
            Err(e) => Err(to_io(e)),
        }
    }
}

fn is_answer(error: &object_store::Error) -> bool {
    matches!(
        error,
        object_store::Error::NotFound { .. }
            | object_store::Error::AlreadyExists { .. }
            | object_store::Error::NotImplemented { .. }
    )
}

fn to_io(error: object_store::Error) -> io::Error {
    io::Error::other(format!("the checkpoint store: {error}"))
}

fn decode(hash: &Hash, bytes: &[u8]) -> io::Result<Tree> {
    Tree::from_bytes(bytes).map_err(|e| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!("checkpoint tree {} does not decode: {e}", hex(hash)),
        )
    })
}

/// An object as [`Remote::list`] shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Listed {
    /// Below the prefix, e.g. `blobs/<sha256>`.
    pub path: String,
    /// On the store's clock.
    pub modified_ms: i64,
    pub size: u64,
}

/// `gc/state`: how many sweeps have ended, and until when one runs, if one does.
const GC_STATE: &str = "gc/state";

/// The sweep's state in the store: `generation N` and, while a sweep runs, `running until
/// MS` (the wall clock, in ms: a sweep past it stops deleting, so a sweep that died leaves
/// nobody waiting longer than that).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GcState {
    pub generation: u64,
    pub running_until_ms: i64,
}

impl GcState {
    fn parse(text: &str) -> GcState {
        let mut state = GcState::default();
        let words: Vec<&str> = text.split_whitespace().collect();
        for pair in words.windows(2) {
            match pair {
                ["generation", n] => state.generation = n.parse().unwrap_or(0),
                ["until", ms] => state.running_until_ms = ms.parse().unwrap_or(0),
                _ => {}
            }
        }
        state
    }

    /// Whether a sweep runs now (by this machine's clock).
    pub fn running(&self) -> bool {
        self.running_until_ms > now_ms()
    }
}

impl fmt::Display for GcState {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "generation {}", self.generation)?;
        if self.running_until_ms > 0 {
            write!(f, " running until {}", self.running_until_ms)?;
        }
        Ok(())
    }
}

/// The wall clock, in ms since the epoch.
pub fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

/// The objects a checkpoint names, as far as the local area holds its trees.
#[derive(Debug, Default)]
struct Closure {
    trees: HashSet<Hash>,
    /// Deepest first, so a tree follows the trees it names.
    trees_in_order: Vec<Hash>,
    blobs: HashSet<Hash>,
}

/// The trees and blobs reachable from `root` in `area`, not descending into `skip` (trees
/// whose objects are known to be stored).
fn closure(area: &Area, root: &Hash, skip: &HashSet<Hash>) -> io::Result<Closure> {
    let mut found = Closure::default();
    let mut stack = vec![(*root, false)];
    while let Some((hash, children_done)) = stack.pop() {
        if children_done {
            found.trees_in_order.push(hash);
            continue;
        }
        if skip.contains(&hash) || !found.trees.insert(hash) {
            continue;
        }
        let bytes = match area.read(Kind::Tree, &hash) {
            Ok(bytes) => bytes,
            Err(e) if e.kind() == io::ErrorKind::NotFound => {
                found.trees.remove(&hash);
                continue;
            }
            Err(e) => return Err(e),
        };
        stack.push((hash, true));
        for entry in &decode(&hash, &bytes)?.entries {
            match (entry.kind(), entry.object_hash()) {
                (EntryKind::File, Some(blob)) => {
                    found.blobs.insert(blob);
                }
                (EntryKind::Dir, Some(subtree)) => stack.push((subtree, false)),
                _ => {}
            }
        }
    }
    Ok(found)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sweeps_state_reads_back_as_written() {
        let running = GcState {
            generation: 7,
            running_until_ms: now_ms() + 60_000,
        };
        assert_eq!(GcState::parse(&running.to_string()), running);
        assert!(running.running());
        let idle = GcState {
            generation: 8,
            running_until_ms: 0,
        };
        assert_eq!(GcState::parse(&idle.to_string()), idle);
        assert!(!idle.running());
        assert_eq!(GcState::parse("garbage"), GcState::default());
    }

    #[test]
    fn checkpoint_store_urls_parse_or_say_why_not() {
        assert_eq!(StoreUrl::parse("file://"), Ok(StoreUrl::Local(None)));
        assert_eq!(
            StoreUrl::parse("file:///var/cp"),
            Ok(StoreUrl::Local(Some("/var/cp".into())))
        );
        assert_eq!(
            StoreUrl::parse("s3://bucket/a/b/"),
            Ok(StoreUrl::Object {
                scheme: Scheme::S3,
                bucket: "bucket".into(),
                prefix: "a/b".into()
            })
        );
        assert_eq!(
            StoreUrl::parse("gs://b").map(|u| u.to_string()),
            Ok("gs://b/".to_string())
        );
        for bad in [
            "bucket",
            "ftp://x/y",
            "s3:///p",
            "s3://b/a/../c",
            "file://tmp/x",
        ] {
            let error = StoreUrl::parse(bad).expect_err(bad);
            assert!(error.contains("--checkpoint-store"), "{bad}: {error}");
        }
    }
}
