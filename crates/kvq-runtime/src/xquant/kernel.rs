//! [`XQuantKernel`]: the fused XQuant decode and its combine for one scheme and shape.

use super::device_cache::XQuantDeviceCache;
use super::paged::XQuantPagedCache;
use super::weights::{invalid, XQuantWeightInputs};
use super::XQuantScratch;
use crate::decode::{CacheArgs, CachePtrs, CacheView};
use crate::error::{Result, RuntimeError};
use crate::jit::Jit;
use crate::launch::{allow_dynamic_shared, launch_err, unit_source, Args, Input, Output};
use crate::nvrtc::CompileOptions;
use crate::split_scratch::combine;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig};
use kvq_codegen::{xquant_kernels, KernelShape, RebuildMma, RebuildPrecision, XQuantKernels};
use kvq_jit::ArchVariant;
use kvq_spec::SchemeSpec;
use std::sync::Arc;

/// An XQuant scheme's decode and combine kernels for one shape, compiled and loaded.
pub struct XQuantKernel {
    generated: XQuantKernels,
    spec: SchemeSpec,
    kv_heads: usize,
    sm_count: u32,
    decode: CudaFunction,
    combine: CudaFunction,
}

/// One decode launch's buffers: kvq's allocations or an engine's device addresses.
struct Launch<'a> {
    cache: CacheArgs<'a>,
    /// Rows of the batch (grid z).
    batch: usize,
    /// `[batch]` i32 sequence slots (−1: a padding row), or `Raw(0)`: row i is slot i.
    slots: Input<'a, i32>,
    weights: XQuantWeightInputs<'a>,
    /// XQuant-CL's accumulator latents (K, V) and their rows a slot.
    base: Option<(Input<'a, u16>, Input<'a, u16>, usize)>,
    q: Input<'a, u16>,
    out: Output<'a, u16>,
    /// `[batch][q_heads]` f32 log-sum-exps, or `Raw(0)`.
    lse: Output<'a, f32>,
    splits: usize,
    part_acc: Output<'a, f32>,
    part_ml: Output<'a, f32>,
}

/// Splits of `tiles` tiles for `pairs` (sequence, KV head) pairs on `sms` SMs at one CTA an SM:
/// the most that fit one wave, then the fewest that give each split the same number of tiles.
fn one_wave_splits(sms: usize, pairs: usize, tiles: usize) -> usize {
    let tiles = tiles.max(1);
    let want = (sms / pairs.max(1)).clamp(1, tiles);
    tiles.div_ceil(tiles.div_ceil(want))
}

impl XQuantKernel {
    /// Generates, compiles (through the JIT's caches) and loads the decode of `spec` for `shape`
    /// over caches of `kv_heads` KV heads whose layer input is `d_model` wide, K rebuilt at
    /// `precision`.
    pub fn load(
        jit: &Jit,
        spec: &SchemeSpec,
        shape: &KernelShape,
        kv_heads: usize,
        d_model: usize,
        precision: RebuildPrecision,
    ) -> Result<Self> {
        let narrow = |x: usize, what: &str| {
            u32::try_from(x).map_err(|_| invalid(format!("{what} {x} past u32")))
        };
        // Warpgroup MMAs exist on sm_90a only (not on later architectures' `a` targets).
        let arch = jit.arch();
        let hopper = arch.compute_capability() == (9, 0) && arch.variant() == ArchVariant::Specific;
        let (kv_heads32, d_model32) = (narrow(kv_heads, "KV heads")?, narrow(d_model, "d_model")?);
        let mma = RebuildMma::best(spec, shape, (kv_heads32, d_model32), precision, hopper);
        let generated = xquant_kernels(spec, shape, kv_heads32, d_model32, (precision, mma))?;
        let source = unit_source(&generated.decode.name, &generated.source);
        let names = [
            generated.decode.name.as_str(),
            generated.combine.name.as_str(),
        ];
        let mut functions = jit
            .functions(&source, &names, &CompileOptions::default())?
            .into_iter();
        let (Some(decode), Some(combine)) = (functions.next(), functions.next()) else {
            return Err(invalid("kernel list shorter than requested".into()));
        };
        allow_dynamic_shared(&decode, &generated.decode)?;
        Ok(Self {
            generated,
            spec: *spec,
            kv_heads,
            sm_count: jit.device().props().sm_count,
            decode,
            combine,
        })
    }

