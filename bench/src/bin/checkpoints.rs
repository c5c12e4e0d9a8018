//! Checkpoints in an object store (`runner --checkpoint-store s3://…`) against the local
//! checkpoint area and against the store's own bulk download, in one run
//! (bench/RESULTS.md, "Checkpoints in an object store"). The store is moto's S3 server
//! (`testkit::s3::S3Server`), on this machine.
//!
//! The workspace: `files` files, `bytes` in all, as a repository looks: 99 in 100 are
//! source-like text files (skewed sizes, 40 to a directory, four levels deep under `src/`),
//! the rest binaries of random bytes under `assets/` holding 60% of the bytes. Content is
//! pseudo-random from fixed seeds, so every run writes the same workspace. It is written
//! twice, beside two workspace roots: one whose checkpoints live in the object store
//! (`s3://BUCKET/bench`), one with the local area (`file://`). Figures:
//!
//! 1. each round changes `changed` source files in both workspaces (same sizes, new
//!    content; other files every round), then times the checkpoint of each
//!    (`Checkpoints::record`, as the runner's guard calls it before a `tool_result`; with
//!    the object store it returns once every new object is stored), the order alternating
//!    by round;
//! 2. a full restore from the object store on a fresh workspace root with an empty local
//!    area (`Checkpoints::fetch`, then `Checkpoints::materialize`) against a bulk download
//!    of the same objects through the same client (`Remote::open`'s, listing the prefix
//!    and `GET`ting every object to memory, `PARALLEL` in flight as the fetch has),
//!    alternating; taken right after the first checkpoint, while the prefix holds exactly
//!    its objects;
//! 3. per round, the objects the checkpoint added to the bucket (listed before and after):
//!    blobs' bytes against the changed files' bytes, the trees' bytes beside them.
//!
//! And where the object-store checkpoint's time goes: its local part is the same
//! `record_blocking` the local area's checkpoint is; its requests are replayed by the bench
//! through the same client as the runner sends them (the reference's `PUT`, then every new
//! object at once, `PARALLEL` in flight: one conditional `PUT` for an object up to
//! `SMALL_OBJECT`, a `HEAD` and a `PUT` for a larger one; under a prefix of their own); the CPU of
//! this process and of the server over each checkpoint; and the server's latency per
//! request, one at a time and `PARALLEL` in flight.
//!
//! Build first (`cargo build --release -p bench`), then
//! `target/release/agentlog-bench-checkpoints` (`--help` for the knobs), or `bash bench/run
//! --checkpoints`; `--quick` runs 200 files of 2 MB, to check the path still runs.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{ensure, Context};
use clap::Parser;
use futures::stream::{self, StreamExt, TryStreamExt};
use object_store::path::Path as ObjectPath;
use object_store::{ObjectStore, ObjectStoreExt, PutMode, PutOptions, PutPayload};
use runner::tools::checkpoint::{IgnoreRules, Remote, StoreUrl, PARALLEL, SMALL_OBJECT};
use runner::tools::Checkpoints;
use testkit::s3::S3Server;

#[derive(Parser)]
struct Args {
    /// Files in the workspace.
    #[arg(long, default_value_t = 10_000)]
    files: usize,
    /// Bytes in the workspace, every file together.
    #[arg(long, default_value_t = 200_000_000)]
    bytes: u64,
    /// Files changed before each timed checkpoint.
    #[arg(long, default_value_t = 10)]
    changed: usize,
    /// Timed checkpoints on each side (the medians are reported).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Full restores, each beside a bulk download (the medians are reported).
    #[arg(long, default_value_t = 3)]
    restores: usize,
    /// 200 files of 2 MB, 2 rounds, one restore: a check that the path still runs.
    #[arg(long)]
    quick: bool,
    /// Where the workspaces go (a fresh directory under it, removed at the end).
    #[arg(long, default_value = "target/bench-data/checkpoints")]
    dir: PathBuf,
}

/// The session whose workspace is checkpointed: `<root>/s/`.
const SESSION: &str = "s";
/// The prefix of the checkpoints in the bucket.
const PREFIX: &str = "bench";

/// One file of the workspace.
struct WsFile {
    path: PathBuf,
    size: usize,
    source: bool,
}

