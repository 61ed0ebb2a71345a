//! Query heads a KV head past what one tensor-core CTA scores: the grid's head groups.
//!
//! The tensor-core decode kernel scores a KV head's query heads as the 8 columns of its `mma`
//! tiles (`docs/KERNELS.md`), so it serves at most 8 query heads a KV head. Models with more
//! (Mistral Large 2 has 12, Llama 3.1 405B 16) split each KV head's query heads into groups
//! of at most 8: the decode grid (and CalibQuant's range grid) takes one row a group, and
//! the rows of one KV head read the same cache bytes, which the ones after the first mostly
//! find in L2, as they run at the same time. The query, output, partial and score buffers keep
//! their layouts: group `g` of KV head `h` holds query heads `h·gqa + g·heads ..`, consecutive.

use crate::KernelShape;
use serde::Serialize;

/// Query heads one tensor-core CTA scores: the columns of a score `mma` tile.
pub const MMA_HEAD_COLUMNS: u32 = 8;

/// Fewest query heads a group takes where a KV head's query heads are split: smaller groups would
/// read each cache byte more than `gqa / 4` times and leave most of each tile's columns empty,
/// for shapes no measured model has (GQA 9, 11, 13, …), which the generic kernel serves instead.
pub const MIN_GROUP_HEADS: u32 = 4;

/// How a decode grid covers a KV head's `gqa` query heads: `groups` grid rows a KV head, each
/// over `heads` consecutive query heads (`groups × heads = gqa`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct HeadGroups {
    pub groups: u32,
    pub heads: u32,
}

impl HeadGroups {
    /// The groups of the tensor-core kernel for `gqa` query heads a KV head: all of them in one
    /// row up to [`MMA_HEAD_COLUMNS`]; past it the fewest groups of equal size that fit, if that
    /// size is at least [`MIN_GROUP_HEADS`]; `None` otherwise (and for `gqa` 0).
    pub fn for_gqa(gqa: u32) -> Option<HeadGroups> {
        if gqa == 0 {
            return None;
        }
        if gqa <= MMA_HEAD_COLUMNS {
            return Some(HeadGroups {
                groups: 1,
                heads: gqa,
            });
        }
        (2..=gqa)
            .find(|&g| gqa % g == 0 && gqa / g <= MMA_HEAD_COLUMNS)
            .map(|groups| HeadGroups {
                groups,
                heads: gqa / groups,
            })
            .filter(|g| g.heads >= MIN_GROUP_HEADS)
    }

    /// The shape one CTA of the grid sees: `shape` with `gqa` the group's heads.
    pub fn cta_shape(&self, shape: &KernelShape) -> KernelShape {
        KernelShape {
            gqa: self.heads,
            ..*shape
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn up_to_eight_heads_take_one_row() {
        for gqa in 1..=8 {
            assert_eq!(
                HeadGroups::for_gqa(gqa),
                Some(HeadGroups {
                    groups: 1,
                    heads: gqa
                })
            );
        }
        assert_eq!(HeadGroups::for_gqa(0), None);
    }

    #[test]
    fn more_heads_split_into_the_fewest_groups_of_four_to_eight() {
        let split = |gqa| HeadGroups::for_gqa(gqa).map(|g| (g.groups, g.heads));
        assert_eq!(split(10), Some((2, 5)));
        assert_eq!(split(12), Some((2, 6)));
        assert_eq!(split(16), Some((2, 8)));
        assert_eq!(split(20), Some((4, 5)));
        assert_eq!(split(24), Some((3, 8)));
        assert_eq!(split(32), Some((4, 8)));
        assert_eq!(split(64), Some((8, 8)));
        // Primes, and sizes whose only fitting groups are smaller than four heads.
        for gqa in [9, 11, 13, 17, 22, 27] {
            assert_eq!(split(gqa), None, "gqa {gqa}");
        }
    }
}
