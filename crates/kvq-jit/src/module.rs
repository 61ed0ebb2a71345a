//! A compiled image loaded into a device's context, and its kernels.
//!
//! [`Module::load`] hands a PTX or CUBIN image to `cuModuleLoadData` (through cudarc) and turns
//! a refusal into [`JitError::ModuleLoad`] with a hint (the usual cause: a driver older than
//! the NVRTC that built the image). [`Module::function`] looks kernels up by their unmangled
//! (`extern "C"`) names, once each.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::CUresult;
use cudarc::driver::{CudaFunction, CudaModule};
use cudarc::nvrtc::Ptx;

use crate::arch::Arch;
use crate::device::Device;
use crate::disk_cache::{CacheKey, Origin};
use crate::error::{describe_driver_error, JitError, Result};
use crate::nvrtc::Compiled;

/// A loaded module.
#[derive(Debug)]
pub struct Module {
    name: String,
    key: CacheKey,
    arch: Arch,
    origin: Origin,
    module: Arc<CudaModule>,
    functions: Mutex<HashMap<String, CudaFunction>>,
}

impl Module {
    /// Loads `compiled` (built from the source called `name`, cached under `key`) on `device`.
    pub fn load(
        device: &Device,
        name: &str,
        key: CacheKey,
        compiled: &Compiled,
        origin: Origin,
    ) -> Result<Module> {
        check_driver_loads(device.props().driver, compiled.nvrtc, compiled.output)?;
        let module = device
            .context()
            .load_module(Ptx::from_binary(compiled.load_image()))
            .map_err(|e| {
                let (code, description) = describe_driver_error(e);
                let hint = load_hint(e.0, compiled, device, origin);
                JitError::ModuleLoad {
                    module: name.to_string(),
                    arch: compiled.arch,
                    code,
                    description,
                    hint,
                }
            })?;
        Ok(Module {
            name: name.to_string(),
            key,
            arch: compiled.arch,
            origin,
            module,
            functions: Mutex::new(HashMap::new()),
        })
    }

    /// The kernel `name` (declared `extern "C" __global__`).
    pub fn function(&self, name: &str) -> Result<CudaFunction> {
        if name.contains('\0') {
            return Err(JitError::InvalidInput(format!(
                "kernel name {name:?} contains a NUL byte"
            )));
        }
        let mut functions = self.functions.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(f) = functions.get(name) {
            return Ok(f.clone());
        }
        let f = self.module.load_function(name).map_err(|e| {
            if e.0 == CUresult::CUDA_ERROR_NOT_FOUND {
                JitError::FunctionNotFound {
                    module: self.name.clone(),
                    function: name.to_string(),
                }
            } else {
                JitError::driver(format!("cuModuleGetFunction({name})"), e)
            }
        })?;
        functions.insert(name.to_string(), f.clone());
        Ok(f)
    }

    /// The source's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The cache key it was compiled under.
    pub fn key(&self) -> &CacheKey {
        &self.key
    }

    /// The architecture it was compiled for.
    pub fn arch(&self) -> Arch {
        self.arch
    }

    /// Whether NVRTC ran for it or it came from the disk cache.
    pub fn origin(&self) -> Origin {
        self.origin
    }

    /// cudarc's module (for globals and constants).
    pub fn cuda_module(&self) -> &Arc<CudaModule> {
        &self.module
    }
}

/// Whether a driver supporting `driver` can load `output` built by NVRTC `nvrtc`: CUBIN needs a
/// driver of the NVRTC's major version or newer (minor-version compatibility), PTX one of its
/// version or newer (the driver compiles it, and cannot read a newer PTX ISA). Checked before
/// `cuModuleLoadData`, whose own refusal names neither version.
pub(crate) fn check_driver_loads(
    driver: crate::version::DriverVersion,
    nvrtc: crate::version::NvrtcVersion,
    output: crate::nvrtc::Output,
) -> Result<()> {
    let loads = match output {
        crate::nvrtc::Output::Cubin => driver.major >= nvrtc.major,
        crate::nvrtc::Output::Ptx => (driver.major, driver.minor) >= (nvrtc.major, nvrtc.minor),
    };
    if loads {
        Ok(())
    } else {
        Err(JitError::DriverOlderThanNvrtc {
            driver,
            nvrtc,
            output: match output {
                crate::nvrtc::Output::Cubin => "CUBIN",
                crate::nvrtc::Output::Ptx => "PTX",
            },
        })
    }
}

fn load_hint(code: CUresult, compiled: &Compiled, device: &Device, origin: Origin) -> String {
    let image_problem = matches!(
        code,
        CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION
            | CUresult::CUDA_ERROR_NO_BINARY_FOR_GPU
            | CUresult::CUDA_ERROR_INVALID_PTX
            | CUresult::CUDA_ERROR_INVALID_IMAGE
            | CUresult::CUDA_ERROR_INVALID_SOURCE
    );
    if !image_problem {
        return String::new();
    }
    let driver = device.props().driver;
    let mut hint = format!(
        ". The image was built by NVRTC {} for {}; this GPU is {} and the driver supports \
         {driver}. A driver older than the NVRTC cannot load its output: update the driver, or \
         put an NVRTC no newer than the driver first on LD_LIBRARY_PATH",
        compiled.nvrtc,
        compiled.arch,
        device.arch()
    );
    if origin == Origin::DiskCache {
        hint.push_str(
            "; the image came from the disk cache: delete the cache folder (KVQ_CACHE_DIR, or \
             ~/.cache/kvq/modules) if it is stale",
        );
    }
    hint
}

/// Lets kernel `f` (named `name` in messages) take `bytes` of dynamic shared memory: the driver
/// refuses launches whose static plus dynamic shared memory passes 48 KiB until the function's
/// limit is raised, so it is raised for any dynamic amount (head_dim-256 decode kernels with
/// 41–48 KiB of stages beside 8–9 KiB of static arrays failed while it was raised only above
/// 48 KiB of stages).
pub fn allow_dynamic_shared(f: &CudaFunction, name: &str, bytes: u32) -> Result<()> {
    if bytes > 0 {
        let limit = i32::try_from(bytes).map_err(|_| {
            JitError::InvalidInput(format!(
                "{name} asks for {bytes} bytes of shared memory, more than a GPU has"
            ))
        })?;
        f.set_attribute(
            cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            limit,
        )
        .map_err(|e| JitError::driver(format!("allow {bytes} bytes of shared memory for {name}"), e))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvrtc::Output;
    use crate::version::{DriverVersion, NvrtcVersion};

    #[test]
    fn a_driver_older_than_nvrtc_is_a_typed_error() {
        let d = |major, minor| DriverVersion { major, minor };
        let n = |major, minor| NvrtcVersion { major, minor };
        assert!(check_driver_loads(d(13, 0), n(13, 1), Output::Cubin).is_ok());
        assert!(check_driver_loads(d(13, 1), n(13, 1), Output::Ptx).is_ok());
        let e = check_driver_loads(d(13, 0), n(13, 1), Output::Ptx).unwrap_err();
        assert!(e.is_environment(), "{e}");
        let e = check_driver_loads(d(12, 9), n(13, 0), Output::Cubin).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("CUDA 12.9") && text.contains("NVRTC is 13.0") && text.contains("R580"),
            "{text}"
        );
    }
}
