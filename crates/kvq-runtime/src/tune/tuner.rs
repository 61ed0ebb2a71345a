//! The autotuner: chooses a [`TuneChoice`] for a decode problem (and the forms of a scheme's page
//! quantizers) by policy, times candidates on the GPU, gates them on correctness, and remembers
//! the winner per GPU and problem in one store.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::CudaStream;
use kvq_codegen::{Dtype, KernelShape, QuantizerForms};
use kvq_reference::int::IntCache;
use kvq_spec::SchemeSpec;

use super::choice::{Residency, TuneChoice};
use super::key::{GpuKey, ProblemKey, TuneProblem};
use super::policy::TunePolicy;
use super::session::Session;
use super::store::{unix_now, TuneEntry, TuneStore};
use super::synth::random_kv;
use crate::decode::{is_fast_memory, DecodeKernel, DecodeOptions};
use crate::error::{Result, RuntimeError};
use crate::jit::Jit;

/// Knobs of a tuning session. The defaults keep one shape under ~30 s on an H100.
#[derive(Clone, Debug, PartialEq)]
pub struct TuneOptions {
    /// Untimed runs before each timing.
    pub warmup: usize,
    /// Timed runs per candidate in the first pass over all candidates.
    pub coarse_runs: usize,
    /// Timed runs per finalist in the second pass (split over interleaved rounds, so drift hits
    /// every finalist alike).
    pub fine_runs: usize,
    /// Fastest correct candidates re-timed in the second pass (the default is always re-timed).
    pub finalists: usize,
    /// A candidate replaces the default only if its median is at least this fraction faster:
    /// smaller differences are noise, and the default is the stable choice.
    pub min_gain: f64,
    /// Stop timing further candidates once this much time has passed (the default and the
    /// candidates timed so far still compete).
    pub time_budget: Duration,
    /// Device bytes the tuner may allocate for its copies of the batch; `None`: 70% of free.
    pub memory_budget: Option<u64>,
    /// Seed of the synthetic inputs.
    pub seed: u64,
    /// Show a progress bar (only ever drawn on a terminal).
    pub progress: bool,
}

impl Default for TuneOptions {
    fn default() -> Self {
        TuneOptions {
            warmup: 3,
            coarse_runs: 10,
            fine_runs: 30,
            finalists: 4,
            min_gain: 0.01,
            time_budget: Duration::from_secs(20),
            memory_budget: None,
            seed: 0x6b76_7120_7475_6e65,
            progress: true,
        }
    }
}

/// Where a [`Selection`] came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChoiceSource {
    /// The heuristic default (policy `off`, or nothing stored under `cached`).
    Heuristic,
    /// A stored result.
    Stored,
    /// Tuned just now (policy `full`) and stored.
    Tuned,
}

/// A configuration and where it came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Selection {
    /// What to launch with.
    pub choice: TuneChoice,
    /// How it was found.
    pub source: ChoiceSource,
}

/// One candidate's fate in a tuning session.
#[derive(Clone, Debug, PartialEq)]
pub struct CandidateResult {
    /// The configuration.
    pub choice: TuneChoice,
    /// Median of the first pass, µs (`None`: not timed, see `rejected`).
    pub coarse_us: Option<f64>,
    /// Median of the second pass, µs (finalists only).
    pub fine_us: Option<f64>,
    /// Largest relative error against the reference (checked candidates only).
    pub error: Option<f64>,
    /// Why it was discarded (failed to compile or launch, or wrong output).
    pub rejected: Option<String>,
}

/// What a tuning session measured and chose.
#[derive(Clone, Debug, PartialEq)]
pub struct TuneReport {
    /// The GPU.
    pub gpu: GpuKey,
    /// The problem's key.
    pub problem: ProblemKey,
    /// The scheme's text.
    pub scheme: String,
    /// Batch and longest sequence timed.
    pub measured_batch: usize,
    /// See `measured_batch`.
    pub measured_len: usize,
    /// The winner.
    pub chosen: TuneChoice,
    /// Its median, µs.
    pub chosen_us: f64,
    /// The heuristic default.
    pub default: TuneChoice,
    /// Its median in the same pass as `chosen_us`, µs.
    pub default_us: f64,
    /// Every candidate.
    pub candidates: Vec<CandidateResult>,
    /// Copies of the batch rotated through while timing.
    pub copies: usize,
    /// The time budget ran out before every candidate was timed.
    pub truncated: bool,
    /// Wall-clock time of the session.
    pub elapsed: Duration,
    /// Where the result was stored (`None`: not persisted, see the printed warning).
    pub saved_to: Option<PathBuf>,
}

