//! What a tuning result is valid for: the GPU ([`GpuKey`]) and the problem ([`ProblemKey`]), with
//! batch size and context length rounded up to power-of-two buckets so nearby shapes share one
//! result (and one captured launch shape, see `default_splits`).

use kvq_codegen::rules::LaunchRules;
use kvq_codegen::{Dtype, KernelShape, TuneParams};
use kvq_spec::SchemeSpec;
use serde::{Deserialize, Serialize};
use std::fmt;

use super::choice::SPLIT_FACTORS;
use super::store::checksum;
use crate::device::{DeviceProps, DriverVersion};
use crate::error::{Result, RuntimeError};

/// The checksum of the decode candidate set the tuner times for `spec` at `shape`: the block
/// candidates ([`TuneParams::candidates_for`]), the launch rules that give the default and its
/// split count ([`LaunchRules::for_kernel`]) and the split multiples around it
/// ([`SPLIT_FACTORS`]). Results stored under another checksum were chosen from another set.
pub fn candidates_checksum(spec: &SchemeSpec, shape: &KernelShape) -> String {
    let set = (
        TuneParams::candidates_for(spec, shape),
        LaunchRules::for_kernel(spec, shape),
        SPLIT_FACTORS,
    );
    checksum(serde_json::to_string(&set).unwrap_or_default().as_bytes())
}

/// Contexts shorter than this share one bucket: below it a single split is the only sensible
/// choice, so separate results would only repeat themselves.
pub const MIN_CONTEXT_BUCKET: usize = 256;

/// The batch bucket of `batch` sequences: the next power of two (1, 2, 4, …).
pub fn batch_bucket(batch: usize) -> usize {
    batch.max(1).next_power_of_two()
}

/// The context bucket of a longest sequence of `max_len` tokens: the next power of two, at least
/// [`MIN_CONTEXT_BUCKET`].
pub fn context_bucket(max_len: usize) -> usize {
    max_len.max(MIN_CONTEXT_BUCKET).next_power_of_two()
}

/// The GPU a result was measured on. Results move with none of these changing: another model,
/// SM count (MIG, binning) or driver can favour another configuration.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct GpuKey {
    /// Marketing name, e.g. `NVIDIA H100 80GB HBM3`.
    pub name: String,
    /// `(major, minor)`.
    pub compute_capability: (u32, u32),
    /// Streaming multiprocessors.
    pub sm_count: u32,
    /// The driver's CUDA version.
    pub driver: DriverVersion,
}

impl GpuKey {
    /// The key of an opened device.
    pub fn of(props: &DeviceProps) -> GpuKey {
        GpuKey {
            name: props.name.clone(),
            compute_capability: props.compute_capability,
            sm_count: props.sm_count,
            driver: props.driver,
        }
    }
}

impl fmt::Display for GpuKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} (compute {}.{}, {} SMs, {})",
            self.name,
            self.compute_capability.0,
            self.compute_capability.1,
            self.sm_count,
            self.driver
        )
    }
}

/// The problem a result was measured for.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ProblemKey {
    /// `SchemeSpec::stable_hash` as 16 hex digits (JSON numbers lose 64-bit precision in many
    /// readers).
    pub scheme_hash: String,
    /// Channels per head.
    pub head_dim: u32,
    /// Query heads per KV head.
    pub gqa: u32,
    /// Query/output element type.
    pub dtype: Dtype,
    /// KV heads per sequence: with the batch it sets how many CTAs one split gives, so the best
    /// split count depends on it.
    pub kv_heads: usize,
    /// [`batch_bucket`] of the batch size.
    pub batch_bucket: usize,
    /// [`context_bucket`] of the longest sequence.
    pub context_bucket: usize,
    /// [`candidates_checksum`] of the scheme and kernel shape.
    pub candidates: String,
}

