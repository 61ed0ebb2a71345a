//! EM training of one (KV head, group) of the RoPE-commutative key codebook, round by round.
//!
//! Each round fits `N'` complex entries per pair to the residuals left by the rounds before it:
//! - E step: soft assignment of every vector to every code `(a, b)`, `p ∝ exp(−‖z − c_a − i·c_b‖² / T)`,
//!   with the temperature `T` annealed geometrically (soft early, nearly hard at the end), as in the paper.
//! - M step: the weighted least-squares codebook. All pairs of a group share the code, so the normal
//!   equations share one `N' × N'` Hermitian matrix `H = diag(row + column sums of W) + i(W − Wᵀ)`
//!   (`W_ab` = total weight of code `(a, b)`), solved as a real `2N'` system with a small ridge that
//!   pulls unused entries towards their previous value.
//!
//! The best iterate by hard-assignment error is kept; entries are rounded to f16 (the GPU's copy) and the
//! residuals for the next round come from the greedy encoder on those rounded entries.

use super::key::{RoundTables, Scratch};
use super::linalg::solve_spd;
use crate::RefError;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Schedule of one round's EM.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EmSchedule {
    /// EM iterations per residual round.
    pub steps: usize,
    /// First and last temperature, as fractions of the mean squared norm of the round's residuals.
    pub temperature: (f64, f64),
}

impl Default for EmSchedule {
    fn default() -> Self {
        Self {
            steps: 8,
            temperature: (1e-2, 1e-4),
        }
    }
}

/// Soft assignments below `exp(−CUTOFF)` of the best one are dropped.
const CUTOFF: f64 = 20.0;

/// Trains every round of one group on `data` (`n × 2g`, pair-interleaved, already scaled). Returns the
/// rounds' tables `[entry][2g]`, f16-exact.
pub(crate) fn train_group(
    data: &[f64],
    dim: usize,
    levels: usize,
    residuals: usize,
    schedule: &EmSchedule,
    seed: u64,
) -> Result<Vec<Vec<f32>>, RefError> {
    let n = data.len() / dim.max(1);
    if n == 0 {
        return Err(RefError::Mismatch(
            "key codebook training needs at least one vector".into(),
        ));
    }
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let mut resid = data.to_vec();
    let mut rounds = Vec::with_capacity(residuals);
    let mut scratch = Scratch::new(levels);
    for _ in 0..residuals {
        let table = train_round(&resid, n, dim, levels, schedule, &mut rng)?;
        let stored: Vec<f32> = table
            .iter()
            .map(|x| super::f16_of_f64(*x).to_f32())
            .collect();
        let tables = RoundTables::new(
            &stored.iter().map(|x| *x as f64).collect::<Vec<_>>(),
            levels,
            dim,
        );
        for z in resid.chunks_exact_mut(dim) {
            let (code, _) = tables.nearest(z, &mut scratch);
            tables.subtract(code, z);
        }
        rounds.push(stored);
    }
    Ok(rounds)
}

/// Sufficient statistics of one E step.
struct Stats {
    /// `[a][b]` total weight.
    w: Vec<f64>,
    /// `[k][2g]`: Σ_n P(a = k) z_n and Σ_n P(b = k) z_n.
    ra: Vec<f64>,
    rb: Vec<f64>,
    /// Mean squared error of the hard (nearest) assignment.
    hard_mse: f64,
}

fn e_step(
    data: &[f64],
    dim: usize,
    tables: &RoundTables,
    temperature: f64,
    scratch: &mut Scratch,
) -> Stats {
    let l = tables.levels;
    let mut s = Stats {
        w: vec![0.0; l * l],
        ra: vec![0.0; l * dim],
        rb: vec![0.0; l * dim],
        hard_mse: 0.0,
    };
    let (mut pa, mut pb) = (vec![0.0; l], vec![0.0; l]);
    let n = data.len() / dim;
    for z in data.chunks_exact(dim) {
        tables.projections(z, &mut scratch.alpha, &mut scratch.beta);
        tables.distances(&scratch.alpha, &scratch.beta, &mut scratch.dist);
        let best = scratch.dist.iter().cloned().fold(f64::INFINITY, f64::min);
        let zz: f64 = z.iter().map(|x| x * x).sum();
        s.hard_mse += (best + zz).max(0.0);
        if temperature <= 0.0 {
            continue;
        }
        let mut total = 0.0;
        for d in scratch.dist.iter_mut() {
            let e = (*d - best) / temperature;
            *d = if e < CUTOFF { (-e).exp() } else { 0.0 };
            total += *d;
        }
        pa.iter_mut().for_each(|x| *x = 0.0);
        pb.iter_mut().for_each(|x| *x = 0.0);
        for (a, (row, pa_a)) in scratch.dist.chunks_exact(l).zip(pa.iter_mut()).enumerate() {
            for (b, (p, pb_b)) in row.iter().zip(pb.iter_mut()).enumerate() {
                if *p > 0.0 {
                    let p = p / total;
                    s.w[a * l + b] += p;
                    *pa_a += p;
                    *pb_b += p;
                }
            }
        }
        for k in 0..l {
            if pa[k] > 0.0 {
                axpy(pa[k], z, &mut s.ra[k * dim..(k + 1) * dim]);
            }
            if pb[k] > 0.0 {
                axpy(pb[k], z, &mut s.rb[k * dim..(k + 1) * dim]);
            }
        }
    }
    s.hard_mse /= n as f64;
    s
}

