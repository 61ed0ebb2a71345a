//! Checks the untyped tree against what kvq supports and builds a [`SchemeSpec`].
//!
//! Every rule that can be decided without knowing the head dimension lives here, so the `#[scheme]`
//! attribute rejects it at compile time on the right token. Shape-dependent rules live in
//! [`SchemeSpec::check_shape`](crate::SchemeSpec::check_shape).

use super::syntax::{Arg, Value};
use crate::error::shown;
use crate::types::*;
use crate::SpecError;
use std::ops::Range;

/// Largest sink, local window or page we accept; larger values are almost surely typos.
const MAX_TOKENS: u32 = 1 << 20;

/// Largest calibration offset we accept; scores are O(10), so anything near this is a typo.
const MAX_TAU: f32 = 1e4;

/// Keyed and positional arguments of one call (or of the whole scheme), consumed one by one so that
/// whatever is left at the end is reported.
struct Args {
    what: &'static str,
    call_span: Range<usize>,
    allowed: &'static [&'static str],
    items: Vec<Option<Arg>>,
    /// Keys already given, so that a leftover positional argument that repeats one is reported as
    /// the key given twice rather than as something unexpected.
    filled: Vec<Filled>,
}

/// A key that took a value, where, and which positional values it would have taken.
struct Filled {
    key: &'static str,
    /// The key (`bits = ...`) or the positional value that gave it.
    span: Range<usize>,
    by_key: bool,
    accepts: Box<dyn Fn(&Value) -> bool>,
}