impl TuneReport {
    /// Default time over tuned time (≥ 1 by construction).
    pub fn speedup(&self) -> f64 {
        if self.chosen_us > 0.0 {
            self.default_us / self.chosen_us
        } else {
            1.0
        }
    }

    /// Candidates discarded.
    pub fn rejected(&self) -> usize {
        self.candidates
            .iter()
            .filter(|c| c.rejected.is_some())
            .count()
    }

    /// The store entry for this result.
    pub fn entry(&self) -> TuneEntry {
        TuneEntry {
            gpu: self.gpu.clone(),
            problem: self.problem.clone(),
            scheme: self.scheme.clone(),
            choice: self.chosen,
            tuned_us: self.chosen_us,
            default_us: self.default_us,
            measured_batch: self.measured_batch,
            measured_len: self.measured_len,
            candidates: self.candidates.len(),
            rejected: self.rejected(),
            tuned_at_unix: unix_now(),
            kvq_version: env!("CARGO_PKG_VERSION").into(),
            codebook: None,
            xquant: None,
        }
    }
}

/// Chooses launch configurations for decode problems on one GPU; see the module docs of
/// [`tune`](super).
pub struct Tuner<'j> {
    jit: &'j Jit,
    policy: TunePolicy,
    store: TuneStore,
    options: TuneOptions,
    gpu: GpuKey,
}

fn warn(message: &str) {
    eprintln!("kvq: warning: {message}");
}

