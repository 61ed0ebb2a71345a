//! Checks the untyped tree against what kvq supports and builds a [`SchemeSpec`].
//!
//! Every rule that can be decided without knowing the head dimension lives here, so the `#[scheme]`
//! attribute rejects it at compile time on the right token. Shape-dependent rules live in
//! [`SchemeSpec::check_shape`](crate::SchemeSpec::check_shape).

use super::syntax::{Arg, Value};
use crate::types::*;
use crate::SpecError;
use std::ops::Range;

/// Largest sink, local window or page we accept; larger values are almost surely typos.
const MAX_TOKENS: u32 = 1 << 20;

/// Keyed arguments of one call (or of the whole scheme), consumed one by one so that whatever is
/// left at the end is reported as unknown.
struct Args {
    what: &'static str,
    call_span: Range<usize>,
    items: Vec<Option<Arg>>,
}

impl Args {
    fn new(what: &'static str, call_span: Range<usize>, args: Vec<Arg>) -> Result<Self, SpecError> {
        // Duplicate keys are an error, not "last one wins".
        for (i, a) in args.iter().enumerate() {
            if let Some((k, span)) = &a.key {
                if args[..i]
                    .iter()
                    .any(|b| b.key.as_ref().is_some_and(|(bk, _)| bk == k))
                {
                    return Err(SpecError::new(
                        span.clone(),
                        format!("`{k}` is given twice in {what}"),
                    ));
                }
            }
        }
        Ok(Self {
            what,
            call_span,
            items: args.into_iter().map(Some).collect(),
        })
    }

    fn keyed(&mut self, key: &str) -> Option<Value> {
        self.items
            .iter_mut()
            .find(|a| {
                a.as_ref()
                    .is_some_and(|a| a.key.as_ref().is_some_and(|(k, _)| k == key))
            })
            .and_then(|a| a.take())
            .map(|a| a.value)
    }

    /// The first positional argument accepted by `accept`.
    fn positional(&mut self, accept: impl Fn(&Value) -> bool) -> Option<Value> {
        self.items
            .iter_mut()
            .find(|a| a.as_ref().is_some_and(|a| a.key.is_none() && accept(&a.value)))
            .and_then(|a| a.take())
            .map(|a| a.value)
    }

    /// A bare flag word such as `symmetric`.
    fn flag(&mut self, name: &str) -> Result<bool, SpecError> {
        if let Some(v) = self.keyed(name) {
            return match v {
                Value::Word { name: w, .. } if w == "true" => Ok(true),
                Value::Word { name: w, .. } if w == "false" => Ok(false),
                other => Err(SpecError::new(
                    other.span(),
                    format!("`{name}` is a flag: write `{name}` alone or `{name} = true|false`"),
                )),
            };
        }
        Ok(self
            .positional(|v| matches!(v, Value::Word { name: w, .. } if w == name))
            .is_some())
    }

    fn finish(self, allowed: &[&str]) -> Result<(), SpecError> {
        if let Some(arg) = self.items.into_iter().flatten().next() {
            let (span, msg) = match &arg.key {
                Some((k, span)) => (
                    span.clone(),
                    format!("unknown key `{k}` in {}; expected one of: {}", self.what, allowed.join(", ")),
                ),
                None => (
                    arg.value.span(),
                    format!("unexpected value in {}; expected one of: {}", self.what, allowed.join(", ")),
                ),
            };
            return Err(SpecError::new(span, msg));
        }
        Ok(())
    }
}

fn number(v: &Value, what: &str) -> Result<f64, SpecError> {
    match v {
        Value::Number { value, .. } => Ok(*value),
        other => Err(SpecError::new(other.span(), format!("`{what}` must be a number"))),
    }
}

fn integer(v: &Value, what: &str, min: u32, max: u32) -> Result<u32, SpecError> {
    let x = number(v, what)?;
    if x.fract() != 0.0 || x < min as f64 || x > max as f64 {
        return Err(SpecError::new(
            v.span(),
            format!("`{what}` must be a whole number in {min}..={max}, got {x}"),
        ));
    }
    Ok(x as u32)
}

fn word<'v>(v: &'v Value, what: &str, choices: &[&str]) -> Result<(&'v str, Range<usize>), SpecError> {
    match v {
        Value::Word { name, span } if choices.contains(&name.as_str()) => Ok((name, span.clone())),
        other => Err(SpecError::new(
            other.span(),
            format!("`{what}` must be one of: {}", choices.join(", ")),
        )),
    }
}