impl Args {
    /// Rejects unknown and duplicate keys up front, so a typo is reported as itself rather than as
    /// whatever it was meant to provide being missing.
    fn new(
        what: &'static str,
        call_span: Range<usize>,
        args: Vec<Arg>,
        allowed: &'static [&'static str],
    ) -> Result<Self, SpecError> {
        for (i, a) in args.iter().enumerate() {
            let Some((k, span)) = &a.key else { continue };
            if !allowed.contains(&k.as_str()) {
                return Err(SpecError::new(
                    span.clone(),
                    format!(
                        "unknown key `{}` in {what}; expected one of: {}",
                        shown(k),
                        allowed.join(", ")
                    ),
                ));
            }
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
        Ok(Self {
            what,
            call_span,
            allowed,
            items: args.into_iter().map(Some).collect(),
            filled: Vec::new(),
        })
    }

    fn fill(&mut self, key: &'static str, arg: &Arg, accepts: impl Fn(&Value) -> bool + 'static) {
        let (span, by_key) = match &arg.key {
            Some((_, s)) => (s.clone(), true),
            None => (arg.value.span(), false),
        };
        self.filled.push(Filled {
            key,
            span,
            by_key,
            accepts: Box::new(accepts),
        });
    }

    fn take(&mut self, pick: impl Fn(&Arg) -> bool) -> Option<Arg> {
        self.items
            .iter_mut()
            .find(|a| a.as_ref().is_some_and(&pick))
            .and_then(Option::take)
    }

    /// `key = value`. A call named after the key (`boost(...)` for `boost`) is what a positional
    /// argument repeating it looks like.
    fn keyed(&mut self, key: &'static str) -> Option<Value> {
        let arg = self.take(|a| a.key.as_ref().is_some_and(|(k, _)| k == key))?;
        self.fill(
            key,
            &arg,
            move |v| matches!(v, Value::Call { name, .. } if name == key),
        );
        Some(arg.value)
    }

    /// The first positional argument accepted by `accept`.
    fn positional(&mut self, accept: impl Fn(&Value) -> bool) -> Option<Value> {
        self.take(|a| a.key.is_none() && accept(&a.value))
            .map(|a| a.value)
    }

    /// `key = value`, else the first positional argument accepted by `accept`.
    fn keyed_or(
        &mut self,
        key: &'static str,
        accept: impl Fn(&Value) -> bool + Copy + 'static,
    ) -> Option<Value> {
        let arg = self
            .take(|a| a.key.as_ref().is_some_and(|(k, _)| k == key))
            .or_else(|| self.take(|a| a.key.is_none() && accept(&a.value)))?;
        self.fill(key, &arg, accept);
        Some(arg.value)
    }

    /// A flag such as `symmetric` (alone, or `symmetric = true|false`); the span of the flag when set.
    fn flag(&mut self, name: &'static str) -> Result<Option<Range<usize>>, SpecError> {
        let is_flag = move |v: &Value| matches!(v, Value::Word { name: w, .. } if w == name);
        let taken = self
            .take(|a| a.key.as_ref().is_some_and(|(k, _)| k == name))
            .or_else(|| self.take(|a| a.key.is_none() && is_flag(&a.value)));
        let Some(arg) = taken else {
            return Ok(None);
        };
        self.fill(name, &arg, is_flag);
        let Some((_, key_span)) = arg.key else {
            return Ok(Some(arg.value.span()));
        };
        match arg.value {
            Value::Word { name: w, span } if w == "true" => Ok(Some(key_span.start..span.end)),
            Value::Word { name: w, .. } if w == "false" => Ok(None),
            other => Err(SpecError::new(
                other.span(),
                format!("`{name}` is a flag: write `{name}` alone or `{name} = true|false`"),
            )),
        }
    }

    /// The first positional word left over (a misspelt flag or kind, usually).
    fn stray_word(&mut self) -> Option<Value> {
        self.positional(|v| matches!(v, Value::Word { .. }))
    }

    /// Rejects keys that the chosen variant of a call (`codebook(additive, ...)`) does not take.
    fn only(&self, keys: &[&str], variant: &str) -> Result<(), SpecError> {
        for (k, span) in self.items.iter().flatten().filter_map(|a| a.key.as_ref()) {
            if !keys.contains(&k.as_str()) {
                return Err(SpecError::new(
                    span.clone(),
                    format!(
                        "`{k}` does not apply to {variant}; its keys are: {}",
                        keys.join(", ")
                    ),
                ));
            }
        }
        Ok(())
    }

    /// `what needs key`, reported on the whole call.
    fn missing(&self, key: &str, hint: &str) -> SpecError {
        SpecError::new(
            self.call_span.clone(),
            format!("{} needs `{key}` ({hint})", self.what),
        )
    }

    /// Reports the first argument nothing consumed.
    ///
    /// A leftover positional argument that a key already given would have taken is that key given
    /// twice: a word (words name one key's values only: `channel`, `symmetric`), or a number when the
    /// key was also given by name (`int(2, channel, bits = 4)`). The message points at whichever of
    /// the two comes second.
    fn finish(self) -> Result<(), SpecError> {
        let leftover = self.items.into_iter().flatten().next();
        if let Some(Arg { key: None, value }) = &leftover {
            let twice = self
                .filled
                .iter()
                .find(|f| (f.accepts)(value) && (f.by_key || matches!(value, Value::Word { .. })));
            if let Some(f) = twice {
                let at = if f.span.start > value.span().start {
                    f.span.clone()
                } else {
                    value.span()
                };
                return Err(SpecError::new(
                    at,
                    format!("`{}` is given twice in {}", f.key, self.what),
                ));
            }
        }
        match leftover {
            None => Ok(()),
            Some(Arg {
                key: None,
                value: Value::Call { name, span, .. },
            }) if self.allowed.contains(&name.as_str()) => Err(SpecError::new(
                span,
                format!("`{name}(...)` needs its key here: write `{name} = {name}(...)`"),
            )),
            Some(arg) => Err(SpecError::new(
                arg.key.map_or(arg.value.span(), |(_, s)| s),
                format!(
                    "unexpected {} in {}; expected one of: {}",
                    arg.value.quoted(),
                    self.what,
                    self.allowed.join(", ")
                ),
            )),
        }
    }
}

/// The digits of a number value (`_` removed), or an error naming the key that wanted a number.
fn number_text<'v>(v: &'v Value, what: &str) -> Result<&'v str, SpecError> {
    match v {
        Value::Number { text, .. } => Ok(text),
        other => Err(SpecError::new(
            other.span(),
            format!("`{what}` must be a number, got {}", other.quoted()),
        )),
    }
}

