//! Filling a [`CodebookCache`] on the GPU: new tokens' FP16 rows into the sink, the tail ring or
//! FP16 pages, and every page that fills coded by the reference's own encoders (greedy residual for
//! RoPE-commutative keys, iterated conditional modes for binary additive tensors), bit for bit the
//! bytes `CommVqCache::build_rotated(…).device_sequence()` lays out for the same inputs.
//!
//! ```no_run
//! # fn demo(jit: &kvq_runtime::Jit, spec: &kvq_spec::SchemeSpec,
//! #         books: &kvq_reference::commvq::Codebooks,
//! #         k_pre: &cudarc::driver::CudaSlice<u16>, k_post: &cudarc::driver::CudaSlice<u16>,
//! #         v: &cudarc::driver::CudaSlice<u16>) -> kvq_runtime::Result<()> {
//! use kvq_codegen::Dtype;
//! use kvq_runtime::codebook::{CodebookEncoder, EncodeInputs};
//! let stream = jit.device().default_stream();
//! let encoder = CodebookEncoder::load(jit, spec, books, 128, 8, Dtype::F16)?;
//! let mut cache = encoder.new_cache(&stream, 4, 32_768, 10_000.0)?;
//! // 512 prompt tokens of sequence 0: keys before and after RoPE, values, [token][kv_head][128].
//! let prompt = EncodeInputs { k_pre_rope: k_pre, k_post_rope: k_post, v, tokens: 512 };
//! encoder.append(&stream, &mut cache, 0, &prompt)?;
//! # Ok(()) }
//! ```

use super::cache::{alloc, upload, CodebookCache, Pending};
use crate::error::{Result, RuntimeError};
use crate::jit::Jit;
use crate::launch::{launch_err, unit_source, Args};
use crate::nvrtc::CompileOptions;
use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig};
use kvq_codegen::{codebook_encode_kernels, CodebookEncodeKernels, Dtype, KernelEntry};
use kvq_reference::commvq::device::{DeviceCodebooks, SideLayout};
use kvq_reference::commvq::{Codebooks, EncoderTables, SideTables};
use kvq_spec::SchemeSpec;
use std::sync::Arc;

/// New tokens of one sequence, `[token][kv_head][head_dim]` in the encoder's 16-bit format.
pub struct EncodeInputs<'a> {
    /// Keys before RoPE: what RoPE-commutative codes encode (not read for other key sides).
    pub k_pre_rope: &'a CudaSlice<u16>,
    /// Keys after RoPE: the FP16 key rows, and what additive key codes encode.
    pub k_post_rope: &'a CudaSlice<u16>,
    /// Values.
    pub v: &'a CudaSlice<u16>,
    /// Tokens the tensors hold (they may hold more values; the first tokens' are read).
    pub tokens: usize,
}

/// A reference tensor (`[kv_head][token][D]` f32) as the `[token][kv_head][D]` words of `dtype`
/// [`EncodeInputs`] take, each value rounded to nearest.
pub fn input_words(t: &kvq_reference::KvTensor, dtype: Dtype) -> Vec<u16> {
    let (h, d) = (t.kv_heads, t.head_dim);
    let mut out = vec![0u16; t.data.len()];
    for head in 0..h {
        for tok in 0..t.tokens {
            for (c, x) in t.row(head, tok).iter().enumerate() {
                out[(tok * h + head) * d + c] = crate::tune::synth::round_to_word(*x, dtype).0;
            }
        }
    }
    out
}

/// `x` as a kernel's `int`, refused past i32.
fn narrow(what: &str, x: usize) -> Result<i32> {
    i32::try_from(x).map_err(|_| RuntimeError::InvalidInput(format!("{what} {x} past i32")))
}

/// One coded side's page encoder and its tables on the device.
struct SideEncoder {
    function: CudaFunction,
    entry: KernelEntry,
    /// t0 … t4 of the entry point (kvq/codebook/encode.cuh), unused ones one element.
    tables: Vec<CudaSlice<f64>>,
}

/// A codebook scheme's cache-filling kernels for one head size and input format, with the layer's
/// codebooks (device tensors and encoder tables).
pub struct CodebookEncoder {
    generated: CodebookEncodeKernels,
    spec: SchemeSpec,
    kv_heads: usize,
    store: CudaFunction,
    k: Option<SideEncoder>,
    v: Option<SideEncoder>,
    books: DeviceCodebooks,
}