/// The workspace's files: sources first, then binaries; sizes add up to `bytes`.
fn layout(files: usize, bytes: u64) -> Vec<WsFile> {
    let mut rng = fastrand::Rng::with_seed(1);
    let binaries = (files / 100).max(1);
    let sources = files - binaries;
    let source_bytes = bytes * 2 / 5;
    // Source sizes skewed as a repository's (many small files, a few long ones); binaries
    // from a quarter to 1.75 times their mean.
    let source_weights: Vec<f64> = (0..sources)
        .map(|_| -(1.0 - rng.f64()).ln() + 0.05)
        .collect();
    let binary_weights: Vec<f64> = (0..binaries).map(|_| 0.25 + 1.5 * rng.f64()).collect();
    let sizes = |weights: &[f64], total: u64| -> Vec<usize> {
        let sum: f64 = weights.iter().sum();
        let mut sizes: Vec<usize> = weights
            .iter()
            .map(|w| (w / sum * total as f64) as usize)
            .collect();
        let short = total as usize - sizes.iter().sum::<usize>();
        sizes[0] += short;
        sizes
    };
    let extensions = ["rs", "py", "ts", "go", "md", "json", "toml", "c"];
    let mut out = Vec::with_capacity(files);
    for (i, size) in sizes(&source_weights, source_bytes).into_iter().enumerate() {
        // 40 files to a directory, 8 directories to a module, 8 modules to a package.
        let (leaf, module, package) = (i / 40, i / 320, i / 2560);
        out.push(WsFile {
            path: PathBuf::from(format!(
                "src/p{package:02}/m{module:03}/d{leaf:04}/file{i:05}.{}",
                extensions[i % extensions.len()]
            )),
            size,
            source: true,
        });
    }
    for (i, size) in sizes(&binary_weights, bytes - source_bytes)
        .into_iter()
        .enumerate()
    {
        out.push(WsFile {
            path: PathBuf::from(format!("assets/a{}/blob{i:03}.bin", i % 2)),
            size,
            source: false,
        });
    }
    out
}

const WORDS: [&str; 48] = [
    "fn", "let", "mut", "self", "return", "if", "else", "match", "Some", "None", "Ok", "Err",
    "struct", "impl", "pub", "use", "for", "in", "while", "loop", "=", "==", "(", ")", "{", "}",
    ";", "->", "&", "usize", "u64", "String", "Vec", "Option", "Result", "config", "path",
    "buffer", "count", "index", "value", "entry", "state", "client", "request", "session", "event",
    "error",
];

/// `size` bytes of source-like text: indented lines of keywords and identifiers.
fn text(rng: &mut fastrand::Rng, size: usize) -> Vec<u8> {
    let mut out = Vec::with_capacity(size + 64);
    while out.len() < size {
        out.extend(std::iter::repeat_n(b' ', 4 * rng.usize(0..4)));
        for _ in 0..rng.usize(3..12) {
            if rng.u8(..) < 40 {
                out.extend_from_slice(format!("name{}", rng.u16(..1000)).as_bytes());
            } else {
                out.extend_from_slice(WORDS[rng.usize(..WORDS.len())].as_bytes());
            }
            out.push(b' ');
        }
        out.push(b'\n');
    }
    out.truncate(size);
    out
}

/// The content of `file` for `version` (0: as first written).
fn content(file: &WsFile, index: usize, version: usize) -> Vec<u8> {
    let mut rng = fastrand::Rng::with_seed(((version as u64) << 32) ^ index as u64);
    if file.source {
        text(&mut rng, file.size)
    } else {
        let mut bytes = vec![0u8; file.size];
        rng.fill(&mut bytes);
        bytes
    }
}

fn write_workspace(ws: &Path, files: &[WsFile]) -> anyhow::Result<()> {
    for (i, file) in files.iter().enumerate() {
        let path = ws.join(&file.path);
        std::fs::create_dir_all(path.parent().context("a file has a directory")?)?;
        std::fs::write(&path, content(file, i, 0))?;
    }
    Ok(())
}

