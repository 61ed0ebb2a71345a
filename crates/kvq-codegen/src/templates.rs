//! The embedded Tera templates (strict: undefined variables are errors; no autoescape).

use crate::CodegenError;
use serde::Serialize;
use std::sync::OnceLock;
use tera::{Context, Tera};

/// Every template, by name; embedded so nothing reads the source tree at run time.
pub(crate) const TEMPLATES: &[(&str, &str)] = &[
    (
        "common.cuh.tera",
        include_str!("../../../templates/common.cuh.tera"),
    ),
    (
        "tensor.cuh.tera",
        include_str!("../../../templates/tensor.cuh.tera"),
    ),
    (
        "quantize.cuh.tera",
        include_str!("../../../templates/quantize.cuh.tera"),
    ),
    (
        "quantize_regs.cuh.tera",
        include_str!("../../../templates/quantize_regs.cuh.tera"),
    ),
    (
        "combine.cu.tera",
        include_str!("../../../templates/combine.cu.tera"),
    ),
    (
        "decode.cu.tera",
        include_str!("../../../templates/decode.cu.tera"),
    ),
    (
        "decode_mma.cuh.tera",
        include_str!("../../../templates/decode_mma.cuh.tera"),
    ),
    (
        "cache.cu.tera",
        include_str!("../../../templates/cache.cu.tera"),
    ),
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
