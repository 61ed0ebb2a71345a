//! The fused split-K decode kernels of the integer and FP16 schemes, with their launch metadata.

use crate::context::{CodeAxis, DecodeCtx, MmaCtx, StagePlan, TensorCtx, TensorKind};
use crate::head_groups::HeadGroups;
use crate::rules::variants::{
    fp16_row_cap, k_fine_pays, k_planes_in_place, k_subnormal_pays, most_head_tiles,
    pack_heads_pays, piece_rule, range_int_pays, range_packs_halves, stages_v_params,
    stored_scores_pay, v_channel_subnormal_pays, v_subnormal_pays,
};
use crate::templates::render;
use crate::{CodegenError, KernelShape, TuneParams};
use kvq_spec::{CacheSource, SchemeSpec, TensorQuant};
use serde::Serialize;

/// One `extern "C"` entry point of a generated module and how to launch it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KernelEntry {
    pub name: String,
    /// Parameters in order, as `(C type, name)`.
    pub params: Vec<(String, String)>,
    /// Grid as formulas of the launch's values.
    pub grid: [String; 3],
    pub block: u32,
    /// Dynamic shared memory bytes; when non-zero a launcher sets the function's
    /// `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES` to it first (the driver refuses launches
    /// whose static plus dynamic shared memory passes 48 KiB without it).
    pub dynamic_shared_bytes: u32,
}

/// Generated source of one scheme × shape × tuning, and what it takes to run it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DecodeKernels {
    pub scheme: String,
    pub shape: KernelShape,
    pub tune: TuneParams,
    pub source: String,
    /// Split-K decode: writes per-split partial results.
    pub decode: KernelEntry,
    /// Why the generic CUDA-core kernel serves this shape; `None` on the tensor-core kernel.
    pub slow_path: Option<SlowPath>,
    /// Merges the splits (and pieces) into the output.
    pub combine: KernelEntry,
    /// Where the runtime's default launches this kernel with pieces; `PieceRule::None` for a
    /// kernel that runs none (see [`DecodeKernels::runs_pieces`]).
    pub piece_rule: PieceRule,
    /// CalibQuant's score-range pass (before `decode`), when the scheme calibrates.
    pub range: Option<KernelEntry>,
    /// The range pass stores every quantized key's scores in `scores` and the decode kernel
    /// reads them back instead of the keys: `scores` must then hold
    /// [`score_floats`](Self::score_floats) floats. Otherwise both kernels ignore it.
    pub stores_scores: bool,
    /// Rows the decode and range grids take a KV head (`gridDim.y = kv_heads · head_groups`): more
    /// than 1 where the tensor-core kernel splits a KV head's query heads into groups
    /// ([`HeadGroups`]), else 1.
    pub head_groups: u32,
    /// Query heads one grid row scores: `shape.gqa` with one row a KV head, else a group's
    /// (`head_groups × group_heads` exceeds `gqa` where the last row shares heads with the one
    /// before, [`HeadGroups::overlap`]).
    pub group_heads: u32,
    /// Tokens of one sequence a quantized page holds (the scheme's group).
    pub page_tokens: u32,
    /// Bytes of one K page block and one V page block of one KV head.
    pub k_block_bytes: usize,
    pub v_block_bytes: usize,
    /// FP16 tail ring capacity (tokens) per KV head, for K and V (0 for FP16 tensors).
    pub k_tail_capacity: u32,
    pub v_tail_capacity: u32,
}

pub(crate) fn param(ty: &str, name: &str) -> (String, String) {
    (ty.to_string(), name.to_string())
}

/// The parameters every decode entry point starts with: the queries, the paged cache (pools, page
/// table, FP16 sink and tail buffers) and which sequences a launch takes.
pub(crate) fn paged_params() -> Vec<(String, String)> {
    vec![
        param("const uint16_t*", "q"),
        param("const uint8_t*", "k_pool"),
        param("const uint8_t*", "v_pool"),
        param("const int32_t*", "page_table"),
        param("int32_t", "max_pages"),
        param("const uint16_t*", "k_sink"),
        param("const uint16_t*", "v_sink"),
        param("const uint16_t*", "k_tail"),
        param("const uint16_t*", "v_tail"),
        param("const int32_t*", "seq_lens"),
        param("const int32_t*", "seq_slots"),
    ]
}

/// [`paged_params`] and the query tokens a sequence (`q_len`), for the decodes that take steps
/// of several.
pub(crate) fn cache_params() -> Vec<(String, String)> {
    let mut p = paged_params();
    p.push(param("int32_t", "q_len"));
    p
}

/// The combine entry point (kvq/combine.cuh) every split-K decode family shares.
pub(crate) fn combine_entry(name: &str) -> KernelEntry {
    KernelEntry {
        name: name.to_string(),
        params: vec![
            param("const float*", "part_acc"),
            param("const float*", "part_ml"),
            param("uint16_t*", "out"),
            param("float*", "lse"),
            param("int32_t", "num_parts"),
        ],
        grid: ["q_heads".into(), "batch".into(), "1".into()],
        block: COMBINE_THREADS,
        dynamic_shared_bytes: 0,
    }
}

/// A stable identifier of scheme × shape × tuning, for kernel names and caches (FNV-1a).
fn kernel_id(spec: &SchemeSpec, shape: &KernelShape, tune: &TuneParams) -> String {
    stable_id(&format!("{spec}|{shape:?}|{tune:?}"))
}

/// FNV-1a of `key` as 16 hex digits: kernel names that stay the same from run to run.
pub(crate) fn stable_id(key: &str) -> String {
    let h = key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("{h:016x}")
}

