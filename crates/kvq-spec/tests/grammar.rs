//! The scheme grammar: every built-in and documented scheme parses, canonical text round-trips, and
//! every rejected input names its problem and points at the offending token.

use kvq_spec::*;
use proptest::prelude::*;

mod common;

use common::*;

const K2: &str = "k = int(2, channel)";

#[test]
fn builtin_scheme_texts_parse_and_round_trip() {
    let texts = builtin_texts();
    assert!(texts.len() >= 14, "found only {} built-ins", texts.len());
    for text in texts {
        let spec = parse(&text);
        assert_eq!(parse(&spec.to_string()), spec, "{text}");
        // The canonical text is a fixed point.
        assert_eq!(parse(&spec.to_string()).to_string(), spec.to_string());
    }
}

#[test]
fn documented_schemes_parse_and_documented_errors_fail() {
    let blocks = doc_blocks();
    let schemes = blocks
        .iter()
        .filter(|(i, _)| i.starts_with("scheme"))
        .count();
    assert!(
        schemes >= 8,
        "docs/GRAMMAR.md has {schemes} scheme examples"
    );
    for (info, text) in blocks {
        if info.starts_with("scheme") {
            let spec = parse(&text);
            assert_eq!(parse(&spec.to_string()), spec);
        } else if info == "error" {
            // An error example: the scheme text, then the rendered error exactly as documented.
            let (scheme, shown) = text
                .split_once('\n')
                .expect("error block: text, then error");
            let err = SchemeSpec::parse(scheme).expect_err(scheme);
            assert_eq!(err.render(scheme), shown, "docs/GRAMMAR.md error block");
        }
    }
}

#[test]
fn defaults_and_normal_form() {
    let s = parse("k = int(2, channel), v = int(2, token)");
    assert_eq!(s.page, DEFAULT_PAGE);
    assert_eq!((s.sink, s.local), (0, 0));
    assert_eq!(s.source, CacheSource::Kv);
    assert_eq!(s.calibrate, None);
    let k = *s.k.as_int().unwrap();
    assert_eq!(
        k,
        IntQuant {
            bits: 2,
            axis: Axis::Channel,
            group: None,
            symmetric: false,
            boost: None,
            local: None
        }
    );
    // A channel-axis group is the page; only the page records it.
    let g = parse("k = int(2, channel, group = 64), v = fp16");
    assert_eq!((g.page, g.k.as_int().unwrap().group), (64, None));
    assert_eq!(g, parse("k = int(2, channel), v = fp16, page = 64"));
    // Positional and keyed arguments, flags with and without `= true`, whitespace and trailing commas.
    let a = parse("k = int(4, channel, symmetric), v = int(4, token, group = 32)");
    let b = parse(
        "\n  v = int( axis = token , bits = 4 , group = 32 , ) ,\n\tk = int(bits = 4, symmetric = true, axis = channel),\n",
    );
    assert_eq!(a, b);
    assert_eq!(
        parse("k = int(2, channel, symmetric = false), v = fp16"),
        parse("k = int(2, channel), v = fp16")
    );
    // Defaults: boost criterion, codebook span; `source = kv`, `1_000`-style numbers.
    let c = parse("k = int(2, channel, boost = boost(4, 0.25)), v = fp16, source = kv, sink = 1_0");
    assert_eq!(
        c.k.as_int().unwrap().boost.unwrap().by,
        BoostCriterion::Magnitude
    );
    assert_eq!(c.sink, 10);
    let d = parse("k = codebook(additive, rows = 64), v = fp16");
    assert!(matches!(
        d.k,
        TensorQuant::Codebook(CodebookQuant {
            span: CodebookSpan::Head,
            ..
        })
    ));
    assert_eq!(
        d,
        "k = codebook(additive, rows = 64), v = fp16"
            .parse()
            .unwrap()
    );
}

