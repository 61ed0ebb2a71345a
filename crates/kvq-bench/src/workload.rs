//! Inputs of a run: random K/V generated once per context length, every scheme's reference cache
//! built from them (in parallel; XQuant's from random latents of its own), and the reference
//! outputs of the rows that will be checked.
//!
//! A batch of B sequences is B references to one cache: building 16 × 128K-token caches on the
//! CPU would take minutes and change nothing the GPU sees (the page table still maps every
//! sequence to its own pages).

use kvq::codegen::{has_codebook_kernel, has_xquant_kernel, Dtype, RebuildPrecision};
use kvq::reference::attention::{self, Queries};
use kvq::reference::commvq::{self, CalibrationData, CommVqCache, TrainOptions};
use kvq::reference::int::IntCache;
use kvq::reference::resources::AllocError;
use kvq::reference::rope::Rope;
use kvq::reference::xquant::XQuantCache;
use kvq::reference::KvTensor;
use kvq::runtime::tune::check::default_rows;
use kvq::runtime::tune::synth::{random_kv, random_queries};
use kvq::runtime::xquant::synthetic_cache;

use crate::error::{BenchError, Result};
use crate::grid::{BenchConfig, Scheme};

/// One sequence's cache, as its scheme's family stores it.
pub enum PreparedCache {
    /// FP16 and integer schemes.
    Int(Box<IntCache>),
    /// Codebook schemes (CommVQ), with the RoPE their keys were coded under.
    Codebook(Box<CommVqCache>),
    /// XQuant schemes: random latents over synthetic projections of the configured d_model
    /// (the decode's time depends on the widths and the tokens, not on the values), K rebuilt at
    /// [`XQUANT_PRECISION`].
    XQuant(Box<XQuantCache>),
}

/// The precision the bench rebuilds XQuant's K at: the library's default (one f16 product).
pub const XQUANT_PRECISION: RebuildPrecision = RebuildPrecision::F16;

/// Tokens a codebook scheme's codebooks are trained on (the first of the random K/V): timing does
/// not depend on how good they are, so the training stays short.
const CODEBOOK_CALIBRATION: usize = 1024;

/// A codebook scheme's cache of `k` (read as keys before RoPE) and `v`, with codebooks trained
/// briefly on their first tokens.
fn codebook_cache(scheme: &Scheme, k: &KvTensor, v: &KvTensor, seed: u64) -> Result<CommVqCache> {
    let reference =
        |e: kvq::reference::RefError| BenchError::Reference(format!("{}: {e}", scheme.name));
    let n = k.tokens.min(CODEBOOK_CALIBRATION);
    let (kc, vc) = (k.prefix(n), v.prefix(n));
    let rope = Rope::default();
    let data = CalibrationData {
        k_pre_rope: &kc,
        v: &vc,
        rope,
    };
    let books =
        commvq::train_with(&scheme.spec, &data, &TrainOptions::quick(seed)).map_err(reference)?;
    CommVqCache::build(&scheme.spec, k, v, rope, &books).map_err(reference)
}

/// One scheme's cache at one context length, with reference outputs.
pub struct Prepared {
    /// The scheme.
    pub scheme: Scheme,
    /// One sequence's cache.
    pub cache: PreparedCache,
    /// `(row, output)` of the CPU reference for every row any batch checks (empty without
    /// checks): whole rows, or for XQuant the query heads of the last KV head, from
    /// `reference_offset` in the row.
    pub reference: Vec<(usize, Vec<f32>)>,
    /// Where each reference output starts in its row of `[q_heads][head_dim]` values.
    pub reference_offset: usize,
}

/// Queries for the largest batch (smaller batches use its first rows).
pub struct QueryRows {
    /// Device words, `[batch][q_heads][head_dim]`.
    pub bits: Vec<u16>,
    /// The values the reference sees.
    pub values: Vec<f32>,
    /// Values per row.
    pub row_len: usize,
}

impl QueryRows {
    /// Random queries for `batch` rows of `q_heads × head_dim`; sizes past the machine are a
    /// [`BenchError::Memory`] naming the bytes.
    pub fn new(
        batch: usize,
        q_heads: usize,
        head_dim: usize,
        dtype: Dtype,
        seed: u64,
    ) -> Result<QueryRows> {
        let too_many = || {
            AllocError::overflow(format!(
                "the queries ({batch} rows × {q_heads} heads × {head_dim} channels)"
            ))
        };
        let row_len = q_heads.checked_mul(head_dim).ok_or_else(too_many)?;
        let count = batch.checked_mul(row_len).ok_or_else(too_many)?;
        let (bits, values) = random_queries(count, dtype, seed)?;
        Ok(QueryRows {
            bits,
            values,
            row_len,
        })
    }

    /// The first `batch` rows' device words.
    pub fn bits_for(&self, batch: usize) -> &[u16] {
        &self.bits[..(batch * self.row_len).min(self.bits.len())]
    }
}