/// Why the generic CUDA-core decode kernel serves a shape instead of the tensor-core kernel.
/// [`DecodeKernels::slow_path`] carries it, and the runtime refuses to load such a kernel unless
/// its caller opts in: the generic kernel runs several times slower, so taking it is a choice the
/// caller makes knowingly, never a silent fallback.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum SlowPath {
    /// The tensor-core kernel serves head_dim 64 to 256 in multiples of 16.
    HeadDim(u32),
    /// Codes of a width the tensor-core kernel does not read (it reads 1, 2, 4 and 8 bits).
    CodeBits { tensor: char, bits: u8 },
    /// A boosted plane over 1-bit keys at head_dim 64 (half a word a thread).
    BoostedHalfWordKeys { tensor: char },
    /// Token-axis keys (the kernel folds channel-axis key scales into the query).
    TokenAxisKeys { tensor: char },
    /// Token-axis V groups smaller than a row (the kernel folds one scale a token).
    TokenGroupsBelowRow { tensor: char },
    /// A boosted plane the kernel does not read (V, symmetric, or not 2-bit high codes in at
    /// most four words a row).
    BoostLayout { tensor: char },
}

impl std::fmt::Display for SlowPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SlowPath::HeadDim(d) => write!(f, "head_dim {d}"),
            SlowPath::CodeBits { tensor, bits } => write!(f, "{tensor}: {bits}-bit codes"),
            SlowPath::BoostedHalfWordKeys { tensor } => {
                write!(
                    f,
                    "{tensor}: a boosted plane over 1-bit codes at head_dim 64"
                )
            }
            SlowPath::TokenAxisKeys { tensor } => write!(f, "{tensor}: token-axis keys"),
            SlowPath::TokenGroupsBelowRow { tensor } => {
                write!(f, "{tensor}: token groups smaller than a row")
            }
            SlowPath::BoostLayout { tensor } => write!(f, "{tensor}: this boost layout"),
        }
    }
}

/// Why one tensor cannot use the tensor-core kernel, if it cannot: the kernel reads 1/2/4/8-bit
/// codes (in shares of whole words, or half a word for 1-bit codes at head_dim 64,
/// [`half_word_codes`]: [`slabs`] keeps every other share whole at head_dim ≥ 64), folds
/// channel-axis K scales into the query, and folds token-axis V scales into the probabilities only
/// when one group spans the whole row.
fn mma_unsupported(t: &TensorCtx, is_k: bool, head_dim: usize) -> Option<SlowPath> {
    if t.kind == TensorKind::Fp16 {
        return None;
    }
    let tensor = if is_k { 'k' } else { 'v' };
    if ![1, 2, 4, 8].contains(&t.bits) {
        return Some(SlowPath::CodeBits {
            tensor,
            bits: t.bits,
        });
    }
    if is_k && half_word_codes(t, head_dim) && t.boost {
        return Some(SlowPath::BoostedHalfWordKeys { tensor });
    }
    if is_k && t.axis != CodeAxis::Channel {
        return Some(SlowPath::TokenAxisKeys { tensor });
    }
    if !is_k && t.axis == CodeAxis::Token && t.group != head_dim {
        return Some(SlowPath::TokenGroupsBelowRow { tensor });
    }
    if t.boost && (!is_k || t.symmetric || t.high_bits != 2 || t.high_row_words > 4) {
        return Some(SlowPath::BoostLayout { tensor });
    }
    None
}

/// Whether a tensor's rows are 64 bits (1-bit codes at head_dim 64), so that a thread's share of a
/// row is half a word: 16 K codes, which the load spreads over the word's two halves
/// (`kvq_spread_half_word`), or 8 V codes, one byte. Such keys take the f16 path (the integer
/// path's byte planes assume whole words). Before the tensor-core kernel took them, the generic
/// kernel ran CalibQuant-1 at head_dim 64 at 0.13–0.19× FP16's speed (H100).
fn half_word_codes(t: &TensorCtx, head_dim: usize) -> bool {
    t.kind == TensorKind::Int && t.bits == 1 && head_dim == 64
}

/// Why the tensor-core kernel cannot serve this shape and these layouts, if it cannot.
pub(crate) fn mma_unsupported_shape(
    shape: &KernelShape,
    k: &TensorCtx,
    v: &TensorCtx,
) -> Option<SlowPath> {
    let d = shape.head_dim as usize;
    if !(64..=256).contains(&d) || d % 16 != 0 {
        Some(SlowPath::HeadDim(shape.head_dim))
    } else {
        mma_unsupported(k, true, d).or_else(|| mma_unsupported(v, false, d))
    }
}

/// Fewest channels a slab of a tensor's rows may have, from the units the kernel converts codes
/// in. K codes on the integer path: a quad lane's quarter of a slab (`slab·bits/4` bits) must be
/// whole 32-bit words (its byte planes); on the f16 path whole 16-bit halves (an odd last half is
/// spread over a word). V codes: a lane group's eighth (`slab·bits/8` bits) is whole halves or
/// sits alone in the low bits of one (`kvq_share_half0` in kernels/include/kvq/decode/slabs.cuh),
/// so any slab of 16 channels will do.
fn slab_granularity(t: &TensorCtx, side: Side) -> usize {
    let unit_bits = match (t.kind, side) {
        (TensorKind::Fp16, _) | (_, Side::V) => return 16,
        // 2-bit keys' shares of 32- and 16-channel slabs become half-word and byte units.
        (_, Side::K { int_path: true }) if t.bits == 2 => return 16,
        (_, Side::K { int_path: true }) => 128,
        // Shares smaller than a half get a half of their own and are spread (kvq_pair_lo).
        (_, Side::K { int_path: false }) => return 16,
    };
    (unit_bits / usize::from(t.bits.max(1)))
        .next_power_of_two()
        .max(16)
}

/// Which side of the kernel a row belongs to, and for keys which path scores them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Side {
    K { int_path: bool },
    V,
}