#[test]
fn numbers() {
    let s = parse(&format!(
        "{K2}, v = fp16, calibrate = calibrate(tau1 = -0.5, tau2 = 1e-3)"
    ));
    assert_eq!(
        s.calibrate,
        Some(Calibration {
            tau1: -0.5,
            tau2: 1e-3
        })
    );
    let s = parse(&format!(
        "{K2}, v = fp16, calibrate = calibrate(tau1 = +.5, tau2 = 2E+1)"
    ));
    assert_eq!(
        s.calibrate,
        Some(Calibration {
            tau1: 0.5,
            tau2: 20.0
        })
    );
    // A whole number may be written with a fraction of zero.
    assert_eq!(
        parse("k = int(2.0, channel), v = fp16"),
        parse(&format!("{K2}, v = fp16"))
    );
    fails(
        &format!("{K2}, v = fp16, sink = -1"),
        "`sink` must be a whole number in 0..=1048576, got `-1`",
        "-1",
    );
    fails(
        &format!("{K2}, v = fp16, sink = 4bit"),
        "`4bit` is not a number",
        "4bit",
    );
    fails(
        &format!("{K2}, v = fp16, sink = -"),
        "`-` is not a number",
        "-",
    );
    fails(
        &format!("{K2}, v = fp16, sink = 1e999"),
        "`1e999` is not a number",
        "1e999",
    );
    fails(
        &format!("{K2}, v = fp16, sink = -inf"),
        "`-inf` is not a number",
        "-inf",
    );
    fails(
        &format!("{K2}, v = fp16, sink = 1.2.3"),
        "`1.2.3` is not a number",
        "1.2.3",
    );
    fails(
        &format!("{K2}, v = fp16, sink = 0x10"),
        "`0x10` is not a number",
        "0x10",
    );
    fails(
        &format!("{K2}, v = fp16, sink = nan"),
        "`sink` must be a number, got `nan`",
        "nan",
    );
    fails(&format!("{K2}, v = fp16, sink = 2.5"), "got `2.5`", "2.5");
    fails(
        "k = int(2, channel, boost = boost(4, ratio = 1e39)), v = fp16",
        "boost `ratio` must lie strictly between 0 and 1, got `1e39`",
        "1e39",
    );
}

#[test]
fn syntax_errors() {
    let (msg, _) = error("");
    assert_eq!(
        msg,
        "empty scheme: declare at least `k = ...` and `v = ...`"
    );
    fails(" \n\t", "empty scheme", " \n\t");
    fails(
        "k = int(2, channel); v = fp16",
        "unexpected character `;`",
        ";",
    );
    fails(
        "k = int(2, channel), v = \"fp16\"",
        "unexpected character `\"`",
        "\"",
    );
    fails(
        "k = int(2, chännel), v = fp16",
        "unexpected character `ä`",
        "ä",
    );
    fails(
        "k = int(2, channel) v = fp16",
        "expected `,` between items, found `v`",
        "v",
    );
    fails(
        "k int(2, channel), v = fp16",
        "expected `=` after `k`, found `int`",
        "int",
    );
    fails(
        "= fp16",
        "expected a key such as `k`, `v` or `sink`, found `=`",
        "=",
    );
    fails(
        "k = fp16,, v = fp16",
        "expected a key such as `k`, `v` or `sink`, found `,`",
        ",",
    );
    fails("k = (2), v = fp16", "expected a value, found `(`", "(");
    fails(
        "k = int(2,, channel), v = fp16",
        "expected a value, found `,`",
        ",",
    );
    fails(
        "k = int(2 channel), v = fp16",
        "expected `,` or `)`, found `channel`",
        "channel",
    );
    fails(
        "k = int(bits = ), v = fp16",
        "expected a value, found `)`",
        ")",
    );
    // Missing pieces at the end are reported just past the last token.
    for (text, message) in [
        ("k", "expected `=` after `k`, found the end of the scheme"),
        ("k = ", "expected a value, found the end of the scheme"),
        (
            "k = fp16, v",
            "expected `=` after `v`, found the end of the scheme",
        ),
    ] {
        let err = SchemeSpec::parse(text).unwrap_err();
        assert_eq!(err.message, message);
        let end = text.trim_end().len();
        assert_eq!(err.span, end..end, "{text}");
    }
    // An unclosed call points at its opening.
    let err = SchemeSpec::parse("k = int(2, channel, boost = boost(4, 0.1), v = fp16").unwrap_err();
    assert_eq!(err.message, "`int(` is never closed: expected `)`");
    assert_eq!(err.span, 4..8);
    fails(
        "k = fp16, v = int (2, token",
        "`int(` is never closed",
        "int (",
    );
}

