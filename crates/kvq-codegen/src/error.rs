//! Why a kernel could not be generated.

/// Errors of source generation (no I/O, no GPU involved).
#[derive(Debug, thiserror::Error)]
pub enum CodegenError {
    /// The scheme and shape are valid, but this kernel family does not implement them yet.
    #[error("no {family} kernel for {what}")]
    Unsupported { family: &'static str, what: String },
    /// The shape or tuning parameters are out of range.
    #[error("invalid kernel shape: {0}")]
    Shape(String),
    #[error(transparent)]
    SchemeShape(#[from] kvq_spec::ShapeError),
    #[error(transparent)]
    Layout(#[from] kvq_reference::RefError),
    /// A template failed to render: a bug in kvq, reported with Tera's full chain of causes.
    #[error("template {template}: {message}")]
    Template { template: String, message: String },
}

impl CodegenError {
    pub(crate) fn template(template: &str, err: tera::Error) -> Self {
        let mut message = err.to_string();
        let mut source = std::error::Error::source(&err);
        while let Some(s) = source {
            message.push_str(": ");
            message.push_str(&s.to_string());
            source = s.source();
        }
        CodegenError::Template {
            template: template.to_string(),
            message,
        }
    }
}