fn call(v: Value, what: &str, names: &[&str]) -> Result<(String, Range<usize>, Vec<Arg>), SpecError> {
    match v {
        Value::Call { name, span, args } if names.contains(&name.as_str()) => Ok((name, span, args)),
        Value::Word { name, span } if names.contains(&name.as_str()) => Ok((name, span, Vec::new())),
        other => Err(SpecError::new(
            other.span(),
            format!(
                "`{what}` must be {}",
                names.iter().map(|n| format!("`{n}(...)`")).collect::<Vec<_>>().join(" or ")
            ),
        )),
    }
}

fn required(v: Option<Value>, key: &str, args: &Args) -> Result<Value, SpecError> {
    v.ok_or_else(|| {
        SpecError::new(args.call_span.clone(), format!("{} needs `{key} = ...`", args.what))
    })
}

/// Codes per 32-bit word for a bit width; 3-bit codes are stored as a 2-bit and a 1-bit plane, so
/// they pack 32 to a group of words.
pub(crate) fn packing_width(bits: u8) -> u32 {
    match bits {
        3 => 32,
        b => 32 / b as u32,
    }
}

fn tensor(v: Value, which: &'static str) -> Result<TensorQuant, SpecError> {
    if let Value::Word { name, .. } = &v {
        if name == "fp16" {
            return Ok(TensorQuant::Fp16);
        }
    }
    let (name, span, args) = call(v, which, &["int", "codebook", "fp16"])?;
    match name.as_str() {
        "fp16" => {
            Args::new("fp16(...)", span, args)?.finish(&[])?;
            Ok(TensorQuant::Fp16)
        }
        "int" => int_quant(span, args).map(TensorQuant::Int),
        _ => codebook(span, args, which).map(TensorQuant::Codebook),
    }
}

fn int_quant(span: Range<usize>, args: Vec<Arg>) -> Result<IntQuant, SpecError> {
    let mut a = Args::new("int(...)", span, args)?;
    let bits_v = match a.keyed("bits") {
        Some(v) => v,
        None => required(a.positional(|v| matches!(v, Value::Number { .. })), "bits", &a)?,
    };
    let bits = integer(&bits_v, "bits", 1, 8)?;
    if ![1, 2, 3, 4, 8].contains(&bits) {
        return Err(SpecError::new(
            bits_v.span(),
            format!("`bits` must be 1, 2, 3, 4 or 8, got {bits}"),
        ));
    }
    let bits = bits as u8;
    let axis_v = match a.keyed("axis") {
        Some(v) => v,
        None => required(
            a.positional(|v| matches!(v, Value::Word { name, .. } if name == "channel" || name == "token")),
            "axis",
            &a,
        )?,
    };
    let axis = match word(&axis_v, "axis", &["channel", "token"])?.0 {
        "channel" => Axis::Channel,
        _ => Axis::Token,
    };
    let symmetric = a.flag("symmetric")?;
    let group = match a.keyed("group") {
        Some(v) => {
            let g = integer(&v, "group", 1, MAX_TOKENS)?;
            let width = match axis {
                // A channel-axis group is a page of tokens; pages are tiled 16 tokens at a time.
                Axis::Channel => 16,
                Axis::Token => packing_width(bits),
            };
            if g % width != 0 {
                let unit = if axis == Axis::Channel { "tokens (the page tile)" } else { "codes per packed word" };
                return Err(SpecError::new(
                    v.span(),
                    format!("`group = {g}` is not a multiple of {width} {unit} for {bits}-bit codes"),
                ));
            }
            Some(g)
        }
        None => None,
    };
    let local = a
        .keyed("local")
        .map(|v| integer(&v, "local", 0, MAX_TOKENS))
        .transpose()?;
    let boost = match a.keyed("boost") {
        Some(v) => Some(boost(v, bits, axis)?),
        None => None,
    };
    if symmetric && bits == 1 {
        return Err(SpecError::new(
            a.call_span.clone(),
            "1-bit codes cannot be symmetric (no zero level); drop `symmetric`",
        ));
    }
    a.finish(&["bits", "axis", "group", "symmetric", "boost", "local"])?;
    Ok(IntQuant {
        bits,
        axis,
        group,
        symmetric,
        boost,
        local,
    })
}