#[test]
fn keys() {
    fails(
        &format!("{K2}, v = fp16, K = 3"),
        "unknown key `K` in the scheme; expected one of: k, v, page, sink, local, calibrate, source",
        "K",
    );
    // Unknown keys are reported before anything they might have been meant to provide.
    fails(
        "key = fp16, v = fp16",
        "unknown key `key` in the scheme",
        "key",
    );
    fails(
        "k = int(2, channel, bitz = 3), v = fp16",
        "unknown key `bitz` in int(...); expected one of: bits, axis, group, symmetric, boost, local",
        "bitz",
    );
    fails(
        "k = int(2, channel, boost = boost(4, 0.1, ratios = 2)), v = fp16",
        "unknown key `ratios` in boost(...); expected one of: bits, ratio, by",
        "ratios",
    );
    fails(
        &format!("{K2}, v = fp16, calibrate = calibrate(tau = 1)"),
        "unknown key `tau` in calibrate(...); expected one of: tau1, tau2",
        "tau",
    );
    fails(
        "k = int(2, channel), v = int(2, token), source = x(latent = true, form = 2)",
        "unknown key `form` in x(...); expected one of: latent, cross_layer",
        "form",
    );
    fails(
        "k = codebook(additive, row = 64), v = fp16",
        "unknown key `row` in codebook(...); expected one of: rope_commutative, additive, levels",
        "row",
    );
    // Duplicates are errors, not "last one wins", and point at the second.
    let err = SchemeSpec::parse("k = fp16, v = fp16, k = fp16").unwrap_err();
    assert_eq!(err.message, "`k` is given twice in the scheme");
    assert_eq!(err.span, 20..21);
    fails(
        "k = int(2, channel, bits = 2, bits = 4), v = fp16",
        "`bits` is given twice in int(...)",
        "bits",
    );
    fails(
        "k = int(2, channel, 4), v = fp16",
        "unexpected `4` in int(...); expected one of: bits, axis",
        "4",
    );
    fails(
        "k = int(2, channel, symetric), v = fp16",
        "unexpected `symetric` in int(...)",
        "symetric",
    );
    fails(
        "k = int(2, channel, boost(4, 0.1)), v = fp16",
        "`boost(...)` needs its key here: write `boost = boost(...)`",
        "boost(4, 0.1)",
    );
    fails(
        "k = int(2, channel, symmetric = yes), v = fp16",
        "`symmetric` is a flag: write `symmetric` alone or `symmetric = true|false`",
        "yes",
    );
}

#[test]
fn required_values() {
    fails(
        "v = fp16",
        "the scheme needs `k = ...` (fp16, int(...) or codebook(...))",
        "v = fp16",
    );
    fails("k = fp16", "the scheme needs `v = ...`", "k = fp16");
    fails(
        "k = int(channel), v = fp16",
        "int(...) needs `bits` (1, 2, 3, 4 or 8)",
        "int(channel)",
    );
    fails("k = int, v = fp16", "int(...) needs `bits`", "int");
    fails(
        "k = int(2), v = fp16",
        "int(...) needs `axis` (channel or token)",
        "int(2)",
    );
    fails(
        "k = int(2, channel, boost = boost(ratio = 0.1)), v = fp16",
        "boost(...) needs `bits`",
        "boost(ratio = 0.1)",
    );
    fails(
        "k = int(2, channel, boost = boost(4)), v = fp16",
        "boost(...) needs `ratio`",
        "boost(4)",
    );
    fails(
        &format!("{K2}, v = fp16, calibrate = calibrate(tau1 = 1)"),
        "calibrate(...) needs `tau2`",
        "calibrate(tau1 = 1)",
    );
    fails(
        &format!("{K2}, v = fp16, calibrate = calibrate"),
        "calibrate(...) needs `tau1`",
        "calibrate",
    );
    fails(
        "k = codebook(rope_commutative, residuals = 2, pairs_per_code = 1), v = fp16",
        "codebook(...) needs `levels`",
        "codebook(rope_commutative, residuals = 2, pairs_per_code = 1)",
    );
    fails(
        "k = codebook(rope_commutative, levels = 4, pairs_per_code = 1), v = fp16",
        "needs `residuals`",
        "codebook(rope_commutative, levels = 4, pairs_per_code = 1)",
    );
    fails(
        "k = codebook(rope_commutative, levels = 4, residuals = 1), v = fp16",
        "needs `pairs_per_code`",
        "codebook(rope_commutative, levels = 4, residuals = 1)",
    );
    fails(
        "k = codebook(additive), v = fp16",
        "codebook(...) needs `rows`",
        "codebook(additive)",
    );
}

