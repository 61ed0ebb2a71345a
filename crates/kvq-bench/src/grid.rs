//! Which shapes and schemes a run covers, parsed from flags.

use kvq::codegen::{has_codebook_kernel, has_decode_kernel, has_xquant_kernel, Dtype};
use kvq::runtime::decode::DecodeOptions;
use kvq::schemes::{by_name, is_scheme_text, label, BUILTIN};
use kvq::SchemeSpec;

use crate::error::{BenchError, Result};

/// One scheme under test.
#[derive(Clone, Debug, PartialEq)]
pub struct Scheme {
    /// What tables, JSON and plots call it: the built-in's name (`fp16`, `kivi2`, …), or
    /// `custom-…` for other scheme text ([`kvq::schemes::label`]).
    pub name: String,
    /// Its spec.
    pub spec: SchemeSpec,
}

impl Scheme {
    fn new(spec: SchemeSpec) -> Scheme {
        Scheme {
            name: label(&spec),
            spec,
        }
    }
}

/// Everything a run measures and how.
#[derive(Clone, Debug)]
pub struct BenchConfig {
    /// Schemes, in table order.
    pub schemes: Vec<Scheme>,
    /// Batch sizes.
    pub batches: Vec<usize>,
    /// Context lengths (tokens per sequence).
    pub contexts: Vec<usize>,
    /// Query heads per sequence.
    pub q_heads: usize,
    /// KV heads per sequence.
    pub kv_heads: usize,
    /// Channels per head.
    pub head_dim: u32,
    /// Width of the layer input XQuant schemes cache the latents of: their latents are
    /// `min(d_model, kv_heads·head_dim)` wide ([`kvq::codegen::xquant_rank`]), which sets the K
    /// rebuild's work a token. Other schemes ignore it.
    pub d_model: usize,
    /// Query/output dtype.
    pub dtype: Dtype,
    /// Untimed runs before each timing.
    pub warmup: usize,
    /// Timed runs per configuration.
    pub runs: usize,
    /// Also tune every shape and time tuned against default.
    pub tune: bool,
    /// Check rows of every output against the CPU reference.
    pub check: bool,
    /// Most device bytes a shape's buffers may take.
    pub memory_budget: u64,
    /// Bytes of the device-to-device copy that measures bandwidth.
    pub copy_bytes: u64,
    /// Device bytes set aside before anything else is allocated, so that every buffer of the run
    /// lands at other addresses. Where buffers land changes some shapes' times by up to 15% on
    /// an H100; timing a comparison at a few pads tells a kernel's change from a change of
    /// placement.
    pub placement_pad: u64,
    /// Seed of the random K/V and queries.
    pub seed: u64,
    /// Measurement switches for the untuned launches (pieces, overlapped launches); the default
    /// runs what the library runs.
    pub launch: DecodeOptions,
}

impl BenchConfig {
    /// The issue's grid: every GPU scheme × B {1, 16} × L {4K, 32K, 128K}, 32 query heads, 8 KV
    /// heads, head_dim 128, f16; XQuant's layer input 4,096 wide (latents of 1,024, a
    /// LLaMA-3.1-8B layer's).
    pub fn standard() -> BenchConfig {
        BenchConfig {
            schemes: gpu_schemes(),
            batches: vec![1, 16],
            contexts: vec![4096, 32_768, 131_072],
            q_heads: 32,
            kv_heads: 8,
            head_dim: 128,
            d_model: 4096,
            dtype: Dtype::F16,
            warmup: 5,
            runs: 30,
            tune: false,
            check: true,
            memory_budget: 60 << 30,
            copy_bytes: 4 << 30,
            placement_pad: 0,
            seed: 2024,
            launch: DecodeOptions::default(),
        }
    }

    /// Query heads per KV head; `Err` unless it divides evenly.
    pub fn gqa(&self) -> Result<u32> {
        if self.kv_heads == 0 || self.q_heads == 0 || self.q_heads % self.kv_heads != 0 {
            return Err(BenchError::Usage(format!(
                "{} query heads are not a positive multiple of {} KV heads",
                self.q_heads, self.kv_heads
            )));
        }
        Ok((self.q_heads / self.kv_heads) as u32)
    }
}

/// The built-in schemes that have GPU kernels: integer and FP16 K/V caches (not codebooks, not
/// layer-input caches). `all` selects these.
pub fn gpu_schemes() -> Vec<Scheme> {
    BUILTIN
        .iter()
        .filter(|b| has_decode_kernel(&b.spec))
        .map(|b| Scheme::new(b.spec))
        .collect()
}

/// The codebook built-ins the GPU runs (CommVQ), selected by name: their caches take the CPU
/// reference's encoder to build, so `all` leaves them out.
pub fn codebook_schemes() -> Vec<Scheme> {
    BUILTIN
        .iter()
        .filter(|b| has_codebook_kernel(&b.spec))
        .map(|b| Scheme::new(b.spec))
        .collect()
}

