//! Thin SVD by one-sided Jacobi rotations (Hestenes), in f64: accurate for the small dense weight
//! matrices here and free of dependencies.

use crate::RefError;

/// `A = U · diag(σ) · Vᵀ` of an `m × n` matrix with `m ≥ n`: `u` is `m × n` (orthonormal columns; a
/// zero column where σ = 0), `v` is `n × n` orthogonal, σ descending. Matrices are row-major.
#[derive(Debug, Clone, PartialEq)]
pub struct Svd {
    pub m: usize,
    pub n: usize,
    pub u: Vec<f64>,
    pub sigma: Vec<f64>,
    pub v: Vec<f64>,
}

const MAX_SWEEPS: usize = 60;

/// SVD of a row-major `m × n` matrix, `m ≥ n`.
pub fn svd(a: &[f64], m: usize, n: usize) -> Result<Svd, RefError> {
    if a.len() != m * n || m < n || n == 0 {
        return Err(RefError::Mismatch(format!(
            "SVD of a {m} × {n} matrix (needs m ≥ n ≥ 1) from {} values",
            a.len()
        )));
    }
    if a.iter().any(|x| !x.is_finite()) {
        return Err(RefError::Mismatch(
            "SVD of a matrix with a non-finite entry".into(),
        ));
    }
    // Columns contiguous: cols[j] is column j of A (becomes σ_j u_j), vs[j] column j of V.
    let mut cols: Vec<Vec<f64>> = (0..n)
        .map(|j| (0..m).map(|i| a[i * n + j]).collect())
        .collect();
    let mut vs: Vec<Vec<f64>> = (0..n)
        .map(|j| (0..n).map(|i| (i == j) as u8 as f64).collect())
        .collect();
    let dot = |x: &[f64], y: &[f64]| x.iter().zip(y).map(|(p, q)| p * q).sum::<f64>();
    let mut converged = false;
    for _ in 0..MAX_SWEEPS {
        let mut rotated = false;
        for p in 0..n {
            for q in p + 1..n {
                let (alpha, beta, gamma) = (
                    dot(&cols[p], &cols[p]),
                    dot(&cols[q], &cols[q]),
                    dot(&cols[p], &cols[q]),
                );
                if gamma == 0.0 || gamma.abs() <= 1e-15 * (alpha * beta).sqrt() {
                    continue;
                }
                rotated = true;
                let zeta = (beta - alpha) / (2.0 * gamma);
                let t = zeta.signum() / (zeta.abs() + (1.0 + zeta * zeta).sqrt());
                let c = 1.0 / (1.0 + t * t).sqrt();
                let s = c * t;
                for pair in [&mut cols, &mut vs] {
                    let (lo, hi) = pair.split_at_mut(q);
                    for (x, y) in lo[p].iter_mut().zip(hi[0].iter_mut()) {
                        let (xp, yq) = (*x, *y);
                        *x = c * xp - s * yq;
                        *y = s * xp + c * yq;
                    }
                }
            }
        }
        if !rotated {
            converged = true;
            break;
        }
    }
    if !converged {
        return Err(RefError::Mismatch(format!(
            "SVD did not converge in {MAX_SWEEPS} sweeps"
        )));
    }
    let mut order: Vec<(f64, usize)> = cols
        .iter()
        .enumerate()
        .map(|(j, c)| (dot(c, c).sqrt(), j))
        .collect();
    order.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    let (mut u, mut v, mut sigma) = (vec![0.0; m * n], vec![0.0; n * n], Vec::with_capacity(n));
    let tiny = order.first().map_or(0.0, |o| o.0) * 1e-14;
    for (k, (s, j)) in order.into_iter().enumerate() {
        let s = if s > tiny { s } else { 0.0 };
        sigma.push(s);
        for i in 0..m {
            u[i * n + k] = if s > 0.0 { cols[j][i] / s } else { 0.0 };
        }
        for i in 0..n {
            v[i * n + k] = vs[j][i];
        }
    }
    Ok(Svd { m, n, u, sigma, v })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconstructs_and_is_orthonormal() {
        let (m, n) = (7, 4);
        let a: Vec<f64> = (0..m * n)
            .map(|i| ((i * 37 % 11) as f64 - 5.0) / 3.0)
            .collect();
        let s = svd(&a, m, n).unwrap();
        for i in 0..m {
            for j in 0..n {
                let x: f64 = (0..n)
                    .map(|k| s.u[i * n + k] * s.sigma[k] * s.v[j * n + k])
                    .sum();
                assert!((x - a[i * n + j]).abs() < 1e-12);
            }
        }
        for p in 0..n {
            for q in 0..n {
                let uu: f64 = (0..m).map(|i| s.u[i * n + p] * s.u[i * n + q]).sum();
                let vv: f64 = (0..n).map(|i| s.v[i * n + p] * s.v[i * n + q]).sum();
                let want = (p == q) as u8 as f64;
                assert!((uu - want).abs() < 1e-12 && (vv - want).abs() < 1e-12);
            }
        }
        assert!(s.sigma.windows(2).all(|w| w[0] >= w[1]));
    }

    #[test]
    fn rank_deficient_input_gives_zero_singular_values() {
        // Two equal columns.
        let a = vec![1.0, 1.0, 2.0, 2.0, 3.0, 3.0];
        let s = svd(&a, 3, 2).unwrap();
        assert!((s.sigma[0] - (28.0f64).sqrt()).abs() < 1e-12);
        assert_eq!(s.sigma[1], 0.0);
        assert!(svd(&a, 2, 3).is_err());
    }
}