#[test]
fn value_kinds() {
    fails(
        "k = 4, v = fp16",
        "`k` must be `fp16`, `int(...)` or `codebook(...)`, got `4`",
        "4",
    );
    fails(
        "k = fp32, v = fp16",
        "`k` must be `fp16`, `int(...)` or `codebook(...)`, got `fp32`",
        "fp32",
    );
    fails(
        "k = fp16, v = float(16)",
        "`v` must be `fp16`, `int(...)` or `codebook(...)`, got `float(...)`",
        "float(16)",
    );
    fails(
        "k = int(two, channel), v = fp16",
        "int(...) needs `bits`",
        "int(two, channel)",
    );
    fails(
        "k = int(bits = two, axis = channel), v = fp16",
        "`bits` must be 1, 2, 3, 4 or 8, got `two`",
        "two",
    );
    fails(
        "k = int(2, chanel), v = fp16",
        "`axis` must be one of: channel, token; got `chanel`",
        "chanel",
    );
    fails(
        "k = int(2, axis = 3), v = fp16",
        "`axis` must be one of: channel, token; got `3`",
        "3",
    );
    fails(
        "k = int(2, channel, boost = boost(4, 0.1, by = size)), v = fp16",
        "`by` must be one of: magnitude, variance; got `size`",
        "size",
    );
    fails(
        "k = int(2, channel, boost = 4), v = fp16",
        "`boost` must be `boost(...)`, got `4`",
        "4",
    );
    fails(
        &format!("{K2}, v = fp16, calibrate = 0.5"),
        "`calibrate` must be `calibrate(...)`, got `0.5`",
        "0.5",
    );
    fails(
        &format!("{K2}, v = fp16, sink = many"),
        "`sink` must be a number, got `many`",
        "many",
    );
    fails(
        "k = codebook(additive, rows = 64, span = layer), v = fp16",
        "`span` must be one of: head, token; got `layer`",
        "layer",
    );
}

#[test]
fn int_rules() {
    // Exact span and message on the bit width.
    let err = SchemeSpec::parse("k = int(5, channel), v = fp16").unwrap_err();
    assert_eq!(
        (err.message.as_str(), err.span.clone()),
        ("`bits` must be 1, 2, 3, 4 or 8, got `5`", 8..9)
    );
    for bad in ["0", "16", "2.5", "-1", "1e-3"] {
        fails(
            &format!("k = int({bad}, channel), v = fp16"),
            &format!("got `{bad}`"),
            bad,
        );
    }
    for bits in [1, 2, 3, 4, 8] {
        assert_eq!(
            parse(&format!("k = int({bits}, token), v = fp16"))
                .k
                .as_int()
                .unwrap()
                .bits,
            bits
        );
    }
    // Token-axis groups are whole packed words of codes; channel-axis groups whole page tiles.
    fails(
        "k = int(2, token, group = 20), v = fp16",
        "`group` must be a multiple of 16 in 16..=1048576 (2-bit codes are packed 16 together in 32-bit words), got `20`",
        "20",
    );
    fails(
        "k = int(4, token, group = 4), v = fp16",
        "`group` must be a multiple of 8 in 8..=1048576",
        "4",
    );
    fails(
        "k = int(3, token, group = 16), v = fp16",
        "`group` must be a multiple of 32 in 32..=1048576",
        "16",
    );
    parse("k = int(8, token, group = 4), v = fp16");
    fails(
        "k = int(2, channel, group = 24), v = fp16",
        "`group` must be a multiple of 16 in 16..=1048576 (a channel-axis group is one page, and pages are tiled 16 tokens at a time), got `24`",
        "24",
    );
    fails(
        "k = int(2, token, group = 0), v = fp16",
        "`group` must be a multiple of 16 in 16..=1048576 (2-bit codes are packed 16 together in 32-bit words), got `0`",
        "0",
    );
    fails(
        "k = int(1, channel, symmetric), v = fp16",
        "1-bit codes cannot be symmetric",
        "symmetric",
    );
    fails(
        "k = int(1, channel, symmetric = true), v = fp16",
        "1-bit codes cannot be symmetric",
        "symmetric = true",
    );
    assert_eq!(
        parse("k = fp16, v = int(2, token, local = 64)")
            .v
            .as_int()
            .unwrap()
            .local,
        Some(64)
    );
}