impl fmt::Display for ProblemKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "scheme {} d{} gqa{} {} kv_heads {} batch≤{} context≤{} candidates {}",
            self.scheme_hash,
            self.head_dim,
            self.gqa,
            self.dtype,
            self.kv_heads,
            self.batch_bucket,
            self.context_bucket,
            self.candidates
        )
    }
}

/// One decode problem to choose a configuration for.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TuneProblem {
    /// The scheme of every sequence.
    pub spec: SchemeSpec,
    /// Head size, GQA group and dtype of the kernel.
    pub shape: KernelShape,
    /// KV heads per sequence.
    pub kv_heads: usize,
    /// Sequences per launch.
    pub batch: usize,
    /// Tokens of the longest sequence.
    pub max_len: usize,
}

impl TuneProblem {
    /// Checks that a batch the tuner times (`sequences` of up to `longest` tokens) is this
    /// problem's.
    pub fn check_tuning_batch(&self, sequences: usize, longest: usize) -> Result<()> {
        if sequences != self.batch || longest > self.max_len {
            return Err(RuntimeError::InvalidInput(format!(
                "the batch holds {sequences} sequences of up to {longest} tokens, the problem {} \
                 of up to {}",
                self.batch, self.max_len
            )));
        }
        Ok(())
    }

    /// A problem; see [`TuneProblem::check`] for what is accepted.
    pub fn new(
        spec: SchemeSpec,
        shape: KernelShape,
        kv_heads: usize,
        batch: usize,
        max_len: usize,
    ) -> TuneProblem {
        TuneProblem {
            spec,
            shape,
            kv_heads,
            batch,
            max_len,
        }
    }

    /// Rejects empty problems and shapes the scheme cannot hold.
    pub fn check(&self) -> Result<()> {
        if self.kv_heads == 0 || self.batch == 0 || self.max_len == 0 || self.shape.gqa == 0 {
            return Err(RuntimeError::InvalidInput(format!(
                "tuning needs at least one KV head, query head, sequence and token (kv_heads {}, gqa {}, batch {}, max_len {})",
                self.kv_heads, self.shape.gqa, self.batch, self.max_len
            )));
        }
        // The scheme checks shapes in u32 and the query count is kv_heads × gqa: a count past
        // either would be checked (or sized) wrapped.
        let kv_heads = u32::try_from(self.kv_heads)
            .ok()
            .filter(|_| self.kv_heads.checked_mul(self.shape.gqa as usize).is_some())
            .ok_or_else(|| {
                RuntimeError::InvalidInput(format!(
                    "tuning: {} KV heads × gqa {} is more query heads than kvq counts",
                    self.kv_heads, self.shape.gqa
                ))
            })?;
        self.spec
            .check_shape(self.shape.head_dim, kv_heads)
            .map_err(|e| RuntimeError::InvalidInput(format!("scheme `{}`: {e}", self.spec)))
    }

    /// Query heads per sequence.
    pub fn q_heads(&self) -> usize {
        // Saturates rather than wraps: `check` refuses a product this large.
        self.kv_heads.saturating_mul(self.shape.gqa as usize)
    }

    /// Decode grid rows a sequence takes: its KV heads times the kernel's head groups
    /// ([`kvq_codegen::decode_head_groups`]; 1 up to 8 query heads a KV head). The launch
    /// heuristics count these rows as the "(sequence, KV head) pairs" of their rules.
    pub fn grid_heads(&self) -> usize {
        self.kv_heads * kvq_codegen::decode_head_groups(&self.spec, &self.shape) as usize
    }

    /// Query heads one decode CTA scores: the KV head's, or one head group's.
    pub fn cta_gqa(&self) -> u32 {
        kvq_codegen::decode_groups(&self.spec, &self.shape).heads
    }

    /// The store key of this problem.
    pub fn key(&self) -> ProblemKey {
        self.key_with_candidates(candidates_checksum(&self.spec, &self.shape))
    }

