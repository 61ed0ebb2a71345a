//! Tuning the XQuant decode: its kernel's shape is fixed by the code generator (tile, warps,
//! rebuild MMAs; the rebuild precision is the caller's quality choice), so what is left to choose
//! per GPU and problem is the split count. The default ([`XQuantKernel::default_splits`]: one wave
//! of one CTA an SM) is a rule; the tuner times the split counts around it on the caller's batch
//! (or a synthetic one), checks each candidate's output against the default's, and remembers the
//! winner in the tuner's store (`tune.json`, beside the other schemes' results).
//!
//! ```text
//! Tuner::tune_xquant(problem, d_model, precision)   synthetic batches (random latents over
//!                                                   synthetic projections), then:
//! Tuner::choose_xquant(problem, kernel, batches, q) policy as for the other schemes
//!   off    ─▶ kernel.default_splits(batch, max_len)
//!   cached ─▶ stored result, else the default
//!   full   ─▶ stored result, else tune now on `batches` and store:
//!        candidates: split_candidates around the default, at most one a tile
//!        pass 1: every candidate, a few runs, median (the rotation of `batches` defeats L2)
//!        gate:   fastest candidates vs the default's output (2e-3 f16 / 1e-2 bf16, no NaN)
//!        pass 2: correct finalists + default, interleaved rounds, median
//!        winner: fastest finalist, unless the default is within `min_gain` of it
//! ```

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaSlice, CudaStream};
use kvq_codegen::{has_xquant_kernel, xquant_tile, RebuildPrecision, TuneParams, XQuantKernels};
use serde::{Deserialize, Serialize};

use super::device_cache::XQuantDeviceCache;
use super::kernel::XQuantKernel;
use super::synth::synthetic_cache;
use super::XQuantScratch;
use crate::decode::Pieces;
use crate::error::{Result, RuntimeError};
use crate::timing::GpuTimer;
use crate::tune::check::gate_output;
use crate::tune::finalists::{fastest_finalists, passed, retime_interleaved};
use crate::tune::store::{checksum, unix_now};
use crate::tune::synth::random_queries;
use crate::tune::{
    coarse_runs_within, fine_runs_within, plan_copies, select_winner, split_candidates,
    CandidateResult, ChoiceSource, ProblemKey, TuneChoice, TuneEntry, TunePolicy, TuneProblem,
    Tuner, MAX_SPLITS, SPLIT_FACTORS,
};

/// The most splits the XQuant launch takes (its grid's x dimension; the decode refuses more).
pub const XQUANT_MAX_SPLITS: usize = 1024;

/// Interleaved rounds of the second pass (drift hits every finalist alike).
const FINE_ROUNDS: usize = 3;

/// What a stored XQuant result was measured with, for people reading `tune.json` and for the
/// store's validity check (matching uses the key, whose candidate checksum covers the same).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct XQuantTuned {
    /// Latent width `R` (from d_model and the KV heads' width).
    pub rank: usize,
    /// How K was rebuilt: the precision and the MMA form, e.g. `F16 Warpgroup`.
    pub rebuild: String,
}

/// What an XQuant tuning session measured and chose.
#[derive(Clone, Debug, PartialEq)]
pub struct XQuantTuneReport {
    /// The winning split count and its median, µs.
    pub chosen: usize,
    /// See `chosen`.
    pub chosen_us: f64,
    /// The default split count and its median in the same pass, µs.
    pub default: usize,
    /// See `default`.
    pub default_us: f64,
    /// Every split count timed (the default first).
    pub candidates: Vec<CandidateResult>,
    /// Wall-clock time of the session.
    pub elapsed: Duration,
    /// Where the result was saved (`None`: kept in memory only).
    pub saved_to: Option<PathBuf>,
}

impl XQuantTuneReport {
    /// Default time over tuned time.
    pub fn speedup(&self) -> f64 {
        self.default_us / self.chosen_us
    }

    /// Candidates discarded (failed to launch, or output off the default's).
    pub fn rejected(&self) -> usize {
        self.candidates
            .iter()
            .filter(|c| c.rejected.is_some())
            .count()
    }
}

