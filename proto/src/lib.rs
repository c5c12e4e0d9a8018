//! The `agentlog.v1` protocol: messages, the `EventStore` client and server, and the
//! encoded descriptor set that the store serves through gRPC reflection.
#![forbid(unsafe_code)]

pub mod codec;
pub mod json;
pub mod reason;
pub mod replay;
pub mod settled;

pub mod v1 {
    #![allow(clippy::all)]
    tonic::include_proto!("agentlog.v1");
}

/// The encoded `FileDescriptorSet` of every agentlog proto file (with its imports).
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/agentlog_descriptor.bin"));