/// Whether the tensor-core kernel scores `k` on the integer tensor cores ([`MmaCtx::k_int`]):
/// 1- and 2-bit keys, except those of half a word a thread (1-bit at head_dim 64) and calibrated
/// keys whose fine limb does not pay.
fn keys_on_int_path(k: &TensorCtx, head_dim: usize, calibrated: bool) -> bool {
    k.kind == TensorKind::Int
        && k.bits <= 2
        && !half_word_codes(k, head_dim)
        && (!calibrated || k_fine_pays(k))
}

/// How the tensor-core kernel reads a row of `head_dim` channels of `t` (the `side` tensor):
/// as slabs, each read as a whole row of its size is (a quad lane takes a quarter of each slab's
/// K channels, a lane group an eighth of its V channels), largest first. A power of two is one
/// slab. Otherwise the largest powers of two of at least [`slab_granularity`] channels, then one
/// more slab of that many for what is left, reaching past the row: its channels there are zeros
/// in the query and the scales; 1- and 2-bit codes take at most two slabs (what is left after
/// the first becomes one power of two).
/// Every slab starts at a multiple of its size, so on a word
/// boundary of the reference's rows: the layout is the same at every head_dim (docs/LAYOUT.md
/// §9).
pub(crate) fn slabs(head_dim: usize, t: &TensorCtx, side: Side) -> Vec<usize> {
    if head_dim.is_power_of_two() {
        return vec![head_dim];
    }
    let least = slab_granularity(t, side);
    let mut out = Vec::new();
    let mut rest = head_dim;
    while rest >= least {
        let slab = 1usize << rest.ilog2();
        out.push(slab);
        rest -= slab;
    }
    if rest > 0 {
        out.push(least);
    }
    // 1- and 2-bit codes pay per slab (K on the integer path a query section and a unit chain
    // each, on the f16 path a spread half for the smallest; V a load a row each): at head_dim
    // 112 three key slabs (64 + 32 + 16) ran slower than one of 128 reaching past the row. So
    // past two slabs, the rest becomes one power of two, and two equal slabs one slab of twice
    // the size. The channels past the row load bytes that follow it (kvq_load_share's PAST)
    // and are never used: zero query limbs or scales for K, output columns never written for V.
    if t.bits <= 2 && t.kind == TensorKind::Int && out.len() > 2 {
        let first = out[0];
        let rest = (head_dim - first).next_power_of_two();
        return if rest == first {
            vec![2 * first]
        } else {
            vec![first, rest]
        };
    }
    out
}

/// [`slabs`] as the unit's four constants (0 past the last) and their sum.
fn slab_constants(head_dim: usize, t: &TensorCtx, side: Side) -> ([u32; 4], u32) {
    let list = slabs(head_dim, t, side);
    // At most 128 + 64 + 32 + 16 below 256 channels.
    debug_assert!(list.len() <= 4, "{list:?}");
    let mut sizes = [0u32; 4];
    for (to, from) in sizes.iter_mut().zip(&list) {
        *to = *from as u32;
    }
    (sizes, list.iter().sum::<usize>() as u32)
}

/// The head_dim whose measured launch rules a shape takes: 128 where its tensor-core kernel's
/// computed row width (the sum of its slabs, the wider side's) is more than 64 and at most
/// 128 — a kernel at head_dim 80–112 holds its registers and runs its loops as the head_dim-128
/// kernel does; with those blocks the GPU built-ins ran ×0.99–×1.15 against the generic default
/// at B=16 L=32K on an H200 (keys then padded to 128) — else the shape's own head_dim (160 and
/// 192 have rows of their own in [`crate::rules::table::DEFAULT_BLOCKS`]).
pub fn rule_head_dim(spec: &SchemeSpec, shape: &KernelShape) -> u32 {
    let d = shape.head_dim as usize;
    let (Ok(k), Ok(v)) = (
        TensorCtx::new("k", spec, &spec.k, d),
        TensorCtx::new("v", spec, &spec.v, d),
    ) else {
        return shape.head_dim;
    };
    if mma_unsupported_shape(shape, &k, &v).is_some() {
        return shape.head_dim;
    }
    let int_path = keys_on_int_path(&k, d, spec.calibrate.is_some());
    let computed = slabs(d, &k, Side::K { int_path })
        .iter()
        .sum::<usize>()
        .max(slabs(d, &v, Side::V).iter().sum());
    if computed > 64 && computed <= 128 {
        128
    } else {
        shape.head_dim
    }
}

