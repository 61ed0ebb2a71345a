//! What a GPU encoder is handed: the reference encoders' tables (`commvq::encoder`), the codebooks
//! as device tensors without a cache, and `CommVqCache::build_rotated` (keys given before and after
//! RoPE), which must be `build` when the keys after RoPE are the reference's own rotation.

use kvq_reference::commvq::{
    self, CalibrationData, Codebooks, CommVqCache, DeviceCodebooks, EncoderTables, SideTables,
    TrainOptions,
};
use kvq_reference::synth::{generate, SynthConfig, SynthKv};
use kvq_reference::KvTensor;
use kvq_spec::SchemeSpec;

const SCHEME: &str = "k = codebook(rope_commutative, levels = 16, residuals = 3, pairs_per_code = 16, span = head), \
                      v = codebook(additive, rows = 64), sink = 4, local = 16, page = 32";

fn layer(tokens: usize) -> SynthKv {
    generate(&SynthConfig {
        tokens,
        kv_heads: 2,
        gqa: 1,
        head_dim: 64,
        d_model: 128,
        seed: 11,
        ..Default::default()
    })
}

fn train(spec: &SchemeSpec, s: &SynthKv) -> Codebooks {
    let data = CalibrationData {
        k_pre_rope: &s.k_pre_rope,
        v: &s.v,
        rope: s.rope,
    };
    commvq::train_with(spec, &data, &TrainOptions::quick(3)).unwrap()
}

#[test]
fn encoder_tables_have_one_block_per_head_group_and_round() {
    let spec: SchemeSpec = SCHEME.parse().unwrap();
    let s = layer(256);
    let books = train(&spec, &s);
    let t = EncoderTables::new(&spec, &books, 2, 64).unwrap();
    // 2 heads × 2 groups of 16 pairs × 3 rounds; 16 entries of 32 reals.
    let SideTables::Rope(k) = &t.k else {
        panic!("keys are RoPE-coded")
    };
    let blocks = 2 * 2 * 3;
    assert_eq!(k.c.len(), blocks * 16 * 32);
    assert_eq!(k.ic.len(), k.c.len());
    assert_eq!(k.norm.len(), blocks * 16);
    assert_eq!(k.cross.len(), blocks * 16 * 16);
    // ‖c_k‖² and i·c_k of the first entry, from the codebook itself.
    let c0 = &k.c[..32];
    let n0: f64 = c0.iter().map(|x| x * x).sum();
    assert!((k.norm[0] - n0).abs() <= 1e-12 * n0.max(1.0));
    assert_eq!((k.ic[0], k.ic[1]), (-c0[1], c0[0]));
    let SideTables::Additive(v) = &t.v else {
        panic!("values are additive")
    };
    assert_eq!(v.rows.len(), 2 * 64 * 64);
    assert_eq!((v.norm.len(), v.pair_cross.len()), (2 * 64, 2 * 32));
    assert_eq!((v.mean.len(), v.scale.len()), (2 * 64, 2 * 64));
    assert!(v.scale.iter().all(|x| *x > 0.0));
}

#[test]
fn codebooks_of_another_shape_or_kind_are_refused() {
    let spec: SchemeSpec = SCHEME.parse().unwrap();
    let books = train(&spec, &layer(256));
    let e = EncoderTables::new(&spec, &books, 3, 64)
        .unwrap_err()
        .to_string();
    assert!(e.contains("KV heads"), "{e}");
    assert!(DeviceCodebooks::new(&spec, &books, 2, 128).is_err());
    let fp16_keys: SchemeSpec = "k = fp16, v = codebook(additive, rows = 64), page = 32"
        .parse()
        .unwrap();
    let t = EncoderTables::new(&fp16_keys, &books, 2, 64).unwrap();
    assert_eq!(t.k, SideTables::Fp16);
    let other: SchemeSpec = SCHEME.replace("levels = 16", "levels = 8").parse().unwrap();
    let e = EncoderTables::new(&other, &books, 2, 64)
        .unwrap_err()
        .to_string();
    assert!(e.contains("levels"), "{e}");
}

#[test]
fn build_rotated_is_build_when_the_keys_after_rope_are_the_rotation() {
    let spec: SchemeSpec = SCHEME.parse().unwrap();
    let s = layer(200);
    let books = train(&spec, &s);
    let mut post = s.k_pre_rope.clone();
    for h in 0..post.kv_heads {
        for t in 0..post.tokens {
            s.rope.apply(post.row_mut(h, t), t);
        }
    }
    let a = CommVqCache::build(&spec, &s.k_pre_rope, &s.v, s.rope, &books).unwrap();
    let b = CommVqCache::build_rotated(&spec, &s.k_pre_rope, &post, &s.v, s.rope, &books).unwrap();
    assert_eq!(a, b);
    // Keys after RoPE of another shape, or out of range, are refused.
    let short = KvTensor::zeros(2, 199, 64);
    let e = CommVqCache::build_rotated(&spec, &s.k_pre_rope, &short, &s.v, s.rope, &books);
    assert!(e.unwrap_err().to_string().contains("after RoPE"));
    let mut huge = post.clone();
    huge.row_mut(1, 5)[3] = 1e6;
    assert!(CommVqCache::build_rotated(&spec, &s.k_pre_rope, &huge, &s.v, s.rope, &books).is_err());
}
