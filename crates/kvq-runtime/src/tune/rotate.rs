//! Several device copies of one batch (cache, queries, outputs), used in turn, so that timed runs
//! read from DRAM rather than from what the previous run left in L2.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};
use kvq_reference::int::IntCache;

use crate::decode::{DecodeKernel, DecodeScratch, GpuCache};
use crate::error::{Result, RuntimeError};

/// Most copies: enough for a batch of 1/64 of L2 (a 4K-token 2-bit sequence on an H100) to touch
/// 4×L2 per round, without letting tiny shapes allocate thousands of buffers.
pub const MAX_COPIES: usize = 256;

/// Copies needed so that one round over them touches at least four times the L2 size, so each
/// copy has been evicted by the time its turn comes again (`bytes_per_copy` = device bytes one
/// run reads).
pub fn rotation_copies(bytes_per_copy: u64, l2_bytes: u64) -> usize {
    if bytes_per_copy == 0 {
        return MAX_COPIES;
    }
    let want = (4 * l2_bytes).div_ceil(bytes_per_copy);
    (want as usize).clamp(1, MAX_COPIES)
}

/// How many copies of `bytes_per_copy` device bytes to make: [`rotation_copies`], fewer if they
/// would not fit in `budget` bytes. `Err` when even one does not fit.
pub fn plan_copies(bytes_per_copy: u64, l2_bytes: u64, budget: u64) -> Result<usize> {
    if bytes_per_copy > budget {
        return Err(RuntimeError::InvalidInput(format!(
            "the batch needs {:.2} GiB of device memory, {:.2} GiB are available for it",
            bytes_per_copy as f64 / (1u64 << 30) as f64,
            budget as f64 / (1u64 << 30) as f64
        )));
    }
    let fit = (budget / bytes_per_copy.max(1)).max(1) as usize;
    Ok(rotation_copies(bytes_per_copy, l2_bytes).min(fit))
}

/// Device bytes a batch of these sequences occupies once uploaded (pools, FP16 buffers, page
/// table, and the query and output rows of `q_heads` heads).
pub fn batch_device_bytes(sequences: &[&IntCache], q_heads: usize) -> u64 {
    sequences
        .iter()
        .map(|s| {
            let pages = s.k().pages().max(s.v().pages()) as u64;
            s.allocated_bytes() as u64 + 4 * pages + 2 * 2 * (q_heads * s.k().head_dim()) as u64
        })
        .sum()
}

/// `copies` device copies of one batch, attended in turn.
pub struct RotatingBatch {
    caches: Vec<GpuCache>,
    queries: Vec<CudaSlice<u16>>,
    outs: Vec<CudaSlice<u16>>,
    next: usize,
}

impl RotatingBatch {
    /// Uploads `copies` copies of the batch `sequences` with queries `q` (device words,
    /// `[batch][q_heads][head_dim]`); outputs start poisoned (all bits set: NaN in f16 and bf16).
    pub fn upload(
        stream: &Arc<CudaStream>,
        sequences: &[&IntCache],
        q: &[u16],
        copies: usize,
    ) -> Result<RotatingBatch> {
        let copies = copies.max(1);
        let mut caches = Vec::with_capacity(copies);
        let mut queries = Vec::with_capacity(copies);
        let mut outs = Vec::with_capacity(copies);
        let poison = vec![0xFFFFu16; q.len()];
        for _ in 0..copies {
            caches.push(GpuCache::upload(stream, sequences)?);
            queries.push(
                stream
                    .clone_htod(q)
                    .map_err(|e| RuntimeError::driver("upload queries", e))?,
            );
            outs.push(
                stream
                    .clone_htod(&poison)
                    .map_err(|e| RuntimeError::driver("allocate outputs", e))?,
            );
        }
        Ok(RotatingBatch {
            caches,
            queries,
            outs,
            next: 0,
        })
    }

    /// Number of copies.
    pub fn copies(&self) -> usize {
        self.caches.len()
    }

    /// Copy `i`'s cache.
    pub fn cache(&self, i: usize) -> Option<&GpuCache> {
        self.caches.get(i)
    }

    /// Enqueues one decode on the next copy in turn (no synchronisation).
    pub fn attend_next(
        &mut self,
        stream: &Arc<CudaStream>,
        kernel: &DecodeKernel,
        scratch: &mut DecodeScratch,
    ) -> Result<()> {
        let i = self.next;
        self.next = (self.next + 1) % self.caches.len();
        self.attend(i, stream, kernel, scratch)
    }

    /// Enqueues one decode on copy `i`.
    pub fn attend(
        &mut self,
        i: usize,
        stream: &Arc<CudaStream>,
        kernel: &DecodeKernel,
        scratch: &mut DecodeScratch,
    ) -> Result<()> {
        let n = self.caches.len();
        let (cache, q, out) = match (
            self.caches.get(i),
            self.queries.get(i),
            self.outs.get_mut(i),
        ) {
            (Some(c), Some(q), Some(o)) => (c, q, o),
            _ => {
                return Err(RuntimeError::InvalidInput(format!(
                    "copy {i} of a rotation of {n}"
                )))
            }
        };
        kernel.attend(stream, cache.view(), q, out, scratch)
    }

    /// Poisons copy `i`'s output, runs one decode on it, and returns the output (synchronises):
    /// for checks, where an unwritten element must show as NaN.
    pub fn run_checked(
        &mut self,
        i: usize,
        stream: &Arc<CudaStream>,
        kernel: &DecodeKernel,
        scratch: &mut DecodeScratch,
    ) -> Result<Vec<u16>> {
        let out = self
            .outs
            .get_mut(i)
            .ok_or_else(|| RuntimeError::InvalidInput(format!("no copy {i}")))?;
        let poison = vec![0xFFFFu16; out.len()];
        stream
            .memcpy_htod(&poison, out)
            .map_err(|e| RuntimeError::driver("poison outputs", e))?;
        self.attend(i, stream, kernel, scratch)?;
        let out = &self.outs[i];
        let host = stream
            .clone_dtoh(out)
            .map_err(|e| RuntimeError::async_failure("decode (checked run)", e))?;
        crate::device::synchronize_stream(stream, "decode (checked run)")?;
        Ok(host)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_cover_four_times_l2_within_limits() {
        let l2 = 50 << 20;
        assert_eq!(rotation_copies(1 << 30, l2), 1);
        assert_eq!(rotation_copies(200 << 20, l2), 1);
        assert_eq!(rotation_copies(100 << 20, l2), 2);
        assert_eq!(rotation_copies(16 << 20, l2), 13);
        assert_eq!(rotation_copies(1 << 20, l2), 200);
        assert_eq!(rotation_copies(1 << 10, l2), MAX_COPIES);
        assert_eq!(rotation_copies(0, l2), MAX_COPIES);
    }

    #[test]
    fn plans_fit_the_budget_or_fail() {
        let l2 = 50 << 20;
        assert_eq!(plan_copies(16 << 20, l2, 1 << 40).unwrap(), 13);
        assert_eq!(plan_copies(16 << 20, l2, 40 << 20).unwrap(), 2);
        assert_eq!(plan_copies(16 << 20, l2, 16 << 20).unwrap(), 1);
        assert!(matches!(
            plan_copies(16 << 20, l2, 15 << 20),
            Err(RuntimeError::InvalidInput(_))
        ));
    }
}