/// Chooses between the tensor-core kernel and the generic one for a shape and the tensors' layouts.
fn mma_plan(
    shape: &KernelShape,
    tune: &TuneParams,
    k: &TensorCtx,
    v: &TensorCtx,
    calibrated: bool,
) -> MmaCtx {
    let d = shape.head_dim as usize;
    let bits = |t: &TensorCtx| {
        if t.kind == TensorKind::Fp16 {
            16
        } else {
            u32::from(t.bits)
        }
    };
    // Symmetric codes subtract their offset. Token-axis V (its scale folded into the weights, its
    // zero summed beside) also centres asymmetric codes on 2^(b−1): the code sum Σ p·s·(c − o)
    // then stays small instead of nearly cancelling Σ p·z over long spans (measured: relative
    // errors 2.5e-3–5.7e-3 at 26K tokens per split with codes from 0, 4e-4 at 6K).
    let offset = |t: &TensorCtx, token_fold: bool| {
        if t.kind == TensorKind::Int && (t.symmetric || token_fold) {
            1u32 << (t.bits - 1)
        } else {
            0
        }
    };
    let reason = mma_unsupported_shape(shape, k, v);
    let enabled = reason.is_none();
    let k_int = keys_on_int_path(k, d, calibrated);
    let (k_slabs, k_dim) = slab_constants(d, k, Side::K { int_path: k_int });
    let (v_slabs, v_dim) = slab_constants(d, v, Side::V);
    let groups = mma_head_groups(shape, k, v);
    let head_tiles = head_tiles_of(groups);
    // A CTA scores one group of the KV head's query heads (head_groups.rs).
    let shape = &groups.map_or(*shape, |g| g.cta_shape(shape));
    let v_token_fold = v.kind == TensorKind::Int && v.axis == CodeAxis::Token;
    // Keys of half a word a thread (1-bit at head_dim 64) take the f16 path: not the integer one.
    let low_bit_keys = k.kind == TensorKind::Int && k.bits <= 2 && !half_word_codes(k, d);
    // Not at head_dim 256: there Kitty-Pro's kernel (255 registers, uncapped) took 6 spill
    // instructions at GQA 1 with it. At 160 and 192 Kitty's and Kitty-Pro's kernels take 200-234
    // registers and spill nothing (ptxas -v through NVRTC 13.0, GQA 1/7/16, f16 and bf16).
    let k_high_int = low_bit_keys && !calibrated && k.boost && d < 256;
    let v_channel_subnormal =
        v.kind == TensorKind::Int && v.axis == CodeAxis::Channel && v_channel_subnormal_pays(v);
    let stored_scores = enabled && calibrated && tune.store_scores && stored_scores_pay(k);
    let piece_rule = if enabled {
        piece_rule(k, v, calibrated)
    } else {
        PieceRule::None
    };
    MmaCtx {
        stage: if enabled {
            stage_plan(
                tune,
                k,
                v,
                v_token_fold,
                stored_score_row_bytes(shape, stored_scores),
            )
        } else {
            StagePlan::default()
        },
        enabled,
        reason: reason.map(|r| r.to_string()).unwrap_or_default(),
        k_bits: bits(k),
        v_bits: bits(v),
        k_offset: offset(k, false),
        v_offset: offset(v, v_token_fold),
        k_quant: k.kind == TensorKind::Int,
        k_int,
        k_fine: low_bit_keys && calibrated && k_fine_pays(k),
        k_planes_in_place: k_planes_in_place(k, calibrated),
        k_subnormal: !k_int && k_subnormal_pays(k),
        k_high_int,
        range_int: calibrated && !stored_scores && range_int_pays(k) && !half_word_codes(k, d),
        stored_scores,
        range_query_kept: stored_scores && !k_int,
        range_packed: stored_scores && !k_int && range_packs_halves(shape, k),
        v_quant: v.kind == TensorKind::Int,
        v_token_fold,
        v_subnormal: v_token_fold && v_subnormal_pays(v),
        v_channel_subnormal,
        stage_v_params: stored_scores && v_channel_subnormal && stages_v_params(k, v),
        merge_bytes: merge_bytes(tune, v_dim as usize) * head_tiles as usize,
        head_tiles,
        k_slabs,
        k_dim,
        v_slabs,
        v_dim,
        pack_heads: enabled && k_high_int && tune.pack_heads && pack_heads_pays(shape, tune),
        k_fp16_row_cap: fp16_row_cap(k, tune),
        v_fp16_row_cap: fp16_row_cap(v, tune),
        piece_rule,
        runs_pieces: piece_rule != PieceRule::None,
    }
}

/// The grid rows of the tensor-core kernel: the fewest of at most [`most_head_tiles`] tiles.
pub(crate) fn mma_head_groups(
    shape: &KernelShape,
    k: &TensorCtx,
    v: &TensorCtx,
) -> Option<HeadGroups> {
    HeadGroups::for_gqa_in_tiles(shape.gqa, most_head_tiles(shape, k, v))
}

/// Head tiles a warp holds for the rows `groups` gives ([`HeadGroups::tiles`]; 1 without rows).
pub(crate) fn head_tiles_of(groups: Option<HeadGroups>) -> u32 {
    groups.map_or(1, |g| g.tiles())
}

/// Bytes a stored key's scores take in the decode kernel's stage (they take K's rows' place
/// there), or 0 where the kernel stores none.
fn stored_score_row_bytes(shape: &KernelShape, stored_scores: bool) -> usize {
    if stored_scores {
        shape.gqa as usize * 4
    } else {
        0
    }
}

/// Which launches of a decode kernel take pieces after their splits by default; the runtime's
/// `pieces_rule` turns the rule into counts. A kernel with a rule other than `None` is generated to
/// run pieces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
pub enum PieceRule {
    /// No pieces: the kernel's piece CTAs, if launched, find their shares empty.
    None,
    /// Two pieces per split over the last tenth of the cost where a split warp's share of the
    /// context bucket is long (8-bit codes).
    LongShares,
    /// Two pieces per (sequence, KV head) over the last twentieth of the cost where the launch
    /// has few split warps (uncalibrated codes of at most 2 bits).
    FewSplits,
}

/// Shared memory of the warps' merge: each warp's accumulators (`v_dim / 16` m-tiles × 4 per
/// lane) in register order, rows of 32 lanes padded to 33 words so that neither the warps' stores
/// nor the reads of whole output rows conflict on banks. The merge it replaced added each warp's
/// values into one `[heads][head_dim]` array in turn, 8-way bank conflicts and a barrier per warp:
/// 3.1–3.5 µs at the end of every 64-thread CTA, 6.4 µs for 128 threads (H100).
fn merge_bytes(tune: &TuneParams, v_dim: usize) -> usize {
    let warps = tune.threads as usize / 32;
    warps * (v_dim / 16) * 4 * 33 * 4
}

/// Eight warps per combine CTA: at B = 1 a head's 50-odd splits take one batch of loads per warp.
pub(crate) const COMBINE_THREADS: u32 = 256;

