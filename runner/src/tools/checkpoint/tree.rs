//! A directory as a checkpoint keeps it: its entries sorted by name, each with what a
//! restore needs (kind, mode, mtime, the content's or the subtree's hash, a link's target)
//! and what the next checkpoint compares to find it unchanged without reading it (inode,
//! size, ctime). Encoded with prost, so the encoding of the same entries is always the same
//! bytes and a tree's hash names it.

use prost::Message;

use super::area::Hash;

/// What an entry is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, prost::Enumeration)]
#[repr(i32)]
pub enum EntryKind {
    File = 0,
    Dir = 1,
    Symlink = 2,
    /// Left out by `--checkpoint-ignore`: recorded so a restore can say it is missing.
    LeftOut = 3,
    /// Not kept (a FIFO, a socket, a device, or a file the runner could not read); `note`
    /// says which.
    Skipped = 4,
}

#[derive(Clone, PartialEq, Message)]
pub struct Entry {
    #[prost(bytes = "vec", tag = "1")]
    pub name: Vec<u8>,
    #[prost(enumeration = "EntryKind", tag = "2")]
    pub kind: i32,
    /// Permission bits (`0o7777`).
    #[prost(uint32, tag = "3")]
    pub mode: u32,
    /// A file's blob or a directory's tree.
    #[prost(bytes = "vec", tag = "4")]
    pub object: Vec<u8>,
    /// A symbolic link's target.
    #[prost(bytes = "vec", tag = "5")]
    pub target: Vec<u8>,
    #[prost(uint64, tag = "6")]
    pub size: u64,
    #[prost(int64, tag = "7")]
    pub mtime_ns: i64,
    #[prost(uint64, tag = "8")]
    pub ino: u64,
    #[prost(int64, tag = "9")]
    pub ctime_ns: i64,
    #[prost(uint64, tag = "10")]
    pub dev: u64,
    /// Why a [`EntryKind::LeftOut`] or [`EntryKind::Skipped`] entry was not kept.
    #[prost(string, tag = "11")]
    pub note: String,
}

#[derive(Clone, PartialEq, Message)]
pub struct Tree {
    #[prost(message, repeated, tag = "1")]
    pub entries: Vec<Entry>,
}

impl Entry {
    /// The hash of its blob or tree, if it has one.
    pub fn object_hash(&self) -> Option<Hash> {
        self.object.as_slice().try_into().ok()
    }
}

impl Tree {
    pub fn to_bytes(&self) -> Vec<u8> {
        self.encode_to_vec()
    }

    pub fn from_bytes(bytes: &[u8]) -> Result<Tree, prost::DecodeError> {
        Tree::decode(bytes)
    }

    /// Pushes the subtrees this tree names onto `subtrees` and adds its files' blobs to
    /// `blobs`: one step of a walk that marks what a checkpoint reaches.
    pub fn reach(&self, subtrees: &mut Vec<Hash>, blobs: &mut std::collections::HashSet<Hash>) {
        for entry in &self.entries {
            match (entry.kind(), entry.object_hash()) {
                (EntryKind::Dir, Some(subtree)) => subtrees.push(subtree),
                (EntryKind::File, Some(blob)) => {
                    blobs.insert(blob);
                }
                _ => {}
            }
        }
    }

    /// The entry named `name` (entries are sorted by name).
    pub fn find(&self, name: &[u8]) -> Option<&Entry> {
        self.entries
            .binary_search_by(|e| e.name.as_slice().cmp(name))
            .ok()
            .map(|i| &self.entries[i])
    }
}
