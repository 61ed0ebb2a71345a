//! [`XQuantPagedCache`]: an XQuant layer cache written on the device. An append or prefill hands
//! in the new tokens' layer input X; the projector turns it into f16 latent rows and the integer
//! store's own append, prefill and page quantizers (the latent store is an integer cache of
//! `R / W` heads of `W` channels, docs/LAYOUT.md §10) keep them — the FP16 sink and local window
//! hold latents, full pages are quantized exactly as the CPU reference quantizes the same rows.
//! XQuant-CL (`x(cross_layer)`) stores the latents of `X − X̂` instead, X̂ the accumulator the
//! engine carries from layer to layer, and keeps X̂'s latents per token (`CrossLayerWrites`).

use super::cross_layer::{CrossLayerWrites, NewRows};
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

/// The tokens an XQuant-CL write adds: one to each of an append's slots, or a prefill's.
enum Written<'a> {
    Append(&'a [i32]),
    Prefill(SeqId),
}

/// Refuses a K/V scheme (those caches are [`PagedKvCache`]s).
fn check_writable(spec: &SchemeSpec) -> Result<()> {
    match spec.source {
        CacheSource::X(_) => Ok(()),
        CacheSource::Kv => Err(invalid(format!(
            "`{spec}` caches K and V: use PagedKvCache"
        ))),
    }
}

/// One layer's XQuant cache in device memory, written from the layer input on the device.
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
///
/// XQuant-CL (`x(cross_layer)`): every write also takes the accumulator `X̂` of the new tokens,
/// `[n][d_model]` in X's dtype (zeros at the first layer of the chain), and replaces it with this
/// layer's, which the engine hands to the next layer's cache:
///
/// ```no_run
/// # fn demo(layers: &mut [kvq_runtime::xquant::XQuantPagedCache],
/// #         seq: kvq_runtime::SeqId, x_of_layer: &[cudarc::driver::CudaSlice<u16>],
/// #         x_hat: &mut cudarc::driver::CudaSlice<u16>) -> kvq_runtime::Result<()> {
/// use kvq_codegen::Dtype;
/// // x_hat: [1][d_model] zeros before the first layer of the step.
/// for (cache, x) in layers.iter_mut().zip(x_of_layer) {
///     cache.append_cross_layer(&[seq], x, x_hat, Dtype::F16)?;
/// }
/// # Ok(()) }
/// ```
pub struct XQuantPagedCache {
    latents: PagedKvCache,
    weights: XQuantWeights,
    projector: XQuantProjector,
    stream: Arc<CudaStream>,
    /// Latent rows (K, V) for the largest step so far, grown as needed; a step uses the first.
    rows: Option<(CudaSlice<u16>, CudaSlice<u16>)>,
    /// XQuant-CL's writes and per-token accumulator latents.
    cross_layer: Option<CrossLayerWrites>,
}

