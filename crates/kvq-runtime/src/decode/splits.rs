//! How a decode launch divides each sequence's work: split-K partitions, and pieces launched after
//! them for the SMs that finish first.

use kvq_codegen::{decode_groups, KernelShape, PieceRule};
use kvq_spec::SchemeSpec;
use serde::{Deserialize, Serialize};
use std::cmp::Reverse;

/// Splits per (sequence, KV head) for a grid that fills whole waves of the GPU. `kv_heads` counts
/// the decode grid's rows a sequence: KV heads times the kernel's head groups
/// ([`DecodeKernels::head_groups`](kvq_codegen::DecodeKernels)).
///
/// `resident_ctas` is how many decode CTAs the GPU holds at once (SMs × CTAs per SM, from
/// [`DecodeKernel::resident_ctas`](super::DecodeKernel::resident_ctas)). CTAs of one launch take
/// about equal time, so a grid of 1.6 waves (ncu: the earlier four-per-SM rule at B=16 on an H100)
/// runs about as long as two; the split count is therefore the one, between the fewest that fill
/// 90% of a wave and twice that, whose last wave is the fullest (ties: fewer splits, so less
/// merging). Never fewer than `warp_tokens` tokens per warp of a split (`warps_per_cta` warps
/// share one; see [`min_warp_tokens`]) in the context bucket (the longest sequence rounded up to a
/// power of two), nor more than 256 splits. It depends only on the batch shape, that bucket and
/// the block, so a captured CUDA graph stays valid while sequences grow within their bucket.
pub fn default_splits(
    batch: usize,
    kv_heads: usize,
    max_len: usize,
    resident_ctas: usize,
    warps_per_cta: usize,
    warp_tokens: usize,
) -> usize {
    let bucket = context_bucket(max_len);
    let most = (bucket / (warp_tokens.max(1) * warps_per_cta.max(1))).clamp(1, 256);
    let ctas = (batch * kv_heads).max(1);
    let slots = resident_ctas.max(1);
    let fewest = (9 * slots).div_ceil(10 * ctas).clamp(1, most);
    (fewest..=(2 * fewest).min(most))
        .max_by_key(|&s| {
            let grid = ctas * s;
            let waves = grid.div_ceil(slots);
            (1000 * grid / (waves * slots), Reverse(s))
        })
        .unwrap_or(1)
}

/// Fewest tokens of the context bucket a split warp gets at which the default launch of a kernel
/// that can take the short staging path does ([`TuneParams::short_staging`](kvq_codegen::TuneParams)):
/// measured on an H100 with KIVI-4 (docs/BENCHMARKS.md, twenty-seventh round), ×1.009 at 4096
/// tokens a warp (B=16 L=32K) and ×1.005 at 16384, but ×0.967 at 512 and ×0.970 at about 1000.
pub const SHORT_STAGING_MIN_WARP_TOKENS: usize = 4096;

/// Whether the default launch of `splits` splits of `warps_per_cta` warps over sequences of at
/// most `max_len` tokens takes the short staging path, where the kernel has a choice: when a split
/// warp's share of the context bucket reaches [`SHORT_STAGING_MIN_WARP_TOKENS`]. Like the split
/// count it depends only on the batch shape and the bucket.
pub fn short_staging_by_default(max_len: usize, splits: usize, warps_per_cta: usize) -> bool {
    context_bucket(max_len) / (splits.max(1) * warps_per_cta.max(1))
        >= SHORT_STAGING_MIN_WARP_TOKENS
}

/// Whether the default launch over sequences of at most `max_len` tokens stores a calibrated
/// scheme's key scores, where the kernel has a choice
/// ([`TuneParams::store_scores`](kvq_codegen::TuneParams)): for context buckets past
/// [`SHORT_CONTEXT_BUCKET`], and past [`STORED_SCORES_MAX_GQA`] query heads a decode CTA scores
/// (`gqa`: a KV head's, or one head group's, [`TuneProblem::cta_gqa`](crate::TuneProblem::cta_gqa))
/// only where [`scores_stored_at_any_gqa`].
/// Measured on an H100 (docs/BENCHMARKS.md, twenty-eighth round, GQA 4): at L=32K and 128K
/// CalibQuant-1 ran ×1.06–×1.31 with them, CalibQuant-2 ×0.99–×1.20; at L=4K, where the decode
/// grid's wait for the range grid before its first copies weighs more than the keys it does not
/// score, ×0.95–×1.00.
pub fn store_scores_by_default(spec: &SchemeSpec, max_len: usize, gqa: u32) -> bool {
    context_bucket(max_len) > SHORT_CONTEXT_BUCKET
        && (gqa <= STORED_SCORES_MAX_GQA || scores_stored_at_any_gqa(spec))
}

