//! A sequence's CommVQ cache: FP16 sink/tail tokens plus packed codes of whole pages, and its
//! dequantization to the [`Dequantized`] K̂/V̂ the shared attention runs on.

use super::additive::{encode_vector, AdditiveCodebook, BookEncoder};
use super::key::{GroupEncoder, KeyCodebook};
use super::layout::{pack_stream, stream_words, unpack_stream, TensorLayout};
use super::train::{Codebooks, TensorCodebook};
use super::{pairs, vectors};
use crate::par;
use crate::regions::TokenRegions;
use crate::rope::Rope;
use crate::{Dequantized, KvTensor, RefError};
use half::f16;
use kvq_spec::{Codebook, CodebookQuant, CodebookSpan, SchemeSpec, TensorQuant};

/// How one tensor is coded.
#[derive(Debug, Clone, PartialEq)]
pub enum Coding {
    Fp16,
    /// RoPE-commutative codes of the pre-RoPE keys.
    Rope {
        codebook: KeyCodebook,
        span: CodebookSpan,
    },
    /// Binary additive codes (values; keys after RoPE).
    Additive(AdditiveCodebook),
}

/// One tensor's storage (read-only: the cache guarantees its sizes agree).
#[derive(Debug, Clone, PartialEq)]
pub struct Stored {
    pub(crate) coding: Coding,
    pub(crate) regions: TokenRegions,
    pub(crate) fp16: Vec<u16>,
    pub(crate) codes: Vec<u32>,
    pub(crate) scales: Vec<u16>,
    pub(crate) layout: TensorLayout,
}

impl Stored {
    /// How the tensor is coded (with its codebook).
    pub fn coding(&self) -> &Coding {
        &self.coding
    }

    /// The token split: FP16 sink, coded pages, FP16 tail.
    pub fn regions(&self) -> &TokenRegions {
        &self.regions
    }

    /// f16 bits of the FP16 tokens, `[kv_head][sink tokens, then tail tokens][head_dim]`; keys after RoPE.
    pub fn fp16(&self) -> &[u16] {
        &self.fp16
    }

    /// Packed codes, page-major (`layout().code_words` per page; see `docs/CODEBOOKS.md`).
    pub fn codes(&self) -> &[u32] {
        &self.codes
    }

    /// f16 bits of the per-vector scales (keys) or factors (additive), page-major (`layout().scales`
    /// per page).
    pub fn scales(&self) -> &[u16] {
        &self.scales
    }

    /// Words and scales per page.
    pub fn layout(&self) -> &TensorLayout {
        &self.layout
    }

    fn fp16_tokens(&self) -> usize {
        self.regions.sink().len() + self.regions.tail().len()
    }

    /// Position of `token` among the FP16 tokens (it must not be in a page).
    fn fp16_index(&self, token: usize) -> usize {
        if token < self.regions.sink_end {
            token
        } else {
            token - self.regions.quantized().len()
        }
    }

    /// The FP16 row of `token` in `head`, as f32.
    pub fn fp16_row(&self, head: usize, token: usize, head_dim: usize) -> Vec<f32> {
        let start = (head * self.fp16_tokens() + self.fp16_index(token)) * head_dim;
        self.fp16[start..start + head_dim]
            .iter()
            .map(|b| f16::from_bits(*b).to_f32())
            .collect()
    }

    pub(crate) fn page_codes(&self, page: usize) -> &[u32] {
        &self.codes[page * self.layout.code_words..(page + 1) * self.layout.code_words]
    }

    pub(crate) fn page_scales(&self, page: usize) -> &[u16] {
        &self.scales[page * self.layout.scales..(page + 1) * self.layout.scales]
    }
}

/// A CommVQ-coded sequence.
#[derive(Debug, Clone, PartialEq)]
pub struct CommVqCache {
    pub(crate) spec: SchemeSpec,
    pub(crate) kv_heads: usize,
    pub(crate) head_dim: usize,
    pub(crate) tokens: usize,
    pub(crate) rope: Rope,
    pub(crate) k: Stored,
    pub(crate) v: Stored,
}

