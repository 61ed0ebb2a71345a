//! The paged integer/FP16 store: byte layout pinned on small examples, edge cases (constant, zero,
//! single-token, partial pages, every width and axis), refusal of non-finite input, and footprint
//! equal to the bytes actually built.

use half::f16;
use kvq_reference::footprint;
use kvq_reference::int::{decode_page, IntCache, IntLayout, TensorStore, NOT_BOOSTED};
use kvq_reference::{KvTensor, RefError};
use kvq_spec::{Axis, SchemeSpec, TensorQuant};
use proptest::prelude::*;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

fn spec(text: &str) -> SchemeSpec {
    SchemeSpec::parse(text).unwrap()
}

fn random(kv_heads: usize, tokens: usize, head_dim: usize, seed: u64) -> KvTensor {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let data = (0..kv_heads * tokens * head_dim)
        .map(|i| rng.random_range(-3.0f32..3.0) * if i % head_dim == 5 { 10.0 } else { 1.0 })
        .collect();
    KvTensor::new(data, kv_heads, tokens, head_dim).unwrap()
}

fn f16_round(x: &KvTensor) -> Vec<f32> {
    x.data.iter().map(|&v| f16::from_f32(v).to_f32()).collect()
}

#[test]
fn two_bit_channel_page_bytes_are_pinned() {
    // page 16, head_dim 32, x[t][c] = t % 4: every channel has zero 0, scale 1, code t % 4.
    let s = spec("k = int(2, channel), v = int(2, channel), page = 16");
    let data: Vec<f32> = (0..16 * 32).map(|i| ((i / 32) % 4) as f32).collect();
    let x = KvTensor::new(data, 1, 16, 32).unwrap();
    let cache = IntCache::build(&s, &x, &x).unwrap();
    let block = cache.k().block(0, 0).unwrap();
    assert_eq!(block.len(), 16 * 8 + 64 + 64);
    for t in 0..16 {
        let word = [0u32, 0x5555_5555, 0xAAAA_AAAA, 0xFFFF_FFFF][t % 4];
        for w in 0..2 {
            let at = t * 8 + w * 4;
            assert_eq!(
                u32::from_le_bytes(block[at..at + 4].try_into().unwrap()),
                word
            );
        }
    }
    assert!(
        block[128..192].chunks(2).all(|c| c == [0x00, 0x3C]),
        "scales are f16 1.0"
    );
    assert!(block[192..256].iter().all(|&b| b == 0), "zeros are f16 0.0");
    assert_eq!(cache.dequantize().k.data, x.data);
}

#[test]
fn token_axis_scales_are_token_major() {
    // page 16, head_dim 64, groups of 32 channels: 2 scales per token.
    let s = spec("k = int(4, token, group = 32), v = int(4, token, group = 32), page = 16");
    let x = random(1, 16, 64, 1);
    let cache = IntCache::build(&s, &x, &x).unwrap();
    let l = cache.v().layout().unwrap();
    assert_eq!(
        (l.codes.bytes, l.scales.bytes, l.zeros.bytes),
        (16 * 32, 16 * 2 * 2, 16 * 2 * 2)
    );
    let block = cache.v().block(0, 0).unwrap();
    // Scale of token 3, group 1 spans channels 32..64 of token 3.
    let i = 3 * 2 + 1;
    let scale = f16::from_le_bytes([
        block[l.scales.offset + 2 * i],
        block[l.scales.offset + 2 * i + 1],
    ]);
    let g = &x.row(0, 3)[32..64];
    let (mn, mx) = g
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(a, b), &v| {
            (a.min(v), b.max(v))
        });
    assert!(scale.to_f32() * 15.0 >= mx - mn && scale.to_f32() * 15.0 <= (mx - mn) * 1.01);
}