/// Whether untuned launches store `spec`'s key scores past [`STORED_SCORES_MAX_GQA`] too: for
/// 1-bit keys, which the decode kernel would otherwise score again on the f16 path.
pub fn scores_stored_at_any_gqa(spec: &SchemeSpec) -> bool {
    spec.k.as_int().is_some_and(|k| k.bits < 2)
}

/// Most query heads a KV head at which untuned launches store the scores of keys of 2 bits or
/// more ([`store_scores_by_default`]). A key's stored scores are 4 bytes a query head, written
/// once and read once: at GQA 8 that is 64 bytes against about 36 for reading a 2-bit key and its
/// page parameters again, which the decode kernel scores on the integer tensor cores with the
/// same `mma` as at GQA 4. Measured on an H100 (thirty-fifth round, GQA 8, against storing):
/// CalibQuant-2 ×1.003–×1.13 at B ∈ {1, 4, 16} × L ∈ {8K, 32K, 128K} where no whole-pairs block
/// applies. CalibQuant-1's 1-bit keys (16 bytes, scored again on the f16 path) keep their scores:
/// without them it ran ×0.84–×1.05 (B=16 ×0.84–×0.91).
pub const STORED_SCORES_MAX_GQA: u32 = 4;

/// The context bucket of a launch: its longest sequence rounded up to a power of two.
pub(crate) fn context_bucket(max_len: usize) -> usize {
    max_len.max(1).next_power_of_two()
}

/// Context buckets up to which quantized kernels take splits of [`SHORT_WARP_TOKENS`] tokens a
/// warp.
pub const SHORT_CONTEXT_BUCKET: usize = 4096;

/// Fewest tokens of the context bucket a split warp gets, in general.
pub const WARP_TOKENS: usize = 64;

/// Fewest tokens a split warp of a quantized kernel gets at contexts up to
/// [`SHORT_CONTEXT_BUCKET`]: half a 64-token chunk.
pub const SHORT_WARP_TOKENS: usize = 32;

/// The fewest bucket tokens per split warp that [`default_splits`] allows for `spec`: 32 where K
/// or V is quantized and the context bucket is at most 4096 tokens, 64 otherwise. Measured on an
/// H100 with four-warp CTAs (docs/BENCHMARKS.md, twenty-second round): at B ∈ {1, 2, 4} and
/// contexts of 256 to 4K tokens, where the grid is otherwise too small to fill the GPU, 32 tokens
/// a warp ran the quantized schemes ×0.99–×1.31 (CalibQuant most, at 256 tokens); at 8K Kitty ran
/// ×0.90 and Kitty-Pro ×0.93 (warps of less than a chunk), and FP16 ×0.96–×0.99 from 1K on.
/// FP16's kernels of several head tiles (past 8 query heads a KV head at head_dim 64 and 128),
/// whose warps do a one-tile warp's work a token once a tile and whose grids have fewer rows,
/// take 32 as well: at
/// GQA 16 on an H100 (forty-fourth round, two calls on different machines) B=1 L=1K ran 13.6 µs
/// instead of 16.6, B=2 14.1 instead of 17.0, B=4 17.0 instead of 19.0, B=1 L=4K 16.2 instead of
/// 18.1 (16 splits, the tuner's choice with 64), and B ∈ {2, 4, 8} at 4K and B=8 at 1K within
/// ±2%.
pub fn min_warp_tokens(spec: &SchemeSpec, shape: &KernelShape, max_len: usize) -> usize {
    let quantized = spec.k.is_quantized() || spec.v.is_quantized();
    let several_tiles = decode_groups(spec, shape).tiles() > 1;
    if (quantized || several_tiles) && context_bucket(max_len) <= SHORT_CONTEXT_BUCKET {
        SHORT_WARP_TOKENS
    } else {
        WARP_TOKENS
    }
}

