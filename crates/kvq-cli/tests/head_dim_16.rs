//! Heads of 80 and 112 channels (Phi-2, StableLM): `kvq eval` measures them with the CPU
//! reference, `kvq gen` writes their kernels, and `kvq schemes` lists the GPU built-ins as running
//! on the GPU there.

mod common;
use common::{kvq_without_gpu, text, write_f16_safetensors, TempDir};
use std::path::Path;
use std::process::Output;

/// `kvq args…` with its cache folder in `cache`, its GPU hidden where `hide_gpu`.
fn kvq(args: &[&str], cache: &Path, hide_gpu: bool) -> Output {
    if hide_gpu {
        kvq_without_gpu(args, cache)
    } else {
        common::kvq(args, cache)
    }
}

/// One layer `[tokens][kv_heads][head_dim]` of smooth K/V with a few large key channels.
fn write_capture(path: &Path, tokens: usize, kv_heads: usize, head_dim: usize) {
    let value = |seed: usize, i: usize| {
        let x = ((i * 7919 + seed * 104_729) % 10_007) as f32 / 10_007.0;
        let outlier = if i % head_dim == 3 { 8.0 } else { 1.0 };
        (x * std::f32::consts::TAU).sin() * outlier
    };
    let n = tokens * kv_heads * head_dim;
    let f16_bytes = |seed: usize, n: usize| -> Vec<u8> {
        (0..n)
            .flat_map(|i| half::f16::from_f32(value(seed, i)).to_bits().to_le_bytes())
            .collect()
    };
    let data = [
        (
            "layer.0.k",
            vec![tokens, kv_heads, head_dim],
            f16_bytes(1, n),
        ),
        (
            "layer.0.v",
            vec![tokens, kv_heads, head_dim],
            f16_bytes(2, n),
        ),
        (
            "layer.0.q",
            vec![2 * kv_heads, head_dim],
            f16_bytes(3, 2 * kv_heads * head_dim),
        ),
    ]
    .map(|(name, shape, bytes)| (name.to_string(), shape, bytes));
    write_f16_safetensors(path, &data);
}

#[test]
fn eval_measures_heads_of_80_and_112_channels_on_the_cpu() {
    let tmp = TempDir::new("eval");
    for d in [80, 112] {
        let file = tmp.0.join(format!("kv{d}.safetensors"));
        write_capture(&file, 400, 2, d);
        let f = file.to_str().unwrap();
        for scheme in ["kivi2", "kitty", "int8", "fp16"] {
            let o = kvq(
                &["eval", "--scheme", scheme, "--kv", f, "--cpu"],
                &tmp.0,
                false,
            );
            let (out, err) = text(&o);
            assert!(o.status.success(), "{scheme} d{d}: {out}\n{err}");
            assert!(out.contains("1 layer(s)"), "{scheme} d{d}: {out}");
            assert!(out.contains("mean attention error"), "{scheme} d{d}: {out}");
        }
        // Without `--cpu` and without a GPU, the CPU reference still answers.
        let o = kvq(&["eval", "--scheme", "kivi2", "--kv", f], &tmp.0, true);
        let (out, err) = text(&o);
        assert!(o.status.success(), "d{d}: {out}\n{err}");
    }
}

#[test]
fn eval_still_refuses_head_dims_off_the_grid_of_16() {
    let tmp = TempDir::new("eval-odd");
    let file = tmp.0.join("kv72.safetensors");
    write_capture(&file, 64, 1, 72);
    let o = kvq(
        &[
            "eval",
            "--scheme",
            "kivi2",
            "--kv",
            file.to_str().unwrap(),
            "--cpu",
        ],
        &tmp.0,
        false,
    );
    let (out, err) = text(&o);
    assert!(!o.status.success(), "{out}");
    assert!(err.contains("must be a positive multiple of 16"), "{err}");
}

#[test]
fn gen_writes_kernels_for_head_dims_80_and_112() {
    let tmp = TempDir::new("gen");
    // KIVI-2's rows: exact at 80 (64 + 16), one 128-channel slab at 112 (1- and 2-bit codes
    // take at most two slabs).
    for (d, dv) in [("80", "80"), ("112", "128")] {
        let out_dir = tmp.0.join(format!("out{d}"));
        let o = kvq(
            &[
                "gen",
                "--scheme",
                "kivi2",
                "--head-dim",
                d,
                "--out",
                out_dir.to_str().unwrap(),
            ],
            &tmp.0,
            true,
        );
        let (out, err) = text(&o);
        assert!(o.status.success(), "d{d}: {out}\n{err}");
        let manifest = std::fs::read_to_string(out_dir.join("manifest.json")).unwrap();
        assert!(
            manifest.contains(&format!("\"head_dim\": {d}")),
            "d{d}: {manifest}"
        );
        let unit = std::fs::read_dir(&out_dir)
            .unwrap()
            .filter_map(Result::ok)
            .map(|e| e.path())
            .find(|p| {
                p.extension().is_some_and(|x| x == "cu") && p.to_string_lossy().contains("decode")
            })
            .unwrap_or_else(|| panic!("d{d}: no decode unit in {out_dir:?}"));
        let source = std::fs::read_to_string(unit).unwrap();
        // The tensor-core kernel, reading rows as slabs (docs/LAYOUT.md §9).
        assert!(
            source.contains(&format!("static constexpr int DVK = {dv}, DVV = {dv};")),
            "d{d}"
        );
        assert!(
            source.contains(&format!("static constexpr int D = {d};")),
            "d{d}"
        );
    }
}

#[test]
fn schemes_at_head_dim_80_lists_every_built_in_and_says_which_cannot() {
    let tmp = TempDir::new("schemes");
    let o = kvq(&["schemes", "--head-dim", "80"], &tmp.0, true);
    let (out, err) = text(&o);
    assert!(o.status.success(), "{out}\n{err}");
    for (name, runs_on) in [
        ("kivi2", "GPU + CPU"),
        ("kitty", "GPU + CPU"),
        ("int8", "GPU + CPU"),
        ("xquant2", "CPU only"),
    ] {
        let row = out
            .lines()
            .find(|l| l.split_whitespace().next() == Some(name))
            .unwrap_or_else(|| panic!("no row for {name}:\n{out}"));
        assert!(row.contains(runs_on), "{row}");
        assert!(!row.contains('–'), "{row}");
    }
    assert!(
        out.contains(
            "not at this shape: commvq2: k: `pairs_per_code = 64` does not divide the 40 RoPE \
             pairs of head_dim 80"
        ),
        "{out}"
    );
    // At 128 nothing is refused.
    let o = kvq(&["schemes", "--head-dim", "128"], &tmp.0, true);
    let (out, _) = text(&o);
    assert!(
        out.contains("GPU + CPU") && !out.contains("not at this shape"),
        "{out}"
    );
    // A head_dim no scheme takes is still an error.
    let o = kvq(&["schemes", "--head-dim", "72"], &tmp.0, true);
    assert!(!o.status.success());
}
