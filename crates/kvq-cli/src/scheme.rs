//! `--scheme` arguments: a built-in name or scheme text, resolved to a [`SchemeSpec`] with errors
//! that list the built-ins or point at the offending column.

use kvq::codegen::{has_codebook_kernel, has_decode_kernel, has_xquant_kernel};
use kvq::schemes::{by_name, is_scheme_text, BUILTIN};
use kvq::SchemeSpec;

use crate::error::{CliError, Result};

/// A scheme from the command line.
#[derive(Debug, Clone, PartialEq)]
pub struct Resolved {
    /// The built-in's name, when the argument named one.
    pub name: Option<&'static str>,
    /// The validated scheme.
    pub spec: SchemeSpec,
}

impl Resolved {
    /// The built-in name, or `custom-…` for other scheme text: what tables print
    /// ([`kvq::schemes::label`]).
    pub fn label(&self) -> String {
        kvq::schemes::label(&self.spec)
    }

    /// Whether the integer/FP16 decode and cache kernels cover this scheme
    /// ([`has_decode_kernel`]); codebook and XQuant schemes have their own decodes.
    pub fn has_gpu_kernel(&self) -> bool {
        has_decode_kernel(&self.spec)
    }

    /// Whether `all` selects it for the GPU commands (`kvq tune`): the integer/FP16 kernel or the
    /// codebook one.
    pub fn runs_on_gpu(&self) -> bool {
        self.has_gpu_kernel() || has_codebook_kernel(&self.spec)
    }

    /// Whether any GPU decode serves it: [`runs_on_gpu`](Self::runs_on_gpu)'s, or XQuant's over
    /// its latents (latent and cross-layer schemes; tuned too, but only by name: a step
    /// rebuilds K on tensor cores and takes tens of times FP16's, so `all` leaves them out).
    pub fn decodes_on_gpu(&self) -> bool {
        self.runs_on_gpu() || has_xquant_kernel(&self.spec)
    }
}

fn builtin_names() -> Vec<String> {
    BUILTIN.iter().map(|b| b.name.to_string()).collect()
}

/// Resolves a built-in name (case-insensitive, `_` = `-`) or scheme text.
pub fn resolve(arg: &str) -> Result<Resolved> {
    let arg = arg.trim();
    if let Some(b) = by_name(arg) {
        return Ok(Resolved {
            name: Some(b.name),
            spec: b.spec,
        });
    }
    if !is_scheme_text(arg) {
        return Err(CliError::UnknownScheme {
            name: arg.to_string(),
            builtins: builtin_names(),
        });
    }
    let spec = SchemeSpec::parse(arg).map_err(|e| CliError::Grammar {
        text: arg.to_string(),
        rendered: e.render(arg),
    })?;
    // Scheme text equal to a built-in gets its name, so tables and file names read well.
    let name = BUILTIN.iter().find(|b| b.spec == spec).map(|b| b.name);
    Ok(Resolved { name, spec })
}

/// `all` (every built-in, or every built-in whose decode runs on the GPU when `gpu_only`: not the
/// XQuant ones), or a comma list of built-in names (when `gpu_only`, of any GPU decode, XQuant's
/// included), in the order given, without repeats.
pub fn resolve_list(arg: &str, gpu_only: bool) -> Result<Vec<Resolved>> {
    let pick = |b: &kvq::schemes::Builtin| Resolved {
        name: Some(b.name),
        spec: b.spec,
    };
    if arg.trim().eq_ignore_ascii_case("all") {
        return Ok(BUILTIN
            .iter()
            .map(pick)
            .filter(|r| !gpu_only || r.runs_on_gpu())
            .collect());
    }
    if is_scheme_text(arg) {
        return Ok(vec![resolve(arg)?]);
    }
    let mut out: Vec<Resolved> = Vec::new();
    for name in arg.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let r = resolve(name)?;
        if gpu_only && !r.decodes_on_gpu() {
            return Err(CliError::Unsupported(format!(
                "`{name}` runs in the CPU reference only (no GPU kernel for its family yet); \
                 GPU schemes: {}",
                BUILTIN
                    .iter()
                    .filter(|b| {
                        has_decode_kernel(&b.spec)
                            || has_codebook_kernel(&b.spec)
                            || has_xquant_kernel(&b.spec)
                    })
                    .map(|b| b.name)
                    .collect::<Vec<_>>()
                    .join(", ")
            )));
        }
        if !out.contains(&r) {
            out.push(r);
        }
    }
    if out.is_empty() {
        return Err(CliError::Usage("no scheme selected".into()));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_text_resolve() {
        let r = resolve("Kitty_Pro").unwrap();
        assert_eq!(r.name, Some("kitty-pro"));
        let t = resolve("k = int(2, channel), v = int(2, token), local = 128").unwrap();
        assert_eq!(t.name, Some("kivi2"));
        let c = resolve("k = int(3, channel), v = int(4, token)").unwrap();
        assert_eq!(c.name, None);
        assert!(c.label().starts_with("custom-"));
        assert!(c.has_gpu_kernel());
        assert!(!resolve("commvq2").unwrap().has_gpu_kernel());
    }

    #[test]
    fn unknown_names_list_builtins_and_bad_text_points_at_the_column() {
        let e = resolve("kivi3").unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("kivi3") && msg.contains("kitty-pro"), "{msg}");
        assert_eq!(e.exit_code(), crate::error::EXIT_USAGE);
        let e = resolve("k = int(5, channel), v = fp16").unwrap_err();
        let report = e.report();
        assert!(report.contains("column 9"), "{report}");
        assert!(report.ends_with("          ^"), "{report:?}");
    }

    #[test]
    fn lists_resolve_in_order_and_gpu_only_refuses_cpu_schemes() {
        let all = resolve_list("all", true).unwrap();
        assert_eq!(all.len(), 10);
        assert!(all.iter().all(Resolved::runs_on_gpu));
        assert_eq!(all.iter().filter(|r| !r.has_gpu_kernel()).count(), 2);
        assert_eq!(resolve_list("all", false).unwrap().len(), BUILTIN.len());
        let l = resolve_list("int8, kivi2,int8", true).unwrap();
        assert_eq!(
            l.iter().map(|r| r.name.unwrap()).collect::<Vec<_>>(),
            ["int8", "kivi2"]
        );
        // XQuant by name (tuned by its own tuner), not under `all`.
        let x = resolve_list("xquant2,xquant-cl2", true).unwrap();
        assert!(x.iter().all(|r| r.decodes_on_gpu() && !r.runs_on_gpu()));
        assert!(!all.iter().any(|r| has_xquant_kernel(&r.spec)));
        assert!(resolve_list(" , ", false).is_err());
    }
}