impl<'j> Tuner<'j> {
    /// A tuner for `jit`'s device with the policy in `KVQ_TUNE` and the store at
    /// `<cache dir>/tune.json`. Fails only on an invalid `KVQ_TUNE`; without a cache folder the
    /// results live in memory (with a warning).
    pub fn new(jit: &'j Jit) -> Result<Tuner<'j>> {
        let policy = TunePolicy::from_env()?;
        let store = match TuneStore::default_path() {
            Ok(path) => TuneStore::open(path),
            Err(e) => {
                warn(&format!("tuning results will not be saved: {e}"));
                TuneStore::empty(PathBuf::new())
            }
        };
        Ok(Self::with_store(jit, policy, store))
    }

    /// A tuner with an explicit policy and store.
    pub fn with_store(jit: &'j Jit, policy: TunePolicy, store: TuneStore) -> Tuner<'j> {
        Tuner {
            jit,
            policy,
            store,
            options: TuneOptions::default(),
            gpu: GpuKey::of(jit.device().props()),
        }
    }

    /// Replaces the policy.
    pub fn set_policy(&mut self, policy: TunePolicy) {
        self.policy = policy;
    }

    /// Replaces the session options.
    pub fn set_options(&mut self, options: TuneOptions) {
        self.options = options;
    }

    /// The policy.
    pub fn policy(&self) -> TunePolicy {
        self.policy
    }

    /// The session options.
    pub fn options(&self) -> &TuneOptions {
        &self.options
    }

    /// The results known to this tuner.
    pub fn store(&self) -> &TuneStore {
        &self.store
    }

    /// The GPU results are recorded for.
    pub fn gpu(&self) -> &GpuKey {
        &self.gpu
    }

    /// The JIT the tuner compiles and times with.
    pub fn jit(&self) -> &Jit {
        self.jit
    }

    /// Stores `entry` (replacing one of the same GPU and key) and saves the file; returns where,
    /// or `None` (with a warning) when only the in-memory store holds it.
    pub(crate) fn store_entry(&mut self, entry: TuneEntry) -> Option<PathBuf> {
        self.store.insert(entry);
        match self.store.save() {
            Ok(()) => Some(self.store.path().to_path_buf()),
            Err(e) => {
                warn(&format!("tuning result kept in memory only: {e}"));
                None
            }
        }
    }

    /// The untuned default for `problem` on this GPU (loads the kernel of
    /// [`TuneChoice::occupancy_block`], through the JIT's caches, for its occupancy).
    pub fn heuristic(&self, problem: &TuneProblem) -> Result<TuneChoice> {
        let sm_count = self.gpu.sm_count as usize;
        let kernel = occupancy_kernel(self.jit, problem, sm_count)?;
        Ok(TuneChoice::heuristic(
            problem,
            residency(self.jit, &kernel)?,
        ))
    }

    /// The stored result for `problem` on this GPU, whatever the policy.
    pub fn lookup(&self, problem: &TuneProblem) -> Option<TuneChoice> {
        self.store
            .lookup(&self.gpu, &problem.key())
            .map(|e| e.choice)
    }

    /// The configuration to launch `problem` with, by policy: `off` → heuristic; `cached` →
    /// stored, else heuristic; `full` → stored, else tuned now (synthetic inputs of the
    /// problem's size) and stored.
    pub fn choose(&mut self, problem: &TuneProblem) -> Result<Selection> {
        problem.check()?;
        if self.policy == TunePolicy::Off {
            return Ok(Selection {
                choice: self.heuristic(problem)?,
                source: ChoiceSource::Heuristic,
            });
        }
        if let Some(choice) = self.lookup(problem) {
            return Ok(Selection {
                choice,
                source: ChoiceSource::Stored,
            });
        }
        if self.policy == TunePolicy::Cached {
            return Ok(Selection {
                choice: self.heuristic(problem)?,
                source: ChoiceSource::Heuristic,
            });
        }
        let report = self.tune(problem)?;
        Ok(Selection {
            choice: report.chosen,
            source: ChoiceSource::Tuned,
        })
    }

    /// The forms of `spec`'s page quantizers at `head_dim` for inputs of `dtype`, by this tuner's
    /// policy and from its store (the decode results' file): the default under `off`, a stored
    /// result under `cached` (else the default), tuned now and stored under `full`.
    pub fn choose_forms(
        &mut self,
        stream: &Arc<CudaStream>,
        spec: &SchemeSpec,
        head_dim: u32,
        dtype: Dtype,
    ) -> Result<QuantizerForms> {
        crate::paged::choose_forms_in(
            &mut self.store,
            self.policy,
            self.jit,
            stream,
            spec,
            head_dim,
            dtype,
        )
    }

    /// Tunes `problem` on synthetic inputs of its size (one random sequence of `max_len` tokens,
    /// repeated `batch` times) and stores the result, whatever the policy.
    pub fn tune(&mut self, problem: &TuneProblem) -> Result<TuneReport> {
        let started = Instant::now();
        problem.check()?;
        let (k, v) = random_kv(
            problem.kv_heads,
            problem.max_len,
            problem.shape.head_dim as usize,
            self.options.seed,
        )?;
        let cache = IntCache::build(&problem.spec, &k, &v)
            .map_err(|e| RuntimeError::InvalidInput(format!("reference cache for tuning: {e}")))?;
        drop((k, v));
        let batch = kvq_reference::resources::try_vec(
            problem.batch,
            &cache,
            &format!("the tuning batch ({} sequences)", problem.batch),
        )?;
        self.tune_batch(problem.shape, &batch, started)
    }

    /// Tunes the decode of the caller's batch `sequences` (all of one scheme, KV heads and head
    /// size; a sequence may appear several times) with kernel shape `shape`, and stores the
    /// result under the batch's key.
    pub fn tune_on(&mut self, shape: KernelShape, sequences: &[&IntCache]) -> Result<TuneReport> {
        self.tune_batch(shape, sequences, Instant::now())
    }

    /// [`Tuner::tune_on`], with the session clock started at `started`.
    fn tune_batch(
        &mut self,
        shape: KernelShape,
        sequences: &[&IntCache],
        started: Instant,
    ) -> Result<TuneReport> {
        let first = sequences
            .first()
            .ok_or_else(|| RuntimeError::InvalidInput("tuning an empty batch".into()))?;
        let problem = TuneProblem::new(
            *first.spec(),
            shape,
            first.k().kv_heads(),
            sequences.len(),
            sequences.iter().map(|s| s.tokens()).max().unwrap_or(0),
        );
        problem.check()?;
        if first.k().head_dim() != shape.head_dim as usize {
            return Err(RuntimeError::InvalidInput(format!(
                "the caches have head_dim {}, the kernel shape {}",
                first.k().head_dim(),
                shape.head_dim
            )));
        }
        let mut session = Session::new(self.jit, &self.options, &problem, started);
        let mut report = session.run(sequences, &self.gpu)?;
        self.store.insert(report.entry());
        match self.store.save() {
            Ok(()) => report.saved_to = Some(self.store.path().to_path_buf()),
            Err(e) => warn(&format!("tuning result kept in memory only: {e}")),
        }
        Ok(report)
    }
}

/// Fewest timed runs per measurement: a median of fewer says little.
pub const MIN_RUNS: usize = 3;

/// Timed runs per candidate so that `candidates` more candidates of about `per_run_us` each (plus
/// `warmup` untimed runs) fit in `budget`: at most `max_runs`, at least [`MIN_RUNS`].
pub fn coarse_runs_within(
    budget: Duration,
    candidates: usize,
    per_run_us: f64,
    warmup: usize,
    max_runs: usize,
) -> usize {
    if candidates == 0 || per_run_us.is_nan() || per_run_us <= 0.0 {
        return max_runs.max(MIN_RUNS);
    }
    let per_candidate = budget.as_secs_f64() * 1e6 / candidates as f64;
    let fit = (per_candidate / per_run_us).floor() as usize;
    fit.saturating_sub(warmup)
        .clamp(MIN_RUNS, max_runs.max(MIN_RUNS))
}

/// Timed runs per finalist and round so that `rounds` rounds over `finalists` finalists of at most
/// `slowest_us` per run (plus one warm-up each) fit in `remaining`: at most `want`, at least
/// [`MIN_RUNS`].
pub fn fine_runs_within(
    remaining: Duration,
    rounds: usize,
    finalists: usize,
    slowest_us: f64,
    want: usize,
) -> usize {
    let slots = (rounds * finalists).max(1) as f64;
    if slowest_us.is_nan() || slowest_us <= 0.0 {
        return want.max(MIN_RUNS);
    }
    let fit = (remaining.as_secs_f64() * 1e6 / slots / slowest_us).floor() as usize;
    fit.saturating_sub(1).clamp(MIN_RUNS, want.max(MIN_RUNS))
}

/// The index of the winner among `results` (index 0 is the default): the fastest second-pass
/// median among candidates that passed the check and were not rejected; the default instead when
/// it passed too and the fastest is not at least `min_gain` faster. `None` when nothing qualifies.
pub fn select_winner(results: &[CandidateResult], min_gain: f64) -> Option<usize> {
    let eligible = |r: &CandidateResult| r.rejected.is_none() && r.error.is_some();
    let best = results
        .iter()
        .enumerate()
        .filter(|(_, r)| eligible(r))
        .filter_map(|(i, r)| r.fine_us.map(|t| (i, t)))
        .min_by(|a, b| a.1.total_cmp(&b.1))?;
    match results.first() {
        Some(d) if eligible(d) => match d.fine_us {
            Some(default_us) if best.1 > default_us * (1.0 - min_gain) => Some(0),
            _ => Some(best.0),
        },
        _ => Some(best.0),
    }
}

/// What the heuristic needs of this GPU ([`Residency`]) with `occupancy`, the kernel of
/// [`TuneChoice::occupancy_block`], resident: its SM count, that kernel's resident CTAs, and
/// whether its memory is fast for its SMs ([`is_fast_memory`]).
pub(super) fn residency(jit: &Jit, occupancy: &DecodeKernel) -> Result<Residency> {
    let props = jit.device().props();
    let sm_count = props.sm_count as usize;
    Ok(Residency::new(sm_count, occupancy.resident_ctas(sm_count)?)
        .with_fast_memory(is_fast_memory(props.peak_memory_bandwidth_gbps(), sm_count)))
}

/// The kernel whose occupancy the heuristic's split count for `problem` on `sm_count` SMs fills
/// ([`TuneChoice::occupancy_block`]; mostly the heuristic's own block), through the JIT's caches.
pub(super) fn occupancy_kernel(
    jit: &Jit,
    problem: &TuneProblem,
    sm_count: usize,
) -> Result<DecodeKernel> {
    DecodeKernel::load_with(
        jit,
        &problem.spec,
        &problem.shape,
        &TuneChoice::occupancy_block(problem, sm_count),
        crate::decode::LoadOptions::ALLOW_SLOW_PATH,
    )
}

/// The untuned default launch for `problem` and the kernel it runs, without a [`Tuner`]: the
/// kernel of [`TuneChoice::occupancy_block`] is loaded for its occupancy, then the one the
/// heuristic launches if that differs. Kernels come through the JIT's caches.
pub fn default_launch(jit: &Jit, problem: &TuneProblem) -> Result<(TuneChoice, DecodeKernel)> {
    default_launch_with(jit, problem, &DecodeOptions::default())
}

/// [`default_launch`] with a bench's measurement switches: pieces other than the rule's
/// ([`DecodeOptions::pieces`]) and overlapped launches on or off ([`DecodeOptions::pdl`]).
pub fn default_launch_with(
    jit: &Jit,
    problem: &TuneProblem,
    options: &DecodeOptions,
) -> Result<(TuneChoice, DecodeKernel)> {
    let sm_count = jit.device().props().sm_count as usize;
    let occupancy = occupancy_kernel(jit, problem, sm_count)?;
    let mut choice = TuneChoice::heuristic(problem, residency(jit, &occupancy)?);
    let mut kernel = if choice.params == occupancy.generated().tune {
        occupancy
    } else {
        DecodeKernel::load_with(
            jit,
            &problem.spec,
            &problem.shape,
            &choice.params,
            crate::decode::LoadOptions::ALLOW_SLOW_PATH,
        )?
    };
    choice.pieces = options.pieces(kernel.piece_rule(), choice.pieces, choice.splits);
    if let Some(on) = options.pdl {
        kernel.set_overlap_launches(on);
    }
    Ok((choice, kernel))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvq_codegen::TuneParams;

    fn result(
        splits: usize,
        fine: Option<f64>,
        error: Option<f64>,
        rejected: bool,
    ) -> CandidateResult {
        CandidateResult {
            choice: TuneChoice {
                params: TuneParams {
                    threads: 128,
                    tile_tokens: 32,
                    min_warps_per_sm: 0,
                    pack_heads: true,
                    short_staging: false,
                    store_scores: false,
                },
                splits,
                pieces: crate::decode::Pieces::NONE,
            },
            coarse_us: fine,
            fine_us: fine,
            error,
            rejected: rejected.then(|| "wrong output".to_string()),
        }
    }

    #[test]
    fn run_counts_shrink_to_fit_the_budget_but_not_below_three() {
        let s = Duration::from_secs;
        // Fast kernels: the configured counts.
        assert_eq!(coarse_runs_within(s(12), 62, 100.0, 3, 10), 10);
        // 28 ms kernels, 62 candidates in 12 s: 6 runs each (3 timed + 3 warm-up).
        assert_eq!(coarse_runs_within(s(12), 62, 28_000.0, 3, 10), 3);
        assert_eq!(coarse_runs_within(s(12), 62, 15_000.0, 1, 20), 11);
        assert_eq!(coarse_runs_within(s(0), 62, 1000.0, 3, 10), 3);
        assert_eq!(coarse_runs_within(s(5), 0, 1000.0, 3, 10), 10);
        assert_eq!(coarse_runs_within(s(5), 10, f64::NAN, 3, 10), 10);
        assert_eq!(fine_runs_within(s(10), 3, 5, 100.0, 10), 10);
        assert_eq!(fine_runs_within(s(3), 3, 5, 20_000.0, 10), 9);
        assert_eq!(fine_runs_within(s(0), 3, 5, 20_000.0, 10), 3);
    }

    #[test]
    fn a_wrong_candidate_is_never_chosen() {
        let results = vec![
            result(3, Some(100.0), Some(1e-4), false),
            result(6, Some(50.0), None, true),
            result(2, Some(90.0), Some(1e-4), false),
        ];
        assert_eq!(select_winner(&results, 0.01), Some(2));
    }

    #[test]
    fn the_default_stays_unless_clearly_beaten() {
        let results = vec![
            result(3, Some(100.0), Some(1e-4), false),
            result(4, Some(99.5), Some(1e-4), false),
        ];
        assert_eq!(select_winner(&results, 0.01), Some(0));
        let results = vec![
            result(3, Some(100.0), Some(1e-4), false),
            result(4, Some(98.0), Some(1e-4), false),
        ];
        assert_eq!(select_winner(&results, 0.01), Some(1));
    }

    #[test]
    fn a_wrong_default_loses_to_any_correct_candidate() {
        let results = vec![
            result(3, Some(10.0), Some(0.5), true),
            result(4, Some(120.0), Some(1e-4), false),
        ];
        assert_eq!(select_winner(&results, 0.01), Some(1));
        let none = vec![result(3, Some(10.0), None, true)];
        assert_eq!(select_winner(&none, 0.01), None);
        // Unchecked candidates (no error recorded) do not qualify either.
        let unchecked = vec![result(3, Some(10.0), None, false)];
        assert_eq!(select_winner(&unchecked, 0.01), None);
    }
}
