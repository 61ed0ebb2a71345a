//! The compiled cache kernels of one scheme × head_dim × input dtype.

use cudarc::driver::CudaFunction;
use kvq_codegen::{cache_kernels_with, CacheKernels, Dtype, KernelEntry, QuantizerForms};
use kvq_spec::SchemeSpec;

use crate::error::Result;
use crate::jit::Jit;
use crate::launch::{allow_dynamic_shared, unit_source};
use crate::nvrtc::CompileOptions;

/// A loaded kernel and its launch metadata.
pub(crate) struct Loaded {
    pub f: CudaFunction,
    pub entry: KernelEntry,
}

/// The page quantizers of one tensor.
pub(crate) struct Quantizers {
    pub from_input: Loaded,
    pub from_ring: Loaded,
}

pub(crate) struct CacheFunctions {
    pub generated: CacheKernels,
    pub append: Loaded,
    pub commit: Loaded,
    pub prefill_copy: Loaded,
    pub k: Option<Quantizers>,
    pub v: Option<Quantizers>,
}

impl CacheFunctions {
    pub fn load(
        jit: &Jit,
        spec: &SchemeSpec,
        head_dim: u32,
        dtype: Dtype,
        forms: QuantizerForms,
    ) -> Result<Self> {
        let generated = cache_kernels_with(spec, head_dim, dtype, forms)?;
        let source = unit_source(&generated.append.name, &generated.source);
        let module = jit.module(&source, &CompileOptions::default())?;
        let load = |entry: &KernelEntry| -> Result<Loaded> {
            let f = module.function(&entry.name)?;
            allow_dynamic_shared(&f, entry)?;
            Ok(Loaded {
                f,
                entry: entry.clone(),
            })
        };
        let quantizers = |q: &Option<kvq_codegen::PageQuantizers>| -> Result<Option<Quantizers>> {
            q.as_ref()
                .map(|q| {
                    Ok(Quantizers {
                        from_input: load(&q.from_input)?,
                        from_ring: load(&q.from_ring)?,
                    })
                })
                .transpose()
        };
        Ok(Self {
            append: load(&generated.append)?,
            commit: load(&generated.commit)?,
            prefill_copy: load(&generated.prefill_copy)?,
            k: quantizers(&generated.k_quantizers)?,
            v: quantizers(&generated.v_quantizers)?,
            generated,
        })
    }
}