/// Every row checked by some batch in `batches`: the first and last of each.
pub fn checked_rows(batches: &[usize]) -> Vec<usize> {
    let mut rows: Vec<usize> = batches.iter().flat_map(|&b| default_rows(b)).collect();
    rows.sort_unstable();
    rows.dedup();
    rows
}

/// Builds every scheme of `config` at `len` tokens from one random K/V, one thread per scheme,
/// and (when `config.check`) the reference output of each row in `rows`.
pub fn prepare(
    config: &BenchConfig,
    len: usize,
    queries: &QueryRows,
    rows: &[usize],
) -> Result<Vec<Prepared>> {
    let (kv_heads, head_dim, check) = (config.kv_heads, config.head_dim as usize, config.check);
    let seed = config.seed ^ (len as u64).rotate_left(32);
    let (k, v) = random_kv(kv_heads, len, head_dim, seed)?;
    let q_heads = queries.row_len / head_dim.max(1);
    let build = |scheme: &Scheme| -> Result<Prepared> {
        let reference_err =
            |e: kvq::reference::RefError| BenchError::Reference(format!("{}: {e}", scheme.name));
        let cache = if has_codebook_kernel(&scheme.spec) {
            PreparedCache::Codebook(Box::new(codebook_cache(scheme, &k, &v, seed)?))
        } else if has_xquant_kernel(&scheme.spec) {
            let shape = (kv_heads, head_dim, config.d_model);
            PreparedCache::XQuant(Box::new(synthetic_cache(&scheme.spec, shape, len, seed)?))
        } else {
            PreparedCache::Int(Box::new(
                IntCache::build(&scheme.spec, &k, &v).map_err(reference_err)?,
            ))
        };
        let mut reference = Vec::new();
        let mut reference_offset = 0;
        if let (true, PreparedCache::XQuant(c)) = (check, &cache) {
            (reference, reference_offset) =
                xquant_reference(c, queries, rows, kv_heads).map_err(reference_err)?;
        } else if check {
            // Integer caches are dequantized once, for every row.
            let mut deq = None;
            for &row in rows {
                let data = queries
                    .values
                    .get(row * queries.row_len..(row + 1) * queries.row_len)
                    .ok_or_else(|| BenchError::Usage(format!("no query row {row}")))?
                    .to_vec();
                let q = Queries {
                    data,
                    q_heads,
                    head_dim,
                };
                let out = match &cache {
                    PreparedCache::Int(c) => {
                        let deq = deq.get_or_insert_with(|| c.dequantize());
                        attention::decode(&q, deq, scheme.spec.calibrate.as_ref())
                    }
                    PreparedCache::Codebook(c) => c.attend(&q),
                    PreparedCache::XQuant(_) => {
                        return Err(BenchError::Reference("XQuant rows checked above".into()))
                    }
                }
                .map_err(reference_err)?;
                reference.push((row, out));
            }
        }
        Ok(Prepared {
            scheme: scheme.clone(),
            cache,
            reference,
            reference_offset,
        })
    };
    std::thread::scope(|s| {
        let handles: Vec<_> = config
            .schemes
            .iter()
            .map(|sc| s.spawn(|| build(sc)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(BenchError::Reference("a build thread panicked".into()))
                })
            })
            .collect()
    })
}

/// `(row, reference output)` pairs.
type ReferenceRows = Vec<(usize, Vec<f32>)>;