/// The exact value of number text (`-12`, `2.0`, `1.5e1`, `+0`) when it is a whole number below
/// 10^30 in magnitude; `None` when it has a fractional part or is larger.
///
/// Read from the digits, not through `f64`: `1e-400` underflows an `f64` to 0 and
/// `2.0000000000000001` rounds to 2, and neither is a whole number.
pub(crate) fn exact_whole(text: &str) -> Option<i128> {
    const MAX_DIGITS: i64 = 30;
    let (negative, unsigned) = match text.as_bytes().first() {
        Some(b'-') => (true, &text[1..]),
        Some(b'+') => (false, &text[1..]),
        _ => (false, text),
    };
    let (mantissa, exponent) = match unsigned.find(['e', 'E']) {
        Some(i) => (&unsigned[..i], &unsigned[i + 1..]),
        None => (unsigned, "0"),
    };
    let (int_part, frac_part) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    let all_digits = |s: &str| s.bytes().all(|b| b.is_ascii_digit());
    if int_part.len() + frac_part.len() == 0 || !all_digits(int_part) || !all_digits(frac_part) {
        return None;
    }
    let (exp_negative, exp_digits) = match exponent.as_bytes().first() {
        Some(b'-') => (true, &exponent[1..]),
        Some(b'+') => (false, &exponent[1..]),
        _ => (false, exponent),
    };
    if exp_digits.is_empty() || !all_digits(exp_digits) {
        return None;
    }
    // Saturating: any exponent past the text's length already decides the answer.
    let exp = exp_digits.bytes().fold(0i64, |e, b| {
        e.saturating_mul(10).saturating_add(i64::from(b - b'0'))
    });
    let exp = if exp_negative { -exp } else { exp };
    // value = significant digits × 10^shift, with the significant digits free of leading and
    // trailing zeros.
    let digits = format!("{int_part}{frac_part}");
    let digits = digits.trim_start_matches('0');
    let significant = digits.trim_end_matches('0');
    if significant.is_empty() {
        return Some(0);
    }
    let trailing = (digits.len() - significant.len()) as i64;
    let shift = exp
        .saturating_sub(frac_part.len() as i64)
        .saturating_add(trailing);
    if shift < 0 || (significant.len() as i64).saturating_add(shift) > MAX_DIGITS {
        return None;
    }
    let mut value: i128 = significant.parse().ok()?;
    for _ in 0..shift {
        value = value.checked_mul(10)?;
    }
    Some(if negative { -value } else { value })
}

/// A number stored as `f32`, read from its digits so that printing and parsing round-trip exactly.
/// Rounds to the nearest `f32` (infinite past its range, for the caller's range check to refuse);
/// `-0` reads as `0`, so equal schemes print, and hash, alike.
fn number_f32(v: &Value, what: &str) -> Result<f32, SpecError> {
    let text = number_text(v, what)?;
    match text.parse::<f32>() {
        Ok(x) => Ok(x + 0.0),
        Err(_) => Err(SpecError::new(
            v.span(),
            format!("`{what}` must be a number, got {}", v.quoted()),
        )),
    }
}

/// Which whole numbers in a range a key takes.
#[derive(Clone, Copy)]
enum Step {
    Any,
    MultipleOf(u32),
    PowerOfTwo,
}

/// The values an integer key takes. The error message is written from the same rule the check
/// applies, so the range it prints is the range accepted.
struct Whole {
    min: u32,
    max: u32,
    step: Step,
    /// Why the step, when there is one.
    why: Option<String>,
}

impl Whole {
    fn range(min: u32, max: u32) -> Self {
        Self {
            min,
            max,
            step: Step::Any,
            why: None,
        }
    }

    /// Positive multiples of `unit` up to `max`.
    fn multiples(unit: u32, max: u32, why: String) -> Self {
        Self {
            min: unit,
            max: max - max % unit,
            step: Step::MultipleOf(unit),
            why: Some(why),
        }
    }

    fn powers_of_two(min: u32, max: u32, why: &str) -> Self {
        Self {
            min,
            max,
            step: Step::PowerOfTwo,
            why: Some(why.into()),
        }
    }

    /// `n` as a `u32` when the rule takes it.
    fn accept(&self, n: i128) -> Option<u32> {
        let n = u32::try_from(n).ok()?;
        let on_step = match self.step {
            Step::Any => true,
            Step::MultipleOf(unit) => n % unit == 0,
            Step::PowerOfTwo => n.is_power_of_two(),
        };
        ((self.min..=self.max).contains(&n) && on_step).then_some(n)
    }

