//! XQuant (`source = x(latent)` and `x(cross_layer)`) on the GPU: the fused decode over a batch's
//! latent caches ([`XQuantKernel`], [`XQuantDeviceCache`]). The latents live in the integer store
//! of docs/LAYOUT.md as one "head" of `R` channels; the decode rebuilds K from them per tile on
//! tensor cores and never rebuilds V (docs/CODEBOOKS.md §3.1). XQuant-CL's caches carry their
//! accumulator's latents, which the decode adds to the stored deltas.
//!
//! ```no_run
//! # fn demo(jit: &kvq_runtime::Jit, cache: &kvq_reference::xquant::XQuantCache,
//! #         q: &cudarc::driver::CudaSlice<u16>, out: &mut cudarc::driver::CudaSlice<u16>)
//! #         -> kvq_runtime::Result<()> {
//! use kvq_codegen::{Dtype, KernelShape, RebuildPrecision};
//! use kvq_runtime::xquant::{XQuantDeviceCache, XQuantKernel, XQuantScratch};
//! let p = cache.projections();
//! let shape = KernelShape::new(p.head_dim as u32, 4, Dtype::F16);
//! let kernel = XQuantKernel::load(jit, cache.spec(), &shape, p.kv_heads, p.d_model(),
//!                                 RebuildPrecision::F32)?;
//! let stream = jit.device().default_stream();
//! let gpu = XQuantDeviceCache::upload(&stream, std::slice::from_ref(cache))?;
//! let mut scratch = XQuantScratch::new(&stream)?;
//! kernel.attend(&stream, &gpu, q, out, 4, &mut scratch)?;
//! # Ok(()) }
//! ```

use crate::decode::{upload, GpuCache};
use crate::error::{Result, RuntimeError};
use crate::jit::Jit;
use crate::launch::{allow_dynamic_shared, launch_err, unit_source, Args};
use crate::nvrtc::CompileOptions;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig};
use kvq_codegen::{xquant_kernels, KernelShape, RebuildPrecision, XQuantKernels};
use kvq_reference::xquant::XQuantCache;
use kvq_spec::{CacheSource, SchemeSpec, XSource};
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

/// A batch's XQuant caches in device memory: the latents' integer store, the projections' up
/// factors (`up_k` transposed and split in two f16 halves for the tensor cores, `up_v` in f32) and
/// the RoPE frequencies.
pub struct XQuantDeviceCache {
    spec: SchemeSpec,
    latents: GpuCache,
    kv_heads: usize,
    head_dim: usize,
    rank: usize,
    up_k_hi: CudaSlice<u16>,
    up_k_lo: CudaSlice<u16>,
    up_v: CudaSlice<f32>,
    rope_freq: CudaSlice<f64>,
    /// XQuant-CL: the accumulator's latents (`X̂_{i−1}·down_k`, `·down_v`), f32
    /// `[batch][base_rows][rank]`, which the decode adds to the stored deltas.
    base: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
    base_rows: usize,
}

/// The split partials the XQuant decode writes and its combine reads.
pub type XQuantScratch = crate::split_scratch::SplitScratch;

fn invalid(msg: String) -> RuntimeError {
    RuntimeError::InvalidInput(msg)
}