pub(crate) fn coding(
    t: &TensorQuant,
    cb: Option<&TensorCodebook>,
    which: &str,
    kv_heads: usize,
    head_dim: usize,
) -> Result<Coding, RefError> {
    match (t, cb) {
        (TensorQuant::Fp16, _) => Ok(Coding::Fp16),
        (TensorQuant::Int(_), _) => Err(RefError::WrongEntryPoint(format!(
            "`{which}` is integer-quantized: build it with `int::IntCache`, not `commvq`"
        ))),
        (
            TensorQuant::Codebook(CodebookQuant {
                codebook: Codebook::RopeCommutative {
                    levels,
                    residuals,
                    pairs_per_code,
                },
                span,
            }),
            Some(TensorCodebook::RopeCommutative(c)),
        ) => {
            c.check(kv_heads, head_dim)?;
            if (c.levels, c.residuals, c.pairs_per_code) != (*levels as usize, *residuals as usize, *pairs_per_code as usize) {
                return Err(RefError::Mismatch(format!(
                    "`{which}` codebook has {} levels, {} residuals, {} pairs per code; the scheme asks for \
                     {levels}, {residuals}, {pairs_per_code}",
                    c.levels, c.residuals, c.pairs_per_code
                )));
            }
            Ok(Coding::Rope {
                codebook: c.clone(),
                span: *span,
            })
        }
        (
            TensorQuant::Codebook(CodebookQuant {
                codebook: Codebook::Additive { rows },
                span,
            }),
            Some(TensorCodebook::Additive(c)),
        ) => {
            c.check(*span, *rows as usize, kv_heads, head_dim)?;
            Ok(Coding::Additive(c.clone()))
        }
        (TensorQuant::Codebook(_), _) => Err(RefError::Mismatch(format!(
            "`{which}` needs a codebook of the kind its scheme declares (train one with `commvq::train`)"
        ))),
    }
}

fn f16_bits(x: f32) -> u16 {
    f16::from_f32(x).to_bits()
}

impl CommVqCache {
    /// Codes a sequence: `k_pre_rope` (keys before RoPE at positions `0..tokens`) and `v`.
    pub fn build(
        spec: &SchemeSpec,
        k_pre_rope: &KvTensor,
        v: &KvTensor,
        rope: Rope,
        codebooks: &Codebooks,
    ) -> Result<Self, RefError> {
        super::check_inputs(spec, k_pre_rope, v)?;
        let k_post = super::post_rope(k_pre_rope, rope);
        Self::code(spec, k_pre_rope, &k_post, v, rope, codebooks)
    }

    /// Codes a sequence whose keys are given both before and after RoPE, as an engine holds them
    /// (a GPU cache takes both in its 16-bit format; this is what it must equal): codes of
    /// RoPE-commutative keys from `k_pre_rope`, FP16 key rows and additive key codes from
    /// `k_post_rope`, which is not checked against `rope`.
    pub fn build_rotated(
        spec: &SchemeSpec,
        k_pre_rope: &KvTensor,
        k_post_rope: &KvTensor,
        v: &KvTensor,
        rope: Rope,
        codebooks: &Codebooks,
    ) -> Result<Self, RefError> {
        super::check_inputs(spec, k_pre_rope, v)?;
        let (h, d, len) = (k_pre_rope.kv_heads, k_pre_rope.head_dim, k_pre_rope.tokens);
        let k_post = k_post_rope;
        if (k_post.kv_heads, k_post.head_dim, k_post.tokens) != (h, d, len) {
            return Err(RefError::Mismatch(format!(
                "K before RoPE is [{h} × {len} × {d}] but after RoPE [{} × {} × {}]",
                k_post.kv_heads, k_post.tokens, k_post.head_dim
            )));
        }
        Self::code(spec, k_pre_rope, k_post, v, rope, codebooks)
    }

    /// [`CommVqCache::build_rotated`] on inputs already checked (`check_inputs`, agreeing shapes).
    fn code(
        spec: &SchemeSpec,
        k_pre_rope: &KvTensor,
        k_post: &KvTensor,
        v: &KvTensor,
        rope: Rope,
        codebooks: &Codebooks,
    ) -> Result<Self, RefError> {
        let (h, d, len) = (k_pre_rope.kv_heads, k_pre_rope.head_dim, k_pre_rope.tokens);
        let k_coding = coding(&spec.k, codebooks.k.as_ref(), "k", h, d)?;
        let v_coding = coding(&spec.v, codebooks.v.as_ref(), "v", h, d)?;
        crate::int::check_cacheable(k_post, "k after RoPE")?;
        let k = store(spec, &spec.k, k_coding, k_pre_rope, k_post)?;
        let v = store(spec, &spec.v, v_coding, v, v)?;
        Ok(Self {
            spec: *spec,
            kv_heads: h,
            head_dim: d,
            tokens: len,
            rope,
            k,
            v,
        })
    }

