//! The packed layout as `docs/CODEBOOKS.md` describes it, the footprint, and the typed errors.

mod commvq_common;
use commvq_common::*;
use half::f16;
use kvq_reference::commvq::{self, CalibrationData, Coding, CommVqCache, TensorCodebook};
use kvq_reference::{KvTensor, RefError};
use kvq_spec::{Codebook, SchemeSpec, TensorQuant};

/// Code `i` of a little-endian stream of `w`-bit codes, read bit by bit (independently of the crate).
fn read_code(words: &[u32], w: usize, i: usize) -> u32 {
    (0..w)
        .map(|b| ((words[(i * w + b) / 32] >> ((i * w + b) % 32)) & 1) << b)
        .sum()
}

#[test]
fn a_kernel_following_the_documented_layout_reconstructs_the_cache() {
    let spec = small_scheme("token");
    let cb = train(&spec, &layer(256, 1), 5);
    let s = layer(300, 2);
    let cache = CommVqCache::build(&spec, &s.k_pre_rope, &s.v, s.rope, &cb).unwrap();
    let deq = cache.dequantize();
    let (Coding::Rope { codebook: kc, .. }, Coding::Additive(vc)) =
        (&cache.k().coding(), &cache.v().coding())
    else {
        panic!("codings");
    };
    let (d, half, page) = (64, 32, 64);
    let (g, groups, rounds, levels) = (kc.pairs_per_code, kc.groups(), kc.residuals, kc.levels);
    let w = 2 * levels.trailing_zeros() as usize;
    let stream = page * w / 32;
    for p in 0..cache.k().regions().pages {
        for i in [0, 17, 63] {
            let tok = cache.k().regions().page_tokens(p).start + i;
            for h in 0..2 {
                // Keys: span = token, so one scale per token.
                let scale =
                    f16::from_bits(cache.k().scales()[p * cache.k().layout().scales + i]).to_f64();
                let mut k = vec![0.0f32; d];
                for gr in 0..groups {
                    for j in 0..g {
                        let (mut re, mut im) = (0.0f64, 0.0f64);
                        for r in 0..rounds {
                            let at = p * cache.k().layout().code_words
                                + ((h * groups + gr) * rounds + r) * stream;
                            let code = read_code(&cache.k().codes()[at..at + stream], w, i);
                            let (a, b) = (
                                (code >> (w / 2)) as usize,
                                (code & ((1 << (w / 2)) - 1)) as usize,
                            );
                            let e = |k: usize, c: usize| {
                                kc.entries[((((h * groups + gr) * rounds + r) * levels + k) * g
                                    + j)
                                    * 2
                                    + c] as f64
                            };
                            re += e(a, 0) - e(b, 1);
                            im += e(a, 1) + e(b, 0);
                        }
                        k[gr * g + j] = (scale * re) as f32;
                        k[gr * g + j + half] = (scale * im) as f32;
                    }
                }
                s.rope.apply(&mut k, tok);
                for (x, y) in k.iter().zip(deq.k.row(h, tok)) {
                    assert!(
                        (x - y).abs() <= 1e-5 * y.abs().max(1.0),
                        "key {h}/{tok}: {x} vs {y}"
                    );
                }
            }
            // Values: span = token, one book over both heads; words [book][word][token].
            let dim = 2 * d;
            let factor =
                f16::from_bits(cache.v().scales()[p * cache.v().layout().scales + i]).to_f64();
            let mut v = vec![0.0f64; dim];
            for row in 0..vc.rows {
                let word =
                    cache.v().codes()[p * cache.v().layout().code_words + (row / 32) * page + i];
                if word >> (row % 32) & 1 == 1 {
                    for (c, x) in v.iter_mut().enumerate() {
                        *x += vc.table[row * dim + c] as f64;
                    }
                }
            }
            for (c, x) in v.iter().enumerate() {
                let want = deq.v.row(c / d, tok)[c % d];
                let got = (vc.mean[c] as f64 + factor * x * vc.channel_scale[c] as f64) as f32;
                assert!(
                    (got - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "value {c}/{tok}: {got} vs {want}"
                );
            }
        }
    }
}

#[test]
fn footprint_payload_is_the_schemes_rate() {
    let spec = small_scheme("head");
    let cb = train(&spec, &layer(256, 1), 5);
    let s = layer(300, 2);
    let cache = CommVqCache::build(&spec, &s.k_pre_rope, &s.v, s.rope, &cb).unwrap();
    let fp = cache.footprint();
    let rate = |t: &TensorQuant, dim| match t {
        TensorQuant::Codebook(c) => c.codebook.bits_per_scalar(dim),
        _ => unreachable!(),
    };
    assert_eq!(fp.k.payload_bits_per_element(), rate(&spec.k, 64)); // 3·log2(16)/8 = 1.5
    assert_eq!(fp.k.payload_bits_per_element(), 1.5);
    assert_eq!(fp.v.payload_bits_per_element(), rate(&spec.v, 64)); // 64 rows / 64 channels
                                                                    // 4 pages × 64 tokens × 2 heads × 64 channels quantized; 44 tokens FP16.
    assert_eq!(fp.k.quantized_elements, 4 * 64 * 128);
    assert_eq!(fp.k.fp16_elements, 44 * 128);
    // One f16 scale per head vector (span = head) for keys and values.
    assert_eq!(fp.k.scale_bits, 16 * 4 * 64 * 2);
    assert_eq!(fp.v.scale_bits, 16 * 4 * 64 * 2);
    // Codebooks: keys 2 heads × 4 groups × 3 rounds × 16 entries × 8 pairs × 2; values 2 × (64×64 + 2×64).
    assert_eq!(fp.k.codebook_bits, 16 * 2 * 4 * 3 * 16 * 8 * 2);
    assert_eq!(fp.v.codebook_bits, 16 * 2 * (64 * 64 + 2 * 64));
    let total = fp.k.code_bits
        + fp.k.scale_bits
        + fp.v.code_bits
        + fp.v.scale_bits
        + 16 * (fp.k.fp16_elements + fp.v.fp16_elements);
    assert_eq!(fp.sequence_bytes(), total / 8);
}

#[test]
fn bad_inputs_are_typed_errors() {
    let spec = small_scheme("head");
    let s = layer(128, 2);
    let cb = train(&spec, &layer(256, 1), 5);
    let mut k = s.k_pre_rope.clone();
    k.row_mut(1, 7)[3] = f32::NAN;
    let err = CommVqCache::build(&spec, &k, &s.v, s.rope, &cb).unwrap_err();
    assert!(
        matches!(
            err,
            RefError::NonFinite {
                tensor: "k",
                head: 1,
                token: 7,
                channel: 3,
                ..
            }
        ),
        "{err:?}"
    );
    let data = CalibrationData {
        k_pre_rope: &k,
        v: &s.v,
        rope: s.rope,
    };
    assert!(matches!(
        commvq::train(&spec, &data, 1),
        Err(RefError::NonFinite { .. })
    ));

    let int = SchemeSpec::parse("k = int(2, channel), v = int(2, token)").unwrap();
    assert!(matches!(
        CommVqCache::build(&int, &s.k_pre_rope, &s.v, s.rope, &cb),
        Err(RefError::WrongEntryPoint(_))
    ));
    let x =
        SchemeSpec::parse("k = int(2, channel), v = int(2, token), source = x(latent)").unwrap();
    assert!(matches!(
        CommVqCache::build(&x, &s.k_pre_rope, &s.v, s.rope, &cb),
        Err(RefError::WrongEntryPoint(_))
    ));

    // Codebooks of another scheme or shape, or none at all.
    let other = SchemeSpec::parse(
        "k = codebook(rope_commutative, levels = 16, residuals = 2, pairs_per_code = 8), v = codebook(additive, rows = 64)",
    )
    .unwrap();
    assert!(matches!(
        CommVqCache::build(&other, &s.k_pre_rope, &s.v, s.rope, &cb),
        Err(RefError::Mismatch(_))
    ));
    let none = commvq::Codebooks { k: None, v: None };
    assert!(matches!(
        CommVqCache::build(&spec, &s.k_pre_rope, &s.v, s.rope, &none),
        Err(RefError::Mismatch(_))
    ));
    let narrow = KvTensor::zeros(2, 128, 32);
    assert!(matches!(
        CommVqCache::build(&spec, &narrow, &narrow, s.rope, &cb),
        Err(RefError::Mismatch(_))
    ));
    // 48 channels are a valid shape (24 pairs, three codes of 8) for codebooks trained on 64.
    let other_width = KvTensor::zeros(2, 128, 48);
    assert!(matches!(
        CommVqCache::build(&spec, &other_width, &other_width, s.rope, &cb),
        Err(RefError::Mismatch(_))
    ));
    let odd = KvTensor::zeros(2, 128, 40);
    assert!(matches!(
        CommVqCache::build(&spec, &odd, &odd, s.rope, &cb),
        Err(RefError::Shape(kvq_spec::ShapeError::HeadDim(40)))
    ));
    let v_other = KvTensor::zeros(2, 100, 64);
    assert!(matches!(
        CommVqCache::build(&spec, &s.k_pre_rope, &v_other, s.rope, &cb),
        Err(RefError::Mismatch(_))
    ));

    // Beyond the f16 range, and a key whose norm overflows the f16 scale.
    let mut huge = s.k_pre_rope.clone();
    huge.row_mut(0, 70)[0] = 7.0e4;
    assert!(matches!(
        CommVqCache::build(&spec, &huge, &s.v, s.rope, &cb),
        Err(RefError::NonFinite { .. })
    ));
    let mut huge = s.k_pre_rope.clone();
    huge.row_mut(0, 70).iter_mut().for_each(|x| *x = 3.0e4);
    assert!(matches!(
        CommVqCache::build(&spec, &huge, &s.v, s.rope, &cb),
        Err(RefError::Mismatch(_))
    ));
}

#[test]
fn fp16_tensors_and_additive_keys_work_too() {
    let spec =
        SchemeSpec::parse("k = codebook(additive, rows = 128), v = fp16, page = 64").unwrap();
    let full = layer(768, 1);
    let cal = window(&full, 0, 512);
    let data = CalibrationData {
        k_pre_rope: &cal.k_pre_rope,
        v: &cal.v,
        rope: cal.rope,
    };
    let cb = commvq::train(&spec, &data, 3).unwrap();
    assert!(matches!(cb.k, Some(TensorCodebook::Additive(_))) && cb.v.is_none());
    assert!(
        matches!(spec.k, TensorQuant::Codebook(c) if c.codebook == Codebook::Additive { rows: 128 })
    );
    let s = window(&full, 512, 256);
    let cache = CommVqCache::build(&spec, &s.k_pre_rope, &s.v, s.rope, &cb).unwrap();
    let deq = cache.dequantize();
    assert_eq!(
        deq.v.data,
        s.v.data
            .iter()
            .map(|x| f16::from_f32(*x).to_f32())
            .collect::<Vec<_>>()
    );
    let fast = cache.attend(&s.q).unwrap();
    let slow = kvq_reference::attention::decode(&s.q, &deq, None).unwrap();
    assert!(kvq_reference::attention::relative_error(&fast, &slow) < 1e-5);
    let err = kvq_reference::attention::mse(&deq.k.data, &s.k.data)
        / kvq_reference::attention::mse(&s.k.data, &vec![0.0f32; s.k.data.len()]);
    assert!(err < 0.5, "additive 2-bit keys relative mse {err}");
}
