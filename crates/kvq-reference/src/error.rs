//! Errors of the CPU reference.

use kvq_spec::ShapeError;

/// Why the reference refused an input.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum RefError {
    /// NaN or ±Inf in a tensor to be cached: never quantized into a silently broken cache.
    #[error("{tensor} holds a non-finite value ({value}) at kv head {head}, token {token}, channel {channel}")]
    NonFinite {
        tensor: &'static str,
        head: usize,
        token: usize,
        channel: usize,
        value: f32,
    },
    #[error(transparent)]
    Shape(#[from] ShapeError),
    /// Tensor sizes that do not agree with each other or with the declared shape.
    #[error("shape mismatch: {0}")]
    Mismatch(String),
    /// The scheme needs a different entry point (e.g. codebooks, or XQuant's activations).
    #[error("{0}")]
    WrongEntryPoint(String),
    /// A size larger than the machine's memory (or than 64 bits), refused before allocating.
    #[error(transparent)]
    Alloc(#[from] crate::resources::AllocError),
}
