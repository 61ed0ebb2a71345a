//! [`XQuantSteps`]: an XQuant layer's kernels on an engine's memory (the engine surface). The
//! engine owns the latent store (an integer cache of `rank / store_width` heads of `store_width`
//! channels, docs/LAYOUT.md §10), the packed projections ([`XQuantWeightsLayout`]) and a
//! workspace; the steps take the layer input X and write the latents (projection, then the
//! integer store's own prefill and append), and decode over them.
//!
//! The workspace ([`XQuantWorkspace`]) holds, for the writes, the projected latent rows of up to
//! `rows` tokens (K then V, f16), the projection's partition sums and the prefill's job list;
//! for an attend, the split partials (the two uses never overlap in time on one stream).

use super::kernel::XQuantKernel;
use super::project::XQuantProjector;
use super::weights::{invalid, XQuantWeightInputs, XQuantWeightsLayout};
use crate::decode::CachePtrs;
use crate::error::Result;
use crate::jit::Jit;
use crate::paged::CacheWriter;
use cudarc::driver::CudaStream;
use kvq_codegen::{latent_spec, Dtype, KernelShape, RebuildPrecision};
use kvq_reference::xquant::latent_store_width;
use kvq_spec::{CacheSource, SchemeSpec, XSource};
use std::sync::Arc;

/// Alignment of each workspace region.
const ALIGN: usize = 256;

/// The limits an engine's XQuant layer is made for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XQuantLimits {
    /// Sequence slots.
    pub max_seqs: usize,
    /// Longest sequence, in tokens (and the most tokens one prompt of a prefill has).
    pub max_seq_len: usize,
    /// Columns of the block table.
    pub max_pages: usize,
}

/// An engine's XQuant layer memory: the latent store and the packed projections.
#[derive(Debug, Clone, Copy)]
pub struct XQuantPtrs {
    /// The latent store (`kv_heads` = store heads, `head_dim` = store width).
    pub latents: CachePtrs,
    /// The packed projections ([`XQuantWeightsLayout`]), written by the engine from
    /// [`XQuantWeightsLayout::pack`].
    pub weights: u64,
}

/// Where a write's regions lie in the workspace, and the bytes an attend takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XQuantWorkspace {
    /// Tokens one projection takes (prompts are written in groups of at most this many).
    pub rows: usize,
    /// Offset of V's latent rows (K's start at 0).
    v_rows: usize,
    /// Offset of the projection's partition sums.
    partial: usize,
    /// Offset and bytes of the prefill's job list.
    jobs: (usize, usize),
    /// Bytes of the whole workspace.
    pub bytes: usize,
}

impl XQuantWorkspace {
    fn new(
        rank: usize,
        rows: usize,
        partial_bytes: usize,
        jobs_bytes: usize,
        attend: usize,
    ) -> Self {
        let lat = (2 * rows * rank).next_multiple_of(ALIGN);
        let partial = 2 * lat;
        let jobs = partial + partial_bytes.next_multiple_of(ALIGN);
        let writes = jobs + jobs_bytes;
        Self {
            rows,
            v_rows: lat,
            partial,
            jobs: (jobs, jobs_bytes),
            bytes: writes.max(attend).next_multiple_of(ALIGN),
        }
    }
}

/// An XQuant scheme's kernels for one shape and limits on one GPU, over an engine's memory.
pub struct XQuantSteps {
    spec: SchemeSpec,
    input: Dtype,
    d_model: usize,
    layout: XQuantWeightsLayout,
    /// The decode and its combine.
    pub decode: XQuantKernel,
    projector: XQuantProjector,
    writer: CacheWriter,
    store_heads: usize,
    store_width: usize,
    /// Splits of an attend of `n` sequences, at index `n - 1`.
    splits: Vec<usize>,
    workspace: XQuantWorkspace,
}

