//! Kernel-variant rules: which code paths a scheme's decode kernels are rendered with (integer or
//! f16 keys, subnormal codes, packed score fragments, staged parameters, pieces, head tiles), by
//! the tensors' layouts and the shape. Each is a measured choice, stated with its measurement;
//! `decode.rs` renders what these say. Like the launch rules they are one place to read and
//! change, and need no GPU.

#[cfg(doc)]
use crate::context::MmaCtx;
use crate::context::{TensorCtx, TensorKind};
use crate::decode::{head_tiles_of, mma_head_groups, mma_unsupported_shape};
use crate::{KernelShape, PieceRule, TuneParams};
use kvq_spec::SchemeSpec;

/// Most head tiles of 8 query heads a warp of the tensor-core kernel may hold
/// ([`MmaCtx::head_tiles`]): for FP16 K and V two at head_dim 128 and four at head_dim 64, so
/// that a CTA serves up to 16 or 32 query heads and each K and V fragment it loads feeds every
/// tile's `mma`. With one tile a row, every group of 8 heads loaded the KV head's bytes through
/// its own SM's L1 again: at GQA 29 (four rows) FP16 took 1.79× its one-launch read floor on an
/// H100 with the SMs' L1/TEX throughput at 93% of its peak. Not for quantized
/// tensors: their kernels at head_dim 128 already use the registers a second tile's accumulators
/// would need. Not at head_dim 256, where one tile's accumulators take 64 registers a thread.
pub(crate) fn most_head_tiles(shape: &KernelShape, k: &TensorCtx, v: &TensorCtx) -> u32 {
    match (
        k.kind == TensorKind::Fp16 && v.kind == TensorKind::Fp16,
        shape.head_dim,
    ) {
        (true, 64) => 4,
        (true, 128) => 2,
        _ => 1,
    }
}

/// At most how many quantized rows of a tensor one of its FP16 rows (sink or tail window) costs
/// when the decode kernel divides a sequence among its split warps by cost (`kvq_share_range`),
/// as a C++ float literal. An FP16 row costs its bytes, but a warp reads the sink and the tail a
/// subtile at a time, a round trip each, while a quantized row costs the time its codes take to
/// convert. Per-warp timestamps at B=1 L=128K on an H100 put kivi2's FP16 rows at about
/// 0.18 µs a row against 0.039 µs a quantized row (4.7
/// rows), and the warp holding each KV head's 128-row tail ended 3–6 µs after the median warp;
/// KIVI-4's tail warps ended with the others at 3. With 4.5 for codes of at most
/// 2 bits the 1- and 2-bit built-ins ran ×1.005–×1.094 at B=1 L ≥ 32K and ×1.007–×1.139 at B=4,
/// but ×0.94–×1.00 at B=16 L=4K in eight-warp CTAs (one split a pair; by the division's arithmetic,
/// not timed, seven warps get exactly 17 32-token chunks with 3 and some get 18 with 4.5), so
/// those keep 3.
pub(crate) fn fp16_row_cap(t: &TensorCtx, tune: &TuneParams) -> String {
    if t.kind == TensorKind::Int && t.bits <= 2 && tune.warps() <= 4 {
        "4.5f".to_string()
    } else {
        "3.f".to_string()
    }
}

/// Whether two subtiles share a score fragment ([`MmaCtx::pack_heads`]), for kernels whose keys
/// take Kitty's boosted plane on the integer path (`k_high_int`). At GQA ≤ 4 the head columns 4–7
/// of every `mma` score nothing the kernel reads, so half of each thread's scores, and of its
/// softmax work (max, exp2, rescaling, packing P), went to waste. With the query of head `c mod 4`
/// in column `c`, the columns 4–7 of subtile `2i + 1` are the scores of heads 0–3 there, and they
/// take the place of subtile `2i`'s: the `mma` stay as many, the softmax's code a 64-token chunk
/// falls from 122 to 78 instructions, and the accumulators' columns 4–7 hold heads 0–3's sums over
/// the odd subtiles until the CTA's merge. Needs an even number of subtiles a chunk (tiles of 32 or
/// 64 tokens). Measured on an H100 at 32 query heads, 8
/// KV heads: Kitty ×1.015–×1.019 and Kitty-Pro ×1.006–×1.013 at B=16 L=32K, but ×0.975–×0.990
/// for Kitty at B=4 L=4K; for every other scheme no gain where the targets are (KIVI-4
/// ×0.973 at B=16 L=32K, kivi2 ×1.001, CalibQuant-2 ×0.995, INT8 ×0.998, FP16 ×1.001), so the
/// other kernels keep one subtile a fragment. With the select moved onto the integer sums
/// packing still gains at B=16 L=32K (Kitty ×1.020, Kitty-Pro ×1.010) and
/// still loses at B=4 L=4K (×0.975, ×0.966), where the tuner turns it off
/// ([`TuneParams::pack_heads`]).
pub(crate) fn pack_heads_pays(shape: &KernelShape, tune: &TuneParams) -> bool {
    shape.gqa <= 4 && (tune.tile_tokens / 16) % 2 == 0
}

