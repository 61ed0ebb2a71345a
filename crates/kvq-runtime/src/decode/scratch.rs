//! The decode step's scratch: split and piece partials, calibration score ranges and stored key
//! scores. Either kvq allocates it ([`DecodeScratch::new`]) or it lies in a workspace the caller
//! lends ([`DecodeScratch::lent`], sized by [`WorkspaceLayout`]), as an engine that owns its
//! memory wants.

use std::sync::Arc;

use cudarc::driver::{CudaSlice, CudaStream};

use super::splits::Pieces;
use crate::error::{Result, RuntimeError};
use crate::launch::{Input, Output};

/// Bytes every region of a lent workspace starts at a multiple of.
pub const WORKSPACE_ALIGNMENT: usize = 256;

/// One scratch buffer of f32.
pub(crate) enum Floats {
    /// kvq's allocation, grown when a launch needs more.
    Owned(CudaSlice<f32>),
    /// Part of a lent workspace, `floats` long: never grown.
    Lent { ptr: u64, floats: usize },
}

impl Floats {
    fn len(&self) -> usize {
        match self {
            Floats::Owned(s) => s.len(),
            Floats::Lent { floats, .. } => *floats,
        }
    }

    pub(crate) fn input(&self) -> Input<'_, f32> {
        match self {
            Floats::Owned(s) => Input::Slice(s),
            Floats::Lent { ptr, .. } => Input::Raw(*ptr),
        }
    }

    pub(crate) fn output(&mut self) -> Output<'_, f32> {
        match self {
            Floats::Owned(s) => Output::Slice(s),
            Floats::Lent { ptr, .. } => Output::Raw(*ptr),
        }
    }

    /// Makes the buffer hold `floats`: an owned one grows (filled by `fill`), a lent one that is
    /// too small is an error naming `what`.
    fn reserve(
        &mut self,
        floats: usize,
        what: &str,
        fill: impl FnOnce(usize) -> Result<CudaSlice<f32>>,
    ) -> Result<()> {
        if self.len() >= floats {
            return Ok(());
        }
        match self {
            Floats::Owned(s) => *s = fill(floats)?,
            Floats::Lent { floats: have, .. } => {
                return Err(RuntimeError::InvalidInput(format!(
                    "the workspace holds {have} floats of {what}, this launch needs {floats} \
                     (size it with WorkspaceLayout for the launch's batch and page-table width)"
                )))
            }
        }
        Ok(())
    }
}

/// Per-launch scratch (split and piece partials, calibration ranges, stored key scores), reusable
/// across steps of at most its batch size with its KV heads, split count and pieces. An owned
/// scratch's stored scores grow with the first launch that needs more (batch × KV heads ×
/// page-table width × page × gqa floats: 67 MB at B=16, 8 KV heads, GQA 4 and 32K-token page
/// tables), and so do the score ranges with the first launch whose range grid has more splits
/// than the decode grid ([`DecodeKernel::range_splits`](super::DecodeKernel::range_splits)), so an
/// engine that captures launches in a CUDA graph runs one step of its widest shape first, or
/// lends a workspace sized for it ([`WorkspaceLayout`]).
pub struct DecodeScratch {
    pub(crate) splits: usize,
    pub(crate) pieces: Pieces,
    pub(crate) rows: usize,
    pub(crate) part_acc: Floats,
    pub(crate) part_ml: Floats,
    /// Calibration score ranges, `[rows][range splits][2]`.
    pub(crate) score_range: Floats,
    /// Stored key scores (`DecodeKernels::stores_scores`).
    pub(crate) scores: Floats,
}

/// Where a lent workspace keeps each scratch buffer, for launches of at most `rows` query rows
/// (batch × query heads), `splits` splits and `pieces`: offsets in bytes, each a multiple of
/// [`WORKSPACE_ALIGNMENT`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkspaceLayout {
    /// Query rows.
    pub rows: usize,
    /// Decode splits.
    pub splits: usize,
    /// Pieces after the splits.
    pub pieces: Pieces,
    /// `(offset, floats)` of the partial outputs, `[rows][splits + pieces][head_dim]`.
    pub part_acc: (usize, usize),
    /// `(offset, floats)` of the partials' (max, denominator), `[rows][splits + pieces][2]`.
    pub part_ml: (usize, usize),
    /// `(offset, floats)` of the calibration ranges, `[rows][range splits][2]`.
    pub score_range: (usize, usize),
    /// `(offset, floats)` of the stored key scores (at least one float).
    pub scores: (usize, usize),
    /// Bytes of the whole workspace.
    pub bytes: usize,
}

impl WorkspaceLayout {
    /// The layout for `rows` query rows of `head_dim`, `splits` decode splits and `pieces`,
    /// `range_splits` range splits and `score_floats` stored scores; sizes past the address space
    /// are an error.
    pub fn new(
        rows: usize,
        head_dim: usize,
        splits: usize,
        pieces: Pieces,
        range_splits: usize,
        score_floats: usize,
    ) -> Result<WorkspaceLayout> {
        let overflow = || {
            RuntimeError::InvalidInput(format!(
                "a decode workspace for {rows} rows of head_dim {head_dim} and {splits} splits \
                 would not fit the address space"
            ))
        };
        let mut at = 0usize;
        let mut region = |floats: usize| -> Result<(usize, usize)> {
            let floats = floats.max(1);
            let start = at;
            let bytes = floats.checked_mul(4).ok_or_else(overflow)?;
            at = start
                .checked_add(bytes.next_multiple_of(WORKSPACE_ALIGNMENT))
                .ok_or_else(overflow)?;
            Ok((start, floats))
        };
        let per_rows = |n: usize| rows.checked_mul(n).ok_or_else(overflow);
        let parts = splits + pieces.count;
        let part_acc = region(per_rows(parts.checked_mul(head_dim).ok_or_else(overflow)?)?)?;
        let part_ml = region(per_rows(parts * 2)?)?;
        let score_range = region(per_rows(range_splits * 2)?)?;
        let scores = region(score_floats)?;
        Ok(WorkspaceLayout {
            rows,
            splits,
            pieces,
            part_acc,
            part_ml,
            score_range,
            scores,
            bytes: at,
        })
    }
}