impl XQuantSteps {
    /// Compiles (through the JIT's caches) and loads the decode (K rebuilt in f16 on the tensor
    /// cores), the projection for `shape.dtype` layer inputs of `d_model`, and the latent store's
    /// writes; sizes the workspace for `limits`. `x(cross_layer)` is refused: its per-token
    /// accumulator latents and lift run through [`super::XQuantPagedCache`] only.
    pub fn load(
        jit: &Jit,
        spec: &SchemeSpec,
        shape: &KernelShape,
        kv_heads: usize,
        d_model: usize,
        limits: XQuantLimits,
    ) -> Result<Self> {
        match spec.source {
            CacheSource::X(XSource::Latent) => {}
            CacheSource::X(XSource::CrossLayer) => {
                return Err(invalid(format!(
                    "`{spec}`: XQuant-CL's writes on an engine's memory are not offered (the \
                     accumulator's per-token latents and the lift have no place in a plan); \
                     XQuantPagedCache::append_cross_layer serves them from Rust"
                )))
            }
            CacheSource::Kv => {
                return Err(invalid(format!("`{spec}` caches K and V: use a K/V plan")))
            }
        }
        let d = shape.head_dim as usize;
        let layout = XQuantWeightsLayout::new(kv_heads, d, d_model).ok_or_else(|| {
            invalid(format!(
                "{kv_heads} KV heads of {d} from a d_model of {d_model}: sizes past the address space"
            ))
        })?;
        let store_width = latent_store_width(spec, layout.rank)?;
        let decode =
            XQuantKernel::load(jit, spec, shape, kv_heads, d_model, RebuildPrecision::F16)?;
        let projector = XQuantProjector::load(jit, shape.dtype, d_model, layout.rank)?;
        let writer = CacheWriter::load(jit, &latent_spec(spec), store_width, Dtype::F16)?;
        let max_seqs = limits.max_seqs.clamp(1, u16::MAX as usize);
        let splits: Vec<usize> = (1..=max_seqs)
            .map(|n| decode.default_splits(n, limits.max_seq_len))
            .collect();
        let attend = splits
            .iter()
            .enumerate()
            .map(|(i, &s)| decode.workspace_bytes(i + 1, s))
            .max()
            .unwrap_or(0);
        let rows = limits.max_seq_len.max(max_seqs);
        let partial = (1..=rows)
            .map(|n| projector.partial_bytes(n))
            .max()
            .unwrap_or(0);
        // Two job values a page of every slot at most (as the integer plans' prefill).
        let jobs = 8 * limits.max_seqs * limits.max_pages;
        let workspace = XQuantWorkspace::new(layout.rank, rows, partial, jobs, attend);
        Ok(Self {
            spec: *spec,
            input: shape.dtype,
            d_model,
            layout,
            decode,
            projector,
            writer,
            store_heads: layout.rank / store_width,
            store_width,
            splits,
            workspace,
        })
    }

    /// The packed projections' layout (the engine's weights buffer).
    pub fn weights_layout(&self) -> &XQuantWeightsLayout {
        &self.layout
    }

    /// The workspace every step of these limits takes.
    pub fn workspace(&self) -> &XQuantWorkspace {
        &self.workspace
    }

    /// Splits of an attend of `n` sequences (1 up to the limits' `max_seqs`).
    pub fn splits(&self, n: usize) -> Result<usize> {
        n.checked_sub(1)
            .and_then(|i| self.splits.get(i).copied())
            .ok_or_else(|| {
                invalid(format!(
                    "{n} sequences (these steps take 1 to {})",
                    self.splits.len()
                ))
            })
    }