    fn describe(&self) -> String {
        let (min, max) = (self.min, self.max);
        let what = match self.step {
            Step::Any => format!("a whole number in {min}..={max}"),
            Step::MultipleOf(unit) => format!("a multiple of {unit} in {min}..={max}"),
            Step::PowerOfTwo => format!("a power of two in {min}..={max}"),
        };
        match &self.why {
            Some(why) => format!("{what} ({why})"),
            None => what,
        }
    }
}

fn integer(v: &Value, what: &str, rule: &Whole) -> Result<u32, SpecError> {
    let text = number_text(v, what)?;
    exact_whole(text)
        .and_then(|n| rule.accept(n))
        .ok_or_else(|| {
            SpecError::new(
                v.span(),
                format!("`{what}` must be {}, got {}", rule.describe(), v.quoted()),
            )
        })
}

/// The code widths `int(...)` supports.
const INT_BITS: [i128; 5] = [1, 2, 3, 4, 8];

/// The code width of `int(...)`: one message for every wrong value, whatever its kind.
fn int_bits(v: &Value) -> Result<u8, SpecError> {
    let exact = match v {
        Value::Number { text, .. } => exact_whole(text),
        _ => None,
    };
    match exact {
        Some(n) if INT_BITS.contains(&n) => Ok(n as u8),
        _ => Err(SpecError::new(
            v.span(),
            format!("`bits` must be 1, 2, 3, 4 or 8, got {}", v.quoted()),
        )),
    }
}

fn word<'v>(v: &'v Value, what: &str, choices: &[&str]) -> Result<&'v str, SpecError> {
    match v {
        Value::Word { name, .. } if choices.contains(&name.as_str()) => Ok(name),
        other => Err(SpecError::new(
            other.span(),
            format!(
                "`{what}` must be one of: {}; got {}",
                choices.join(", "),
                other.quoted()
            ),
        )),
    }
}

fn is_number(v: &Value) -> bool {
    matches!(v, Value::Number { .. })
}

fn is_word(v: &Value, names: &[&str]) -> bool {
    matches!(v, Value::Word { name, .. } if names.contains(&name.as_str()))
}

/// `name(...)` (or the bare word `name`, which is `name()`), one of `names`.
fn call(
    v: Value,
    what: &str,
    names: &[&str],
) -> Result<(String, Range<usize>, Vec<Arg>), SpecError> {
    match v {
        Value::Call { name, span, args } if names.contains(&name.as_str()) => {
            Ok((name, span, args))
        }
        Value::Word { name, span } if names.contains(&name.as_str()) => {
            Ok((name, span, Vec::new()))
        }
        other => Err(SpecError::new(
            other.span(),
            format!(
                "`{what}` must be {}, got {}",
                names
                    .iter()
                    .map(|n| format!("`{n}(...)`"))
                    .collect::<Vec<_>>()
                    .join(" or "),
                other.quoted()
            ),
        )),
    }
}

/// Codes per 32-bit word for a bit width; 3-bit codes are stored as a 2-bit and a 1-bit plane, so
/// they pack 32 to a group of words.
pub(crate) fn packing_width(bits: u8) -> u32 {
    match bits {
        0 | 3 => 32,
        b => 32 / b as u32,
    }
}

/// Tokens a page must be a multiple of: the attention kernels tile a page 16 tokens at a time.
const PAGE_TILE: u32 = 16;

/// A parsed tensor, with the spans that scheme-wide checks point at.
struct Tensor {
    quant: TensorQuant,
    span: Range<usize>,
    /// The `group = N` value of a channel-axis `int(...)` (that group is the page).
    group: Option<(u32, Range<usize>)>,
    /// The `boost = ...` argument.
    boost: Option<Range<usize>>,
}

