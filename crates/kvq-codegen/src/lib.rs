//! CUDA source generation from scheme specs (templates in `templates/`). Filled by the codegen issue.