/// Bytes of a stage's chunk descriptor (`KvqChunk` in kernels/include/kvq/decode/ring.cuh: two
/// pointers, three ints, five skews; rounded up to the stage's section alignment in the layout).
const STAGE_HEADER_BYTES: usize = 48;

/// Most dynamic shared memory a CTA's stages may take: three CTAs still fit an SM of 228 KiB
/// (the register-capped low-bit kernels run three).
const MAX_STAGE_CTA_BYTES: usize = 72 * 1024;

/// Alignments a stage's sections may start at in shared memory, most preferred first: the largest
/// whose ring fits [`aligned_ring_room`]. On an H100, every section at a multiple of 128 bytes
/// instead of 16 ran INT8 ×1.046, Kitty-Pro ×1.049, KIVI-4 ×1.032 and kivi2 ×1.015 at B=16
/// L=32K; likely because a `cp.async` whose
/// shared-memory destination sits at another offset within 128 bytes than its global source
/// (page blocks and their row sections are 128-byte aligned for most schemes) takes more
/// shared-memory wavefronts (not profiled).
const SECTION_ALIGNS: [usize; 3] = [128, 32, 16];

/// Shared memory a CTA's ring may take once its sections are aligned: an SM's 192 KiB shared by
/// the CTAs the occupancy floor asks for, two at least (the uncapped 4- and 8-bit kernels run two
/// by their registers). Whether there is a ring at all is still decided by the dense layout
/// against [`MAX_STAGE_CTA_BYTES`], so alignment never costs a kernel its ring.
fn aligned_ring_room(tune: &TuneParams) -> usize {
    192 * 1024 / (tune.min_ctas_per_sm() as usize).max(2)
}

/// The `cp.async` ring of the tensor-core kernel: two stages per warp (the next chunk copies while
/// the current one computes; a third measured ×0.98 for KIVI-4 and INT8 on the H100), for schemes whose K and V are both quantized, when the ring fits
/// [`MAX_STAGE_CTA_BYTES`] in the dense layout (sections at multiples of 16 bytes), then with its
/// sections aligned as [`SECTION_ALIGNS`] says where that fits; otherwise none (chunks load from
/// global memory, as FP16 rows do, whose per-warp latency hiding is enough: measured at the copy
/// bandwidth). Copies round out to 16 bytes, which stays inside a page block since blocks and
/// their sections are 16-byte aligned multiples (docs/LAYOUT.md §1).
fn stage_plan(
    tune: &TuneParams,
    k: &TensorCtx,
    v: &TensorCtx,
    v_token_fold: bool,
    score_row_bytes: usize,
) -> StagePlan {
    if k.kind != TensorKind::Int || v.kind != TensorKind::Int {
        return StagePlan::default();
    }
    debug_assert!(k.block_bytes % 16 == 0 && v.block_bytes % 16 == 0 && k.scales_offset % 16 == 0);
    let dense = aligned_stage_plan(tune, k, v, v_token_fold, score_row_bytes, 16);
    if dense.cta_bytes > MAX_STAGE_CTA_BYTES {
        return StagePlan::default();
    }
    let room = aligned_ring_room(tune);
    SECTION_ALIGNS
        .iter()
        .map(|&align| aligned_stage_plan(tune, k, v, v_token_fold, score_row_bytes, align))
        .find(|plan| plan.cta_bytes <= room)
        .unwrap_or(dense)
}

/// [`stage_plan`]'s layout with every section starting at a multiple of `align` bytes.
fn aligned_stage_plan(
    tune: &TuneParams,
    k: &TensorCtx,
    v: &TensorCtx,
    v_token_fold: bool,
    score_row_bytes: usize,
    align: usize,
) -> StagePlan {
    let tile = tune.tile_tokens as usize;
    let round = |bytes: usize| bytes.div_ceil(align) * align;
    // A row section holds the chunk's bytes and 16 of slack (copies start at the 16-byte
    // boundary below their source); the parameter section starts aligned in the block.
    let section = |bytes: usize| round(bytes + 16);
    let mut plan = StagePlan {
        stages: 2,
        header: round(STAGE_HEADER_BYTES),
        // The decode kernel's stored scores take this section's place of the keys' rows.
        k_rows: section(tile * (k.row_words * 4).max(score_row_bytes)),
        k_high: if k.boost {
            section(tile * k.high_row_words * 4)
        } else {
            0
        },
        v_rows: section(tile * v.row_words * 4),
        v_scales: if v_token_fold { section(tile * 2) } else { 0 },
        v_zeros: if v_token_fold && !v.symmetric {
            section(tile * 2)
        } else {
            0
        },
        k_params: round(k.block_bytes - k.scales_offset),
        // Measured on the H100 over the bench grid:
        // ×1.035–×1.063 for the 1- and 2-bit schemes, ×1.004 for INT8, but ×0.983 for KIVI-4
        // (why is not known; without the short path it stays at ×0.999), ×0.981 and ×0.98 for
        // KIVI-4 again with later kernels; with 128-byte
        // sections it wins where warps' shares are long (TuneParams::short_staging).
        quant_fast_path: !(k.bits == 4 && v.bits == 4) || tune.short_staging,
        align,
        ..StagePlan::default()
    };
    plan.bytes = plan.header
        + plan.k_rows
        + plan.k_high
        + plan.v_rows
        + plan.v_scales
        + plan.v_zeros
        + plan.k_params;
    plan.cta_bytes = (tune.threads as usize / 32) * plan.stages as usize * plan.bytes;
    plan
}