/// The XQuant built-ins the GPU runs (`source = x(latent)` and XQuant-CL's
/// `x(cross_layer)`), selected by name: each step rebuilds K from the latents on tensor cores,
/// tens of times FP16's step, so `all` leaves them out.
pub fn xquant_schemes() -> Vec<Scheme> {
    BUILTIN
        .iter()
        .filter(|b| has_xquant_kernel(&b.spec))
        .map(|b| Scheme::new(b.spec))
        .collect()
}

/// The schemes of `--schemes`: entries separated by `;`, each `all` (every GPU built-in), a
/// comma list of GPU built-in names, or scheme text (`k = int(1, channel), v = int(1, channel)`,
/// read by the parser the attribute uses). In the order given, without repeats; FP16 comes first
/// when missing, because every row's speedup is measured against it.
pub fn parse_schemes(text: &str) -> Result<Vec<Scheme>> {
    let mut out: Vec<Scheme> = Vec::new();
    for entry in text.split(';').map(str::trim).filter(|e| !e.is_empty()) {
        for scheme in parse_entry(entry)? {
            if !out.contains(&scheme) {
                out.push(scheme);
            }
        }
    }
    if out.is_empty() {
        return Err(BenchError::Usage("no scheme selected".into()));
    }
    if !out.iter().any(|s| s.name == "fp16") {
        if let Some(fp16) = by_name("fp16") {
            out.insert(0, Scheme::new(fp16.spec));
        }
    }
    Ok(out)
}

/// One `;`-separated entry of `--schemes`.
fn parse_entry(entry: &str) -> Result<Vec<Scheme>> {
    if entry.eq_ignore_ascii_case("all") {
        return Ok(gpu_schemes());
    }
    if is_scheme_text(entry) {
        let spec = SchemeSpec::parse(entry)
            .map_err(|e| BenchError::Usage(format!("scheme text:\n{}", e.render(entry))))?;
        return on_gpu(Scheme::new(spec), entry).map(|s| vec![s]);
    }
    entry
        .split(',')
        .map(str::trim)
        .filter(|name| !name.is_empty())
        .map(|name| {
            let builtin = by_name(name).ok_or_else(|| {
                BenchError::Usage(format!(
                    "unknown scheme `{name}`; GPU schemes: {} (or scheme text)",
                    names(&gpu_schemes())
                ))
            })?;
            on_gpu(Scheme::new(builtin.spec), name)
        })
        .collect()
}

/// `scheme`, where a GPU decode kernel covers it: the integer/FP16 decode, the codebook one or
/// XQuant's.
fn on_gpu(scheme: Scheme, given: &str) -> Result<Scheme> {
    if has_decode_kernel(&scheme.spec)
        || has_codebook_kernel(&scheme.spec)
        || has_xquant_kernel(&scheme.spec)
    {
        Ok(scheme)
    } else {
        Err(BenchError::Usage(format!(
            "`{given}` runs in the CPU reference only; GPU schemes: {}, and by name {} and {} (or \
             scheme text of fp16, int(...) and codebook(...) tensors without calibration, or \
             int(...) latents of `source = x(...)`)",
            names(&gpu_schemes()),
            names(&codebook_schemes()),
            names(&xquant_schemes())
        )))
    }
}

fn names(schemes: &[Scheme]) -> String {
    schemes
        .iter()
        .map(|s| s.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

/// A token count: `4096`, `4K`/`4k` (×1024), `1M` (×1024²).
pub fn parse_tokens(text: &str) -> Result<usize> {
    let t = text.trim();
    let (digits, scale) = match t.chars().last() {
        Some('k' | 'K') => (&t[..t.len() - 1], 1024),
        Some('m' | 'M') => (&t[..t.len() - 1], 1024 * 1024),
        _ => (t, 1),
    };
    let n: usize = digits.parse().map_err(|_| {
        BenchError::Usage(format!("`{text}` is not a token count (e.g. 4096 or 4K)"))
    })?;
    if n == 0 {
        return Err(BenchError::Usage("a context of 0 tokens".into()));
    }
    Ok(n * scale)
}

/// A comma-separated list of token counts.
pub fn parse_token_list(text: &str) -> Result<Vec<usize>> {
    text.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(parse_tokens)
        .collect()
}

/// A comma-separated list of positive integers.
pub fn parse_usize_list(text: &str) -> Result<Vec<usize>> {
    text.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|s| match s.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(BenchError::Usage(format!(
                "`{s}` is not a positive integer"
            ))),
        })
        .collect()
}