fn tensor(v: Value, which: &'static str) -> Result<Tensor, SpecError> {
    let span = v.span();
    let plain = |quant| Tensor {
        quant,
        span: span.clone(),
        group: None,
        boost: None,
    };
    let (name, call_span, args) = match v {
        Value::Word { name, .. } if name == "fp16" => return Ok(plain(TensorQuant::Fp16)),
        Value::Call { name, span, args } if name == "int" || name == "codebook" => {
            (name, span, args)
        }
        Value::Word { name, span } if name == "int" || name == "codebook" => {
            (name, span, Vec::new())
        }
        other => {
            return Err(SpecError::new(
                other.span(),
                format!(
                    "`{which}` must be `fp16`, `int(...)` or `codebook(...)`, got {}",
                    other.quoted()
                ),
            ))
        }
    };
    if name == "int" {
        int_quant(call_span, args)
    } else {
        codebook(call_span, args, which).map(|c| plain(TensorQuant::Codebook(c)))
    }
}

fn int_quant(span: Range<usize>, args: Vec<Arg>) -> Result<Tensor, SpecError> {
    const KEYS: &[&str] = &["bits", "axis", "group", "symmetric", "boost", "local"];
    let mut a = Args::new("int(...)", span.clone(), args, KEYS)?;
    let bits_v = a
        .keyed_or("bits", is_number)
        .ok_or_else(|| a.missing("bits", "1, 2, 3, 4 or 8"))?;
    let bits = int_bits(&bits_v)?;
    let symmetric = a.flag("symmetric")?;
    // Once the flags are taken, any positional word is meant as the axis: a misspelt axis is
    // reported as a bad axis rather than as a missing one.
    let axis_v = a
        .keyed_or("axis", |v| is_word(v, &["channel", "token"]))
        .or_else(|| a.stray_word())
        .ok_or_else(|| a.missing("axis", "channel or token"))?;
    let axis = match word(&axis_v, "axis", &["channel", "token"])? {
        "channel" => Axis::Channel,
        _ => Axis::Token,
    };
    let group = match a.keyed("group") {
        Some(v) => {
            let rule = match axis {
                Axis::Channel => Whole::multiples(
                    PAGE_TILE,
                    MAX_TOKENS,
                    "a channel-axis group is one page, and pages are tiled 16 tokens at a time"
                        .into(),
                ),
                Axis::Token => {
                    let unit = packing_width(bits);
                    Whole::multiples(
                        unit,
                        MAX_TOKENS,
                        format!("{bits}-bit codes are packed {unit} together in 32-bit words"),
                    )
                }
            };
            Some((integer(&v, "group", &rule)?, v.span()))
        }
        None => None,
    };
    let local = match a.keyed("local") {
        Some(v) => Some(integer(&v, "local", &Whole::range(0, MAX_TOKENS))?),
        None => None,
    };
    let (boost, boost_span) = match a.keyed("boost") {
        Some(v) => {
            let s = v.span();
            (Some(boost(v, bits, axis)?), Some(s))
        }
        None => (None, None),
    };
    if let (Some(flag), 1) = (&symmetric, bits) {
        return Err(SpecError::new(
            flag.clone(),
            "1-bit codes cannot be symmetric (a symmetric code has no level but zero); drop `symmetric`",
        ));
    }
    a.finish()?;
    let quant = IntQuant {
        bits,
        axis,
        group: group.as_ref().map(|(g, _)| *g),
        symmetric: symmetric.is_some(),
        boost,
        local,
    };
    Ok(Tensor {
        quant: TensorQuant::Int(quant),
        span,
        group: group.filter(|_| axis == Axis::Channel),
        boost: boost_span,
    })
}

/// Bit widths of the planes boosted codes are stored in: the base plane and the high plane each
/// take one of these.
const PLANE_BITS: [u8; 3] = [1, 2, 4];

/// The boosted width: the base plus a high plane, both of [`PLANE_BITS`].
fn boost_bits(v: &Value, base_bits: u8) -> Result<u8, SpecError> {
    let text = number_text(v, "bits")?;
    let exact = exact_whole(text);
    if let Some(n) = exact.filter(|&n| n <= i128::from(base_bits)) {
        return Err(SpecError::new(
            v.span(),
            format!("boost bits ({n}) must exceed the tensor's base bits ({base_bits})"),
        ));
    }
    if !PLANE_BITS.contains(&base_bits) {
        return Err(SpecError::new(
            v.span(),
            format!(
                "boosted codes are stored as a base plane plus a high plane, each 1, 2 or 4 bits: \
                 {base_bits}-bit codes cannot be boosted"
            ),
        ));
    }
    let choices = PLANE_BITS.map(|high| base_bits + high);
    match exact {
        Some(n) if choices.iter().any(|&c| i128::from(c) == n) => Ok(n as u8),
        _ => Err(SpecError::new(
            v.span(),
            format!(
                "boost `bits` must be {}, {} or {} (a {base_bits}-bit base plane plus a 1-, 2- or \
                 4-bit high plane), got {}",
                choices[0],
                choices[1],
                choices[2],
                v.quoted()
            ),
        )),
    }
}

