//! One tuning session: compile every candidate's kernel, time them all, check the fastest against
//! the CPU reference, re-time the correct finalists and choose (see the module docs of
//! [`tune`](super) for the steps and [`Tuner`](super::Tuner) for what calls it).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::CudaStream;
use kvq_codegen::TuneParams;
use kvq_reference::int::IntCache;

use super::check::{default_rows, ReferenceCheck};
use super::choice::{candidates, TuneChoice};
use super::key::{GpuKey, TuneProblem};
use super::progress::Progress;
use super::rotate::{batch_device_bytes, plan_copies, RotatingBatch};
use super::synth::random_queries;
use super::tuner::{
    coarse_runs_within, fine_runs_within, occupancy_kernel, residency, select_winner,
    CandidateResult, TuneOptions, TuneReport,
};
use crate::decode::{DecodeKernel, DecodeScratch, Pieces};
use crate::error::{Result, RuntimeError};
use crate::jit::Jit;
use crate::timing::{GpuTimer, Timing};

/// Each block shape's kernel, or why it does not build.
type Kernels = HashMap<TuneParams, std::result::Result<DecodeKernel, String>>;

/// Interleaved rounds of the second pass, so drift hits every finalist alike.
const FINE_ROUNDS: usize = 3;

/// One tuning session's state.
pub(super) struct Session<'a> {
    jit: &'a Jit,
    options: &'a TuneOptions,
    problem: &'a TuneProblem,
    started: Instant,
    progress: Progress,
}

/// A candidate under evaluation: its result so far and its second-pass samples.
struct Entry {
    result: CandidateResult,
    samples: Vec<f64>,
}

/// What the timing and checking steps share: the compiled kernels, the batch's rotating device
/// copies with their stream and timer, and a scratch per split and piece count.
struct Bench<'a> {
    problem: &'a TuneProblem,
    kernels: Kernels,
    stream: Arc<CudaStream>,
    batch: RotatingBatch,
    timer: GpuTimer,
    scratches: HashMap<(usize, Pieces), DecodeScratch>,
}

impl Bench<'_> {
    fn kernel(&self, choice: &TuneChoice) -> Option<&DecodeKernel> {
        self.kernels.get(&choice.params)?.as_ref().ok()
    }

    /// Times `runs` decodes of `choice` after `warmup` untimed ones, rotating over the copies.
    /// `Ok(None)`: its kernel did not build.
    fn time(&mut self, choice: &TuneChoice, warmup: usize, runs: usize) -> Result<Option<Timing>> {
        let Some(Ok(kernel)) = self.kernels.get(&choice.params) else {
            return Ok(None);
        };
        let scratch = scratch_for(&mut self.scratches, &self.stream, self.problem, choice)?;
        let batch = &mut self.batch;
        self.timer
            .time(&self.stream, warmup, runs, |s| {
                batch.attend_next(s, kernel, scratch)
            })
            .map(Some)
    }

    /// One decode of `choice` into poisoned outputs, read back. `Ok(None)`: its kernel did not
    /// build.
    fn run_checked(&mut self, choice: &TuneChoice) -> Result<Option<Vec<u16>>> {
        let Some(Ok(kernel)) = self.kernels.get(&choice.params) else {
            return Ok(None);
        };
        let scratch = scratch_for(&mut self.scratches, &self.stream, self.problem, choice)?;
        self.batch
            .run_checked(0, &self.stream, kernel, scratch)
            .map(Some)
    }
}

impl<'a> Session<'a> {
    pub(super) fn new(
        jit: &'a Jit,
        options: &'a TuneOptions,
        problem: &'a TuneProblem,
        started: Instant,
    ) -> Self {
        let label = format!(
            "tuning {} B={} L={}",
            problem.spec, problem.batch, problem.max_len
        );
        Session {
            jit,
            options,
            problem,
            started,
            progress: Progress::new(1, label, options.progress),
        }
    }

