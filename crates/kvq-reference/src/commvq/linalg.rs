//! The one dense solve the trainers need: a symmetric positive (semi)definite system, made definite
//! by a ridge, by Cholesky in f64. Sizes are small (at most a few hundred unknowns).

use crate::RefError;

/// Solves `(A + ridge·I) X = B` in place: `a` is `n × n` row-major (overwritten by its factor),
/// `b` is `n × m` row-major and receives `X`.
pub(crate) fn solve_spd(
    a: &mut [f64],
    n: usize,
    b: &mut [f64],
    m: usize,
    ridge: f64,
) -> Result<(), RefError> {
    if a.len() != n * n || b.len() != n * m {
        return Err(RefError::Mismatch(format!(
            "a {n}×{n} system with {m} right-hand sides got {} and {} values",
            a.len(),
            b.len()
        )));
    }
    for i in 0..n {
        a[i * n + i] += ridge;
    }
    cholesky(a, n)?;
    substitute(a, n, b, m);
    Ok(())
}

/// The lower-triangular factor L of a symmetric positive definite `a` (`n × n`, row-major),
/// A = L·Lᵀ, in place in `a`'s lower half.
pub(crate) fn cholesky(a: &mut [f64], n: usize) -> Result<(), RefError> {
    for j in 0..n {
        let mut d = a[j * n + j];
        for k in 0..j {
            d -= a[j * n + k] * a[j * n + k];
        }
        if d.is_nan() || d <= 0.0 || !d.is_finite() {
            return Err(RefError::Mismatch(format!(
                "codebook update: the normal equations are not positive definite (pivot {j} = {d})"
            )));
        }
        let d = d.sqrt();
        a[j * n + j] = d;
        for i in j + 1..n {
            let mut s = a[i * n + j];
            for k in 0..j {
                s -= a[i * n + k] * a[j * n + k];
            }
            a[i * n + j] = s / d;
        }
    }
    Ok(())
}

/// Solves L·Lᵀ·X = B for `m` right-hand sides (`b`: `n × m`, row-major, replaced by X), `l` the
/// factor of [`cholesky`].
pub(crate) fn substitute(l: &[f64], n: usize, b: &mut [f64], m: usize) {
    let a = l;
    // Forward (L·Y = B) then backward (Lᵀ·X = Y) substitution, all columns at once.
    for i in 0..n {
        for k in 0..i {
            let l = a[i * n + k];
            if l != 0.0 {
                for c in 0..m {
                    b[i * m + c] -= l * b[k * m + c];
                }
            }
        }
        let d = a[i * n + i];
        for c in 0..m {
            b[i * m + c] /= d;
        }
    }
    for i in (0..n).rev() {
        for k in i + 1..n {
            let l = a[k * n + i];
            if l != 0.0 {
                for c in 0..m {
                    b[i * m + c] -= l * b[k * m + c];
                }
            }
        }
        let d = a[i * n + i];
        for c in 0..m {
            b[i * m + c] /= d;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn solves_a_small_system() {
        // A = [[4, 1], [1, 3]], X = [[1, 2], [-1, 0]] → B = A·X.
        let mut a = vec![4.0, 1.0, 1.0, 3.0];
        let mut b = vec![3.0, 8.0, -2.0, 2.0];
        solve_spd(&mut a, 2, &mut b, 2, 0.0).unwrap();
        for (x, want) in b.iter().zip([1.0, 2.0, -1.0, 0.0]) {
            assert!((x - want).abs() < 1e-12, "{x} vs {want}");
        }
    }

    #[test]
    fn singular_without_ridge_is_an_error() {
        let mut a = vec![1.0, 1.0, 1.0, 1.0];
        let mut b = vec![1.0, 1.0];
        assert!(solve_spd(&mut a, 2, &mut b, 1, 0.0).is_err());
    }
}