fn boost(v: Value, base_bits: u8, axis: Axis) -> Result<Boost, SpecError> {
    let (_, span, args) = call(v, "boost", &["boost"])?;
    let mut a = Args::new("boost(...)", span.clone(), args)?;
    let bits_v = match a.keyed("bits") {
        Some(v) => v,
        None => required(a.positional(|v| matches!(v, Value::Number { .. })), "bits", &a)?,
    };
    let bits = integer(&bits_v, "bits", 1, 8)? as u8;
    if bits <= base_bits {
        return Err(SpecError::new(
            bits_v.span(),
            format!("boost bits ({bits}) must exceed the tensor's base bits ({base_bits})"),
        ));
    }
    let high = bits - base_bits;
    if ![1, 2, 4].contains(&high) || ![1, 2, 4].contains(&base_bits) {
        return Err(SpecError::new(
            bits_v.span(),
            format!(
                "boosted codes are stored as a {base_bits}-bit plane plus a {high}-bit plane; \
                 both must be 1, 2 or 4 bits"
            ),
        ));
    }
    let ratio_v = match a.keyed("ratio") {
        Some(v) => v,
        None => required(a.positional(|v| matches!(v, Value::Number { .. })), "ratio", &a)?,
    };
    let ratio = number(&ratio_v, "ratio")?;
    if !(ratio > 0.0 && ratio < 1.0) {
        return Err(SpecError::new(
            ratio_v.span(),
            format!("boost `ratio` must lie strictly between 0 and 1, got {ratio}"),
        ));
    }
    let by = match a.keyed("by") {
        Some(v) => match word(&v, "by", &["magnitude", "variance"])?.0 {
            "magnitude" => BoostCriterion::Magnitude,
            _ => BoostCriterion::Variance,
        },
        None => BoostCriterion::Magnitude,
    };
    a.finish(&["bits", "ratio", "by"])?;
    if axis != Axis::Channel {
        return Err(SpecError::new(
            span,
            "channel boost needs `axis = channel` (per-channel scales); token-axis tensors have none to boost",
        ));
    }
    Ok(Boost {
        bits,
        ratio: ratio as f32,
        by,
    })
}

fn codebook(span: Range<usize>, args: Vec<Arg>, which: &str) -> Result<CodebookQuant, SpecError> {
    let mut a = Args::new("codebook(...)", span.clone(), args)?;
    let rope = a.flag("rope_commutative")?;
    let additive = a.flag("additive")?;
    let span_kind = match a.keyed("span") {
        Some(v) => match word(&v, "span", &["head", "token"])?.0 {
            "head" => CodebookSpan::Head,
            _ => CodebookSpan::Token,
        },
        None => CodebookSpan::Head,
    };
    let codebook = match (rope, additive) {
        (true, false) => {
            let levels_v = required(a.keyed("levels"), "levels", &a)?;
            let levels = integer(&levels_v, "levels", 2, 1 << 16)?;
            if !levels.is_power_of_two() {
                return Err(SpecError::new(
                    levels_v.span(),
                    format!("`levels` must be a power of two (codes are whole bits), got {levels}"),
                ));
            }
            let residuals = integer(&required(a.keyed("residuals"), "residuals", &a)?, "residuals", 1, 64)?;
            let g_v = required(a.keyed("pairs_per_code"), "pairs_per_code", &a)?;
            let pairs_per_code = integer(&g_v, "pairs_per_code", 1, 1024)?;
            let cb = Codebook::RopeCommutative {
                levels,
                residuals,
                pairs_per_code,
            };
            let bits = cb.bits_per_scalar(0);
            if bits >= 16.0 {
                return Err(SpecError::new(
                    span.clone(),
                    format!("this codebook spends {bits} bits per scalar: no compression over fp16"),
                ));
            }
            if which == "v" {
                return Err(SpecError::new(
                    span.clone(),
                    "a RoPE-commutative codebook is for keys (values carry no RoPE); use `codebook(additive, ...)` for `v`",
                ));
            }
            cb
        }
        (false, true) => {
            let rows_v = required(a.keyed("rows"), "rows", &a)?;
            let rows = integer(&rows_v, "rows", 1, 1 << 16)?;
            if rows % 32 != 0 {
                return Err(SpecError::new(
                    rows_v.span(),
                    format!("`rows` must be a multiple of 32 (binary codes pack into 32-bit words), got {rows}"),
                ));
            }
            Codebook::Additive { rows }
        }
        _ => {
            return Err(SpecError::new(
                span,
                "a codebook is either `rope_commutative` or `additive`: name exactly one",
            ))
        }
    };
    a.finish(&["rope_commutative", "additive", "levels", "residuals", "pairs_per_code", "rows", "span"])?;
    Ok(CodebookQuant {
        codebook,
        span: span_kind,
    })
}

fn calibration(v: Value) -> Result<(Calibration, Range<usize>), SpecError> {
    let (_, span, args) = call(v, "calibrate", &["calibrate"])?;
    let mut a = Args::new("calibrate(...)", span.clone(), args)?;
    let tau = |a: &mut Args, key: &str| -> Result<f32, SpecError> {
        let v = required(a.keyed(key), key, a)?;
        let x = number(&v, key)?;
        if !x.is_finite() || x.abs() > 1e4 {
            return Err(SpecError::new(v.span(), format!("`{key}` must be a finite number")));
        }
        Ok(x as f32)
    };
    let tau1 = tau(&mut a, "tau1")?;
    let tau2 = tau(&mut a, "tau2")?;
    a.finish(&["tau1", "tau2"])?;
    Ok((Calibration { tau1, tau2 }, span))
}

