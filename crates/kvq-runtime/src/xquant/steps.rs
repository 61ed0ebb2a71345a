//! [`XQuantSteps`]: an XQuant layer's kernels on an engine's memory (the engine surface). The
//! engine owns the latent store (an integer cache of `rank / store_width` heads of `store_width`
//! channels, docs/LAYOUT.md §10), the packed projections ([`XQuantWeightsLayout`]) and a
//! workspace; the steps take the layer input X and write the latents (projection, then the
//! integer store's own prefill and append), and decode over them.
//!
//! XQuant-CL (`x(cross_layer)`) adds the accumulator's latents of every token (an engine buffer,
//! [`XQuantSteps::accumulator_bytes`]) and the lift matrix (in the packed projections); its
//! writes also take the accumulator X̂ the engine carries through the layers and replace it with
//! the layer's (`*_cross_layer_raw`).
//!
//! The workspace ([`XQuantWorkspace`]) holds, for the writes, the projected latent rows of up to
//! `rows` tokens (K then V, f16), the projection's partition sums and the prefill's job list
//! (XQuant-CL's also the deltas, then the accumulator's latent rows, in one region, and the
//! lift's partition sums); for an attend, the split partials (the two uses never overlap in time
//! on one stream).

use super::cross_layer::{BaseRows, CrossLayerKernels};
use super::kernel::XQuantKernel;
use super::project::XQuantProjector;
use super::weights::{invalid, XQuantWeightInputs, XQuantWeightsLayout};
use crate::decode::CachePtrs;
use crate::error::Result;
use crate::jit::Jit;
use crate::launch::{Input, Output};
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
    /// XQuant-CL: the accumulator's latents of every token slot, f16
    /// `[2][max_seqs][max_seq_len][rank]` (K's, then V's; [`XQuantSteps::accumulator_bytes`]),
    /// written by the cross-layer writes; 0 for `x(latent)`.
    pub accumulator: u64,
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
    /// XQuant-CL: offset of the deltas, then the accumulator's latent rows (K's, then V's at
    /// `rows · rank` values on), and of the lift's partition sums.
    cross_layer: Option<(usize, usize)>,
    /// Bytes of the whole workspace.
    pub bytes: usize,
}

/// The sizes an [`XQuantWorkspace`] is laid out from.
struct WorkspaceNeeds {
    rank: usize,
    rows: usize,
    /// The projection's partition sums, at most.
    partial: usize,
    /// The prefill's job list.
    jobs: usize,
    /// XQuant-CL: the deltas' and accumulator rows' region, and the lift's sums at most.
    cross_layer: Option<(usize, usize)>,
    /// An attend's split partials, at most.
    attend: usize,
}

