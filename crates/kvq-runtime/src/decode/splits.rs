//! How a decode launch divides each sequence's work: split-K partitions, and pieces launched after
//! them for the SMs that finish first. The rules and their numbers live in
//! [`kvq_codegen::rules`]; these are the runtime's names for them, and the measurement switches
//! ([`DecodeOptions`]) a bench passes explicitly.

use kvq_codegen::rules::{self, table::CONSTANTS, LaunchRules, PieceKind};
use kvq_codegen::{KernelShape, PieceRule};
use kvq_spec::SchemeSpec;

pub use kvq_codegen::rules::Pieces;

/// Splits per (sequence, KV head) for a grid that fills whole waves of the GPU
/// ([`LaunchRules::splits`]). `kv_heads` counts the decode grid's rows a sequence: KV heads
/// times the kernel's head groups. `resident_ctas` is how many decode CTAs the GPU holds at once
/// ([`DecodeKernel::resident_ctas`](super::DecodeKernel::resident_ctas)).
pub fn default_splits(
    batch: usize,
    kv_heads: usize,
    max_len: usize,
    resident_ctas: usize,
    warps_per_cta: usize,
    warp_tokens: usize,
) -> usize {
    rules::split_count(
        &CONSTANTS,
        batch * kv_heads,
        max_len,
        resident_ctas,
        warps_per_cta,
        warp_tokens,
    )
}

/// The fewest bucket tokens per split warp that [`default_splits`] allows for `spec` at `shape`
/// ([`LaunchRules::min_warp_tokens`]).
pub fn min_warp_tokens(spec: &SchemeSpec, shape: &KernelShape, max_len: usize) -> usize {
    LaunchRules::for_kernel(spec, shape).min_warp_tokens(max_len)
}

/// The pieces a launch of `splits` splits of `warps_per_cta` warps takes for a kernel of piece
/// rule `rule` ([`DecodeKernel::piece_rule`](super::DecodeKernel::piece_rule)), by the launch
/// rules. A bench that measures other pieces says so with [`DecodeOptions::pieces`].
pub fn default_pieces(
    rule: PieceRule,
    max_len: usize,
    splits: usize,
    warps_per_cta: usize,
) -> Pieces {
    rules::pieces_of(
        &CONSTANTS,
        PieceKind::from(rule),
        max_len,
        splits,
        warps_per_cta,
    )
}

/// Pieces a bench asks for instead of the rule's, for measuring.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PiecesOverride {
    /// No pieces.
    Off,
    /// `per_split × splits` pieces over `permille` thousandths of the cost.
    PerSplit {
        /// Pieces a split.
        per_split: usize,
        /// Thousandths of the cost they cover.
        permille: u32,
    },
    /// `count` pieces per (sequence, KV head) over `permille` thousandths of the cost.
    PerPair {
        /// Pieces a (sequence, KV head).
        count: usize,
        /// Thousandths of the cost they cover.
        permille: u32,
    },
}

impl PiecesOverride {
    /// `off`, `PER_SPLIT,PERMILLE` or `COUNT/PERMILLE` (what `KVQ_PIECES` held when the library
    /// read it; a bench may take the text from wherever it likes). `None` for other text.
    pub fn parse(text: &str) -> Option<PiecesOverride> {
        let text = text.trim();
        if text == "off" {
            return Some(PiecesOverride::Off);
        }
        let split = |sep| {
            let (a, b) = text.split_once(sep)?;
            let n: usize = a.trim().parse().ok()?;
            let permille: u32 = b.trim().parse().ok()?;
            (n > 0 && (1..1000).contains(&permille)).then_some((n, permille))
        };
        if let Some((count, permille)) = split('/') {
            return Some(PiecesOverride::PerPair { count, permille });
        }
        split(',').map(|(per_split, permille)| PiecesOverride::PerSplit {
            per_split,
            permille,
        })
    }

    /// The pieces of a launch of `splits` splits.
    pub fn pieces(&self, splits: usize) -> Pieces {
        match *self {
            PiecesOverride::Off => Pieces::NONE,
            PiecesOverride::PerSplit {
                per_split,
                permille,
            } => Pieces {
                count: per_split * splits.max(1),
                permille,
            },
            PiecesOverride::PerPair { count, permille } => Pieces { count, permille },
        }
    }
}

/// Measurement switches of a decode launch, which the bench (or a tuner experiment) passes
/// explicitly; the library's launch paths read no environment. The default changes nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DecodeOptions {
    /// Pieces instead of the rule's, for kernels that run pieces (others get none whatever
    /// this says).
    pub pieces: Option<PiecesOverride>,
    /// Whether launches overlap the kernel before them (programmatic dependent launch) where
    /// the GPU can: `None` keeps the default (on).
    pub pdl: Option<bool>,
}

impl DecodeOptions {
    /// The pieces a launch of `splits` splits takes: `rule_pieces` unless [`DecodeOptions::pieces`]
    /// says otherwise, and none for a kernel without a piece rule.
    pub fn pieces(&self, rule: PieceRule, rule_pieces: Pieces, splits: usize) -> Pieces {
        match self.pieces {
            _ if rule == PieceRule::None => Pieces::NONE,
            Some(o) => o.pieces(splits),
            None => rule_pieces,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overrides_parse_per_split_per_pair_or_off() {
        assert_eq!(
            PiecesOverride::parse("2,100").map(|o| o.pieces(6)),
            Some(Pieces {
                count: 12,
                permille: 100
            })
        );
        assert_eq!(
            PiecesOverride::parse(" 2 / 40 ").map(|o| o.pieces(6)),
            Some(Pieces {
                count: 2,
                permille: 40
            })
        );
        assert_eq!(
            PiecesOverride::parse("off").map(|o| o.pieces(6)),
            Some(Pieces::NONE)
        );
        for bad in ["0/40", "2/0", "2/1000", "x/5", "2", "", "0,100", "-1,100"] {
            assert_eq!(PiecesOverride::parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn options_change_only_kernels_that_run_pieces() {
        let rule = Pieces {
            count: 4,
            permille: 100,
        };
        let none = DecodeOptions::default();
        assert_eq!(none.pieces(PieceRule::LongShares, rule, 2), rule);
        let off = DecodeOptions {
            pieces: Some(PiecesOverride::Off),
            pdl: None,
        };
        assert_eq!(off.pieces(PieceRule::LongShares, rule, 2), Pieces::NONE);
        let many = DecodeOptions {
            pieces: PiecesOverride::parse("3,150"),
            pdl: None,
        };
        assert_eq!(many.pieces(PieceRule::None, Pieces::NONE, 2), Pieces::NONE);
        assert_eq!(
            many.pieces(PieceRule::FewSplits, Pieces::NONE, 2),
            Pieces {
                count: 6,
                permille: 150
            }
        );
    }

    #[test]
    fn pieces_check_their_share_and_the_grid() {
        assert!(Pieces::NONE.check(1).is_ok());
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
        assert_eq!(Pieces::NONE.to_string(), "no pieces");
    }
}
