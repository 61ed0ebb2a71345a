//! Helpers shared by the GPU test files.
#![allow(dead_code)]

use kvq::schemes::BUILTIN;
use kvq::{CacheSource, SchemeSpec, TensorQuant};
use std::time::{SystemTime, UNIX_EPOCH};

/// The built-ins with GPU kernels today: integer and FP16 schemes caching K/V.
pub fn integer_schemes() -> Vec<(&'static str, SchemeSpec)> {
    BUILTIN
        .iter()
        .filter(|b| b.spec.source == CacheSource::Kv)
        .filter(|b| {
            ![b.spec.k, b.spec.v]
                .iter()
                .any(|t| matches!(t, TensorQuant::Codebook(_)))
        })
        .map(|b| (b.name, b.spec))
        .collect()
}

/// A fresh seed per run (printed by the tests), or `KVQ_SEED` to repeat one.
pub fn seed() -> u64 {
    std::env::var("KVQ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(1, |d| d.as_nanos() as u64)
        })
}
