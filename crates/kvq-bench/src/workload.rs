//! Inputs of a run: random K/V generated once per context length, every scheme's reference cache
//! built from them (in parallel), and the reference outputs of the rows that will be checked.
//!
//! A batch of B sequences is B references to one cache: building 16 × 128K-token caches on the
//! CPU would take minutes and change nothing the GPU sees (the page table still maps every
//! sequence to its own pages).

use kvq::codegen::Dtype;
use kvq::reference::attention::{self, Queries};
use kvq::reference::int::IntCache;
use kvq::reference::resources::AllocError;
use kvq::runtime::tune::check::default_rows;
use kvq::runtime::tune::synth::{random_kv, random_queries};

use crate::error::{BenchError, Result};
use crate::grid::{BenchConfig, Scheme};

/// One scheme's cache at one context length, with reference outputs.
pub struct Prepared {
    /// The scheme.
    pub scheme: Scheme,
    /// One sequence's cache.
    pub cache: IntCache,
    /// `(row, output)` of the CPU reference for every row any batch checks (empty without
    /// checks).
    pub reference: Vec<(usize, Vec<f32>)>,
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
        let cache = IntCache::build(&scheme.spec, &k, &v)
            .map_err(|e| BenchError::Reference(format!("{}: {e}", scheme.name)))?;
        let mut reference = Vec::new();
        if check {
            let deq = cache.dequantize();
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
                let out = attention::decode(&q, &deq, scheme.spec.calibrate.as_ref())
                    .map_err(|e| BenchError::Reference(format!("{}: {e}", scheme.name)))?;
                reference.push((row, out));
            }
        }
        Ok(Prepared {
            scheme: scheme.clone(),
            cache,
            reference,
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
            assert_eq!(p.cache.tokens(), 300);
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
