//! The trainer is deterministic for a seed, independent of the thread count, and learns.

mod commvq_common;
use commvq_common::*;
use kvq_reference::attention::mse;
use kvq_reference::commvq::{self, CalibrationData, CommVqCache, TrainOptions};

#[test]
fn same_seed_same_codebooks_other_seed_other_codebooks() {
    let spec = small_scheme("token");
    let s = layer(256, 1);
    let data = CalibrationData {
        k_pre_rope: &s.k_pre_rope,
        v: &s.v,
        rope: s.rope,
    };
    let a = commvq::train_with(&spec, &data, &fast_options(11)).unwrap();
    let serial = TrainOptions {
        threads: 1,
        ..fast_options(11)
    };
    assert_eq!(a, commvq::train_with(&spec, &data, &serial).unwrap());
    assert_ne!(
        a,
        commvq::train_with(&spec, &data, &fast_options(12)).unwrap()
    );
}

#[test]
fn more_residual_rounds_reconstruct_held_out_keys_better() {
    let full = layer(768, 1);
    let (cal, s) = (window(&full, 0, 512), window(&full, 512, 256));
    let mut last = f64::INFINITY;
    for residuals in [1, 2, 4] {
        let spec = kvq_spec::SchemeSpec::parse(&format!(
            "k = codebook(rope_commutative, levels = 16, residuals = {residuals}, pairs_per_code = 8), v = fp16, page = 64"
        ))
        .unwrap();
        let cb = train(&spec, &cal, 5);
        let cache = CommVqCache::build(&spec, &s.k_pre_rope, &s.v, s.rope, &cb).unwrap();
        let err = mse(&cache.dequantize().k.data, &s.k.data);
        assert!(err < last, "{residuals} rounds: {err} !< {last}");
        last = err;
    }
}