/// Whether a calibrated scheme's keys take the integer path with a third, fine query limb
/// ([`MmaCtx::k_fine`]) rather than the f16 path. Calibration g(x) = a·x + b scales score errors
/// by |a| = |1 + (τ1 − τ2)/(δ − γ)|, unbounded as a head's score range shrinks: two limbs (16
/// bits of max|q⊙s|) put CalibQuant-1 at head_dim 256 past the tolerance on one seed (2.26e-3
/// against 2e-3), which passed on the f16 path (22 bits); the
/// fine limb gives about 24. Measured on an H100: 2-bit keys (CalibQuant-2)
/// ×1.017–×1.039 at B ≥ 4 and L ≥ 32K, 1-bit keys (CalibQuant-1, eight byte planes a word)
/// ×0.955–×0.984, so only 2-bit keys.
pub(crate) fn k_fine_pays(k: &TensorCtx) -> bool {
    k.kind == TensorKind::Int && k.bits == 2
}

/// How many byte planes of an integer key word are masked in place per shift
/// ([`MmaCtx::k_planes_in_place`]). A word of b-bit codes holds 8/b byte planes; cutting plane j
/// out as `(w >> b·j) & mask` costs a shift and an AND. Masked in place, `w & (mask << b·j)`, its
/// bytes are worth 2^(b·j) codes, and the page's fold divides that plane's query by the same power
/// of two before rounding it to its integer limbs: the shift is gone, and the plane's query keeps
/// b·j bits fewer. Pairs of 2-bit planes (one shift a word instead of three) for calibrated keys,
/// whose decode kernels carry the fine limb (22 bits left of 24) and whose range pass only sets the
/// calibration's constants. Measured on an H100:
/// CalibQuant-2 ×1.02–×1.04 at L ≥ 32K. Uncalibrated 2-bit keys (two limbs, 14 bits left of 16)
/// lost the gain to precision and placement: kivi2's largest f16 error against the reference rose
/// from about 4e-4 to 1.1e-3, and it ran ×1.024–×1.047 at B=16 but ×0.966 at B=1 L=128K, Kitty
/// ×0.974–×1.021; four planes a group put kivi2 (no shift) and 1-bit keys (one shift a word)
/// past the tolerance.
pub(crate) fn k_planes_in_place(k: &TensorCtx, calibrated: bool) -> u32 {
    if k.kind == TensorKind::Int && k.bits == 2 && calibrated {
        2
    } else {
        1
    }
}

/// Whether keys on the f16 path enter the score `mma` as f16 subnormals ([`MmaCtx::k_subnormal`]):
/// 1-bit asymmetric codes without a boosted plane. A code masked in place at bit p of a half is
/// exactly `code·2^(p−24)`, so a pair costs one AND where the magic-number conversion took an
/// AND-OR and an exact `fma` (or `sub`); the page's fold multiplies each pair's query halves by
/// 2^(24−p) times a power of two per head that keeps them finite, and the scores take its
/// inverse. Multiplying by powers of two is exact, so the scores are those of the magic-number
/// path but for query halves that fall below f16's normal range (low halves of channels under
/// 2^−10 of the head's largest), which round to multiples of 2^−24: at most 2^−29 of the head's
/// largest half at the same bit position. It applies to CalibQuant-1, whose range pass (which scores every key, with
/// stored scores) is bound by its instruction stream.
pub(crate) fn k_subnormal_pays(k: &TensorCtx) -> bool {
    k.kind == TensorKind::Int && k.bits == 1 && !k.symmetric && !k.boost
}

