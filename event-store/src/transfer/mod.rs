//! Sessions that move: the export format ([`format`]), export ([`export`]: sessions read
//! through the storage contract, written as text a piece at a time) and import
//! ([`import`]: text read a line at a time, each session recreated exactly, or refused on
//! its own). The gRPC edge (`Export`, `Import`) and the archive of `--archive-dir` ([`archive`]) run them over any [`crate::backend::Backend`].

pub mod archive;
pub mod export;
pub mod format;
pub mod import;
