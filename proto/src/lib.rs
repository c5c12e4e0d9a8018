//! The `agentlog.v1` protocol: messages, the `EventStore` client and server, and the
//! encoded descriptor set that the store serves through gRPC reflection.
#![forbid(unsafe_code)]

pub mod codec;
pub mod fields;
pub mod json;
pub mod kept;
pub mod reason;
pub mod release;
pub mod replay;
pub mod settled;
pub mod unknown;

pub mod v1 {
    #![allow(clippy::all)]
    tonic::include_proto!("agentlog.v1");
    // The server, decoding the requests that carry events into `crate::kept`'s types.
    include!(concat!(env!("OUT_DIR"), "/agentlog.v1.EventStore.rs"));
}

/// The encoded `FileDescriptorSet` of every agentlog proto file (with its imports).
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/agentlog_descriptor.bin"));
