//! Loading a scheme's decode kernels and launching them.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig};
use kvq_codegen::{decode_kernels, decode_slow_path, DecodeKernels, KernelShape, TuneParams};
use kvq_spec::SchemeSpec;

use super::layout::{CacheArgs, CachePtrs, CacheView};
use super::scratch::{DecodeScratch, WorkspaceLayout};
use super::splits::Pieces;
use crate::error::{Result, RuntimeError};
use crate::jit::Jit;
use crate::launch::{allow_dynamic_shared, launch_err, unit_source, Args, Input, Output};
use crate::nvrtc::CompileOptions;

/// The compiled decode kernels of one scheme × shape × tuning.
pub struct DecodeKernel {
    spec: SchemeSpec,
    generated: DecodeKernels,
    decode: CudaFunction,
    combine: CudaFunction,
    range: Option<CudaFunction>,
    /// CTAs an SM holds of the decode kernel and of the range kernel (0 without one): the range
    /// grid's split count scales with their ratio ([`DecodeKernel::range_splits`]).
    decode_per_sm: usize,
    range_per_sm: usize,
    /// The GPU and driver can launch a kernel overlapping the one before it (programmatic
    /// dependent launch: compute capability 9.0 on, `cuLaunchKernelEx`).
    can_overlap: bool,
    /// `attend` does so (see [`DecodeKernel::overlaps_launches`]).
    overlap: bool,
}

/// What [`DecodeKernel::load_with`] may load.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Load the generic CUDA-core kernel where the tensor-core kernel cannot serve the scheme and
    /// shape ([`kvq_codegen::SlowPath`] says why). It runs several times slower, so without this
    /// such a load fails with [`RuntimeError::SlowPath`] instead of falling back silently.
    pub allow_slow_path: bool,
}

impl LoadOptions {
    /// Options that take the generic kernel where it is the only one (tools and tests that run
    /// every shape on purpose).
    pub const ALLOW_SLOW_PATH: LoadOptions = LoadOptions {
        allow_slow_path: true,
    };
}

/// CTAs of `f` (launched as `entry` says) an SM holds at once, from the driver's occupancy.
fn ctas_per_sm(f: &CudaFunction, entry: &kvq_codegen::KernelEntry) -> Result<usize> {
    let n = f
        .occupancy_max_active_blocks_per_multiprocessor(
            entry.block,
            entry.dynamic_shared_bytes as usize,
            None,
        )
        .map_err(|e| RuntimeError::driver("cuOccupancyMaxActiveBlocksPerMultiprocessor", e))?;
    Ok((n as usize).max(1))
}

/// Most decode splits at which the range grid takes more splits than the decode grid
/// ([`DecodeKernel::range_splits`]). Measured on an H100 with CalibQuant-1 and -2 at head_dim 128:
/// scaled from three splits to five at B=16 and from
/// twelve to twenty at B=4, ×1.00–×1.04; from 32 and 49 to 53 and 81 at B=1, ×0.90–×1.00 at
/// L ≤ 32K and ×1.01–×1.02 at L=128K (likely, not profiled: range warps of 19–101 tokens pay
/// more in fixed costs than the filled slots gain).
pub const RANGE_SCALE_MAX_SPLITS: usize = 16;

/// [`DecodeKernel::range_splits`] from the two kernels' CTAs an SM (`range_per_sm` 0: no range
/// kernel).
fn range_splits_for(splits: usize, decode_per_sm: usize, range_per_sm: usize) -> usize {
    if splits > RANGE_SCALE_MAX_SPLITS {
        return splits;
    }
    let scaled = splits * range_per_sm / decode_per_sm.max(1);
    splits.max(scaled)
}

/// A step takes at least one query token a sequence.
fn check_q_len(q_len: usize) -> Result<()> {
    if q_len == 0 {
        return Err(RuntimeError::InvalidInput(
            "q_len 0 (a step has at least one query token a sequence)".into(),
        ));
    }
    Ok(())
}

impl DecodeKernel {
    /// Generates, compiles (through the JIT's caches) and loads the kernels; refuses a scheme and
    /// shape that only the generic CUDA-core kernel serves ([`RuntimeError::SlowPath`];
    /// [`load_with`](Self::load_with) and [`LoadOptions::allow_slow_path`] opt in).
    pub fn load(
        jit: &Jit,
        spec: &SchemeSpec,
        shape: &KernelShape,
        tune: &TuneParams,
    ) -> Result<DecodeKernel> {
        Self::load_with(jit, spec, shape, tune, LoadOptions::default())
    }

