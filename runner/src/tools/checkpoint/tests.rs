//! The checkpoint area without a store: record, restore, adopt and sweep on a temporary
//! workspace root, compared with the files themselves.

use std::collections::BTreeMap;
use std::fs;
use std::os::unix::fs::{symlink, MetadataExt, PermissionsExt};
use std::path::Path;
use std::time::Duration;

use super::*;

/// Everything a restore must bring back, per path: kind, mode, content or target, mtime.
fn describe(dir: &Path) -> BTreeMap<String, String> {
    fn walk(base: &Path, dir: &Path, out: &mut BTreeMap<String, String>) {
        for entry in fs::read_dir(dir).expect("read dir") {
            let entry = entry.expect("entry");
            let path = entry.path();
            let rel = path
                .strip_prefix(base)
                .expect("below")
                .to_string_lossy()
                .into_owned();
            let meta = fs::symlink_metadata(&path).expect("metadata");
            let mode = meta.permissions().mode() & 0o7777;
            let what = if meta.file_type().is_symlink() {
                format!("link -> {}", fs::read_link(&path).expect("link").display())
            } else if meta.is_dir() {
                walk(base, &path, out);
                format!(
                    "dir {mode:o} {}",
                    meta.mtime_nsec() + meta.mtime() * 1_000_000_000
                )
            } else {
                format!(
                    "file {mode:o} {} {:?}",
                    meta.mtime_nsec() + meta.mtime() * 1_000_000_000,
                    fs::read(&path).expect("read")
                )
            };
            out.insert(rel, what);
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, dir, &mut out);
    out
}

/// Makes the files' ctimes older than the next checkpoint's scan (see `scan.rs`).
fn settle() {
    std::thread::sleep(Duration::from_millis(30));
}

fn write(path: &Path, content: &str) {
    if let Some(parent) = path.parent() {
        fs::create_dir_all(parent).expect("mkdir");
    }
    fs::write(path, content).expect("write");
}

fn checkpoints(root: &Path, ignore: &[&str]) -> Checkpoints {
    Checkpoints::new(root, IgnoreRules::new(ignore), None)
}

#[test]
fn a_checkpoint_restores_files_modes_links_and_empty_directories_exactly() {
    let root = tempfile::tempdir().expect("temp dir");
    let ws = root.path().join("s1");
    write(&ws.join("a.txt"), "alpha");
    write(&ws.join("src/lib.rs"), "pub fn f() {}");
    fs::create_dir_all(ws.join("empty/inner")).expect("mkdir");
    write(&ws.join("run.sh"), "#!/bin/sh\necho hi\n");
    fs::set_permissions(ws.join("run.sh"), fs::Permissions::from_mode(0o755)).expect("chmod");
    fs::set_permissions(ws.join("a.txt"), fs::Permissions::from_mode(0o444)).expect("chmod");
    symlink("a.txt", ws.join("link")).expect("symlink");
    symlink("../../nowhere", ws.join("dangling")).expect("symlink");
    fs::set_permissions(ws.join("empty"), fs::Permissions::from_mode(0o750)).expect("chmod");
    let cps = checkpoints(root.path(), &[]);
    let first = cps.record_blocking("s1").expect("record");
    assert_eq!(first.id.len(), 64);

    let copy = root.path().join("copy");
    let missing = cps.materialize(&first.id, &copy).expect("restore");
    assert_eq!(missing, Vec::<String>::new());
    assert_eq!(describe(&copy), describe(&ws));
}

#[test]
fn only_files_whose_metadata_moved_are_read_and_unchanged_workspaces_keep_their_id() {
    let root = tempfile::tempdir().expect("temp dir");
    let ws = root.path().join("s1");
    for i in 0..50 {
        write(
            &ws.join(format!("d{}/f{i}.txt", i % 5)),
            &format!("file {i}"),
        );
    }
    settle();
    let cps = checkpoints(root.path(), &[]);
    let first = cps.record_blocking("s1").expect("record");
    assert_eq!(first.files_read, 50);
    settle();
    let again = cps.record_blocking("s1").expect("record");
    assert_eq!(
        (again.id.as_str(), again.files_read),
        (first.id.as_str(), 0)
    );

    // Changed, renamed, deleted and made by "bash", whatever the tool.
    write(&ws.join("d1/f1.txt"), "changed");
    fs::rename(ws.join("d2/f2.txt"), ws.join("d3/moved.txt")).expect("mv");
    fs::remove_file(ws.join("d4/f4.txt")).expect("rm");
    write(&ws.join("new/made.txt"), "new");
    settle();
    // A fresh runner (nothing kept in memory) finds the same, from the area alone.
    let fresh = checkpoints(root.path(), &[]);
    let second = fresh.record_blocking("s1").expect("record");
    assert_ne!(second.id, first.id);
    // The changed, the moved (a rename moves its ctime) and the new file; no other.
    assert_eq!(second.files_read, 3, "{second:?}");

    let before = root.path().join("before");
    cps.materialize(&first.id, &before).expect("restore");
    assert_eq!(
        fs::read_to_string(before.join("d1/f1.txt")).expect("read"),
        "file 1"
    );
    assert!(before.join("d2/f2.txt").exists() && before.join("d4/f4.txt").exists());
    assert!(!before.join("new").exists());
    let after = root.path().join("after");
    cps.materialize(&second.id, &after).expect("restore");
    assert_eq!(describe(&after), describe(&ws));
}

#[test]
fn a_file_changed_within_the_last_scans_clock_tick_is_read_again() {
    let root = tempfile::tempdir().expect("temp dir");
    let ws = root.path().join("s1");
    write(&ws.join("f"), "one");
    let cps = checkpoints(root.path(), &[]);
    let first = cps.record_blocking("s1").expect("record");
    // Same size, and possibly the same mtime and ctime tick as the first scan.
    write(&ws.join("f"), "two");
    let second = cps.record_blocking("s1").expect("record");
    assert_ne!(first.id, second.id);
    let copy = root.path().join("copy");
    cps.materialize(&second.id, &copy).expect("restore");
    assert_eq!(fs::read_to_string(copy.join("f")).expect("read"), "two");
}

#[test]
fn ignored_trees_are_left_out_and_a_restore_says_so() {
    let root = tempfile::tempdir().expect("temp dir");
    let ws = root.path().join("s1");
    write(&ws.join("node_modules/pkg/index.js"), "x");
    write(&ws.join("web/node_modules/y.js"), "y");
    write(&ws.join("keep.txt"), "k");
    let cps = checkpoints(root.path(), &DEFAULT_IGNORE);
    let first = cps.record_blocking("s1").expect("record");
    assert_eq!(first.files_read, 1);
    // What changes inside an ignored tree does not change the checkpoint.
    write(&ws.join("node_modules/pkg/other.js"), "z");
    assert_eq!(cps.record_blocking("s1").expect("record").id, first.id);
    let copy = root.path().join("copy");
    let mut missing = cps.materialize(&first.id, &copy).expect("restore");
    missing.sort();
    assert_eq!(
        missing,
        vec![
            "node_modules: left out by --checkpoint-ignore node_modules/".to_string(),
            "web/node_modules: left out by --checkpoint-ignore node_modules/".to_string(),
        ]
    );
    assert!(copy.join("keep.txt").exists() && !copy.join("node_modules").exists());
}

#[test]
fn a_fork_is_restored_once_and_says_what_it_could_not_restore() {
    let root = tempfile::tempdir().expect("temp dir");
    let parent = root.path().join("p");
    write(&parent.join("a.txt"), "a");
    write(&parent.join("target/big.o"), "obj");
    let cps = checkpoints(root.path(), &DEFAULT_IGNORE);
    let first = cps.record_blocking("p").expect("record");
    write(&parent.join("a.txt"), "later");
    cps.record_blocking("p").expect("record");

    // A leftover of a restore that died before it was marked is replaced.
    write(&root.path().join("f/stale.txt"), "stale");
    let prefix = PrefixCheckpoints {
        named: vec![first.id.clone()],
        latest: Some((4, first.id.clone())),
        last_result_seq: Some(4),
    };
    let report = cps
        .restore_fork_blocking("f", "p", 5, &prefix)
        .expect("restore")
        .expect("a report");
    assert!(report.contains("fork of p at seq 5"), "{report}");
    assert!(report.contains("target: left out"), "{report}");
    let ws = root.path().join("f");
    assert_eq!(fs::read_to_string(ws.join("a.txt")).expect("read"), "a");
    assert!(!ws.join("stale.txt").exists() && !ws.join("target").exists());
    assert!(cps.is_restored("f") && cps.is_adopted("f"));
    // The note reaches the model with the fork's next result, once.
    let next = cps.record_blocking("f").expect("record");
    assert!(next.note.as_deref().is_some_and(|n| n.contains("target")));

    // Restored once: a later claim leaves the workspace alone.
    write(&ws.join("work.txt"), "the fork's own");
    assert_eq!(
        cps.restore_fork_blocking("f", "p", 5, &prefix)
            .expect("restore"),
        None
    );
    assert!(ws.join("work.txt").exists());
}

#[test]
fn a_fork_whose_prefix_names_no_checkpoint_starts_empty_and_says_why_if_calls_ran() {
    let root = tempfile::tempdir().expect("temp dir");
    let cps = checkpoints(root.path(), &[]);
    let report = cps
        .restore_fork_blocking("f1", "p", 1, &PrefixCheckpoints::default())
        .expect("restore")
        .expect("report");
    assert!(!report.contains("Not restored"), "{report}");
    assert!(root.path().join("f1").is_dir());
    let prefix = PrefixCheckpoints {
        last_result_seq: Some(3),
        ..PrefixCheckpoints::default()
    };
    let report = cps
        .restore_fork_blocking("f2", "p", 3, &prefix)
        .expect("restore")
        .expect("report");
    assert!(report.contains("no tool result up to seq 3"), "{report}");
}

#[test]
fn the_gc_keeps_what_existing_sessions_name_and_sweeps_the_rest() {
    let root = tempfile::tempdir().expect("temp dir");
    let parent = root.path().join("p");
    write(&parent.join("shared.txt"), "in both");
    write(&parent.join("early.txt"), "early");
    let cps = checkpoints(root.path(), &[]);
    let early = cps.record_blocking("p").expect("record");
    fs::remove_file(parent.join("early.txt")).expect("rm");
    write(
        &parent.join("late.txt"),
        "only the parent's later checkpoint",
    );
    let late = cps.record_blocking("p").expect("record");
    // A fork made at the early checkpoint adopts it (its log names it).
    cps.adopt("f", std::slice::from_ref(&early.id))
        .expect("adopt");
    // Left by a crash mid-write.
    fs::write(cps.area_dir().join("tmp/w-leftover"), "x").expect("write");

    let swept = cps.forget_and_sweep(&["p".to_string()]).expect("sweep");
    assert!(swept.blobs_removed >= 1, "{swept:?}");
    let copy = root.path().join("copy");
    assert_eq!(
        cps.materialize(&early.id, &copy).expect("restore"),
        Vec::<String>::new()
    );
    assert_eq!(
        fs::read_to_string(copy.join("early.txt")).expect("read"),
        "early"
    );
    let gone = root.path().join("gone");
    let missing = cps.materialize(&late.id, &gone).expect("restore");
    assert!(
        !missing.is_empty(),
        "the parent's later checkpoint went with it"
    );
    assert_eq!(
        fs::read_dir(cps.area_dir().join("tmp"))
            .expect("tmp")
            .count(),
        0
    );

    cps.forget_and_sweep(&["f".to_string()]).expect("sweep");
    for objects in ["blobs", "trees"] {
        assert_eq!(
            fs::read_dir(cps.area_dir().join(objects))
                .expect("objects")
                .count(),
            0,
            "{objects}"
        );
    }
}
