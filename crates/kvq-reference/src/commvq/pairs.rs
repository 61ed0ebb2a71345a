//! Between a head's channels and the pair-interleaved group vectors the key codebook works on.
//!
//! Pair `p` of a head of `D` channels is `(x[p], x[p + D/2])`; group `γ` holds pairs
//! `γ·g .. (γ+1)·g`, stored as `[re_0, im_0, re_1, im_1, …]`.

/// Group `group` of a head vector, times `factor`.
pub(crate) fn gather(head: &[f32], g: usize, group: usize, factor: f64) -> Vec<f64> {
    let half = head.len() / 2;
    let mut out = Vec::with_capacity(2 * g);
    for p in group * g..(group + 1) * g {
        out.push(head[p] as f64 * factor);
        out.push(head[p + half] as f64 * factor);
    }
    out
}

/// Adds `factor ·` a group vector into its channels of a head vector.
pub(crate) fn scatter_add(
    group_vec: &[f64],
    g: usize,
    group: usize,
    factor: f64,
    head: &mut [f64],
) {
    let half = head.len() / 2;
    for (j, p) in (group * g..(group + 1) * g).enumerate() {
        head[p] += group_vec[2 * j] * factor;
        head[p + half] += group_vec[2 * j + 1] * factor;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gather_then_scatter_is_identity() {
        let x: Vec<f32> = (0..16).map(|i| i as f32).collect();
        let mut back = vec![0.0f64; 16];
        for group in 0..2 {
            let v = gather(&x, 4, group, 2.0);
            assert_eq!(v[0], 2.0 * (group * 4) as f64);
            assert_eq!(v[1], 2.0 * (group * 4 + 8) as f64);
            scatter_add(&v, 4, group, 0.5, &mut back);
        }
        assert!(x.iter().zip(&back).all(|(a, b)| *a as f64 == *b));
    }
}