    fn weights(&self, p: &XQuantPtrs) -> XQuantWeightInputs<'static> {
        self.layout.inputs(&self.spec, p.weights, self.input)
    }

    fn check_store(&self, p: &XQuantPtrs) -> Result<()> {
        let l = &p.latents;
        if (l.kv_heads, l.head_dim) != (self.store_heads, self.store_width) {
            return Err(invalid(format!(
                "the latent store has {} heads of {}; `{}` at latents of {} keeps {} of {}",
                l.kv_heads,
                l.head_dim,
                self.spec,
                self.layout.rank,
                self.store_heads,
                self.store_width
            )));
        }
        Ok(())
    }

    /// Projects `n` rows of X at `x` into the workspace's latent rows.
    ///
    /// # Safety
    /// As [`Self::prefill_raw`]; `n` at most the workspace's rows.
    unsafe fn project(
        &self,
        stream: &Arc<CudaStream>,
        p: &XQuantPtrs,
        x: u64,
        n: usize,
        workspace: u64,
    ) -> Result<(u64, u64)> {
        let w = &self.workspace;
        let (k, v) = (workspace, workspace + w.v_rows as u64);
        let partial = workspace + w.partial as u64;
        // SAFETY: the workspace holds `rows` latent rows and the sums of any projection of at
        // most `rows` tokens (XQuantWorkspace::new); the caller vouches for the rest.
        unsafe {
            self.projector
                .project_raw(stream, &self.weights(p), (x, n), (k, v), partial)
        }?;
        Ok((k, v))
    }

    /// Prefills empty slots with prompts' layer input packed back to back (`x`:
    /// `[Σ tokens][d_model]` in the steps' dtype; `prompts`: `(slot, tokens)`), as the integer
    /// store's prefill does with K and V: each group of prompts of at most the workspace's rows
    /// is projected into the workspace, then written (sink and tail latents in f16, whole pages
    /// quantized into the pages the block table names).
    ///
    /// # Safety
    /// Every address is device memory of `stream`'s context: the latent store and weights of
    /// `p` of their plan's sizes, `x` of those rows, `workspace` of the workspace's bytes; the
    /// slots are distinct slots below the store's, each block-table row maps the pages its
    /// prompt fills; all alive until the launches have run.
    pub unsafe fn prefill_raw(
        &self,
        stream: &Arc<CudaStream>,
        p: &XQuantPtrs,
        prompts: &[(usize, usize)],
        x: u64,
        workspace: u64,
    ) -> Result<()> {
        self.check_store(p)?;
        let w = &self.workspace;
        if let Some(&(slot, t)) = prompts.iter().find(|pr| pr.1 > w.rows) {
            return Err(invalid(format!(
                "slot {slot}'s prompt of {t} tokens is longer than the steps' {} rows",
                w.rows
            )));
        }
        let row_bytes = (self.d_model * 2) as u64;
        let (jobs, jobs_bytes) = (workspace + w.jobs.0 as u64, w.jobs.1);
        let mut at = 0usize;
        let mut group_start = 0usize;
        while group_start < prompts.len() {
            let mut end = group_start;
            let mut tokens = 0usize;
            while end < prompts.len() && tokens + prompts[end].1 <= w.rows {
                tokens += prompts[end].1;
                end += 1;
            }
            let group = &prompts[group_start..end];
            // SAFETY: `tokens` ≤ rows; x holds these rows after the `at` before them.
            let (k, v) =
                unsafe { self.project(stream, p, x + at as u64 * row_bytes, tokens, workspace) }?;
            // SAFETY: the latent rows of this group are in the workspace; the job list has the
            // room of any prefill within the limits; the caller vouches for the store.
            unsafe {
                self.writer
                    .prefill_raw(stream, &p.latents, group, k, v, jobs, jobs_bytes / 4)
            }?;
            at += tokens;
            group_start = end;
        }
        Ok(())
    }

    /// Appends one token to each of `n` sequences from its layer input (`x`: `[n][d_model]`,
    /// row `i` for the slot `slots[i]` names; `slots`: `n` distinct device i32, −1: padding,
    /// skipped): projected into the workspace, then the integer store's append. No host
    /// synchronisation: capturable in a CUDA graph.
    ///
    /// # Safety
    /// As [`Self::prefill_raw`]; `n` at most the limits' `max_seqs`.
    pub unsafe fn append_raw(
        &self,
        stream: &Arc<CudaStream>,
        p: &XQuantPtrs,
        n: usize,
        slots: u64,
        x: u64,
        workspace: u64,
    ) -> Result<()> {
        self.check_store(p)?;
        if n == 0 {
            return Ok(());
        }
        if n > self.splits.len() {
            return Err(invalid(format!(
                "{n} sequences (these steps take at most {})",
                self.splits.len()
            )));
        }
        // SAFETY: n ≤ max_seqs ≤ rows.
        let (k, v) = unsafe { self.project(stream, p, x, n, workspace) }?;
        // SAFETY: the caller vouches for the store and slots; the rows were just projected.
        unsafe {
            self.writer
                .append_raw(stream, &p.latents, n, 1, slots, k, v)
        }
    }

    /// Attention of one query token for each of `n` sequences ([`XQuantKernel::attend_raw`]) at
    /// the split count [`splits`](Self::splits) gives, the partials in `workspace`.
    ///
    /// # Safety
    /// As [`XQuantKernel::attend_raw`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn attend_raw(
        &self,
        stream: &Arc<CudaStream>,
        p: &XQuantPtrs,
        n: usize,
        slots: u64,
        (q, out, lse): (u64, u64, u64),
        workspace: u64,
    ) -> Result<()> {
        self.check_store(p)?;
        if n == 0 {
            return Ok(());
        }
        let splits = self.splits(n)?;
        // SAFETY: the workspace covers the partials of `splits` for `n` (XQuantSteps::load).
        unsafe {
            self.decode.attend_raw(
                stream,
                &p.latents,
                self.weights(p),
                n,
                slots,
                (q, out, lse),
                splits,
                workspace,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::XQuantWorkspace;

    #[test]
    fn write_regions_follow_each_other_and_an_attend_may_need_more() {
        let w = XQuantWorkspace::new(1024, 100, 1000, 64, 0);
        // K's rows, V's rows (100 × 1024 f16 each), the sums, the jobs.
        assert_eq!(w.v_rows, 204_800);
        assert_eq!(w.partial, 409_600);
        assert_eq!(w.jobs, (409_600 + 1024, 64));
        assert_eq!(w.bytes, 410_880);
        let big = XQuantWorkspace::new(1024, 100, 1000, 64, 1 << 20);
        assert_eq!(big.bytes, 1 << 20);
    }
}
