//! Hostile and extreme input: text nested deeper than any scheme, shapes at the edges of `u32`,
//! boosted heads wider than the boost map can index, numbers no key can hold exactly, and keys
//! repeated in every way the grammar allows. Each fails with a typed error or a message at the
//! offending token; none panics, overflows or aborts.

use kvq_spec::*;

mod common;

use common::*;

/// Runs `f` on a thread with a small stack, so unbounded recursion aborts the test binary instead of
/// passing by luck on a large main-thread stack.
fn on_small_stack<T: Send + 'static>(f: impl FnOnce() -> T + Send + 'static) -> T {
    std::thread::Builder::new()
        .stack_size(256 * 1024)
        .spawn(f)
        .expect("spawn a thread")
        .join()
        .expect("the thread did not panic")
}

fn nested(levels: usize) -> String {
    format!(
        "k = {}fp16{}, v = fp16",
        "a(".repeat(levels),
        ")".repeat(levels)
    )
}

#[test]
fn deep_nesting_is_an_error_at_the_first_call_too_deep() {
    for levels in [5_000, 20_000] {
        let text = nested(levels);
        let err = on_small_stack(move || SchemeSpec::parse(&nested(levels)).unwrap_err());
        assert_eq!(
            err.message,
            format!(
                "`a(` nests calls {} deep; scheme text allows at most {MAX_NESTING} (a valid scheme needs 2)",
                MAX_NESTING + 1
            )
        );
        // The call that opens level MAX_NESTING + 1: `k = ` then MAX_NESTING `a(`s before it.
        let at = 4 + 2 * MAX_NESTING;
        assert_eq!(err.span, at..at + 2);
        assert_eq!(&text[err.span.clone()], "a(");
        assert!(err.render(&text).starts_with(&format!(
            "error: `a(` nests calls 33 deep; scheme text allows at most 32 (a valid scheme needs 2) (column {})",
            at + 1
        )));
    }
}

#[test]
fn nesting_up_to_the_limit_reaches_the_interpreter() {
    // At the limit the text parses, and the interpreter names the real problem.
    let (message, under) = error(&nested(MAX_NESTING));
    assert_eq!(
        message,
        "`k` must be `fp16`, `int(...)` or `codebook(...)`, got `a(...)`"
    );
    assert!(under.starts_with("a(a(") && under.ends_with("))"));
    // Deep nesting inside a valid call is caught the same way, wherever it sits.
    let text = format!(
        "k = int(2, channel, boost = {}4{}), v = fp16",
        "boost(".repeat(40),
        ")".repeat(40)
    );
    let err = on_small_stack(move || SchemeSpec::parse(&text).unwrap_err());
    assert!(err.message.starts_with("`boost(` nests calls 33 deep"));
}

#[test]
fn boosted_tensors_are_refused_past_what_one_byte_indexes() {
    assert_eq!(MAX_BOOSTED_HEAD_DIM, 256);
    let kitty = "k = int(2, channel, boost = boost(4, ratio = 0.125, by = magnitude)), \
                 v = int(2, token, local = 128), sink = 32, page = 128";
    let kitty_pro = "k = int(2, channel, boost = boost(4, ratio = 0.25)), v = int(2, token)";
    let boosted_v = "k = fp16, v = int(4, channel, boost = boost(8, 0.5))";
    for (text, tensor) in [(kitty, "k"), (kitty_pro, "k"), (boosted_v, "v")] {
        let spec = parse(text);
        for head_dim in [32, 64, 128, 192, 256] {
            spec.check_shape(head_dim, 8)
                .unwrap_or_else(|e| panic!("{text} at {head_dim}: {e}"));
        }
        for head_dim in [288, 512, 544, 1024, u32::MAX - 31] {
            let err = spec.check_shape(head_dim, 8).unwrap_err();
            assert_eq!(err, ShapeError::BoostHeadDim { tensor, head_dim });
            assert_eq!(
                err.to_string(),
                format!(
                    "{tensor}: boosted tensors support head_dim at most 256, got {head_dim}: a boosted \
                     page stores each channel index in one byte (byte value 255 marks an unboosted channel)"
                )
            );
        }
    }
    // Unboosted schemes keep every head_dim they had.
    let kivi = parse("k = int(2, channel), v = int(2, token)");
    for head_dim in [288, 512, 544, 1024] {
        kivi.check_shape(head_dim, 8).unwrap();
    }
}

