# Does mma.m16n8k16 (f16 in, f32 acc) keep products of subnormal A and small B exactly?
# Build the kernel first: nvcc -arch=sm_90a -cubin -o mma-probe.cubin mma-probe.cu (or NVRTC);
# then run with python3 next to it. Needs only libcuda and the standard library.
import ctypes, struct, random, sys, os
cu = ctypes.CDLL("libcuda.so.1")
def ck(r, what):
    if r: sys.exit(f"{what}: CUDA error {r}")
ck(cu.cuInit(0), "init"); dev = ctypes.c_int(); ck(cu.cuDeviceGet(ctypes.byref(dev), 0), "dev")
ctx = ctypes.c_void_p(); ck(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "ctx"); ck(cu.cuCtxSetCurrent(ctx), "cur")
mod = ctypes.c_void_p(); img = open(os.path.join(os.path.dirname(__file__), "mma-probe.cubin"), "rb").read()
ck(cu.cuModuleLoadData(ctypes.byref(mod), img), "load"); fn = ctypes.c_void_p(); ck(cu.cuModuleGetFunction(ctypes.byref(fn), mod, b"probe"), "fn")
h = lambda x: struct.unpack("<H", struct.pack("<e", x))[0]
f = lambda b: struct.unpack("<e", struct.pack("<H", b))[0]
random.seed(1)
CASES = 64
A, B = [], []
# rows 0-7: centred codes c-2 as normal f16 (the old path); rows 8-15: raw codes c*2^(pos-24) (subnormal)
# columns n: B magnitudes 2^-E[n], E spanning normal and subnormal f16
E = [0, 4, 8, 12, 14, 16, 20, 23]
codes = []
for cs in range(CASES):
    for row in range(16):
        for k in range(16):
            c = random.randrange(4)
            if row < 8: A.append(h(float(c - 2)))
            else:
                pos = 2 * ((row - 8) % 5)
                A.append((c << pos) & 0xFFFF)
    for k in range(16):
        for n in range(8):
            B.append(h(random.uniform(0.5, 1.0) * 2.0 ** -E[n]))
def dev_buf(data, fmt):
    raw = struct.pack("<%d%s" % (len(data), fmt), *data)
    p = ctypes.c_uint64(); ck(cu.cuMemAlloc_v2(ctypes.byref(p), len(raw)), "alloc"); ck(cu.cuMemcpyHtoD_v2(p, raw, len(raw)), "h2d"); return p, len(raw)
pa, _ = dev_buf(A, "H"); pb, _ = dev_buf(B, "H"); pd, nd = dev_buf([float("nan")] * (CASES * 128), "f")
args = (ctypes.c_void_p * 3)(*[ctypes.cast(ctypes.pointer(x), ctypes.c_void_p) for x in (pa, pb, pd)])
ck(cu.cuLaunchKernel(fn, CASES, 1, 1, 32, 1, 1, 0, None, args, None), "launch"); ck(cu.cuCtxSynchronize(), "sync")
out = ctypes.create_string_buffer(nd); ck(cu.cuMemcpyDtoH_v2(out, pd, nd), "d2h")
D = struct.unpack("<%df" % (CASES * 128), out.raw)
worst = {}
for cs in range(CASES):
    for row in range(16):
        for n in range(8):
            exact = sum(f(A[cs * 256 + row * 16 + k]) * f(B[cs * 128 + k * 8 + n]) for k in range(16))
            # scale: the largest product's magnitude
            scale = max(abs(f(A[cs * 256 + row * 16 + k]) * f(B[cs * 128 + k * 8 + n])) for k in range(16)) or 1
            err = abs(D[cs * 128 + row * 8 + n] - exact) / scale
            key = ("centred-normal" if row < 8 else "raw-subnormal pos%d" % (2 * ((row - 8) % 5)), E[n])
            worst[key] = max(worst.get(key, 0), err)
for key in sorted(worst): print("%-22s B~2^-%-2d  max |err| / max|product| = %.3e" % (key[0], key[1], worst[key]))