#[test]
fn kitty_boost_map_and_planes() {
    let s = spec(
        "k = int(2, channel, boost = boost(4, ratio = 0.125)), v = int(2, token, local = 128), sink = 32",
    );
    let x = random(2, 32 + 128 + 40, 128, 2);
    let cache = IntCache::build(&s, &x, &x).unwrap();
    let k = cache.k();
    assert_eq!(k.pages(), 1);
    let l = k.layout().unwrap();
    for head in 0..2 {
        let block = k.block(0, head).unwrap();
        let map = &block[l.map.range()];
        let slots: Vec<u8> = map.iter().copied().filter(|&s| s != NOT_BOOSTED).collect();
        assert_eq!(
            slots,
            (0..16).collect::<Vec<u8>>(),
            "slots in channel order"
        );
        // Channel 5 carries 10× larger values: always boosted.
        assert_ne!(map[5], NOT_BOOSTED);
    }
    // Boosted channels are quantized with 4 bits: their error is far below 2-bit channels'.
    let kh = cache.dequantize().k;
    let err = |c: usize| {
        (32..160)
            .map(|t| (kh.row(0, t)[c] - x.row(0, t)[c]).abs())
            .fold(0.0f32, f32::max)
    };
    let map = &k.block(0, 0).unwrap()[l.map.range()];
    let scales = &k.block(0, 0).unwrap()[l.scales.range()];
    for c in 0..128 {
        let scale = f16::from_le_bytes([scales[2 * c], scales[2 * c + 1]]).to_f32();
        assert!(err(c) <= scale / 2.0 * 1.0001, "channel {c}");
        if map[c] != NOT_BOOSTED {
            let range = (32..160)
                .map(|t| x.row(0, t)[c])
                .fold(0.0f32, |m, v| m.max(v.abs()))
                * 2.0;
            assert!(
                scale <= range / 15.0 * 1.01,
                "boosted channel {c} not at 4 bits"
            );
        }
    }
}

#[test]
fn regions_sink_and_tail_are_f16_exact() {
    let s =
        spec("k = int(2, channel), v = int(2, token, local = 64), sink = 8, local = 16, page = 32");
    let x = random(3, 8 + 32 * 3 + 20, 64, 3);
    let cache = IntCache::build(&s, &x, &x).unwrap();
    let d = cache.dequantize();
    let r = |t: &TensorStore| *t.regions().unwrap();
    let (rk, rv) = (r(cache.k()), r(cache.v()));
    assert_eq!((rk.pages, rv.pages), (3, 1));
    let xr = f16_round(&x);
    for h in 0..3 {
        for t in 0..x.tokens {
            let row = (h * x.tokens + t) * 64..(h * x.tokens + t + 1) * 64;
            if !rk.is_quantized(t) {
                assert_eq!(d.k.row(h, t), &xr[row.clone()], "k token {t}");
            }
            if !rv.is_quantized(t) {
                assert_eq!(d.v.row(h, t), &xr[row], "v token {t}");
            }
        }
    }
    assert_eq!(
        d.k_quantized,
        (0..x.tokens)
            .map(|t| rk.is_quantized(t))
            .collect::<Vec<_>>()
    );
    // The tail is a ring of local + page slots starting after the sink.
    assert_eq!(cache.v().tail_capacity(), 64 + 32);
    assert_eq!(cache.v().tail_slot(8 + 32), Some(32));
    // Tail tokens 40..124 take slots 32..96, then wrap to slot 0 at token 8 + 96.
    assert_eq!(cache.v().tail_slot(8 + 95), Some(95));
    assert_eq!(cache.v().tail_slot(8 + 96), Some(0));
    assert_eq!(cache.v().tail_slot(124), None);
    assert_eq!(cache.v().tail_slot(0), None);
}

#[test]
fn fp16_scheme_is_f16_rounding_only() {
    let s = spec("k = fp16, v = fp16, page = 16");
    let x = random(2, 37, 32, 4);
    let cache = IntCache::build(&s, &x, &x).unwrap();
    assert_eq!(cache.k().pages(), 3);
    let d = cache.dequantize();
    assert_eq!(d.k.data, f16_round(&x));
    assert!(d.k_quantized.iter().all(|q| !q));
}