/// The rebuild's precision and MMA form as stored and shown: `F16 Warpgroup`, `F32 Sync`.
pub fn rebuild_text(generated: &XQuantKernels) -> String {
    format!("{:?} {:?}", generated.precision, generated.mma)
}

/// `kernel`'s launch at `splits` in the store's and the reports' [`TuneChoice`] form: the
/// decode's threads and tile (fixed by the code generator) and the splits.
pub fn xquant_choice(kernel: &XQuantKernel, splits: usize) -> TuneChoice {
    let g = kernel.generated();
    TuneChoice {
        params: TuneParams {
            threads: g.decode.block,
            tile_tokens: xquant_tile(g.shape.head_dim),
            min_warps_per_sm: 0,
            // Not a choice of this kernel; set so the launch prints without "unpacked".
            pack_heads: true,
            short_staging: false,
            store_scores: false,
        },
        splits,
        pieces: Pieces::NONE,
    }
}

/// The split counts the tuner times around `default` for contexts of `max_len` tokens at the
/// kernel's `tile`: [`split_candidates`], never more splits than tiles (an empty split only
/// costs) nor than the launch takes.
pub fn xquant_split_candidates(default: usize, max_len: usize, tile: usize) -> Vec<usize> {
    let tiles = max_len.div_ceil(tile.max(1)).max(1);
    split_candidates(default, tiles.min(XQUANT_MAX_SPLITS))
}

/// Rejects problems `generated` cannot decode: another scheme or kernel shape, no XQuant decode
/// for the scheme, or no KV head, query head, sequence or token.
pub fn check_xquant_problem(problem: &TuneProblem, generated: &XQuantKernels) -> Result<()> {
    let spec = &problem.spec;
    if !has_xquant_kernel(spec) {
        return Err(RuntimeError::InvalidInput(format!(
            "`{spec}` has no XQuant decode (`source = x(latent)` or `x(cross_layer)` with plain \
             integer K and V latents)"
        )));
    }
    let (p, g) = (problem, generated);
    if p.kv_heads == 0 || p.batch == 0 || p.max_len == 0 || p.shape.gqa == 0 {
        return Err(RuntimeError::InvalidInput(format!(
            "tuning needs at least one KV head, query head, sequence and token (kv_heads {}, gqa \
             {}, batch {}, max_len {})",
            p.kv_heads, p.shape.gqa, p.batch, p.max_len
        )));
    }
    if g.shape != p.shape || g.scheme != spec.to_string() {
        return Err(RuntimeError::InvalidInput(format!(
            "the XQuant kernel decodes `{}` at {:?}, the problem is `{spec}` at {:?}",
            g.scheme, g.shape, p.shape
        )));
    }
    Ok(())
}

/// The store key of an XQuant problem decoded by `generated`: the decode problem's key with the
/// checksum of what sets the candidates and their times — the latent width, the rebuild's
/// precision and MMA form, the CTA's threads, the tile and the split multiples — prefixed `xq-`
/// (another rank, precision or kernel design, another key).
pub fn xquant_problem_key(problem: &TuneProblem, generated: &XQuantKernels) -> ProblemKey {
    // The threads and the KV heads a CTA follow the kernel's design (the warpgroup rebuild's
    // roles, heads paired or not): a split count tuned for an earlier design of the same rebuild
    // is not reused.
    let set = (
        "xquant",
        generated.rank,
        rebuild_text(generated),
        generated.decode.block,
        generated.kv_heads_per_cta,
        xquant_tile(generated.shape.head_dim),
        SPLIT_FACTORS,
        MAX_SPLITS,
    );
    let mut key = problem.key_with_candidates(checksum(
        serde_json::to_string(&set).unwrap_or_default().as_bytes(),
    ));
    key.candidates = format!("xq-{}", key.candidates);
    key
}

/// Device bytes one copy of `cache` reads: the latents' store and, for XQuant-CL, the
/// accumulator's latents (the projections are shared by every copy's CTAs and stay in L2).
pub fn xquant_cache_bytes(cache: &XQuantDeviceCache) -> u64 {
    let base = cache
        .base
        .as_ref()
        .map_or(0, |(k, v)| 2 * (k.len() + v.len()) as u64);
    cache.latent_bytes() as u64 + base
}