/// The files and bytes under `dir`.
fn tree_size(dir: &Path) -> anyhow::Result<(usize, u64)> {
    let mut found = (0, 0);
    for entry in std::fs::read_dir(dir)? {
        let entry = entry?;
        let kind = entry.file_type()?;
        if kind.is_dir() {
            let (files, bytes) = tree_size(&entry.path())?;
            found.0 += files;
            found.1 += bytes;
        } else if kind.is_file() {
            found.0 += 1;
            found.1 += entry.metadata()?.len();
        }
    }
    Ok(found)
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1000.0
}

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

/// "median (min–max)" of `values`, with `digits` decimals.
fn cell(values: &[f64], digits: usize) -> String {
    let min = values.iter().copied().fold(f64::INFINITY, f64::min);
    let max = values.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if values.len() == 1 {
        format!("{:.digits$}", values[0])
    } else {
        format!(
            "{:.digits$} ({min:.digits$}–{max:.digits$})",
            median(values)
        )
    }
}

fn progress(what: &str) {
    eprintln!("== {what}");
}

/// One round's figures.
#[derive(Default)]
struct Round {
    s3_ms: f64,
    file_ms: f64,
    files_read: usize,
    changed_bytes: u64,
    blobs: usize,
    blob_bytes: u64,
    trees: usize,
    tree_bytes: u64,
    /// The same requests, sent by the bench: the reference's `PUT`, the blobs', the trees'.
    replay_ref_ms: f64,
    replay_objects_ms: f64,
    /// CPU over the object-store checkpoint: this process's, the server's.
    bench_cpu_ms: f64,
    server_cpu_ms: f64,
}

/// One restore's figures.
struct Restore {
    fetch_ms: f64,
    materialize_ms: f64,
    download_ms: f64,
    objects: usize,
    object_bytes: u64,
}

/// The server's latency per request, one at a time and `PARALLEL` in flight.
struct Latency {
    head_missing_ms: Vec<f64>,
    head_ms: Vec<f64>,
    put_ms: Vec<f64>,
    get_ms: Vec<f64>,
    heads_per_sec_serial: f64,
    heads_per_sec_parallel: f64,
}

fn objects_under(listing: &[(String, u64)], dir: &str) -> Vec<(String, u64)> {
    let prefix = format!("{PREFIX}/{dir}/");
    listing
        .iter()
        .filter(|(key, _)| key.starts_with(&prefix))
        .cloned()
        .collect()
}

/// Every object of the checkpoints' prefix (blobs and trees), listed and `GET` to memory,
/// `PARALLEL` in flight; the time in ms, the objects and the bytes.
async fn bulk_download(store: &Arc<dyn ObjectStore>) -> anyhow::Result<(f64, usize, u64)> {
    let started = Instant::now();
    let mut paths = Vec::new();
    for dir in ["blobs", "trees"] {
        let prefix = ObjectPath::from(format!("{PREFIX}/{dir}"));
        let listed: Vec<_> = store.list(Some(&prefix)).try_collect().await?;
        paths.extend(listed.into_iter().map(|meta| meta.location));
    }
    let objects = paths.len();
    let bytes = stream::iter(paths)
        .map(|path| async move {
            let bytes = store.get(&path).await?.bytes().await?;
            Ok::<_, object_store::Error>(bytes.len() as u64)
        })
        .buffer_unordered(PARALLEL)
        .try_fold(0u64, |sum, n| async move { Ok(sum + n) })
        .await?;
    Ok((ms(started), objects, bytes))
}

/// A full restore from the object store on a fresh workspace root: fetch, then materialize.
async fn restore(
    dir: &Path,
    url: &StoreUrl,
    id: &str,
    expected: (usize, u64),
) -> anyhow::Result<(f64, f64)> {
    let root = dir.join("restore-root");
    std::fs::create_dir_all(&root)?;
    let checkpoints = Checkpoints::new(&root, IgnoreRules::default(), None)
        .in_store(url)
        .map_err(anyhow::Error::msg)?;
    let started = Instant::now();
    checkpoints.fetch_for("restore", id).await?;
    let fetch_ms = ms(started);
    let target = root.join("restored");
    let started = Instant::now();
    let not_restored = tokio::task::block_in_place(|| checkpoints.materialize(id, &target))?;
    let materialize_ms = ms(started);
    ensure!(not_restored.is_empty(), "not restored: {not_restored:?}");
    let found = tree_size(&target)?;
    ensure!(
        found == expected,
        "restored {found:?} (files, bytes), not {expected:?}"
    );
    std::fs::remove_dir_all(&root)?;
    Ok((fetch_ms, materialize_ms))
}