fn source(v: Value) -> Result<CacheSource, SpecError> {
    if let Value::Word { name, .. } = &v {
        if name == "kv" {
            return Ok(CacheSource::Kv);
        }
    }
    let (_, span, args) = call(v, "source", &["x"])?;
    let mut a = Args::new("x(...)", span.clone(), args)?;
    let latent = a.flag("latent")?;
    let cross = a.flag("cross_layer")?;
    a.finish(&["latent", "cross_layer"])?;
    match (latent, cross) {
        (true, false) => Ok(CacheSource::X(XSource::Latent)),
        (false, true) => Ok(CacheSource::X(XSource::CrossLayer)),
        _ => Err(SpecError::new(
            span,
            "name one cached form: `source = x(latent)` or `source = x(cross_layer)`",
        )),
    }
}

/// Builds a scheme from the parsed items.
pub(crate) fn scheme(items: Vec<Arg>, text_len: usize) -> Result<SchemeSpec, SpecError> {
    let mut a = Args::new("the scheme", 0..text_len, items)?;
    let k_v = required(a.keyed("k"), "k", &a)?;
    let k_span = k_v.span();
    let k = tensor(k_v, "k")?;
    let v_v = required(a.keyed("v"), "v", &a)?;
    let v_span = v_v.span();
    let v = tensor(v_v, "v")?;
    let tokens = |a: &mut Args, key: &str| -> Result<Option<(u32, Range<usize>)>, SpecError> {
        a.keyed(key)
            .map(|v| integer(&v, key, 0, MAX_TOKENS).map(|n| (n, v.span())))
            .transpose()
    };
    let page_given = tokens(&mut a, "page")?;
    let sink = tokens(&mut a, "sink")?.map_or(0, |(n, _)| n);
    let local = tokens(&mut a, "local")?.map_or(0, |(n, _)| n);
    let calibrate = match a.keyed("calibrate") {
        Some(v) => Some(calibration(v)?),
        None => None,
    };
    let source_v = a.keyed("source");
    let source_span = source_v.as_ref().map(Value::span);
    let source = match source_v {
        Some(v) => source(v)?,
        None => CacheSource::Kv,
    };
    a.finish(&["k", "v", "page", "sink", "local", "calibrate", "source"])?;

    // The page: a channel-axis group is exactly one page.
    let mut page = page_given.as_ref().map(|(p, _)| *p);
    for (t, span) in [(&k, &k_span), (&v, &v_span)] {
        if let TensorQuant::Int(IntQuant { axis: Axis::Channel, group: Some(g), .. }) = t {
            match page {
                Some(p) if p != *g => {
                    return Err(SpecError::new(
                        span.clone(),
                        format!("a channel-axis group is one page: `group = {g}` but the page is {p} tokens"),
                    ))
                }
                _ => page = Some(*g),
            }
        }
    }
    let page = page.unwrap_or(DEFAULT_PAGE);
    if page < 16 || page % 16 != 0 {
        let span = page_given.map_or(0..text_len, |(_, s)| s);
        return Err(SpecError::new(
            span,
            format!("the page must be a positive multiple of 16 tokens, got {page}"),
        ));
    }
    if let Some((_, span)) = &calibrate {
        if !k.is_quantized() {
            return Err(SpecError::new(
                span.clone(),
                "`calibrate` corrects the scores of quantized keys, but `k = fp16`",
            ));
        }
    }
    if let CacheSource::X(_) = source {
        for (t, span, name) in [(&k, &k_span, "k"), (&v, &v_span, "v")] {
            if !matches!(t, TensorQuant::Int(_)) {
                return Err(SpecError::new(
                    span.clone(),
                    format!("`source = x(...)` caches integer-quantized activations: `{name}` must be `int(...)`"),
                ));
            }
        }
        if k.as_int().is_some_and(|q| q.boost.is_some()) {
            return Err(SpecError::new(
                source_span.unwrap_or(0..text_len),
                "channel boost is not defined for cached activations (`source = x(...)`)",
            ));
        }
    }
    // Normal form: a channel-axis group is the page, so only the page records it.
    let normalise = |t: TensorQuant| match t {
        TensorQuant::Int(q) if q.axis == Axis::Channel => TensorQuant::Int(IntQuant { group: None, ..q }),
        other => other,
    };
    Ok(SchemeSpec {
        k: normalise(k),
        v: normalise(v),
        page,
        sink,
        local,
        calibrate: calibrate.map(|(c, _)| c),
        source,
    })
}