impl Tuner<'_> {
    /// The stored split count for `problem` decoded by `kernel` on this GPU, whatever the
    /// policy.
    pub fn xquant_lookup(&self, problem: &TuneProblem, kernel: &XQuantKernel) -> Option<usize> {
        let key = xquant_problem_key(problem, kernel.generated());
        let e = self.store().lookup(self.gpu(), &key)?;
        e.xquant.as_ref()?;
        Some(e.choice.splits)
    }

    /// The split count to decode `problem` with `kernel`, by policy (see the module docs); under
    /// `full` without a stored result, tuned now on `batches` (copies of one batch of the
    /// problem's shape, rotated so no run finds its cache in L2) with queries `q`.
    pub fn choose_xquant(
        &mut self,
        problem: &TuneProblem,
        kernel: &XQuantKernel,
        batches: &[&XQuantDeviceCache],
        q: &CudaSlice<u16>,
    ) -> Result<(usize, ChoiceSource)> {
        check_xquant_problem(problem, kernel.generated())?;
        if self.policy() != TunePolicy::Off {
            if let Some(splits) = self.xquant_lookup(problem, kernel) {
                return Ok((splits, ChoiceSource::Stored));
            }
        }
        if self.policy() != TunePolicy::Full {
            return Ok((
                kernel.default_splits(problem.batch, problem.max_len),
                ChoiceSource::Heuristic,
            ));
        }
        let report = self.tune_xquant_on(problem, kernel, batches, q)?;
        Ok((report.chosen, ChoiceSource::Tuned))
    }

    /// Tunes `problem` for a layer whose input is `d_model` wide with K rebuilt at `precision`,
    /// on synthetic inputs of its size, and stores the result, whatever the policy: one
    /// sequence of `max_len` random latents over synthetic projections
    /// ([`synthetic_cache`]), repeated `batch` times, in as many copies as keep the rotation
    /// past L2.
    pub fn tune_xquant(
        &mut self,
        problem: &TuneProblem,
        d_model: usize,
        precision: RebuildPrecision,
    ) -> Result<XQuantTuneReport> {
        let started = Instant::now();
        let (h, d) = (problem.kv_heads, problem.shape.head_dim as usize);
        let kernel = XQuantKernel::load(
            self.jit(),
            &problem.spec,
            &problem.shape,
            h,
            d_model,
            precision,
        )?;
        check_xquant_problem(problem, kernel.generated())?;
        let seed = self.options().seed;
        let one = synthetic_cache(&problem.spec, (h, d, d_model), problem.max_len, seed)?;
        let sequences = vec![one; problem.batch];
        let stream = self.jit().device().default_stream();
        let first = XQuantDeviceCache::upload(&stream, &sequences)?;
        let (free, _) = self
            .jit()
            .device()
            .context()
            .mem_get_info()
            .map_err(|e| RuntimeError::driver("cuMemGetInfo", e))?;
        let budget = self
            .options()
            .memory_budget
            .unwrap_or((free as u64) / 10 * 7);
        let copies = plan_copies(
            xquant_cache_bytes(&first),
            self.jit().device().props().l2_bytes,
            budget,
        )?;
        let mut batches = vec![first];
        for _ in 1..copies {
            batches.push(XQuantDeviceCache::upload(&stream, &sequences)?);
        }
        drop(sequences);
        let (q_words, _) = random_queries(
            problem.batch * problem.q_heads() * d,
            problem.shape.dtype,
            seed ^ 0x51ed,
        )?;
        let q = stream
            .clone_htod(&q_words)
            .map_err(|e| RuntimeError::driver("upload the tuning queries", e))?;
        let refs: Vec<&XQuantDeviceCache> = batches.iter().collect();
        let mut report = self.tune_xquant_on(problem, &kernel, &refs, &q)?;
        report.elapsed = started.elapsed();
        Ok(report)
    }

    /// Tunes `problem`'s split count for `kernel` on `batches` (rotated) with queries `q`, and
    /// stores the result, whatever the policy.
    pub fn tune_xquant_on(
        &mut self,
        problem: &TuneProblem,
        kernel: &XQuantKernel,
        batches: &[&XQuantDeviceCache],
        q: &CudaSlice<u16>,
    ) -> Result<XQuantTuneReport> {
        let started = Instant::now();
        check_xquant_problem(problem, kernel.generated())?;
        let first = batches
            .first()
            .ok_or_else(|| RuntimeError::InvalidInput("tuning on no batch".into()))?;
        problem.check_tuning_batch(first.batch(), first.max_len())?;
        let key = xquant_problem_key(problem, kernel.generated());
        let stream = self.jit().device().default_stream();
        let options = self.options().clone();
        let timer = GpuTimer::new(self.jit())?;
        let out_len = problem.batch * problem.q_heads() * problem.shape.head_dim as usize;
        let mut session = Session {
            stream: &stream,
            timer: &timer,
            kernel,
            batches,
            q,
            out: stream
                .alloc_zeros::<u16>(out_len)
                .map_err(|e| RuntimeError::driver("allocate the tuning output", e))?,
            scratch: XQuantScratch::new(&stream)?,
            next: 0,
        };
        let default = kernel.default_splits(problem.batch, problem.max_len);
        let tile = xquant_tile(problem.shape.head_dim) as usize;
        let splits: Vec<usize> = std::iter::once(default)
            .chain(
                xquant_split_candidates(default, problem.max_len, tile)
                    .into_iter()
                    .filter(|&s| s != default),
            )
            .collect();
        let want = session.output(default)?;
        let mut results: Vec<CandidateResult> = splits
            .iter()
            .map(|&s| CandidateResult {
                choice: xquant_choice(kernel, s),
                coarse_us: None,
                fine_us: None,
                error: None,
                rejected: None,
            })
            .collect();
        // Pass 1: the default first, its time sizing the others' runs to the time budget.
        let mut runs = options.coarse_runs;
        for (i, &s) in splits.iter().enumerate() {
            if i > 0 && started.elapsed() >= options.time_budget {
                results[i].rejected = Some("not timed: the time budget ran out".into());
                continue;
            }
            match session.time(s, options.warmup, runs) {
                Ok(us) => {
                    results[i].coarse_us = Some(us);
                    if i == 0 {
                        runs = coarse_runs_within(
                            options.time_budget.saturating_sub(started.elapsed()),
                            splits.len() - 1,
                            us,
                            options.warmup,
                            options.coarse_runs,
                        );
                    }
                }
                Err(e) => results[i].rejected = Some(e.to_string()),
            }
        }
        // Gate: the fastest candidates (and the default) against the default's output.
        let finalists = fastest_finalists(&results, options.finalists);
        for &i in &finalists {
            let got = session.output(splits[i]);
            gate_output(&mut results[i], got, &want, problem.shape.dtype, i == 0);
        }
        // Pass 2: the correct finalists, interleaved rounds.
        let live = passed(&results, &finalists);
        let slowest = live
            .iter()
            .filter_map(|&i| results[i].coarse_us)
            .fold(0.0, f64::max);
        let per_round = fine_runs_within(
            options.time_budget.saturating_sub(started.elapsed()),
            FINE_ROUNDS,
            live.len(),
            slowest,
            options.fine_runs.div_ceil(FINE_ROUNDS),
        );
        retime_interleaved(&mut results, &live, FINE_ROUNDS, |i| {
            session.time(splits[i], 1, per_round)
        });
        let winner = select_winner(&results, options.min_gain).ok_or_else(|| {
            RuntimeError::InvalidInput(format!(
                "no correct XQuant launch for `{}`: the default's {default} splits {}",
                problem.spec,
                results[0]
                    .rejected
                    .as_deref()
                    .unwrap_or("gave no usable timing")
            ))
        })?;
        let report_base = XQuantTuneReport {
            chosen: splits[winner],
            chosen_us: results[winner].fine_us.unwrap_or(f64::NAN),
            default,
            default_us: results[0].fine_us.unwrap_or(f64::NAN),
            candidates: results,
            elapsed: started.elapsed(),
            saved_to: None,
        };
        let entry = TuneEntry {
            gpu: self.gpu().clone(),
            problem: key,
            scheme: problem.spec.to_string(),
            choice: xquant_choice(kernel, report_base.chosen),
            tuned_us: report_base.chosen_us,
            default_us: report_base.default_us,
            measured_batch: problem.batch,
            measured_len: first.max_len(),
            candidates: report_base.candidates.len(),
            rejected: report_base.rejected(),
            tuned_at_unix: unix_now(),
            kvq_version: env!("CARGO_PKG_VERSION").into(),
            codebook: None,
            xquant: Some(XQuantTuned {
                rank: kernel.generated().rank,
                rebuild: rebuild_text(kernel.generated()),
            }),
        };
        let saved_to = self.store_entry(entry);
        Ok(XQuantTuneReport {
            saved_to,
            ..report_base
        })
    }
}