/// Status flags of kvq/codebook/encode.cuh.
const BAD_INPUT: u32 = 1;
const SCALE_OVERFLOW: u32 = 2;
const FACTOR_OVERFLOW: u32 = 4;

impl CodebookEncoder {
    /// Generates, compiles and loads the kernels of `spec` for `kv_heads` heads of `head_dim`
    /// channels handed in `dtype`, and uploads `codebooks` (refused if trained for another scheme
    /// or shape).
    pub fn load(
        jit: &Jit,
        spec: &SchemeSpec,
        codebooks: &Codebooks,
        head_dim: usize,
        kv_heads: usize,
        dtype: Dtype,
    ) -> Result<Self> {
        let generated = codebook_encode_kernels(
            spec,
            narrow("channels a head", head_dim)? as u32,
            dtype,
            narrow("KV heads", kv_heads)? as u32,
        )?;
        let tables = EncoderTables::new(spec, codebooks, kv_heads, head_dim)?;
        let books = DeviceCodebooks::new(spec, codebooks, kv_heads, head_dim)?;
        let mut names = vec![generated.store.name.as_str()];
        names.extend(generated.encode_k.iter().map(|e| e.name.as_str()));
        names.extend(generated.encode_v.iter().map(|e| e.name.as_str()));
        let source = unit_source(&generated.store.name, &generated.source);
        let mut functions = jit
            .functions(&source, &names, &CompileOptions::default())?
            .into_iter();
        let mut next = || {
            functions.next().ok_or_else(|| {
                RuntimeError::InvalidInput("kernel list shorter than requested".into())
            })
        };
        let store = next()?;
        let stream = jit.device().default_stream();
        let mut side = |entry: &Option<KernelEntry>,
                        t: &SideTables|
         -> Result<Option<SideEncoder>> {
            let Some(entry) = entry else { return Ok(None) };
            let tables = match t {
                SideTables::Fp16 => Vec::new(),
                SideTables::Rope(r) => vec![&r.c, &r.ic, &r.norm, &r.cross],
                SideTables::Additive(a) => vec![&a.rows, &a.norm, &a.pair_cross, &a.mean, &a.scale],
            };
            let mut tables = tables
                .into_iter()
                .map(|t| upload(&stream, t))
                .collect::<Result<Vec<_>>>()?;
            while tables.len() < 5 {
                tables.push(alloc(&stream, 1)?);
            }
            Ok(Some(SideEncoder {
                function: next()?,
                entry: entry.clone(),
                tables,
            }))
        };
        let k = side(&generated.encode_k, &tables.k)?;
        let v = side(&generated.encode_v, &tables.v)?;
        Ok(Self {
            generated,
            spec: *spec,
            kv_heads,
            store,
            k,
            v,
            books,
        })
    }

    /// The generated source and launch metadata.
    pub fn generated(&self) -> &CodebookEncodeKernels {
        &self.generated
    }

    /// An empty cache for these kernels: `batch` sequences of at most `max_len` tokens each (their
    /// pages reserved), RoPE at base `rope_theta` for the decode.
    pub fn new_cache(
        &self,
        stream: &Arc<CudaStream>,
        batch: usize,
        max_len: usize,
        rope_theta: f64,
    ) -> Result<CodebookCache> {
        CodebookCache::empty(
            stream,
            &self.spec,
            &self.generated.layout,
            &self.books,
            batch,
            max_len,
            rope_theta,
            self.generated.dtype,
        )
    }

    /// Appends `inputs` to sequence `slot`: FP16 rows stored, every page that fills coded. An empty
    /// sequence's pages are coded straight from the inputs in one launch a side; a growing one's
    /// through its pending rings, a page at a time. Blocks until the encoders' status is read: on an
    /// error (a value that is not finite or past f16's range, a scale or factor past f16's range)
    /// the tokens of the part that failed are not appended, what came before it is, and
    /// [`CodebookCache::len`] says how much.
    pub fn append(
        &self,
        stream: &Arc<CudaStream>,
        cache: &mut CodebookCache,
        slot: usize,
        inputs: &EncodeInputs,
    ) -> Result<()> {
        self.check(cache, slot, inputs)?;
        let len = cache.lens[slot];
        if inputs.tokens == 0 {
            return Ok(());
        }
        if len == 0 {
            return self.prefill_empty(stream, cache, slot, inputs);
        }
        let (mut done, mut len) = (0usize, len);
        while done < inputs.tokens {
            let piece = (inputs.tokens - done).min(self.room(cache, len));
            self.store(stream, cache, slot, inputs, done, len, piece, 0, 0)?;
            for (which, side) in self.coded_sides(cache) {
                let (before, after) = (side.pages(len), side.pages(len + piece));
                if after > before {
                    self.encode_ring(stream, cache, slot, which, before, after - before)?;
                }
            }
            self.finish(stream, cache, slot, len + piece)?;
            done += piece;
            len += piece;
        }
        Ok(())
    }

