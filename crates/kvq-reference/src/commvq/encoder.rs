//! The encoders' precomputed tables, as a GPU encoder reads them: the same f64 values the reference
//! encoders compute from a codebook before they code a token (`key::RoundTables` for
//! RoPE-commutative keys, `additive::BookEncoder` for binary additive tensors), so a device
//! encoder that follows their arithmetic step by step writes the reference's codes bit for bit.
//!
//! Tables are per layer, `f64`, little-endian when uploaded; a side stored in FP16 has none.

use super::additive::{AdditiveCodebook, BookEncoder};
use super::cache::{coding, Coding};
use super::key::{KeyCodebook, RoundTables};
use super::train::Codebooks;
use crate::RefError;
use kvq_spec::SchemeSpec;

/// The greedy residual encoder's tables of a RoPE-commutative key codebook, one block per
/// (KV head, group, round) in that order; `2g` is a group's real dimension.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct RopeTables {
    /// `[head][group][round][entry][2g]`: the entries `c_k` as real vectors (pair-interleaved).
    pub c: Vec<f64>,
    /// `[head][group][round][entry][2g]`: `i·c_k`.
    pub ic: Vec<f64>,
    /// `[head][group][round][entry]`: `‖c_k‖²`.
    pub norm: Vec<f64>,
    /// `[head][group][round][a][b]`: `c_a · (i·c_b)`.
    pub cross: Vec<f64>,
}

/// The iterated-conditional-modes encoder's tables of a binary additive codebook, per book.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct AdditiveTables {
    /// `[book][row][dim]`: the rows `C_j` (not scaled by σ).
    pub rows: Vec<f64>,
    /// `[book][row]`: `‖C_j‖²`.
    pub norm: Vec<f64>,
    /// `[book][row / 2]`: `C_2j · C_2j+1`.
    pub pair_cross: Vec<f64>,
    /// `[book][dim]`: μ.
    pub mean: Vec<f64>,
    /// `[book][dim]`: σ.
    pub scale: Vec<f64>,
}

/// One side's encoder tables.
#[derive(Debug, Clone, PartialEq)]
pub enum SideTables {
    /// Stored in FP16: nothing to encode.
    Fp16,
    Rope(RopeTables),
    Additive(AdditiveTables),
}

/// A layer's encoder tables for both sides.
#[derive(Debug, Clone, PartialEq)]
pub struct EncoderTables {
    pub k: SideTables,
    pub v: SideTables,
}

impl EncoderTables {
    /// The tables of `codebooks` for `spec` at `kv_heads` heads of `head_dim`; refuses codebooks of
    /// another scheme or shape (the checks [`super::CommVqCache::build`] makes).
    pub fn new(
        spec: &SchemeSpec,
        codebooks: &Codebooks,
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self, RefError> {
        let k = coding(&spec.k, codebooks.k.as_ref(), "k", kv_heads, head_dim)?;
        let v = coding(&spec.v, codebooks.v.as_ref(), "v", kv_heads, head_dim)?;
        Ok(Self {
            k: side_tables(&k),
            v: side_tables(&v),
        })
    }
}

fn side_tables(c: &Coding) -> SideTables {
    match c {
        Coding::Fp16 => SideTables::Fp16,
        Coding::Rope { codebook, .. } => SideTables::Rope(rope_tables(codebook)),
        Coding::Additive(cb) => SideTables::Additive(additive_tables(cb)),
    }
}

fn rope_tables(cb: &KeyCodebook) -> RopeTables {
    let mut t = RopeTables::default();
    let dim = 2 * cb.pairs_per_code;
    for head in 0..cb.kv_heads {
        for group in 0..cb.groups() {
            for round in 0..cb.residuals {
                let table: Vec<f64> = cb
                    .table(head, group, round)
                    .iter()
                    .map(|x| *x as f64)
                    .collect();
                let r = RoundTables::new(&table, cb.levels, dim);
                t.c.extend_from_slice(&r.c);
                t.ic.extend_from_slice(&r.ic);
                t.norm.extend_from_slice(&r.norm);
                t.cross.extend_from_slice(&r.cross);
            }
        }
    }
    t
}

fn additive_tables(cb: &AdditiveCodebook) -> AdditiveTables {
    let mut t = AdditiveTables::default();
    let dim = cb.dim();
    for b in 0..cb.books() {
        let book: Vec<f64> = cb.book(b).iter().map(|x| *x as f64).collect();
        let enc = BookEncoder::new(&book, cb.rows, dim);
        t.rows.extend_from_slice(&enc.rows);
        t.norm.extend_from_slice(&enc.norm);
        t.pair_cross.extend_from_slice(&enc.pair_cross);
        t.mean.extend(cb.mean(b).iter().map(|x| *x as f64));
        t.scale.extend(cb.scale(b).iter().map(|x| *x as f64));
    }
    t
}