fn axpy(a: f64, x: &[f64], y: &mut [f64]) {
    for (yi, xi) in y.iter_mut().zip(x) {
        *yi += a * xi;
    }
}

/// The weighted least-squares codebook for the statistics `s`, pulled towards `old` where unused.
fn m_step(s: &Stats, old: &[f64], levels: usize, dim: usize) -> Result<Vec<f64>, RefError> {
    let (l, g) = (levels, dim / 2);
    let n2 = 2 * l;
    let mut a = vec![0.0; n2 * n2];
    for k in 0..l {
        let d: f64 = (0..l).map(|b| s.w[k * l + b] + s.w[b * l + k]).sum();
        a[k * n2 + k] = d;
        a[(l + k) * n2 + l + k] = d;
        for j in 0..l {
            let kk = s.w[k * l + j] - s.w[j * l + k];
            // [S −K; K S]
            a[k * n2 + l + j] = -kk;
            a[(l + k) * n2 + j] = kk;
        }
    }
    let trace: f64 = (0..n2).map(|i| a[i * n2 + i]).sum::<f64>() / n2 as f64;
    let ridge = 1e-4 * trace + 1e-12;
    // Right-hand side: Re and Im of b_k = RA_k − i·RB_k, plus the ridge's pull towards `old`.
    let mut rhs = vec![0.0; n2 * g];
    for k in 0..l {
        for j in 0..g {
            let (ar, ai) = (s.ra[k * dim + 2 * j], s.ra[k * dim + 2 * j + 1]);
            let (br, bi) = (s.rb[k * dim + 2 * j], s.rb[k * dim + 2 * j + 1]);
            rhs[k * g + j] = ar + bi + ridge * old[k * dim + 2 * j];
            rhs[(l + k) * g + j] = ai - br + ridge * old[k * dim + 2 * j + 1];
        }
    }
    solve_spd(&mut a, n2, &mut rhs, g, ridge)?;
    let mut table = vec![0.0; l * dim];
    for k in 0..l {
        for j in 0..g {
            table[k * dim + 2 * j] = rhs[k * g + j];
            table[k * dim + 2 * j + 1] = rhs[(l + k) * g + j];
        }
    }
    Ok(table)
}

