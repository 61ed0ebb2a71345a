//! [`XQuantPagedCache`]: an XQuant layer cache written on the device. An append or prefill hands
//! in the new tokens' layer input X; the projector turns it into f16 latent rows and the integer
//! store's own append, prefill and page quantizers (the latent store is an integer cache of
//! `R / W` heads of `W` channels, docs/LAYOUT.md §10) keep them — the FP16 sink and local window
//! hold latents, full pages are quantized exactly as the CPU reference quantizes the same rows.

use super::project::XQuantProjector;
use super::weights::{invalid, XQuantWeights};
use crate::error::{Result, RuntimeError};
use crate::jit::Jit;
use crate::paged::{CacheConfig, MemoryReport, PagedKvCache, Rows, SeqId, SequenceSnapshot};
use cudarc::driver::{CudaSlice, CudaStream};
use kvq_codegen::{latent_spec, Dtype};
use kvq_reference::rope::Rope;
use kvq_reference::xquant::Projections;
use kvq_spec::{CacheSource, SchemeSpec, XSource};
use std::sync::Arc;

/// Sizes of an XQuant cache, fixed at creation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XQuantCacheConfig {
    /// Sequence slots.
    pub max_seqs: usize,
    /// Physical pages in the pool (each holds `page` tokens of both latents).
    pub pool_pages: usize,
    /// Longest sequence a slot can hold.
    pub max_tokens: usize,
    /// Element type of the layer input X handed to append and prefill.
    pub input_dtype: Dtype,
}

/// Refuses a scheme whose caches the device cannot write from the layer input: XQuant-CL
/// (`x(cross_layer)`), whose writes need the decoder's accumulator of the previous layers'
/// reconstructions, which has no cheap home on the device (docs/CODEBOOKS.md §3.1), and K/V caches.
pub(super) fn check_writable(spec: &SchemeSpec) -> Result<()> {
    match spec.source {
        CacheSource::X(XSource::Latent) => Ok(()),
        CacheSource::X(XSource::CrossLayer) => Err(invalid(format!(
            "`{spec}`: XQuant-CL's cache writes are not built on the GPU (its \
                 accumulator of earlier layers has no cheap home, docs/CODEBOOKS.md §3.1); \
                 build the caches with the CPU reference and upload them \
                 (XQuantDeviceCache)"
        ))),
        CacheSource::Kv => Err(invalid(format!(
            "`{spec}` caches K and V: use PagedKvCache"
        ))),
    }
}

/// One layer's XQuant cache (`source = x(latent)`) in device memory, written from the layer
/// input on the device.
///
/// ```no_run
/// # fn demo(jit: &kvq_runtime::Jit, spec: &kvq_spec::SchemeSpec,
/// #         p: &kvq_reference::xquant::Projections,
/// #         x_prompt: &cudarc::driver::CudaSlice<u16>, x_step: &cudarc::driver::CudaSlice<u16>)
/// #         -> kvq_runtime::Result<()> {
/// use kvq_codegen::Dtype;
/// use kvq_runtime::xquant::{XQuantCacheConfig, XQuantPagedCache};
/// let stream = jit.device().default_stream();
/// let cfg = XQuantCacheConfig { max_seqs: 8, pool_pages: 4096, max_tokens: 32768,
///                               input_dtype: Dtype::F16 };
/// let mut cache = XQuantPagedCache::new(jit, stream, spec, p, Default::default(), cfg)?;
/// let seq = cache.add_sequence()?;
/// cache.prefill(seq, x_prompt, 100, Dtype::F16)?;  // [100][d_model]
/// cache.append(&[seq], x_step, Dtype::F16)?;       // [1][d_model]
/// # Ok(()) }
/// ```
pub struct XQuantPagedCache {
    latents: PagedKvCache,
    weights: XQuantWeights,
    projector: XQuantProjector,
    stream: Arc<CudaStream>,
    /// Latent rows (K, V) for the largest step so far, grown as needed; a step uses the first.
    rows: Option<(CudaSlice<u16>, CudaSlice<u16>)>,
}

impl XQuantPagedCache {
    /// Compiles (or loads) the projection and the latent store's kernels and allocates the cache.
    /// XQuant-CL (`x(cross_layer)`) is refused: its writes need the decoder's accumulator of the
    /// previous layers' reconstructions, which has no cheap home on the device
    /// (docs/CODEBOOKS.md §3.1); its caches are built by the CPU reference and uploaded.
    pub fn new(
        jit: &Jit,
        stream: Arc<CudaStream>,
        spec: &SchemeSpec,
        projections: &Projections,
        rope: Rope,
        cfg: XQuantCacheConfig,
    ) -> Result<Self> {
        check_writable(spec)?;
        let weights =
            XQuantWeights::upload(&stream, spec, projections, rope, Some(cfg.input_dtype))?;
        let projector = XQuantProjector::load(jit, cfg.input_dtype, weights.d_model, weights.rank)?;
        let latents = PagedKvCache::new(
            jit,
            stream.clone(),
            &latent_spec(spec),
            CacheConfig {
                kv_heads: weights.rank / weights.store_width,
                head_dim: weights.store_width,
                max_seqs: cfg.max_seqs,
                pool_pages: cfg.pool_pages,
                max_tokens: cfg.max_tokens,
                input_dtype: Dtype::F16,
            },
        )?;
        Ok(Self {
            latents,
            weights,
            projector,
            stream,
            rows: None,
        })
    }

