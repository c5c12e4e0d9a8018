//! The codecs of the agentlog RPCs: prost's encoding, and decoding from the contiguous
//! bytes of a message rather than through tonic's buffer as a [`bytes::Buf`]: each field
//! read then moves a slice instead of calling the buffer's `advance` (which showed as 7%
//! of a catch-up reader's CPU). The bytes on the wire are the same. [`SliceCodec`] decodes
//! from a borrowed slice; [`BytesCodec`], for the requests whose events are kept as they
//! came ([`crate::kept`]), from the message's own [`Bytes`], so that what is kept is a
//! slice of it rather than a copy.

use std::marker::PhantomData;

use bytes::{Buf, Bytes};
use prost::Message;
use tonic::codec::{Codec, DecodeBuf, Decoder};
use tonic::Status;
use tonic_prost::{ProstCodec, ProstEncoder};

/// prost messages, decoded from one slice.
#[derive(Debug, Clone)]
pub struct SliceCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for SliceCodec<T, U> {
    fn default() -> Self {
        SliceCodec(PhantomData)
    }
}

impl<T, U> Codec for SliceCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = SliceDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::new().encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        SliceDecoder(PhantomData)
    }
}

/// Decodes a `U` from the message's bytes as one slice.
#[derive(Debug, Clone)]
pub struct SliceDecoder<U>(PhantomData<U>);

impl<U: Message + Default> Decoder for SliceDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        let len = buf.remaining();
        // tonic hands over a whole message, buffered contiguously; should a buffer ever
        // come in pieces, it is decoded through `Buf` as prost's own codec does.
        let decoded = if buf.chunk().len() == len {
            let decoded = U::decode(buf.chunk());
            buf.advance(len);
            decoded
        } else {
            U::decode(buf)
        };
        // As prost's codec answers: a message that does not parse is INTERNAL.
        decoded
            .map(Some)
            .map_err(|e| Status::internal(e.to_string()))
    }
}

/// prost messages, decoded from the message's own bytes ([`crate::kept`]'s requests).
#[derive(Debug, Clone)]
pub struct BytesCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for BytesCodec<T, U> {
    fn default() -> Self {
        BytesCodec(PhantomData)
    }
}

impl<T, U> Codec for BytesCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = BytesDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::new().encoder()
    }

    fn decoder(&mut self) -> Self::Decoder {
        BytesDecoder(PhantomData)
    }
}

/// Decodes a `U` from the message's bytes, taken out of tonic's buffer without a copy.
#[derive(Debug, Clone)]
pub struct BytesDecoder<U>(PhantomData<U>);

impl<U: Message + Default> Decoder for BytesDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        let bytes: Bytes = buf.copy_to_bytes(buf.remaining());
        U::decode(bytes)
            .map(Some)
            .map_err(|e| Status::internal(e.to_string()))
    }
}