    pub fn spec(&self) -> &SchemeSpec {
        &self.spec
    }

    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    pub fn tokens(&self) -> usize {
        self.tokens
    }

    pub fn rope(&self) -> Rope {
        self.rope
    }

    /// The key tensor's storage.
    pub fn k(&self) -> &Stored {
        &self.k
    }

    /// The value tensor's storage.
    pub fn v(&self) -> &Stored {
        &self.v
    }

    /// K̂ (after RoPE) and V̂ exactly as a kernel reading this cache reconstructs them.
    pub fn dequantize(&self) -> Dequantized {
        let k = unstore(
            &self.k,
            self.kv_heads,
            self.head_dim,
            self.tokens,
            Some(self.rope),
        );
        let v = unstore(&self.v, self.kv_heads, self.head_dim, self.tokens, None);
        Dequantized {
            k,
            v,
            k_quantized: (0..self.tokens)
                .map(|t| self.k.regions.is_quantized(t))
                .collect(),
        }
    }
}

fn regions_for(spec: &SchemeSpec, t: &TensorQuant, len: usize) -> TokenRegions {
    match t {
        // Nothing to quantize: every token is an FP16 "sink" token.
        TensorQuant::Fp16 => TokenRegions::new(len, len, 0, spec.page as usize),
        _ => TokenRegions::new(
            len,
            spec.sink as usize,
            spec.local_of(t) as usize,
            spec.page as usize,
        ),
    }
}

/// Stores one tensor: FP16 tokens from `fp16_src` (keys: after RoPE), pages coded from `pre` (keys: before
/// RoPE for a RoPE-commutative codebook) or `fp16_src` (additive).
fn store(
    spec: &SchemeSpec,
    t: &TensorQuant,
    coding: Coding,
    pre: &KvTensor,
    fp16_src: &KvTensor,
) -> Result<Stored, RefError> {
    let h = pre.kv_heads;
    let regions = regions_for(spec, t, pre.tokens);
    let mut fp16 = Vec::new();
    for head in 0..h {
        for tok in regions.sink().chain(regions.tail()) {
            fp16.extend(fp16_src.row(head, tok).iter().map(|x| f16_bits(*x)));
        }
    }
    let page = regions.page;
    let (layout, codes, scales) = match &coding {
        Coding::Fp16 => (
            TensorLayout {
                code_words: 0,
                scales: 0,
            },
            Vec::new(),
            Vec::new(),
        ),
        Coding::Rope { codebook, span } => encode_rope(pre, codebook, *span, &regions)?,
        Coding::Additive(cb) => encode_additive(fp16_src, cb, &regions)?,
    };
    if codes.len() != layout.code_words * regions.pages
        || scales.len() != layout.scales * regions.pages
    {
        return Err(RefError::Mismatch(format!(
            "internal: page of {page} tokens packed to the wrong size"
        )));
    }
    Ok(Stored {
        coding,
        regions,
        fp16,
        codes,
        scales,
        layout,
    })
}

type Packed = (TensorLayout, Vec<u32>, Vec<u16>);