    /// As [`load`](Self::load), with `options` saying whether the generic kernel may serve.
    pub fn load_with(
        jit: &Jit,
        spec: &SchemeSpec,
        shape: &KernelShape,
        tune: &TuneParams,
        options: LoadOptions,
    ) -> Result<DecodeKernel> {
        if let (Some(reason), false) = (decode_slow_path(spec, shape), options.allow_slow_path) {
            return Err(RuntimeError::SlowPath {
                scheme: spec.to_string(),
                head_dim: shape.head_dim,
                gqa: shape.gqa,
                reason,
            });
        }
        let generated = decode_kernels(spec, shape, tune)?;
        let source = unit_source(&generated.decode.name, &generated.source);
        let mut names = vec![
            generated.decode.name.as_str(),
            generated.combine.name.as_str(),
        ];
        if let Some(r) = &generated.range {
            names.push(r.name.as_str());
        }
        let mut functions = jit
            .functions(&source, &names, &CompileOptions::default())?
            .into_iter();
        let mut next = || {
            functions.next().ok_or_else(|| {
                RuntimeError::InvalidInput("kernel list shorter than requested".into())
            })
        };
        let decode = next()?;
        allow_dynamic_shared(&decode, &generated.decode)?;
        let combine = next()?;
        let range = match &generated.range {
            Some(entry) => {
                let f = next()?;
                allow_dynamic_shared(&f, entry)?;
                Some(f)
            }
            None => None,
        };
        // The occupancy queries need the context current on this thread, which a tuner's
        // compile worker may not have.
        jit.device()
            .context()
            .bind_to_thread()
            .map_err(|e| RuntimeError::driver("bind the device context", e))?;
        let decode_per_sm = ctas_per_sm(&decode, &generated.decode)?;
        let range_per_sm = match (&range, &generated.range) {
            (Some(f), Some(entry)) => ctas_per_sm(f, entry)?,
            _ => 0,
        };
        // Any driver kvq accepts exports cuLaunchKernelEx (libs::DRIVER_ENTRY_POINTS), so the
        // architecture alone decides whether launches may overlap.
        let can_overlap = jit.arch().sm() >= 90;
        Ok(DecodeKernel {
            spec: *spec,
            generated,
            decode,
            combine,
            range,
            decode_per_sm,
            range_per_sm,
            can_overlap,
            overlap: can_overlap,
        })
    }

    /// Whether [`attend`](Self::attend) launches each kernel of a step overlapping the one
    /// before it (programmatic dependent launch): the combine grid the decode grid, and for
    /// calibrated schemes the decode grid the score-range grid; each waits for its predecessor's
    /// results in its own code. On by default from compute capability 9.0 with a driver that has
    /// `cuLaunchKernelEx` (CUDA 12.0 on); a bench turns it off with
    /// [`set_overlap_launches`](Self::set_overlap_launches) (`DecodeOptions::pdl`).
    pub fn overlaps_launches(&self) -> bool {
        self.overlap
    }

    /// Turns the overlapped launches on (where the GPU can) or off, and returns whether they are
    /// now on. The results are the same bits either way; off, the launches are the plain ones an
    /// engine embedding the generated kernels would make.
    pub fn set_overlap_launches(&mut self, on: bool) -> bool {
        self.overlap = on && self.can_overlap;
        self.overlap
    }

    /// The generated source and launch metadata.
    pub fn generated(&self) -> &DecodeKernels {
        &self.generated
    }

    /// How many decode CTAs a GPU of `sm_count` SMs holds at once (the driver's occupancy for
    /// this kernel's registers and shared memory): what [`default_splits`](super::default_splits)
    /// fills whole waves of.
    pub fn resident_ctas(&self, sm_count: usize) -> Result<usize> {
        Ok(self.decode_per_sm * sm_count.max(1))
    }

