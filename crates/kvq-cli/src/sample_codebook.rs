//! `kvq gen --sample` for codebook schemes: a small batch coded by the CPU reference and laid out
//! as `kvq_reference::commvq::device` says (page pools with a page table handed out in reverse,
//! unused pool bytes poisoned; FP16 sink and tail rings; lengths), the layer's codebooks as the
//! decode reads them and as a `kvq-codebooks-1` file, queries, and the reference's output — so an
//! engine that embeds the generated decode checks its launch against known bytes without kvq.

use std::path::Path;

use kvq::codegen::KernelShape;
use kvq::reference::attention::Queries;
use kvq::reference::commvq::device::{DeviceLayout, DeviceTensor, SideLayout};
use kvq::reference::commvq::{self, CalibrationData, CommVqCache, TrainOptions};
use kvq::reference::rope::Rope;
use kvq::reference::synth::{generate, SynthConfig};
use kvq::runtime::tune::synth::{random_kv, random_queries};
use kvq::runtime::tune::tolerance;
use kvq::SchemeSpec;

use crate::error::{CliError, Result};
use crate::sample::{
    le16, le32f, le32i, pages_from_the_top, write_buffers, write_json, Buffer, Pages, SampleInfo,
    SampleSpec, Written, POISON, SAMPLE_DIR,
};

/// The file the layer's codebooks are saved to inside the sample.
pub const CODEBOOK_FILE: &str = "codebooks.safetensors";

/// Refuses a sample that cannot be made, as the integer sample does.
pub fn check(s: &SampleSpec, shape: &KernelShape) -> Result<()> {
    crate::sample::check(s, shape)
}

