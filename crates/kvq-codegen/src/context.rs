//! The typed context templates render from. Every field is always present (FP16 tensors fill the
//! integer fields with zeros), because Tera treats a missing field in `{% if %}` as false instead of
//! failing: a typo must not silently select the wrong code path.

use crate::CodegenError;
use kvq_reference::int::{fp16_block_bytes, IntLayout, Quantizer};
use kvq_reference::pack;
use kvq_spec::{Axis, BoostCriterion, SchemeSpec, TensorQuant};
use serde::Serialize;

/// How a cached tensor stores its rows in pages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum TensorKind {
    /// FP16/BF16 rows, as the model wrote them.
    Fp16,
    /// Integer codes with scales (and zeros) per group.
    Int,
}

/// The axis a tensor's quantization groups run along.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum CodeAxis {
    /// One scale per channel over a page's tokens.
    Channel,
    /// Scales per group of a token's channels.
    Token,
}

/// How a boosted plane picks its channels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum BoostBy {
    Magnitude,
    Variance,
}

/// One cached tensor (K or V) as the kernel sees it: its kind and its page layout in bytes.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct TensorCtx {
    /// Name prefix of the emitted functions: "k" or "v".
    pub prefix: &'static str,
    pub kind: TensorKind,
    pub description: String,
    pub block_bytes: usize,
    pub local: u32,
    pub tail_capacity: u32,
    pub bits: u8,
    pub per_word: u32,
    pub mask: u32,
    pub low_plane_words: usize,
    pub axis: CodeAxis,
    pub symmetric: bool,
    pub offset: u32,
    pub group: usize,
    pub groups_per_token: usize,
    pub row_words: usize,
    pub codes_offset: usize,
    pub scales_offset: usize,
    pub zeros_offset: usize,
    pub boost: bool,
    pub high_bits: u8,
    pub high_per_word: u32,
    pub high_mask: u32,
    pub high_row_words: usize,
    pub high_offset: usize,
    pub map_offset: usize,
    pub slots_offset: usize,
    /// Largest code magnitude of the base quantizer (`2^b − 1`, or `2^(b−1) − 1` when symmetric).
    pub levels: u32,
    pub boost_levels: u32,
    pub boost_channels: usize,
    pub boost_by: BoostBy,
    /// Scale (and zero) entries per page block.
    pub scale_count: usize,
    /// Byte ranges of a block that no section covers (alignment padding), as `[offset, len]`.
    pub padding: Vec<[usize; 2]>,
    /// Token-axis groups reduce min/max with warp shuffles: each lane holds `head_dim / 32`
    /// channels (head_dim a multiple of 32) and `lanes_per_group` lanes (a power of two) share a
    /// group.
    pub token_warp_reduce: bool,
    pub lanes_per_group: usize,
    /// The page quantizer packs with a warp per row (head_dim a multiple of 32; each lane's
    /// `head_dim / 32` codes form a bit field that never straddles a word, and lies in one token
    /// group).
    pub fast_pack: bool,
    /// The page quantizer keeps every code in shared memory (generic packer, or boost high plane).
    pub needs_code_buffer: bool,
}