    /// The range grid's split count for a launch of `splits` decode splits. Up to
    /// [`RANGE_SCALE_MAX_SPLITS`] splits, `splits` scaled by how many more CTAs an SM holds of
    /// the range kernel than of the decode kernel, so that its grid fills the GPU as far as the
    /// decode grid does; otherwise, or where the scheme has no range pass, `splits`. The range
    /// kernel has fewer registers: CalibQuant-1 at head_dim 128 holds five CTAs an SM against the
    /// decode kernel's three, and with the decode grid's three splits at B=16 it left 40% of its
    /// slots empty.
    pub fn range_splits(&self, splits: usize) -> usize {
        range_splits_for(splits, self.decode_per_sm, self.range_per_sm)
    }

    /// The split count [`default_splits`](super::default_splits) gives this kernel's own
    /// occupancy for a batch of `batch` sequences of at most `max_len` tokens with `kv_heads` KV
    /// heads (each [`head_groups`](kvq_codegen::DecodeKernels::head_groups) grid rows) on a GPU of
    /// `sm_count` SMs: the heuristic's, except for KIVI-4's few-pairs block,
    /// whose heuristic splits fill the 64-token block's occupancy
    /// ([`TuneChoice::occupancy_block`](crate::TuneChoice::occupancy_block)).
    pub fn default_splits(
        &self,
        batch: usize,
        kv_heads: usize,
        max_len: usize,
        sm_count: usize,
    ) -> Result<usize> {
        Ok(super::default_splits(
            batch,
            kv_heads * self.generated.head_groups as usize,
            max_len,
            self.resident_ctas(sm_count)?,
            self.generated.tune.warps(),
            super::min_warp_tokens(&self.spec, &self.generated.shape, max_len),
        ))
    }

    /// The layout of a workspace lent for launches of `batch` sequences of `kv_heads` KV heads with
    /// page tables `max_pages` wide, `splits` splits and `pieces` ([`DecodeScratch::lent`]):
    /// partials, the range grid's score ranges ([`range_splits`](Self::range_splits)) and, for
    /// kernels that store key scores, those.
    pub fn workspace_layout(
        &self,
        batch: usize,
        kv_heads: usize,
        max_pages: usize,
        splits: usize,
        pieces: Pieces,
    ) -> Result<WorkspaceLayout> {
        let q_heads = kv_heads * self.generated.shape.gqa as usize;
        let rows = batch.checked_mul(q_heads).ok_or_else(|| {
            RuntimeError::InvalidInput(format!("{batch} sequences of {q_heads} query heads"))
        })?;
        WorkspaceLayout::new(
            rows,
            self.generated.shape.head_dim as usize,
            splits,
            pieces,
            self.range_splits(splits),
            self.generated.score_floats(batch, kv_heads, max_pages),
        )
    }

    /// Whether the decode kernel runs pieces after its splits (see [`Pieces`]); a kernel that
    /// does not still takes launches with pieces and does all the work in its splits.
    pub fn runs_pieces(&self) -> bool {
        self.generated.runs_pieces()
    }

    /// Where the default launch takes pieces ([`PieceRule`](kvq_codegen::PieceRule)).
    pub fn piece_rule(&self) -> kvq_codegen::PieceRule {
        self.generated.piece_rule
    }

    /// The heuristic pieces for a launch of `splits` splits over sequences of at most `max_len`
    /// tokens ([`default_pieces`](super::default_pieces)).
    pub fn default_pieces(&self, max_len: usize, splits: usize) -> Pieces {
        super::default_pieces(
            self.piece_rule(),
            max_len,
            splits,
            self.generated.tune.warps(),
        )
    }

    /// Enqueues decode attention for every sequence of `cache` on `stream` (no host
    /// synchronisation): `q` is `[batch][kv_heads·gqa][head_dim]`, `out` the same shape, both in the
    /// kernel's dtype (16-bit words).
    pub fn attend(
        &self,
        stream: &Arc<CudaStream>,
        cache: CacheView<'_>,
        q: &CudaSlice<u16>,
        out: &mut CudaSlice<u16>,
        scratch: &mut DecodeScratch,
    ) -> Result<()> {
        self.attend_step(stream, cache, 1, q, out, None, scratch)
    }

