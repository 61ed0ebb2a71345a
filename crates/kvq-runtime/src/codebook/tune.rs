//! Tuning a codebook scheme's decode: which launch shape ([`CodebookParams`]: threads, tile, the
//! key codebook in shared memory or not) and split count decode a batch fastest, on the caller's
//! batch, each candidate's output checked against the default's, the winner remembered per GPU
//! and problem in the tuner's store (`tune.json`, beside the integer schemes' results).
//!
//! ```text
//! Tuner::tune_codebook(problem)                 synthetic batches (codebooks trained briefly,
//!                                               a random sequence coded on the GPU), then:
//! Tuner::choose_codebook(problem, batches, q)   policy as for the integer schemes
//!   off    ─▶ the default launch                CodebookParams::default_for + default_splits
//!   cached ─▶ stored result, else the default
//!   full   ─▶ stored result, else tune now on `batches` and store:
//!        candidates: codebook_candidates × split counts around each one's default
//!        pass 1: every candidate, a few runs, median (the rotation of `batches` defeats L2)
//!        gate:   fastest candidates vs the default's output (2e-3 f16 / 1e-2 bf16, no NaN)
//!        pass 2: correct finalists + default, interleaved rounds, median
//!        winner: fastest finalist, unless the default is within `min_gain` of it
//! ```

use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use kvq_codegen::{codebook_candidates, CodebookParams, TuneParams};

use kvq_reference::commvq::{self, CalibrationData, TrainOptions};
use kvq_reference::rope::Rope;

use super::cache::CodebookCache;
use super::decode::{CodebookKernel, CodebookScratch};
use super::encode::{input_words, CodebookEncoder, EncodeInputs};
use crate::error::{Result, RuntimeError};
use crate::timing::GpuTimer;
use crate::tune::check::gate_output;
use crate::tune::finalists::{fastest_finalists, passed, retime_interleaved};
use crate::tune::plan_copies;
use crate::tune::store::{checksum, unix_now};
use crate::tune::synth::{random_kv, random_queries};
use crate::tune::{
    select_winner, split_candidates, CandidateResult, ChoiceSource, ProblemKey, TuneChoice,
    TuneEntry, TunePolicy, TuneProblem, Tuner, SPLIT_FACTORS,
};

/// Tokens of the synthetic K/V a tuning session trains its codebooks on.
const SYNTHETIC_CALIBRATION: usize = 1024;

/// A codebook decode's launch: its kernel's shape and the split count.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CodebookLaunch {
    /// The kernel.
    pub params: CodebookParams,
    /// Split-K partitions per (sequence, KV head).
    pub splits: usize,
}

impl std::fmt::Display for CodebookLaunch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "threads {} tile {}{} splits {}",
            self.params.threads,
            self.params.tile,
            if self.params.book_in_shared_memory {
                " codebook in shared memory"
            } else {
                ""
            },
            self.splits
        )
    }
}

/// What a codebook tuning session measured and chose.
#[derive(Clone, Debug, PartialEq)]
pub struct CodebookTuneReport {
    /// The winner and its median, µs.
    pub chosen: CodebookLaunch,
    /// See `chosen`.
    pub chosen_us: f64,
    /// The default launch and its median in the same pass, µs.
    pub default: CodebookLaunch,
    /// See `default`.
    pub default_us: f64,
    /// Launches timed, and of them discarded (failed to build or launch, or wrong output).
    pub candidates: usize,
    /// See `candidates`.
    pub rejected: usize,
    /// Where the result was saved (`None`: kept in memory only).
    pub saved_to: Option<PathBuf>,
}

impl CodebookTuneReport {
    /// Default time over tuned time.
    pub fn speedup(&self) -> f64 {
        self.default_us / self.chosen_us
    }
}

/// The store key of a codebook problem: the integer schemes' key with the checksum of the codebook
/// candidate set (another set, another key).
pub fn codebook_problem_key(problem: &TuneProblem) -> Result<ProblemKey> {
    let set = (
        "codebook",
        codebook_candidates(&problem.spec, &problem.shape)?,
        SPLIT_FACTORS,
    );
    let mut key = problem.key_with_candidates(checksum(
        serde_json::to_string(&set).unwrap_or_default().as_bytes(),
    ));
    key.candidates = format!("cb-{}", key.candidates);
    Ok(key)
}