/// The tensor-core kernel's plan for these parameters (`None` where the generic kernel serves
/// them or the tensors have no GPU layout).
fn mma_plan_for(spec: &SchemeSpec, shape: &KernelShape, tune: &TuneParams) -> Option<MmaCtx> {
    let d = shape.head_dim as usize;
    let k = TensorCtx::new("k", spec, &spec.k, d).ok()?;
    let v = TensorCtx::new("v", spec, &spec.v, d).ok()?;
    let plan = mma_plan(shape, tune, &k, &v, spec.calibrate.is_some());
    plan.enabled.then_some(plan)
}

/// Whether the tensor-core kernel for these parameters stages its chunks through the `cp.async`
/// ring (false for schemes or shapes the generic kernel serves).
pub(crate) fn uses_stage_ring(spec: &SchemeSpec, shape: &KernelShape, tune: &TuneParams) -> bool {
    mma_plan_for(spec, shape, tune).is_some_and(|plan| plan.stage.stages > 0)
}

/// Whether [`TuneParams::short_staging`] changes the decode kernel for these parameters: the scheme
/// has one, and its ring stages quantized chunks through the general path unless told otherwise
/// (4-bit K and V).
pub fn short_staging_changes(spec: &SchemeSpec, shape: &KernelShape, tune: &TuneParams) -> bool {
    let general = TuneParams {
        short_staging: false,
        ..*tune
    };
    has_decode_kernel(spec)
        && mma_plan_for(spec, shape, &general)
            .is_some_and(|plan| plan.stage.stages > 0 && !plan.stage.quant_fast_path)
}

/// Whether [`TuneParams::store_scores`] changes the decode kernels for these parameters: a
/// calibrated scheme whose keys the tensor-core kernel scores.
pub fn store_scores_changes(spec: &SchemeSpec, shape: &KernelShape, tune: &TuneParams) -> bool {
    let storing = TuneParams {
        store_scores: true,
        ..*tune
    };
    has_decode_kernel(spec) && mma_plan_for(spec, shape, &storing).is_some_and(|p| p.stored_scores)
}

/// Whether the decode kernel for these parameters holds two subtiles in one score fragment
/// ([`MmaCtx::pack_heads`]); with [`TuneParams::pack_heads`] false, none does.
pub(crate) fn packs_heads(spec: &SchemeSpec, shape: &KernelShape, tune: &TuneParams) -> bool {
    mma_plan_for(spec, shape, tune).is_some_and(|plan| plan.pack_heads)
}

/// Whether `tune`'s floor of warps an SM changes the decode kernel for its block: twelve for a
/// tensor-core kernel at head_dim ≤ 128 (where it was measured) in CTAs of at most six warps (an
/// 8-warp CTA gets one CTA an SM either way); sixteen (128 registers a thread) only below 128,
/// where the 1- and 2-bit kernels do not get faster with fewer channels at twelve warps
/// (BENCHMARKS.md, Known limits): under that cap the five short of their target at head_dim 80
/// spill nothing there and 4-8 bytes at 96 (ptxas -v, NVRTC 13.0); not yet timed.
pub(crate) fn raises_occupancy(spec: &SchemeSpec, shape: &KernelShape, tune: &TuneParams) -> bool {
    let with_floor = TuneParams {
        min_warps_per_sm: tune.min_warps_per_sm.max(12),
        ..*tune
    };
    let size_allows = match tune.min_warps_per_sm {
        16 => shape.head_dim < 128,
        _ => shape.head_dim <= 128,
    };
    size_allows
        && with_floor.min_ctas_per_sm() > 1
        && has_decode_kernel(spec)
        && mma_plan_for(spec, shape, tune).is_some()
}

/// Most query heads a KV head the decode kernels take: the tensor-core kernel's head groups
/// cover any count (MQA models such as Falcon 7B have 71), up to 16 grid rows a KV head.
pub const MAX_GQA: u32 = 128;

/// Most query heads a KV head the generic kernel takes: it holds a thread's share of every
/// head's query and scores in registers and static arrays.
pub const GENERIC_MAX_GQA: u32 = 64;

/// Whether the scheme's family has a GPU decode kernel: K/V caches of `fp16` and `int(...)`
/// tensors (XQuant latents and codebook tensors have their own decodes: `xquant_kernels`,
/// `codebook_kernels`). The command line and the
/// bench runner ask this before they take a scheme for the GPU.
pub fn has_decode_kernel(spec: &SchemeSpec) -> bool {
    !matches!(spec.source, CacheSource::X(_))
        && ![spec.k, spec.v]
            .iter()
            .any(|t| matches!(t, TensorQuant::Codebook(_)))
}

/// Rows the decode kernels' grids take a KV head ([`DecodeKernels::head_groups`], without
/// rendering them): the tensor-core kernel's [`HeadGroups`] where it serves the shape, else 1.
pub fn decode_head_groups(spec: &SchemeSpec, shape: &KernelShape) -> u32 {
    decode_groups(spec, shape).groups
}

/// How the decode kernels' grid rows cover a KV head's query heads, without rendering them:
/// the tensor-core kernel's [`HeadGroups`] where it serves the shape, else one row of all of
/// them (the generic kernel).
pub fn decode_groups(spec: &SchemeSpec, shape: &KernelShape) -> HeadGroups {
    let d = shape.head_dim as usize;
    let one_row = HeadGroups {
        groups: 1,
        heads: shape.gqa,
        gqa: shape.gqa,
    };
    if !has_decode_kernel(spec) {
        return one_row;
    }
    match (
        TensorCtx::new("k", spec, &spec.k, d),
        TensorCtx::new("v", spec, &spec.v, d),
    ) {
        (Ok(k), Ok(v)) if mma_unsupported_shape(shape, &k, &v).is_none() => {
            mma_head_groups(shape, &k, &v).unwrap_or(one_row)
        }
        _ => one_row,
    }
}

