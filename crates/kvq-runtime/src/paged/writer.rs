//! [`CacheWriter`]: the cache kernels of one scheme, launched on a cache in memory the caller owns
//! (an engine's), for its prefill and append calls.

use std::sync::Arc;

use cudarc::driver::CudaStream;
use kvq_codegen::{Dtype, QuantizerForms};
use kvq_spec::SchemeSpec;

use super::append::{launch_append, AppendArgs};
use super::kernels::CacheFunctions;
use super::prefill::{launch_prefill, max_job_values, PrefillArgs};
use crate::decode::{CacheMut, CachePtrs};
use crate::error::{Result, RuntimeError};
use crate::jit::Jit;
use crate::launch::{Input, Output};

/// The cache kernels of one scheme × head_dim × input dtype, for a cache in memory the caller
/// owns ([`CachePtrs`]): what an engine's write call launches.
pub struct CacheWriter {
    spec: SchemeSpec,
    dtype: Dtype,
    kernels: CacheFunctions,
}

impl CacheWriter {
    /// Compiles (or loads from the caches) the scheme's cache kernels, the page quantizers in
    /// their heuristic forms.
    pub fn load(jit: &Jit, spec: &SchemeSpec, head_dim: usize, dtype: Dtype) -> Result<Self> {
        let head_dim = u32::try_from(head_dim)
            .map_err(|_| RuntimeError::InvalidInput(format!("head_dim {head_dim}")))?;
        let kernels = CacheFunctions::load(
            jit,
            spec,
            head_dim,
            dtype,
            QuantizerForms::default_for(spec, head_dim),
        )?;
        Ok(CacheWriter {
            spec: *spec,
            dtype,
            kernels,
        })
    }

    /// The scheme the kernels store.
    pub fn spec(&self) -> &SchemeSpec {
        &self.spec
    }

    /// The element type of the new K/V.
    pub fn dtype(&self) -> Dtype {
        self.dtype
    }

    /// Appends `q_len` tokens' K and V to each listed sequence (`[n][q_len][kv_heads][head_dim]`,
    /// sequence `i` for slot `slots[i]`; a slot of −1 is padding, skipped): token by token, each
    /// at position `seq_lens[slot]`, the page it completes quantized, then counted in `seq_lens`.
    ///
    /// # Safety
    /// Every pointer is a device allocation of the stream's context holding what [`CachePtrs`]
    /// says (`slots` `n` i32 of distinct slots, `k_new`/`v_new` `n·q_len·kv_heads·head_dim`
    /// values);
    /// each slot's page table maps the page its new token completes (a page of `page` tokens
    /// after the sink and local window); all stay alive until the launches have run.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn append_raw(
        &self,
        stream: &Arc<CudaStream>,
        cache: &CachePtrs,
        n: usize,
        q_len: usize,
        slots: u64,
        k_new: u64,
        v_new: u64,
    ) -> Result<()> {
        if n > 0 && (slots == 0 || k_new == 0 || v_new == 0) {
            return Err(RuntimeError::InvalidInput(
                "slots, k_new and v_new must not be null".into(),
            ));
        }
        // Bytes of one token's row of every KV head.
        let row = (cache.kv_heads * cache.head_dim * 2) as u64;
        for j in 0..q_len as u64 {
            // SAFETY: the caller vouches for the rows of every token.
            unsafe {
                self.append_token(
                    stream,
                    cache,
                    n,
                    q_len,
                    slots,
                    k_new + j * row,
                    v_new + j * row,
                )
            }?;
        }
        Ok(())
    }

    /// One token a sequence of an append of `stride` tokens a sequence.
    ///
    /// # Safety
    /// As [`append_raw`](Self::append_raw).
    #[allow(clippy::too_many_arguments)]
    unsafe fn append_token(
        &self,
        stream: &Arc<CudaStream>,
        cache: &CachePtrs,
        n: usize,
        stride: usize,
        slots: u64,
        k_new: u64,
        v_new: u64,
    ) -> Result<()> {
        let a = AppendArgs {
            cache: CacheMut::from(cache),
            slots: Input::Raw(slots),
            n,
            k_new: Input::Raw(k_new),
            v_new: Input::Raw(v_new),
            stride,
        };
        // SAFETY: the caller vouches for the pointers.
        unsafe { launch_append(stream, &self.kernels, a) }
    }

    /// Values of the device job list a [`prefill_raw`](Self::prefill_raw) of `prompts` needs
    /// with page tables `max_pages` wide.
    pub fn prefill_job_values(
        &self,
        prompts: &[(usize, usize)],
        max_pages: usize,
    ) -> Result<usize> {
        max_job_values(&self.spec, prompts, max_pages)
    }

    /// Bulk prefill of empty sequence slots with prompts packed back to back (`k`/`v`:
    /// `[Σ tokens][kv_heads][head_dim]`, prompt `i`'s rows after those of prompts `< i`;
    /// `prompts` are `(slot, tokens)`): each prompt's sink and tail are copied in FP16, its whole
    /// pages quantized (one launch a tensor for the batch) into the pages its page-table row
    /// maps, and its slot's length set to its tokens. `jobs` is a device list of at least
    /// [`prefill_job_values`](Self::prefill_job_values) i32 that the step overwrites.
    ///
    /// # Safety
    /// Every pointer is a device allocation of the stream's context holding what [`CachePtrs`]
    /// says; the slots are distinct slots of the cache; each slot's page-table row maps every page
    /// its prompt fills; all stay alive until the launches have run.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn prefill_raw(
        &self,
        stream: &Arc<CudaStream>,
        cache: &CachePtrs,
        prompts: &[(usize, usize)],
        k: u64,
        v: u64,
        jobs: u64,
        jobs_capacity: usize,
    ) -> Result<()> {
        let need = self.prefill_job_values(prompts, cache.max_pages)?;
        if need > jobs_capacity {
            return Err(RuntimeError::InvalidInput(format!(
                "the prefill's job list needs {need} values, the buffer holds {jobs_capacity}"
            )));
        }
        if prompts.iter().any(|p| p.1 > 0) && (k == 0 || v == 0 || (need > 0 && jobs == 0)) {
            return Err(RuntimeError::InvalidInput(
                "k, v and the job list must not be null".into(),
            ));
        }
        let a = PrefillArgs {
            cache: CacheMut::from(cache),
            k: Input::Raw(k),
            v: Input::Raw(v),
            prompts,
            jobs: Output::Raw(jobs),
        };
        // SAFETY: the caller vouches for the pointers; the job list was checked above.
        unsafe { launch_prefill(stream, &self.kernels, &self.spec, a) }
    }
}
