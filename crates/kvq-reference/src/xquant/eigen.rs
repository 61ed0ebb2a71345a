//! Eigen-decomposition of a symmetric matrix in f64: Householder reduction to tridiagonal form,
//! then the implicit QL method with Wilkinson-style shifts, eigenvectors accumulated. `O(n³)` with
//! small constants, where one-sided Jacobi on a 4096 × 1024 projection takes a minute and a half;
//! [`super::svd`] uses it on the Gram matrix of large weights.

use crate::RefError;

/// Eigenvalues (ascending order not guaranteed) and eigenvectors of a symmetric `n × n` matrix
/// given row-major; `vectors[j]` is the unit eigenvector of `values[j]`.
pub(crate) struct Eigen {
    pub values: Vec<f64>,
    pub vectors: Vec<Vec<f64>>,
}

const MAX_QL_ITERATIONS: usize = 60;

/// Reduces `a` (row-major, symmetric, `n × n`) in place to the orthogonal `Q` of `A = Q T Qᵀ` and
/// returns `T`'s diagonal and sub-diagonal (`e[i]` couples `i − 1` and `i`; `e[0] = 0`).
fn tridiagonalize(a: &mut [f64], n: usize) -> (Vec<f64>, Vec<f64>) {
    let (mut d, mut e) = (vec![0.0f64; n], vec![0.0f64; n]);
    let at = |i: usize, j: usize| i * n + j;
    for i in (1..n).rev() {
        let l = i - 1;
        let mut h = 0.0;
        if l > 0 {
            let scale: f64 = (0..=l).map(|k| a[at(i, k)].abs()).sum();
            if scale == 0.0 {
                e[i] = a[at(i, l)];
            } else {
                for k in 0..=l {
                    a[at(i, k)] /= scale;
                    h += a[at(i, k)] * a[at(i, k)];
                }
                let f = a[at(i, l)];
                let g = if f >= 0.0 { -h.sqrt() } else { h.sqrt() };
                e[i] = scale * g;
                h -= f * g;
                a[at(i, l)] = f - g;
                let mut f = 0.0;
                for j in 0..=l {
                    a[at(j, i)] = a[at(i, j)] / h;
                    let mut g = 0.0;
                    for k in 0..=j {
                        g += a[at(j, k)] * a[at(i, k)];
                    }
                    for k in j + 1..=l {
                        g += a[at(k, j)] * a[at(i, k)];
                    }
                    e[j] = g / h;
                    f += e[j] * a[at(i, j)];
                }
                let hh = f / (h + h);
                for j in 0..=l {
                    let f = a[at(i, j)];
                    let g = e[j] - hh * f;
                    e[j] = g;
                    for k in 0..=j {
                        a[at(j, k)] -= f * e[k] + g * a[at(i, k)];
                    }
                }
            }
        } else {
            e[i] = a[at(i, l)];
        }
        d[i] = h;
    }
    d[0] = 0.0;
    e[0] = 0.0;
    // Accumulate the transformations into Q.
    for i in 0..n {
        if d[i] != 0.0 {
            for j in 0..i {
                let g: f64 = (0..i).map(|k| a[at(i, k)] * a[at(k, j)]).sum();
                for k in 0..i {
                    a[at(k, j)] -= g * a[at(k, i)];
                }
            }
        }
        d[i] = a[at(i, i)];
        a[at(i, i)] = 1.0;
        for j in 0..i {
            a[at(j, i)] = 0.0;
            a[at(i, j)] = 0.0;
        }
    }
    (d, e)
}