impl XQuantDeviceCache {
    /// Uploads `caches` (one per sequence, all of one scheme, projections and RoPE).
    pub fn upload(stream: &Arc<CudaStream>, caches: &[XQuantCache]) -> Result<Self> {
        let first = caches
            .first()
            .ok_or_else(|| invalid("a batch of no sequences".into()))?;
        for (i, c) in caches.iter().enumerate() {
            if c.spec() != first.spec()
                || c.projections() != first.projections()
                || c.rope() != first.rope()
            {
                return Err(invalid(format!(
                    "sequence {i} differs from sequence 0 in scheme, projections or RoPE"
                )));
            }
        }
        let stored: Vec<&kvq_reference::int::IntCache> =
            caches.iter().map(|c| c.stored()).collect();
        let latents = GpuCache::upload(stream, &stored)?;
        let base_rows = latents.max_len().max(1);
        let base = match first.spec().source {
            CacheSource::X(XSource::CrossLayer) => {
                let rank = first.projections().k.rank;
                let (mut k, mut v) = (
                    vec![0f32; caches.len() * base_rows * rank],
                    vec![0f32; caches.len() * base_rows * rank],
                );
                for (i, c) in caches.iter().enumerate() {
                    let (bk, bv) = c.accumulator_latents().ok_or_else(|| {
                        invalid(format!(
                            "sequence {i}: a cross-layer cache without its accumulator"
                        ))
                    })?;
                    let at = i * base_rows * rank;
                    k[at..at + bk.len()].copy_from_slice(bk);
                    v[at..at + bv.len()].copy_from_slice(bv);
                }
                Some((
                    upload(stream, &k, 0.0, "the accumulator's K latents")?,
                    upload(stream, &v, 0.0, "the accumulator's V latents")?,
                ))
            }
            _ => None,
        };
        let p = first.projections();
        let (h, d) = (p.kv_heads, p.head_dim);
        let theta = first.rope().theta;
        let freq: Vec<f64> = (0..d / 2)
            .map(|i| theta.powf(-2.0 * i as f64 / d as f64))
            .collect();
        let (hi, lo) = split_transposed(&p.k.up, p.k.rank, p.k.out);
        Ok(Self {
            spec: *first.spec(),
            kv_heads: h,
            head_dim: d,
            rank: p.k.rank,
            up_k_hi: upload(stream, &hi, 0, "up_k (high half)")?,
            up_k_lo: upload(stream, &lo, 0, "up_k (low half)")?,
            up_v: upload(stream, &p.v.up, 0.0, "up_v")?,
            rope_freq: upload(stream, &freq, 0.0, "the RoPE frequencies")?,
            latents,
            base,
            base_rows,
        })
    }

    /// Sequences of the batch.
    pub fn batch(&self) -> usize {
        self.latents.batch()
    }

    /// The longest sequence's tokens.
    pub fn max_len(&self) -> usize {
        self.latents.max_len()
    }

    /// Device bytes of the latents' store (pages, FP16 rows, page table, lengths); the
    /// projections' factors not included.
    pub fn latent_bytes(&self) -> usize {
        self.latents.device_bytes()
    }
}

/// Splits of `tiles` tiles for `pairs` (sequence, KV head) pairs on `sms` SMs at one CTA an SM:
/// the most that fit one wave, then the fewest that give each split the same number of tiles.
fn one_wave_splits(sms: usize, pairs: usize, tiles: usize) -> usize {
    let tiles = tiles.max(1);
    let want = (sms / pairs.max(1)).clamp(1, tiles);
    tiles.div_ceil(tiles.div_ceil(want))
}

/// `up` (`[rank][out]` f32) transposed to `[out][rank]` and split into f16 halves, `x ≈ hi + lo`
/// to about f32's precision (each rounded to nearest), as the tensor-core rebuild reads it.
fn split_transposed(up: &[f32], rank: usize, out: usize) -> (Vec<u16>, Vec<u16>) {
    let (mut hi, mut lo) = (vec![0u16; rank * out], vec![0u16; rank * out]);
    for r in 0..rank {
        for o in 0..out {
            let x = up[r * out + o];
            let h = half::f16::from_f32(x);
            hi[o * rank + r] = h.to_bits();
            lo[o * rank + r] = half::f16::from_f32(x - h.to_f32()).to_bits();
        }
    }
    (hi, lo)
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
        let generated = xquant_kernels(
            spec,
            shape,
            narrow(kv_heads, "KV heads")?,
            narrow(d_model, "d_model")?,
            precision,
        )?;
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
        let shape = self.generated.shape;
        let d = shape.head_dim as usize;
        if cache.spec != self.spec
            || cache.kv_heads != self.kv_heads
            || cache.head_dim != d
            || cache.rank != self.generated.rank
        {
            return Err(invalid(format!(
                "cache holds `{}` with {} KV heads of {} and latents of {}; the kernel is for `{}` \
                 with {} of {d} and latents of {}",
                cache.spec,
                cache.kv_heads,
                cache.head_dim,
                cache.rank,
                self.spec,
                self.kv_heads,
                self.generated.rank
            )));
        }
        let batch = cache.batch();
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
        let view = cache.latents.view();
        let max_pages = i32::try_from(view.max_pages)
            .map_err(|_| invalid(format!("{} pages", view.max_pages)))?;
        let base_rows = i32::try_from(cache.base_rows)
            .map_err(|_| invalid(format!("{} accumulator rows", cache.base_rows)))?;
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
            .buffer(&cache.up_k_hi)
            .buffer(&cache.up_k_lo)
            .buffer(&cache.up_v)
            .buffer(&cache.rope_freq);
        match &cache.base {
            Some((k, v)) => args.buffer(k).buffer(v),
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
