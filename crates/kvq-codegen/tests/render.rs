//! Every decode-kernel variant renders; set KVQ_DUMP_DIR to write the sources out (for NVRTC checks).

use kvq_codegen::{decode_kernels, Dtype, KernelShape, TuneParams};
use kvq_spec::SchemeSpec;

/// Integer and FP16 schemes covering every code path of the decode template.
pub const SCHEMES: &[&str] = &[
    "k = fp16, v = fp16",
    "k = int(2, channel), v = int(2, token), local = 128",
    "k = int(4, channel), v = int(4, token), local = 128",
    "k = int(2, channel, boost = boost(4, ratio = 0.125)), v = int(2, token, local = 128), sink = 32",
    "k = int(1, channel), v = int(1, channel), local = 128, calibrate = calibrate(tau1 = 0.6, tau2 = 0.1)",
    "k = int(8, channel, symmetric), v = int(8, channel, symmetric)",
    "k = int(3, token, group = 32), v = int(3, channel), sink = 16, page = 64",
    "k = int(4, channel), v = fp16, sink = 4",
    "k = int(4, channel, symmetric, boost = boost(8, ratio = 0.25, by = variance)), v = int(2, token, group = 32), local = 64",
];

#[test]
fn every_variant_renders() {
    let dump = std::env::var_os("KVQ_DUMP_DIR");
    for (i, text) in SCHEMES.iter().enumerate() {
        let spec = SchemeSpec::parse(text).unwrap();
        for head_dim in [64, 96, 128, 256] {
            for (gqa, dtype) in [(1, Dtype::F16), (4, Dtype::Bf16), (8, Dtype::F16)] {
                for tune in TuneParams::candidates().filter(|t| t.threads == 128 || head_dim == 128)
                {
                    let shape = KernelShape::new(head_dim, gqa, dtype);
                    let k = decode_kernels(&spec, &shape, &tune)
                        .unwrap_or_else(|e| panic!("{text}: {e}"));
                    assert!(k.source.contains(&k.decode.name));
                    assert_eq!(k.range.is_some(), spec.calibrate.is_some());
                    if let Some(dir) = &dump {
                        if tune == TuneParams::default_for(&shape) {
                            let path = std::path::Path::new(dir)
                                .join(format!("s{i}_d{head_dim}_g{gqa}_{dtype}.cu"));
                            std::fs::write(path, &k.source).unwrap();
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn every_cache_variant_renders() {
    use kvq_codegen::cache_kernels;
    let dump = std::env::var_os("KVQ_DUMP_DIR");
    for (i, text) in SCHEMES.iter().enumerate() {
        let spec = SchemeSpec::parse(text).unwrap();
        for head_dim in [64, 96, 128, 256] {
            for dtype in [Dtype::F16, Dtype::Bf16] {
                let k =
                    cache_kernels(&spec, head_dim, dtype).unwrap_or_else(|e| panic!("{text}: {e}"));
                assert!(k.source.contains(&k.append.name));
                assert_eq!(k.k_quantizers.is_some(), spec.k.is_quantized());
                assert_eq!(k.v_quantizers.is_some(), spec.v.is_quantized());
                if let Some(dir) = &dump {
                    let path = std::path::Path::new(dir)
                        .join(format!("cache_s{i}_d{head_dim}_{dtype}.cu"));
                    std::fs::write(path, &k.source).unwrap();
                }
            }
        }
    }
}