#[test]
fn shapes_at_the_edge_of_u32_never_overflow() {
    let mut texts = builtin_texts();
    texts.extend(
        doc_blocks()
            .into_iter()
            .filter(|(info, _)| info.starts_with("scheme"))
            .map(|(_, text)| text),
    );
    texts.extend(
        [
            "k = codebook(additive, rows = 512, span = token), v = fp16",
            "k = fp16, v = codebook(additive, rows = 65536, span = token)",
            "k = codebook(rope_commutative, levels = 2, residuals = 1, pairs_per_code = 1024, span = token), v = fp16",
            "k = int(8, token, group = 1048576), v = fp16",
        ]
        .map(String::from),
    );
    const LARGEST_HEAD_DIM: u32 = u32::MAX - u32::MAX % 32;
    for text in &texts {
        let spec = parse(text);
        for head_dim in [32, 128, 1 << 20, LARGEST_HEAD_DIM, u32::MAX] {
            for kv_heads in [1, 8, u32::MAX] {
                // Each either fits or says why; a debug build panics on any overflow on the way.
                let _ = spec.check_shape(head_dim, kv_heads);
            }
        }
    }
    // The case: a token-span codebook over u32::MAX heads of 128 channels.
    let token = parse("k = codebook(additive, rows = 512, span = token), v = fp16");
    assert_eq!(token.check_shape(128, u32::MAX), Ok(()));
    assert_eq!(
        SchemeSpec::codebook_dim(CodebookSpan::Token, u32::MAX, u32::MAX),
        u64::from(u32::MAX) * u64::from(u32::MAX)
    );
    assert_eq!(
        parse("k = int(2, channel), v = fp16").check_shape(u32::MAX, 1),
        Err(ShapeError::HeadDim(u32::MAX))
    );
}

#[test]
fn hand_built_specs_with_zero_divisors_are_errors_not_panics() {
    let mut spec = parse("k = int(2, channel), v = int(2, token, group = 32)");
    if let TensorQuant::Int(q) = &mut spec.v {
        q.group = Some(0);
    }
    assert_eq!(
        spec.check_shape(128, 1),
        Err(ShapeError::Group {
            tensor: "v",
            group: 0,
            head_dim: 128
        })
    );
    let mut rope = parse(
        "k = codebook(rope_commutative, levels = 4, residuals = 1, pairs_per_code = 1), v = fp16",
    );
    rope.k = TensorQuant::Codebook(CodebookQuant {
        codebook: Codebook::RopeCommutative {
            levels: 4,
            residuals: 1,
            pairs_per_code: 0,
        },
        span: CodebookSpan::Head,
    });
    assert!(matches!(
        rope.check_shape(128, 1),
        Err(ShapeError::Pairs { pairs: 0, .. })
    ));
    let mut boost = parse("k = int(2, channel, boost = boost(4, 0.125)), v = fp16");
    if let TensorQuant::Int(IntQuant { boost: Some(b), .. }) = &mut boost.k {
        b.ratio = f32::NAN;
    }
    assert!(matches!(
        boost.check_shape(128, 1),
        Err(ShapeError::Boost { channels: 0, .. })
    ));
}

const K2: &str = "k = int(2, channel)";

#[test]
fn a_key_given_positionally_and_by_name_is_given_twice() {
    fails(
        "k = int(2, channel, bits = 4), v = fp16",
        "`bits` is given twice in int(...)",
        "bits",
    );
    // Whichever comes second is marked.
    fails(
        "k = int(bits = 4, 2, channel), v = fp16",
        "`bits` is given twice in int(...)",
        "2",
    );
    fails(
        "k = int(2, channel, axis = token), v = fp16",
        "`axis` is given twice in int(...)",
        "axis",
    );
    fails(
        "k = int(2, channel, boost = boost(4, 0.1, ratio = 0.2)), v = fp16",
        "`ratio` is given twice in boost(...)",
        "ratio",
    );
    fails(
        "k = int(2, channel, boost = boost(4, 0.1), boost(4, 0.2)), v = fp16",
        "`boost` is given twice in int(...)",
        "boost(4, 0.2)",
    );
    // A positional number for a key given by name goes to the next key that takes numbers.
    let s = parse("k = int(2, channel, boost = boost(bits = 4, 0.125)), v = fp16");
    assert_eq!(s.k.as_int().unwrap().boost.unwrap().ratio, 0.125);
    // Two positional numbers for one key stay "unexpected": which key was meant is unclear.
    fails(
        "k = int(2, channel, 4), v = fp16",
        "unexpected `4` in int(...); expected one of: bits, axis",
        "4",
    );
}

