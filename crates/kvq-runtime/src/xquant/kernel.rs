//! [`XQuantKernel`]: the fused XQuant decode and its combine for one scheme and shape.

use super::device_cache::XQuantDeviceCache;
use super::paged::XQuantPagedCache;
use super::weights::{invalid, XQuantWeights};
use super::XQuantScratch;
use crate::decode::CacheView;
use crate::error::{Result, RuntimeError};
use crate::jit::Jit;
use crate::launch::{allow_dynamic_shared, launch_err, unit_source, Args};
use crate::nvrtc::CompileOptions;
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

/// A launch's queries, outputs and split partials.
struct Io<'a> {
    q: &'a CudaSlice<u16>,
    out: &'a mut CudaSlice<u16>,
    splits: usize,
    scratch: &'a mut XQuantScratch,
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
    /// second one), then as few as cover the same tiles a split (no empty splits).
    pub fn default_splits(&self, batch: usize, max_len: usize) -> usize {
        let tiles =
            max_len.div_ceil(kvq_codegen::xquant_tile(self.generated.shape.head_dim) as usize);
        one_wave_splits(self.sm_count as usize, batch * self.kv_heads, tiles)
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
        let base = cache.base.as_ref().map(|(k, v)| (k, v, cache.base_rows));
        let io = Io {
            q,
            out,
            splits,
            scratch,
        };
        self.launch(stream, cache.latents.view(), &cache.weights, base, io)
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
        let io = Io {
            q,
            out,
            splits,
            scratch,
        };
        self.launch(stream, cache.latents().view(), cache.weights(), None, io)
    }

    fn launch(
        &self,
        stream: &Arc<CudaStream>,
        view: CacheView<'_>,
        weights: &XQuantWeights,
        base: Option<(&CudaSlice<f32>, &CudaSlice<f32>, usize)>,
        io: Io<'_>,
    ) -> Result<()> {
        let Io {
            q,
            out,
            splits,
            scratch,
        } = io;
        let shape = self.generated.shape;
        let d = shape.head_dim as usize;
        let w = weights;
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
        let batch = view.batch;
        let q_heads = self.kv_heads * shape.gqa as usize;
        let need = batch * q_heads * d;
        if q.len() != need || out.len() != need {
            return Err(invalid(format!(
                "q and out must hold [batch {batch}][q_heads {q_heads}][head_dim {d}] = {need} \
                 values, got {} and {}",
                q.len(),
                out.len()
            )));
        }
        if splits == 0 || splits > 1024 {
            return Err(invalid(format!("{splits} splits (1 to 1024)")));
        }
        scratch.reserve(stream, batch * q_heads * splits, d)?;
        let max_pages = i32::try_from(view.max_pages)
            .map_err(|_| invalid(format!("{} pages", view.max_pages)))?;
        let base_rows = base.map_or(0, |b| b.2);
        let base_rows = i32::try_from(base_rows)
            .map_err(|_| invalid(format!("{base_rows} accumulator rows")))?;
        let cfg = LaunchConfig {
            grid_dim: (splits as u32, self.kv_heads as u32, batch as u32),
            block_dim: (self.generated.decode.block, 1, 1),
            shared_mem_bytes: self.generated.decode.dynamic_shared_bytes,
        };
        let mut args = Args::new(stream);
        args.buffer(q)
            .buffer(view.k_pool)
            .buffer(view.v_pool)
            .buffer(view.page_table)
            .int(max_pages)
            .buffer(view.k_sink)
            .buffer(view.v_sink)
            .buffer(view.k_tail)
            .buffer(view.v_tail)
            .buffer(view.seq_lens)
            .null()
            .buffer(&w.up_k_hi)
            .buffer(&w.up_k_lo)
            .buffer(&w.up_k_groups)
            .buffer(&w.up_v)
            .buffer(&w.rope_freq);
        match base {
            Some((k, v, _)) => args.buffer(k).buffer(v),
            None => args.null().null(),
        };
        args.int(base_rows)
            .buffer_mut(&mut scratch.part_acc)
            .buffer_mut(&mut scratch.part_ml);
        // SAFETY: the arguments follow the decode entry's params; the latents were uploaded for
        // this batch, the partials reserved for this grid.
        unsafe { args.launch(&self.decode, cfg, false) }
            .map_err(launch_err(&self.generated.decode.name))?;
        scratch.combine(
            stream,
            &self.combine,
            &self.generated.combine,
            out,
            (q_heads, batch),
            splits,
        )
    }
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