/// One side's pool of the batch: each sequence's blocks at the physical pages `slots` give it.
fn gather(
    layout: &DeviceLayout,
    side: &SideLayout,
    tensors: &[&DeviceTensor],
    slots: &[Vec<usize>],
    physical: usize,
) -> Vec<u8> {
    let h = layout.kv_heads;
    let mut pool = vec![POISON; (physical * h * side.block_bytes).max(1)];
    for (t, own) in tensors.iter().zip(slots) {
        for (page, &phys) in own.iter().enumerate().take(t.pages) {
            for head in 0..h {
                let src = &t.blocks[layout.block_range(side, page, head)];
                let at = (phys * h + head) * side.block_bytes;
                pool[at..at + side.block_bytes].copy_from_slice(src);
            }
        }
    }
    pool
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
    let layout = DeviceLayout::new(spec, h, d)
        .map_err(|e| CliError::Unsupported(format!("sample layout: {e}")))?;
    let q_heads = h * shape.gqa as usize;
    let unsupported = |what: &str, e: kvq::reference::RefError| {
        CliError::Unsupported(format!("sample {what}: {e}"))
    };
    // Codebooks trained briefly on a synthetic layer of the sample's shape.
    let cal = generate(&SynthConfig {
        tokens: 512,
        kv_heads: h,
        gqa: 1,
        head_dim: d,
        d_model: 128,
        seed: s.seed,
        ..Default::default()
    });
    let data = CalibrationData {
        k_pre_rope: &cal.k_pre_rope,
        v: &cal.v,
        rope: cal.rope,
    };
    let books = commvq::train_with(spec, &data, &TrainOptions::quick(s.seed))
        .map_err(|e| unsupported("codebooks", e))?;
    let rope = Rope::default();
    let caches: Vec<CommVqCache> = s
        .lengths
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            let (k, v) = random_kv(h, len, d, s.seed.wrapping_add(i as u64))
                .map_err(|e| CliError::Usage(format!("--sample-lengths: {e}")))?;
            CommVqCache::build(spec, &k, &v, rope, &books).map_err(|e| unsupported("cache", e))
        })
        .collect::<Result<_>>()?;
    let seqs = caches
        .iter()
        .map(|c| c.device_sequence())
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| unsupported("device layout", e))?;
    let device_books = caches[0]
        .device_codebooks()
        .map_err(|e| unsupported("codebooks", e))?;

    // Logical pages per sequence (K and V share the table); physical pages from the top down.
    let counts: Vec<usize> = seqs.iter().map(|q| q.k.pages.max(q.v.pages)).collect();
    let Pages {
        table: page_table,
        slots,
        physical,
        max_pages,
    } = pages_from_the_top(&counts);
    let ks: Vec<&DeviceTensor> = seqs.iter().map(|q| &q.k).collect();
    let vs: Vec<&DeviceTensor> = seqs.iter().map(|q| &q.v).collect();
    let k_pool = gather(&layout, &layout.k, &ks, &slots, physical);
    let v_pool = gather(&layout, &layout.v, &vs, &slots, physical);
    let cat = |ts: &[&DeviceTensor], f: fn(&DeviceTensor) -> &[u16]| -> Vec<u16> {
        let v: Vec<u16> = ts.iter().flat_map(|t| f(t).iter().copied()).collect();
        if v.is_empty() {
            vec![0xFFFF]
        } else {
            v
        }
    };
    let seq_lens: Vec<i32> = s.lengths.iter().map(|&n| n as i32).collect();
    let n = seqs.len() * q_heads * d;
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
        expected.extend(c.attend(&q).map_err(|e| unsupported("reference", e))?);
    }
    let nonempty_f32 = |v: &[f32]| if v.is_empty() { vec![0.0] } else { v.to_vec() };
    let nonempty_u32 = |v: &[u32]| if v.is_empty() { vec![0] } else { v.to_vec() };
    let dir = out.join(SAMPLE_DIR);
    std::fs::create_dir_all(&dir).map_err(|source| CliError::Write {
        path: dir.clone(),
        source,
    })?;
    let batch = seqs.len();
    let per_seq = |rows: usize| vec![batch, h, rows, d];
    let io = shape.dtype.to_string();
    let u32le = |v: &[u32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let entries: Vec<Buffer> = vec![
        (
            "k_pool",
            "u8",
            vec![physical, h, layout.k.block_bytes],
            k_pool,
        ),
        (
            "v_pool",
            "u8",
            vec![physical, h, layout.v.block_bytes],
            v_pool,
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
            per_seq(layout.k.sink),
            le16(&cat(&ks, |t| &t.sink)),
        ),
        (
            "v_sink",
            "f16",
            per_seq(layout.v.sink),
            le16(&cat(&vs, |t| &t.sink)),
        ),
        (
            "k_tail",
            "f16",
            per_seq(layout.k.tail_cap),
            le16(&cat(&ks, |t| &t.tail)),
        ),
        (
            "v_tail",
            "f16",
            per_seq(layout.v.tail_cap),
            le16(&cat(&vs, |t| &t.tail)),
        ),
        ("seq_lens", "i32", vec![batch], le32i(&seq_lens)),
        (
            "k_book",
            "u32",
            vec![device_books.k_rope.len()],
            u32le(&nonempty_u32(&device_books.k_rope)),
        ),
        (
            "k_rows",
            "f32",
            vec![device_books.k_rows_scaled.len()],
            le32f(&nonempty_f32(&device_books.k_rows_scaled)),
        ),
        (
            "k_mean",
            "f32",
            vec![device_books.k_mean.len()],
            le32f(&nonempty_f32(&device_books.k_mean)),
        ),
        (
            "v_rows",
            "f32",
            vec![device_books.v_rows_scaled.len()],
            le32f(&nonempty_f32(&device_books.v_rows_scaled)),
        ),
        (
            "v_mean",
            "f32",
            vec![device_books.v_mean.len()],
            le32f(&nonempty_f32(&device_books.v_mean)),
        ),
        ("q", &io, vec![batch, q_heads, d], le16(&q_bits)),
        ("expected", "f32", vec![batch, q_heads, d], le32f(&expected)),
    ];
    let (mut files, infos) = write_buffers(&dir, entries)?;
    let book_path = dir.join(CODEBOOK_FILE);
    books
        .save(&book_path, spec, h, d)
        .map_err(|e| CliError::Write {
            path: book_path.clone(),
            source: std::io::Error::other(e.to_string()),
        })?;
    let book_bytes = std::fs::metadata(&book_path).map_or(0, |m| m.len());
    files.push((book_path, book_bytes));
    let info = SampleInfo {
        format: "kvq-gen-sample",
        family: Some("codebook"),
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
        rope_theta: Some(rope.theta),
        tolerance: tolerance(shape.dtype),
        seed: s.seed,
        codebook_file: Some(CODEBOOK_FILE),
        files: infos,
        notes: vec![
            "little-endian raw arrays; shapes in elements; an empty buffer holds one element \
             (never read)"
                .into(),
            "expected: CommVqCache::attend over the same codes (f32); compare per sequence with \
             relative L2 error"
                .into(),
            "codebooks.safetensors: the layer's codebooks (kvq-codebooks-1); the .bin codebook \
             tensors are what the decode reads"
                .into(),
        ],
    };
    write_json(&dir, &info, &mut files)?;
    Ok(Written {
        dir_name: SAMPLE_DIR.into(),
        files,
        summary: format!(
            "sample batch: {batch} sequences of {:?} tokens, {h} KV heads, {q_heads} query heads, \
             {physical} physical pages, codebooks trained briefly, with the reference output \
             (tolerance {:.0e})",
            s.lengths,
            tolerance(shape.dtype)
        ),
    })
}
