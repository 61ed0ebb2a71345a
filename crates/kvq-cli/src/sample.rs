//! `kvq gen --sample`: a small batch in the documented device layout (page pools, page table, FP16
//! sink and tail rings, lengths), queries, and the CPU reference's output for them — so an engine
//! that embeds the generated kernels can check its launch against known bytes without kvq.
//!
//! The buffers are assembled here from the reference's page blocks by the rules in docs/LAYOUT.md
//! and docs/KERNELS.md (not by the runtime's uploader), so a launch that passes also confirms the
//! documentation. Physical pages are handed out in reverse order and unused pool bytes are
//! poisoned, so a launch that ignored the page table would fail.

use std::path::{Path, PathBuf};

use kvq::codegen::{Dtype, KernelShape};
use kvq::reference::attention::{self, Queries};
use kvq::reference::int::{IntCache, TensorStore};
use kvq::reference::resources;
use kvq::runtime::tune::synth::{random_kv, random_queries};
use kvq::runtime::tune::tolerance;
use kvq::SchemeSpec;
use serde::Serialize;

use crate::error::{CliError, Result};

/// Folder of the sample inside `kvq gen`'s output.
pub const SAMPLE_DIR: &str = "sample";
/// Byte of pool blocks no sequence uses.
pub(crate) const POISON: u8 = 0xA5;

/// What sample to write.
#[derive(Debug, Clone, PartialEq)]
pub struct SampleSpec {
    /// Tokens of each sequence of the batch.
    pub lengths: Vec<usize>,
    /// KV heads per sequence.
    pub kv_heads: usize,
    /// Seed of the random K/V and queries.
    pub seed: u64,
    /// Split-K count the sample suggests (anything ≥ 1 gives the same result).
    pub num_splits: usize,
}

impl Default for SampleSpec {
    fn default() -> Self {
        SampleSpec {
            // A token alone, one inside the first page's window, and two with quantized pages.
            lengths: vec![1, 77, 300, 1000],
            kv_heads: 2,
            seed: 7,
            num_splits: 3,
        }
    }
}

/// Files written and a one-line summary.
#[derive(Debug, Clone)]
pub struct Written {
    pub dir_name: String,
    pub files: Vec<(PathBuf, u64)>,
    pub summary: String,
}

/// One buffer of a sample, as `sample.json` lists it.
#[derive(Serialize)]
pub(crate) struct FileInfo {
    name: String,
    file: String,
    element: String,
    shape: Vec<usize>,
    bytes: usize,
}

/// A buffer to write: name, element type, shape in elements, little-endian bytes.
pub(crate) type Buffer<'a> = (&'a str, &'a str, Vec<usize>, Vec<u8>);

/// A batch's page table with physical pages handed out from the top down (so a launch that
/// ignored the table would read the wrong blocks).
pub(crate) struct Pages {
    /// `[sequence][max_pages]` i32, −1 past a sequence's pages.
    pub table: Vec<i32>,
    /// Each sequence's physical pages, in logical order.
    pub slots: Vec<Vec<usize>>,
    pub physical: usize,
    pub max_pages: usize,
}

/// The page table of sequences holding `counts` logical pages each.
pub(crate) fn pages_from_the_top(counts: &[usize]) -> Pages {
    let physical: usize = counts.iter().sum();
    let max_pages = counts.iter().copied().max().unwrap_or(0).max(1);
    let mut table = vec![-1i32; counts.len() * max_pages];
    let mut slots = Vec::new();
    let mut next = physical;
    for (b, &n) in counts.iter().enumerate() {
        let mut own = Vec::new();
        for j in 0..n {
            next -= 1;
            own.push(next);
            table[b * max_pages + j] = next as i32;
        }
        slots.push(own);
    }
    Pages {
        table,
        slots,
        physical,
        max_pages,
    }
}

/// Files written, with their sizes.
pub(crate) type Files = Vec<(PathBuf, u64)>;

/// Writes each buffer as `dir/<name>.bin`: the files written and their `sample.json` entries.
pub(crate) fn write_buffers(
    dir: &Path,
    entries: Vec<Buffer<'_>>,
) -> Result<(Files, Vec<FileInfo>)> {
    let mut files = Vec::new();
    let mut infos = Vec::new();
    for (name, element, shape_of, bytes) in entries {
        let file = format!("{name}.bin");
        let path = dir.join(&file);
        std::fs::write(&path, &bytes).map_err(|source| CliError::Write {
            path: path.clone(),
            source,
        })?;
        files.push((path, bytes.len() as u64));
        infos.push(FileInfo {
            name: name.into(),
            file,
            element: element.into(),
            shape: shape_of,
            bytes: bytes.len(),
        });
    }
    Ok((files, infos))
}

/// Writes `info` as `dir/sample.json` and lists it in `files`.
pub(crate) fn write_json<T: Serialize>(dir: &Path, info: &T, files: &mut Files) -> Result<()> {
    let json = serde_json::to_string_pretty(info)
        .map_err(|e| CliError::Usage(format!("sample.json: {e}")))?;
    let path = dir.join("sample.json");
    std::fs::write(&path, json.as_bytes()).map_err(|source| CliError::Write {
        path: path.clone(),
        source,
    })?;
    files.push((path, json.len() as u64));
    Ok(())
}

