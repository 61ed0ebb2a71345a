//! THROWAWAY (not committed): hashes of every rendered decode and cache source.
use kvq_codegen::{decode_kernels, Dtype, KernelShape, TuneParams};
use kvq_spec::SchemeSpec;
use std::hash::{Hash, Hasher};

#[path = "render.rs"]
#[allow(dead_code)]
mod render;

#[test]
fn fingerprint() {
    let out = std::env::var("FP_OUT").unwrap();
    let mut lines = Vec::new();
    for (i, text) in render::SCHEMES.iter().enumerate() {
        let spec = SchemeSpec::parse(text).unwrap();
        for head_dim in [64, 96, 128, 256] {
            for (gqa, dtype) in [(1, Dtype::F16), (4, Dtype::Bf16), (8, Dtype::F16), (4, Dtype::F16)] {
                let shape = KernelShape::new(head_dim, gqa, dtype);
                for (j, tune) in TuneParams::candidates_for(&spec, &shape).into_iter().chain(TuneParams::candidates()).enumerate() {
                    let Ok(k) = decode_kernels(&spec, &shape, &tune) else { continue };
                    let mut h = std::collections::hash_map::DefaultHasher::new();
                    k.source.hash(&mut h);
                    lines.push(format!("s{i} d{head_dim} g{gqa} {dtype} t{j} {:016x} {}", h.finish(), k.source.len()));
                }
            }
        }
    }
    std::fs::write(out, lines.join("\n")).unwrap();
}