    /// The generated source and launch metadata.
    pub fn generated(&self) -> &XQuantKernels {
        &self.generated
    }

    /// Splits for `batch` sequences of at most `max_len` tokens: as many as fit one wave of one
    /// CTA an SM (the decode holds an SM's registers alone; a CTA past the wave costs a whole
    /// second one; a CTA a sequence and KV head, or pair of KV heads where the decode pairs
    /// them), then as few as cover the same tiles a split (no empty splits).
    pub fn default_splits(&self, batch: usize, max_len: usize) -> usize {
        let tiles =
            max_len.div_ceil(kvq_codegen::xquant_tile(self.generated.shape.head_dim) as usize);
        let ctas = batch * self.kv_heads / self.generated.kv_heads_per_cta;
        one_wave_splits(self.sm_count as usize, ctas, tiles)
    }

    /// The compiled decode's registers a thread, local-memory bytes a thread (spills) and CTAs
    /// an SM can hold at its shared memory.
    pub fn footprint(&self) -> Result<(i32, i32, u32)> {
        let err = |what: &'static str| move |e| RuntimeError::driver(what, e);
        let regs = self
            .decode
            .num_regs()
            .map_err(err("read the decode's registers"))?;
        let local = self
            .decode
            .local_size_bytes()
            .map_err(err("read the decode's local memory"))?;
        let ctas = self
            .decode
            .occupancy_max_active_blocks_per_multiprocessor(
                self.generated.decode.block,
                self.generated.decode.dynamic_shared_bytes as usize,
                None,
            )
            .map_err(err("read the decode's occupancy"))?;
        Ok((regs, local, ctas))
    }

    /// Enqueues decode attention for every sequence of `cache`: `q` and `out` are
    /// `[batch][kv_heads·gqa][head_dim]` in the kernel's dtype; `splits` parts a (sequence, KV
    /// head), merged by the combine.
    pub fn attend(
        &self,
        stream: &Arc<CudaStream>,
        cache: &XQuantDeviceCache,
        q: &CudaSlice<u16>,
        out: &mut CudaSlice<u16>,
        splits: usize,
        scratch: &mut XQuantScratch,
    ) -> Result<()> {
        let base = cache
            .base
            .as_ref()
            .map(|(k, v)| (Input::Slice(k), Input::Slice(v), cache.base_rows));
        let view = cache.latents.view();
        self.attend_slices(
            stream,
            view,
            cache.weights.inputs(),
            base,
            (q, out),
            splits,
            scratch,
        )
    }

    /// As [`attend`](Self::attend) over a cache written on the device: every sequence slot is a
    /// row of the batch (`q`/`out` are `[max_seqs][kv_heads·gqa][head_dim]`).
    pub fn attend_paged(
        &self,
        stream: &Arc<CudaStream>,
        cache: &XQuantPagedCache,
        q: &CudaSlice<u16>,
        out: &mut CudaSlice<u16>,
        splits: usize,
        scratch: &mut XQuantScratch,
    ) -> Result<()> {
        let view = cache.latents().view();
        let weights = cache.weights().inputs();
        let base = cache
            .accumulator_latents()
            .map(|(k, v, rows)| (Input::Slice(k), Input::Slice(v), rows));
        self.attend_slices(stream, view, weights, base, (q, out), splits, scratch)
    }