/// Sends the requests an upload of `blobs` and `trees` makes, as `Remote::upload` sends
/// them, under `replay/<round>/`; the time of the reference and of the objects.
async fn replay_upload(
    store: &Arc<dyn ObjectStore>,
    round: usize,
    blobs: &[(String, u64)],
    trees: &[(String, u64)],
) -> anyhow::Result<(f64, f64)> {
    // The objects' bytes first, untimed.
    let fetch = |objects: &[(String, u64)]| {
        let keys: Vec<String> = objects.iter().map(|(key, _)| key.clone()).collect();
        async move {
            stream::iter(keys)
                .map(|key| async move {
                    let name = key.rsplit_once('/').map_or(key.as_str(), |(_, n)| n);
                    let dir = if key.contains("/blobs/") {
                        "blobs"
                    } else {
                        "trees"
                    };
                    let bytes = store
                        .get(&ObjectPath::from(key.as_str()))
                        .await?
                        .bytes()
                        .await?;
                    Ok::<_, object_store::Error>((
                        ObjectPath::from(format!("replay/{round}/{dir}/{name}")),
                        bytes,
                    ))
                })
                .buffer_unordered(PARALLEL)
                .try_collect::<Vec<_>>()
                .await
        }
    };
    let mut objects = fetch(blobs).await?;
    objects.extend(fetch(trees).await?);
    let started = Instant::now();
    store
        .put(
            &ObjectPath::from(format!("replay/{round}/sessions/{SESSION}/refs/r")),
            PutPayload::default(),
        )
        .await?;
    let ref_ms = ms(started);
    let started = Instant::now();
    stream::iter(objects)
        .map(|(path, bytes)| async move {
            if bytes.len() as u64 <= SMALL_OBJECT {
                let create = PutOptions::from(PutMode::Create);
                store
                    .put_opts(&path, PutPayload::from_bytes(bytes), create)
                    .await?;
                return Ok(());
            }
            match store.head(&path).await {
                Err(object_store::Error::NotFound { .. }) => {}
                Ok(_) => anyhow::bail!("{path} is there already"),
                Err(e) => return Err(e.into()),
            }
            store.put(&path, PutPayload::from_bytes(bytes)).await?;
            Ok(())
        })
        .buffer_unordered(PARALLEL)
        .try_collect::<Vec<()>>()
        .await?;
    Ok((ref_ms, ms(started)))
}

/// The server's latency per request through the same client: `n` of each, one at a time,
/// then `HEAD`s `PARALLEL` in flight.
async fn latency(store: &Arc<dyn ObjectStore>, n: usize, blob: &str) -> anyhow::Result<Latency> {
    let mut out = Latency {
        head_missing_ms: Vec::new(),
        head_ms: Vec::new(),
        put_ms: Vec::new(),
        get_ms: Vec::new(),
        heads_per_sec_serial: 0.0,
        heads_per_sec_parallel: 0.0,
    };
    let blob = ObjectPath::from(blob);
    let page = vec![b'x'; 4096];
    for i in 0..n {
        let missing = ObjectPath::from(format!("probe/missing-{i}"));
        let started = Instant::now();
        ensure!(matches!(
            store.head(&missing).await,
            Err(object_store::Error::NotFound { .. })
        ));
        out.head_missing_ms.push(ms(started));
        let started = Instant::now();
        store
            .put(
                &ObjectPath::from(format!("probe/put-{i}")),
                PutPayload::from(page.clone()),
            )
            .await?;
        out.put_ms.push(ms(started));
        let started = Instant::now();
        store.head(&blob).await?;
        out.head_ms.push(ms(started));
        let started = Instant::now();
        store.get(&blob).await?.bytes().await?;
        out.get_ms.push(ms(started));
    }
    out.heads_per_sec_serial = 1000.0 / median(&out.head_ms);
    let heads = n * 8;
    let started = Instant::now();
    stream::iter(0..heads)
        .map(|_| store.head(&blob))
        .buffer_unordered(PARALLEL)
        .try_collect::<Vec<_>>()
        .await?;
    out.heads_per_sec_parallel = heads as f64 / started.elapsed().as_secs_f64();
    Ok(out)
}