    /// A new empty sequence.
    pub fn add_sequence(&mut self) -> Result<SeqId> {
        self.latents.add_sequence()
    }

    /// Frees a sequence's slot and pages.
    pub fn remove_sequence(&mut self, id: SeqId) -> Result<()> {
        self.latents.remove_sequence(id)
    }

    /// Tokens a sequence holds.
    pub fn len(&self, id: SeqId) -> Result<usize> {
        self.latents.len(id)
    }

    /// The layer's projections as the kernels read them.
    pub fn weights(&self) -> &XQuantWeights {
        &self.weights
    }

    /// The latents' integer store (`rank / store_width` heads of `store_width` channels).
    pub fn latents(&self) -> &PagedKvCache {
        &self.latents
    }

    /// Latent rows for `n` tokens, projected from `x` (`[n][d_model]`) into the first `n` rows
    /// of the reused buffers.
    fn project_rows(
        &mut self,
        x: &CudaSlice<u16>,
        n: usize,
        dtype: Dtype,
    ) -> Result<(&CudaSlice<u16>, &CudaSlice<u16>, &mut PagedKvCache)> {
        if dtype != self.projector.generated().dtype {
            return Err(invalid(format!(
                "X is {dtype} but this cache was created for {} inputs",
                self.projector.generated().dtype
            )));
        }
        let need = n * self.weights.rank;
        if self.rows.as_ref().map_or(true, |(k, _)| k.len() < need) {
            let alloc = |what: &str| {
                self.stream
                    .alloc_zeros::<u16>(need)
                    .map_err(|e| RuntimeError::driver(what.to_string(), e))
            };
            let k = alloc("allocate K latent rows")?;
            self.rows = Some((k, alloc("allocate V latent rows")?));
        }
        let Some((k, v)) = self.rows.as_mut() else {
            return Err(invalid("no latent rows".into()));
        };
        self.projector
            .project(&self.stream, &self.weights, x, n, k, v)?;
        Ok((k, v, &mut self.latents))
    }

    /// Appends one token to each listed sequence from its layer input (`x`: `[ids.len()][d_model]`,
    /// row i for `ids[i]`): projected to latents, written to the FP16 regions, and a page
    /// quantized where the token completes one.
    pub fn append(&mut self, ids: &[SeqId], x: &CudaSlice<u16>, dtype: Dtype) -> Result<()> {
        if ids.is_empty() {
            return Ok(());
        }
        let (k, v, store) = self.project_rows(x, ids.len(), dtype)?;
        store.append_rows(ids, k, v, Dtype::F16, Rows::AtLeast)
    }

    /// Bulk prefill of an empty sequence from a prompt's layer input (`x`: `[tokens][d_model]`).
    pub fn prefill(
        &mut self,
        id: SeqId,
        x: &CudaSlice<u16>,
        tokens: usize,
        dtype: Dtype,
    ) -> Result<()> {
        if tokens == 0 {
            return Ok(());
        }
        let (k, v, store) = self.project_rows(x, tokens, dtype)?;
        store.prefill_rows(&[(id, tokens)], k, v, Dtype::F16, Rows::AtLeast)
    }

    /// The f16 latent rows (`[n][rank]` each, K then V) the projection writes for `x`: what an
    /// append or prefill of the same rows stores (tests; a sync and a download).
    pub fn project(
        &mut self,
        x: &CudaSlice<u16>,
        n: usize,
        dtype: Dtype,
    ) -> Result<(Vec<u16>, Vec<u16>)> {
        if n == 0 {
            return Ok((Vec::new(), Vec::new()));
        }
        let stream = self.stream.clone();
        let rows = n * self.weights.rank;
        let (k, v, _) = self.project_rows(x, n, dtype)?;
        let down = |s: &CudaSlice<u16>| {
            stream
                .clone_dtoh(&s.slice(..rows))
                .map_err(|e| RuntimeError::driver("download latent rows", e))
        };
        Ok((down(k)?, down(v)?))
    }

    /// One sequence's latent store, copied back (tests, debugging).
    pub fn snapshot(&self, id: SeqId) -> Result<SequenceSnapshot> {
        self.latents.snapshot(id)
    }

    /// Allocated memory and what the live sequences occupy (the projections not included).
    pub fn memory(&self) -> Result<MemoryReport> {
        self.latents.memory()
    }

    /// Longest sequence held.
    pub fn max_len(&self) -> usize {
        self.latents.max_len()
    }
}