    /// As [`attend`](Self::attend), and writes each query row's log-sum-exp into `lse`
    /// (`[batch][kv_heads·gqa]` f32): `ln Σ exp(s)` over the scores the row saw, `s = q·k/√d`
    /// as the scheme scores it (calibrated under CalibQuant), natural log, −inf for a row without
    /// tokens. With it, partial results over parts of a sequence's tokens (on several GPUs) merge
    /// into the whole (`kvq_reference::step::merge`). The combine kernel runs even for a single
    /// split (one small extra launch there).
    pub fn attend_with_lse(
        &self,
        stream: &Arc<CudaStream>,
        cache: CacheView<'_>,
        q: &CudaSlice<u16>,
        out: &mut CudaSlice<u16>,
        lse: &mut CudaSlice<f32>,
        scratch: &mut DecodeScratch,
    ) -> Result<()> {
        self.attend_step(stream, cache, 1, q, out, Some(lse), scratch)
    }

    /// A step of `q_len` query tokens a sequence of `cache` (speculative-decoding verification):
    /// row `b·q_len + j` of `q` and `out` (`[batch][q_len][kv_heads·gqa][head_dim]`) is token `j`
    /// of sequence `b`, one of the sequence's last `q_len` tokens, attending causally to the
    /// tokens up to itself as the cache holds them ([`attend_raw`](Self::attend_raw) has the
    /// rule); `lse`, if given, gets each row's log-sum-exp (`[batch][q_len][kv_heads·gqa]`).
    /// `q_len` 1 is [`attend`](Self::attend) / [`attend_with_lse`](Self::attend_with_lse).
    #[allow(clippy::too_many_arguments)]
    pub fn attend_step(
        &self,
        stream: &Arc<CudaStream>,
        cache: CacheView<'_>,
        q_len: usize,
        q: &CudaSlice<u16>,
        out: &mut CudaSlice<u16>,
        lse: Option<&mut CudaSlice<f32>>,
        scratch: &mut DecodeScratch,
    ) -> Result<()> {
        check_q_len(q_len)?;
        let shape = self.generated.shape;
        let d = shape.head_dim as usize;
        let q_heads = cache.kv_heads * shape.gqa as usize;
        if *cache.spec != self.spec {
            return Err(RuntimeError::InvalidInput(format!(
                "cache holds scheme `{}`, kernel is for `{}`",
                cache.spec, self.spec
            )));
        }
        self.check_cache(cache.head_dim)?;
        let rows = cache.batch * q_len;
        let need = rows * q_heads * d;
        if q.len() != need || out.len() != need {
            return Err(RuntimeError::InvalidInput(format!(
                "q and out must hold [batch {}][q_len {q_len}][q_heads {q_heads}][head_dim {d}] = \
                 {need} values, got {} and {}",
                cache.batch,
                q.len(),
                out.len()
            )));
        }
        if let Some(lse) = &lse {
            if lse.len() != rows * q_heads {
                return Err(RuntimeError::InvalidInput(format!(
                    "lse must hold [batch {}][q_len {q_len}][q_heads {q_heads}] = {} floats, got {}",
                    cache.batch,
                    rows * q_heads,
                    lse.len()
                )));
            }
        }
        // SAFETY: every buffer is a cudarc allocation of the sizes checked here, and the view's
        // cache buffers follow its layout (CacheView's contract).
        unsafe {
            self.launch(
                stream,
                CacheArgs::from(cache),
                cache.batch,
                q_len,
                Input::Raw(0),
                Input::Slice(q),
                Output::Slice(out),
                lse.map(Output::Slice),
                scratch,
            )
        }
    }

