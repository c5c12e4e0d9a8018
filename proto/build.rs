//! Compiles `agentlog/v1/*.proto` with protox (pure Rust, no system `protoc`) and keeps the
//! descriptor set, which the store serves through gRPC reflection.
//!
//! The messages and the client come from tonic-prost-build as usual. The server is generated
//! from the same service description with one difference: the requests that carry events
//! (`Append`, `AppendStream`, `ForkSession`) are decoded into `crate::kept`'s types, which
//! keep each event's bytes as its writer encoded them, so that a field this build does not
//! know is stored rather than dropped.

use std::{env, path::PathBuf};

use prost_types::FileDescriptorSet;

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
    tonic_build::manual::Builder::new()
        .build_client(false)
        .compile(&[event_store_server(&descriptors)?]);
    tonic_prost_build::configure()
        // Snapshot data is passed on as slices of the buffers it arrives in, never copied.
        .bytes(".agentlog.v1.SnapshotChunk.data")
        .codec_path("crate::codec::SliceCodec")
        .build_server(false)
        .build_client(true)
        .compile_fds(descriptors)?;
    Ok(())
}

/// `agentlog.v1.EventStore` as the server decodes it: every RPC as the proto declares it,
/// but a request that carries events decoded into its kept form.
fn event_store_server(
    descriptors: &FileDescriptorSet,
) -> Result<tonic_build::manual::Service, Box<dyn std::error::Error>> {
    let service = descriptors
        .file
        .iter()
        .filter(|f| f.package() == "agentlog.v1")
        .flat_map(|f| &f.service)
        .find(|s| s.name() == "EventStore")
        .ok_or("agentlog.v1.EventStore is not in the proto files")?;
    let mut builder = tonic_build::manual::Service::builder()
        .name("EventStore")
        .package("agentlog.v1");
    for method in &service.method {
        let message = |full: &str| {
            full.strip_prefix(".agentlog.v1.")
                .map(|name| format!("super::{name}"))
                .ok_or_else(|| format!("{full} is not an agentlog.v1 message"))
        };
        let (input, codec) = match method.input_type() {
            ".agentlog.v1.AppendRequest" => (
                "crate::kept::KeptAppendRequest".to_string(),
                "crate::codec::BytesCodec",
            ),
            ".agentlog.v1.ForkSessionRequest" => (
                "crate::kept::KeptForkRequest".to_string(),
                "crate::codec::BytesCodec",
            ),
            other => (message(other)?, "crate::codec::SliceCodec"),
        };
        let mut m = tonic_build::manual::Method::builder()
            .name(snake_case(method.name()))
            .route_name(method.name())
            .input_type(input)
            .output_type(message(method.output_type())?)
            .codec_path(codec);
        if method.client_streaming() {
            m = m.client_streaming();
        }
        if method.server_streaming() {
            m = m.server_streaming();
        }
        builder = builder.method(m.build());
    }
    Ok(builder.build())
}

/// `AppendStream` → `append_stream`, as tonic names a method's function.
fn snake_case(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + 4);
    for (i, c) in name.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}
