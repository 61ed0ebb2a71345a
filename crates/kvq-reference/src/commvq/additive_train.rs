//! Training of one binary additive codebook: alternating minimisation on calibration directions.
//!
//! Codes by the encoder of [`super::additive`] (warm-started from the previous codes), then the
//! codebook by ridge regression `C = (SᵀS + λI)⁻¹ SᵀT`; the best iterate by mean squared error
//! is kept. The paper instead trains the codebook jointly with a small MLP encoder through a
//! Gumbel-softmax relaxation; without the model's loss to train against, least squares on the
//! reconstruction error is the CPU reference's choice.

use super::additive::BookEncoder;
use super::linalg::solve_spd;
use crate::RefError;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Alternations of code and codebook updates, and encoder passes in each.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdditiveSchedule {
    pub iterations: usize,
    pub sweeps: usize,
}

impl Default for AdditiveSchedule {
    fn default() -> Self {
        Self {
            iterations: 8,
            sweeps: 2,
        }
    }
}

/// Trains `[row][dim]` on unit-norm targets (`n × dim`); the result is f16-exact.
pub(crate) fn train_book(
    targets: &[f64],
    dim: usize,
    rows: usize,
    schedule: &AdditiveSchedule,
    seed: u64,
) -> Result<Vec<f32>, RefError> {
    let n = targets.len() / dim.max(1);
    if n == 0 {
        return Err(RefError::Mismatch(
            "additive codebook training needs at least one vector".into(),
        ));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    // Start: random calibration directions, scaled so that a code with half its bits set has norm ≈ 1.
    let a = (2.0 / rows as f64).sqrt();
    let mut book = vec![0.0; rows * dim];
    for j in 0..rows {
        let t = &targets[rng.random_range(0..n) * dim..][..dim];
        let sign = if rng.random_bool(0.5) { a } else { -a };
        for (c, x) in book[j * dim..(j + 1) * dim].iter_mut().zip(t) {
            *c = sign * x;
        }
    }
    let mut codes = vec![false; n * rows];
    let mut best = (f64::INFINITY, book.clone());
    for _ in 0..schedule.iterations.max(1) {
        let enc = BookEncoder::new(&book, rows, dim);
        let mut err = 0.0;
        for (t, code) in targets.chunks_exact(dim).zip(codes.chunks_exact_mut(rows)) {
            err += enc.encode(t, code, schedule.sweeps.max(1));
        }
        err /= n as f64;
        if err < best.0 {
            best = (err, book.clone());
        }
        book = least_squares(targets, &codes, dim, rows)?;
    }
    let enc = BookEncoder::new(&book, rows, dim);
    let err = targets
        .chunks_exact(dim)
        .zip(codes.chunks_exact_mut(rows))
        .map(|(t, code)| enc.encode(t, code, schedule.sweeps.max(1)))
        .sum::<f64>()
        / n as f64;
    if err < best.0 {
        best = (err, book);
    }
    Ok(best
        .1
        .iter()
        .map(|x| super::f16_of_f64(*x).to_f32())
        .collect())
}

/// Ridge of the codebook update, relative to the mean diagonal of `SᵀS`.
const RIDGE: f64 = 3e-2;

fn least_squares(
    targets: &[f64],
    codes: &[bool],
    dim: usize,
    rows: usize,
) -> Result<Vec<f64>, RefError> {
    let mut g = vec![0.0; rows * rows];
    let mut rhs = vec![0.0; rows * dim];
    let mut on = Vec::with_capacity(rows);
    for (t, code) in targets.chunks_exact(dim).zip(codes.chunks_exact(rows)) {
        on.clear();
        on.extend(code.iter().enumerate().filter(|(_, b)| **b).map(|(j, _)| j));
        for &i in &on {
            for &j in &on {
                g[i * rows + j] += 1.0;
            }
            for (r, x) in rhs[i * dim..(i + 1) * dim].iter_mut().zip(t) {
                *r += x;
            }
        }
    }
    let trace = (0..rows).map(|i| g[i * rows + i]).sum::<f64>() / rows as f64;
    // Shrinkage towards zero: the calibration set is small next to `rows · dim` unknowns, and a
    // shrunk codebook generalises better to unseen tokens.
    let ridge = RIDGE * trace.max(1.0);
    solve_spd(&mut g, rows, &mut rhs, dim, ridge)?;
    Ok(rhs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn training_lowers_the_error_and_is_deterministic() {
        let (n, dim, rows) = (300, 16, 32);
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let mut t: Vec<f64> = (0..n * dim)
            .map(|i| rng.random_range(-1.0..1.0) + (i % dim) as f64 * 0.1)
            .collect();
        for v in t.chunks_exact_mut(dim) {
            let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
            v.iter_mut().for_each(|x| *x /= norm);
        }
        let err = |book: &[f32], sweeps| {
            let b: Vec<f64> = book.iter().map(|x| *x as f64).collect();
            let enc = BookEncoder::new(&b, rows, dim);
            t.chunks_exact(dim)
                .map(|v| enc.encode(v, &mut vec![false; rows], sweeps))
                .sum::<f64>()
                / n as f64
        };
        let short = train_book(
            &t,
            dim,
            rows,
            &AdditiveSchedule {
                iterations: 1,
                sweeps: 2,
            },
            3,
        )
        .unwrap();
        let long = train_book(
            &t,
            dim,
            rows,
            &AdditiveSchedule {
                iterations: 10,
                sweeps: 2,
            },
            3,
        )
        .unwrap();
        assert_eq!(
            long,
            train_book(
                &t,
                dim,
                rows,
                &AdditiveSchedule {
                    iterations: 10,
                    sweeps: 2
                },
                3
            )
            .unwrap()
        );
        let (e1, e10) = (err(&short, 6), err(&long, 6));
        assert!(e10 < e1 && e10 < 0.5, "{e1} -> {e10}");
    }
}