fn encode_rope(
    k: &KvTensor,
    cb: &KeyCodebook,
    span: CodebookSpan,
    regions: &TokenRegions,
) -> Result<Packed, RefError> {
    let (h, len, page) = (k.kv_heads, k.tokens, regions.page);
    let (groups, g, rounds, bits) = (cb.groups(), cb.pairs_per_code, cb.residuals, cb.code_bits());
    let vectors_per_token = match span {
        CodebookSpan::Head => h,
        CodebookSpan::Token => 1,
    };
    let layout = TensorLayout::rope(page, h, groups, rounds, bits, vectors_per_token)
        .ok_or_else(|| RefError::Mismatch("the key codes' page layout overflows".into()))?;
    let all_scales = vectors::key_scales(k, span)?;
    let scale_of =
        |head: usize, tok: usize| all_scales[vectors::key_scale_index(span, h, len, head, tok)];
    let half_bits = bits / 2;
    // Codes of every (head, group): [page][round][token in page].
    let per_group = par::map(h * groups, 0, |job| {
        let (head, group) = (job / groups, job % groups);
        let mut enc = GroupEncoder::new(cb, head, group);
        let mut out = vec![0u32; regions.pages * rounds * page];
        let mut code = vec![(0, 0); rounds];
        for p in 0..regions.pages {
            for (i, tok) in regions.page_tokens(p).enumerate() {
                let s = scale_of(head, tok);
                let inv = if s > 0.0 { 1.0 / s as f64 } else { 0.0 };
                enc.encode(&pairs::gather(k.row(head, tok), g, group, inv), &mut code);
                for (r, (a, b)) in code.iter().enumerate() {
                    out[(p * rounds + r) * page + i] = a << half_bits | b;
                }
            }
        }
        out
    })?;
    let stream = stream_words(page, bits);
    let mut codes = vec![0u32; layout.code_words * regions.pages];
    let mut scales = Vec::with_capacity(layout.scales * regions.pages);
    for p in 0..regions.pages {
        for (job, group_codes) in per_group.iter().enumerate() {
            for r in 0..rounds {
                let at = p * layout.code_words + (job * rounds + r) * stream;
                pack_stream(
                    &group_codes[(p * rounds + r) * page..][..page],
                    bits,
                    &mut codes[at..at + stream],
                )?;
            }
        }
        for vector in 0..vectors_per_token {
            scales.extend(
                regions
                    .page_tokens(p)
                    .map(|tok| f16_bits(scale_of(vector, tok))),
            );
        }
    }
    Ok((layout, codes, scales))
}

fn encode_additive(
    x: &KvTensor,
    cb: &AdditiveCodebook,
    regions: &TokenRegions,
) -> Result<Packed, RefError> {
    let (books, rows, dim, page) = (cb.books(), cb.rows, cb.dim(), regions.page);
    let layout = TensorLayout::additive(page, books, rows)
        .ok_or_else(|| RefError::Mismatch("the value codes' page layout overflows".into()))?;
    let words = rows / 32;
    // Per book: [page][word][token in page] codes and [page][token in page] factors.
    let per_book = par::map(books, 0, |b| -> Result<(Vec<u32>, Vec<u16>), RefError> {
        let book: Vec<f64> = cb.book(b).iter().map(|x| *x as f64).collect();
        let enc = BookEncoder::new(&book, rows, dim);
        let mut codes = vec![0u32; regions.pages * words * page];
        let mut factors = Vec::with_capacity(regions.pages * page);
        for p in 0..regions.pages {
            for (i, tok) in regions.page_tokens(p).enumerate() {
                let (code, w) =
                    encode_vector(&enc, cb, b, &vectors::additive_vector(x, cb.span, b, tok));
                if !w.is_finite() {
                    return Err(RefError::Mismatch(format!(
                        "token {tok}: its norm over the codebook's channel scales exceeds the f16 range"
                    )));
                }
                for (j, on) in code.iter().enumerate() {
                    if *on {
                        codes[(p * words + j / 32) * page + i] |= 1 << (j % 32);
                    }
                }
                factors.push(f16_bits(w));
            }
        }
        Ok((codes, factors))
    })?;
    let per_book = per_book.into_iter().collect::<Result<Vec<_>, _>>()?;
    let mut codes = Vec::with_capacity(layout.code_words * regions.pages);
    let mut scales = Vec::with_capacity(layout.scales * regions.pages);
    for p in 0..regions.pages {
        for (c, _) in &per_book {
            codes.extend_from_slice(&c[p * words * page..(p + 1) * words * page]);
        }
        for (_, f) in &per_book {
            scales.extend_from_slice(&f[p * page..(p + 1) * page]);
        }
    }
    Ok((layout, codes, scales))
}