#[test]
fn boost_rules() {
    let boost = |b: &str| format!("k = int(2, channel, boost = boost({b})), v = fp16");
    fails(
        &boost("2, 0.1"),
        "boost bits (2) must exceed the tensor's base bits (2)",
        "2",
    );
    fails(&boost("1, 0.1"), "boost bits (1) must exceed", "1");
    fails(
        &boost("bits = 8, ratio = 0.1"),
        "boost `bits` must be 3, 4 or 6 (a 2-bit base plane plus a 1-, 2- or 4-bit high plane), got `8`",
        "8",
    );
    fails(
        "k = int(3, channel, boost = boost(4, 0.1)), v = fp16",
        "boosted codes are stored as a base plane plus a high plane, each 1, 2 or 4 bits: 3-bit codes cannot be boosted",
        "4",
    );
    fails(
        &boost("4, 9, 0.1"),
        "boost `ratio` must lie strictly between 0 and 1, got `9`",
        "9",
    );
    for ratio in ["0", "1", "1.0", "-0.5", "2"] {
        fails(
            &boost(&format!("4, ratio = {ratio}")),
            &format!("boost `ratio` must lie strictly between 0 and 1, got `{ratio}`"),
            ratio,
        );
    }
    fails(
        "k = int(2, token, boost = boost(4, 0.1)), v = fp16",
        "channel boost needs `axis = channel`",
        "boost(4, 0.1)",
    );
    for (base, high) in [
        (1, 2),
        (1, 3),
        (1, 5),
        (2, 3),
        (2, 4),
        (2, 6),
        (4, 5),
        (4, 6),
        (4, 8),
    ] {
        let s = parse(&format!(
            "k = int({base}, channel, boost = boost({high}, 0.5, variance)), v = fp16"
        ));
        let b = s.k.as_int().unwrap().boost.unwrap();
        assert_eq!(
            (b.bits, b.ratio, b.by),
            (high, 0.5, BoostCriterion::Variance)
        );
    }
}

#[test]
fn codebook_rules() {
    fails(
        "k = fp16, v = codebook(rope_commutative, levels = 16, residuals = 4, pairs_per_code = 8)",
        "a RoPE-commutative codebook is for keys",
        "rope_commutative",
    );
    fails(
        "k = codebook(rope_commutative, levels = 16, residuals = 64, pairs_per_code = 1), v = fp16",
        "bits per scalar: no compression over fp16",
        "codebook(rope_commutative, levels = 16, residuals = 64, pairs_per_code = 1)",
    );
    fails(
        "k = codebook(rope_commutative, levels = 12, residuals = 1, pairs_per_code = 1), v = fp16",
        "`levels` must be a power of two in 2..=65536 (codes are whole bits), got `12`",
        "12",
    );
    fails(
        "k = codebook(rope_commutative, levels = 1, residuals = 1, pairs_per_code = 1), v = fp16",
        "`levels` must be a power of two in 2..=65536 (codes are whole bits), got `1`",
        "1",
    );
    fails(
        "k = codebook(rope_commutative, levels = 4, residuals = 0, pairs_per_code = 1), v = fp16",
        "`residuals` must be a whole number in 1..=64",
        "0",
    );
    fails(
        "k = codebook(additive, rows = 33), v = fp16",
        "`rows` must be a multiple of 32 in 32..=65536 (binary codes pack into 32-bit words), got `33`",
        "33",
    );
    fails(
        "k = codebook(additive, rows = 64, levels = 4), v = fp16",
        "`levels` does not apply to codebook(additive, ...); its keys are: rows, span",
        "levels",
    );
    fails(
        "k = codebook(rope_commutative, rows = 64), v = fp16",
        "`rows` does not apply to codebook(rope_commutative, ...)",
        "rows",
    );
    fails(
        "k = codebook(additive, rope_commutative, rows = 32), v = fp16",
        "either `rope_commutative` or `additive`, not both",
        "additive",
    );
    fails(
        "k = codebook(rope, levels = 4), v = fp16",
        "name the codebook kind: `rope_commutative` or `additive`, got `rope`",
        "rope",
    );
    fails(
        "k = codebook(rows = 64), v = fp16",
        "name the codebook kind",
        "codebook(rows = 64)",
    );
    let s = parse("k = fp16, v = codebook(additive, rows = 128, span = token)");
    assert!(matches!(
        s.v,
        TensorQuant::Codebook(CodebookQuant {
            codebook: Codebook::Additive { rows: 128 },
            span: CodebookSpan::Token
        })
    ));
}