/// Small pieces of each sequence's work, in CTAs launched after all the splits' CTAs. The
/// splits' warps take fixed shares of `1000 − permille` thousandths of each (sequence, KV head)'s
/// cost; the rest is cut into `count` piece CTAs per (sequence, KV head). The GPU starts CTAs in
/// launch order as earlier ones end, so the pieces go to the SMs that finish their splits first:
/// some SMs run 15–30% faster than others whatever they hold (docs/BENCHMARKS.md, twelfth round),
/// and a division fixed at launch waits for the slowest. Which SM runs a piece does not change the
/// result: each piece has its own partial, merged in a fixed order.
///
/// `count = 0` (the [`Default`]) cuts no pieces: every token is in a split.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Pieces {
    /// Piece CTAs per (sequence, KV head).
    pub count: usize,
    /// Thousandths of each (sequence, KV head)'s cost they cover (1..=999 when `count > 0`).
    pub permille: u32,
}

impl Pieces {
    /// No pieces.
    pub const NONE: Pieces = Pieces {
        count: 0,
        permille: 0,
    };

    /// Whether the launch has any pieces.
    pub fn is_some(&self) -> bool {
        self.count > 0
    }

    /// Checks `permille` (1..=999 when there are pieces) and that the grid stays within the
    /// driver's limit with `splits` splits.
    pub fn check(&self, splits: usize) -> Result<(), String> {
        if self.is_some() && !(1..1000).contains(&self.permille) {
            return Err(format!(
                "pieces covering {}‰ of the work (expected 1..=999)",
                self.permille
            ));
        }
        if splits.saturating_add(self.count) > MAX_GRID_X {
            return Err(format!(
                "{splits} splits + {} pieces (at most {MAX_GRID_X} CTAs per (sequence, KV head))",
                self.count
            ));
        }
        Ok(())
    }
}

/// The most CTAs of one (sequence, KV head): splits and pieces share the grid's x dimension.
const MAX_GRID_X: usize = i32::MAX as usize;

impl std::fmt::Display for Pieces {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.is_some() {
            write!(f, "{} pieces of {}‰", self.count, self.permille)
        } else {
            write!(f, "no pieces")
        }
    }
}

/// Tokens of a split warp's share from which pieces pay (the context bucket over the split grid's
/// warps). Measured with INT8 on an H100 (docs/BENCHMARKS.md, thirteenth round): at 4096 tokens
/// per warp and more (B=16 L=32K and 128K, B=4 L=128K), two pieces per split covering a tenth of
/// the cost ran ×1.01–×1.03; at 64–1024 (B=1, B=4 L=32K, L=4K) every piece setting tried ran
/// ×0.7–×1.0, the pieces' own start-up costing more than the balance gains.
pub const PIECES_MIN_WARP_TOKENS: usize = 4096;

/// Most split warps (splits × warps per CTA) of a (sequence, KV head) at which kernels of
/// [`PieceRule::FewSplits`] take pieces. Measured on an H100 with the 2-bit kernels in two-warp
/// CTAs (docs/BENCHMARKS.md, twenty-first round): at 6 splits, 12 warps (B=16), two pieces per
/// (sequence, KV head) over 4–5% of the cost ran kivi2 ×1.01–×1.16, Kitty and Kitty-Pro
/// ×0.99–×1.04; at 24 splits, 48 warps (B=4), ×0.86–×0.95 and at 99 (B=1) ×0.60–×0.73. Counted in
/// warps, not splits, so that four-warp CTAs (half the splits) take pieces at the same batches:
/// B=16 (3 splits, 12 warps; measured with pieces in the twenty-second round), not B=8.
pub const PIECES_MAX_FEW_SPLIT_WARPS: usize = 16;

/// Fewest tokens of a split warp's share of the context bucket at which kernels of
/// [`PieceRule::FewSplits`] take pieces: the shortest measured with a gain was B=16 L=4K (six
/// splits of two warps, 341 tokens a warp). Shorter contexts, where a small batch can also have few
/// splits, were not measured, and get none.
pub const PIECES_FEW_SPLITS_MIN_WARP_TOKENS: usize = 256;