/// Reconstructs one tensor; `rope` rotates keys coded before RoPE.
fn unstore(s: &Stored, h: usize, d: usize, len: usize, rope: Option<Rope>) -> KvTensor {
    let mut out = KvTensor::zeros(h, len, d);
    for head in 0..h {
        for tok in s.regions.sink().chain(s.regions.tail()) {
            out.row_mut(head, tok)
                .copy_from_slice(&s.fp16_row(head, tok, d));
        }
    }
    for p in 0..s.regions.pages {
        for (i, tok) in s.regions.page_tokens(p).enumerate() {
            match &s.coding {
                Coding::Fp16 => {}
                Coding::Rope { codebook, span } => {
                    for head in 0..h {
                        let row = decode_rope_key(s, codebook, *span, p, i, head);
                        let dst = out.row_mut(head, tok);
                        for (o, x) in dst.iter_mut().zip(row) {
                            *o = x as f32;
                        }
                        if let Some(r) = rope {
                            r.apply(dst, tok);
                        }
                    }
                }
                Coding::Additive(cb) => {
                    for b in 0..cb.books() {
                        let vec = decode_additive(s, cb, p, i, b);
                        match cb.span {
                            CodebookSpan::Head => out.row_mut(b, tok).copy_from_slice(&vec),
                            CodebookSpan::Token => {
                                for head in 0..h {
                                    out.row_mut(head, tok)
                                        .copy_from_slice(&vec[head * d..(head + 1) * d]);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    out
}

/// Code `(a, b)` of (head, group, round) for token `i` of page `p`.
pub(crate) fn rope_code(
    s: &Stored,
    cb: &KeyCodebook,
    p: usize,
    i: usize,
    head: usize,
    group: usize,
    round: usize,
) -> (u32, u32) {
    let bits = cb.code_bits();
    let stream = stream_words(s.regions.page, bits);
    let at = ((head * cb.groups() + group) * cb.residuals + round) * stream;
    // In range by construction (the cache sizes every page from its layout).
    let c = unpack_stream(&s.page_codes(p)[at..at + stream], bits, i).unwrap_or_default();
    (c >> (bits / 2), c & ((1 << (bits / 2)) - 1))
}

/// The f16 scale of token `i` of page `p` for `head`.
pub(crate) fn rope_scale(s: &Stored, span: CodebookSpan, p: usize, i: usize, head: usize) -> f64 {
    let vector = match span {
        CodebookSpan::Head => head,
        CodebookSpan::Token => 0,
    };
    f16::from_bits(s.page_scales(p)[vector * s.regions.page + i]).to_f64()
}

/// The pre-RoPE key of `head` at token `i` of page `p` (f64).
fn decode_rope_key(
    s: &Stored,
    cb: &KeyCodebook,
    span: CodebookSpan,
    p: usize,
    i: usize,
    head: usize,
) -> Vec<f64> {
    let (g, d) = (cb.pairs_per_code, cb.head_dim);
    let scale = rope_scale(s, span, p, i, head);
    let mut row = vec![0.0; d];
    let mut group_vec = vec![0.0; 2 * g];
    for group in 0..cb.groups() {
        group_vec.iter_mut().for_each(|x| *x = 0.0);
        for r in 0..cb.residuals {
            cb.add_code(
                head,
                group,
                r,
                rope_code(s, cb, p, i, head, group, r),
                &mut group_vec,
            );
        }
        pairs::scatter_add(&group_vec, g, group, scale, &mut row);
    }
    row
}

/// Whether row `j` of book `b`'s code is set for token `i` of page `p`.
pub(crate) fn additive_bit(
    s: &Stored,
    cb: &AdditiveCodebook,
    p: usize,
    i: usize,
    b: usize,
    j: usize,
) -> bool {
    let page = s.regions.page;
    let words = cb.rows / 32;
    s.page_codes(p)[(b * words + j / 32) * page + i] >> (j % 32) & 1 == 1
}

/// The factor `w` of book `b` for token `i` of page `p`.
pub(crate) fn additive_factor(s: &Stored, p: usize, i: usize, b: usize) -> f64 {
    f16::from_bits(s.page_scales(p)[b * s.regions.page + i]).to_f64()
}

/// `μ + w · (s·C) ⊙ σ` of book `b` at token `i` of page `p`.
fn decode_additive(s: &Stored, cb: &AdditiveCodebook, p: usize, i: usize, b: usize) -> Vec<f32> {
    let dim = cb.dim();
    let book = cb.book(b);
    let mut acc = vec![0.0f64; dim];
    for j in 0..cb.rows {
        if additive_bit(s, cb, p, i, b, j) {
            for (a, c) in acc.iter_mut().zip(&book[j * dim..(j + 1) * dim]) {
                *a += *c as f64;
            }
        }
    }
    let w = additive_factor(s, p, i, b);
    acc.iter()
        .zip(cb.scale(b))
        .zip(cb.mean(b))
        .map(|((a, sc), m)| (*m as f64 + w * a * *sc as f64) as f32)
        .collect()
}
