//! Kitty's choice of boosted channels within one page of one head (`docs/LAYOUT.md` §3.4).
//!
//! Scores accumulate in f32 over the page's tokens in token order — one GPU thread per channel looping
//! over the page reproduces them exactly. Ranking uses the sum (same order as the mean, without a
//! division that could merge neighbours); ties go to the lower channel index.

use kvq_spec::BoostCriterion;

/// Per-channel ranking scores of a `[page][head_dim]` block.
pub fn scores(values: &[f32], page: usize, head_dim: usize, by: BoostCriterion) -> Vec<f32> {
    let column = |c: usize| (0..page).map(move |t| values[t * head_dim + c]);
    (0..head_dim)
        .map(|c| match by {
            BoostCriterion::Magnitude => column(c).fold(0.0f32, |acc, x| acc + x.abs()),
            BoostCriterion::Variance => {
                let mean = column(c).fold(0.0f32, |acc, x| acc + x) / page as f32;
                column(c).fold(0.0f32, |acc, x| {
                    let d = x - mean;
                    d.mul_add(d, acc)
                })
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