/// The pieces a launch of `splits` splits of `warps_per_cta` warps uses by default, for a kernel
/// of piece rule `rule` ([`DecodeKernel::piece_rule`](super::DecodeKernel::piece_rule)):
/// [`pieces_rule`], unless `KVQ_PIECES` says otherwise. `KVQ_PIECES=off` turns them off;
/// `KVQ_PIECES=PER_SPLIT,PERMILLE` (for measuring) cuts `PERMILLE` thousandths of the cost into
/// `PER_SPLIT × splits` pieces wherever the kernel runs them, `KVQ_PIECES=COUNT/PERMILLE` into
/// `COUNT` pieces per (sequence, KV head); other values leave the rule in force.
pub fn default_pieces(
    rule: PieceRule,
    max_len: usize,
    splits: usize,
    warps_per_cta: usize,
) -> Pieces {
    if rule == PieceRule::None {
        return Pieces::NONE;
    }
    match std::env::var("KVQ_PIECES").as_deref() {
        Ok("off") => Pieces::NONE,
        Ok(v) => parse_pieces(v, splits)
            .unwrap_or_else(|| pieces_rule(rule, max_len, splits, warps_per_cta)),
        Err(_) => pieces_rule(rule, max_len, splits, warps_per_cta),
    }
}

/// The pieces of `rule` for a launch of `splits` splits. [`PieceRule::LongShares`]: two pieces per
/// split over the last tenth of the cost where a split warp's share of the context bucket
/// (`max_len` rounded up to a power of two, as for the split count) reaches
/// [`PIECES_MIN_WARP_TOKENS`]. [`PieceRule::FewSplits`]: two pieces per (sequence, KV head) over
/// the last twentieth where there are at most [`PIECES_MAX_FEW_SPLIT_WARPS`] split warps and a
/// split warp's share of the bucket reaches [`PIECES_FEW_SPLITS_MIN_WARP_TOKENS`]. None elsewhere.
/// Like the split count it depends only on the batch shape and the bucket, so a captured CUDA
/// graph stays valid while sequences grow.
pub fn pieces_rule(rule: PieceRule, max_len: usize, splits: usize, warps_per_cta: usize) -> Pieces {
    let splits = splits.max(1);
    let split_warps = splits * warps_per_cta.max(1);
    let warp_tokens = context_bucket(max_len) / split_warps;
    match rule {
        PieceRule::LongShares => {
            if warp_tokens >= PIECES_MIN_WARP_TOKENS {
                Pieces {
                    count: 2 * splits,
                    permille: 100,
                }
            } else {
                Pieces::NONE
            }
        }
        PieceRule::FewSplits
            if split_warps <= PIECES_MAX_FEW_SPLIT_WARPS
                && warp_tokens >= PIECES_FEW_SPLITS_MIN_WARP_TOKENS =>
        {
            Pieces {
                count: 2,
                permille: 50,
            }
        }
        PieceRule::FewSplits | PieceRule::None => Pieces::NONE,
    }
}