    fn check(&self, cache: &CodebookCache, slot: usize, inputs: &EncodeInputs) -> Result<()> {
        let d = self.generated.head_dim as usize;
        if cache.spec != self.spec
            || cache.kv_heads != self.kv_heads
            || cache.head_dim != d
            || cache.pending.as_ref().map(|p| p.dtype) != Some(self.generated.dtype)
        {
            return Err(RuntimeError::InvalidInput(format!(
                "the cache holds `{}` with {} KV heads of {}{}; the encoder is for `{}` with {} of {d} \
                 in {:?} (a cache uploaded from the reference cannot grow)",
                cache.spec,
                cache.kv_heads,
                cache.head_dim,
                cache
                    .pending
                    .as_ref()
                    .map_or(String::new(), |p| format!(" in {:?}", p.dtype)),
                self.spec,
                self.kv_heads,
                self.generated.dtype
            )));
        }
        let len = *cache.lens.get(slot).ok_or_else(|| {
            RuntimeError::InvalidInput(format!("sequence {slot} of a cache of {}", cache.batch))
        })?;
        if len + inputs.tokens > cache.max_len {
            return Err(RuntimeError::InvalidInput(format!(
                "sequence {slot} holds {len} tokens; {} more pass its {} (the cache's max_len)",
                inputs.tokens, cache.max_len
            )));
        }
        let need = inputs.tokens * self.kv_heads * d;
        let k_pre_read = matches!(
            cache.layout.k.kind,
            kvq_reference::commvq::device::SideKind::Rope { .. }
        );
        for (name, t, read) in [
            ("k_pre_rope", inputs.k_pre_rope, k_pre_read),
            ("k_post_rope", inputs.k_post_rope, true),
            ("v", inputs.v, true),
        ] {
            if read && t.len() < need {
                return Err(RuntimeError::InvalidInput(format!(
                    "{name} holds {} values; {} tokens × {} KV heads × {d} need {need}",
                    t.len(),
                    inputs.tokens,
                    self.kv_heads
                )));
            }
        }
        Ok(())
    }

    /// Tokens sequence at `len` can take before a coded side's tail ring would overwrite a token
    /// not yet coded: the free sink rows, then the fewest free ring rows of the coded sides.
    fn room(&self, cache: &CodebookCache, len: usize) -> usize {
        let sink_free = cache.layout.sink.saturating_sub(len);
        let ring_free = self
            .coded_sides(cache)
            .into_iter()
            .map(|(_, side)| {
                let r = side.regions(len);
                side.tail_cap - r.tail().len()
            })
            .min()
            .unwrap_or(usize::MAX);
        sink_free.saturating_add(ring_free).max(1)
    }

    /// The cache's coded sides (copies of their layouts).
    fn coded_sides(&self, cache: &CodebookCache) -> Vec<(Which, SideLayout)> {
        [(Which::K, cache.layout.k), (Which::V, cache.layout.v)]
            .into_iter()
            .filter(|(_, s)| s.is_coded())
            .collect()
    }

    /// An empty sequence: rows of the sink and tail stored, the pages coded from the inputs.
    fn prefill_empty(
        &self,
        stream: &Arc<CudaStream>,
        cache: &mut CodebookCache,
        slot: usize,
        inputs: &EncodeInputs,
    ) -> Result<()> {
        let n = inputs.tokens;
        let ring_from = |side: &SideLayout| {
            let r = side.regions(n);
            (r.sink_end + r.pages * side.page) as i32
        };
        let (k_from, v_from) = (ring_from(&cache.layout.k), ring_from(&cache.layout.v));
        self.store(stream, cache, slot, inputs, 0, 0, n, k_from, v_from)?;
        for (which, side) in self.coded_sides(cache) {
            let pages = side.pages(n);
            if pages > 0 {
                let src = match which {
                    Which::K if side_is_rope(&side) => inputs.k_pre_rope,
                    Which::K => inputs.k_post_rope,
                    Which::V => inputs.v,
                };
                let rows = Rows {
                    tok_stride: self.kv_heads * side.head_dim,
                    head_stride: side.head_dim,
                    first: side.sink.min(n),
                    cap: 0,
                };
                self.encode(
                    stream,
                    cache,
                    slot,
                    which,
                    Source::Input(src),
                    rows,
                    0,
                    pages,
                )?;
            }
        }
        self.finish(stream, cache, slot, n)
    }