/// The default launch of `problem` for a batch of `batch` sequences of at most `max_len` tokens.
pub fn default_codebook_launch(
    tuner: &Tuner<'_>,
    problem: &TuneProblem,
) -> Result<(CodebookLaunch, CodebookKernel)> {
    let params = CodebookParams::default_for(&problem.spec, &problem.shape)?;
    let kernel = CodebookKernel::load_with(
        tuner.jit(),
        &problem.spec,
        &problem.shape,
        problem.kv_heads,
        &params,
    )?;
    let splits = kernel.default_splits(problem.batch, problem.max_len);
    Ok((CodebookLaunch { params, splits }, kernel))
}

impl Tuner<'_> {
    /// The stored codebook launch for `problem` on this GPU, whatever the policy.
    pub fn codebook_lookup(&self, problem: &TuneProblem) -> Option<CodebookLaunch> {
        let key = codebook_problem_key(problem).ok()?;
        let e = self.store().lookup(self.gpu(), &key)?;
        Some(CodebookLaunch {
            params: e.codebook?,
            splits: e.choice.splits,
        })
    }

    /// The launch to decode `problem` with, by policy (see the module docs); under `full`
    /// without a stored result, tuned now on `batches` (copies of one batch of the problem's
    /// shape, rotated so no run finds its cache in L2) with queries `q`.
    pub fn choose_codebook(
        &mut self,
        problem: &TuneProblem,
        batches: &[&CodebookCache],
        q: &CudaSlice<u16>,
    ) -> Result<(CodebookLaunch, ChoiceSource)> {
        problem.check()?;
        if self.policy() != TunePolicy::Off {
            if let Some(l) = self.codebook_lookup(problem) {
                return Ok((l, ChoiceSource::Stored));
            }
        }
        if self.policy() != TunePolicy::Full {
            return Ok((
                default_codebook_launch(self, problem)?.0,
                ChoiceSource::Heuristic,
            ));
        }
        let report = self.tune_codebook_on(problem, batches, q)?;
        Ok((report.chosen, ChoiceSource::Tuned))
    }

    /// Tunes `problem` on synthetic inputs of its size and stores the result, whatever the
    /// policy: codebooks trained briefly on random K/V (decode time does not depend on their
    /// quality), one random sequence of `max_len` tokens coded on the GPU into every slot of as
    /// many batches as keep the rotation past L2.
    pub fn tune_codebook(&mut self, problem: &TuneProblem) -> Result<CodebookTuneReport> {
        problem.check()?;
        let (h, d) = (problem.kv_heads, problem.shape.head_dim as usize);
        let seed = self.options().seed;
        let (k, v) = random_kv(h, problem.max_len, d, seed)?;
        let n = k.tokens.min(SYNTHETIC_CALIBRATION);
        let (kc, vc) = (k.prefix(n), v.prefix(n));
        let data = CalibrationData {
            k_pre_rope: &kc,
            v: &vc,
            rope: Rope::default(),
        };
        let books = commvq::train_with(&problem.spec, &data, &TrainOptions::quick(seed))
            .map_err(|e| RuntimeError::InvalidInput(format!("codebooks for tuning: {e}")))?;
        let dtype = problem.shape.dtype;
        let encoder = CodebookEncoder::load(self.jit(), &problem.spec, &books, d, h, dtype)?;
        let stream = self.jit().device().default_stream();
        let upload = |w: Vec<u16>| {
            stream
                .clone_htod(&w)
                .map_err(|e| RuntimeError::driver("upload the tuning K/V", e))
        };
        let (k_dev, v_dev) = (
            upload(input_words(&k, dtype))?,
            upload(input_words(&v, dtype))?,
        );
        drop((k, v));
        let inputs = EncodeInputs {
            k_pre_rope: &k_dev,
            k_post_rope: &k_dev,
            v: &v_dev,
            tokens: problem.max_len,
        };
        let fill = |cache: &mut CodebookCache| -> Result<()> {
            for slot in 0..problem.batch {
                encoder.append(&stream, cache, slot, &inputs)?;
            }
            Ok(())
        };
        let mut first = encoder.new_cache(&stream, problem.batch, problem.max_len, 10_000.0)?;
        fill(&mut first)?;
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
            first.cache_bytes() as u64,
            self.jit().device().props().l2_bytes,
            budget,
        )?;
        let mut batches = vec![first];
        for _ in 1..copies {
            let mut c = encoder.new_cache(&stream, problem.batch, problem.max_len, 10_000.0)?;
            fill(&mut c)?;
            batches.push(c);
        }
        let (q_words, _) =
            random_queries(problem.batch * problem.q_heads() * d, dtype, seed ^ 0x51ed)?;
        let q = upload(q_words)?;
        let refs: Vec<&CodebookCache> = batches.iter().collect();
        self.tune_codebook_on(problem, &refs, &q)
    }

    /// Tunes `problem` on `batches` and stores the result, whatever the policy.
    pub fn tune_codebook_on(
        &mut self,
        problem: &TuneProblem,
        batches: &[&CodebookCache],
        q: &CudaSlice<u16>,
    ) -> Result<CodebookTuneReport> {
        problem.check()?;
        let first = batches
            .first()
            .ok_or_else(|| RuntimeError::InvalidInput("tuning on no batch".into()))?;
        problem.check_tuning_batch(first.batch(), first.max_tokens())?;
        let key = codebook_problem_key(problem)?;
        let stream = self.jit().device().default_stream();
        let options = self.options().clone();
        let timer = GpuTimer::new(self.jit())?;
        let out_len = problem.batch * problem.q_heads() * problem.shape.head_dim as usize;
        let mut session = Session {
            stream: &stream,
            timer: &timer,
            batches,
            q,
            out: stream
                .alloc_zeros::<u16>(out_len)
                .map_err(|e| RuntimeError::driver("allocate the tuning output", e))?,
            scratch: CodebookScratch::new(&stream)?,
            next: 0,
        };
        // The candidates, the default launch shape first (codebook_candidates' order): every
        // launch shape × split counts around its own default.
        let mut kernels: Vec<(CodebookParams, std::result::Result<CodebookKernel, String>)> =
            Vec::new();
        for params in codebook_candidates(&problem.spec, &problem.shape)? {
            let k = CodebookKernel::load_with(
                self.jit(),
                &problem.spec,
                &problem.shape,
                problem.kv_heads,
                &params,
            );
            kernels.push((params, k.map_err(|e| e.to_string())));
        }
        let default_kernel = match kernels.first() {
            Some((_, Ok(k))) => k,
            Some((_, Err(e))) => {
                return Err(RuntimeError::InvalidInput(format!(
                    "the default codebook decode does not build: {e}"
                )))
            }
            None => {
                return Err(RuntimeError::InvalidInput(
                    "no codebook launch shape".into(),
                ))
            }
        };
        let default = CodebookLaunch {
            params: kernels[0].0,
            splits: default_kernel.default_splits(problem.batch, problem.max_len),
        };
        let want = session.output(default_kernel, default.splits)?;
        let mut launches: Vec<(CodebookLaunch, Option<usize>, Option<String>)> =
            vec![(default, Some(0), None)];
        for (i, (params, k)) in kernels.iter().enumerate() {
            match k {
                Ok(k) => {
                    let most = problem.max_len.div_ceil(k.generated().tile as usize).max(1);
                    for splits in
                        split_candidates(k.default_splits(problem.batch, problem.max_len), most)
                    {
                        let l = CodebookLaunch {
                            params: *params,
                            splits,
                        };
                        if l != default {
                            launches.push((l, Some(i), None));
                        }
                    }
                }
                Err(e) => launches.push((
                    CodebookLaunch {
                        params: *params,
                        splits: 1,
                    },
                    None,
                    Some(e.clone()),
                )),
            }
        }
        // A launch's kernel: `kernels[slot]` (the default launch's is kernels[0]).
        let kernel_of = |slot: Option<usize>| -> Option<&CodebookKernel> {
            kernels.get(slot?)?.1.as_ref().ok()
        };
        let mut results: Vec<CandidateResult> = Vec::with_capacity(launches.len());
        for (l, slot, rejected) in &launches {
            let mut r = CandidateResult {
                choice: as_choice(l),
                coarse_us: None,
                fine_us: None,
                error: None,
                rejected: rejected.clone(),
            };
            if r.rejected.is_none() {
                match kernel_of(*slot) {
                    Some(k) => match session.time(k, l.splits, options.warmup, options.coarse_runs)
                    {
                        Ok(us) => r.coarse_us = Some(us),
                        Err(e) => r.rejected = Some(e.to_string()),
                    },
                    None => r.rejected = Some("no kernel".into()),
                }
            }
            results.push(r);
        }
        // Gate: the fastest candidates (and the default) against the default's output.
        let finalists = fastest_finalists(&results, options.finalists);
        for &i in &finalists {
            let (l, slot, _) = &launches[i];
            let Some(k) = kernel_of(*slot) else {
                continue;
            };
            let got = session.output(k, l.splits);
            gate_output(&mut results[i], got, &want, problem.shape.dtype, i == 0);
        }
        // Pass 2: the correct finalists (each with a kernel: the gate ran it), interleaved rounds.
        let live = passed(&results, &finalists);
        let rounds = 3usize;
        let per_round = options.fine_runs.div_ceil(rounds).max(3);
        retime_interleaved(&mut results, &live, rounds, |i| {
            let (l, slot, _) = &launches[i];
            match kernel_of(*slot) {
                Some(k) => session.time(k, l.splits, 1, per_round),
                None => Err(RuntimeError::InvalidInput("no kernel".into())),
            }
        });
        let winner = select_winner(&results, options.min_gain).unwrap_or(0);
        let chosen = launches[winner].0;
        let chosen_us = results[winner].fine_us.unwrap_or(f64::NAN);
        let default_us = results[0].fine_us.unwrap_or(f64::NAN);
        let rejected = results.iter().filter(|r| r.rejected.is_some()).count();
        let entry = TuneEntry {
            gpu: self.gpu().clone(),
            problem: key,
            scheme: problem.spec.to_string(),
            choice: as_choice(&chosen),
            tuned_us: chosen_us,
            default_us,
            measured_batch: problem.batch,
            measured_len: problem.max_len,
            candidates: results.len(),
            rejected,
            tuned_at_unix: unix_now(),
            kvq_version: env!("CARGO_PKG_VERSION").into(),
            codebook: Some(chosen.params),
            xquant: None,
        };
        let saved_to = self.store_entry(entry);
        Ok(CodebookTuneReport {
            chosen,
            chosen_us,
            default,
            default_us,
            candidates: results.len(),
            rejected,
            saved_to,
        })
    }
}