#[test]
fn a_repeated_word_is_its_key_given_twice() {
    fails(
        "k = int(2, channel, symmetric, symmetric), v = fp16",
        "`symmetric` is given twice in int(...)",
        "symmetric",
    );
    let (_, under) = error("k = int(2, channel, symmetric, symmetric), v = fp16");
    assert_eq!(under, "symmetric");
    let err = SchemeSpec::parse("k = int(2, channel, symmetric, symmetric), v = fp16").unwrap_err();
    assert_eq!(err.span, 31..40, "the second `symmetric`");
    fails(
        "k = int(2, channel, symmetric = true, symmetric), v = fp16",
        "`symmetric` is given twice in int(...)",
        "symmetric",
    );
    fails(
        "k = int(2, channel, channel), v = fp16",
        "`axis` is given twice in int(...)",
        "channel",
    );
    fails(
        "k = int(2, channel, boost = boost(4, 0.1, magnitude, variance)), v = fp16",
        "`by` is given twice in boost(...)",
        "variance",
    );
    fails(
        "k = codebook(additive, additive, rows = 32), v = fp16",
        "`additive` is given twice in codebook(...)",
        "additive",
    );
    fails(
        "k = int(2, channel), v = int(2, token), source = x(latent, latent)",
        "`latent` is given twice in x(...)",
        "latent",
    );
}

/// The range an error message prints for `key`, as `(min, max)`.
fn printed_range(message: &str) -> (u64, u64) {
    let at = message.find("..=").expect("a range in the message");
    let min = message[..at]
        .rsplit(|c: char| !c.is_ascii_digit())
        .next()
        .and_then(|d| d.parse().ok())
        .expect("a lower bound");
    let max = message[at + 3..]
        .split(|c: char| !c.is_ascii_digit())
        .next()
        .and_then(|d| d.parse().ok())
        .expect("an upper bound");
    (min, max)
}

#[test]
fn printed_ranges_are_the_ranges_accepted() {
    // (scheme text with `N` where the key's value goes, the key, the step between valid values)
    let cases: &[(&str, &str, u64)] = &[
        ("k = int(2, channel), v = fp16, page = N", "page", 16),
        ("k = int(2, channel), v = fp16, sink = N", "sink", 1),
        ("k = int(2, channel), v = fp16, local = N", "local", 1),
        ("k = int(2, channel, local = N), v = fp16", "local", 1),
        ("k = int(2, channel, group = N), v = fp16", "group", 16),
        ("k = int(1, token, group = N), v = fp16", "group", 32),
        ("k = int(2, token, group = N), v = fp16", "group", 16),
        ("k = int(3, token, group = N), v = fp16", "group", 32),
        ("k = int(4, token, group = N), v = fp16", "group", 8),
        ("k = int(8, token, group = N), v = fp16", "group", 4),
        ("k = codebook(rope_commutative, levels = 4, residuals = N, pairs_per_code = 1024), v = fp16", "residuals", 1),
        ("k = codebook(rope_commutative, levels = 4, residuals = 1, pairs_per_code = N), v = fp16", "pairs_per_code", 1),
        ("k = codebook(additive, rows = N), v = fp16", "rows", 32),
    ];
    for &(template, key, step) in cases {
        let at = |n: &str| template.replace('N', n);
        for bad in ["1e20", "-1", "0.5", "1e-400"] {
            let (message, under) = error(&at(bad));
            assert_eq!(under, bad, "{message}");
            assert!(
                message.starts_with(&format!("`{key}` must be ")),
                "{message}"
            );
            let (min, max) = printed_range(&message);
            assert!(min <= max, "{message}");
            parse(&at(&min.to_string()));
            parse(&at(&max.to_string()));
            assert_eq!(max % step, 0, "{message}");
            if min > 0 {
                let below = min - 1;
                let (m, _) = error(&at(&below.to_string()));
                assert_eq!(
                    m,
                    message.replace(&format!("`{bad}`"), &format!("`{below}`"))
                );
            }
            let above = max + step;
            let (m, _) = error(&at(&above.to_string()));
            assert_eq!(
                m,
                message.replace(&format!("`{bad}`"), &format!("`{above}`"))
            );
        }
    }
    // The case, in full: 0 was printed as valid and then refused.
    let (message, _) = error(&format!("{K2}, v = fp16, page = 1e20"));
    assert_eq!(
        message,
        "`page` must be a multiple of 16 in 16..=1048576 (the attention kernels tile a page 16 \
         tokens at a time), got `1e20`"
    );
    // Levels are powers of two between the printed bounds.
    let levels = |n: &str| {
        format!("k = codebook(rope_commutative, levels = {n}, residuals = 1, pairs_per_code = 4), v = fp16")
    };
    let (message, _) = error(&levels("3"));
    assert_eq!(
        message,
        "`levels` must be a power of two in 2..=65536 (codes are whole bits), got `3`"
    );
    parse(&levels("2"));
    parse(&levels("65536"));
    error(&levels("131072"));
}

