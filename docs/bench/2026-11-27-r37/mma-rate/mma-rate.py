"""Issue rates of mma.sync shapes on one GPU (mma-rate.cu). Here: `python3 mma-rate.py build`
compiles mma-rate.cu with NVRTC for sm_90a into mma-rate.cubin (needs libnvrtc, no GPU). There:
`python3 mma-rate.py run` times each kernel with CUDA events (libcuda only) and prints, per
kernel, warp instructions a cycle per SM (SM clock from the driver)."""
import ctypes, os, struct, sys

HERE = os.path.dirname(os.path.abspath(__file__))
CHAINS, ITERS = 4, 4096
KERNELS = [("hmma_16816", CHAINS), ("imma_16832", CHAINS), ("bmma_168128", CHAINS), ("bmma_168256", CHAINS), ("lop3_and", 4 * CHAINS)]


def build():
    lib = None
    for d in os.environ.get("LD_LIBRARY_PATH", "").split(":"):
        p = os.path.join(d, "libnvrtc.so.13")
        if os.path.exists(p):
            lib = ctypes.CDLL(p)
    lib = lib or ctypes.CDLL("libnvrtc.so.13")
    src = open(os.path.join(HERE, "mma-rate.cu"), "rb").read()
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src, b"mma-rate.cu", 0, None, None) == 0
    opts = [b"--gpu-architecture=sm_90a"]
    arr = (ctypes.c_char_p * len(opts))(*opts)
    rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
    n = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
    log = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc:
        sys.exit(log.value.decode())
    lib.nvrtcGetCUBINSize(prog, ctypes.byref(n))
    cubin = ctypes.create_string_buffer(n.value)
    lib.nvrtcGetCUBIN(prog, cubin)
    open(os.path.join(HERE, "mma-rate.cubin"), "wb").write(cubin.raw)
    print("wrote mma-rate.cubin", n.value, "bytes")


def run():
    cu = ctypes.CDLL("libcuda.so.1")

    def ck(r, what):
        if r:
            sys.exit(f"{what}: CUDA error {r}")

    ck(cu.cuInit(0), "init")
    dev = ctypes.c_int()
    ck(cu.cuDeviceGet(ctypes.byref(dev), 0), "device")
    name = ctypes.create_string_buffer(100)
    cu.cuDeviceGetName(name, 100, dev)
    sms, clk = ctypes.c_int(), ctypes.c_int()
    cu.cuDeviceGetAttribute(ctypes.byref(sms), 16, dev)   # multiprocessor count
    cu.cuDeviceGetAttribute(ctypes.byref(clk), 13, dev)   # clock rate, kHz
    ctx = ctypes.c_void_p()
    ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "context")
    ck(cu.cuCtxSetCurrent(ctx), "current")
    mod = ctypes.c_void_p()
    ck(cu.cuModuleLoadData(ctypes.byref(mod), open(os.path.join(HERE, "mma-rate.cubin"), "rb").read()), "load")
    threads, blocks_per_sm = 256, 4          # 32 warps an SM: 8 a scheduler
    grid = sms.value * blocks_per_sm
    out = ctypes.c_uint64()
    ck(cu.cuMemAlloc_v2(ctypes.byref(out), grid * threads * 4), "alloc")
    start, stop = ctypes.c_void_p(), ctypes.c_void_p()
    cu.cuEventCreate(ctypes.byref(start), 0)
    cu.cuEventCreate(ctypes.byref(stop), 0)
    print(f"{name.value.decode()}: {sms.value} SMs, max SM clock {clk.value / 1e3:.0f} MHz; {grid} CTAs of {threads} threads")
    for kname, per_iter in KERNELS:
        fn = ctypes.c_void_p()
        ck(cu.cuModuleGetFunction(ctypes.byref(fn), mod, kname.encode()), kname)
        arg = ctypes.c_uint64(out.value)
        params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.byref(arg), ctypes.c_void_p))
        times = []
        for rep in range(7):
            cu.cuEventRecord(start, None)
            ck(cu.cuLaunchKernel(fn, grid, 1, 1, threads, 1, 1, 0, None, params, None), "launch")
            cu.cuEventRecord(stop, None)
            ck(cu.cuEventSynchronize(stop), "sync")
            ms = ctypes.c_float()
            cu.cuEventElapsedTime(ctypes.byref(ms), start, stop)
            times.append(ms.value)
        t = sorted(times[1:])[len(times[1:]) // 2] * 1e-3
        warp_instr = grid * (threads // 32) * ITERS * per_iter
        per_sm_cycle = warp_instr / sms.value / (t * clk.value * 1e3)
        print(f"{kname:12s} median {t * 1e6:9.1f} us  {warp_instr / t / 1e12:7.3f} T warp-instr/s  {per_sm_cycle:6.3f} a cycle per SM (at the max clock)")


if __name__ == "__main__":
    {"build": build, "run": run}[sys.argv[1]]()
