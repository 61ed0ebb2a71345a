//! The built-in schemes, declared with the same attribute users write.
//!
//! Paper configurations; where a paper leaves a detail open the choice is recorded in
//! `docs/SCHEMES.md`.

use crate::{scheme, Scheme, SchemeSpec};

/// FP16 cache: the baseline every speed and error figure is measured against.
#[scheme(k = fp16, v = fp16)]
pub struct Fp16;

/// KIVI 2-bit: per-channel keys, per-token values, 128 recent tokens in FP16.
#[scheme(k = int(2, channel), v = int(2, token), local = 128)]
pub struct Kivi2;

/// KIVI 4-bit.
#[scheme(k = int(4, channel), v = int(4, token), local = 128)]
pub struct Kivi4;

/// Kitty: KIVI-2 keys with the top 12.5% channels of each page boosted to 4-bit, 32 sink tokens,
/// a 128-token FP16 local window for values.
#[scheme(
    k = int(2, channel, boost = boost(4, ratio = 0.125, by = magnitude)),
    v = int(2, token, local = 128),
    sink = 32,
    page = 128
)]
pub struct Kitty;

/// Kitty-Pro: as Kitty with 25% of the key channels boosted.
#[scheme(
    k = int(2, channel, boost = boost(4, ratio = 0.25, by = magnitude)),
    v = int(2, token, local = 128),
    sink = 32,
    page = 128
)]
pub struct KittyPro;

/// CalibQuant 1-bit: per-channel 1-bit keys and values, post-scaled, with score calibration.
#[scheme(
    k = int(1, channel),
    v = int(1, channel),
    local = 128,
    calibrate = calibrate(tau1 = 0.6, tau2 = 0.1)
)]
pub struct CalibQuant1;

/// CalibQuant 2-bit.
#[scheme(
    k = int(2, channel),
    v = int(2, channel),
    local = 128,
    calibrate = calibrate(tau1 = 0.3, tau2 = 0.05)
)]
pub struct CalibQuant2;

/// INT8 symmetric per-channel (scale = max|x|/127, round to nearest), as in the GPU quantization study.
#[scheme(k = int(8, channel, symmetric), v = int(8, channel, symmetric))]
pub struct Int8;

/// CommVQ 2-bit: RoPE-commutative additive codebook for keys, additive binary codebook for values.
#[scheme(
    k = codebook(rope_commutative, levels = 16, residuals = 8, pairs_per_code = 8),
    v = codebook(additive, rows = 256)
)]
pub struct CommVq2;

/// CommVQ 1-bit.
#[scheme(
    k = codebook(rope_commutative, levels = 16, residuals = 4, pairs_per_code = 8),
    v = codebook(additive, rows = 128)
)]
pub struct CommVq1;

/// XQuant 2-bit: cache the layer input's K/V latents and rematerialise K and V.
#[scheme(k = int(2, channel), v = int(2, token), source = x(latent))]
pub struct XQuant2;

/// XQuant 3-bit.
#[scheme(k = int(3, channel), v = int(3, token), source = x(latent))]
pub struct XQuant3;

/// XQuant 4-bit.
#[scheme(k = int(4, channel), v = int(4, token), source = x(latent))]
pub struct XQuant4;

/// XQuant-CL 2-bit: cross-layer deltas of the cached activations.
#[scheme(k = int(2, channel), v = int(2, token), source = x(cross_layer))]
pub struct XQuantCl2;

/// A built-in scheme by name.
#[derive(Debug, Clone, Copy)]
pub struct Builtin {
    /// Lower-case name used by the CLI (`kivi2`, `kitty-pro`, ...).
    pub name: &'static str,
    pub spec: SchemeSpec,
}

macro_rules! builtins {
    ($($name:literal => $ty:ty),* $(,)?) => {
        /// Every built-in scheme, in the order tables print them.
        pub const BUILTIN: &[Builtin] = &[$(Builtin { name: $name, spec: <$ty as Scheme>::SPEC }),*];
    };
}

builtins! {
    "fp16" => Fp16,
    "kivi2" => Kivi2,
    "kivi4" => Kivi4,
    "kitty" => Kitty,
    "kitty-pro" => KittyPro,
    "calibquant1" => CalibQuant1,
    "calibquant2" => CalibQuant2,
    "int8" => Int8,
    "commvq2" => CommVq2,
    "commvq1" => CommVq1,
    "xquant2" => XQuant2,
    "xquant3" => XQuant3,
    "xquant4" => XQuant4,
    "xquant-cl2" => XQuantCl2,
}

/// Looks a built-in up by name (case-insensitive, `_` and `-` alike).
pub fn by_name(name: &str) -> Option<&'static Builtin> {
    let norm = |s: &str| s.to_ascii_lowercase().replace('_', "-");
    let want = norm(name);
    BUILTIN.iter().find(|b| norm(b.name) == want)
}