/// `PER_SPLIT,PERMILLE` or `COUNT/PERMILLE` as pieces of a launch of `splits` splits.
fn parse_pieces(text: &str, splits: usize) -> Option<Pieces> {
    if let Some((a, b)) = text.split_once('/') {
        let count: usize = a.trim().parse().ok()?;
        let permille: u32 = b.trim().parse().ok()?;
        return (count > 0 && (1..1000).contains(&permille)).then_some(Pieces { count, permille });
    }
    let (a, b) = text.split_once(',')?;
    let per_split: usize = a.trim().parse().ok()?;
    let permille: u32 = b.trim().parse().ok()?;
    (per_split > 0 && (1..1000).contains(&permille)).then_some(Pieces {
        count: per_split * splits.max(1),
        permille,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvq_codegen::Dtype;

    #[test]
    fn fills_whole_waves() {
        // H100, 3 CTAs per SM: 396 slots.
        assert_eq!(default_splits(1, 8, 32768, 396, 4, WARP_TOKENS), 49); // 392 CTAs, one wave
        assert_eq!(default_splits(16, 8, 32768, 396, 4, WARP_TOKENS), 3); // 384 CTAs, not 640 (1.6 waves)
        assert_eq!(default_splits(64, 8, 32768, 396, 4, WARP_TOKENS), 2); // 1024 CTAs in 3 waves (86%)
        assert_eq!(default_splits(256, 8, 32768, 396, 4, WARP_TOKENS), 2); // 94% of 11 waves, not 86% of 6
        assert_eq!(default_splits(99, 4, 32768, 396, 4, WARP_TOKENS), 1); // exactly one wave

        // 2 CTAs per SM: 264 slots.
        assert_eq!(default_splits(1, 8, 32768, 264, 4, WARP_TOKENS), 33);
    }

    #[test]
    fn never_more_splits_than_chunks_and_stable_within_a_bucket() {
        assert_eq!(default_splits(1, 8, 100, 396, 4, WARP_TOKENS), 1);
        assert_eq!(default_splits(1, 8, 4096, 396, 4, WARP_TOKENS), 16);
        assert_eq!(
            default_splits(2, 8, 5000, 396, 4, WARP_TOKENS),
            default_splits(2, 8, 8000, 396, 4, WARP_TOKENS)
        );
        assert_eq!(default_splits(0, 0, 0, 0, 0, WARP_TOKENS), 1);
    }

    #[test]
    fn pieces_only_where_a_warp_share_is_long() {
        // INT8 on an H100: 128-thread CTAs; B=16 L=32K takes 2 splits, B=1 L=32K 33.
        let p = pieces_rule(PieceRule::LongShares, 32768, 2, 4);
        assert_eq!(
            p,
            Pieces {
                count: 4,
                permille: 100
            }
        );
        assert!(p.is_some());
        let long =
            |max_len, splits, warps| pieces_rule(PieceRule::LongShares, max_len, splits, warps);
        assert_eq!(long(20_000, 2, 4), p); // same bucket
        assert_eq!(long(32768, 33, 4), Pieces::NONE);
        assert_eq!(long(4096, 2, 4), Pieces::NONE);
        assert_eq!(long(0, 0, 0), Pieces::NONE);
        // Kernels that run no pieces get none, whatever KVQ_PIECES says.
        assert_eq!(default_pieces(PieceRule::None, 32768, 2, 4), Pieces::NONE);
        assert_eq!(pieces_rule(PieceRule::None, 32768, 2, 4), Pieces::NONE);
    }

    #[test]
    fn low_bit_pieces_only_where_splits_are_few() {
        // kivi2 on an H100 in two-warp CTAs: B=16 takes 6 splits at every context, B=4 24,
        // B=1 32-99; in four-warp CTAs half as many.
        let few = |splits| pieces_rule(PieceRule::FewSplits, 32768, splits, 2);
        let two = Pieces {
            count: 2,
            permille: 50,
        };
        assert_eq!(few(6), two);
        assert_eq!(few(PIECES_MAX_FEW_SPLIT_WARPS / 2), two);
        assert_eq!(few(PIECES_MAX_FEW_SPLIT_WARPS / 2 + 1), Pieces::NONE);
        assert_eq!(few(24), Pieces::NONE);
        let four_warps = |splits| pieces_rule(PieceRule::FewSplits, 32768, splits, 4);
        assert_eq!(four_warps(3), two); // B=16
        assert_eq!(four_warps(PIECES_MAX_FEW_SPLIT_WARPS / 4), two);
        assert_eq!(four_warps(6), Pieces::NONE); // B=8: 24 warps, as many as two-warp B=8
        assert_eq!(pieces_rule(PieceRule::FewSplits, 4096, 6, 2), two); // B=16 L=4K: 341 a warp
                                                                        // Short contexts, where few splits also come with small batches: not measured, none.
        assert_eq!(pieces_rule(PieceRule::FewSplits, 2048, 6, 2), Pieces::NONE);
        assert_eq!(pieces_rule(PieceRule::FewSplits, 512, 1, 2), two);
        assert_eq!(pieces_rule(PieceRule::FewSplits, 256, 1, 2), Pieces::NONE);
        assert!(two.check(6).is_ok());
    }

    #[test]
    fn pieces_parse_per_split_or_per_sequence() {
        assert_eq!(
            parse_pieces("2,100", 6),
            Some(Pieces {
                count: 12,
                permille: 100
            })
        );
        assert_eq!(
            parse_pieces("2/40", 6),
            Some(Pieces {
                count: 2,
                permille: 40
            })
        );
        for bad in ["0/40", "2/0", "2/1000", "x/5", "2", ""] {
            assert_eq!(parse_pieces(bad, 6), None, "{bad}");
        }
    }

    #[test]
    fn pieces_check_their_share_and_the_grid() {
        assert!(Pieces::NONE.check(1).is_ok());
        assert!(Pieces {
            count: 0,
            permille: 5000
        }
        .check(1)
        .is_ok()); // ignored without pieces
        assert!(Pieces {
            count: 4,
            permille: 100
        }
        .check(2)
        .is_ok());
        for permille in [0, 1000, 5000] {
            let err = Pieces { count: 4, permille }.check(2).unwrap_err();
            assert!(err.contains("1..=999"), "{err}");
        }
        assert!(Pieces {
            count: usize::MAX,
            permille: 100
        }
        .check(2)
        .is_err());
    }

    #[test]
    fn piece_overrides_parse_or_are_ignored() {
        assert_eq!(
            parse_pieces("3,150", 2),
            Some(Pieces {
                count: 6,
                permille: 150
            })
        );
        assert_eq!(
            parse_pieces(" 1 , 999 ", 4),
            Some(Pieces {
                count: 4,
                permille: 999
            })
        );
        for bad in ["", "3", "0,100", "2,0", "2,1000", "a,b", "-1,100"] {
            assert_eq!(parse_pieces(bad, 2), None, "{bad:?}");
        }
        assert_eq!(Pieces::NONE.to_string(), "no pieces");
        assert_eq!(
            Pieces {
                count: 4,
                permille: 100
            }
            .to_string(),
            "4 pieces of 100‰"
        );
    }

    #[test]
    fn quantized_kernels_take_half_chunks_a_warp_up_to_4k() {
        let kivi2 = SchemeSpec::parse("k = int(2, channel), v = int(2, token)").unwrap();
        let fp16 = SchemeSpec::parse("k = fp16, v = fp16").unwrap();
        let fp16_k = SchemeSpec::parse("k = fp16, v = int(2, token)").unwrap();
        let gqa4 = KernelShape::new(128, 4, Dtype::F16);
        assert_eq!(min_warp_tokens(&kivi2, &gqa4, 4096), SHORT_WARP_TOKENS);
        assert_eq!(min_warp_tokens(&kivi2, &gqa4, 256), SHORT_WARP_TOKENS);
        assert_eq!(min_warp_tokens(&fp16_k, &gqa4, 3000), SHORT_WARP_TOKENS);
        assert_eq!(min_warp_tokens(&kivi2, &gqa4, 4097), WARP_TOKENS);
        assert_eq!(min_warp_tokens(&fp16, &gqa4, 4096), WARP_TOKENS);
        // FP16 in two head tiles a warp (16 heads at head_dim 128) as the quantized kernels; at
        // head_dim 256 (one tile, two rows) as at GQA 4.
        let gqa16 = KernelShape::new(128, 16, Dtype::F16);
        assert_eq!(min_warp_tokens(&fp16, &gqa16, 4096), SHORT_WARP_TOKENS);
        assert_eq!(min_warp_tokens(&fp16, &gqa16, 4097), WARP_TOKENS);
        let d256 = KernelShape::new(256, 16, Dtype::F16);
        assert_eq!(min_warp_tokens(&fp16, &d256, 4096), WARP_TOKENS);
        // Four-warp CTAs, three per SM (396 slots), B=1 L=4K: 32 splits instead of 16; at 8K
        // still 32 (64 tokens a warp).
        let at = |len| default_splits(1, 8, len, 396, 4, min_warp_tokens(&kivi2, &gqa4, len));
        assert_eq!(at(4096), 32);
        assert_eq!(at(8192), 32);
    }

    #[test]
    fn smaller_ctas_may_take_shorter_splits() {
        // Two-warp CTAs, six per SM: 792 slots; 64 tokens per warp allow 32 splits of 4K.
        assert_eq!(default_splits(1, 8, 4096, 792, 2, WARP_TOKENS), 32);
        assert_eq!(default_splits(1, 8, 32768, 792, 2, WARP_TOKENS), 99);
    }
}