impl DecodeScratch {
    /// Scratch for `batch` sequences of `q_heads` query heads of `head_dim`, split `splits` ways,
    /// with no pieces.
    /// Filled with NaN, so a partial result the kernel forgot to write cannot pass a check.
    pub fn new(
        stream: &Arc<CudaStream>,
        batch: usize,
        q_heads: usize,
        head_dim: usize,
        splits: usize,
    ) -> Result<DecodeScratch> {
        Self::with_pieces(stream, batch, q_heads, head_dim, splits, Pieces::NONE)
    }

    /// As [`new`](Self::new), for launches that also run `pieces`.
    pub fn with_pieces(
        stream: &Arc<CudaStream>,
        batch: usize,
        q_heads: usize,
        head_dim: usize,
        splits: usize,
        pieces: Pieces,
    ) -> Result<DecodeScratch> {
        if splits == 0 {
            return Err(RuntimeError::InvalidInput(
                "0 splits (expected at least 1)".into(),
            ));
        }
        pieces.check(splits).map_err(RuntimeError::InvalidInput)?;
        let rows = batch * q_heads;
        let parts = splits + pieces.count;
        let nan = |n: usize, what: &str| -> Result<Floats> {
            Ok(Floats::Owned(nan_filled(stream, n, what)?))
        };
        Ok(DecodeScratch {
            splits,
            pieces,
            rows,
            part_acc: nan(rows * parts * head_dim, "partial outputs")?,
            part_ml: nan(rows * parts * 2, "partial softmax statistics")?,
            score_range: nan(rows * splits * 2, "calibration score ranges")?,
            scores: nan(1, "stored key scores")?,
        })
    }

    /// Scratch in a workspace the caller lends, laid out as `layout` says: launches of at most
    /// `layout.rows` query rows with `layout.splits` splits and `layout.pieces`. It never grows:
    /// a launch that needs more is an error.
    ///
    /// # Safety
    /// `ptr` is a device allocation of the context the launches run in, at least `layout.bytes`
    /// long and aligned to [`WORKSPACE_ALIGNMENT`], that nothing else uses while launches with
    /// this scratch run, and alive as long as the scratch is used.
    pub unsafe fn lent(layout: &WorkspaceLayout, ptr: u64) -> Result<DecodeScratch> {
        if ptr == 0 || ptr % WORKSPACE_ALIGNMENT as u64 != 0 {
            return Err(RuntimeError::InvalidInput(format!(
                "workspace pointer {ptr:#x} (expected a device allocation aligned to \
                 {WORKSPACE_ALIGNMENT} bytes)"
            )));
        }
        if layout.splits == 0 {
            return Err(RuntimeError::InvalidInput(
                "0 splits (expected at least 1)".into(),
            ));
        }
        layout
            .pieces
            .check(layout.splits)
            .map_err(RuntimeError::InvalidInput)?;
        let at = |(offset, floats): (usize, usize)| Floats::Lent {
            ptr: ptr + offset as u64,
            floats,
        };
        Ok(DecodeScratch {
            splits: layout.splits,
            pieces: layout.pieces,
            rows: layout.rows,
            part_acc: at(layout.part_acc),
            part_ml: at(layout.part_ml),
            score_range: at(layout.score_range),
            scores: at(layout.scores),
        })
    }

    /// Makes the stored-scores buffer hold at least `floats`. Zeroed on the device rather than
    /// poisoned from the host like the partials (it can take gigabytes): the range pass writes
    /// every row the decode kernel uses, and rows a chunk copies past its tokens are masked.
    pub(crate) fn reserve_scores(&mut self, stream: &Arc<CudaStream>, floats: usize) -> Result<()> {
        self.scores.reserve(floats, "stored key scores", |n| {
            stream
                .alloc_zeros(n)
                .map_err(|e| RuntimeError::driver("allocate stored key scores", e))
        })
    }

    /// Makes the score-range buffer hold `range_splits` splits of every row, poisoned with NaN
    /// like the partials when it grows.
    pub(crate) fn reserve_ranges(
        &mut self,
        stream: &Arc<CudaStream>,
        range_splits: usize,
    ) -> Result<()> {
        let floats = self.rows * range_splits * 2;
        self.score_range
            .reserve(floats, "calibration score ranges", |n| {
                nan_filled(stream, n, "calibration score ranges")
            })
    }

    /// Split-K partitions this scratch was sized for.
    pub fn splits(&self) -> usize {
        self.splits
    }

    /// The pieces this scratch was sized for.
    pub fn pieces(&self) -> Pieces {
        self.pieces
    }
}

/// `n` (at least one) NaNs on the device.
fn nan_filled(stream: &Arc<CudaStream>, n: usize, what: &str) -> Result<CudaSlice<f32>> {
    stream
        .clone_htod(&vec![f32::NAN; n.max(1)])
        .map_err(|e| RuntimeError::driver(format!("allocate {what}"), e))
}