#[test]
fn constant_and_zero_inputs_are_exact() {
    for text in [
        "k = int(1, channel), v = int(1, token), page = 16",
        "k = int(3, channel), v = int(3, token, group = 32), page = 16",
        "k = int(8, channel, symmetric), v = int(8, token, symmetric), page = 16",
        "k = int(2, channel, boost = boost(4, ratio = 0.25, by = variance)), v = int(4, token), page = 16",
    ] {
        let s = spec(text);
        let zeros = KvTensor::zeros(2, 40, 64);
        let d = IntCache::build(&s, &zeros, &zeros).unwrap().dequantize();
        assert!(d.k.data.iter().chain(&d.v.data).all(|&v| v == 0.0), "{text}");
        // Channel c holds the f16-exact constant c/8 - 2 in every token.
        let data: Vec<f32> = (0..2 * 40 * 64).map(|i| (i % 64) as f32 / 8.0 - 2.0).collect();
        let x = KvTensor::new(data, 2, 40, 64).unwrap();
        let d = IntCache::build(&s, &x, &x).unwrap().dequantize();
        if s.k.as_int().is_some_and(|q| q.symmetric) {
            // No zero point: a constant c is c's top level, within the f16 round-up of the scale.
            for (a, b) in x.data.iter().zip(&d.k.data) {
                assert!((a - b).abs() <= a.abs() / 127.0 * 0.5, "{text}: {a} vs {b}");
            }
        } else {
            assert!(d.k.data == x.data, "{text}: constant channels are not exact");
        }
    }
}

#[test]
fn non_finite_and_out_of_range_values_are_refused() {
    let s = spec("k = int(2, channel), v = int(2, token), page = 16");
    for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 70000.0, -1e6] {
        let mut k = random(2, 40, 32, 5);
        let v = random(2, 40, 32, 6);
        *k.row_mut(1, 7).get_mut(3).unwrap() = bad;
        match IntCache::build(&s, &k, &v) {
            Err(RefError::NonFinite {
                tensor,
                head,
                token,
                channel,
                ..
            }) => assert_eq!((tensor, head, token, channel), ("k", 1, 7, 3)),
            other => panic!("{bad}: {other:?}"),
        }
        // V is checked too, before anything is stored.
        assert!(matches!(
            IntCache::build(&s, &v, &k),
            Err(RefError::NonFinite { tensor: "v", .. })
        ));
    }
}

#[test]
fn wrong_entry_points_and_shapes_are_errors() {
    let x = random(1, 20, 32, 7);
    for text in [
        "k = int(2, channel), v = int(2, token), source = x(latent)",
        "k = codebook(rope_commutative, levels = 16, residuals = 2, pairs_per_code = 8), v = fp16",
    ] {
        assert!(
            matches!(
                IntCache::build(&spec(text), &x, &x),
                Err(RefError::WrongEntryPoint(_))
            ),
            "{text}"
        );
    }
    let s = spec("k = int(2, channel), v = int(2, token)");
    let odd = KvTensor::zeros(1, 20, 40);
    assert!(matches!(
        IntCache::build(&s, &odd, &odd),
        Err(RefError::Shape(kvq_spec::ShapeError::HeadDim(40)))
    ));
    // 48 is a multiple of 16: it builds.
    let narrow = KvTensor::zeros(1, 20, 48);
    assert!(IntCache::build(&s, &narrow, &narrow).is_ok());
    let other = random(1, 21, 32, 8);
    assert!(matches!(
        IntCache::build(&s, &x, &other),
        Err(RefError::Mismatch(_))
    ));
}

#[test]
fn decode_page_checks_block_size_map_and_slot_table() {
    let s = spec("k = int(2, channel, boost = boost(4, ratio = 0.25)), v = fp16, page = 16");
    let x = random(1, 16, 32, 9);
    let cache = IntCache::build(&s, &x, &x).unwrap();
    let l = *cache.k().layout().unwrap();
    let mut block = cache.k().block(0, 0).unwrap().to_vec();
    assert!(decode_page(&l, &block[1..]).is_err());
    let first = l.map.offset
        + block[l.map.range()]
            .iter()
            .position(|&s| s != NOT_BOOSTED)
            .unwrap();
    let intact = block.clone();
    block[first] = 200;
    assert!(decode_page(&l, &block).is_err());
    // A slot table that is not the map's inverse is refused too.
    let mut block = intact;
    assert!(decode_page(&l, &block).is_ok());
    block.swap(l.slots.offset, l.slots.offset + 1);
    let err = decode_page(&l, &block).unwrap_err().to_string();
    assert!(err.contains("slot table"), "{err}");
}