    pub(super) fn run(&mut self, sequences: &[&IntCache], gpu: &GpuKey) -> Result<TuneReport> {
        let p = self.problem;
        let sm_count = self.jit.device().props().sm_count as usize;
        let occupancy = occupancy_kernel(self.jit, p, sm_count)?;
        let all = candidates(p, residency(self.jit, &occupancy)?);
        let default = all[0];
        let mut params: Vec<TuneParams> = Vec::new();
        for c in &all {
            if !params.contains(&c.params) {
                params.push(c.params);
            }
        }
        let finalists = self.options.finalists.max(1);
        self.progress
            .set_total((params.len() + all.len() + 2 * (finalists + 1)) as u64);

        // 1. Compile every block shape, in parallel (NVRTC is the slow part).
        self.progress.phase("compiling");
        let kernels = self.compile(&params);
        let mut entries: Vec<Entry> = all
            .iter()
            .map(|&choice| Entry {
                result: CandidateResult {
                    choice,
                    coarse_us: None,
                    fine_us: None,
                    error: None,
                    rejected: kernels
                        .get(&choice.params)
                        .and_then(|k| k.as_ref().err().cloned()),
                },
                samples: Vec::new(),
            })
            .collect();
        if let Some(why) = &entries[0].result.rejected {
            return Err(RuntimeError::InvalidInput(format!(
                "the default configuration ({default}) does not compile: {why}"
            )));
        }

        // 2. The batch, in enough copies to defeat L2, within the memory budget.
        self.progress.phase("uploading");
        let queries =
            kvq_reference::resources::product(&[p.batch, p.q_heads(), p.shape.head_dim as usize])
                .unwrap_or(usize::MAX);
        let (q_bits, q_vals) = random_queries(queries, p.shape.dtype, self.options.seed)?;
        let mut bench = self.upload(sequences, &q_bits, kernels)?;

        // 3. First pass: every candidate, default first, with run counts fitted to 60% of the
        // time budget; the CPU reference (seconds at long contexts) is computed meanwhile.
        self.progress.phase("timing candidates");
        let rows = default_rows(p.batch);
        let (truncated, reference) = std::thread::scope(|s| -> Result<_> {
            let reference = s.spawn(|| {
                ReferenceCheck::new(sequences, &q_vals, p.q_heads(), p.shape.dtype, &rows)
            });
            let truncated = self.time_all(&mut bench, &mut entries)?;
            let reference = reference.join().unwrap_or_else(|_| {
                Err(RuntimeError::InvalidInput(
                    "the reference thread panicked".into(),
                ))
            });
            Ok((truncated, reference))
        })?;
        let reference = reference?;

        // 4. Correctness gate: the fastest candidates (and the default) against the reference,
        // until `finalists` have passed.
        self.progress.phase("checking against the CPU reference");
        let passed = self.check_fastest(&mut bench, &mut entries, &reference, finalists)?;

        // 5. Second pass: finalists re-timed in interleaved rounds.
        self.progress.phase("re-timing finalists");
        self.retime(&mut bench, &mut entries, &passed)?;

        // 6. The fastest correct finalist, unless the (correct) default is within noise of it.
        let results: Vec<CandidateResult> = entries.into_iter().map(|e| e.result).collect();
        let best = select_winner(&results, self.options.min_gain).ok_or_else(|| {
            RuntimeError::InvalidInput(format!("autotune of `{}`: no finalist was timed", p.spec))
        })?;
        let default_us = results[0]
            .fine_us
            .or(results[0].coarse_us)
            .unwrap_or(f64::NAN);
        self.progress.finish();
        Ok(TuneReport {
            gpu: gpu.clone(),
            problem: p.key(),
            scheme: p.spec.to_string(),
            measured_batch: p.batch,
            measured_len: p.max_len,
            chosen: results[best].choice,
            chosen_us: results[best].fine_us.unwrap_or(f64::NAN),
            default,
            default_us,
            candidates: results,
            copies: bench.batch.copies(),
            truncated,
            elapsed: self.started.elapsed(),
            saved_to: None,
        })
    }

