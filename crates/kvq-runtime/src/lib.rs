//! NVRTC JIT, module cache, autotuning and the paged GPU cache. Filled by the runtime issues.