    /// Codes `pages` pages of a growing sequence from its pending ring, from logical page `page0`.
    fn encode_ring(
        &self,
        stream: &Arc<CudaStream>,
        cache: &mut CodebookCache,
        slot: usize,
        which: Which,
        page0: usize,
        pages: usize,
    ) -> Result<()> {
        let side = match which {
            Which::K => cache.layout.k,
            Which::V => cache.layout.v,
        };
        let (cap, d) = (side.tail_cap, side.head_dim);
        let rows = Rows {
            tok_stride: d,
            head_stride: cap * d,
            first: (page0 * side.page) % cap,
            cap,
        };
        let offset = slot * self.kv_heads * cap * d;
        self.encode(
            stream,
            cache,
            slot,
            which,
            Source::Ring(offset),
            rows,
            page0,
            pages,
        )
    }

    #[allow(clippy::too_many_arguments)]
    fn encode(
        &self,
        stream: &Arc<CudaStream>,
        cache: &mut CodebookCache,
        slot: usize,
        which: Which,
        source: Source,
        rows: Rows,
        page0: usize,
        pages: usize,
    ) -> Result<()> {
        let enc = match which {
            Which::K => self.k.as_ref(),
            Which::V => self.v.as_ref(),
        }
        .ok_or_else(|| RuntimeError::InvalidInput("no encoder for an FP16 side".into()))?;
        let Some(Pending { k, v, status, .. }) = cache.pending.as_mut() else {
            return Err(RuntimeError::InvalidInput(
                "an uploaded cache cannot grow".into(),
            ));
        };
        let cfg = LaunchConfig {
            grid_dim: (
                u32::try_from(pages).map_err(|_| RuntimeError::InvalidInput("pages".into()))?,
                self.kv_heads as u32,
                1,
            ),
            block_dim: (enc.entry.block, 1, 1),
            shared_mem_bytes: 0,
        };
        let (ring, pool) = match which {
            Which::K => (&*k, &mut cache.k_pool),
            Which::V => (&*v, &mut cache.v_pool),
        };
        // The source's address: the caller's tensor, or this sequence's rows of the ring (its
        // stream-order guard held until the launch is enqueued).
        let (base, _guard) = match source {
            Source::Input(t) => t.device_ptr(stream),
            Source::Ring(element) => {
                let (p, g) = ring.device_ptr(stream);
                (p + 2 * element as u64, g)
            }
        };
        let mut args = Args::new(stream);
        args.ptr(base)
            .int(narrow("row stride", rows.tok_stride)?)
            .int(narrow("head stride", rows.head_stride)?)
            .int(narrow("first row", rows.first)?)
            .int(narrow("ring rows", rows.cap)?)
            .int(narrow("page", page0)?)
            .int(narrow("sequence", slot)?)
            .buffer_mut(pool)
            .buffer(&cache.page_table)
            .int(narrow("pages", cache.max_pages)?)
            .buffer(&enc.tables[0])
            .buffer(&enc.tables[1])
            .buffer(&enc.tables[2])
            .buffer(&enc.tables[3])
            .buffer(&enc.tables[4])
            .buffer_mut(status);
        // SAFETY: the arguments follow the encoder entry's params; the pool and page table were
        // sized for `max_pages` pages of every sequence, the source holds the rows checked above.
        unsafe { args.launch(&enc.function, cfg, false) }.map_err(launch_err(&enc.entry.name))
    }