    /// The store key of this problem chosen from the candidate set of checksum `candidates`
    /// (another kernel family's set).
    pub fn key_with_candidates(&self, candidates: String) -> ProblemKey {
        ProblemKey {
            scheme_hash: format!("{:016x}", self.spec.stable_hash()),
            head_dim: self.shape.head_dim,
            gqa: self.shape.gqa,
            dtype: self.shape.dtype,
            kv_heads: self.kv_heads,
            batch_bucket: batch_bucket(self.batch),
            context_bucket: context_bucket(self.max_len),
            candidates,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kivi2() -> SchemeSpec {
        "k = int(2, channel), v = int(2, token)".parse().unwrap()
    }

    #[test]
    fn kv_head_counts_past_u32_are_refused_not_checked_wrapped() {
        let shape = KernelShape::new(128, 4, Dtype::F16);
        // 2^32 + 8 would pass the scheme's check as 8 KV heads if it were truncated.
        let e = TuneProblem::new(kivi2(), shape, (1usize << 32) + 8, 1, 1)
            .check()
            .unwrap_err();
        assert!(e.to_string().contains("4294967304 KV heads"), "{e}");
        assert!(TuneProblem::new(kivi2(), shape, 8, 1, 1).check().is_ok());
    }

    #[test]
    fn buckets_are_powers_of_two_with_a_context_floor() {
        assert_eq!(
            [0, 1, 2, 3, 4, 5, 16, 17].map(batch_bucket),
            [1, 1, 2, 4, 4, 8, 16, 32]
        );
        assert_eq!(context_bucket(0), MIN_CONTEXT_BUCKET);
        assert_eq!(context_bucket(1), MIN_CONTEXT_BUCKET);
        assert_eq!(context_bucket(256), 256);
        assert_eq!(context_bucket(257), 512);
        assert_eq!(context_bucket(4096), 4096);
        assert_eq!(context_bucket(32_769), 65_536);
    }

    #[test]
    fn problems_in_one_bucket_share_a_key_and_others_do_not() {
        let shape = KernelShape::new(128, 4, Dtype::F16);
        let a = TuneProblem::new(kivi2(), shape, 8, 9, 20_000).key();
        let b = TuneProblem::new(kivi2(), shape, 8, 16, 32_768).key();
        assert_eq!(a, b);
        assert_eq!(a.batch_bucket, 16);
        assert_eq!(a.context_bucket, 32_768);
        assert_eq!(a.scheme_hash.len(), 16);
        let other_scheme: SchemeSpec = "k = int(4, channel), v = int(4, token)".parse().unwrap();
        for c in [
            TuneProblem::new(other_scheme, shape, 8, 16, 32_768),
            TuneProblem::new(kivi2(), KernelShape::new(64, 4, Dtype::F16), 8, 16, 32_768),
            TuneProblem::new(kivi2(), KernelShape::new(128, 8, Dtype::F16), 8, 16, 32_768),
            TuneProblem::new(
                kivi2(),
                KernelShape::new(128, 4, Dtype::Bf16),
                8,
                16,
                32_768,
            ),
            TuneProblem::new(kivi2(), shape, 4, 16, 32_768),
            TuneProblem::new(kivi2(), shape, 8, 17, 32_768),
            TuneProblem::new(kivi2(), shape, 8, 16, 32_769),
        ] {
            assert_ne!(c.key(), a, "{c:?}");
        }
    }

    #[test]
    fn empty_and_impossible_problems_are_rejected() {
        let shape = KernelShape::new(128, 4, Dtype::F16);
        assert!(TuneProblem::new(kivi2(), shape, 8, 1, 100).check().is_ok());
        for p in [
            TuneProblem::new(kivi2(), shape, 0, 1, 100),
            TuneProblem::new(kivi2(), shape, 8, 0, 100),
            TuneProblem::new(kivi2(), shape, 8, 1, 0),
            TuneProblem::new(kivi2(), KernelShape::new(128, 0, Dtype::F16), 8, 1, 100),
        ] {
            assert!(
                matches!(p.check(), Err(RuntimeError::InvalidInput(_))),
                "{p:?}"
            );
        }
    }
}
