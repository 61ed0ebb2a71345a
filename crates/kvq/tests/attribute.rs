//! `#[kvq::scheme]` on user types: the attribute and the run-time parser agree, and every built-in's
//! attribute text, canonical text and documented example describe the same scheme.

use kvq::schemes::*;
use kvq::{Scheme, SchemeSpec};

/// A user's own scheme: Kitty's keys with variance ranking, 4-bit values in groups of 32 channels.
#[kvq::scheme(
    k = int(2, channel, boost = boost(4, ratio = 0.25, by = variance)),
    v = int(4, token, group = 32, symmetric),
    sink = 16,
    local = 64,
    page = 64,
)]
pub struct Mine;

/// Negative and exponent literals come through the token stream as the same numbers.
#[kvq::scheme(k = int(1, channel), v = int(1, channel), calibrate = calibrate(tau1 = -0.5, tau2 = 1e-3))]
struct Calibrated;

#[kvq::scheme(
    k = codebook(rope_commutative, levels = 4, residuals = 2, pairs_per_code = 4, span = token),
    v = codebook(additive, rows = 96)
)]
struct Codebooks;

#[kvq::scheme(k = int(3, channel), v = int(3, token), source = x(cross_layer))]
struct Activations;

fn parsed(text: &str) -> SchemeSpec {
    SchemeSpec::parse(text).unwrap_or_else(|e| panic!("{}", e.render(text)))
}

#[test]
fn attribute_equals_the_runtime_parse() {
    assert_eq!(
        Mine::SPEC,
        parsed(
            "k = int(2, channel, boost = boost(4, ratio = 0.25, by = variance)), \
             v = int(4, token, group = 32, symmetric), sink = 16, local = 64, page = 64"
        )
    );
    assert_eq!(
        Calibrated::SPEC,
        parsed("k = int(1, channel), v = int(1, channel), calibrate = calibrate(tau1 = -0.5, tau2 = 0.001)")
    );
    assert_eq!(Codebooks::SPEC, parsed(Codebooks::TEXT));
    assert_eq!(Activations::SPEC, parsed(&Activations::SPEC.to_string()));
}

#[test]
fn name_and_text() {
    assert_eq!(Mine::NAME, "Mine");
    assert_eq!(Kivi2::NAME, "Kivi2");
    assert_eq!(<KittyPro as Scheme>::NAME, "KittyPro");
    // `TEXT` is the canonical text, which is also what the generated doc shows (`Scheme: `TEXT``).
    assert_eq!(Mine::TEXT, Mine::SPEC.to_string());
    assert_eq!(
        Kivi2::TEXT,
        "k = int(bits = 2, axis = channel), v = int(bits = 2, axis = token), page = 128, local = 128"
    );
    // Usable in const contexts, e.g. static tables of kernel names.
    const TABLE: [(&str, &str); 2] = [(Fp16::NAME, Fp16::TEXT), (Int8::NAME, Int8::TEXT)];
    assert_eq!(TABLE[0], ("Fp16", "k = fp16, v = fp16, page = 128"));
}

/// Every `#[scheme(...)]` in `src/schemes.rs` with the name of the struct it is on.
fn builtin_sources() -> Vec<(String, String)> {
    let src = include_str!("../src/schemes.rs");
    let mut out = Vec::new();
    for (at, _) in src.match_indices("#[scheme(") {
        let body = &src[at + "#[scheme(".len()..];
        let mut depth = 1;
        let end = body
            .char_indices()
            .find(|&(_, c)| {
                depth += match c {
                    '(' => 1,
                    ')' => -1,
                    _ => 0,
                };
                depth == 0
            })
            .map(|(i, _)| i)
            .expect("balanced #[scheme(...)]");
        let after = &body[end..];
        let name = after[after.find("struct ").expect("a struct") + 7..]
            .split(|c: char| !c.is_alphanumeric() && c != '_')
            .next()
            .unwrap_or_default();
        out.push((name.to_string(), body[..end].to_string()));
    }
    out
}

/// Every built-in type with its constants, by type name.
fn builtin_types() -> Vec<(&'static str, SchemeSpec, &'static str)> {
    macro_rules! list {
        ($($t:ty),*) => { vec![$((<$t>::NAME, <$t>::SPEC, <$t>::TEXT)),*] };
    }
    list!(
        Fp16,
        Kivi2,
        Kivi4,
        Kitty,
        KittyPro,
        CalibQuant1,
        CalibQuant2,
        Int8,
        CommVq2,
        CommVq1,
        XQuant2,
        XQuant3,
        XQuant4,
        XQuantCl2
    )
}

#[test]
fn builtins_agree_with_their_source_text() {
    let sources = builtin_sources();
    let types = builtin_types();
    assert_eq!(
        sources.len(),
        BUILTIN.len(),
        "every #[scheme] in schemes.rs is in BUILTIN"
    );
    assert_eq!(
        types.len(),
        BUILTIN.len(),
        "this test lists every built-in type"
    );
    for (name, text) in &sources {
        let (_, spec, canonical) = types
            .iter()
            .find(|(n, ..)| n == name)
            .unwrap_or_else(|| panic!("{name} is not in this test's list"));
        // What the attribute saw as tokens and what the runtime parser reads as text agree.
        assert_eq!(parsed(text), *spec, "{name}");
        assert_eq!(parsed(canonical), *spec, "{name}");
        assert!(
            BUILTIN.iter().any(|b| b.spec == *spec),
            "{name} is in BUILTIN"
        );
    }
    for b in BUILTIN {
        assert_eq!(parsed(&b.spec.to_string()), b.spec, "{}", b.name);
        assert_eq!(
            by_name(&b.name.to_uppercase().replace('-', "_")).map(|x| x.name),
            Some(b.name)
        );
    }
}

#[test]
fn documented_examples_are_the_builtins() {
    let doc = include_str!("../../../docs/GRAMMAR.md");
    let mut lines = doc.lines();
    let mut checked = 0;
    while let Some(line) = lines.next() {
        let Some(name) = line.strip_prefix("```text scheme=") else {
            continue;
        };
        let text: Vec<&str> = lines
            .by_ref()
            .take_while(|l| !l.starts_with("```"))
            .collect();
        let builtin = by_name(name.trim()).unwrap_or_else(|| panic!("no built-in `{name}`"));
        assert_eq!(
            parsed(&text.join("\n")),
            builtin.spec,
            "docs/GRAMMAR.md example `{name}`"
        );
        checked += 1;
    }
    assert!(checked >= 8, "docs/GRAMMAR.md names {checked} built-ins");
}

#[test]
fn readme_example_is_valid() {
    let readme = include_str!("../../../README.md");
    let at = readme
        .find("#[kvq::scheme(")
        .expect("README declares a scheme")
        + "#[kvq::scheme(".len();
    let body = &readme[at..];
    let end = body.find(")]\n").expect("the attribute ends with `)]`");
    let spec = parsed(body[..end].trim().trim_end_matches(','));
    spec.check_shape(128, 8).unwrap();
    assert_eq!(spec.k.as_int().unwrap().bits, 2);
    // The error shown in the README is the compile-fail test's, with the path changed.
    let shown = include_str!("ui/ratio_out_of_range.stderr")
        .replace("tests/ui/ratio_out_of_range.rs", "src/lib.rs");
    assert!(
        readme.contains(&shown),
        "README's error example is out of date:\n{shown}"
    );
}