fn boost(v: Value, base_bits: u8, axis: Axis) -> Result<Boost, SpecError> {
    let (_, span, args) = call(v, "boost", &["boost"])?;
    let mut a = Args::new("boost(...)", span.clone(), args, &["bits", "ratio", "by"])?;
    if axis != Axis::Channel {
        return Err(SpecError::new(
            span,
            "channel boost needs `axis = channel` (per-channel scales); token-axis tensors have no channels to boost",
        ));
    }
    let bits_v = a
        .keyed_or("bits", is_number)
        .ok_or_else(|| a.missing("bits", "the boosted channels' bit width"))?;
    let bits = boost_bits(&bits_v, base_bits)?;
    let ratio_v = a
        .keyed_or("ratio", is_number)
        .ok_or_else(|| a.missing("ratio", "the fraction of channels boosted per page"))?;
    let ratio = number_f32(&ratio_v, "ratio")?;
    if !(ratio > 0.0 && ratio < 1.0) {
        return Err(SpecError::new(
            ratio_v.span(),
            format!(
                "boost `ratio` must lie strictly between 0 and 1, got {}",
                ratio_v.quoted()
            ),
        ));
    }
    let by = match a.keyed_or("by", |v| is_word(v, &["magnitude", "variance"])) {
        Some(v) => match word(&v, "by", &["magnitude", "variance"])? {
            "magnitude" => BoostCriterion::Magnitude,
            _ => BoostCriterion::Variance,
        },
        None => BoostCriterion::Magnitude,
    };
    a.finish()?;
    Ok(Boost { bits, ratio, by })
}

fn codebook(span: Range<usize>, args: Vec<Arg>, which: &str) -> Result<CodebookQuant, SpecError> {
    const KEYS: &[&str] = &[
        "rope_commutative",
        "additive",
        "levels",
        "residuals",
        "pairs_per_code",
        "rows",
        "span",
    ];
    let mut a = Args::new("codebook(...)", span.clone(), args, KEYS)?;
    let rope = a.flag("rope_commutative")?;
    let additive = a.flag("additive")?;
    let span_kind = match a.keyed("span") {
        Some(v) => match word(&v, "span", &["head", "token"])? {
            "head" => CodebookSpan::Head,
            _ => CodebookSpan::Token,
        },
        None => CodebookSpan::Head,
    };
    let codebook = match (rope, additive) {
        (Some(flag), None) => {
            if which == "v" {
                return Err(SpecError::new(
                    flag,
                    "a RoPE-commutative codebook is for keys (values carry no RoPE); use `codebook(additive, ...)` for `v`",
                ));
            }
            a.only(
                &["levels", "residuals", "pairs_per_code", "span"],
                "codebook(rope_commutative, ...)",
            )?;
            let levels_v = a
                .keyed("levels")
                .ok_or_else(|| a.missing("levels", "codebook entries per residual round"))?;
            let levels = integer(
                &levels_v,
                "levels",
                &Whole::powers_of_two(2, 1 << 16, "codes are whole bits"),
            )?;
            let residuals_v = a
                .keyed("residuals")
                .ok_or_else(|| a.missing("residuals", "residual rounds"))?;
            let residuals = integer(&residuals_v, "residuals", &Whole::range(1, 64))?;
            let pairs_v = a
                .keyed("pairs_per_code")
                .ok_or_else(|| a.missing("pairs_per_code", "RoPE pairs sharing one code"))?;
            let pairs_per_code = integer(&pairs_v, "pairs_per_code", &Whole::range(1, 1024))?;
            let cb = Codebook::RopeCommutative {
                levels,
                residuals,
                pairs_per_code,
            };
            let bits = cb.bits_per_scalar(0);
            if bits >= 16.0 {
                return Err(SpecError::new(
                    span.clone(),
                    format!(
                        "this codebook spends {residuals}·log2({levels})/{pairs_per_code} = {bits} bits \
                         per scalar: no compression over fp16"
                    ),
                ));
            }
            cb
        }
        (None, Some(_)) => {
            a.only(&["rows", "span"], "codebook(additive, ...)")?;
            let rows_v = a
                .keyed("rows")
                .ok_or_else(|| a.missing("rows", "binary code bits per vector"))?;
            let rows = integer(
                &rows_v,
                "rows",
                &Whole::multiples(32, 1 << 16, "binary codes pack into 32-bit words".into()),
            )?;
            Codebook::Additive { rows }
        }
        (Some(_), Some(second)) => {
            return Err(SpecError::new(
                second,
                "a codebook is either `rope_commutative` or `additive`, not both",
            ))
        }
        (None, None) => {
            let (at, got) = match a.stray_word() {
                Some(w) => (w.span(), format!(", got {}", w.quoted())),
                None => (span, String::new()),
            };
            return Err(SpecError::new(
                at,
                format!("name the codebook kind: `rope_commutative` or `additive`{got}"),
            ));
        }
    };
    a.finish()?;
    Ok(CodebookQuant {
        codebook,
        span: span_kind,
    })
}