    /// Stores rows `r0 .. r0 + n` of the inputs as tokens `t0 …` of sequence `slot`.
    #[allow(clippy::too_many_arguments)]
    fn store(
        &self,
        stream: &Arc<CudaStream>,
        cache: &mut CodebookCache,
        slot: usize,
        inputs: &EncodeInputs,
        r0: usize,
        t0: usize,
        n: usize,
        k_ring_from: i32,
        v_ring_from: i32,
    ) -> Result<()> {
        let pending = cache
            .pending
            .as_mut()
            .ok_or_else(|| RuntimeError::InvalidInput("an uploaded cache cannot grow".into()))?;
        let cfg = LaunchConfig {
            grid_dim: (
                u32::try_from(n).map_err(|_| RuntimeError::InvalidInput("tokens".into()))?,
                self.kv_heads as u32,
                1,
            ),
            block_dim: (self.generated.store.block, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut args = Args::new(stream);
        args.buffer(inputs.k_pre_rope)
            .buffer(inputs.k_post_rope)
            .buffer(inputs.v)
            .int(narrow("row", r0)?)
            .int(narrow("token", t0)?)
            .int(k_ring_from)
            .int(v_ring_from)
            .int(narrow("sequence", slot)?)
            .buffer_mut(&mut cache.k_pool)
            .buffer_mut(&mut cache.v_pool)
            .buffer(&cache.page_table)
            .int(narrow("pages", cache.max_pages)?)
            .buffer_mut(&mut cache.k_sink)
            .buffer_mut(&mut cache.v_sink)
            .buffer_mut(&mut cache.k_tail)
            .buffer_mut(&mut cache.v_tail)
            .buffer_mut(&mut pending.k)
            .buffer_mut(&mut pending.v)
            .buffer_mut(&mut pending.status);
        // SAFETY: the arguments follow the store entry's params; the inputs hold `n` rows from
        // `r0` (checked), every cache buffer was sized for the batch and its longest sequence.
        unsafe { args.launch(&self.store, cfg, false) }
            .map_err(launch_err(&self.generated.store.name))
    }

    /// Reads the status of what was enqueued (blocking), resets it, and on success records the
    /// sequence's new length on the host and the device.
    fn finish(
        &self,
        stream: &Arc<CudaStream>,
        cache: &mut CodebookCache,
        slot: usize,
        new_len: usize,
    ) -> Result<()> {
        let pending = cache
            .pending
            .as_mut()
            .ok_or_else(|| RuntimeError::InvalidInput("an uploaded cache cannot grow".into()))?;
        let status: Vec<u32> = stream
            .clone_dtoh(&pending.status)
            .map_err(|e| RuntimeError::driver("read the encoder status", e))?;
        stream
            .memset_zeros(&mut pending.status)
            .map_err(|e| RuntimeError::driver("reset the encoder status", e))?;
        if let Some(e) = status_error(slot, &status) {
            return Err(e);
        }
        cache.lens[slot] = new_len;
        let len = narrow("tokens", new_len)?;
        let mut one = cache.seq_lens.slice_mut(slot..slot + 1);
        stream
            .memcpy_htod(&[len], &mut one)
            .map_err(|e| RuntimeError::driver("record the sequence length", e))
    }
}

/// The error a sequence's status words (kvq/codebook/encode.cuh: flags, then the first bad
/// token's and the first overflow's, complemented) report, `None` when they are clean.
pub fn status_error(slot: usize, status: &[u32]) -> Option<RuntimeError> {
    let word = |i: usize| status.get(i).copied().unwrap_or(0);
    let token = |i: usize| !word(i);
    let flags = word(0);
    if flags & BAD_INPUT != 0 {
        return Some(RuntimeError::InvalidInput(format!(
            "sequence {slot}, token {}: a key or value is NaN, infinite or past f16's range \
             (±65504); nothing from it on was appended",
            token(1)
        )));
    }
    if flags & (SCALE_OVERFLOW | FACTOR_OVERFLOW) != 0 {
        let what = if flags & SCALE_OVERFLOW != 0 {
            "its key's norm (the per-vector scale)"
        } else {
            "its value's norm over the codebook's channel scales (the code's factor)"
        };
        return Some(RuntimeError::InvalidInput(format!(
            "sequence {slot}, token {}: {what} exceeds f16's range; its page was not appended",
            token(2)
        )));
    }
    None
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Which {
    K,
    V,
}

/// Where a page encoder reads its rows.
enum Source<'a> {
    /// The caller's tensor, `[token][kv_head][D]`.
    Input(&'a CudaSlice<u16>),
    /// The sequence's pending ring, from this element.
    Ring(usize),
}

/// How a page encoder walks its source (KvqCbRows).
struct Rows {
    tok_stride: usize,
    head_stride: usize,
    first: usize,
    cap: usize,
}

fn side_is_rope(side: &SideLayout) -> bool {
    matches!(
        side.kind,
        kvq_reference::commvq::device::SideKind::Rope { .. }
    )
}
