//! The proto only grows: nothing of the last release's proto (message, field, enum value,
//! service, RPC) is removed, renamed, renumbered or retyped in the tree's, and no number or
//! name is reused; a field or value that leaves keeps its number and name in `reserved`.
//!
//! The last release is the newest one named in `CHANGELOG.md`; its proto comes from git
//! history at its commit (`grows/release.rs`) and is compared, descriptor against
//! descriptor, with the descriptor set this crate is built from (`grows/compare.rs`). The
//! check needs git and the release's commit in the clone: without them it fails, it never
//! passes unchecked.

mod grows {
    pub mod compare;
    pub mod release;
}

use std::path::Path;

use grows::{compare, release};
use prost::Message;
use prost_types::FileDescriptorSet;

#[test]
fn the_tree_proto_only_grows_from_the_last_release() {
    let repository = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the proto crate sits in the repository's root");
    let release = release::read_last_release(repository).unwrap_or_else(|e| panic!("{e}"));
    let old = release::release_proto(repository, &release).unwrap_or_else(|e| panic!("{e}"));
    let new = FileDescriptorSet::decode(agentlog_proto::FILE_DESCRIPTOR_SET)
        .expect("build.rs writes an encoded FileDescriptorSet");

    // An empty old set would pass vacuously: the release's proto must have been read.
    assert!(
        old.file.iter().any(|file| !file.message_type.is_empty()),
        "release {} (commit {}) has no message in its proto",
        release.version,
        release.commit
    );
    let violations = compare::violations(&old, &new);
    assert!(
        violations.is_empty(),
        "the tree's proto breaks release {} (commit {}); a field or enum value that leaves \
         must keep its number and name in `reserved`, nothing else may be removed or \
         changed:\n{}",
        release.version,
        release.commit,
        violations
            .iter()
            .map(|v| format!("  {v}"))
            .collect::<Vec<_>>()
            .join("\n")
    );
}