    /// Loads the kernels of every block shape on all cores; a shape that fails to build is
    /// recorded (its candidates are discarded), not fatal.
    fn compile(&self, params: &[TuneParams]) -> Kernels {
        let threads = std::thread::available_parallelism()
            .map_or(4, |n| n.get())
            .clamp(1, params.len().max(1));
        let chunk = params.len().div_ceil(threads).max(1);
        let (jit, p) = (self.jit, self.problem);
        let results: Vec<(TuneParams, std::result::Result<DecodeKernel, String>)> =
            std::thread::scope(|s| {
                let handles: Vec<_> = params
                    .chunks(chunk)
                    .map(|part| {
                        s.spawn(move || {
                            part.iter()
                                .map(|t| {
                                    let k = DecodeKernel::load_with(
                                        jit,
                                        &p.spec,
                                        &p.shape,
                                        t,
                                        crate::decode::LoadOptions::ALLOW_SLOW_PATH,
                                    )
                                    .map_err(|e| format!("does not build: {e}"));
                                    (*t, k)
                                })
                                .collect::<Vec<_>>()
                        })
                    })
                    .collect();
                handles
                    .into_iter()
                    .flat_map(|h| h.join().unwrap_or_default())
                    .collect()
            });
        self.progress.advance(params.len() as u64);
        let mut map: Kernels = results.into_iter().collect();
        for t in params {
            map.entry(*t)
                .or_insert_with(|| Err("the compile thread panicked".into()));
        }
        map
    }