/// The scheme texts exercised below: every width, both axes, boost, symmetric, sink/local mixes.
fn schemes() -> Vec<&'static str> {
    vec![
        "k = int(1, channel), v = int(1, channel), local = 16, page = 16",
        "k = int(2, channel), v = int(2, token), local = 32, page = 32",
        "k = int(3, channel), v = int(3, token, group = 32), page = 16",
        "k = int(4, channel), v = int(4, token), sink = 5, local = 7, page = 16",
        "k = int(8, channel, symmetric), v = int(8, channel, symmetric), page = 16",
        "k = int(4, token, symmetric, group = 32), v = int(2, token, symmetric), page = 16",
        "k = int(2, channel, boost = boost(4, ratio = 0.125)), v = int(2, token, local = 16), sink = 4, page = 16",
        "k = int(1, channel, boost = boost(2, ratio = 0.5, by = variance)), v = fp16, page = 16",
        "k = int(4, channel, boost = boost(8, ratio = 0.25)), v = int(1, token), page = 32",
        "k = fp16, v = int(2, token), sink = 3, local = 9, page = 16",
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn any_length_builds_decodes_and_matches_its_footprint(
        which in 0..10usize,
        tokens in 0usize..120,
        kv_heads in 1usize..3,
        wide in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let s = spec(schemes()[which]);
        let head_dim = if wide { 64 } else { 32 };
        let k = random(kv_heads, tokens, head_dim, seed);
        let v = random(kv_heads, tokens, head_dim, seed ^ 1);
        let cache = IntCache::build(&s, &k, &v).unwrap();
        let d = cache.dequantize();
        prop_assert_eq!((d.k.tokens, d.v.tokens), (tokens, tokens));
        prop_assert!(d.k.data.iter().chain(&d.v.data).all(|x| x.is_finite()));
        // Every value within half a step of its group (f16 rounding for FP16 tokens).
        for (store, x, xh) in [(cache.k(), &k, &d.k), (cache.v(), &v, &d.v)] {
            let max_step = match store.quant() {
                TensorQuant::Int(q) => {
                    let bits = if q.symmetric { q.bits - 1 } else { q.bits };
                    let range = if q.symmetric { 30.0 } else { 60.0 };
                    range / ((1u32 << bits) - 1) as f32
                }
                _ => 0.0,
            };
            for (a, b) in x.data.iter().zip(&xh.data) {
                // Scales round up to f16 (≤ 0.1%), FP16 tokens round to f16 (≤ 2^-11 relative).
                prop_assert!((a - b).abs() <= max_step / 2.0 * 1.002 + 1e-3 * a.abs() + 1e-6,
                    "{} vs {} (step {})", a, b, max_step);
            }
        }
        let f = footprint::scheme(&s, head_dim as u32, kv_heads as u32, tokens as u64).unwrap();
        prop_assert_eq!(f.total_bytes(), cache.allocated_bytes() as u64);
        prop_assert_eq!(f.k.bytes(), cache.k().allocated_bytes() as u64);
        // The pool is a whole number of 16-byte-aligned blocks.
        prop_assert_eq!(cache.k().block_bytes() % 16, 0);
        prop_assert_eq!(cache.v().pool().len(), cache.v().pages() * kv_heads * cache.v().block_bytes());
    }
}

#[test]
fn single_token_sequences_stay_fp16() {
    for text in schemes() {
        let s = spec(text);
        let x = random(2, 1, 32, 10);
        let d = IntCache::build(&s, &x, &x).unwrap().dequantize();
        assert_eq!(d.k.data, f16_round(&x), "{text}");
        assert_eq!(d.v.data, f16_round(&x), "{text}");
    }
}