#[test]
fn scheme_rules() {
    fails(
        "k = int(2, channel, group = 64), v = int(2, channel, group = 128)",
        "a channel-axis group is one page: `group = 128` but the page is 64 tokens",
        "128",
    );
    fails(
        "k = int(2, channel, group = 64), v = fp16, page = 128",
        "`group = 64` but the page is 128 tokens",
        "64",
    );
    fails(
        &format!("{K2}, v = fp16, page = 100"),
        "`page` must be a multiple of 16 in 16..=1048576 (the attention kernels tile a page 16 tokens at a time), got `100`",
        "100",
    );
    fails(
        &format!("{K2}, v = fp16, page = 0"),
        "`page` must be a multiple of 16 in 16..=1048576",
        "0",
    );
    fails(
        &format!("{K2}, v = fp16, page = 2_000_000"),
        "`page` must be a multiple of 16 in 16..=1048576",
        "2_000_000",
    );
    fails(
        "k = fp16, v = int(2, token), calibrate = calibrate(tau1 = 1, tau2 = 2)",
        "`calibrate` corrects the scores of quantized keys, but `k = fp16`",
        "calibrate(tau1 = 1, tau2 = 2)",
    );
    fails(
        &format!("{K2}, v = fp16, calibrate = calibrate(tau1 = 1e5, tau2 = 0)"),
        "`tau1` must lie within ±10000",
        "1e5",
    );
    let x = |k: &str, v: &str, src: &str| format!("k = {k}, v = {v}, source = {src}");
    fails(
        &x(
            "codebook(additive, rows = 32)",
            "int(2, token)",
            "x(latent)",
        ),
        "`source = x(...)` caches integer-quantized activations: `k` must be `int(...)`",
        "codebook(additive, rows = 32)",
    );
    fails(
        &x("int(2, channel)", "fp16", "x(latent)"),
        "`v` must be `int(...)`",
        "fp16",
    );
    fails(
        &x(
            "int(2, channel, boost = boost(4, 0.1))",
            "int(2, token)",
            "x(latent)",
        ),
        "channel boost is not defined for cached activations",
        "boost(4, 0.1)",
    );
    fails(
        &x("int(2, channel)", "int(2, token)", "x"),
        "name the cached form",
        "x",
    );
    fails(
        &x("int(2, channel)", "int(2, token)", "x(delta)"),
        "name the cached form",
        "delta",
    );
    fails(
        &x("int(2, channel)", "int(2, token)", "x(latent, cross_layer)"),
        "name one cached form: `latent` or `cross_layer`, not both",
        "cross_layer",
    );
    fails(
        &x("int(2, channel)", "int(2, token)", "layer_input"),
        "`source` must be `kv` or `x(latent|cross_layer)`, got `layer_input`",
        "layer_input",
    );
    assert_eq!(
        parse(&x("int(2, channel)", "int(2, token)", "x(cross_layer)")).source,
        CacheSource::X(XSource::CrossLayer)
    );
}

#[test]
fn render_points_at_the_column() {
    let text = "k = int(2, channel), v = int(2, tokn)";
    let err = SchemeSpec::parse(text).unwrap_err();
    assert_eq!(
        err.render(text),
        "error: `axis` must be one of: channel, token; got `tokn` (column 33)\n  \
         k = int(2, channel), v = int(2, tokn)\n                                  ^^^^"
    );
    // Missing at the end: one caret just past the text.
    let err = SchemeSpec::parse("k = ").unwrap_err();
    assert_eq!(
        err.render("k = "),
        "error: expected a value, found the end of the scheme (column 4)\n  k = \n     ^"
    );
    // Multi-line text (a config file) shows the offending line only, with tabs as one column each.
    let text = "k = int(2, channel),\n\tv = int(2, token),\n\tsink = 1.5\n";
    let err = SchemeSpec::parse(text).unwrap_err();
    assert_eq!(
        err.render(text),
        "error: `sink` must be a whole number in 0..=1048576, got `1.5` (line 3, column 9)\n   sink = 1.5\n          ^^^"
    );
    // Columns count characters, not bytes.
    let text = "k = int(2, chännel), v = fp16";
    let err = SchemeSpec::parse(text).unwrap_err();
    assert!(
        err.render(text)
            .ends_with(&format!("\n{}^", " ".repeat(2 + 13))),
        "{}",
        err.render(text)
    );
    // A span outside the text never panics.
    let odd = SpecError {
        span: 100..200,
        message: "x".into(),
    };
    assert_eq!(odd.render("é"), "error: x (column 2)\n  é\n   ^");
}

