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
/// CalibQuant quantizes a multimodal model's visual tokens and keeps the text prefix in full
/// precision; the 32 FP16 sink tokens stand for that prefix (docs/SCHEMES.md).
#[scheme(
    k = int(1, channel),
    v = int(1, channel),
    sink = 32,
    local = 128,
    calibrate = calibrate(tau1 = -1.5, tau2 = 3.25)
)]
pub struct CalibQuant1;

/// CalibQuant 2-bit (FP16 prefix as CalibQuant 1-bit).
#[scheme(
    k = int(2, channel),
    v = int(2, channel),
    sink = 32,
    local = 128,
    calibrate = calibrate(tau1 = -1.25, tau2 = 0.75)
)]
pub struct CalibQuant2;

/// INT8 symmetric per-channel (scale = max|x|/127, round to nearest), as in the GPU quantization study.
#[scheme(k = int(8, channel, symmetric), v = int(8, channel, symmetric))]
pub struct Int8;

/// CommVQ 2-bit (the paper's LLaMA-3.1-8B setting): keys by a RoPE-commutative codebook of 64 entries
/// per pair, one 12-bit code per head (64 pairs) and round, 21 rounds (1.97 bits/scalar), normalised by
/// the token's norm over all KV heads; values by a binary additive code of 2 bits/scalar (256 rows per
/// 128-channel head). Pages of 128 tokens; the unfinished page stays FP16. See `docs/CODEBOOKS.md`.
#[scheme(
    k = codebook(rope_commutative, levels = 64, residuals = 21, pairs_per_code = 64, span = token),
    v = codebook(additive, rows = 256)
)]
pub struct CommVq2;

/// CommVQ 1-bit: as [`CommVq2`] with 10 key rounds (0.94 bits/scalar) and 128-row value codes.
#[scheme(
    k = codebook(rope_commutative, levels = 64, residuals = 10, pairs_per_code = 64, span = token),
    v = codebook(additive, rows = 128)
)]
pub struct CommVq1;

/// XQuant 2-bit (GQA form): cache the layer input's SVD latents `X·U_k` (per-channel over pages of 128
/// tokens) and `X·U_v` (per-token over the whole latent) and rematerialise K and V from them.
/// See `docs/CODEBOOKS.md`.
#[scheme(k = int(2, channel), v = int(2, token), source = x(latent))]
pub struct XQuant2;

/// XQuant 3-bit: as [`XQuant2`].
#[scheme(k = int(3, channel), v = int(3, token), source = x(latent))]
pub struct XQuant3;

/// XQuant 4-bit: as [`XQuant2`].
#[scheme(k = int(4, channel), v = int(4, token), source = x(latent))]
pub struct XQuant4;

/// XQuant-CL 2-bit: the latents of the cross-layer delta `X_i − X̂_{i−1}` against an accumulator of
/// the previous layers' reconstructions, quantized as in [`XQuant2`].
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

/// The name tables and files give a scheme: the built-in's whose spec it is, else `custom-`
/// and eight hex digits of its [`stable_hash`](SchemeSpec::stable_hash), so that the same text
/// gets the same label in every run and tool.
///
/// ```
/// use kvq::schemes::label;
/// let kivi2: kvq::SchemeSpec = "k = int(2, channel), v = int(2, token), local = 128".parse().unwrap();
/// assert_eq!(label(&kivi2), "kivi2");
/// let mine: kvq::SchemeSpec = "k = int(3, channel), v = int(4, token)".parse().unwrap();
/// assert!(label(&mine).starts_with("custom-"));
/// ```
pub fn label(spec: &SchemeSpec) -> String {
    BUILTIN.iter().find(|b| b.spec == *spec).map_or_else(
        || format!("custom-{:08x}", spec.stable_hash() >> 32),
        |b| b.name.to_string(),
    )
}

/// Whether a command-line or config argument is scheme text rather than a built-in's name: text
/// has a key (`=`) or a call (`(`), names have neither.
pub fn is_scheme_text(arg: &str) -> bool {
    arg.contains('=') || arg.contains('(')
}

/// A built-in's name (as [`by_name`]) or scheme text, parsed: what engines and bindings accept
/// wherever a scheme is named. The error says what was wrong, naming the built-ins when `arg` is
/// neither.
///
/// ```
/// use kvq::schemes::resolve;
/// assert_eq!(resolve(" KIVI2 ").unwrap(), resolve("kivi2").unwrap());
/// assert!(resolve("k = int(2, channel), v = int(2, token)").is_ok());
/// assert!(resolve("kivi9").unwrap_err().contains("neither a built-in"));
/// ```
pub fn resolve(arg: &str) -> Result<SchemeSpec, String> {
    let text = arg.trim();
    if let Some(builtin) = by_name(text) {
        return Ok(builtin.spec);
    }
    if !is_scheme_text(text) {
        let names: Vec<&str> = BUILTIN.iter().map(|b| b.name).collect();
        return Err(format!(
            "`{text}` is neither a built-in scheme ({}) nor scheme text such as \
             `k = int(2, channel), v = int(2, token)`",
            names.join(", ")
        ));
    }
    text.parse::<SchemeSpec>()
        .map_err(|e| format!("scheme `{text}`: {e}"))
}

/// Looks a built-in up by name (case-insensitive, `_` and `-` alike).
pub fn by_name(name: &str) -> Option<&'static Builtin> {
    let norm = |s: &str| s.to_ascii_lowercase().replace('_', "-");
    let want = norm(name);
    BUILTIN.iter().find(|b| norm(b.name) == want)
}
