//! Compiles `agentlog/v1/*.proto` with protox (pure Rust, no system `protoc`) and keeps the
//! descriptor set, which the store serves through gRPC reflection.

use std::{env, path::PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let files = ["agentlog/v1/events.proto", "agentlog/v1/event_store.proto"];
    for file in files {
        println!("cargo:rerun-if-changed={file}");
    }
    let descriptors = protox::compile(files, ["."])?;
    let out = PathBuf::from(env::var("OUT_DIR")?);
    std::fs::write(
        out.join("agentlog_descriptor.bin"),
        prost::Message::encode_to_vec(&descriptors),
    )?;
    tonic_prost_build::configure()
        // Snapshot data is passed on as slices of the buffers it arrives in, never copied.
        .bytes(".agentlog.v1.SnapshotChunk.data")
        .codec_path("crate::codec::SliceCodec")
        .build_server(true)
        .build_client(true)
        .compile_fds(descriptors)?;
    Ok(())
}