fn train_round(
    data: &[f64],
    n: usize,
    dim: usize,
    levels: usize,
    schedule: &EmSchedule,
    rng: &mut ChaCha8Rng,
) -> Result<Vec<f64>, RefError> {
    let energy = data.iter().map(|x| x * x).sum::<f64>() / n as f64;
    if energy.is_nan() || energy <= 0.0 {
        return Ok(vec![0.0; levels * dim]);
    }
    // Start: entry k = z·(1 − i)/2 for a random vector z, so code (k, k) reproduces z exactly.
    let mut table = vec![0.0; levels * dim];
    for k in 0..levels {
        let z = &data[rng.random_range(0..n) * dim..][..dim];
        for j in 0..dim / 2 {
            let (re, im) = (z[2 * j], z[2 * j + 1]);
            table[k * dim + 2 * j] = (re + im) / 2.0;
            table[k * dim + 2 * j + 1] = (im - re) / 2.0;
        }
    }
    let mut scratch = Scratch::new(levels);
    let (t0, t1) = schedule.temperature;
    let steps = schedule.steps.max(1);
    let mut best = (f64::INFINITY, table.clone());
    for step in 0..steps {
        let frac = if steps > 1 {
            step as f64 / (steps - 1) as f64
        } else {
            1.0
        };
        let temperature = energy * t0 * (t1 / t0).powf(frac);
        let tables = RoundTables::new(&table, levels, dim);
        let stats = e_step(data, dim, &tables, temperature, &mut scratch);
        if stats.hard_mse < best.0 {
            best = (stats.hard_mse, table.clone());
        }
        table = m_step(&stats, &table, levels, dim)?;
    }
    let last = e_step(
        data,
        dim,
        &RoundTables::new(&table, levels, dim),
        0.0,
        &mut scratch,
    );
    if last.hard_mse < best.0 {
        best = (last.hard_mse, table);
    }
    Ok(best.1)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn data(n: usize, dim: usize, seed: u64) -> Vec<f64> {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..n * dim)
            .map(|i| rng.random_range(-1.0..1.0) + if i % dim == 0 { 2.0 } else { 0.0 })
            .collect()
    }

    #[test]
    fn rounds_reduce_the_error_and_training_is_deterministic() {
        let (n, dim) = (200, 8);
        let x = data(n, dim, 1);
        let sched = EmSchedule {
            steps: 6,
            ..Default::default()
        };
        let rounds = train_group(&x, dim, 8, 3, &sched, 7).unwrap();
        assert_eq!(rounds, train_group(&x, dim, 8, 3, &sched, 7).unwrap());
        let mut scratch = Scratch::new(8);
        let mut errs = Vec::new();
        let mut resid = x.clone();
        for t in &rounds {
            let tables = RoundTables::new(&t.iter().map(|v| *v as f64).collect::<Vec<_>>(), 8, dim);
            for z in resid.chunks_exact_mut(dim) {
                let (code, _) = tables.nearest(z, &mut scratch);
                tables.subtract(code, z);
            }
            errs.push(resid.iter().map(|v| v * v).sum::<f64>() / n as f64);
        }
        let start = x.iter().map(|v| v * v).sum::<f64>() / n as f64;
        assert!(errs[0] < 0.8 * start, "{start} -> {errs:?}");
        assert!(errs[2] < errs[1] && errs[1] < errs[0], "{errs:?}");
    }

    #[test]
    fn em_beats_its_initialisation() {
        let (n, dim) = (300, 4);
        let x = data(n, dim, 3);
        let one = EmSchedule {
            steps: 1,
            ..Default::default()
        };
        let many = EmSchedule {
            steps: 10,
            ..Default::default()
        };
        let err = |rounds: &[Vec<f32>]| {
            let t: Vec<f64> = rounds[0].iter().map(|v| *v as f64).collect();
            let tables = RoundTables::new(&t, 4, dim);
            let mut scratch = Scratch::new(4);
            x.chunks_exact(dim)
                .map(|z| tables.nearest(z, &mut scratch).1 + z.iter().map(|v| v * v).sum::<f64>())
                .sum::<f64>()
        };
        let e1 = err(&train_group(&x, dim, 4, 1, &one, 5).unwrap());
        let e10 = err(&train_group(&x, dim, 4, 1, &many, 5).unwrap());
        assert!(e10 < e1, "{e10} !< {e1}");
    }

    #[test]
    fn m_step_is_the_least_squares_codebook() {
        // With near-hard assignments the M step minimises Σ_n ‖z_n − c_a − i·c_b‖² over the codebook:
        // no small perturbation of any entry may lower it (checks the Hermitian system's signs).
        let (n, dim, levels) = (120, 6, 4);
        let x = data(n, dim, 8);
        let mut rng = ChaCha8Rng::seed_from_u64(2);
        let start: Vec<f64> = (0..levels * dim)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let mut scratch = Scratch::new(levels);
        let tables = RoundTables::new(&start, levels, dim);
        let stats = e_step(&x, dim, &tables, 1e-12, &mut scratch);
        let codes: Vec<(u32, u32)> = x
            .chunks_exact(dim)
            .map(|z| tables.nearest(z, &mut scratch).0)
            .collect();
        let cost = |t: &[f64]| {
            let tb = RoundTables::new(t, levels, dim);
            x.chunks_exact(dim)
                .zip(&codes)
                .map(|(z, c)| {
                    let mut r = z.to_vec();
                    tb.subtract(*c, &mut r);
                    r.iter().map(|v| v * v).sum::<f64>()
                })
                .sum::<f64>()
        };
        let fitted = m_step(&stats, &start, levels, dim).unwrap();
        let best = cost(&fitted);
        assert!(best < cost(&start));
        for i in 0..fitted.len() {
            for eps in [1e-3, -1e-3] {
                let mut t = fitted.clone();
                t[i] += eps;
                assert!(
                    cost(&t) >= best - 1e-6 * best,
                    "entry {i}: {} < {best}",
                    cost(&t)
                );
            }
        }
    }
}