impl TensorCtx {
    pub(crate) fn new(
        prefix: &'static str,
        spec: &SchemeSpec,
        quant: &TensorQuant,
        head_dim: usize,
    ) -> Result<Self, CodegenError> {
        let page = spec.page as usize;
        let local = spec.local_of(quant);
        let mut ctx = TensorCtx {
            prefix,
            kind: TensorKind::Fp16,
            description: quant.to_string(),
            block_bytes: fp16_block_bytes(head_dim, page),
            local,
            tail_capacity: local + spec.page,
            bits: 16,
            per_word: 0,
            mask: 0,
            low_plane_words: 0,
            axis: CodeAxis::Channel,
            symmetric: false,
            offset: 0,
            group: head_dim,
            groups_per_token: 1,
            row_words: 0,
            codes_offset: 0,
            scales_offset: 0,
            zeros_offset: 0,
            boost: false,
            high_bits: 0,
            high_per_word: 0,
            high_mask: 0,
            high_row_words: 0,
            high_offset: 0,
            map_offset: 0,
            slots_offset: 0,
            levels: 0,
            boost_levels: 0,
            boost_channels: 0,
            boost_by: BoostBy::Magnitude,
            scale_count: 0,
            padding: Vec::new(),
            token_warp_reduce: false,
            lanes_per_group: 0,
            fast_pack: false,
            needs_code_buffer: true,
        };
        match quant {
            TensorQuant::Fp16 => Ok(ctx),
            TensorQuant::Int(q) => {
                let l = IntLayout::new(q, head_dim, page)?;
                let plane = |bits: u8| 32 / u32::from(if bits == 3 { 2 } else { bits });
                ctx.kind = TensorKind::Int;
                ctx.block_bytes = l.block_bytes;
                ctx.bits = q.bits;
                ctx.per_word = plane(q.bits);
                ctx.mask = (1u32 << q.bits) - 1;
                ctx.low_plane_words = if q.bits == 3 {
                    pack::plane_words(2, head_dim)
                } else {
                    l.row_words
                };
                ctx.axis = match q.axis {
                    Axis::Channel => CodeAxis::Channel,
                    Axis::Token => CodeAxis::Token,
                };
                ctx.symmetric = q.symmetric;
                ctx.offset = l.quant.offset();
                ctx.group = l.group;
                ctx.groups_per_token = head_dim / l.group;
                // A warp over a row needs whole 32-channel units; other head_dims take the
                // quantizer's per-element paths.
                let per_lane = if head_dim % 32 == 0 { head_dim / 32 } else { 0 };
                let field_fits = |width: usize| {
                    let f = per_lane * width;
                    (f <= 32 && 32 % f == 0) || (f % 32 == 0 && f <= 64)
                };
                let widths: &[usize] = if q.bits == 3 {
                    &[2, 1]
                } else {
                    &[q.bits as usize]
                };
                ctx.fast_pack = per_lane > 0
                    && widths.iter().all(|&w| field_fits(w))
                    && (q.axis == Axis::Channel || l.group % per_lane == 0);
                ctx.needs_code_buffer = !ctx.fast_pack || q.boost.is_some();
                if q.axis == Axis::Token && per_lane > 0 && l.group % per_lane == 0 {
                    let lanes = l.group / per_lane;
                    ctx.token_warp_reduce = lanes.is_power_of_two() && lanes <= 32;
                    ctx.lanes_per_group = lanes;
                }
                ctx.row_words = l.row_words;
                ctx.codes_offset = l.codes.offset;
                ctx.scales_offset = l.scales.offset;
                ctx.zeros_offset = l.zeros.offset;
                ctx.levels = l.quant.levels();
                ctx.scale_count = l.scale_count();
                let mut sections = l.sections();
                sections.sort_by_key(|s| s.offset);
                let mut at = 0;
                for s in sections.iter().filter(|s| s.bytes > 0) {
                    if s.offset > at {
                        ctx.padding.push([at, s.offset - at]);
                    }
                    at = s.offset + s.bytes;
                }
                if l.block_bytes > at {
                    ctx.padding.push([at, l.block_bytes - at]);
                }
                if let Some(b) = l.boost {
                    ctx.boost = true;
                    ctx.boost_levels = Quantizer::new(b.bits, q.symmetric)?.levels();
                    ctx.boost_channels = b.channels;
                    ctx.boost_by = match b.by {
                        BoostCriterion::Magnitude => BoostBy::Magnitude,
                        BoostCriterion::Variance => BoostBy::Variance,
                    };
                    ctx.high_bits = b.high_bits;
                    ctx.high_per_word = 32 / u32::from(b.high_bits);
                    ctx.high_mask = (1u32 << b.high_bits) - 1;
                    ctx.high_row_words = b.high_row_words;
                    ctx.high_offset = l.high.offset;
                    ctx.map_offset = l.map.offset;
                    ctx.slots_offset = l.slots.offset;
                }
                Ok(ctx)
            }
            TensorQuant::Codebook(_) => Err(CodegenError::Unsupported {
                family: "decode",
                what: format!("codebook tensors ({quant}); the CPU reference covers them"),
            }),
        }
    }
}

/// Everything `decode.cu.tera` renders from.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct DecodeCtx {
    pub scheme_text: String,
    pub head_dim: u32,
    /// Query heads a CTA scores: the KV head's, or one group of them ([`crate::HeadGroups`]).
    pub gqa: u32,
    /// A KV head's query heads (`gqa × head_groups`, or fewer where the last group shares heads
    /// with the one before: [`crate::HeadGroups::overlap`]).
    pub q_heads: u32,
    /// Whether `gqa × head_groups` exceeds `q_heads` (the last group starts early).
    pub uneven_groups: bool,
    /// Grid rows a KV head (1 but where the query heads are split into groups).
    pub head_groups: u32,
    pub dtype: String,
    pub page: u32,
    pub sink: u32,
    pub threads: u32,
    pub tile: u32,
    /// The decode kernel's `__launch_bounds__` minimum of CTAs per SM
    /// ([`TuneParams::min_ctas_per_sm`](crate::TuneParams::min_ctas_per_sm)).
    pub min_ctas: u32,
    pub k: TensorCtx,
    pub v: TensorCtx,
    /// The tensor-core kernel's plan (or why the generic kernel renders instead).
    pub mma: MmaCtx,
    pub calibrate: bool,
    pub tau1: f32,
    pub tau2: f32,
    /// `tau1` and `tau2` as C++ float literals (`0.0f` without calibration).
    pub tau1_literal: String,
    pub tau2_literal: String,
    pub decode_name: String,
    pub range_name: String,
    pub combine_name: String,
    /// Threads of the combine kernel (whole warps; each merges a share of the splits).
    pub combine_threads: u32,
}

