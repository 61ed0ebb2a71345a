//! Autotuning of the decode kernels: per GPU and problem, find the fastest correct launch
//! configuration ([`TuneChoice`]: the template's block parameters and the split-K count) and
//! remember it.
//!
//! ```text
//! Tuner::choose(problem)            policy (KVQ_TUNE=off|cached|full, or set_policy)
//!   off    ─▶ heuristic default     TuneParams::default_for + default_splits
//!   cached ─▶ stored result for (GpuKey, ProblemKey) in <cache dir>/tune.json, else heuristic
//!   full   ─▶ stored result, else tune now and store:
//!        candidates: TuneParams::candidates_for(spec, shape) × split counts around default_splits
//!        compile all block shapes in parallel (JIT disk cache: free on the next run)
//!        upload the batch in enough copies that a round over them reads ≥ 4× L2
//!        pass 1: every candidate, N runs, median (CUDA events; runs queued behind a spin kernel)
//!        gate:   fastest candidates + default vs the CPU reference (2e-3 f16 / 1e-2 bf16, no NaN)
//!        pass 2: correct finalists + default, interleaved rounds, median
//!        winner: fastest finalist, unless the default is within `min_gain` of it
//! ```
//!
//! * [`policy`]: [`TunePolicy`] and `KVQ_TUNE`.
//! * [`key`]: [`GpuKey`], [`ProblemKey`] (scheme hash, head_dim, GQA, dtype, KV heads, batch and
//!   context buckets), [`TuneProblem`].
//! * [`choice`]: [`TuneChoice`], the heuristic default and the candidate set.
//! * [`store`]: the JSON file ([`TuneStore`]); atomic, merging writes; damaged files ignored.
//! * `finalists.rs`: the codebook and XQuant tuners' gated finalists and interleaved re-timing.
//! * [`rotate`], [`check`], [`synth`]: buffers that defeat L2, the correctness gate and
//!   synthetic inputs (timing is [`crate::timing::GpuTimer`]) — also used by the benchmarks, so both measure the
//!   same way.
//! * [`tuner`]: [`Tuner`] and its [`TuneReport`]; a session's steps (compile, time, check, re-time)
//!   are in `session.rs`.
//!
//! ```no_run
//! use kvq_codegen::{Dtype, KernelShape};
//! use kvq_runtime::tune::{TuneProblem, Tuner};
//! use kvq_runtime::{Device, Jit, RuntimeError};
//!
//! # fn main() -> Result<(), RuntimeError> {
//! let device = Device::open(0)?;
//! let jit = Jit::new(&device)?;
//! let mut tuner = Tuner::new(&jit)?; // policy from KVQ_TUNE, results in <cache dir>/tune.json
//! let spec = "k = int(2, channel), v = int(2, token)".parse().expect("scheme");
//! let problem = TuneProblem::new(spec, KernelShape::new(128, 4, Dtype::F16), 8, 16, 32_768);
//! let selection = tuner.choose(&problem)?;
//! println!("{:?}: {}", selection.source, selection.choice);
//! // DecodeKernel::load(&jit, &spec, &shape, &selection.choice.params), and a DecodeScratch
//! // with selection.choice.splits.
//! # Ok(())
//! # }
//! ```

pub mod check;
pub mod choice;
pub(crate) mod finalists;
pub mod key;
pub mod policy;
mod progress;
pub mod rotate;
mod session;
pub mod store;
pub mod synth;
pub mod tuner;

pub use check::{relative_difference, tolerance, ReferenceCheck};
pub use choice::{candidates, split_candidates, Residency, TuneChoice, MAX_SPLITS, SPLIT_FACTORS};
pub use key::{
    batch_bucket, candidates_checksum, context_bucket, GpuKey, ProblemKey, TuneProblem,
    MIN_CONTEXT_BUCKET,
};
pub use policy::{TunePolicy, KVQ_TUNE};
pub use rotate::{batch_device_bytes, plan_copies, rotation_copies, RotatingBatch};
pub use store::{checksum, Stored, TuneEntry, TuneStore, TUNE_FILE};
pub use tuner::{
    coarse_runs_within, default_launch, default_launch_with, fine_runs_within, select_winner,
    CandidateResult, ChoiceSource, Selection, TuneOptions, TuneReport, Tuner,
};
