//! The side traits both codebook units declare (`templates/codebook_sides.cu.tera`, the members
//! `kernels/include/kvq/codebook/side.cuh` lists), from the reference's device layout.

use kvq_reference::commvq::device::{SideKind, SideLayout};
use kvq_spec::CodebookSpan;
use serde::Serialize;

#[derive(Serialize)]
pub(super) struct SideCtx {
    name: &'static str,
    kind: &'static str,
    block_bytes: usize,
    codes_offset: usize,
    scales_offset: usize,
    local: usize,
    tail_cap: usize,
    levels: usize,
    residuals: usize,
    pairs: usize,
    groups: usize,
    code_bits: u32,
    stream_words: usize,
    rows: usize,
    token_scale: bool,
}

/// A side's traits; those its kind does not use hold harmless values, because the unit declares
/// every member for every side (kvq/codebook/side.cuh) and the header's sizes divide by them.
pub(super) fn side_ctx(name: &'static str, s: &SideLayout) -> SideCtx {
    let mut ctx = SideCtx {
        name,
        kind: "Fp16",
        block_bytes: s.block_bytes,
        codes_offset: s.codes.offset,
        scales_offset: s.scales.offset,
        local: s.local,
        tail_cap: s.tail_cap.max(1),
        levels: 1,
        residuals: 1,
        pairs: 32,
        groups: 1,
        code_bits: 2,
        stream_words: 1,
        rows: 32,
        token_scale: false,
    };
    match s.kind {
        SideKind::Fp16 => {}
        SideKind::Rope {
            levels,
            residuals,
            pairs_per_code,
            code_bits,
            groups,
            stream_words,
            span,
        } => {
            ctx.token_scale = span == CodebookSpan::Token;
            ctx.kind = "Rope";
            (ctx.levels, ctx.residuals, ctx.pairs, ctx.groups) =
                (levels, residuals, pairs_per_code, groups);
            (ctx.code_bits, ctx.stream_words) = (code_bits, stream_words);
        }
        SideKind::Additive { rows } => {
            ctx.kind = "Additive";
            ctx.rows = rows;
        }
    }
    ctx
}