/// `sample.json`: the batch, its buffers and how to check an output. A codebook scheme's sample
/// (`crate::sample_codebook`) adds its family, RoPE base and codebook file.
#[derive(Serialize)]
pub(crate) struct SampleInfo {
    pub format: &'static str,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub family: Option<&'static str>,
    pub scheme: String,
    pub batch: usize,
    pub kv_heads: usize,
    pub q_heads: usize,
    pub head_dim: u32,
    pub gqa: u32,
    pub dtype: Dtype,
    pub seq_lens: Vec<usize>,
    pub max_pages: usize,
    pub physical_pages: usize,
    pub num_splits: usize,
    /// RoPE base the keys were coded under (codebook schemes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rope_theta: Option<f64>,
    /// Largest accepted ‖out − expected‖ / ‖expected‖ per sequence.
    pub tolerance: f64,
    pub seed: u64,
    /// The layer's codebooks file (codebook schemes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub codebook_file: Option<&'static str>,
    pub files: Vec<FileInfo>,
    pub notes: Vec<String>,
}

/// Host copies of one tensor's device buffers for the whole batch.
struct Gathered {
    pool: Vec<u8>,
    sink: Vec<u16>,
    tail: Vec<u16>,
}

fn gather(
    stores: &[&TensorStore],
    slots: &[Vec<usize>],
    physical: usize,
    kv_heads: usize,
) -> Gathered {
    let block_bytes = stores.first().map_or(0, |s| s.block_bytes());
    let mut pool = vec![POISON; physical * kv_heads * block_bytes];
    let (mut sink, mut tail) = (Vec::new(), Vec::new());
    for (store, slots) in stores.iter().zip(slots) {
        for (page, &phys) in slots.iter().enumerate().take(store.pages()) {
            for head in 0..kv_heads {
                if let Some(block) = store.block(page, head) {
                    let at = (phys * kv_heads + head) * block_bytes;
                    pool[at..at + block_bytes].copy_from_slice(block);
                }
            }
        }
        sink.extend(store.sink().iter().map(|h| h.to_bits()));
        tail.extend(store.tail().iter().map(|h| h.to_bits()));
    }
    Gathered { pool, sink, tail }
}