fn calibration(v: Value) -> Result<(Calibration, Range<usize>), SpecError> {
    let (_, span, args) = call(v, "calibrate", &["calibrate"])?;
    let mut a = Args::new("calibrate(...)", span.clone(), args, &["tau1", "tau2"])?;
    let mut tau = |key: &'static str| -> Result<f32, SpecError> {
        let v = a
            .keyed(key)
            .ok_or_else(|| a.missing(key, "a score offset, fixed per model"))?;
        let x = number_f32(&v, key)?;
        if x.abs() > MAX_TAU {
            return Err(SpecError::new(
                v.span(),
                format!(
                    "`{key}` must lie within ±{MAX_TAU} (it shifts pre-softmax scores), got {}",
                    v.quoted()
                ),
            ));
        }
        Ok(x)
    };
    let tau1 = tau("tau1")?;
    let tau2 = tau("tau2")?;
    a.finish()?;
    Ok((Calibration { tau1, tau2 }, span))
}

fn source(v: Value) -> Result<CacheSource, SpecError> {
    let (span, args) = match v {
        Value::Word { name, .. } if name == "kv" => return Ok(CacheSource::Kv),
        Value::Word { name, span } if name == "x" => (span, Vec::new()),
        Value::Call { name, span, args } if name == "x" => (span, args),
        other => {
            return Err(SpecError::new(
                other.span(),
                format!(
                    "`source` must be `kv` or `x(latent|cross_layer)`, got {}",
                    other.quoted()
                ),
            ))
        }
    };
    let mut a = Args::new("x(...)", span.clone(), args, &["latent", "cross_layer"])?;
    let latent = a.flag("latent")?;
    let cross = a.flag("cross_layer")?;
    let form = match (latent, cross) {
        (Some(_), None) => XSource::Latent,
        (None, Some(_)) => XSource::CrossLayer,
        (Some(_), Some(second)) => {
            return Err(SpecError::new(
                second,
                "name one cached form: `latent` or `cross_layer`, not both",
            ))
        }
        (None, None) => {
            let at = a.stray_word().map_or(span, |w| w.span());
            return Err(SpecError::new(
                at,
                "name the cached form: `source = x(latent)` or `source = x(cross_layer)`",
            ));
        }
    };
    a.finish()?;
    Ok(CacheSource::X(form))
}