/// The reference outputs of the query heads of `cache`'s last KV head for each of `rows`, and
/// where they start in a row. One KV head, because rebuilding K of all of them at real widths
/// (latents of 1,024, 32K tokens) takes the CPU minutes and one a few seconds; the last, because
/// that is where a head's offset shows when it is wrong. The rest of each row is checked finite.
fn xquant_reference(
    cache: &XQuantCache,
    queries: &QueryRows,
    rows: &[usize],
    kv_heads: usize,
) -> std::result::Result<(ReferenceRows, usize), kvq::reference::RefError> {
    let head_dim = cache.projections().head_dim;
    let head = kv_heads.saturating_sub(1);
    let group = queries.row_len / head_dim.max(1) / kv_heads.max(1);
    let (offset, len) = (head * group * head_dim, group * head_dim);
    let deq = cache.dequantize_kv_head(head, XQUANT_PRECISION == RebuildPrecision::F16)?;
    let mut out = Vec::with_capacity(rows.len());
    for &row in rows {
        let at = row * queries.row_len + offset;
        let data = queries
            .values
            .get(at..at + len)
            .ok_or_else(|| kvq::reference::RefError::Mismatch(format!("no query row {row}")))?;
        let q = Queries {
            data: data.to_vec(),
            q_heads: group,
            head_dim,
        };
        out.push((row, attention::decode(&q, &deq, None)?));
    }
    Ok((out, offset))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::grid::{parse_schemes, BenchConfig};

    #[test]
    fn rows_cover_first_and_last_of_every_batch() {
        assert_eq!(checked_rows(&[1, 16]), [0, 15]);
        assert_eq!(checked_rows(&[1]), [0]);
        assert_eq!(checked_rows(&[4, 2]), [0, 1, 3]);
    }

    #[test]
    fn prepares_every_scheme_with_references() {
        let mut config = BenchConfig::standard();
        config.schemes = parse_schemes("kivi2,int8").unwrap();
        config.kv_heads = 2;
        config.head_dim = 64;
        let q = QueryRows::new(2, 4, 64, Dtype::F16, 9).unwrap();
        let prepared = prepare(&config, 300, &q, &[0, 1]).unwrap();
        assert_eq!(prepared.len(), 3);
        for p in &prepared {
            let PreparedCache::Int(cache) = &p.cache else {
                panic!(
                    "{}: an integer scheme prepared as a codebook",
                    p.scheme.name
                )
            };
            assert_eq!(cache.tokens(), 300);
            assert_eq!(p.reference.len(), 2);
            assert_eq!(p.reference[1].1.len(), 4 * 64);
            assert!(p.reference[1].1.iter().all(|x| x.is_finite()));
        }
        assert_eq!(q.bits_for(1).len(), 256);
        config.check = false;
        let unchecked = prepare(&config, 300, &q, &[0, 1]).unwrap();
        assert!(unchecked.iter().all(|p| p.reference.is_empty()));
    }

    #[test]
    fn codebook_schemes_prepare_commvq_caches_with_their_reference() {
        let mut config = BenchConfig::standard();
        let text =
            "k = codebook(rope_commutative, levels = 8, residuals = 2, pairs_per_code = 32), \
                    v = codebook(additive, rows = 64)";
        config.schemes = parse_schemes(text).unwrap();
        config.kv_heads = 2;
        config.head_dim = 64;
        let q = QueryRows::new(1, 4, 64, Dtype::F16, 3).unwrap();
        let prepared = prepare(&config, 300, &q, &[0]).unwrap();
        let p = prepared.iter().find(|p| p.scheme.name != "fp16").unwrap();
        let PreparedCache::Codebook(cache) = &p.cache else {
            panic!("a codebook scheme prepared as an integer cache")
        };
        assert_eq!(cache.tokens(), 300);
        // The reference row is the codebook cache's own attention of that query row.
        let want = cache
            .attend(&Queries {
                data: q.values[..4 * 64].to_vec(),
                q_heads: 4,
                head_dim: 64,
            })
            .unwrap();
        assert_eq!(p.reference, [(0, want)]);
    }

    #[test]
    fn xquant_schemes_prepare_latent_caches_checked_on_the_last_kv_head() {
        let mut config = BenchConfig::standard();
        config.schemes = parse_schemes("xquant2").unwrap();
        config.kv_heads = 2;
        config.head_dim = 64;
        config.d_model = 256;
        // 4 query heads, 2 a KV head.
        let q = QueryRows::new(2, 4, 64, Dtype::F16, 5).unwrap();
        let prepared = prepare(&config, 300, &q, &[0, 1]).unwrap();
        let p = prepared
            .iter()
            .find(|p| p.scheme.name == "xquant2")
            .unwrap();
        let PreparedCache::XQuant(cache) = &p.cache else {
            panic!("an XQuant scheme prepared as another family")
        };
        assert_eq!(cache.tokens(), 300);
        // Latents of min(256, 2 × 64).
        assert_eq!(cache.projections().k.rank, 128);
        assert_eq!(p.reference_offset, 2 * 64);
        assert_eq!(p.reference.len(), 2);
        // The last KV head's query heads of row 1, as the whole f16 rebuild attends them.
        let whole = cache.dequantize_f16_rebuild();
        let rows = attention::decode(
            &Queries {
                data: q.values[4 * 64..8 * 64].to_vec(),
                q_heads: 4,
                head_dim: 64,
            },
            &whole,
            None,
        )
        .unwrap();
        let (row, got) = &p.reference[1];
        assert_eq!(*row, 1);
        assert_eq!(got.len(), 2 * 64);
        assert!(attention::relative_error(got, &rows[2 * 64..]) < 1e-6);
    }

    #[test]
    fn sizes_past_the_machine_are_errors_naming_the_bytes() {
        let e = QueryRows::new(usize::MAX, 4, 64, Dtype::F16, 1)
            .err()
            .unwrap();
        assert!(e.to_string().contains("the queries"), "{e}");
        let mut config = BenchConfig::standard();
        config.schemes = parse_schemes("int8").unwrap();
        config.kv_heads = 8;
        config.head_dim = 128;
        let q = QueryRows::new(1, 8, 128, Dtype::F16, 1).unwrap();
        let e = prepare(&config, 100_000_000, &q, &[]).err().unwrap();
        assert!(
            matches!(e, BenchError::Memory(_)) && e.to_string().contains("819200000000 bytes"),
            "{e}"
        );
    }
}