/// What the tensor-core decode kernel (the unit `decode_mma.cuh.tera`, the headers in
/// `kvq/decode/`) needs beyond the tensors' layouts.
/// `enabled == false` renders the generic CUDA-core kernel; `reason` says why (in the source header).
#[derive(Debug, Clone, Serialize)]
pub(crate) struct MmaCtx {
    pub enabled: bool,
    pub reason: String,
    /// Bits of a K / V code in pages (16 for an FP16 tensor).
    pub k_bits: u32,
    pub v_bits: u32,
    /// Offset removed from symmetric (offset-binary) codes while converting them; 0 if asymmetric.
    /// Integer keys (`k_int`) centre on it instead, or on 2^(b−1) where it is 0.
    pub k_offset: u32,
    pub v_offset: u32,
    pub k_quant: bool,
    pub v_quant: bool,
    /// Quantized keys of at most 2 bits meet the query on the integer tensor cores (codes to
    /// bytes, mma u8 × s8). Measured on an H100 at B=16: 2–6% faster for kivi2, Kitty and
    /// Kitty-Pro. 4- and 8-bit keys ran slower on that path (kivi4 248 against 226–239 µs, int8
    /// 409 against 396–406 at L=32K), so they keep the f16 path.
    pub k_int: bool,
    /// Integer keys with a third, fine query limb (about 24 bits instead of 16): calibrated
    /// schemes, whose calibration can magnify score errors (16 bits missed the tolerance there;
    /// see `k_fine_pays` in decode.rs).
    pub k_fine: bool,
    /// Integer keys' byte planes masked in place, in groups of this many planes a shift (1: every
    /// plane shifted down); see `k_planes_in_place` in decode.rs.
    pub k_planes_in_place: u32,
    /// 1-bit asymmetric keys on the f16 path (calibrated schemes' keys) enter the score `mma` as
    /// f16 subnormals: one AND a pair of codes instead of an AND-OR and an exact `fma`, the fold
    /// scaling each pair's query by a power of two (see `k_subnormal_pays` in decode.rs).
    pub k_subnormal: bool,
    /// Kitty's boosted plane on the integer path too: 4·(high code) bytes as extra k-steps of the
    /// integer `mma` against the boosted slots' query limbs, summed with the low plane before one
    /// conversion (integer keys without the fine limb, head_dim ≤ 128). Against two f16 `mma` a word on the
    /// plane in real units: Kitty-Pro ×1.074, Kitty ×1.028 at B=16 L=32K on an H100, errors
    /// against the reference as before.
    pub k_high_int: bool,
    /// CalibQuant's score-range pass meets 1- and 2-bit keys on the integer tensor cores with two
    /// limbs, where its decode kernel keeps the f16 path or adds the fine limb: the range only sets
    /// the calibration's two constants, so an integer score's rounding moves them by about one
    /// score's error instead of entering every softmax weight (see `range_int_pays` in decode.rs).
    pub range_int: bool,
    /// CalibQuant's range pass leaves every quantized key's scores (natural units, before
    /// calibration) in a scratch buffer, and the decode kernel reads them back instead of K: the
    /// keys are scored once a step instead of twice (see `stored_scores_pay` in decode.rs). The
    /// range pass then scores on the decode kernel's path, so `range_int` is false.
    pub stored_scores: bool,
    /// The range pass with stored scores on the f16 path keeps its query's pairs in registers for
    /// every page's fold instead of loading and permuting them again per page (CalibQuant-1
    /// ×1.036–×1.053 at L ≥ 32K on an H100; 96 → 124 registers before the
    /// halves were packed, `range_packed`, which took them back to 96).
    pub range_query_kept: bool,
    /// The range pass with stored scores on the f16 path at GQA ≤ 4 (no boosted plane) meets the
    /// query's high and low halves in one `mma`: columns 0–3 of each score `mma` take the high
    /// halves of heads 0–3, columns 4–7 their low halves, and one shuffle adds the two (see
    /// `range_packs_halves` in decode.rs).
    pub range_packed: bool,
    /// Token-axis V with one group per token: its scale folds into the probabilities.
    pub v_token_fold: bool,
    /// Token-axis V codes of 1 or 2 bits enter P·V as f16 subnormals, one AND per pair
    /// instead of an AND-OR and an `fma` (see `v_subnormal_pays` in decode.rs).
    pub v_subnormal: bool,
    /// Asymmetric channel-axis V codes of 1 or 2 bits enter P·V as f16 subnormals too (one AND
    /// per pair instead of an AND-OR and two f16 `fma`), the accumulators running in units of the
    /// page's scales (see `v_channel_subnormal_pays` in decode.rs).
    pub v_channel_subnormal: bool,
    /// With stored scores, the decode kernel stages a new V page's parameters (channel-axis V
    /// whose page units it applies there) into the stage's K parameter section, which it no
    /// longer uses (see `stages_v_params` in decode.rs).
    pub stage_v_params: bool,
    /// The per-warp `cp.async` ring that quantized-page chunks load through (see [`StagePlan`]).
    pub stage: StagePlan,
    /// Dynamic shared memory where a CTA's warps leave their accumulators for the merge at the
    /// end (the ring's bytes, no longer in use by then, when they are more).
    pub merge_bytes: usize,
    /// Head tiles of 8 query heads a warp scores: as many as a row's heads fill where a CTA
    /// serves more than 8 query heads of FP16 K and V (at most 2 at head_dim 128 and 4 at 64; see
    /// `most_head_tiles` in decode.rs), else 1.
    pub head_tiles: u32,
    /// The slabs a K row's channels are read as, largest first, 0 past the last
    /// ([`crate::decode::slabs`]): `[head_dim, 0, 0, 0]` at head_dim 64, 128 and 256.
    pub k_slabs: [u32; 4],
    /// Key channels the kernel computes over: the K slabs' sum, `head_dim` or more where the
    /// last slab reaches past the row.
    pub k_dim: u32,
    /// The same for V rows.
    pub v_slabs: [u32; 4],
    pub v_dim: u32,
    /// Two 16-token subtiles share one score fragment at GQA ≤ 4: the head columns 4–7 of the
    /// `mma`, which would score heads past GQA, score heads 0–3 of the next subtile instead, so
    /// the softmax works on half the fragments (see `pack_heads_pays` in decode.rs).
    pub pack_heads: bool,
    /// At most how many quantized rows of K / V an FP16 row of that tensor (sink or tail window)
    /// costs in the split-K work division, as a C++ float literal (see `fp16_row_cap` in decode.rs).
    pub k_fp16_row_cap: String,
    pub v_fp16_row_cap: String,
    /// Where the runtime's default launches take pieces. The kernel runs pieces (`num_pieces > 0`,
    /// `KVQ_RUNS_PIECES`) after its splits unless it is `PieceRule::None`; then its piece CTAs find
    /// their shares empty and the splits cover every token.
    pub piece_rule: crate::decode::PieceRule,
    /// Whether the kernel runs pieces after its splits (`KVQ_RUNS_PIECES`): `piece_rule` is not
    /// `PieceRule::None`.
    pub runs_pieces: bool,
}