    #[allow(clippy::too_many_arguments)]
    fn attend_slices(
        &self,
        stream: &Arc<CudaStream>,
        view: CacheView<'_>,
        weights: XQuantWeightInputs<'_>,
        base: Option<(Input<'_, u16>, Input<'_, u16>, usize)>,
        (q, out): (&CudaSlice<u16>, &mut CudaSlice<u16>),
        splits: usize,
        scratch: &mut XQuantScratch,
    ) -> Result<()> {
        let d = self.generated.shape.head_dim as usize;
        let q_heads = self.kv_heads * self.generated.shape.gqa as usize;
        let batch = view.batch;
        let need = batch * q_heads * d;
        if q.len() != need || out.len() != need {
            return Err(invalid(format!(
                "q and out must hold [batch {batch}][q_heads {q_heads}][head_dim {d}] = {need} \
                 values, got {} and {}",
                q.len(),
                out.len()
            )));
        }
        check_splits(splits)?;
        scratch.reserve(stream, batch * q_heads * splits, d)?;
        self.launch(
            stream,
            Launch {
                cache: CacheArgs::from(view),
                batch,
                slots: Input::Raw(0),
                weights,
                base,
                q: Input::Slice(q),
                out: Output::Slice(out),
                lse: Output::Raw(0),
                splits,
                part_acc: Output::Slice(&mut scratch.part_acc),
                part_ml: Output::Slice(&mut scratch.part_ml),
            },
        )
    }

    /// Bytes of the split partials an attend of `n` sequences in `splits` splits takes from a
    /// workspace ([`attend_raw`](Self::attend_raw)).
    pub fn workspace_bytes(&self, n: usize, splits: usize) -> usize {
        let parts = n * self.kv_heads * self.generated.shape.gqa as usize * splits;
        (4 * parts * self.generated.shape.head_dim as usize).next_multiple_of(256) + 8 * parts
    }

    /// Attention of one query token for each of `n` sequences over an engine's latent store
    /// (`cache`: `rank / store_width` heads of `store_width` channels) with the projections of
    /// `weights` and, for XQuant-CL, the accumulator's latents `base` (K's and V's f16
    /// `[slots][rows a slot][rank]`, and those rows a slot): `q`, `out` `[n][q_heads][head_dim]` in the kernel's dtype, sequence `i` in slot
    /// `slots[i]` (device i32; −1: a padding row of zeros), `lse` (0: not written) `[n][q_heads]`
    /// f32, in `splits` splits whose partials use `workspace`. No host synchronisation:
    /// capturable in a CUDA graph.
    ///
    /// # Safety
    /// Every address is device memory of `stream`'s context of the sizes above (the cache's of
    /// its plan, `workspace` at least [`workspace_bytes`](Self::workspace_bytes)), alive until the
    /// launches have run; `weights` lies in such memory too.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn attend_raw(
        &self,
        stream: &Arc<CudaStream>,
        cache: &CachePtrs,
        (weights, base): (XQuantWeightInputs<'_>, Option<(u64, u64, usize)>),
        n: usize,
        slots: u64,
        (q, out, lse): (u64, u64, u64),
        splits: usize,
        workspace: u64,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        check_splits(splits)?;
        let parts = n * self.kv_heads * self.generated.shape.gqa as usize * splits;
        let part_ml = workspace
            + (4 * parts * self.generated.shape.head_dim as usize).next_multiple_of(256) as u64;
        self.launch(
            stream,
            Launch {
                cache: CacheArgs::from(cache),
                batch: n,
                slots: Input::Raw(slots),
                weights,
                base: base.map(|(k, v, rows)| (Input::Raw(k), Input::Raw(v), rows)),
                q: Input::Raw(q),
                out: Output::Raw(out),
                lse: Output::Raw(lse),
                splits,
                part_acc: Output::Raw(workspace),
                part_ml: Output::Raw(part_ml),
            },
        )
    }

