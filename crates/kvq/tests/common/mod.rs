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

/// Calibrated schemes the built-ins do not cover: keys of 4 and 8 bits, and boosted keys, which
/// CalibQuant's range pass scores on the f16 path (with stored scores, the decode kernel's; with
/// the keys scored twice, its own), and token-axis V with a sink and a local window.
pub fn other_calibrated_schemes() -> Vec<(&'static str, SchemeSpec)> {
    [
        (
            "calibrated-int4",
            "k = int(4, channel), v = int(4, token), sink = 32, local = 128, \
             calibrate = calibrate(tau1 = -1.25, tau2 = 0.75)",
        ),
        (
            "calibrated-int8",
            "k = int(8, channel, symmetric), v = int(8, channel, symmetric), \
             calibrate = calibrate(tau1 = -0.5, tau2 = 0.25)",
        ),
        (
            "calibrated-boost",
            "k = int(2, channel, boost = boost(4, ratio = 0.125, by = magnitude)), \
             v = int(2, token, local = 128), sink = 32, page = 128, \
             calibrate = calibrate(tau1 = -1.5, tau2 = 3.25)",
        ),
    ]
    .into_iter()
    .map(|(name, text)| {
        let spec = SchemeSpec::parse(text).unwrap_or_else(|e| panic!("{name}: {e}"));
        (name, spec)
    })
    .collect()
}

/// Uncalibrated layouts the built-ins do not cover: FP16 keys with 2-bit values, whose centring
/// cannot follow K pages and takes every chunk (the twenty-first round's every-other-page centring
/// keys on them); 1-bit K and V, whose rows at head_dim 64 give a thread half a word (16 K
/// codes, 8 V codes; the keys take the f16 path there and the integer path at 128 and 256); and
/// CalibQuant-1 without its calibration (channel-axis 1-bit V, as subnormals, in one pass), which
/// the bench runner measures beside it (docs/BENCHMARKS.md, forty-fifth round).
pub fn other_uncalibrated_schemes() -> Vec<(&'static str, SchemeSpec)> {
    [
        ("fp16-k-kivi2-v", "k = fp16, v = int(2, token)"),
        (
            "one-bit-kv",
            "k = int(1, channel), v = int(1, token), sink = 16, local = 64",
        ),
        (
            "one-bit-channel-v",
            "k = int(1, channel), v = int(1, channel), sink = 32, local = 128",
        ),
    ]
    .into_iter()
    .map(|(name, text)| {
        let spec = SchemeSpec::parse(text).unwrap_or_else(|e| panic!("{name}: {e}"));
        (name, spec)
    })
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