/// Whether the decode kernel for these parameters runs pieces after its splits
/// ([`DecodeKernels::runs_pieces`], without rendering it).
pub fn decode_runs_pieces(spec: &SchemeSpec, shape: &KernelShape, tune: &TuneParams) -> bool {
    decode_piece_rule(spec, shape, tune) != PieceRule::None
}

/// Why the generic CUDA-core kernel would serve this scheme and shape
/// ([`DecodeKernels::slow_path`], without rendering it); `None` where the tensor-core kernel does
/// or the scheme has no GPU kernel.
pub fn decode_slow_path(spec: &SchemeSpec, shape: &KernelShape) -> Option<SlowPath> {
    if !has_decode_kernel(spec) {
        return None;
    }
    let d = shape.head_dim as usize;
    let k = TensorCtx::new("k", spec, &spec.k, d).ok()?;
    let v = TensorCtx::new("v", spec, &spec.v, d).ok()?;
    mma_unsupported_shape(shape, &k, &v)
}

/// The piece rule of the decode kernel for these parameters ([`DecodeKernels::piece_rule`],
/// without rendering it).
pub fn decode_piece_rule(spec: &SchemeSpec, shape: &KernelShape, tune: &TuneParams) -> PieceRule {
    mma_plan_for(spec, shape, tune).map_or(PieceRule::None, |plan| plan.piece_rule)
}

impl DecodeKernels {
    /// How the grid rows cover a KV head's query heads ([`HeadGroups`]; one row of all of them
    /// on the generic kernel).
    pub fn groups(&self) -> HeadGroups {
        HeadGroups {
            groups: self.head_groups,
            heads: self.group_heads,
            gqa: self.shape.gqa,
        }
    }

    /// Stored scores a token of a KV head takes: every grid row's heads (`gqa`, or more where the
    /// last head group shares heads with the one before).
    pub fn score_columns(&self) -> u32 {
        self.groups().score_columns()
    }

    /// Whether `decode`'s piece CTAs do work (`num_pieces > 0`; tensor-core kernels with a piece
    /// rule). Other kernels do all the work in their splits, and their piece CTAs mark their
    /// partials empty.
    pub fn runs_pieces(&self) -> bool {
        self.piece_rule != PieceRule::None
    }

    /// Floats the `scores` buffer needs for a launch over `batch` sequences of `kv_heads` KV heads
    /// with page tables `max_pages` wide: [`score_columns`](Self::score_columns) scores for every
    /// token a page table can reach past the sink, plus 16 bytes the last row's copy may read past
    /// its end. 0 where the kernels store no scores ([`stores_scores`](Self::stores_scores)).
    pub fn score_floats(&self, batch: usize, kv_heads: usize, max_pages: usize) -> usize {
        if self.stores_scores {
            batch * kv_heads * max_pages * self.page_tokens as usize * self.score_columns() as usize
                + 4
        } else {
            0
        }
    }
}

