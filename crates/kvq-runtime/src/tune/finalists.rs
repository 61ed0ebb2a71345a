//! The family tuners' second half (the codebook and XQuant decodes, whose candidates are checked
//! against the default launch's output, `check::gate_output`): which candidates the gate checks,
//! and the re-timing of those that passed in interleaved rounds, so drift hits them alike.

use std::fmt::Display;

use super::CandidateResult;

/// The candidates the gate checks: the default (index 0) first, then the `n` fastest others by
/// their first-pass time (untimed ones left out).
pub(crate) fn fastest_finalists(results: &[CandidateResult], n: usize) -> Vec<usize> {
    let mut order: Vec<usize> = (1..results.len())
        .filter(|&i| results[i].coarse_us.is_some())
        .collect();
    order.sort_by(|&a, &b| {
        let us = |i: usize| results[i].coarse_us.unwrap_or(f64::MAX);
        us(a).total_cmp(&us(b))
    });
    std::iter::once(0)
        .chain(order.into_iter().take(n))
        .collect()
}

/// The `finalists` that passed the gate: an error measured, nothing rejected.
pub(crate) fn passed(results: &[CandidateResult], finalists: &[usize]) -> Vec<usize> {
    finalists
        .iter()
        .copied()
        .filter(|&i| results[i].rejected.is_none() && results[i].error.is_some())
        .collect()
}

/// The second pass: `live` candidates timed in `rounds` interleaved rounds by `time(index)` (a
/// round's µs, or why not), each one's median over its rounds kept as `fine_us`. A failed round
/// rejects its candidate.
pub(crate) fn retime_interleaved<E: Display>(
    results: &mut [CandidateResult],
    live: &[usize],
    rounds: usize,
    mut time: impl FnMut(usize) -> Result<f64, E>,
) {
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); results.len()];
    for _ in 0..rounds {
        for &i in live {
            match time(i) {
                Ok(us) => samples[i].push(us),
                Err(e) => results[i].rejected = Some(e.to_string()),
            }
        }
    }
    for &i in live {
        if !samples[i].is_empty() {
            samples[i].sort_by(f64::total_cmp);
            results[i].fine_us = Some(samples[i][samples[i].len() / 2]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode::Pieces;
    use crate::tune::TuneChoice;
    use kvq_codegen::TuneParams;

    fn result(coarse_us: Option<f64>) -> CandidateResult {
        let params = TuneParams {
            threads: 256,
            tile_tokens: 128,
            min_warps_per_sm: 0,
            pack_heads: false,
            short_staging: false,
            store_scores: false,
        };
        CandidateResult {
            choice: TuneChoice {
                params,
                splits: 1,
                pieces: Pieces::NONE,
            },
            coarse_us,
            fine_us: None,
            error: None,
            rejected: None,
        }
    }

    #[test]
    fn the_default_and_the_fastest_timed_others_are_finalists() {
        let r: Vec<CandidateResult> = [Some(9.0), Some(5.0), None, Some(3.0), Some(7.0)]
            .into_iter()
            .map(result)
            .collect();
        assert_eq!(fastest_finalists(&r, 2), vec![0, 3, 1]);
        assert_eq!(fastest_finalists(&r, 10), vec![0, 3, 1, 4]);
        assert_eq!(fastest_finalists(&r[..1], 3), vec![0]);
    }

    #[test]
    fn only_gated_finalists_are_retimed_and_keep_their_median() {
        let mut r: Vec<CandidateResult> = (0..4).map(|_| result(Some(1.0))).collect();
        r[0].error = Some(0.0);
        r[1].error = Some(1e-4);
        r[2].rejected = Some("wrong".into());
        r[3].error = Some(2e-4);
        let live = passed(&r, &[0, 1, 2]);
        assert_eq!(live, vec![0, 1]);
        let mut calls = 0;
        retime_interleaved(&mut r, &live, 3, |i| {
            calls += 1;
            if i == 1 && calls > 3 {
                Err("launch failed")
            } else {
                Ok(10.0 * (i + 1) as f64 + calls as f64)
            }
        });
        // Rounds interleave: 0, 1, 0, 1, 0, 1.
        assert_eq!(calls, 6);
        assert_eq!(r[0].fine_us, Some(13.0));
        assert_eq!(r[1].fine_us, Some(22.0));
        assert_eq!(r[1].rejected.as_deref(), Some("launch failed"));
        assert_eq!(r[3].fine_us, None);
    }
}