/// A tuning session's buffers: the kernel, the rotation of batches, the queries, an output and
/// the split partials.
struct Session<'s> {
    stream: &'s Arc<CudaStream>,
    timer: &'s GpuTimer,
    kernel: &'s XQuantKernel,
    batches: &'s [&'s XQuantDeviceCache],
    q: &'s CudaSlice<u16>,
    out: CudaSlice<u16>,
    scratch: XQuantScratch,
    next: usize,
}

impl Session<'_> {
    /// The median device time of `runs` decodes at `splits`, µs.
    fn time(&mut self, splits: usize, warmup: usize, runs: usize) -> Result<f64> {
        let (kernel, batches, q, out, scratch, next) = (
            self.kernel,
            self.batches,
            self.q,
            &mut self.out,
            &mut self.scratch,
            &mut self.next,
        );
        let t = self.timer.time(self.stream, warmup, runs.max(1), |s| {
            *next = (*next + 1) % batches.len();
            kernel.attend(s, batches[*next], q, out, splits, scratch)
        })?;
        Ok(t.median_us())
    }

    /// One decode of the first batch at `splits`, its output downloaded (NaN-poisoned first).
    fn output(&mut self, splits: usize) -> Result<Vec<u16>> {
        let poison = vec![0x7e00u16; self.out.len()];
        self.stream
            .memcpy_htod(&poison, &mut self.out)
            .map_err(|e| RuntimeError::driver("poison the tuning output", e))?;
        self.kernel.attend(
            self.stream,
            self.batches[0],
            self.q,
            &mut self.out,
            splits,
            &mut self.scratch,
        )?;
        self.stream
            .clone_dtoh(&self.out)
            .map_err(|e| RuntimeError::driver("download the tuning output", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvq_codegen::{xquant_kernels, Dtype, KernelShape, RebuildMma};
    use kvq_spec::SchemeSpec;

    fn xquant2() -> SchemeSpec {
        "k = int(2, channel), v = int(2, token), source = x(latent)"
            .parse()
            .unwrap()
    }

    fn generated(spec: &SchemeSpec, d_model: u32, precision: RebuildPrecision) -> XQuantKernels {
        let shape = KernelShape::new(128, 4, Dtype::F16);
        let mma = RebuildMma::best(spec, &shape, (8, d_model), precision, false);
        xquant_kernels(spec, &shape, 8, d_model, (precision, mma)).unwrap()
    }

    fn problem(spec: SchemeSpec, batch: usize, len: usize) -> TuneProblem {
        TuneProblem::new(spec, KernelShape::new(128, 4, Dtype::F16), 8, batch, len)
    }

    #[test]
    fn keys_follow_rank_precision_and_buckets_not_d_model_past_the_rank() {
        let spec = xquant2();
        let g = generated(&spec, 4096, RebuildPrecision::F16);
        let key = xquant_problem_key(&problem(spec, 9, 20_000), &g);
        assert!(key.candidates.starts_with("xq-"), "{key}");
        assert_eq!((key.batch_bucket, key.context_bucket), (16, 32_768));
        // Same bucket, and d_model 2,048 gives the same latents of 1,024: one key.
        let same = generated(&spec, 2048, RebuildPrecision::F16);
        assert_eq!(xquant_problem_key(&problem(spec, 16, 32_768), &same), key);
        // Another precision, rank, scheme or bucket: another key, and never an integer key.
        for (p, g) in [
            (
                problem(spec, 16, 32_768),
                generated(&spec, 4096, RebuildPrecision::F32),
            ),
            (
                problem(spec, 16, 32_768),
                generated(&spec, 512, RebuildPrecision::F16),
            ),
            (problem(spec, 17, 32_768), g.clone()),
            (problem(spec, 16, 32_769), g.clone()),
        ] {
            assert_ne!(xquant_problem_key(&p, &g), key, "{p:?}");
        }
        let x4: SchemeSpec = "k = int(4, channel), v = int(4, token), source = x(latent)"
            .parse()
            .unwrap();
        let g4 = generated(&x4, 4096, RebuildPrecision::F16);
        assert_ne!(xquant_problem_key(&problem(x4, 16, 32_768), &g4), key);
        // The warpgroup decode with its KV heads paired, and the same decode one head a CTA
        // (its grid has twice the CTAs): split counts tuned for one are not the other's.
        let shape = KernelShape::new(128, 4, Dtype::F16);
        let paired = xquant_kernels(
            &spec,
            &shape,
            8,
            4096,
            (RebuildPrecision::F16, RebuildMma::Warpgroup),
        )
        .unwrap();
        assert_eq!(paired.kv_heads_per_cta, 2);
        let single = XQuantKernels {
            kv_heads_per_cta: 1,
            ..paired.clone()
        };
        let p = problem(spec, 16, 32_768);
        assert_ne!(
            xquant_problem_key(&p, &paired),
            xquant_problem_key(&p, &single)
        );
        assert_ne!(
            problem(spec, 16, 32_768).key_with_candidates(String::new()),
            key
        );
    }

    #[test]
    fn candidates_stay_within_the_tiles_and_keep_the_default() {
        // B=1 on 132 SMs and 8 KV heads: 16 splits by default.
        assert_eq!(
            xquant_split_candidates(16, 32_768, 128),
            [8, 12, 16, 24, 32, 48, 64]
        );
        // B=16: one split; never more splits than 4K tokens have tiles of 128 (32).
        assert_eq!(xquant_split_candidates(1, 4096, 128), [1, 2, 3, 4]);
        assert_eq!(xquant_split_candidates(16, 300, 128), [3]);
        assert_eq!(xquant_split_candidates(4, 1, 128), [1]);
        for (d, len) in [(16usize, 32_768usize), (1, 4096), (7, 1000), (40, 200_000)] {
            let c = xquant_split_candidates(d, len, 128);
            let most = len.div_ceil(128).min(MAX_SPLITS);
            assert!(c.contains(&d.clamp(1, most)), "{d} {len} {c:?}");
            assert!(c.iter().all(|&s| (1..=most).contains(&s)), "{c:?}");
            assert!(c.windows(2).all(|w| w[0] < w[1]), "{c:?}");
        }
    }

    #[test]
    fn problems_the_kernel_does_not_decode_are_refused() {
        let spec = xquant2();
        let g = generated(&spec, 4096, RebuildPrecision::F16);
        assert!(check_xquant_problem(&problem(spec, 1, 100), &g).is_ok());
        let kivi: SchemeSpec = "k = int(2, channel), v = int(2, token)".parse().unwrap();
        let e = check_xquant_problem(&problem(kivi, 1, 100), &g).unwrap_err();
        assert!(e.to_string().contains("no XQuant decode"), "{e}");
        let x4: SchemeSpec = "k = int(4, channel), v = int(4, token), source = x(latent)"
            .parse()
            .unwrap();
        let e = check_xquant_problem(&problem(x4, 1, 100), &g).unwrap_err();
        assert!(e.to_string().contains("the XQuant kernel decodes"), "{e}");
        for p in [problem(spec, 0, 100), problem(spec, 1, 0)] {
            assert!(check_xquant_problem(&p, &g).is_err(), "{p:?}");
        }
        let other_shape = TuneProblem::new(spec, KernelShape::new(64, 4, Dtype::F16), 8, 1, 100);
        assert!(check_xquant_problem(&other_shape, &g).is_err());
    }
}