/// Renders the decode kernels for a scheme, shape and tuning.
pub fn decode_kernels(
    spec: &SchemeSpec,
    shape: &KernelShape,
    tune: &TuneParams,
) -> Result<DecodeKernels, CodegenError> {
    tune.validate()?;
    // Families without a GPU kernel yet say so first, whatever the shape.
    if let CacheSource::X(_) = spec.source {
        return Err(CodegenError::Unsupported {
            family: "decode",
            what: format!("`{spec}` (XQuant: its latent decode is `xquant_kernels`)"),
        });
    }
    if [spec.k, spec.v]
        .iter()
        .any(|t| matches!(t, TensorQuant::Codebook(_)))
    {
        return Err(CodegenError::Unsupported {
            family: "decode",
            what: format!("`{spec}` (codebook tensors; the CPU reference covers them)"),
        });
    }
    if shape.gqa == 0 || shape.gqa > MAX_GQA {
        return Err(CodegenError::Shape(format!(
            "gqa = {} (expected 1..={MAX_GQA})",
            shape.gqa
        )));
    }
    spec.check_shape(shape.head_dim, 1)?;
    if shape.head_dim > 512 {
        return Err(CodegenError::Shape(format!(
            "head_dim = {} (at most 512)",
            shape.head_dim
        )));
    }
    let d = shape.head_dim as usize;
    let k = TensorCtx::new("k", spec, &spec.k, d)?;
    let v = TensorCtx::new("v", spec, &spec.v, d)?;
    if shape.gqa > GENERIC_MAX_GQA {
        if let Some(reason) = mma_unsupported_shape(shape, &k, &v) {
            return Err(CodegenError::Shape(format!(
                "gqa = {}: the generic kernel, which serves this shape ({reason}), holds at \
                 most {GENERIC_MAX_GQA} query heads a KV head in registers",
                shape.gqa
            )));
        }
    }
    let id = kernel_id(spec, shape, tune);
    let calibrate = spec.calibrate;
    // The tensor-core kernel's CTAs take groups of the query heads; the generic kernel's take all.
    let groups = decode_groups(spec, shape);
    let head_groups = groups.groups;
    let grid_rows = match head_groups {
        1 => "kv_heads".to_string(),
        g => format!("kv_heads * {g}"),
    };
    let ctx = DecodeCtx {
        scheme_text: spec.to_string(),
        head_dim: shape.head_dim,
        gqa: groups.heads,
        q_heads: shape.gqa,
        uneven_groups: !groups.is_even(),
        head_groups,
        dtype: shape.dtype.to_string(),
        page: spec.page,
        sink: spec.sink,
        threads: tune.threads,
        tile: tune.tile_tokens,
        min_ctas: tune.min_ctas_per_sm(),
        mma: mma_plan(shape, tune, &k, &v, calibrate.is_some()),
        k: k.clone(),
        v: v.clone(),
        calibrate: calibrate.is_some(),
        tau1: calibrate.map_or(0.0, |c| c.tau1),
        tau2: calibrate.map_or(0.0, |c| c.tau2),
        tau1_literal: format!("{:?}f", calibrate.map_or(0.0, |c| c.tau1)),
        tau2_literal: format!("{:?}f", calibrate.map_or(0.0, |c| c.tau2)),
        decode_name: format!("kvq_decode_{id}"),
        range_name: format!("kvq_score_range_{id}"),
        combine_name: format!("kvq_combine_{id}"),
        combine_threads: COMBINE_THREADS,
    };
    let source = render("decode.cu.tera", &ctx)?;
    let decode = KernelEntry {
        name: ctx.decode_name.clone(),
        params: [
            cache_params(),
            vec![
                param("const float*", "score_range"),
                param("const float*", "scores"),
                param("int32_t", "range_splits"),
                param("float*", "part_acc"),
                param("float*", "part_ml"),
                param("int32_t", "num_pieces"),
                param("int32_t", "piece_permille"),
                param("uint16_t*", "out"),
            ],
        ]
        .concat(),
        grid: [
            "num_splits + num_pieces".to_string(),
            grid_rows.clone(),
            "batch".to_string(),
        ],
        block: tune.threads,
        dynamic_shared_bytes: ctx.mma.decode_shared_bytes() as u32,
    };
    let combine = combine_entry(&ctx.combine_name);
    let range = calibrate.map(|_| KernelEntry {
        name: ctx.range_name.clone(),
        params: vec![
            param("const uint16_t*", "q"),
            param("const uint8_t*", "k_pool"),
            param("const int32_t*", "page_table"),
            param("int32_t", "max_pages"),
            param("const uint16_t*", "k_sink"),
            param("const uint16_t*", "k_tail"),
            param("const int32_t*", "seq_lens"),
            param("const int32_t*", "seq_slots"),
            param("int32_t", "q_len"),
            param("float*", "score_range"),
            param("float*", "scores"),
        ],
        // Its own split count: where the range kernel holds more CTAs an SM than the decode
        // kernel (CalibQuant-1's tensor-core kernels: five against three), a grid as small as
        // decode's left it under-filled (kvq-runtime's `DecodeKernel::range_splits`).
        grid: [
            "range_splits".to_string(),
            grid_rows.clone(),
            "batch".to_string(),
        ],
        block: tune.threads,
        // The range pass stages K through the decode kernel's ring (same layout, V unused).
        dynamic_shared_bytes: ctx.mma.stage.cta_bytes as u32,
    });
    Ok(DecodeKernels {
        scheme: spec.to_string(),
        shape: *shape,
        tune: *tune,
        source,
        decode,
        slow_path: mma_unsupported_shape(shape, &k, &v),
        combine,
        piece_rule: ctx.mma.piece_rule,
        range,
        stores_scores: ctx.mma.stored_scores,
        head_groups,
        group_heads: groups.heads,
        page_tokens: spec.page,
        k_block_bytes: k.block_bytes,
        v_block_bytes: v.block_bytes,
        k_tail_capacity: if k.kind == TensorKind::Int {
            k.tail_capacity
        } else {
            0
        },
        v_tail_capacity: if v.kind == TensorKind::Int {
            v.tail_capacity
        } else {
            0
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(text: &str, d: usize) -> (TensorCtx, TensorCtx) {
        let spec = SchemeSpec::parse(text).unwrap();
        (
            TensorCtx::new("k", &spec, &spec.k, d).unwrap(),
            TensorCtx::new("v", &spec, &spec.v, d).unwrap(),
        )
    }

    /// Every side's slabs cover the row, each starts at a multiple of its size, V of more than 2
    /// bits never reaches past the row, and 1- and 2-bit codes take at most two slabs.
    #[test]
    fn slabs_cover_the_row_aligned() {
        for text in [
            "k = int(2, channel), v = int(2, token)",
            "k = int(1, channel), v = int(1, token)",
            "k = int(4, channel), v = int(4, token)",
            "k = fp16, v = int(8, channel, symmetric)",
        ] {
            for d in (64..=256).step_by(16) {
                let (k, v) = tensor(text, d);
                for side in [
                    Side::K { int_path: true },
                    Side::K { int_path: false },
                    Side::V,
                ] {
                    let t = if side == Side::V { &v } else { &k };
                    let list = slabs(d, t, side);
                    let mut start = 0;
                    for &s in &list {
                        assert!(
                            s.is_power_of_two() && start % s == 0,
                            "{text} d{d} {list:?}"
                        );
                        start += s;
                    }
                    assert!(
                        start >= d && start - d < d && list.len() <= 4,
                        "{text} d{d} {list:?}"
                    );
                    if side == Side::V && (t.bits > 2 || t.kind != TensorKind::Int) {
                        assert_eq!(start, d, "{text} d{d}: V reaches past the row");
                    }
                    if t.bits <= 2 && t.kind == TensorKind::Int {
                        assert!(list.len() <= 2, "{text} d{d}: {list:?}");
                    }
                }
            }
        }
        let (k, _) = tensor("k = int(2, channel), v = int(2, token)", 112);
        assert_eq!(slabs(112, &k, Side::K { int_path: true }), [128]);
        assert_eq!(slabs(80, &k, Side::K { int_path: true }), [64, 16]);
        assert_eq!(slabs(176, &k, Side::K { int_path: true }), [128, 64]);
        let (_, v) = tensor("k = int(2, channel), v = int(2, token)", 112);
        assert_eq!(slabs(112, &v, Side::V), [128]);
        let (_, v4) = tensor("k = int(4, channel), v = int(4, token)", 112);
        assert_eq!(slabs(112, &v4, Side::V), [64, 32, 16]);
    }
}