    /// Uploads the batch with queries `q_bits` in as many copies as fit the memory budget (70% of
    /// free device memory unless the options say otherwise) and a round over them reads past L2.
    fn upload(
        &self,
        sequences: &[&IntCache],
        q_bits: &[u16],
        kernels: Kernels,
    ) -> Result<Bench<'a>> {
        let device = self.jit.device();
        let stream = device.default_stream();
        let budget = match self.options.memory_budget {
            Some(b) => b,
            None => {
                let (free, _) = device
                    .context()
                    .mem_get_info()
                    .map_err(|e| RuntimeError::driver("cuMemGetInfo", e))?;
                (free as u64 / 10) * 7
            }
        };
        let per_copy = batch_device_bytes(sequences, self.problem.q_heads());
        let copies = plan_copies(per_copy, device.props().l2_bytes, budget)?;
        let batch = RotatingBatch::upload(&stream, sequences, q_bits, copies)?;
        Ok(Bench {
            problem: self.problem,
            kernels,
            timer: GpuTimer::new(self.jit)?,
            stream,
            batch,
            scratches: HashMap::new(),
        })
    }

    /// The first pass: each candidate's coarse median, default first, until 60% of the time
    /// budget is spent (then `true`: the rest stay untimed). The default's time fits the run
    /// count of the others to that budget; a failing default launch fails the session.
    fn time_all(&mut self, bench: &mut Bench, entries: &mut [Entry]) -> Result<bool> {
        let pass1_end = self.options.time_budget.mul_f64(0.6);
        let (mut warmup, mut runs) = (self.options.warmup, self.options.coarse_runs.max(1));
        let total = entries.len();
        for (i, entry) in entries.iter_mut().enumerate() {
            self.progress.advance(1);
            if entry.result.rejected.is_some() {
                continue;
            }
            if i > 0 && self.started.elapsed() > pass1_end {
                return Ok(true);
            }
            match bench.time(&entry.result.choice, warmup, runs) {
                Ok(Some(t)) => entry.result.coarse_us = Some(t.median_us()),
                Ok(None) => continue,
                Err(e) if i == 0 => return Err(e),
                Err(e) => entry.result.rejected = Some(format!("launch failed: {e}")),
            }
            if i == 0 {
                let left = pass1_end.saturating_sub(self.started.elapsed());
                let fitted = coarse_runs_within(
                    left,
                    total - 1,
                    entry.result.coarse_us.unwrap_or(0.0),
                    warmup,
                    runs,
                );
                if fitted < runs {
                    warmup = warmup.min(1);
                }
                runs = fitted;
            }
        }
        Ok(false)
    }

    /// Checks timed candidates, fastest first, against the reference until `finalists` besides
    /// the default have passed (the default is always checked); returns those that passed, and
    /// fails the session if none did.
    fn check_fastest(
        &mut self,
        bench: &mut Bench,
        entries: &mut [Entry],
        reference: &ReferenceCheck,
        finalists: usize,
    ) -> Result<Vec<usize>> {
        let mut order: Vec<usize> = (0..entries.len())
            .filter(|&i| entries[i].result.coarse_us.is_some())
            .collect();
        order.sort_by(|&a, &b| {
            let (x, y) = (entries[a].result.coarse_us, entries[b].result.coarse_us);
            x.unwrap_or(f64::INFINITY)
                .total_cmp(&y.unwrap_or(f64::INFINITY))
        });
        let mut passed: Vec<usize> = Vec::new();
        for &i in order.iter() {
            let others = passed.iter().filter(|&&j| j != 0).count();
            if others >= finalists && i != 0 {
                continue;
            }
            if bench.kernel(&entries[i].result.choice).is_none() {
                continue;
            }
            self.progress.advance(1);
            let out = match bench.run_checked(&entries[i].result.choice) {
                Ok(Some(out)) => out,
                Ok(None) => continue,
                Err(e) => {
                    entries[i].result.rejected = Some(format!("checked run failed: {e}"));
                    continue;
                }
            };
            match reference.verify(&out) {
                Ok(err) => {
                    entries[i].result.error = Some(err);
                    passed.push(i);
                }
                Err(why) => entries[i].result.rejected = Some(format!("wrong output: {why}")),
            }
        }
        if passed.is_empty() {
            let why = entries[0]
                .result
                .rejected
                .clone()
                .unwrap_or_else(|| "not timed".into());
            return Err(RuntimeError::InvalidInput(format!(
                "autotune of `{}`: no configuration produced a correct result (default: {why})",
                self.problem.spec
            )));
        }
        Ok(passed)
    }

    /// The second pass: the checked finalists `passed`, in interleaved rounds within what is
    /// left of the time budget; each gets the median of its rounds' samples.
    fn retime(&mut self, bench: &mut Bench, entries: &mut [Entry], passed: &[usize]) -> Result<()> {
        let slowest = passed
            .iter()
            .filter_map(|&i| entries[i].result.coarse_us)
            .fold(0.0, f64::max);
        let per_round = fine_runs_within(
            self.options
                .time_budget
                .saturating_sub(self.started.elapsed()),
            FINE_ROUNDS,
            passed.len(),
            slowest,
            self.options
                .fine_runs
                .max(FINE_ROUNDS)
                .div_ceil(FINE_ROUNDS),
        );
        for _ in 0..FINE_ROUNDS {
            for &i in passed {
                if let Some(t) = bench.time(&entries[i].result.choice, 1, per_round)? {
                    entries[i].samples.extend(t.samples_us);
                }
            }
        }
        for &i in passed {
            entries[i].result.fine_us = Some(median(&entries[i].samples));
            self.progress.advance(1);
        }
        Ok(())
    }
}

fn median(samples: &[f64]) -> f64 {
    Timing {
        samples_us: samples.to_vec(),
    }
    .median_us()
}

/// The scratch for `choice`'s splits and pieces, made on first use.
fn scratch_for<'s>(
    scratches: &'s mut HashMap<(usize, Pieces), DecodeScratch>,
    stream: &Arc<CudaStream>,
    p: &TuneProblem,
    choice: &TuneChoice,
) -> Result<&'s mut DecodeScratch> {
    match scratches.entry((choice.splits, choice.pieces)) {
        std::collections::hash_map::Entry::Occupied(e) => Ok(e.into_mut()),
        std::collections::hash_map::Entry::Vacant(e) => Ok(e.insert(DecodeScratch::with_pieces(
            stream,
            p.batch,
            p.q_heads(),
            p.shape.head_dim as usize,
            choice.splits,
            choice.pieces,
        )?)),
    }
}
