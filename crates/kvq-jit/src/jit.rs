//! The JIT: CUDA source in, loaded kernels out, each module compiled at most once.
//!
//! A [`Jit`] belongs to one [`Device`]. A request (source + options) resolves the NVRTC
//! arguments for the device's architecture and computes the [`CacheKey`]; then
//!
//! 1. **in-process cache**: a module already loaded under that key is returned at once;
//! 2. **disk cache**: otherwise the image is read from the [`DiskCache`] if present and valid;
//! 3. **NVRTC**: otherwise it is compiled (to CUBIN for the exact architecture by default) and
//!    written to the disk cache;
//!
//! and the image is loaded into the device's context. Thread-safe: concurrent requests for the
//! same key compile once (the others wait for it), requests for different keys proceed in
//! parallel. Failed compiles are not cached, so a fixed source or environment is retried.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::CudaFunction;
use serde::{Deserialize, Serialize};

use crate::arch::Arch;
use crate::device::Device;
use crate::disk_cache::{CacheKey, DiskCache, Origin};
use crate::error::Result;
use crate::module::Module;
use crate::nvrtc::{self, CompileOptions, Output, Source};

/// Counters of one [`Jit`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JitStats {
    /// Modules NVRTC compiled.
    pub compiled: u64,
    /// Modules read from the disk cache.
    pub disk_hits: u64,
    /// Requests answered by an already loaded module.
    pub memory_hits: u64,
}

impl std::fmt::Display for JitStats {
    /// `compiled 0 modules (4 cache hits)` — the line a CLI or test prints on a warm start.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let plural = |n: u64| if n == 1 { "" } else { "s" };
        write!(
            f,
            "compiled {} module{} ({} cache hit{}",
            self.compiled,
            plural(self.compiled),
            self.disk_hits,
            plural(self.disk_hits)
        )?;
        if self.memory_hits > 0 {
            write!(f, ", {} in-process", self.memory_hits)?;
        }
        write!(f, ")")
    }
}

type Slot = Arc<Mutex<Option<Arc<Module>>>>;

/// Compiles, caches and loads kernels for one device.
pub struct Jit {
    device: Device,
    disk: Option<DiskCache>,
    output: Output,
    modules: Mutex<HashMap<CacheKey, Slot>>,
    compiled: AtomicU64,
    disk_hits: AtomicU64,
    memory_hits: AtomicU64,
}

impl std::fmt::Debug for Jit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Jit")
            .field("device", &self.device)
            .field("disk_cache", &self.disk.as_ref().map(|d| d.dir()))
            .field("output", &self.output)
            .field("stats", &self.stats())
            .finish()
    }
}

impl Jit {
    /// A JIT for `device` with the disk cache from the environment ([`DiskCache::from_env`]).
    ///
    /// Fails early, with [`JitError::DriverOlderThanNvrtc`](crate::JitError), when the
    /// loaded NVRTC is newer than the driver can load (where NVRTC is unusable, the first compile
    /// says why).
    pub fn new(device: &Device) -> Result<Jit> {
        if let Ok(v) = nvrtc::version() {
            crate::module::check_driver_loads(device.props().driver, v, Output::Cubin)?;
        }
        Ok(Jit::with_disk_cache(device, Some(DiskCache::from_env()?)))
    }

    /// A JIT with the given disk cache (`None`: compile every new module).
    pub fn with_disk_cache(device: &Device, disk: Option<DiskCache>) -> Jit {
        Jit {
            device: device.clone(),
            disk,
            output: Output::Cubin,
            modules: Mutex::new(HashMap::new()),
            compiled: AtomicU64::new(0),
            disk_hits: AtomicU64::new(0),
            memory_hits: AtomicU64::new(0),
        }
    }

    /// Produce PTX (driver-compiled at load) instead of CUBIN.
    pub fn with_output(mut self, output: Output) -> Jit {
        self.output = output;
        self
    }

    /// The device.
    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The architecture modules are compiled for.
    pub fn arch(&self) -> Arch {
        self.device.arch()
    }

    /// The disk cache, if any.
    pub fn disk_cache(&self) -> Option<&DiskCache> {
        self.disk.as_ref()
    }

    /// The counters so far.
    pub fn stats(&self) -> JitStats {
        JitStats {
            compiled: self.compiled.load(Ordering::Relaxed),
            disk_hits: self.disk_hits.load(Ordering::Relaxed),
            memory_hits: self.memory_hits.load(Ordering::Relaxed),
        }
    }

    /// The loaded module for `source` compiled with `options`.
    pub fn module(&self, source: &Source, options: &CompileOptions) -> Result<Arc<Module>> {
        let resolved = options.resolve(self.arch());
        let key = CacheKey::new(source, &resolved, self.output, nvrtc::version()?);
        let slot = {
            let mut modules = self.modules.lock().unwrap_or_else(|p| p.into_inner());
            modules.entry(key.clone()).or_default().clone()
        };
        let mut slot = slot.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(module) = slot.as_ref() {
            self.memory_hits.fetch_add(1, Ordering::Relaxed);
            return Ok(module.clone());
        }
        let compile = || nvrtc::compile_resolved(source, self.output, &resolved);
        let (compiled, origin) = match &self.disk {
            Some(disk) => disk.get_or_compile(&key, self.output, &source.name, compile)?,
            None => (compile()?, Origin::Compiled),
        };
        match origin {
            Origin::DiskCache => self.disk_hits.fetch_add(1, Ordering::Relaxed),
            _ => self.compiled.fetch_add(1, Ordering::Relaxed),
        };
        let module = Arc::new(Module::load(
            &self.device,
            &source.name,
            key,
            &compiled,
            origin,
        )?);
        *slot = Some(module.clone());
        Ok(module)
    }

    /// The kernels `names` of `source`, in order.
    pub fn functions(
        &self,
        source: &Source,
        names: &[&str],
        options: &CompileOptions,
    ) -> Result<Vec<CudaFunction>> {
        let module = self.module(source, options)?;
        names.iter().map(|n| module.function(n)).collect()
    }

    /// The kernel `name` of `source`.
    pub fn function(
        &self,
        source: &Source,
        name: &str,
        options: &CompileOptions,
    ) -> Result<CudaFunction> {
        self.module(source, options)?.function(name)
    }
}
