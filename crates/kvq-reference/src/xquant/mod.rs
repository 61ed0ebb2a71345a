//! XQuant (Tomar et al., 2025): cache the layer input instead of K and V, quantized, and rematerialise
//! `K = RoPE(X·W_k)`, `V = X·W_v` on the fly.
//!
//! - `source = x(latent)` (GQA models, where X is wider than K and V): the SVD `W = U Σ Bᵀ` of each
//!   projection gives latents `X·U` ([`projection`]); the K latent is quantized with the scheme's `k`
//!   spec (per-channel), the V latent with its `v` spec (per-token), in the integer store of
//!   [`crate::int`] (sink/local FP16 regions included). `K̂ = RoPE(L̂_k·ΣBᵀ)`, `V̂ = L̂_v·ΣBᵀ`.
//! - `source = x(cross_layer)` (XQuant-CL): the same latents, of the delta `X_i − X̂_{i−1}` against an
//!   X-space accumulator carried from layer to layer (see `lift.rs`).
//! - V needs no rematerialisation: `Σ_t p_t (l_t·up) = (Σ_t p_t l_t)·up`
//!   ([`XQuantCache::weighted_values`]).

mod cache;
mod eigen;
mod file;
mod lift;
pub mod projection;
pub mod svd;
mod synthetic;

pub use cache::{latent_store_width, XQuantCache};
pub use file::{ProjectionFileError, PROJECTION_FILE_FORMAT, PROJECTION_FILE_LIMIT};
pub use projection::{LatentProjection, Projections};