    /// [`attend_with_lse`](Self::attend_with_lse) on a cache and buffers the caller owns (an
    /// engine's memory), for `batch` sequences of `q_len` query tokens each: sequence `i` is slot
    /// `seq_slots[i]` of `cache` (`seq_slots` 0: slot `i`; a slot of −1 is padding, whose rows
    /// are zeros), and its query tokens are the slot's last `q_len` tokens, token `j` seeing the
    /// slot's tokens up to itself (causal; `q_len` 1: decode). `q` and `out` are
    /// `[batch][q_len][kv_heads·gqa][head_dim]` in the kernel's dtype, `lse`
    /// `[batch][q_len][kv_heads·gqa]` f32 or 0 for none.
    ///
    /// # Safety
    /// Every pointer is a device allocation of the stream's context holding what its field or
    /// argument says for these sizes; `seq_slots` names distinct slots below the cache's slot
    /// count (or −1), each with `seq_lens` at most `max_pages · page` tokens whose pages the page
    /// table maps into the pools; all stay alive until the launches have run on `stream`.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn attend_raw(
        &self,
        stream: &Arc<CudaStream>,
        cache: &CachePtrs,
        batch: usize,
        q_len: usize,
        seq_slots: u64,
        q: u64,
        out: u64,
        lse: u64,
        scratch: &mut DecodeScratch,
    ) -> Result<()> {
        if q == 0 || out == 0 || cache.k_pool == 0 || cache.v_pool == 0 || cache.page_table == 0 {
            return Err(RuntimeError::InvalidInput(
                "q, out, the pools and the page table must not be null".into(),
            ));
        }
        self.check_cache(cache.head_dim)?;
        let lse = (lse != 0).then_some(Output::Raw(lse));
        // SAFETY: the caller vouches for the pointers (above).
        unsafe {
            self.launch(
                stream,
                CacheArgs::from(cache),
                batch,
                q_len,
                Input::Raw(seq_slots),
                Input::Raw(q),
                Output::Raw(out),
                lse,
                scratch,
            )
        }
    }

    fn check_cache(&self, head_dim: usize) -> Result<()> {
        let d = self.generated.shape.head_dim as usize;
        if head_dim != d {
            return Err(RuntimeError::InvalidInput(format!(
                "cache head_dim {head_dim} but kernel head_dim {d}"
            )));
        }
        Ok(())
    }

    /// The step's launches: the range grid (calibrated schemes), the decode grid and, unless one
    /// part per head wrote the output itself, the combine grid.
    ///
    /// # Safety
    /// The buffers hold what [`attend_raw`](Self::attend_raw) says for `batch` sequences of
    /// `q_len` query tokens.
    #[allow(clippy::too_many_arguments)]
    unsafe fn launch(
        &self,
        stream: &Arc<CudaStream>,
        cache: CacheArgs<'_>,
        batch: usize,
        q_len: usize,
        seq_slots: Input<'_, i32>,
        q: Input<'_, u16>,
        out: Output<'_, u16>,
        lse: Option<Output<'_, f32>>,
        scratch: &mut DecodeScratch,
    ) -> Result<()> {
        let q_heads = cache.kv_heads * self.generated.shape.gqa as usize;
        check_q_len(q_len)?;
        // A row of the grid for each query token of each sequence.
        let q_len_i = i32::try_from(q_len)
            .map_err(|_| RuntimeError::InvalidInput(format!("q_len {q_len}")))?;
        let batch = batch
            .checked_mul(q_len)
            .filter(|&rows| rows <= u16::MAX as usize)
            .ok_or_else(|| {
                RuntimeError::InvalidInput(format!(
                    "{batch} sequences of {q_len} query tokens (at most 65535 query tokens a launch)"
                ))
            })?;
        if scratch.rows < batch * q_heads {
            return Err(RuntimeError::InvalidInput(format!(
                "scratch was made for {} query rows, this launch has {}",
                scratch.rows,
                batch * q_heads
            )));
        }
        if batch == 0 {
            return Ok(());
        }
        let splits = scratch.splits as u32;
        let range_splits = self.range_splits(scratch.splits);
        scratch.reserve_ranges(stream, range_splits)?;
        let max_pages = i32::try_from(cache.max_pages).map_err(|_| {
            RuntimeError::InvalidInput(format!("{} page-table columns", cache.max_pages))
        })?;
        scratch.reserve_scores(
            stream,
            self.generated
                .score_floats(batch, cache.kv_heads, cache.max_pages),
        )?;
        // The pieces' CTAs follow the splits' (kvq_cta_part in the template); a KV head takes a
        // row for each group of its query heads (DecodeKernels::head_groups).
        let grid_heads = cache.kv_heads as u32 * self.generated.head_groups;
        let decode_cfg = LaunchConfig {
            grid_dim: (
                splits + scratch.pieces.count as u32,
                grid_heads,
                batch as u32,
            ),
            block_dim: (self.generated.decode.block, 1, 1),
            shared_mem_bytes: self.generated.decode.dynamic_shared_bytes,
        };
        // Each launch may overlap the kernel before it (launch.rs): the decode grid a calibrated
        // scheme's range grid, the combine grid the decode grid.
        let overlap = self.overlap;
        if let (Some(range), Some(entry)) = (&self.range, &self.generated.range) {
            let mut args = Args::new(stream);
            args.input(q)
                .input(cache.k_pool)
                .input(cache.page_table)
                .int(max_pages)
                .input(cache.k_sink)
                .input(cache.k_tail)
                .input(cache.seq_lens)
                .input(seq_slots)
                .int(q_len_i)
                .output(scratch.score_range.output())
                .output(scratch.scores.output());
            let range_cfg = LaunchConfig {
                grid_dim: (range_splits as u32, grid_heads, batch as u32),
                block_dim: (entry.block, 1, 1),
                shared_mem_bytes: entry.dynamic_shared_bytes,
            };
            // SAFETY: arguments match the kernel's parameter list (KernelEntry::params), and every
            // buffer was sized above for this grid. A plain launch: it follows the engine's work.
            unsafe { args.launch(range, range_cfg, false) }.map_err(launch_err(&entry.name))?;
        }
        let mut args = Args::new(stream);
        args.input(q)
            .input(cache.k_pool)
            .input(cache.v_pool)
            .input(cache.page_table)
            .int(max_pages)
            .input(cache.k_sink)
            .input(cache.v_sink)
            .input(cache.k_tail)
            .input(cache.v_tail)
            .input(cache.seq_lens)
            .input(seq_slots)
            .int(q_len_i)
            .input(scratch.score_range.input())
            .input(scratch.scores.input())
            .int(range_splits as i32)
            .output(scratch.part_acc.output())
            .output(scratch.part_ml.output())
            .int(scratch.pieces.count as i32)
            .int(scratch.pieces.permille as i32);
        // The decode kernel writes the output itself only with one part per head (and no LSE
        // wanted); otherwise it is given null and the combine writes it.
        let one_part = decode_cfg.grid_dim.0 == 1 && lse.is_none();
        let mut out = Some(out);
        if one_part {
            args.output(out.take().expect("the output is still here"));
        } else {
            args.null();
        }
        // SAFETY: as above. Overlapping only the range grid: the decode kernel waits for it
        // (`kvq_calibration_after_range_grid`) before reading the ranges.
        unsafe { args.launch(&self.decode, decode_cfg, overlap && self.range.is_some()) }
            .map_err(launch_err(&self.generated.decode.name))?;
        let Some(out) = out else {
            // One part per head: the decode kernel wrote the output as the combine would.
            return Ok(());
        };
        let combine_cfg = LaunchConfig {
            grid_dim: (q_heads as u32, batch as u32, 1),
            block_dim: (self.generated.combine.block, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut args = Args::new(stream);
        args.input(scratch.part_acc.input())
            .input(scratch.part_ml.input())
            .output(out);
        match lse {
            Some(lse) => args.output(lse),
            None => args.null(),
        };
        args.int((scratch.splits + scratch.pieces.count) as i32);
        // SAFETY: as above; the combine kernel waits for the decode grid
        // (`kvq_wait_for_previous_grid`) before its first read of the partials.
        unsafe { args.launch(&self.combine, combine_cfg, overlap) }
            .map_err(launch_err(&self.generated.combine.name))
    }
}

#[cfg(test)]
mod tests {
    use super::range_splits_for;

    #[test]
    fn range_grid_scales_with_the_range_kernels_occupancy() {
        // CalibQuant-1 at head_dim 128 on an H100: five range CTAs an SM, three decode CTAs.
        assert_eq!(range_splits_for(3, 3, 5), 5);
        assert_eq!(range_splits_for(12, 3, 5), 20);
        assert_eq!(range_splits_for(16, 3, 5), 26);
        assert_eq!(range_splits_for(1, 3, 5), 1);
    }

    #[test]
    fn range_grid_keeps_the_decode_splits_where_they_are_many() {
        // B=1: range warps of a few dozen tokens lost more than the slots they filled.
        assert_eq!(range_splits_for(17, 3, 5), 17);
        assert_eq!(range_splits_for(49, 3, 5), 49);
    }

    #[test]
    fn range_grid_never_has_fewer_splits_than_decode() {
        assert_eq!(range_splits_for(6, 4, 2), 6);
        assert_eq!(range_splits_for(7, 3, 3), 7);
        // No range kernel.
        assert_eq!(range_splits_for(5, 3, 0), 5);
    }
}