/// The eigen-decomposition of the symmetric `n × n` row-major `a` (consumed).
pub(crate) fn symmetric_eigen(mut a: Vec<f64>, n: usize) -> Result<Eigen, RefError> {
    if a.len() != n * n {
        return Err(RefError::Mismatch(format!(
            "eigen-decomposition of an {n} × {n} matrix from {} values",
            a.len()
        )));
    }
    let (mut d, mut e) = tridiagonalize(&mut a, n);
    // Eigenvector j is column j of Q: kept as rows, so that each rotation updates two rows.
    let mut z: Vec<Vec<f64>> = (0..n)
        .map(|j| (0..n).map(|k| a[k * n + j]).collect())
        .collect();
    for i in 1..n {
        e[i - 1] = e[i];
    }
    if n > 0 {
        e[n - 1] = 0.0;
    }
    for l in 0..n {
        let mut iterations = 0;
        loop {
            let mut m = l;
            while m + 1 < n {
                let dd = d[m].abs() + d[m + 1].abs();
                if e[m].abs() <= f64::EPSILON * dd {
                    break;
                }
                m += 1;
            }
            if m == l {
                break;
            }
            iterations += 1;
            if iterations > MAX_QL_ITERATIONS {
                return Err(RefError::Mismatch(format!(
                    "eigen-decomposition did not converge in {MAX_QL_ITERATIONS} QL iterations"
                )));
            }
            let mut g = (d[l + 1] - d[l]) / (2.0 * e[l]);
            let mut r = g.hypot(1.0);
            g = d[m] - d[l] + e[l] / (g + if g >= 0.0 { r.abs() } else { -r.abs() });
            let (mut s, mut c, mut p) = (1.0f64, 1.0f64, 0.0f64);
            let mut deflated = false;
            for i in (l..m).rev() {
                let f = s * e[i];
                let b = c * e[i];
                r = f.hypot(g);
                e[i + 1] = r;
                if r == 0.0 {
                    d[i + 1] -= p;
                    e[m] = 0.0;
                    deflated = true;
                    break;
                }
                s = f / r;
                c = g / r;
                g = d[i + 1] - p;
                r = (d[i] - g) * s + 2.0 * c * b;
                p = s * r;
                d[i + 1] = g + p;
                g = c * r - b;
                let (lo, hi) = z.split_at_mut(i + 1);
                for (zi, zj) in lo[i].iter_mut().zip(hi[0].iter_mut()) {
                    let f = *zj;
                    *zj = s * *zi + c * f;
                    *zi = c * *zi - s * f;
                }
            }
            if deflated {
                continue;
            }
            d[l] -= p;
            e[l] = g;
            e[m] = 0.0;
        }
    }
    Ok(Eigen {
        values: d,
        vectors: z,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A Av = λv check on a matrix with a known spectrum (and repeated eigenvalues).
    #[test]
    fn eigenpairs_satisfy_the_definition() {
        for n in [1usize, 2, 5, 33] {
            let a: Vec<f64> = (0..n * n)
                .map(|i| {
                    let (r, c) = (i / n, i % n);
                    let (lo, hi) = (r.min(c), r.max(c));
                    ((lo * 31 + hi * 17) % 13) as f64 - 6.0 + if r == c { 2.0 } else { 0.0 }
                })
                .collect();
            let eig = symmetric_eigen(a.clone(), n).unwrap();
            let scale = a.iter().fold(1.0f64, |m, x| m.max(x.abs())) * n as f64;
            for (j, v) in eig.vectors.iter().enumerate() {
                let norm: f64 = v.iter().map(|x| x * x).sum();
                assert!((norm - 1.0).abs() < 1e-12);
                for r in 0..n {
                    let av: f64 = (0..n).map(|c| a[r * n + c] * v[c]).sum();
                    assert!((av - eig.values[j] * v[r]).abs() < 1e-12 * scale);
                }
                for w in &eig.vectors[..j] {
                    let dot: f64 = v.iter().zip(w).map(|(x, y)| x * y).sum();
                    assert!(dot.abs() < 1e-12);
                }
            }
        }
        let repeated = vec![2.0, 0.0, 0.0, 0.0, 2.0, 0.0, 0.0, 0.0, 5.0];
        let mut values = symmetric_eigen(repeated, 3).unwrap().values;
        values.sort_by(f64::total_cmp);
        assert_eq!(values, [2.0, 2.0, 5.0]);
        assert!(symmetric_eigen(vec![1.0; 5], 2).is_err());
    }
}