/// Builds a scheme from the parsed items.
pub(crate) fn scheme(items: Vec<Arg>, text_len: usize) -> Result<SchemeSpec, SpecError> {
    const KEYS: &[&str] = &["k", "v", "page", "sink", "local", "calibrate", "source"];
    let mut a = Args::new("the scheme", 0..text_len, items, KEYS)?;
    let hint = "fp16, int(...) or codebook(...)";
    let k = tensor(a.keyed("k").ok_or_else(|| a.missing("k = ...", hint))?, "k")?;
    let v = tensor(a.keyed("v").ok_or_else(|| a.missing("v = ...", hint))?, "v")?;
    let mut tokens =
        |key: &'static str, rule: &Whole| -> Result<Option<(u32, Range<usize>)>, SpecError> {
            match a.keyed(key) {
                Some(v) => Ok(Some((integer(&v, key, rule)?, v.span()))),
                None => Ok(None),
            }
        };
    let page_given = tokens(
        "page",
        &Whole::multiples(
            PAGE_TILE,
            MAX_TOKENS,
            "the attention kernels tile a page 16 tokens at a time".into(),
        ),
    )?;
    let sink = tokens("sink", &Whole::range(0, MAX_TOKENS))?.map_or(0, |(n, _)| n);
    let local = tokens("local", &Whole::range(0, MAX_TOKENS))?.map_or(0, |(n, _)| n);
    let calibrate = match a.keyed("calibrate") {
        Some(v) => Some(calibration(v)?),
        None => None,
    };
    let source = match a.keyed("source") {
        Some(v) => source(v)?,
        None => CacheSource::Kv,
    };
    a.finish()?;

    // A channel-axis group is exactly one page: every group given must agree with the page.
    let mut page = page_given.clone();
    for t in [&k, &v] {
        let Some((g, g_span)) = &t.group else {
            continue;
        };
        match &page {
            Some((p, _)) if p != g => {
                return Err(SpecError::new(
                    g_span.clone(),
                    format!(
                    "a channel-axis group is one page: `group = {g}` but the page is {p} tokens"
                ),
                ))
            }
            _ => page = Some((*g, g_span.clone())),
        }
    }
    // `page` and a channel-axis `group` were both read as positive multiples of the page tile.
    let page = page.map_or(DEFAULT_PAGE, |(p, _)| p);
    if let Some((_, span)) = &calibrate {
        if !k.quant.is_quantized() {
            return Err(SpecError::new(
                span.clone(),
                "`calibrate` corrects the scores of quantized keys, but `k = fp16`",
            ));
        }
    }
    if let CacheSource::X(_) = source {
        for (t, name) in [(&k, "k"), (&v, "v")] {
            if !matches!(t.quant, TensorQuant::Int(_)) {
                return Err(SpecError::new(
                    t.span.clone(),
                    format!("`source = x(...)` caches integer-quantized activations: `{name}` must be `int(...)`"),
                ));
            }
            if let Some(b) = &t.boost {
                return Err(SpecError::new(
                    b.clone(),
                    "channel boost is not defined for cached activations (`source = x(...)`)",
                ));
            }
        }
    }
    // Normal form: a channel-axis group is the page, so only the page records it.
    let normalise = |t: Tensor| match t.quant {
        TensorQuant::Int(q) if q.axis == Axis::Channel => {
            TensorQuant::Int(IntQuant { group: None, ..q })
        }
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

#[cfg(test)]
mod tests {
    use super::exact_whole;

    #[test]
    fn exact_whole_reads_every_spelling_of_a_whole_number() {
        for n in [0i128, 1, 7, 10, 32, 1000, 123_456_789, 10i128.pow(29)] {
            let d = n.to_string();
            let spellings = [
                d.clone(),
                format!("+{d}"),
                format!("{d}.000"),
                format!("{d}e0"),
                format!("{d}0e-1"),
                format!("{d}E+0"),
                format!("0{d}"),
                format!(".{d}e{}", d.len()),
                format!("{d}00000e-5"),
            ];
            for s in spellings {
                assert_eq!(exact_whole(&s), Some(n), "{s}");
                if !s.starts_with('+') {
                    assert_eq!(exact_whole(&format!("-{s}")), Some(-n), "-{s}");
                }
            }
        }
        for s in [
            "0.5",
            "1e-400",
            "1.0000000000000001",
            "123e-3",
            "1e30",
            "1e99999999999999999999999",
            "1e-99999999999999999999999",
            ".",
            "e5",
            "1e",
            "1e+",
            "1.2.3",
            "",
            "-",
        ] {
            assert_eq!(exact_whole(s), None, "{s}");
        }
        for s in ["0e999999999999999999999999", "-0", "0.000e-400", "000"] {
            assert_eq!(exact_whole(s), Some(0), "{s}");
        }
    }
}