/// `4096` → `4K`, `131072` → `128K`, other values as they are.
pub fn format_tokens(n: usize) -> String {
    if n >= 1024 && n % 1024 == 0 {
        format!("{}K", n / 1024)
    } else {
        n.to_string()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_gpu_schemes_are_the_eight_integer_and_fp16_builtins() {
        let names: Vec<String> = gpu_schemes().into_iter().map(|s| s.name).collect();
        assert_eq!(
            names,
            [
                "fp16",
                "kivi2",
                "kivi4",
                "kitty",
                "kitty-pro",
                "calibquant1",
                "calibquant2",
                "int8"
            ]
        );
    }

    #[test]
    fn scheme_lists_parse_and_always_include_fp16() {
        let s = parse_schemes("kivi2, int8").unwrap();
        let names: Vec<&str> = s.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["fp16", "kivi2", "int8"]);
        assert_eq!(parse_schemes("ALL").unwrap().len(), 8);
        assert_eq!(parse_schemes("fp16,kivi2,kivi2").unwrap().len(), 2);
        assert!(parse_schemes("nope").is_err());
        // Codebook built-ins by name (their own GPU kernel), not under `all`.
        let c = parse_schemes("commvq2").unwrap();
        assert_eq!(
            c.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(),
            ["fp16", "commvq2"]
        );
        // XQuant built-ins by name (their own GPU kernel), not under `all`.
        let x = parse_schemes("xquant2,kivi2, xquant-cl2").unwrap();
        assert_eq!(
            x.iter().map(|s| s.name.as_str()).collect::<Vec<_>>(),
            ["fp16", "xquant2", "kivi2", "xquant-cl2"]
        );
        assert!(parse_schemes("all")
            .unwrap()
            .iter()
            .all(|s| !has_xquant_kernel(&s.spec)));
        let token_books = "k = fp16, v = codebook(additive, rows = 512, span = token)";
        assert!(parse_schemes(token_books)
            .unwrap_err()
            .to_string()
            .contains("CPU reference"));
        assert!(parse_schemes(" , ").is_err());
    }

    #[test]
    fn scheme_text_takes_a_builtin_name_or_a_stable_custom_label() {
        // Text equal to a built-in is that built-in; other text is labelled by its hash.
        let s = parse_schemes("k = int(2, channel), v = int(2, token), local = 128").unwrap();
        let names: Vec<&str> = s.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names, ["fp16", "kivi2"]);
        let text = "k = int(1, channel), v = int(1, channel), sink = 32, local = 128";
        let mixed = parse_schemes(&format!("kivi2, calibquant1; {text}; kivi2")).unwrap();
        let names: Vec<&str> = mixed.iter().map(|s| s.name.as_str()).collect();
        assert_eq!(names[..3], ["fp16", "kivi2", "calibquant1"]);
        assert_eq!(mixed.len(), 4);
        assert!(names[3].starts_with("custom-"), "{names:?}");
        assert_eq!(mixed[3].spec, SchemeSpec::parse(text).unwrap());
        assert_eq!(parse_schemes(text).unwrap()[1].name, names[3]);
    }

    #[test]
    fn bad_scheme_text_points_at_its_column_and_cpu_only_text_is_refused() {
        let e = parse_schemes("kivi2; k = int(5, channel), v = fp16")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("column 9") && e.contains("k = int(5, channel)"),
            "{e}"
        );
        // XQuant text is timed by its own kernel; text equal to a built-in takes its name.
        let x =
            parse_schemes("k = int(2, channel), v = int(2, token), source = x(latent)").unwrap();
        assert_eq!(x[1].name, "xquant2");
        let e = parse_schemes("k = fp16, v = codebook(additive, rows = 512, span = token)")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("CPU reference only") && e.contains("xquant2, xquant3"),
            "{e}"
        );
        assert!(parse_schemes(" ; ").is_err());
    }

    #[test]
    fn token_counts_parse_with_suffixes() {
        assert_eq!(
            parse_token_list("4K,32k,128K").unwrap(),
            [4096, 32_768, 131_072]
        );
        assert_eq!(parse_tokens("1000").unwrap(), 1000);
        assert_eq!(parse_tokens("1M").unwrap(), 1 << 20);
        assert!(parse_tokens("0").is_err() && parse_tokens("4X").is_err());
        assert_eq!(parse_usize_list("1,16").unwrap(), [1, 16]);
        assert!(parse_usize_list("1,0").is_err());
        assert_eq!(format_tokens(131_072), "128K");
        assert_eq!(format_tokens(1000), "1000");
    }

    #[test]
    fn the_xquant_builtins_are_the_latent_and_cross_layer_ones() {
        let names: Vec<String> = xquant_schemes().into_iter().map(|s| s.name).collect();
        assert_eq!(names, ["xquant2", "xquant3", "xquant4", "xquant-cl2"]);
    }

    #[test]
    fn the_standard_grid_is_the_issue_shape() {
        let c = BenchConfig::standard();
        assert_eq!(c.gqa().unwrap(), 4);
        // XQuant's latents at this shape: min(4096, 8 × 128).
        assert_eq!(
            kvq::codegen::xquant_rank(c.d_model, c.kv_heads, c.head_dim as usize),
            1024
        );
        assert_eq!(c.contexts, [4096, 32_768, 131_072]);
        let mut bad = c.clone();
        bad.q_heads = 30;
        assert!(bad.gqa().is_err());
    }
}