struct Plan {
    files: usize,
    bytes: u64,
    changed: usize,
    rounds: usize,
    restores: usize,
}

/// The 1, 5 and 15 minute load averages.
fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|text| {
            text.split_whitespace()
                .take(3)
                .collect::<Vec<_>>()
                .join(" ")
        })
        .unwrap_or_default()
}

async fn run(plan: &Plan, s3: &S3Server, dir: &Path) -> anyhow::Result<()> {
    let load_before = load_average();
    let files = layout(plan.files, plan.bytes);
    let sources = files.iter().filter(|f| f.source).count();
    ensure!(
        plan.changed * plan.rounds <= sources,
        "{} rounds of {} changed files need more than {sources} source files",
        plan.rounds,
        plan.changed
    );
    let url = StoreUrl::parse(&s3.url(PREFIX)).map_err(anyhow::Error::msg)?;
    let mut roots = Vec::new();
    for side in ["s3", "file"] {
        let root = dir.join(side);
        progress(&format!(
            "writing the workspace: {} files, {} bytes ({side})",
            plan.files, plan.bytes
        ));
        write_workspace(&root.join(SESSION), &files)?;
        roots.push(root);
    }
    let s3_checkpoints = Arc::new(
        Checkpoints::new(&roots[0], IgnoreRules::default(), None)
            .in_store(&url)
            .map_err(anyhow::Error::msg)?,
    );
    let file_checkpoints = Arc::new(
        Checkpoints::new(&roots[1], IgnoreRules::default(), None)
            .in_store(&StoreUrl::Local(None))
            .map_err(anyhow::Error::msg)?,
    );

    progress("first checkpoints (every file)");
    let started = Instant::now();
    file_checkpoints.record(SESSION).await?;
    let first_file_ms = ms(started);
    let started = Instant::now();
    let first = s3_checkpoints.record(SESSION).await?;
    let first_s3_ms = ms(started);
    let listing = s3.list(&format!("{PREFIX}/"))?;
    let first_objects = listing.len() - 1;
    let first_bytes: u64 = listing.iter().map(|(_, size)| size).sum();

    // 2. The restore, while the prefix holds exactly the first checkpoint's objects.
    let env: Vec<(String, String)> = std::env::vars().collect();
    let client = Remote::open(&url, &env).map_err(anyhow::Error::msg)?;
    let store = client.store();
    let mut restores = Vec::new();
    for i in 0..plan.restores {
        progress(&format!("restore {} of {}", i + 1, plan.restores));
        let expected = (plan.files, plan.bytes);
        let (download, (fetch_ms, materialize_ms)) = if i % 2 == 0 {
            let download = bulk_download(store).await?;
            (download, restore(dir, &url, &first.id, expected).await?)
        } else {
            let restored = restore(dir, &url, &first.id, expected).await?;
            (bulk_download(store).await?, restored)
        };
        restores.push(Restore {
            fetch_ms,
            materialize_ms,
            download_ms: download.0,
            objects: download.1,
            object_bytes: download.2,
        });
    }

    // 1 and 3. Rounds of changed files.
    let mut order: Vec<usize> = (0..sources).collect();
    fastrand::Rng::with_seed(2).shuffle(&mut order);
    let server_pid = s3.pid();
    let bench_pid = std::process::id();
    let mut rounds = Vec::new();
    for r in 0..plan.rounds {
        progress(&format!("round {} of {}", r + 1, plan.rounds));
        let mut round = Round::default();
        for &i in &order[r * plan.changed..(r + 1) * plan.changed] {
            let bytes = content(&files[i], i, r + 1);
            round.changed_bytes += bytes.len() as u64;
            for root in &roots {
                std::fs::write(root.join(SESSION).join(&files[i].path), &bytes)?;
            }
        }
        let before: HashMap<String, u64> = s3.list(&format!("{PREFIX}/"))?.into_iter().collect();
        for side in if r % 2 == 0 { [0, 1] } else { [1, 0] } {
            if side == 0 {
                let cpu = (testkit::cpu_ms(bench_pid)?, testkit::cpu_ms(server_pid)?);
                let started = Instant::now();
                let checkpoint = s3_checkpoints.record(SESSION).await?;
                round.s3_ms = ms(started);
                round.bench_cpu_ms = testkit::cpu_ms(bench_pid)? - cpu.0;
                round.server_cpu_ms = testkit::cpu_ms(server_pid)? - cpu.1;
                round.files_read = checkpoint.files_read;
            } else {
                let started = Instant::now();
                file_checkpoints.record(SESSION).await?;
                round.file_ms = ms(started);
            }
        }
        let added: Vec<(String, u64)> = s3
            .list(&format!("{PREFIX}/"))?
            .into_iter()
            .filter(|(key, _)| !before.contains_key(key))
            .collect();
        let blobs = objects_under(&added, "blobs");
        let trees = objects_under(&added, "trees");
        round.blobs = blobs.len();
        round.blob_bytes = blobs.iter().map(|(_, size)| size).sum();
        round.trees = trees.len();
        round.tree_bytes = trees.iter().map(|(_, size)| size).sum();
        (round.replay_ref_ms, round.replay_objects_ms) =
            replay_upload(store, r, &blobs, &trees).await?;
        rounds.push(round);
    }

    progress("the server's latency per request");
    let probe = objects_under(&listing, "blobs")
        .into_iter()
        .min_by_key(|(_, size)| size.abs_diff(20_000))
        .context("a blob")?;
    let latency = latency(store, if plan.rounds < 5 { 10 } else { 50 }, &probe.0).await?;

    println!(
        "Load average (1, 5, 15 min) before: {load_before}; after: {}.\n",
        load_average()
    );
    report(
        plan,
        &Firsts {
            file_ms: first_file_ms,
            s3_ms: first_s3_ms,
            objects: first_objects,
            bytes: first_bytes,
        },
        &rounds,
        &restores,
        &latency,
        probe.1,
    );
    Ok(())
}

