//! kvq's CPU reference. It defines the exact byte layout and numerics every GPU kernel must reproduce,
//! and is the oracle of all GPU tests.
//!
//! Data flow for every scheme: quantize + pack a sequence's K/V (or XQuant's activations) into the
//! page layout of `docs/LAYOUT.md` → unpack and dequantize back to [`Dequantized`] K̂/V̂ → the one shared
//! [`attention::decode`] (with CalibQuant's calibration where the scheme asks for it).
//! [`step`] runs steps of several query tokens (causal, with each row's LSE) and merges partial
//! attention states computed over parts of a sequence.
//!
//! Tensors are head-major `[kv_heads][tokens][head_dim]` `f32` ([`KvTensor`]).

pub mod attention;
pub mod commvq;
mod error;
pub mod every_token;
pub mod footprint;
pub mod int;
pub mod pack;
mod par;
pub mod regions;
pub mod resources;
pub mod rope;
pub mod step;
pub mod synth;
mod tensor;
mod tensor_file;
pub mod xquant;

pub use error::RefError;
pub use tensor::{Dequantized, KvTensor};
