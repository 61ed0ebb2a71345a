//! Query heads a KV head past what one tensor-core CTA scores: the grid's head groups.
//!
//! The tensor-core decode kernel scores a KV head's query heads as the 8 columns of its `mma`
//! tiles (`docs/KERNELS.md`), so a CTA serves at most 8 query heads, or 8 a head tile where its
//! warps hold several (FP16 K and V: two at head_dim 128, four at 64). Models with more (Mistral Large 2 has 12,
//! Llama 3.1 405B 16, Falcon 180B 29) split each KV head's query heads into groups of at most
//! that many: the decode grid (and CalibQuant's range grid) takes one row a group,
//! and the rows of one KV head read the same cache bytes, which the ones after the first mostly
//! find in L2, as they run at the same time. The query, output and partial buffers keep their
//! layouts: row `j` of KV head `h` scores query heads `h·gqa + start(j) ..` (consecutive).
//!
//! Where `gqa` does not split into equal groups (a prime such as 11 or 29), the groups are as
//! large as the equal ones would be were `gqa` rounded up, and the last one starts early: it
//! shares its first [`overlap`](HeadGroups::overlap) heads with the row before, scores them
//! again and leaves writing them to that row. Every column of every row is then a real head of
//! the KV head, so no query read falls past the buffer and no column needs a mask at run time.

use crate::KernelShape;
use serde::Serialize;

/// Query heads one tensor-core CTA scores: the columns of a score `mma` tile.
pub const MMA_HEAD_COLUMNS: u32 = 8;

/// How a decode grid covers a KV head's `gqa` query heads: `groups` grid rows a KV head, each
/// over `heads` consecutive query heads (`groups × heads ≥ gqa`; equal where `gqa` allows).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct HeadGroups {
    pub groups: u32,
    pub heads: u32,
    /// The KV head's query heads.
    pub gqa: u32,
}

impl HeadGroups {
    /// The groups of the tensor-core kernel for `gqa` query heads a KV head: all of them in one
    /// row up to [`MMA_HEAD_COLUMNS`]; past it the fewest rows that cover them,
    /// `⌈gqa / 8⌉`, each of `⌈gqa / rows⌉` heads. `None` for `gqa` 0.
    pub fn for_gqa(gqa: u32) -> Option<HeadGroups> {
        Self::for_gqa_in_tiles(gqa, 1)
    }

    /// The groups of a kernel whose CTAs score up to `tiles` head tiles of [`MMA_HEAD_COLUMNS`]
    /// each (FP16 K and V past 8 query heads: `MmaCtx::head_tiles` in kvq-codegen): the fewest
    /// rows of at most `8 · tiles` heads. `None` for `gqa` or `tiles` 0.
    pub fn for_gqa_in_tiles(gqa: u32, tiles: u32) -> Option<HeadGroups> {
        if gqa == 0 || tiles == 0 {
            return None;
        }
        let groups = gqa.div_ceil(MMA_HEAD_COLUMNS * tiles);
        Some(HeadGroups {
            groups,
            heads: gqa.div_ceil(groups),
            gqa,
        })
    }

    /// Whether the groups cover the query heads exactly (no row shares heads with another).
    pub fn is_even(&self) -> bool {
        self.groups * self.heads == self.gqa
    }

    /// Heads the last row shares with the row before it (0 where the groups are even): that row
    /// writes their results, the last one only scores them.
    pub fn overlap(&self) -> u32 {
        self.groups * self.heads - self.gqa
    }

    /// The first query head (of the KV head's) that row `group` scores: what the template's
    /// `kvq_head_row` computes on the GPU.
    pub fn start(&self, group: u32) -> u32 {
        (group * self.heads).min(self.gqa - self.heads)
    }

    /// Head tiles of [`MMA_HEAD_COLUMNS`] a row's heads fill: the tiles a warp of the
    /// tensor-core kernel holds (`MmaCtx::head_tiles` in kvq-codegen; more than one only for
    /// FP16 K and V past 8 query heads a KV head).
    pub fn tiles(&self) -> u32 {
        self.heads.div_ceil(MMA_HEAD_COLUMNS)
    }

    /// Floats a token of a KV head takes in the stored-scores buffer: every row's columns.
    pub fn score_columns(&self) -> u32 {
        self.groups * self.heads
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
            let g = HeadGroups::for_gqa(gqa).unwrap();
            assert_eq!((g.groups, g.heads, g.overlap()), (1, gqa, 0));
        }
        assert_eq!(HeadGroups::for_gqa(0), None);
    }

    /// Rows, heads a row and shared heads of `gqa` heads in rows of at most `tiles` tiles.
    fn split_in(tiles: u32, gqa: u32) -> (u32, u32, u32) {
        let g = HeadGroups::for_gqa_in_tiles(gqa, tiles).unwrap();
        (g.groups, g.heads, g.overlap())
    }

    #[test]
    fn more_heads_take_the_fewest_rows_of_at_most_eight() {
        let split = |gqa| split_in(1, gqa);
        assert_eq!(split(10), (2, 5, 0));
        assert_eq!(split(12), (2, 6, 0));
        assert_eq!(split(16), (2, 8, 0));
        assert_eq!(split(24), (3, 8, 0));
        assert_eq!(split(32), (4, 8, 0));
        assert_eq!(split(64), (8, 8, 0));
        // No equal split into so few rows: the last row starts early.
        assert_eq!(split(9), (2, 5, 1));
        assert_eq!(split(11), (2, 6, 1));
        assert_eq!(split(13), (2, 7, 1));
        assert_eq!(split(20), (3, 7, 1));
        assert_eq!(split(29), (4, 8, 3));
    }

    #[test]
    fn two_tiles_take_rows_of_at_most_sixteen() {
        let split = |gqa| split_in(2, gqa);
        assert_eq!(split(8), (1, 8, 0));
        assert_eq!(split(11), (1, 11, 0));
        assert_eq!(split(16), (1, 16, 0));
        assert_eq!(split(24), (2, 12, 0));
        assert_eq!(split(29), (2, 15, 1));
        assert_eq!(split(71), (5, 15, 4));
        assert_eq!(HeadGroups::for_gqa_in_tiles(4, 0), None);
        // Four tiles (FP16 at head_dim 64): Falcon 7B's 71 heads in three rows of 24, three tiles.
        assert_eq!(split_in(4, 71), (3, 24, 1));
        assert_eq!(HeadGroups::for_gqa_in_tiles(71, 4).unwrap().tiles(), 3);
        assert_eq!(HeadGroups::for_gqa_in_tiles(29, 4).unwrap().tiles(), 4);
    }

    #[test]
    fn rows_cover_every_head_and_each_head_is_written_once() {
        for (gqa, tiles) in (1..=crate::MAX_GQA).flat_map(|gqa| [(gqa, 1), (gqa, 2)]) {
            let g = HeadGroups::for_gqa_in_tiles(gqa, tiles).unwrap();
            assert!(g.heads <= MMA_HEAD_COLUMNS * tiles, "gqa {gqa}");
            assert!(g.overlap() < g.heads, "gqa {gqa}");
            let mut written = vec![0; gqa as usize];
            for row in 0..g.groups {
                let start = g.start(row);
                assert!(
                    start + g.heads <= gqa,
                    "gqa {gqa} row {row} reads past the KV head"
                );
                // A row writes its heads from the end of the previous row's on.
                let first = row * g.heads;
                for h in first.max(start)..start + g.heads {
                    written[h as usize] += 1;
                }
            }
            assert!(written.iter().all(|&n| n == 1), "gqa {gqa}: {written:?}");
        }
    }
}