#[test]
fn shape_checks() {
    let kivi = parse("k = int(2, channel), v = int(2, token, group = 32)");
    kivi.check_shape(128, 8).unwrap();
    assert_eq!(kivi.check_shape(100, 8), Err(ShapeError::HeadDim(100)));
    assert_eq!(kivi.check_shape(0, 8), Err(ShapeError::HeadDim(0)));
    assert_eq!(kivi.check_shape(128, 0), Err(ShapeError::KvHeads));
    let g = parse("k = fp16, v = int(2, token, group = 64)");
    assert_eq!(
        g.check_shape(96, 1).unwrap_err().to_string(),
        "v: token-axis `group = 64` does not divide head_dim 96"
    );
    let rope = parse(
        "k = codebook(rope_commutative, levels = 4, residuals = 1, pairs_per_code = 3), v = fp16",
    );
    assert_eq!(
        rope.check_shape(64, 1),
        Err(ShapeError::Pairs {
            tensor: "k",
            pairs: 3,
            half: 32,
            head_dim: 64
        })
    );
    rope.check_shape(96, 1).unwrap();
    // An additive codebook compresses or not depending on the vector length.
    let add = parse("k = fp16, v = codebook(additive, rows = 1024)");
    assert!(matches!(
        add.check_shape(64, 1),
        Err(ShapeError::NoCompression {
            tensor: "v",
            dim: 64,
            ..
        })
    ));
    add.check_shape(128, 1).unwrap();
    let tok = parse("k = fp16, v = codebook(additive, rows = 1024, span = token)");
    tok.check_shape(32, 4).unwrap();
    assert!(tok
        .check_shape(32, 2)
        .unwrap_err()
        .to_string()
        .contains("no compression over fp16"));
    // A boost must select at least one channel and not all of them.
    let tiny = parse("k = int(2, channel, boost = boost(4, 0.01)), v = fp16");
    assert!(matches!(
        tiny.check_shape(32, 1),
        Err(ShapeError::Boost { channels: 0, .. })
    ));
    tiny.check_shape(128, 1).unwrap();
    let huge = parse("k = int(2, channel, boost = boost(4, 0.995)), v = fp16");
    assert!(huge
        .check_shape(64, 1)
        .unwrap_err()
        .to_string()
        .contains("fewer than all"));
}

#[test]
fn hash_follows_the_canonical_text() {
    let a = parse("k = int(2, channel), v = int(2, token)");
    let b = parse("v = int(bits = 2, axis = token), k = int(2, channel, group = 128)");
    assert_eq!(a.stable_hash(), b.stable_hash());
    assert_ne!(
        a.stable_hash(),
        parse("k = int(4, channel), v = int(2, token)").stable_hash()
    );
}

#[test]
fn packing_widths() {
    assert_eq!([1, 2, 3, 4, 8].map(packing_width), [32, 16, 32, 8, 4]);
}

// ---- Round trips over generated schemes ----

fn ratio() -> impl Strategy<Value = f32> {
    // Any f32 strictly inside (0, 1): exercises the shortest-digits printing of odd values too.
    (1u32..0x3f80_0000).prop_map(f32::from_bits)
}