#[test]
fn integer_keys_take_exact_whole_numbers_only() {
    // Forms whose exact value is whole are that number.
    for (text, value) in [
        ("32", 32),
        ("+32", 32),
        ("32.0", 32),
        ("3.2e1", 32),
        ("320e-1", 32),
        ("3_2", 32),
        ("0.032e3", 32),
        ("-0", 0),
        ("0e-400", 0),
        ("0.0", 0),
        ("1e6", 1_000_000),
    ] {
        assert_eq!(
            parse(&format!("{K2}, v = fp16, sink = {text}")).sink,
            value,
            "{text}"
        );
    }
    // Forms an f64 would round to a whole number, but which are not one.
    for text in [
        "1e-400",
        "1e-99999999999999999999",
        "0.5",
        "1.0000000000000001",
        "32.00000000000000001",
        "1048576.0000000001",
        "3.21e1",
        "-1",
        "-0.0000001",
    ] {
        fails(
            &format!("{K2}, v = fp16, sink = {text}"),
            &format!("`sink` must be a whole number in 0..=1048576, got `{text}`"),
            text,
        );
    }
    // Huge whole numbers are out of range, not wrapped or saturated.
    for text in [
        "4294967296",
        "18446744073709551617",
        "1e30",
        "1e300",
        "9".repeat(300).as_str(),
    ] {
        let (message, under) = error(&format!("{K2}, v = fp16, sink = {text}"));
        assert_eq!(under, text);
        assert!(
            message.starts_with("`sink` must be a whole number in 0..=1048576"),
            "{message}"
        );
    }
    // Code widths read the same way.
    assert_eq!(
        parse("k = int(4.0, channel), v = fp16")
            .k
            .as_int()
            .unwrap()
            .bits,
        4
    );
    assert_eq!(
        parse("k = int(4e0, channel), v = fp16")
            .k
            .as_int()
            .unwrap()
            .bits,
        4
    );
    for bits in ["2.0000000000000001", "4e-400", "-2", "1e1"] {
        fails(
            &format!("k = int({bits}, channel), v = fp16"),
            &format!("`bits` must be 1, 2, 3, 4 or 8, got `{bits}`"),
            bits,
        );
    }
    fails(
        "k = int(2, channel, boost = boost(4.0000000000000001, 0.1)), v = fp16",
        "boost `bits` must be 3, 4 or 6 (a 2-bit base plane plus a 1-, 2- or 4-bit high plane), got `4.0000000000000001`",
        "4.0000000000000001",
    );
    fails(
        "k = int(2, channel, boost = boost(1e-400, 0.1)), v = fp16",
        "boost `bits` must be 3, 4 or 6",
        "1e-400",
    );
    assert_eq!(
        parse("k = int(2, channel, boost = boost(4.0, 0.1)), v = fp16")
            .k
            .as_int()
            .unwrap()
            .boost
            .unwrap()
            .bits,
        4
    );
}