#[test]
fn layouts_of_the_paper_shapes() {
    let q = |t: &str| *spec(t).k.as_int().unwrap();
    let kivi_k = IntLayout::new(&q("k = int(2, channel), v = fp16"), 128, 128).unwrap();
    assert_eq!(kivi_k.block_bytes, 4096 + 256 + 256);
    assert_eq!(kivi_k.axis, Axis::Channel);
    let int8 = IntLayout::new(&q("k = int(8, channel, symmetric), v = fp16"), 128, 128).unwrap();
    assert_eq!((int8.block_bytes, int8.zeros.bytes), (16384 + 256, 0));
    let three = IntLayout::new(&q("k = int(3, token), v = fp16"), 128, 128).unwrap();
    assert_eq!(three.row_words, 12);
    assert_eq!(three.block_bytes, 128 * 48 + 256 + 256);
}

/// Reads codes straight from the bytes as docs/LAYOUT.md §6 describes and checks the decoded values.
#[test]
fn kitty_worked_example_reads_as_documented() {
    let s = spec(
        "k = int(2, channel, boost = boost(4, ratio = 0.125)), v = int(2, token, local = 128), sink = 32",
    );
    let x = random(1, 32 + 128 + 10, 128, 11);
    let cache = IntCache::build(&s, &x, &x).unwrap();
    let k = cache.k().dequantize();
    let block = cache.k().block(0, 0).unwrap();
    let word = |at: usize| u32::from_le_bytes(block[at..at + 4].try_into().unwrap());
    let half = |at: usize| f16::from_le_bytes([block[at], block[at + 1]]).to_f32();
    let t = 5;
    for c in 0..128 {
        let low = (word(32 * t + 4 * (c / 16)) >> (2 * (c % 16))) & 3;
        let code = match block[5120 + c] {
            NOT_BOOSTED => low,
            slot => low | ((word(4096 + 4 * t) >> (2 * slot as usize)) & 3) << 2,
        };
        let value = half(4608 + 2 * c).mul_add(code as f32, half(4864 + 2 * c));
        assert_eq!(value, k.row(0, 32 + t)[c], "channel {c}");
    }
    let boosted: Vec<usize> = (0..128)
        .filter(|&c| block[5120 + c] != NOT_BOOSTED)
        .collect();
    assert_eq!(boosted.len(), 16);
    // The slot table after the map: slot s's channel, slots in ascending channel order.
    let slots: Vec<usize> = block[5248..5264].iter().map(|&c| usize::from(c)).collect();
    assert_eq!(slots, boosted);
    assert_eq!(block.len(), 5264);
}

/// Every public way into a store follows kvq-spec's shape rules: a boosted tensor wider than the
/// one-byte channel index was refused by `check_shape` but reached `TensorStore::build` unchecked
/// and panicked on decode.
#[test]
fn stores_follow_the_spec_shape_rules_on_every_path() {
    let kitty = spec("k = int(2, channel, boost = boost(4, ratio = 0.125)), v = int(2, token)");
    let x = random(1, 130, 512, 3);
    assert!(matches!(
        IntCache::build(&kitty, &x, &x),
        Err(RefError::Shape(kvq_spec::ShapeError::BoostHeadDim { .. }))
    ));
    let e = TensorStore::build(&kitty, &kitty.k, &x, "k").unwrap_err();
    assert!(
        matches!(
            e,
            RefError::Shape(kvq_spec::ShapeError::BoostHeadDim { head_dim: 512, .. })
        ),
        "{e}"
    );
    let x = random(1, 130, 256, 3);
    let store = TensorStore::build(&kitty, &kitty.k, &x, "k").unwrap();
    assert_eq!(store.dequantize().head_dim, 256);
}

/// A size past `u32` is refused, not truncated to a shape that passes (2^32 + 128 would read as 128).
#[test]
fn sizes_past_u32_are_refused_not_truncated() {
    let s = spec("k = int(2, channel), v = int(2, token)");
    let e = s.check_shape_usize((1usize << 32) + 128, 1).unwrap_err();
    assert!(
        matches!(
            e,
            kvq_spec::ShapeError::TooLarge {
                what: "head_dim",
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("4294967424"), "{e}");
    let e = s.check_shape_usize(128, (1usize << 32) + 1).unwrap_err();
    assert!(matches!(
        e,
        kvq_spec::ShapeError::TooLarge {
            what: "kv_heads",
            ..
        }
    ));
    assert!(s.check_shape_usize(128, 8).is_ok());
}