struct Firsts {
    file_ms: f64,
    s3_ms: f64,
    objects: usize,
    bytes: u64,
}

fn report(
    plan: &Plan,
    first: &Firsts,
    rounds: &[Round],
    restores: &[Restore],
    latency: &Latency,
    probe_bytes: u64,
) {
    let of = |pick: fn(&Round) -> f64| -> Vec<f64> { rounds.iter().map(pick).collect() };
    let s3 = of(|r| r.s3_ms);
    let file = of(|r| r.file_ms);
    let replay = of(|r| r.replay_ref_ms + r.replay_objects_ms);
    let rest: Vec<f64> = rounds
        .iter()
        .map(|r| r.s3_ms - r.file_ms - (r.replay_ref_ms + r.replay_objects_ms))
        .collect();
    println!(
        "Workspace: {} files, {} bytes; {} changed files a round, {} rounds, {} restores. \
         Medians (min–max).\n",
        plan.files, plan.bytes, plan.changed, plan.rounds, plan.restores
    );
    println!(
        "First checkpoint (every file): local area {:.0} ms; object store {:.0} ms ({} objects, \
         {} bytes: {:.0} objects/s).\n",
        first.file_ms,
        first.s3_ms,
        first.objects,
        first.bytes,
        first.objects as f64 / (first.s3_ms / 1000.0)
    );
    println!("| figure | object store | baseline | ratio | goal |\n|---|---|---|---|---|");
    println!(
        "| checkpoint after {} changed files, ms | {} | local area (`file://`): {} | **{:.2}×** | ≤ 2× |",
        plan.changed,
        cell(&s3, 1),
        cell(&file, 1),
        median(&s3) / median(&file)
    );
    let fetch: Vec<f64> = restores.iter().map(|r| r.fetch_ms).collect();
    let materialize: Vec<f64> = restores.iter().map(|r| r.materialize_ms).collect();
    let total: Vec<f64> = restores
        .iter()
        .map(|r| r.fetch_ms + r.materialize_ms)
        .collect();
    let download: Vec<f64> = restores.iter().map(|r| r.download_ms).collect();
    println!(
        "| full restore (fetch + materialize), ms | {} (fetch {}, materialize {}) | list + GET of the same {} objects ({} bytes) to memory: {} | **{:.2}×** | ≤ 1.2× |",
        cell(&total, 0),
        cell(&fetch, 0),
        cell(&materialize, 0),
        restores[0].objects,
        restores[0].object_bytes,
        cell(&download, 0),
        median(&total) / median(&download)
    );
    let blob_ratio: Vec<f64> = rounds
        .iter()
        .map(|r| r.blob_bytes as f64 / r.changed_bytes as f64)
        .collect();
    let uploaded: Vec<f64> = of(|r| (r.blob_bytes + r.tree_bytes) as f64);
    println!(
        "| bytes uploaded per checkpoint | {} (blobs {}, trees {}) | bytes of the changed files: {} | **{:.2}×** blobs; {:.2}× with the trees | ≤ 1.1× plus metadata |",
        cell(&uploaded, 0),
        cell(&of(|r| r.blob_bytes as f64), 0),
        cell(&of(|r| r.tree_bytes as f64), 0),
        cell(&of(|r| r.changed_bytes as f64), 0),
        median(&blob_ratio),
        median(&uploaded) / median(&of(|r| r.changed_bytes as f64)),
    );
    println!(
        "\nObjects a checkpoint added: {} blobs, {} trees, and the session's reference; files \
         the checkpoint read: {}.\n",
        cell(&of(|r| r.blobs as f64), 0),
        cell(&of(|r| r.trees as f64), 0),
        cell(&of(|r| r.files_read as f64), 0),
    );
    println!("Where the object-store checkpoint's time goes (ms, medians of the rounds):\n");
    println!("| part | ms |\n|---|---|");
    println!("| the checkpoint, object store | {} |", cell(&s3, 1));
    println!(
        "| local scan and store (`record_blocking`, as the local area's checkpoint) | {} |",
        cell(&file, 1)
    );
    println!(
        "| its requests, sent by the bench through the same client: reference `PUT` + every new object at once (conditional `PUT` up to 64 KiB, else `HEAD`+`PUT`) | {} = {} + {} |",
        cell(&replay, 1),
        cell(&of(|r| r.replay_ref_ms), 1),
        cell(&of(|r| r.replay_objects_ms), 1),
    );
    println!(
        "| the rest (the upload's own work: the previous and new checkpoints' trees read from the local area to find what is new, the new blobs read; scheduling) | {} |",
        cell(&rest, 1)
    );
    println!(
        "| CPU over the checkpoint: this process (the runner's code) / the server | {} / {} |",
        cell(&of(|r| r.bench_cpu_ms), 0),
        cell(&of(|r| r.server_cpu_ms), 0),
    );
    println!(
        "\nThe server's latency per request, one at a time (ms): `HEAD` of a missing object {}, \
         of a present one {}, `PUT` of 4 KiB {}, `GET` of {probe_bytes} bytes {}; `HEAD`s: \
         {:.0}/s one at a time, {:.0}/s with {PARALLEL} in flight.",
        cell(&latency.head_missing_ms, 2),
        cell(&latency.head_ms, 2),
        cell(&latency.put_ms, 2),
        cell(&latency.get_ms, 2),
        latency.heads_per_sec_serial,
        latency.heads_per_sec_parallel,
    );
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let plan = if args.quick {
        Plan {
            files: 200,
            bytes: 2_000_000,
            changed: args.changed,
            rounds: 2,
            restores: 1,
        }
    } else {
        Plan {
            files: args.files,
            bytes: args.bytes,
            changed: args.changed,
            rounds: args.rounds,
            restores: args.restores,
        }
    };
    let dir = args.dir.join(format!("run-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let s3 = S3Server::start("agentlog-bench")?;
    // The runner's client reads these at `Remote::open`; set before any other thread runs.
    for (name, value) in s3.env() {
        std::env::set_var(name, value);
    }
    let result = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(run(&plan, &s3, &dir));
    std::fs::remove_dir_all(&dir)?;
    result
}