impl CodebookLaunch {
    /// This launch in the store's and the reports' [`TuneChoice`] form: threads and tile in the
    /// block parameters (the rest unused), and the splits.
    pub fn as_tune_choice(&self) -> TuneChoice {
        as_choice(self)
    }
}

fn as_choice(l: &CodebookLaunch) -> TuneChoice {
    TuneChoice {
        params: TuneParams {
            threads: l.params.threads,
            tile_tokens: l.params.tile,
            min_warps_per_sm: 0,
            pack_heads: false,
            short_staging: false,
            store_scores: false,
        },
        splits: l.splits,
        pieces: Default::default(),
    }
}

/// A tuning session's buffers: the rotation of batches, the queries, an output and the partials.
struct Session<'s> {
    stream: &'s Arc<CudaStream>,
    timer: &'s GpuTimer,
    batches: &'s [&'s CodebookCache],
    q: &'s CudaSlice<u16>,
    out: CudaSlice<u16>,
    scratch: CodebookScratch,
    next: usize,
}

impl Session<'_> {
    /// The median device time of `runs` decodes with `kernel` and `splits`, µs.
    fn time(
        &mut self,
        kernel: &CodebookKernel,
        splits: usize,
        warmup: usize,
        runs: usize,
    ) -> Result<f64> {
        let (batches, q, out, scratch, next) = (
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

    /// One decode of the first batch, its output downloaded (NaN-poisoned first).
    fn output(&mut self, kernel: &CodebookKernel, splits: usize) -> Result<Vec<u16>> {
        let poison = vec![0x7e00u16; self.out.len()];
        self.stream
            .memcpy_htod(&poison, &mut self.out)
            .map_err(|e| RuntimeError::driver("poison the tuning output", e))?;
        kernel.attend(
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