impl MmaCtx {
    /// Dynamic shared memory of the decode kernel: the ring while it runs, the merge after.
    pub fn decode_shared_bytes(&self) -> usize {
        if self.enabled {
            self.stage.cta_bytes.max(self.merge_bytes)
        } else {
            0
        }
    }
}

/// Where one chunk's page bytes sit in a warp's shared-memory stage, and how many stages a warp
/// has (0: chunks load straight from global memory). Each row section holds a chunk's bytes plus
/// 16 of slack, since copies start at the 16-byte boundary below their source.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct StagePlan {
    pub stages: u32,
    /// The staged chunk's descriptor (`KvqChunk`: where its rows are, its pages, its length).
    pub header: usize,
    pub k_rows: usize,
    pub k_high: usize,
    pub v_rows: usize,
    pub v_scales: usize,
    pub v_zeros: usize,
    /// The K page's parameter section (scales, zeros, map), staged with a page's first chunk so
    /// the query fold reads shared memory: from global memory, each fold waited out a load. It
    /// starts 16-byte aligned in the block, so it needs no slack.
    pub k_params: usize,
    /// Bytes of one stage (a multiple of 16).
    pub bytes: usize,
    /// Dynamic shared memory of one CTA: warps × stages × bytes.
    pub cta_bytes: usize,
    /// Whether chunks inside quantized pages take `kvq_stage_quant`, the staging path that skips
    /// the sink/tail bookkeeping (see `stage_plan` in decode.rs for when).
    pub quant_fast_path: bool,
    /// Bytes every section's start (and the stage size) is a multiple of: 128, 32 or 16, the
    /// largest whose ring fits (`stage_plan` in decode.rs).
    pub align: usize,
}