/// Whether CalibQuant's range pass takes the integer path for keys ([`MmaCtx::range_int`]): keys
/// of at most 2 bits, as for uncalibrated schemes, and no boost (the range pass's integer fold has
/// no high plane). Measured on an H100: CalibQuant-1
/// ×1.020–×1.033, CalibQuant-2 ×1.026–×1.058 over B ∈ {1, 4, 16} × L ∈ {4K, 32K, 128K}, with
/// every `gpu_decode` output within its dtype's tolerance and the largest errors as in earlier
/// rounds on the f16 path (CalibQuant-1 1.8e-3, CalibQuant-2 1.9e-3; before, 1.8e-3–2.1e-3).
pub(crate) fn range_int_pays(k: &TensorCtx) -> bool {
    k.kind == TensorKind::Int && k.bits <= 2 && !k.boost
}

/// Whether a calibrated scheme's range pass can store the keys' scores for its decode kernel
/// ([`MmaCtx::stored_scores`], where [`TuneParams::store_scores`] asks): quantized keys on the
/// tensor-core kernel. Scoring a key costs the same on either pass (the decode kernel's path, in
/// the same arithmetic), so the step scores each key once instead of twice, at the price of
/// writing and reading `gqa` floats a key and of the decode grid's first copies waiting for the
/// range grid's end.
pub(crate) fn stored_scores_pay(k: &TensorCtx) -> bool {
    k.kind == TensorKind::Int
}

/// Whether token-axis V codes enter P·V as f16 subnormals (`KvqPairs::get<true>`): a code
/// masked in place at bit p of a half is exactly `code·2^(p−24)`, so each pair costs one AND
/// where the magic-number conversion took an AND-OR and an exact `fma` to remove 1024 and the
/// offset (128 fewer instructions a 64-token chunk at head_dim 128). The sums are centred per
/// chunk against Σ p' (one more `mma` per subtile, one `fma` per accumulator), which keeps them
/// those of the magic-number path. Measured on an H100:
/// kivi2 ×1.031, Kitty ×1.032, Kitty-Pro ×1.023 at B=16 L=32K; KIVI-4 (4-bit V) ×0.991 and
/// ×1.007 in two runs, no gain, so it keeps the magic-number path. The price: the error against
/// the reference at L ≥ 32K is about 1.5× the magic-number path's (4.9e-4 against 3.1e-4 for
/// kivi2 at B=16 L=32K; tolerance 2e-3), as for the same arithmetic on the f16 path.
/// Keys on the f16 path were tried the same way (4-bit asymmetric keys masked in place, the fold
/// scaling each pair's query by 2^−p, the score taking 2^24): KIVI-4's scores block fell from 431
/// to 294 instructions a chunk with unchanged errors, yet it ran ×0.977 at B=16 L=32K and
/// ×0.967–×0.983 at L=128K, so keys keep the magic-number conversion too.
pub(crate) fn v_subnormal_pays(v: &TensorCtx) -> bool {
    v.kind == TensorKind::Int && v.bits <= 2
}

/// Whether channel-axis V codes enter P·V as f16 subnormals ([`MmaCtx::v_channel_subnormal`]):
/// asymmetric codes of at most 2 bits. Each pair then costs one AND instead of the magic-number
/// conversion's AND-OR, its exact code fix and the dequantising `fma` with the channel's scale and
/// zero; the page's scales move onto the f32 accumulators (a rescale per V page) and its zeros
/// into one `fma` per accumulator per chunk against Σ p. Measured on an H100: CalibQuant-1 ×1.072–×1.078 at B=16 L=32K, ×1.045 over the bench grid
/// (CalibQuant-2, with its fine limb, ×1.084–×1.088 and ×1.047). CalibQuant-1's error against the
/// reference rose at L ≥ 32K (at most 8.5e-4 against 3.0e-4; tolerance 2e-3), CalibQuant-2's fell.
pub(crate) fn v_channel_subnormal_pays(v: &TensorCtx) -> bool {
    v.kind == TensorKind::Int && v.bits <= 2 && !v.symmetric
}

/// Whether the range pass with stored scores on the f16 path meets the query's high and low halves
/// in one `mma` ([`MmaCtx::range_packed`]): at GQA ≤ 4 the score `mma`'s head columns 4–7 scored
/// nothing, so they take the low halves of heads 0–3 (the fold gives each B column one half) and
/// one shuffle adds lane `r ^ 2`'s sums to lane `r`'s: 32 `mma` a 64-token chunk instead of 64, 16
/// shuffles more, 96 registers instead of 124. Not with a boosted plane, whose scores are added
/// per head column. CalibQuant-1 on an H100: ×1.017 at B=16 L=32K, ×1.020 at L=128K, ×1.016 at
/// B=4 L=128K, ×0.993–×1.007 at B=1.
pub(crate) fn range_packs_halves(shape: &KernelShape, k: &TensorCtx) -> bool {
    shape.gqa <= 4 && !k.boost
}