impl XQuantPagedCache {
    /// Compiles (or loads) the projection and the latent store's kernels and allocates the cache;
    /// XQuant-CL's also the accumulator's latents of every token it can hold, f16
    /// `2 · max_seqs · max_tokens · R` (docs/CODEBOOKS.md §3.1), and the layer's lift matrix.
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
        let cross_layer = match spec.source {
            CacheSource::X(XSource::CrossLayer) => Some(CrossLayerWrites::new(
                jit,
                &stream,
                projections,
                cfg.input_dtype,
                (cfg.max_seqs, cfg.max_tokens),
            )?),
            _ => None,
        };
        Ok(Self {
            latents,
            weights,
            projector,
            stream,
            rows: None,
            cross_layer,
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
        self.check_dtype(dtype)?;
        self.reserve_rows(n)?;
        let Some((k, v)) = self.rows.as_mut() else {
            return Err(invalid("no latent rows".into()));
        };
        self.projector
            .project(&self.stream, &self.weights, x, n, k, v)?;
        Ok((k, v, &mut self.latents))
    }

    fn check_dtype(&self, dtype: Dtype) -> Result<()> {
        if dtype != self.projector.generated().dtype {
            return Err(invalid(format!(
                "X is {dtype} but this cache was created for {} inputs",
                self.projector.generated().dtype
            )));
        }
        Ok(())
    }

    /// Grows the reused latent rows to `n` tokens.
    fn reserve_rows(&mut self, n: usize) -> Result<()> {
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
        Ok(())
    }

    /// Refuses X and X̂ of another dtype or not `n` rows of d_model each.
    fn check_cross_layer_rows(
        &self,
        x: &CudaSlice<u16>,
        x_hat: &CudaSlice<u16>,
        n: usize,
        dtype: Dtype,
    ) -> Result<()> {
        self.check_dtype(dtype)?;
        let need = n * self.weights.d_model;
        if x.len() != need || x_hat.len() != need {
            return Err(invalid(format!(
                "x and x_hat must hold [n {n}][d_model {}] = {need} values each, got {} and {}",
                self.weights.d_model,
                x.len(),
                x_hat.len()
            )));
        }
        Ok(())
    }

    /// Refuses a write of the other source's kind.
    fn check_kind(&self, cross_layer: bool) -> Result<()> {
        match (self.cross_layer.is_some(), cross_layer) {
            (true, false) => Err(invalid(
                "an XQuant-CL cache stores deltas against the accumulator: write it with \
                 append_cross_layer / prefill_cross_layer"
                    .into(),
            )),
            (false, true) => Err(invalid(
                "this cache stores the layer input's latents (x(latent)): write it with append / \
                 prefill"
                    .into(),
            )),
            _ => Ok(()),
        }
    }

    /// Appends one token to each listed sequence from its layer input (`x`: `[ids.len()][d_model]`,
    /// row i for `ids[i]`): projected to latents, written to the FP16 regions, and a page
    /// quantized where the token completes one.
    pub fn append(&mut self, ids: &[SeqId], x: &CudaSlice<u16>, dtype: Dtype) -> Result<()> {
        self.check_kind(false)?;
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
        self.check_kind(false)?;
        if tokens == 0 {
            return Ok(());
        }
        let (k, v, store) = self.project_rows(x, tokens, dtype)?;
        store.prefill_rows(&[(id, tokens)], k, v, Dtype::F16, Rows::AtLeast)
    }

    /// XQuant-CL: appends one token to each listed sequence from its layer input `x` and the
    /// accumulator `x_hat` of the earlier layers (`[ids.len()][d_model]` each, row i for
    /// `ids[i]`; zeros at the chain's first layer). Stores the latents of `x − x_hat` as
    /// [`append`](Self::append) stores X's, keeps `x_hat`'s latents for the decode, and replaces
    /// `x_hat` with this layer's accumulator for the next layer. On an error nothing is stored
    /// and `x_hat` is unchanged.
    pub fn append_cross_layer(
        &mut self,
        ids: &[SeqId],
        x: &CudaSlice<u16>,
        x_hat: &mut CudaSlice<u16>,
        dtype: Dtype,
    ) -> Result<()> {
        self.check_kind(true)?;
        if ids.is_empty() {
            return Ok(());
        }
        let slots: Vec<i32> = ids.iter().map(|id| id.0 as i32).collect();
        for &id in ids {
            self.latents.len(id)?;
        }
        self.write_cross_layer(
            (x, x_hat, ids.len()),
            dtype,
            Written::Append(&slots),
            |s, k, v| s.append_rows(ids, k, v, Dtype::F16, Rows::AtLeast),
        )
    }

    /// XQuant-CL: bulk prefill of an empty sequence from a prompt's layer input `x` and the
    /// accumulator `x_hat` (`[tokens][d_model]` each), replaced with this layer's, as
    /// [`append_cross_layer`](Self::append_cross_layer) does for one token.
    pub fn prefill_cross_layer(
        &mut self,
        id: SeqId,
        x: &CudaSlice<u16>,
        x_hat: &mut CudaSlice<u16>,
        tokens: usize,
        dtype: Dtype,
    ) -> Result<()> {
        self.check_kind(true)?;
        if tokens == 0 {
            return Ok(());
        }
        // The accumulator's rows are written before the store takes the prompt: refuse here
        // what the store would refuse after them.
        let (len, max_tokens) = (self.latents.len(id)?, self.latents.config().max_tokens);
        if len != 0 || tokens > max_tokens {
            return Err(invalid(format!(
                "a prefill takes an empty sequence and at most {max_tokens} tokens; sequence {} \
                 holds {len} and the prompt has {tokens}",
                id.0
            )));
        }
        self.write_cross_layer(
            (x, x_hat, tokens),
            dtype,
            Written::Prefill(id),
            |s, k, v| s.prefill_rows(&[(id, tokens)], k, v, Dtype::F16, Rows::AtLeast),
        )
    }

    /// The XQuant-CL write of `n` tokens: deltas projected to latents, the accumulator's latents
    /// into their rows (an append's at its slots' next positions, a prefill's from its
    /// sequence's first row), the deltas' latents stored by `store` (all or
    /// nothing: a refused store leaves rows past the sequences' lengths, which nothing reads),
    /// then the accumulator lifted.
    fn write_cross_layer(
        &mut self,
        (x, x_hat, n): (&CudaSlice<u16>, &mut CudaSlice<u16>, usize),
        dtype: Dtype,
        at: Written<'_>,
        store: impl FnOnce(&mut PagedKvCache, &CudaSlice<u16>, &CudaSlice<u16>) -> Result<()>,
    ) -> Result<()> {
        self.check_cross_layer_rows(x, x_hat, n, dtype)?;
        self.reserve_rows(n)?;
        let (Some(cl), Some((k, v))) = (self.cross_layer.as_mut(), self.rows.as_mut()) else {
            return Err(invalid("not an XQuant-CL cache".into()));
        };
        let stream = &self.stream;
        let delta = cl.delta(stream, x, x_hat, n)?;
        self.projector
            .project(stream, &self.weights, delta, n, k, v)?;
        let (ak, av) = cl.acc_rows(stream, n)?;
        self.projector
            .project(stream, &self.weights, x_hat, n, ak, av)?;
        let view = self.latents.view();
        let rows = match at {
            Written::Append(slots) => NewRows::Append {
                slots,
                seq_lens: view.seq_lens,
            },
            Written::Prefill(id) => NewRows::From(id.0 as usize * cl.max_tokens),
        };
        cl.store_base(stream, rows, n)?;
        store(&mut self.latents, k, v)?;
        cl.lift(stream, x_hat, (k, v), n)
    }

    /// The f16 latent rows (`[n][rank]` each, K then V) the projection writes for `x`: what an
    /// append or prefill of the same rows stores (tests; a sync and a download).
    pub fn project(
        &mut self,
        x: &CudaSlice<u16>,
        n: usize,
        dtype: Dtype,
    ) -> Result<(Vec<u16>, Vec<u16>)> {
        self.check_kind(false)?;
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

    /// XQuant-CL: the f16 delta latent rows (`[n][rank]` each, K then V) that
    /// [`append_cross_layer`](Self::append_cross_layer) or a prefill stores for `x` and the
    /// accumulator `x_hat` (tests; nothing is stored, `x_hat` is unchanged; a sync and a
    /// download).
    pub fn project_cross_layer(
        &mut self,
        x: &CudaSlice<u16>,
        x_hat: &CudaSlice<u16>,
        n: usize,
        dtype: Dtype,
    ) -> Result<(Vec<u16>, Vec<u16>)> {
        self.check_kind(true)?;
        if n == 0 {
            return Err(invalid("no rows to project".into()));
        }
        self.check_cross_layer_rows(x, x_hat, n, dtype)?;
        self.reserve_rows(n)?;
        let (Some(cl), Some((k, v))) = (self.cross_layer.as_mut(), self.rows.as_mut()) else {
            return Err(invalid("not an XQuant-CL cache".into()));
        };
        let delta = cl.delta(&self.stream, x, x_hat, n)?;
        self.projector
            .project(&self.stream, &self.weights, delta, n, k, v)?;
        let rows = n * self.weights.rank;
        let down = |s: &CudaSlice<u16>| {
            self.stream
                .clone_dtoh(&s.slice(..rows))
                .map_err(|e| RuntimeError::driver("download delta latent rows", e))
        };
        Ok((down(k)?, down(v)?))
    }

    /// One sequence's latent store, copied back (tests, debugging).
    pub fn snapshot(&self, id: SeqId) -> Result<SequenceSnapshot> {
        self.latents.snapshot(id)
    }

    /// Allocated memory and what the live sequences occupy (the projections not included):
    /// the latent store's and, for XQuant-CL, the accumulator's latents (f16, 2R a token) and
    /// the lift matrix.
    pub fn memory(&self) -> Result<MemoryReport> {
        let mut report = self.latents.memory()?;
        if let Some(cl) = &self.cross_layer {
            let rank = self.weights.rank;
            let tokens: usize = (0..self.latents.config().max_seqs)
                .filter_map(|s| self.latents.len(SeqId(s as u32)).ok())
                .sum();
            report.allocated_bytes += cl.device_bytes();
            report.sequence_bytes += tokens * 2 * rank * 2;
            if tokens > 0 {
                // Both latents' f16 rows beside each stored latent element.
                report.bits_per_element += 16.0;
            }
        }
        Ok(report)
    }

    /// XQuant-CL: the accumulator's latents of every token slot, f16
    /// `[max_seqs][max_tokens][rank]` (K, V), with `max_tokens`: what the decode adds to the
    /// stored deltas. `None` for `x(latent)`.
    pub fn accumulator_latents(&self) -> Option<(&CudaSlice<u16>, &CudaSlice<u16>, usize)> {
        self.cross_layer
            .as_ref()
            .map(|c| (&c.base_k, &c.base_v, c.max_tokens))
    }

    /// Longest sequence held.
    pub fn max_len(&self) -> usize {
        self.latents.max_len()
    }
}