fn int_quant(allow_boost: bool) -> impl Strategy<Value = IntQuant> {
    (
        prop::sample::select(vec![1u8, 2, 3, 4, 8]),
        any::<bool>(),
        1u32..8,
        any::<bool>(),
        any::<bool>(),
        prop::option::of(0u32..=1 << 20),
        prop::option::of((
            prop::sample::select(vec![1u8, 2, 4]),
            ratio(),
            any::<bool>(),
        )),
    )
        .prop_map(
            move |(bits, channel, words, grouped, symmetric, local, boost)| {
                let axis = if channel { Axis::Channel } else { Axis::Token };
                let boost = boost.filter(|_| allow_boost && channel && matches!(bits, 1 | 2 | 4));
                IntQuant {
                    bits,
                    axis,
                    // Channel-axis groups are recorded as the page, never in the tensor.
                    group: (grouped && !channel).then(|| words * packing_width(bits)),
                    symmetric: symmetric && bits != 1,
                    boost: boost.map(|(high, ratio, variance)| Boost {
                        bits: bits + high,
                        ratio,
                        by: if variance {
                            BoostCriterion::Variance
                        } else {
                            BoostCriterion::Magnitude
                        },
                    }),
                    local,
                }
            },
        )
}

fn codebook(key: bool) -> impl Strategy<Value = CodebookQuant> {
    let rope = (1u32..=16, 1u32..=64, 1u32..=1024)
        .prop_map(
            |(log, residuals, pairs_per_code)| Codebook::RopeCommutative {
                levels: 1 << log,
                residuals,
                pairs_per_code,
            },
        )
        .prop_filter("compresses", |c| c.bits_per_scalar(0) < 16.0);
    let additive = (1u32..=2048).prop_map(|n| Codebook::Additive { rows: 32 * n });
    let kinds = if key {
        prop_oneof![rope, additive.clone()].boxed()
    } else {
        additive.boxed()
    };
    (kinds, any::<bool>()).prop_map(|(codebook, token)| CodebookQuant {
        codebook,
        span: if token {
            CodebookSpan::Token
        } else {
            CodebookSpan::Head
        },
    })
}

fn tensor(key: bool, allow_boost: bool) -> impl Strategy<Value = TensorQuant> {
    prop_oneof![
        Just(TensorQuant::Fp16),
        int_quant(allow_boost).prop_map(TensorQuant::Int),
        codebook(key).prop_map(TensorQuant::Codebook),
    ]
}

fn tau() -> impl Strategy<Value = f32> {
    prop_oneof![-1e4f32..=1e4, (-10i32..=10).prop_map(|x| x as f32 / 4.0)]
}

fn spec() -> impl Strategy<Value = SchemeSpec> {
    (
        any::<bool>(),
        prop::sample::select(vec![None, Some(XSource::Latent), Some(XSource::CrossLayer)]),
    )
        .prop_flat_map(|(boost, x)| {
            let (k, v) = if x.is_some() {
                (
                    int_quant(false).prop_map(TensorQuant::Int).boxed(),
                    int_quant(false).prop_map(TensorQuant::Int).boxed(),
                )
            } else {
                (tensor(true, boost).boxed(), tensor(false, boost).boxed())
            };
            (
                k,
                v,
                1u32..=65536,
                0u32..=1 << 20,
                0u32..=1 << 20,
                prop::option::of((tau(), tau())),
                Just(x),
            )
        })
        .prop_map(|(k, v, tiles, sink, local, calibrate, x)| SchemeSpec {
            k,
            v,
            page: 16 * tiles,
            sink,
            local,
            calibrate: calibrate
                .filter(|_| k.is_quantized())
                .map(|(tau1, tau2)| Calibration { tau1, tau2 }),
            source: x.map_or(CacheSource::Kv, CacheSource::X),
        })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn canonical_text_round_trips(spec in spec()) {
        let text = spec.to_string();
        let back = SchemeSpec::parse(&text).map_err(|e| TestCaseError::fail(e.render(&text)))?;
        prop_assert_eq!(back, spec);
        prop_assert_eq!(back.to_string(), text);
    }

    /// Arbitrary text from the grammar's alphabet never panics, and every error span lies inside the
    /// text on character boundaries, so rendering and the attribute's span mapping are safe.
    #[test]
    fn any_text_fails_cleanly(text in "[kvintchaeslbo_x0-9(),=. \\-é;]{0,40}") {
        if let Err(e) = SchemeSpec::parse(&text) {
            prop_assert!(e.span.start <= e.span.end && e.span.end <= text.len(), "{:?} in {:?}", e.span, text);
            prop_assert!(text.is_char_boundary(e.span.start) && text.is_char_boundary(e.span.end));
            prop_assert!(!e.message.is_empty());
            let _ = e.render(&text);
        }
    }
}