/// Whether a decode kernel with stored scores whose channel-axis V enters P·V as subnormals
/// ([`MmaCtx::v_channel_subnormal`], page units applied when a chunk meets a new page) stages that
/// page's parameters into its stage's K parameter section, which it no longer uses
/// ([`MmaCtx::stage_v_params`]): 1-bit V whose parameters fit that section. Read from global memory there, that load was the decode
/// kernel's largest stall: 14.5% of CalibQuant-1's warp samples at B=16 L=32K on an H100 (ncu
/// source counters). Staged, CalibQuant-1 ran ×1.027–×1.033 at B=16 L ≥ 32K and ×0.990–×1.015
/// elsewhere; CalibQuant-2 (2-bit V) ×1.009–×1.025 at B=16 but ×0.954 at B=1 L=128K and ×0.966
/// at B=4 L=32K, for a reason not found, so 2-bit V keeps the load (staging
/// in a section of its own, without stored scores, lost ×0.95 for CalibQuant-2 at B=16 L=4K).
pub(crate) fn stages_v_params(k: &TensorCtx, v: &TensorCtx) -> bool {
    v.bits == 1 && v.block_bytes - v.scales_offset <= k.block_bytes - k.scales_offset
}

/// The kernel's piece rule. Measured on an H100 at B=16 L=32K: INT8 ran ×1.01–×1.03 with pieces; KIVI-4 ×0.93–×0.97, and with the piece
/// logic compiled in but unused it took 8 more registers and ran ×0.96; FP16 ×0.99. kivi2 and
/// Kitty-Pro lost with 1–4 pieces per split over 10–25% (×0.89–×0.98), but with the current 2-bit
/// kernels two pieces per (sequence, KV head) over 5% ran kivi2 ×1.01, Kitty
/// ×1.01, Kitty-Pro ×1.02 at B=16 L=32K (six splits), and over 4% ×1.16 for kivi2 at B=16 L=4K,
/// while at 24 and 99 splits (B=4, B=1) pieces lost ×0.60–×0.96. Calibrated schemes keep none:
/// with the piece logic CalibQuant-1's decode kernel had 17 spill instructions against 12.
pub(crate) fn piece_rule(k: &TensorCtx, v: &TensorCtx, calibrated: bool) -> PieceRule {
    let int = k.kind == TensorKind::Int && v.kind == TensorKind::Int;
    if int && k.bits >= 8 && v.bits >= 8 {
        PieceRule::LongShares
    } else if int && k.bits <= 2 && v.bits <= 2 && !calibrated {
        PieceRule::FewSplits
    } else {
        PieceRule::None
    }
}

/// Whether the default holds the decode kernel to twelve warps an SM (see
/// [`TuneParams::default_for`]): the tensor-core kernels of 1- and 2-bit K and V, and of FP16, at
/// head_dim ≤ 128 (at 256 the cap spills), but not FP16's kernels of more head tiles than fit the
/// cap's 168 registers: two at head_dim 128 spilled (187 local stores, NVRTC 13.0; uncapped 249
/// registers, eight warps an SM), three and four at head_dim 64 too (76 and 199–219 stores;
/// uncapped 229–233 and 252 registers); two at head_dim 64 fit.
pub(crate) fn twelve_warps_by_default(spec: &SchemeSpec, shape: &KernelShape) -> bool {
    if !crate::has_decode_kernel(spec) {
        return false;
    }
    let d = shape.head_dim as usize;
    let (Ok(k), Ok(v)) = (
        TensorCtx::new("k", spec, &spec.k, d),
        TensorCtx::new("v", spec, &spec.v, d),
    ) else {
        return false;
    };
    let low_bits =
        k.kind == TensorKind::Int && v.kind == TensorKind::Int && k.bits <= 2 && v.bits <= 2;
    let tiles = head_tiles_of(mma_head_groups(shape, &k, &v));
    let fp16 = k.kind == TensorKind::Fp16
        && v.kind == TensorKind::Fp16
        && (tiles == 1 || (d <= 64 && tiles <= 2));
    d <= 128 && (low_bits || fp16) && mma_unsupported_shape(shape, &k, &v).is_none()
}
