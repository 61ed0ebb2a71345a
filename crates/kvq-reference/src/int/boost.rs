//! Kitty's choice of boosted channels within one page of one head (`docs/LAYOUT.md` §3.4).
//!
//! Scores are f32 sums over the page's tokens in a fixed *halving fold* order: the tokens, padded
//! with +0 to a power of two, are folded in half (`v[t] + v[t + n/2]`) until one value is left. A
//! GPU page quantizer that holds a page in registers (rows `t`, `t + S`, `t + 2S`, … per thread)
//! reproduces that order with no shared-memory staging, and padding with +0 changes nothing
//! (`x + 0 = x`), so any power of two at least the page gives the same sums. Ranking uses the sum
//! (same order as the mean, without a division that could merge neighbours); ties go to the lower
//! channel index.

use kvq_spec::BoostCriterion;

/// The halving fold of `terms` (padded with +0 to a power of two): the sum order of every score.
pub fn fold_sum(terms: &[f32]) -> f32 {
    let mut v = terms.to_vec();
    v.resize(terms.len().max(1).next_power_of_two(), 0.0);
    while v.len() > 1 {
        let half = v.len() / 2;
        for t in 0..half {
            v[t] += v[t + half];
        }
        v.truncate(half);
    }
    v[0]
}

/// Per-channel ranking scores of a `[page][head_dim]` block.
///
/// * magnitude: `fold(|x[t][c]|)`;
/// * variance: `mean = fold(x[t][c]) / page`, then `fold((x[t][c] − mean)²)` (each square rounded
///   to f32 on its own).
pub fn scores(values: &[f32], page: usize, head_dim: usize, by: BoostCriterion) -> Vec<f32> {
    let column = |c: usize| (0..page).map(move |t| values[t * head_dim + c]);
    (0..head_dim)
        .map(|c| match by {
            BoostCriterion::Magnitude => fold_sum(&column(c).map(f32::abs).collect::<Vec<_>>()),
            BoostCriterion::Variance => {
                let mean = fold_sum(&column(c).collect::<Vec<_>>()) / page as f32;
                let squares: Vec<f32> = column(c)
                    .map(|x| {
                        let d = x - mean;
                        d * d
                    })
                    .collect();
                fold_sum(&squares)
            }
        })
        .collect()
}

/// Which channels are boosted: the `k` highest scores, ties to the lower index.
pub fn select(
    values: &[f32],
    page: usize,
    head_dim: usize,
    k: usize,
    by: BoostCriterion,
) -> Vec<bool> {
    let s = scores(values, page, head_dim, by);
    let mut order: Vec<usize> = (0..head_dim).collect();
    order.sort_by(|&a, &b| s[b].total_cmp(&s[a]).then(a.cmp(&b)));
    let mut boosted = vec![false; head_dim];
    for &c in order.iter().take(k) {
        boosted[c] = true;
    }
    boosted
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_largest_magnitudes_and_breaks_ties_low() {
        // 2 tokens × 4 channels.
        let v = [1.0, -5.0, 5.0, 0.0, 1.0, 5.0, -5.0, 0.0];
        assert_eq!(
            select(&v, 2, 4, 1, BoostCriterion::Magnitude),
            [false, true, false, false]
        );
        assert_eq!(
            select(&v, 2, 4, 2, BoostCriterion::Magnitude),
            [false, true, true, false]
        );
    }

    #[test]
    fn fold_sum_pairs_halves_and_pads_with_zeros() {
        // ((a + c) + (b + d)), not ((a + b) + c) + d: visible with a large and a small value.
        let big = 16_777_216.0f32; // 2^24: adding 1.0 to it is lost to rounding
        assert_eq!(fold_sum(&[big, 1.0, -big, 1.0]), 2.0);
        assert_eq!([big, 1.0, -big, 1.0].iter().sum::<f32>(), 1.0);
        // 3 terms fold as 4 with a +0: (a + c) + b.
        assert_eq!(fold_sum(&[1.0, 2.0, 3.0]), 6.0);
        assert_eq!(fold_sum(&[5.0]), 5.0);
        assert_eq!(fold_sum(&[]), 0.0);
    }

    #[test]
    fn variance_ignores_constant_offsets() {
        // Channel 0 is large but constant; channel 1 varies.
        let v = [9.0, 1.0, 9.0, -1.0];
        assert_eq!(select(&v, 2, 2, 1, BoostCriterion::Variance), [false, true]);
        assert_eq!(
            select(&v, 2, 2, 1, BoostCriterion::Magnitude),
            [true, false]
        );
    }
}