impl XQuantWorkspace {
    fn new(n: WorkspaceNeeds) -> Self {
        let lat = (2 * n.rows * n.rank).next_multiple_of(ALIGN);
        let partial = 2 * lat;
        let jobs = partial + n.partial.next_multiple_of(ALIGN);
        let mut writes = jobs + n.jobs.next_multiple_of(ALIGN);
        let cross_layer = n.cross_layer.map(|(scratch, lift)| {
            let at = writes;
            writes += scratch.next_multiple_of(ALIGN) + lift;
            (at, at + scratch.next_multiple_of(ALIGN))
        });
        Self {
            rows: n.rows,
            v_rows: lat,
            partial,
            jobs: (jobs, n.jobs),
            cross_layer,
            bytes: writes.max(n.attend).next_multiple_of(ALIGN),
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
    /// XQuant-CL's write kernels.
    cross_layer: Option<CrossLayerKernels>,
    /// Sequence slots and their tokens at most (the accumulator's rows).
    limits: XQuantLimits,
}

impl XQuantSteps {
    /// Compiles (through the JIT's caches) and loads the decode (K rebuilt in f16 on the tensor
    /// cores), the projection for `shape.dtype` layer inputs of `d_model`, the latent store's
    /// writes and, for XQuant-CL, the delta, accumulator and lift kernels; sizes the workspace
    /// for `limits`.
    pub fn load(
        jit: &Jit,
        spec: &SchemeSpec,
        shape: &KernelShape,
        kv_heads: usize,
        d_model: usize,
        limits: XQuantLimits,
    ) -> Result<Self> {
        let cross_layer = match spec.source {
            CacheSource::X(XSource::Latent) => false,
            CacheSource::X(XSource::CrossLayer) => true,
            CacheSource::Kv => {
                return Err(invalid(format!("`{spec}` caches K and V: use a K/V plan")))
            }
        };
        let d = shape.head_dim as usize;
        let layout = XQuantWeightsLayout::new(kv_heads, d, d_model, cross_layer).ok_or_else(|| {
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
        let most = |bytes: &dyn Fn(usize) -> usize| (1..=rows).map(bytes).max().unwrap_or(0);
        let partial = most(&|n| projector.partial_bytes(n));
        let cross_layer = if cross_layer {
            let slots_rows = limits.max_seqs.checked_mul(limits.max_seq_len);
            if slots_rows.map_or(true, |r| i32::try_from(r).is_err()) {
                return Err(invalid(format!(
                    "{} sequences of {} tokens: XQuant-CL's accumulator rows are indexed in 32 bits",
                    limits.max_seqs, limits.max_seq_len
                )));
            }
            Some(CrossLayerKernels::load(
                jit,
                shape.dtype,
                d_model,
                layout.rank,
            )?)
        } else {
            None
        };
        let cl_needs = cross_layer.as_ref().map(|cl| {
            // The deltas ([rows][d_model], X's dtype), then the accumulator's rows (2 × [rows][R]
            // f16) in the same bytes: the deltas are dead once projected.
            let scratch = (rows * d_model * 2).max(2 * rows * layout.rank * 2);
            (scratch, most(&|n| cl.lift_partial_bytes(n)))
        });
        // Two job values a page of every slot at most (as the integer plans' prefill).
        let jobs = 8 * limits.max_seqs * limits.max_pages;
        let workspace = XQuantWorkspace::new(WorkspaceNeeds {
            rank: layout.rank,
            rows,
            partial,
            jobs,
            cross_layer: cl_needs,
            attend,
        });
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
            cross_layer,
            limits,
        })
    }

    /// Bytes of XQuant-CL's accumulator buffer ([`XQuantPtrs::accumulator`]): f16 K and V
    /// latents of every token the limits hold, `2 · max_seqs · max_seq_len · rank · 2`; 0 for
    /// `x(latent)`.
    pub fn accumulator_bytes(&self) -> usize {
        match self.cross_layer {
            Some(_) => 2 * self.limits.max_seqs * self.limits.max_seq_len * self.layout.rank * 2,
            None => 0,
        }
    }

    /// The accumulator buffer at `base` as its K and V halves.
    fn accumulator_halves(&self, base: u64) -> (u64, u64) {
        (base, base + (self.accumulator_bytes() / 2) as u64)
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

    /// Projects `n` rows of X at `x` into `(k, v)` (`[n][rank]` f16 each), the projection's
    /// partition sums in the workspace.
    ///
    /// # Safety
    /// As [`Self::prefill_raw`]; `n` at most the workspace's rows, `k` and `v` of `n` rows.
    unsafe fn project(
        &self,
        stream: &Arc<CudaStream>,
        p: &XQuantPtrs,
        (x, n): (u64, usize),
        (k, v): (u64, u64),
        workspace: u64,
    ) -> Result<()> {
        let partial = workspace + self.workspace.partial as u64;
        // SAFETY: the workspace holds the sums of any projection of at most `rows` tokens
        // (XQuantWorkspace::new); the caller vouches for the rest.
        unsafe {
            self.projector
                .project_raw(stream, &self.weights(p), (x, n), (k, v), partial)
        }
    }

    /// The workspace's latent rows (K, V).
    fn latent_rows(&self, workspace: u64) -> (u64, u64) {
        (workspace, workspace + self.workspace.v_rows as u64)
    }

    /// Refuses a write of the other source's kind (`cross_layer`: the write takes X̂).
    fn check_kind(&self, cross_layer: bool) -> Result<()> {
        match (self.cross_layer.is_some(), cross_layer) {
            (true, false) => Err(invalid(format!(
                "`{}` stores deltas against the accumulator X̂: write it with the cross-layer \
                 calls, which take X̂",
                self.spec
            ))),
            (false, true) => Err(invalid(format!(
                "`{}` stores the layer input's latents (x(latent)): its writes take no X̂",
                self.spec
            ))),
            _ => Ok(()),
        }
    }

    /// Refuses prompts past the limits: a slot outside them, or more tokens than a slot holds
    /// or the workspace's rows take.
    fn check_prompts(&self, prompts: &[(usize, usize)]) -> Result<()> {
        let (rows, l) = (self.workspace.rows, &self.limits);
        let most = rows.min(l.max_seq_len);
        if let Some(&(slot, t)) = prompts.iter().find(|pr| pr.0 >= l.max_seqs || pr.1 > most) {
            return Err(invalid(format!(
                "slot {slot}'s prompt of {t} tokens: these steps take slots below {} and at most \
                 {most} tokens a prompt",
                l.max_seqs
            )));
        }
        Ok(())
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
        self.check_kind(false)?;
        self.check_prompts(prompts)?;
        let (k, v) = self.latent_rows(workspace);
        for (group, at, tokens) in groups(prompts, self.workspace.rows) {
            let x = x + at as u64 * self.row_bytes();
            // SAFETY: `tokens` ≤ rows; x holds these rows after the `at` before them.
            unsafe { self.project(stream, p, (x, tokens), (k, v), workspace) }?;
            // SAFETY: the latent rows of this group are in the workspace; the caller vouches
            // for the store.
            unsafe { self.store_prompts(stream, p, group, workspace) }?;
        }
        Ok(())
    }

    /// XQuant-CL: [`prefill_raw`](Self::prefill_raw) from prompts' layer input `x` and the
    /// accumulator `x_hat` of the earlier layers (both `[Σ tokens][d_model]` in the steps' dtype,
    /// zeros at the chain's first layer): stores the latents of `x − x_hat`, keeps `x_hat`'s
    /// latents in the accumulator buffer (slot `s`'s token `t` at row `s · max_seq_len + t`), and
    /// replaces `x_hat` with this layer's accumulator, in place.
    ///
    /// # Safety
    /// As [`Self::prefill_raw`]; `x_hat` device memory of `x`'s size, `p.accumulator` of
    /// [`accumulator_bytes`](Self::accumulator_bytes).
    pub unsafe fn prefill_cross_layer_raw(
        &self,
        stream: &Arc<CudaStream>,
        p: &XQuantPtrs,
        prompts: &[(usize, usize)],
        (x, x_hat): (u64, u64),
        workspace: u64,
    ) -> Result<()> {
        self.check_store(p)?;
        self.check_kind(true)?;
        self.check_prompts(prompts)?;
        for (group, at, tokens) in groups(prompts, self.workspace.rows) {
            let off = at as u64 * self.row_bytes();
            let rows = CrossLayerRows::Prompts(group);
            // SAFETY: `tokens` ≤ rows; x and x_hat hold these rows after the `at` before them;
            // the caller vouches for the rest.
            unsafe {
                self.write_cross_layer(stream, p, (x + off, x_hat + off, tokens), rows, workspace)
            }?;
        }
        Ok(())
    }

    /// The integer store's prefill of `group`'s latent rows (in the workspace).
    ///
    /// # Safety
    /// As [`Self::prefill_raw`]; the group's rows projected into the workspace.
    unsafe fn store_prompts(
        &self,
        stream: &Arc<CudaStream>,
        p: &XQuantPtrs,
        group: &[(usize, usize)],
        workspace: u64,
    ) -> Result<()> {
        let (k, v) = self.latent_rows(workspace);
        let w = &self.workspace;
        let (jobs, jobs_bytes) = (workspace + w.jobs.0 as u64, w.jobs.1);
        // SAFETY: the job list has the room of any prefill within the limits; the caller
        // vouches for the store and the rows.
        unsafe {
            self.writer
                .prefill_raw(stream, &p.latents, group, k, v, jobs, jobs_bytes / 4)
        }
    }

    fn row_bytes(&self) -> u64 {
        (self.d_model * 2) as u64
    }

    /// XQuant-CL's write of `n` tokens: `x − x_hat` projected to the latent rows, `x_hat`'s
    /// latents into the accumulator's rows, the latent rows stored, `x_hat` lifted in place.
    ///
    /// # Safety
    /// As [`Self::prefill_cross_layer_raw`]; `n` at most the workspace's rows.
    unsafe fn write_cross_layer(
        &self,
        stream: &Arc<CudaStream>,
        p: &XQuantPtrs,
        (x, x_hat, n): (u64, u64, usize),
        rows: CrossLayerRows<'_>,
        workspace: u64,
    ) -> Result<()> {
        let (Some(cl), Some((scratch, lift_partial))) =
            (self.cross_layer.as_ref(), self.workspace.cross_layer)
        else {
            return Err(invalid("not an XQuant-CL plan".into()));
        };
        let Some(lift) = self.layout.lift(p.weights) else {
            return Err(invalid("the projections' layout has no lift matrix".into()));
        };
        if p.accumulator == 0 {
            return Err(invalid(format!(
                "`{}` keeps the accumulator's latents: its buffer is NULL",
                self.spec
            )));
        }
        let (k, v) = self.latent_rows(workspace);
        let scratch = workspace + scratch as u64;
        let rank = self.layout.rank;
        let (ak, av) = (scratch, scratch + (self.workspace.rows * rank * 2) as u64);
        let per_slot = self.limits.max_seq_len;
        let (base_k, base_v) = self.accumulator_halves(p.accumulator);
        let base = || (Output::Raw(base_k), Output::Raw(base_v));
        // SAFETY (all launches): the workspace's regions hold `rows` tokens (XQuantWorkspace::
        // new), the accumulator buffer every slot's `max_seq_len` rows; the caller vouches for
        // x, x_hat, the store and the slots.
        unsafe {
            cl.delta(
                stream,
                (Input::Raw(x), Input::Raw(x_hat)),
                n,
                Output::Raw(scratch),
            )?;
            self.project(stream, p, (scratch, n), (k, v), workspace)?;
            // The deltas are dead: their bytes take the accumulator's latent rows.
            self.project(stream, p, (x_hat, n), (ak, av), workspace)?;
            let acc = (Input::Raw(ak), Input::Raw(av));
            match rows {
                CrossLayerRows::Append(slots) => {
                    let new_rows = BaseRows::Append {
                        slots: Input::Raw(slots),
                        seq_lens: Input::Raw(p.latents.seq_lens),
                    };
                    cl.store_base(stream, acc, new_rows, (per_slot, n), base())?;
                    self.writer
                        .append_raw(stream, &p.latents, n, 1, slots, k, v)?;
                }
                CrossLayerRows::Prompts(group) => {
                    let mut at = 0u64;
                    for &(slot, tokens) in group {
                        let lat = (Input::Raw(ak + at), Input::Raw(av + at));
                        let from = BaseRows::From(slot * per_slot);
                        cl.store_base(stream, lat, from, (per_slot, tokens), base())?;
                        at += (tokens * rank * 2) as u64;
                    }
                    self.store_prompts(stream, p, group, workspace)?;
                }
            }
            let lat = (Input::Raw(k), Input::Raw(v));
            let partial = Output::Raw(workspace + lift_partial as u64);
            cl.lift(
                stream,
                Output::Raw(x_hat),
                lat,
                Input::Raw(lift),
                n,
                partial,
            )
        }
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
        self.check_kind(false)?;
        if !self.check_count(n)? {
            return Ok(());
        }
        let (k, v) = self.latent_rows(workspace);
        // SAFETY: n ≤ max_seqs ≤ rows.
        unsafe { self.project(stream, p, (x, n), (k, v), workspace) }?;
        // SAFETY: the caller vouches for the store and slots; the rows were just projected.
        unsafe {
            self.writer
                .append_raw(stream, &p.latents, n, 1, slots, k, v)
        }
    }

    /// XQuant-CL: [`append_raw`](Self::append_raw) from the layer input `x` and the accumulator
    /// `x_hat` of the earlier layers (`[n][d_model]` each, row `i` for `slots[i]`; zeros at the
    /// chain's first layer): stores the latents of `x − x_hat`, keeps `x_hat`'s latents at the
    /// token's row of the accumulator buffer, and replaces `x_hat` with this layer's
    /// accumulator, in place (padding rows' too). No host synchronisation: capturable in a CUDA
    /// graph.
    ///
    /// # Safety
    /// As [`Self::append_raw`]; `x_hat` device memory of `x`'s size, `p.accumulator` of
    /// [`accumulator_bytes`](Self::accumulator_bytes).
    pub unsafe fn append_cross_layer_raw(
        &self,
        stream: &Arc<CudaStream>,
        p: &XQuantPtrs,
        n: usize,
        slots: u64,
        (x, x_hat): (u64, u64),
        workspace: u64,
    ) -> Result<()> {
        self.check_store(p)?;
        self.check_kind(true)?;
        if !self.check_count(n)? {
            return Ok(());
        }
        let rows = CrossLayerRows::Append(slots);
        // SAFETY: n ≤ max_seqs ≤ rows; the caller vouches for the rest.
        unsafe { self.write_cross_layer(stream, p, (x, x_hat, n), rows, workspace) }
    }

    /// Whether an append of `n` sequences has work, refusing more than the limits' slots.
    fn check_count(&self, n: usize) -> Result<bool> {
        if n > self.splits.len() {
            return Err(invalid(format!(
                "{n} sequences (these steps take at most {})",
                self.splits.len()
            )));
        }
        Ok(n > 0)
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
        let base = match self.cross_layer {
            None => None,
            Some(_) if p.accumulator == 0 => {
                return Err(invalid(format!(
                    "`{}` adds the accumulator's latents: its buffer is NULL",
                    self.spec
                )))
            }
            Some(_) => {
                let (k, v) = self.accumulator_halves(p.accumulator);
                Some((k, v, self.limits.max_seq_len))
            }
        };
        // SAFETY: the workspace covers the partials of `splits` for `n` (XQuantSteps::load).
        unsafe {
            self.decode.attend_raw(
                stream,
                &p.latents,
                (self.weights(p), base),
                n,
                slots,
                (q, out, lse),
                splits,
                workspace,
            )
        }
    }
}

/// The tokens of an XQuant-CL write: one a slot of an append (device slots), or a group of
/// prompts `(slot, tokens)` packed back to back.
enum CrossLayerRows<'a> {
    Append(u64),
    Prompts(&'a [(usize, usize)]),
}

/// Prompts `(slot, tokens)` written together: the group, the tokens before it and its own.
type PromptGroup<'a> = (&'a [(usize, usize)], usize, usize);

/// Prompts in groups of at most `rows` tokens, in order.
fn groups(prompts: &[(usize, usize)], rows: usize) -> Vec<PromptGroup<'_>> {
    let mut out = Vec::new();
    let (mut start, mut at) = (0usize, 0usize);
    while start < prompts.len() {
        let (mut end, mut tokens) = (start, 0usize);
        while end < prompts.len() && tokens + prompts[end].1 <= rows {
            tokens += prompts[end].1;
            end += 1;
        }
        // A prompt longer than `rows` was refused before; never loop on one.
        let end = end.max(start + 1);
        out.push((&prompts[start..end], at, tokens));
        at += tokens;
        start = end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::{groups, WorkspaceNeeds, XQuantWorkspace};

    fn needs(attend: usize, cross_layer: Option<(usize, usize)>) -> WorkspaceNeeds {
        WorkspaceNeeds {
            rank: 1024,
            rows: 100,
            partial: 1000,
            jobs: 64,
            cross_layer,
            attend,
        }
    }

    #[test]
    fn write_regions_follow_each_other_and_an_attend_may_need_more() {
        let w = XQuantWorkspace::new(needs(0, None));
        // K's rows, V's rows (100 × 1024 f16 each), the sums, the jobs.
        assert_eq!(w.v_rows, 204_800);
        assert_eq!(w.partial, 409_600);
        assert_eq!(w.jobs, (409_600 + 1024, 64));
        assert_eq!(w.bytes, 410_880);
        let big = XQuantWorkspace::new(needs(1 << 20, None));
        assert_eq!(big.bytes, 1 << 20);
        // XQuant-CL's scratch and lift sums after the jobs.
        let cl = XQuantWorkspace::new(needs(0, Some((409_600, 1000))));
        assert_eq!(cl.cross_layer, Some((410_880, 410_880 + 409_600)));
        assert_eq!(cl.bytes, 410_880 + 409_600 + 1024);
    }

    #[test]
    fn prompts_group_in_order_within_the_rows() {
        let prompts = [(0, 60), (1, 30), (2, 20), (3, 100), (4, 0)];
        let g = groups(&prompts, 100);
        let shape: Vec<(usize, usize, usize)> =
            g.iter().map(|(p, at, t)| (p.len(), *at, *t)).collect();
        assert_eq!(shape, [(2, 0, 90), (1, 90, 20), (2, 110, 100)]);
    }
}