#[test]
fn real_keys_round_to_f32_and_refuse_what_leaves_their_range() {
    let tau = |t: &str| format!("{K2}, v = fp16, calibrate = calibrate(tau1 = {t}, tau2 = 0)");
    // `-0` is 0: equal schemes print, and hash, alike.
    let neg = parse(&tau("-0"));
    let pos = parse(&tau("0"));
    assert_eq!(neg.to_string(), pos.to_string());
    assert_eq!(neg.stable_hash(), pos.stable_hash());
    assert!(neg.calibrate.unwrap().tau1.is_sign_positive());
    // Past f32's range is past the key's range, with the key's own message.
    for t in ["1e39", "-1e39", "1e300"] {
        fails(
            &tau(t),
            &format!("`tau1` must lie within ±10000 (it shifts pre-softmax scores), got `{t}`"),
            t,
        );
    }
    // A ratio that rounds to 0 or 1 in f32 is refused, naming what was written.
    for r in ["1e-50", "1e-400", "0.99999999", "-0"] {
        fails(
            &format!("k = int(2, channel, boost = boost(4, ratio = {r})), v = fp16"),
            &format!("boost `ratio` must lie strictly between 0 and 1, got `{r}`"),
            r,
        );
    }
    // Not numbers at all.
    for t in ["nan", "inf", "NaN", "infinity"] {
        fails(&tau(t), &format!("`tau1` must be a number, got `{t}`"), t);
    }
    for t in ["-inf", "+inf", "-nan", "1e999"] {
        fails(&tau(t), &format!("`{t}` is not a number"), t);
    }
}

#[test]
fn errors_about_enormous_text_stay_short() {
    // A 60 KB line is shown as a window around the span, with the true column.
    let text = nested(20_000);
    let err = on_small_stack({
        let text = text.clone();
        move || SchemeSpec::parse(&text).unwrap_err()
    });
    let shown = err.render(&text);
    assert!(shown.len() < 400, "{} bytes", shown.len());
    let lines: Vec<&str> = shown.lines().collect();
    assert_eq!(lines.len(), 3, "{shown}");
    assert!(lines[0].ends_with("(column 69)"), "{}", lines[0]);
    assert!(
        lines[1].starts_with("  …") && lines[1].ends_with('…'),
        "{}",
        lines[1]
    );
    // The carets sit under an `a(` of the window.
    let caret = lines[2].find('^').expect("carets");
    assert_eq!(lines[2].trim_start().trim_end(), "^^");
    let under: String = lines[1].chars().skip(caret).take(2).collect();
    assert_eq!(under, "a(");
    // The end of a long line is reachable too: a missing value after 10,000 characters.
    let text = format!("{K2}, v = fp16, sink = {}, local = ", "0".repeat(10_000));
    let err = SchemeSpec::parse(&text).unwrap_err();
    let shown = err.render(&text);
    assert!(shown.len() < 400, "{shown}");
    assert!(
        shown.lines().nth(1).unwrap().ends_with("local = "),
        "{shown}"
    );
    assert!(shown.lines().nth(2).unwrap().ends_with('^'), "{shown}");
    // One enormous token is quoted by its start.
    let word = "x".repeat(100_000);
    let (message, _) = error(&format!("k = fp16, v = fp16, {word} = 1"));
    assert_eq!(
        message,
        format!(
            "unknown key `{}…` in the scheme; expected one of: k, v, page, sink, local, calibrate, source",
            "x".repeat(40)
        )
    );
    let (message, _) = error(&format!("{K2}, v = {word}"));
    assert!(message.len() < 200, "{message}");
    let (message, _) = error(&format!("{K2}, v = fp16, sink = 1{}x", "0".repeat(100_000)));
    assert!(message.len() < 200, "{message}");
}

proptest::proptest! {
    #![proptest_config(proptest::prelude::ProptestConfig::with_cases(1024))]

    /// Long, deep and numeric noise never panics, and its rendering stays a few short lines with the
    /// carets inside the shown text.
    #[test]
    fn noise_renders_in_a_few_short_lines(text in "[ka(),=0-9eE.+_\\- vintsgb\t\né]{0,600}") {
        if let Err(e) = SchemeSpec::parse(&text) {
            let shown = e.render(&text);
            let lines: Vec<&str> = shown.lines().collect();
            proptest::prop_assert_eq!(lines.len(), 3, "{}", shown);
            proptest::prop_assert!(lines[1].chars().count() <= 2 + 102, "{}", shown);
            proptest::prop_assert!(lines[2].chars().count() <= lines[1].chars().count() + 1, "{}", shown);
        }
    }
}
