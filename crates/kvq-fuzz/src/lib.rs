//! A fuzz harness for kvq that runs on stable Rust (no libFuzzer): seeded generators, each input
//! run on a small-stack worker thread under `catch_unwind` with a time limit, and a supervisor
//! process that turns aborts (stack overflow, failed allocation) into findings. See
//! `docs/FUZZING.md`.
//!
//! Targets:
//! - [`Target::Scheme`]: scheme text through the parser, the canonical round trip, `check_shape`
//!   over head_dims 0..=1024, memory accounting, the CPU reference and CUDA source rendering
//!   ([`scheme`]);
//! - [`Target::Safetensors`]: files through `kvq eval`'s reader and a CPU evaluation
//!   ([`safetensors`]).

pub mod exec;
pub mod fuzz;
pub mod gen;
pub mod safetensors;
pub mod scheme;

use std::time::Duration;

use rand::Rng;

pub use exec::{Finding, Kind};

/// What a run exercises.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Target {
    /// Scheme text → parse → render → round trip → check_shape → reference → codegen.
    Scheme,
    /// Safetensors files → `kvq eval`'s reader → CPU evaluation.
    Safetensors,
}

impl Target {
    pub fn name(self) -> &'static str {
        match self {
            Target::Scheme => "scheme",
            Target::Safetensors => "safetensors",
        }
    }

    /// The check one input goes through.
    pub fn check(self) -> exec::Check {
        match self {
            Target::Scheme => scheme::check,
            Target::Safetensors => safetensors::check,
        }
    }

    /// Inputs the generator starts from (mutated along with grammar-made ones).
    pub fn corpus(self) -> Vec<Vec<u8>> {
        match self {
            Target::Scheme => gen::scheme_corpus(),
            Target::Safetensors => Vec::new(),
        }
    }

    /// The next input.
    pub fn generate<R: Rng>(self, rng: &mut R, corpus: &[Vec<u8>]) -> Vec<u8> {
        match self {
            Target::Scheme => gen::scheme_input(rng, corpus),
            Target::Safetensors => gen::safetensors_input(rng),
        }
    }

    /// Inputs this process has run that got past the first gate (parsed as a scheme, or read as
    /// a K/V file); the rest stopped at a clean error.
    pub fn accepted(self) -> u64 {
        use std::sync::atomic::Ordering;
        match self {
            Target::Scheme => scheme::PARSED.load(Ordering::Relaxed),
            Target::Safetensors => safetensors::READ.load(Ordering::Relaxed),
        }
    }

    /// Longest an input may run before it counts as a hang. Generous: a debug build on a loaded
    /// 2-core CI machine renders kernels and runs the reference several times per input.
    pub fn default_limit(self) -> Duration {
        Duration::from_secs(20)
    }
}