/// Little-endian bytes of 16- and 32-bit values.
pub(crate) fn le16(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
pub(crate) fn le32i(v: &[i32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}
pub(crate) fn le32f(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Refuses a sample larger than the machine's memory before any of it is generated: per sequence
/// its f32 K and V, the quantized cache, the dequantized K̂ and V̂ the reference output comes from,
/// and the gathered device buffers — about six f32 K/V-sized buffers in all.
fn check_memory(s: &SampleSpec, head_dim: usize) -> Result<()> {
    let total = s.lengths.iter().try_fold(0u64, |acc, &len| {
        let kv = resources::bytes_of::<f32>(resources::product(&[2, s.kv_heads, len, head_dim])?)?;
        acc.checked_add(kv.checked_mul(3)?)
    });
    resources::check(
        total,
        &format!(
            "a sample of {:?} tokens × {} KV heads × head_dim {head_dim}",
            s.lengths, s.kv_heads
        ),
    )
    .map(|_| ())
    .map_err(|e| CliError::Usage(format!("--sample-lengths/--sample-kv-heads: {e}")))
}

/// Refuses a sample that cannot be made (empty or zero lengths, lengths past the kernels' i32,
/// more memory than the machine has) before anything is generated or written.
pub fn check(s: &SampleSpec, shape: &KernelShape) -> Result<()> {
    if s.lengths.is_empty() || s.lengths.contains(&0) || s.kv_heads == 0 || s.num_splits == 0 {
        return Err(CliError::Usage(format!(
            "--sample-lengths must list positive lengths and --sample-kv-heads be ≥ 1 (got {:?}, {})",
            s.lengths, s.kv_heads
        )));
    }
    // The kernels take sequence lengths as i32.
    if let Some(&len) = s.lengths.iter().find(|&&n| i32::try_from(n).is_err()) {
        return Err(CliError::Usage(format!(
            "--sample-lengths: {len} tokens is more than the kernels' i32 sequence lengths hold \
             ({})",
            i32::MAX
        )));
    }
    check_memory(s, shape.head_dim as usize)
}

/// Writes `out/sample/`: see the module docs.
pub fn write(
    out: &Path,
    spec: &SchemeSpec,
    shape: &KernelShape,
    s: &SampleSpec,
) -> Result<Written> {
    check(s, shape)?;
    let (h, d) = (s.kv_heads, shape.head_dim as usize);
    let q_heads = h * shape.gqa as usize;
    let caches: Vec<IntCache> = s
        .lengths
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            let (k, v) = random_kv(h, len, d, s.seed.wrapping_add(i as u64))
                .map_err(|e| CliError::Usage(format!("--sample-lengths: {e}")))?;
            IntCache::build(spec, &k, &v)
                .map_err(|e| CliError::Unsupported(format!("sample cache: {e}")))
        })
        .collect::<Result<_>>()?;

    let counts: Vec<usize> = caches
        .iter()
        .map(|c| c.k().pages().max(c.v().pages()))
        .collect();
    let Pages {
        table: page_table,
        slots,
        physical,
        max_pages,
    } = pages_from_the_top(&counts);
    let ks: Vec<&TensorStore> = caches.iter().map(|c| c.k()).collect();
    let vs: Vec<&TensorStore> = caches.iter().map(|c| c.v()).collect();
    let k = gather(&ks, &slots, physical, h);
    let v = gather(&vs, &slots, physical, h);
    let seq_lens: Vec<i32> = s.lengths.iter().map(|&n| n as i32).collect();
    let n = caches.len() * q_heads * d;
    let (q_bits, q_vals) = random_queries(n, shape.dtype, s.seed)
        .map_err(|e| CliError::Usage(format!("--sample-lengths: {e}")))?;
    let mut expected = Vec::with_capacity(n);
    for (b, c) in caches.iter().enumerate() {
        let per = q_heads * d;
        let q = Queries {
            data: q_vals[b * per..(b + 1) * per].to_vec(),
            q_heads,
            head_dim: d,
        };
        let o = attention::decode(&q, &c.dequantize(), spec.calibrate.as_ref())
            .map_err(|e| CliError::Unsupported(format!("sample reference: {e}")))?;
        expected.extend(o);
    }

    let dir = out.join(SAMPLE_DIR);
    std::fs::create_dir_all(&dir).map_err(|source| CliError::Write {
        path: dir.clone(),
        source,
    })?;
    let batch = caches.len();
    let per_seq = |rows: usize| vec![batch, h, rows, d];
    let k_sink_rows = ks.first().map_or(0, |s| s.sink_capacity());
    let v_sink_rows = vs.first().map_or(0, |s| s.sink_capacity());
    let k_tail_rows = ks.first().map_or(0, |s| s.tail_capacity());
    let v_tail_rows = vs.first().map_or(0, |s| s.tail_capacity());
    let io = shape.dtype.to_string();
    // An empty buffer is written as one poison element: kernels never read it, and an engine
    // still needs a valid pointer to pass.
    let nonempty8 = |v: Vec<u8>| if v.is_empty() { vec![POISON] } else { v };
    let nonempty16 = |v: &[u16]| {
        if v.is_empty() {
            vec![0xFFFF]
        } else {
            v.to_vec()
        }
    };
    let entries: Vec<(&str, &str, Vec<usize>, Vec<u8>)> = vec![
        (
            "k_pool",
            "u8",
            vec![physical, h, ks[0].block_bytes()],
            nonempty8(k.pool),
        ),
        (
            "v_pool",
            "u8",
            vec![physical, h, vs[0].block_bytes()],
            nonempty8(v.pool),
        ),
        (
            "page_table",
            "i32",
            vec![batch, max_pages],
            le32i(&page_table),
        ),
        (
            "k_sink",
            "f16",
            per_seq(k_sink_rows),
            le16(&nonempty16(&k.sink)),
        ),
        (
            "v_sink",
            "f16",
            per_seq(v_sink_rows),
            le16(&nonempty16(&v.sink)),
        ),
        (
            "k_tail",
            "f16",
            per_seq(k_tail_rows),
            le16(&nonempty16(&k.tail)),
        ),
        (
            "v_tail",
            "f16",
            per_seq(v_tail_rows),
            le16(&nonempty16(&v.tail)),
        ),
        ("seq_lens", "i32", vec![batch], le32i(&seq_lens)),
        ("q", &io, vec![batch, q_heads, d], le16(&q_bits)),
        ("expected", "f32", vec![batch, q_heads, d], le32f(&expected)),
    ];
    let (mut files, infos) = write_buffers(&dir, entries)?;
    let info = SampleInfo {
        format: "kvq-gen-sample",
        family: None,
        scheme: spec.to_string(),
        batch,
        kv_heads: h,
        q_heads,
        head_dim: shape.head_dim,
        gqa: shape.gqa,
        dtype: shape.dtype,
        seq_lens: s.lengths.clone(),
        max_pages,
        physical_pages: physical,
        num_splits: s.num_splits,
        rope_theta: None,
        tolerance: tolerance(shape.dtype),
        seed: s.seed,
        codebook_file: None,
        files: infos,
        notes: vec![
            "little-endian raw arrays; shapes in elements; an empty buffer holds one poison \
             element (never read)"
                .into(),
            "expected: CPU reference decode over the same quantized cache (f32); compare per \
             sequence with relative L2 error"
                .into(),
            "out and scratch are not included: allocate them (outputs poisoned with 0xFFFF to \
             catch unwritten values)"
                .into(),
        ],
    };
    write_json(&dir, &info, &mut files)?;
    Ok(Written {
        dir_name: SAMPLE_DIR.into(),
        files,
        summary: format!(
            "sample batch: {batch} sequences of {:?} tokens, {h} KV heads, {q_heads} query heads, \
             {physical} physical pages, with the reference output (tolerance {:.0e})",
            s.lengths,
            tolerance(shape.dtype)
        ),
    })
}
