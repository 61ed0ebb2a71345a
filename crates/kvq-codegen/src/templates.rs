//! The embedded Tera templates (strict: undefined variables are errors; no autoescape).

use crate::CodegenError;
use serde::Serialize;
use std::sync::OnceLock;
use tera::{Context, Tera};

/// The workspace's `templates/` files, each under its path there as its Tera name.
macro_rules! embedded {
    ($($name:literal),* $(,)?) => {
        &[$(($name, include_str!(concat!("../../../templates/", $name)))),*]
    };
}

/// Every template, by name; embedded so nothing reads the source tree at run time.
pub(crate) const TEMPLATES: &[(&str, &str)] = embedded![
    "tensor.cuh.tera",
    "combine.cu.tera",
    "decode.cu.tera",
    "decode_mma.cuh.tera",
    "cache.cu.tera",
    "merge.cu.tera",
    "codebook_sides.cu.tera",
    "codebook_decode.cu.tera",
    "codebook_encode.cu.tera",
    "xquant_decode.cu.tera",
    "xquant_project.cu.tera",
    "xquant_cross_layer.cu.tera",
];

fn engine() -> Result<&'static Tera, CodegenError> {
    static ENGINE: OnceLock<Result<Tera, String>> = OnceLock::new();
    ENGINE
        .get_or_init(|| {
            let mut tera = Tera::default();
            tera.autoescape_on(vec![]);
            tera.add_raw_templates(TEMPLATES.iter().copied())
                .map_err(|e| CodegenError::template("(all)", e).to_string())?;
            Ok(tera)
        })
        .as_ref()
        .map_err(|message| CodegenError::Template {
            template: "(all)".into(),
            message: message.clone(),
        })
}

/// Renders `template` with a typed context.
pub(crate) fn render<T: Serialize>(template: &str, ctx: &T) -> Result<String, CodegenError> {
    let context = Context::from_serialize(ctx).map_err(|e| CodegenError::template(template, e))?;
    engine()?
        .render(template, &context)
        .map_err(|e| CodegenError::template(template, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(name: &str) -> &'static str {
        TEMPLATES
            .iter()
            .find(|(n, _)| *n == name)
            .unwrap_or_else(|| panic!("{name} is not embedded"))
            .1
    }

    /// The tensor-core unit holds no Tera part (its code lives in the headers) and includes each
    /// kvq/decode header once, in the order headers.rs lists them.
    #[test]
    fn decode_mma_unit_includes_each_decode_header_once() {
        let unit = template("decode_mma.cuh.tera");
        assert!(!unit.contains("{% include"), "a Tera part is back");
        let included: Vec<&str> = unit
            .lines()
            .filter_map(|line| line.strip_prefix("#include \""))
            .filter_map(|rest| rest.strip_suffix('"'))
            .filter(|name| name.starts_with("kvq/decode/"))
            .collect();
        let listed: Vec<&str> = crate::headers::KERNEL_HEADERS
            .iter()
            .map(|(name, _)| *name)
            .filter(|name| name.starts_with("kvq/decode/"))
            .collect();
        assert!(!listed.is_empty());
        assert_eq!(included, listed);
    }
}