    fn launch(&self, stream: &Arc<CudaStream>, l: Launch<'_>) -> Result<()> {
        let shape = self.generated.shape;
        let d = shape.head_dim as usize;
        let w = &l.weights;
        if w.spec != self.spec
            || w.kv_heads != self.kv_heads
            || w.head_dim != d
            || w.rank != self.generated.rank
        {
            return Err(invalid(format!(
                "cache holds `{}` with {} KV heads of {} and latents of {}; the kernel is for `{}` \
                 with {} of {d} and latents of {}",
                w.spec, w.kv_heads, w.head_dim, w.rank, self.spec, self.kv_heads, self.generated.rank
            )));
        }
        let rows = u32::try_from(l.batch)
            .ok()
            .filter(|&r| r <= u16::MAX as u32)
            .ok_or_else(|| invalid(format!("{} sequences (at most 65535)", l.batch)))?;
        let q_heads = self.kv_heads * shape.gqa as usize;
        let max_pages = i32::try_from(l.cache.max_pages)
            .map_err(|_| invalid(format!("{} pages", l.cache.max_pages)))?;
        let base_rows = l.base.map_or(0, |b| b.2);
        let base_rows = i32::try_from(base_rows)
            .map_err(|_| invalid(format!("{base_rows} accumulator rows")))?;
        let cfg = LaunchConfig {
            grid_dim: (
                l.splits as u32,
                (self.kv_heads / self.generated.kv_heads_per_cta) as u32,
                rows,
            ),
            block_dim: (self.generated.decode.block, 1, 1),
            shared_mem_bytes: self.generated.decode.dynamic_shared_bytes,
        };
        let c = l.cache;
        let Launch {
            mut part_acc,
            mut part_ml,
            ..
        } = l;
        let mut args = Args::new(stream);
        args.input(l.q)
            .input(c.k_pool)
            .input(c.v_pool)
            .input(c.page_table)
            .int(max_pages)
            .input(c.k_sink)
            .input(c.v_sink)
            .input(c.k_tail)
            .input(c.v_tail)
            .input(c.seq_lens)
            .input(l.slots)
            .input(w.up_k_hi)
            .input(w.up_k_lo)
            .input(w.up_k_groups)
            .input(w.up_v)
            .input(w.rope_freq);
        match l.base {
            Some((k, v, _)) => args.input(k).input(v),
            None => args.null().null(),
        };
        args.int(base_rows)
            .output(part_acc.reborrow())
            .output(part_ml.reborrow());
        // SAFETY: the arguments follow the decode entry's params; the callers checked or vouch
        // for the cache, the queries and the partials' room for this grid.
        unsafe { args.launch(&self.decode, cfg, false) }
            .map_err(launch_err(&self.generated.decode.name))?;
        let parts = (part_acc.as_input(), part_ml.as_input());
        // SAFETY: the decode just wrote `splits` partials of every head of these rows.
        unsafe {
            combine(
                stream,
                (&self.combine, &self.generated.combine),
                parts,
                (l.out, l.lse),
                (q_heads, l.batch),
                l.splits,
            )
        }
    }
}

/// A split count the combine takes.
fn check_splits(splits: usize) -> Result<()> {
    if splits == 0 || splits > 1024 {
        return Err(invalid(format!("{splits} splits (1 to 1024)")));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::one_wave_splits;

    #[test]
    fn splits_fill_one_wave_without_empty_ones() {
        // 132 SMs (an H200), 8 KV heads: 16 splits a sequence, never 17 (a second wave).
        assert_eq!(one_wave_splits(132, 8, 32), 16);
        assert_eq!(one_wave_splits(132, 8, 256), 16);
        // A wave of whole pairs already: one split each.
        assert_eq!(one_wave_splits(132, 128, 256), 1);
        assert_eq!(one_wave_splits(132, 1000, 4), 1);
        // Short sequences: no more splits than tiles, and 7 tiles in 5 wanted splits take 4
        // splits of 2 tiles (the fifth would be empty).
        assert_eq!(one_wave_splits(132, 8, 3), 3);
        assert_eq!(one_wave_splits(40, 8, 7), 4);
        assert_eq!(one_wave_splits(132, 0, 0), 1);
    }
}
