#!/usr/bin/env python3
"""An engine embedding kvq's generated decode kernels without kvq.

Reads the output of `kvq gen ... --sample --out DIR`, compiles DIR/decode.cu with NVRTC (the kernel
headers it includes from DIR/include, as DIR/README.md says), loads it with the CUDA driver API, puts the sample batch (page pools, page table, FP16 sink and tail rings,
lengths, queries) in device buffers it allocates itself, launches the decode kernels on its own
stream exactly as manifest.json describes them, and checks the output against the CPU reference's
(DIR/sample/expected.bin), for several split counts: each without pieces, then with piece CTAs
after the splits' (`num_pieces`; a kernel with `runs_pieces` false takes them and leaves them
empty), launched twice on the same scratch, the second output bit for bit the first's.

Only the Python standard library is used (ctypes, struct, json): the machine needs libcuda (the
NVIDIA driver) and libnvrtc. With --check-only it stops before the driver: it validates the sample's
buffers against the layout in the manifest and compiles the sources (DIR/cache.cu too), which needs
no GPU.

    python3 examples/embed/embed.py DIR [--check-only] [--arch sm_90a] [--splits 3,1,7]
        [--pieces-per-split 2] [--permille 300]

Exit status: 0 every check passed, 1 a check failed, 2 bad input or missing library.
"""

import argparse
import ctypes
import glob
import json
import math
import os
import struct
import sys

LAYOUT_VERSION = "kvq-layout-2"
CODEBOOK_LAYOUT_VERSION = "kvq-codebook-layout-1"


class EmbedError(Exception):
    """A failure with a message for the user."""


# --------------------------------------------------------------------------------------------
# Input: manifest.json and sample/
# --------------------------------------------------------------------------------------------


def load_json(path):
    try:
        with open(path, "r", encoding="utf-8") as f:
            return json.load(f)
    except OSError as e:
        raise EmbedError(f"cannot read {path}: {e}") from e
    except json.JSONDecodeError as e:
        raise EmbedError(f"{path} is not valid JSON: {e}") from e


def load_sample(gen_dir):
    """The manifest, the sample description and each sample buffer's bytes."""
    manifest = load_json(os.path.join(gen_dir, "manifest.json"))
    if manifest.get("format") != "kvq-gen" or manifest.get("version") != 5:
        raise EmbedError(f"{gen_dir}/manifest.json is not a kvq-gen version 5 manifest")
    want = CODEBOOK_LAYOUT_VERSION if manifest.get("family") == "codebook" else LAYOUT_VERSION
    if manifest.get("layout_version") != want:
        raise EmbedError(
            f"layout {manifest.get('layout_version')!r}, this engine reads {want!r}"
        )
    if not manifest.get("sample"):
        raise EmbedError(f"{gen_dir} has no sample: run `kvq gen ... --sample`")
    sample_dir = os.path.join(gen_dir, manifest["sample"])
    sample = load_json(os.path.join(sample_dir, "sample.json"))
    buffers = {}
    for f in sample["files"]:
        path = os.path.join(sample_dir, f["file"])
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError as e:
            raise EmbedError(f"cannot read {path}: {e}") from e
        if len(data) != f["bytes"]:
            raise EmbedError(f"{path}: {len(data)} bytes, sample.json says {f['bytes']}")
        buffers[f["name"]] = data
    return manifest, sample, buffers


# The values run_decode passes, by parameter name: the sample's buffers, then what the engine
# allocates or chooses.
SAMPLE_INPUTS = ("k_pool", "v_pool", "page_table", "k_sink", "v_sink", "k_tail", "v_tail",
                 "seq_lens", "q")
ENGINE_VALUES = ("out", "part_acc", "part_ml", "lse", "score_range", "scores", "max_pages", "seq_slots",
                 "q_len",
                 "num_splits", "range_splits", "num_pieces", "piece_permille", "num_parts")
# The names grid formulas may use (run_decode's `env`).
GRID_NAMES = ("num_splits", "range_splits", "num_pieces", "kv_heads", "batch", "q_heads")


def check_launch(manifest):
    """Checks that this engine has a value for every parameter and grid formula of the decode
    step's kernels; returns a list of problems."""
    kernels = {k["role"]: k for k in manifest["kernels"]}
    problems = []
    for role in manifest["launch"]["decode_steps"]:
        k = kernels.get(role)
        if k is None:
            problems.append(f"decode step {role!r} has no kernel entry")
            continue
        for p in k["params"]:
            if p["name"] not in SAMPLE_INPUTS + ENGINE_VALUES:
                problems.append(f"{role}: no value for parameter {p['name']!r}")
        for g in k["grid"]:
            try:
                grid_dim(g, {n: 1 for n in GRID_NAMES})
            except EmbedError as e:
                problems.append(f"{role}: {e}")
    return problems


def element_bytes(element):
    return {"u8": 1, "i32": 4, "u32": 4, "f16": 2, "bf16": 2, "f32": 4}[element]


def check_layout(manifest, sample, buffers):
    """Checks every sample buffer against the documented shapes; returns a list of problems."""
    layout = manifest["layout"]
    shape = manifest["shape"]
    d = shape["head_dim"]
    batch, h, q_heads = sample["batch"], sample["kv_heads"], sample["q_heads"]
    pages, max_pages = sample["physical_pages"], sample["max_pages"]
    want = {
        "k_pool": pages * h * layout["k"]["block_bytes"],
        "v_pool": pages * h * layout["v"]["block_bytes"],
        "page_table": batch * max_pages * 4,
        "k_sink": batch * h * (layout["sink"] if layout["k"]["kind"] == "int" else 0) * d * 2,
        "v_sink": batch * h * (layout["sink"] if layout["v"]["kind"] == "int" else 0) * d * 2,
        "k_tail": batch * h * layout["k"]["tail_capacity"] * d * 2,
        "v_tail": batch * h * layout["v"]["tail_capacity"] * d * 2,
        "seq_lens": batch * 4,
        "q": batch * q_heads * d * 2,
        "expected": batch * q_heads * d * 4,
    }
    problems = []
    for name, n in want.items():
        have = len(buffers.get(name, b""))
        # An empty buffer is stored as one poison element.
        if have != n and not (n == 0 and have in (1, 2)):
            problems.append(f"{name}: {have} bytes, the layout gives {n}")
    if q_heads != h * shape["gqa"]:
        problems.append(f"q_heads {q_heads} != kv_heads {h} * gqa {shape['gqa']}")
    seq_lens = struct.unpack(f"<{batch}i", buffers["seq_lens"])
    table = struct.unpack(f"<{batch * max_pages}i", buffers["page_table"])
    for b, n in enumerate(seq_lens):
        # Pages each tensor of this sequence needs (docs/LAYOUT.md section 5).
        need = 0
        for t in ("k", "v"):
            tl = layout[t]
            if tl["kind"] == "fp16":
                need = max(need, -(-n // layout["page_tokens"]))
            else:
                sink_end = min(layout["sink"], n)
                need = max(need, max(n - sink_end - tl["local"], 0) // layout["page_tokens"])
        row = table[b * max_pages:(b + 1) * max_pages]
        for p in range(need):
            if not 0 <= row[p] < pages:
                problems.append(f"sequence {b}: page slot {p} maps to {row[p]}, outside the pool")
    return problems


# --------------------------------------------------------------------------------------------
# NVRTC
# --------------------------------------------------------------------------------------------


def find_library(stem, env, sonames):
    """Loads a CUDA library: $env, the sonames through the loader, then pip wheels' folders."""
    tried = []
    candidates = []
    if os.environ.get(env):
        candidates.append(os.environ[env])
    candidates += sonames
    for base in sys.path + [os.environ.get("CUDA_HOME", "/usr/local/cuda")]:
        if base and os.path.isdir(base):
            candidates += sorted(glob.glob(os.path.join(base, "nvidia", "*", "lib", f"lib{stem}.so*")))
            candidates += sorted(glob.glob(os.path.join(base, "lib64", f"lib{stem}.so*")))
    for c in candidates:
        try:
            return ctypes.CDLL(c), c
        except OSError:
            tried.append(c)
    raise EmbedError(f"lib{stem} not found (tried {', '.join(tried) or 'nothing'}); set {env}")


class Nvrtc:
    def __init__(self):
        self.lib, self.path = find_library(
            "nvrtc", "KVQ_NVRTC", ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"]
        )
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        self.version = f"{major.value}.{minor.value}"

    def compile(self, source, name, arch, include_dir):
        """CUDA C++ → CUBIN for `arch` (e.g. sm_90a); `#include "kvq/…"` found under include_dir."""
        lib = self.lib
        prog = ctypes.c_void_p()
        status = lib.nvrtcCreateProgram(
            ctypes.byref(prog), source.encode(), name.encode(), 0, None, None
        )
        if status != 0:
            raise EmbedError(f"nvrtcCreateProgram failed ({status})")
        try:
            opts = [
                f"--gpu-architecture={arch}".encode(),
                b"--std=c++17",
                f"--include-path={include_dir}".encode(),
            ]
            status = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
            if status != 0:
                size = ctypes.c_size_t()
                lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                log = ctypes.create_string_buffer(size.value)
                lib.nvrtcGetProgramLog(prog, log)
                raise EmbedError(f"NVRTC could not compile {name} for {arch}:\n{log.value.decode()}")
            size = ctypes.c_size_t()
            if lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)) != 0:
                raise EmbedError(f"nvrtcGetCUBINSize failed for {arch} (a real sm_XY is needed)")
            image = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetCUBIN(prog, image)
            return image.raw
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def unit_image(gen_dir, unit, arch, log):
    """CUBIN of the unit (decode.cu, cache.cu) for `arch`: compiled with NVRTC, the kernel headers
    from gen_dir/include, else the one `kvq gen --arch` wrote."""
    with open(os.path.join(gen_dir, unit), "r", encoding="utf-8") as f:
        source = f.read()
    stem = unit[: -len(".cu")]
    try:
        nvrtc = Nvrtc()
    except EmbedError as e:
        prebuilt = os.path.join(gen_dir, f"{stem}.{arch}.cubin")
        if os.path.exists(prebuilt):
            log(f"no NVRTC ({e}); using {prebuilt} from `kvq gen --arch {arch}`")
            with open(prebuilt, "rb") as f:
                return f.read()
        raise
    image = nvrtc.compile(source, unit, arch, os.path.join(gen_dir, "include"))
    log(f"compiled {unit} for {arch} with NVRTC {nvrtc.version} ({nvrtc.path}): "
        f"{len(image)} bytes of CUBIN")
    return image


def decode_image(gen_dir, arch, log):
    """CUBIN of decode.cu for `arch` (see unit_image)."""
    return unit_image(gen_dir, "decode.cu", arch, log)


# --------------------------------------------------------------------------------------------
# The CUDA driver API
# --------------------------------------------------------------------------------------------

CUdeviceptr = ctypes.c_uint64
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR = 75
CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR = 76
CU_STREAM_NON_BLOCKING = 1
CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8


class Driver:
    """The few driver calls an engine needs, with argument types declared (64-bit pointers and
    sizes must not be truncated to C int)."""

    SIGNATURES = {
        "cuInit": [ctypes.c_uint],
        "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
        "cuDeviceGetAttribute": [ctypes.POINTER(ctypes.c_int), ctypes.c_int, ctypes.c_int],
        "cuDeviceGetName": [ctypes.c_char_p, ctypes.c_int, ctypes.c_int],
        "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int],
        "cuDevicePrimaryCtxRelease_v2": [ctypes.c_int],
        "cuCtxSetCurrent": [ctypes.c_void_p],
        "cuModuleLoadData": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p],
        "cuModuleUnload": [ctypes.c_void_p],
        "cuModuleGetFunction": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p],
        "cuFuncSetAttribute": [ctypes.c_void_p, ctypes.c_int, ctypes.c_int],
        "cuStreamCreate": [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint],
        "cuStreamDestroy_v2": [ctypes.c_void_p],
        "cuStreamSynchronize": [ctypes.c_void_p],
        "cuMemAlloc_v2": [ctypes.POINTER(CUdeviceptr), ctypes.c_size_t],
        "cuMemFree_v2": [CUdeviceptr],
        "cuMemcpyHtoDAsync_v2": [CUdeviceptr, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p],
        "cuMemcpyDtoHAsync_v2": [ctypes.c_void_p, CUdeviceptr, ctypes.c_size_t, ctypes.c_void_p],
        "cuMemsetD16Async": [CUdeviceptr, ctypes.c_ushort, ctypes.c_size_t, ctypes.c_void_p],
        "cuMemsetD32Async": [CUdeviceptr, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p],
        "cuLaunchKernel": [
            ctypes.c_void_p,
            ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
            ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
            ctypes.c_uint, ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_void_p),
        ],
        "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    }

    def __init__(self):
        self.lib, self.path = find_library("cuda", "KVQ_LIBCUDA", ["libcuda.so.1", "libcuda.so"])
        for name, args in self.SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.argtypes = args
            fn.restype = ctypes.c_int

    def __call__(self, name, *args):
        status = getattr(self.lib, name)(*args)
        if status != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorName(status, ctypes.byref(text))
            raise EmbedError(f"{name} failed: {status} ({(text.value or b'?').decode()})")


def f16_to_float(word):
    return struct.unpack("<e", struct.pack("<H", word))[0]


def bf16_to_float(word):
    return struct.unpack("<f", struct.pack("<I", word << 16))[0]


def grid_dim(formula, env):
    """A grid entry of the manifest: a sum of products of launch values' names and integers
    (`num_splits + num_pieces`, `kv_heads * 2`)."""
    total = 0
    for term in formula.split("+"):
        product = 1
        for factor in term.split("*"):
            factor = factor.strip()
            if factor.isdigit():
                product *= int(factor)
            elif factor in env:
                product *= int(env[factor])
            else:
                raise EmbedError(f"grid formula {formula!r} is not one this engine evaluates")
        total += product
    return total


class Engine:
    """Owns a context, a stream, a module and device buffers — as an inference engine would."""

    def __init__(self, device_ordinal, log):
        self.cu = Driver()
        self.log = log
        cu = self.cu
        cu("cuInit", 0)
        self.device = ctypes.c_int()
        cu("cuDeviceGet", ctypes.byref(self.device), device_ordinal)
        major, minor = ctypes.c_int(), ctypes.c_int()
        cu("cuDeviceGetAttribute", ctypes.byref(major), CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
           self.device)
        cu("cuDeviceGetAttribute", ctypes.byref(minor), CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR,
           self.device)
        name = ctypes.create_string_buffer(256)
        cu("cuDeviceGetName", name, 256, self.device)
        # The architecture-specific variant from Hopper on, as kvq's JIT compiles.
        self.arch = f"sm_{major.value}{minor.value}" + ("a" if major.value >= 9 else "")
        self.ctx = ctypes.c_void_p()
        cu("cuDevicePrimaryCtxRetain", ctypes.byref(self.ctx), self.device)
        cu("cuCtxSetCurrent", self.ctx)
        self.stream = ctypes.c_void_p()
        cu("cuStreamCreate", ctypes.byref(self.stream), CU_STREAM_NON_BLOCKING)
        self.allocations = []
        self.module = None
        log(f"GPU {device_ordinal}: {name.value.decode()} ({self.arch}), driver {self.cu.path}")

    def load(self, image, names):
        self.module = ctypes.c_void_p()
        self.cu("cuModuleLoadData", ctypes.byref(self.module), image)
        functions = {}
        for n in names:
            f = ctypes.c_void_p()
            self.cu("cuModuleGetFunction", ctypes.byref(f), self.module, n.encode())
            functions[n] = f
        return functions

    def check_entry_points(self, image, names):
        """Loads a module, looks every name up, and unloads it again."""
        module = ctypes.c_void_p()
        self.cu("cuModuleLoadData", ctypes.byref(module), image)
        try:
            for n in names:
                f = ctypes.c_void_p()
                self.cu("cuModuleGetFunction", ctypes.byref(f), module, n.encode())
        finally:
            self.cu("cuModuleUnload", module)

    def alloc(self, nbytes):
        ptr = CUdeviceptr()
        self.cu("cuMemAlloc_v2", ctypes.byref(ptr), max(nbytes, 4))
        self.allocations.append(ptr)
        return ptr

    def upload(self, data):
        ptr = self.alloc(len(data))
        host = ctypes.create_string_buffer(data, len(data))
        self.cu("cuMemcpyHtoDAsync_v2", ptr, host, len(data), self.stream)
        self.cu("cuStreamSynchronize", self.stream)  # `host` must outlive the copy
        return ptr

    def download(self, ptr, nbytes):
        host = ctypes.create_string_buffer(nbytes)
        self.cu("cuMemcpyDtoHAsync_v2", host, ptr, nbytes, self.stream)
        self.cu("cuStreamSynchronize", self.stream)
        return host.raw

    def launch(self, function, kernel, values, env):
        """Launches `kernel` (a manifest entry) with `values` by parameter name."""
        params = kernel["params"]
        holders = []
        for p in params:
            if p["name"] not in values:
                raise EmbedError(f"{kernel['name']}: no value for parameter {p['name']!r}")
            v = values[p["name"]]
            if p["c_type"].endswith("*"):
                holders.append(CUdeviceptr(v.value if isinstance(v, CUdeviceptr) else v))
            elif p["c_type"] == "int32_t":
                holders.append(ctypes.c_int32(v))
            elif p["c_type"] == "double":
                holders.append(ctypes.c_double(v))
            else:
                raise EmbedError(f"{kernel['name']}: parameter type {p['c_type']!r} not handled")
        args = (ctypes.c_void_p * len(holders))(
            *[ctypes.cast(ctypes.pointer(h), ctypes.c_void_p) for h in holders]
        )
        grid = [grid_dim(g, env) for g in kernel["grid"]]
        block = kernel["block"]
        dynamic = kernel["dynamic_shared_bytes"]
        if dynamic > 0:
            # The driver refuses static + dynamic shared memory above 48 KiB until the function's
            # limit is raised, so raise it to what the kernel declares whenever it declares any.
            self.cu("cuFuncSetAttribute", function, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    dynamic)
        self.cu("cuLaunchKernel", function, grid[0], grid[1], grid[2], block[0], block[1], block[2],
                dynamic, self.stream, args, None)

    def close(self):
        for p in self.allocations:
            self.cu("cuMemFree_v2", p)
        if self.module:
            self.cu("cuModuleUnload", self.module)
        self.cu("cuStreamDestroy_v2", self.stream)
        self.cu("cuDevicePrimaryCtxRelease_v2", self.device)


# --------------------------------------------------------------------------------------------
# The decode step
# --------------------------------------------------------------------------------------------


def relative_error(have, want):
    num = sum((a - b) ** 2 for a, b in zip(have, want))
    den = sum(b * b for b in want)
    return math.sqrt(num / max(den, sys.float_info.min))


def run_decode(engine, functions, manifest, sample, buffers, splits, pieces=0, permille=0,
               launches=1):
    """Decode steps with `splits` split-K partitions and `pieces` piece CTAs per (sequence, KV
    head) covering the last `permille`/1000 of its cost (0: none), launched `launches` times on
    the same scratch. With one part (one split, no pieces) the decode kernel writes `out` itself:
    the first launch skips the combine, as an engine may, and later ones run it anyway. Returns
    each launch's output as raw 16-bit words."""
    batch, h, q_heads = sample["batch"], sample["kv_heads"], sample["q_heads"]
    d = manifest["shape"]["head_dim"]
    rows = batch * q_heads
    parts = splits + pieces  # partials per query head: the splits', then the pieces'
    # The score-range grid takes any split count of its own (launch.range_splits); one unlike
    # decode's shows that the two are independent.
    range_splits = 2 * splits + 1
    ptr = {name: engine.upload(buffers[name]) for name in SAMPLE_INPUTS}
    out = engine.alloc(rows * d * 2)
    part_acc = engine.alloc(rows * parts * d * 4)
    part_ml = engine.alloc(rows * parts * 2 * 4)
    score_range = engine.alloc(rows * range_splits * 2 * 4)
    # Stored key scores (launch.scratch): launch.score_columns floats for every token a page
    # table reaches past the sink, and 4 floats of slack; one float where the kernels store none.
    score_floats = 1
    if manifest["launch"]["stores_scores"]:
        score_floats = (batch * h * sample["max_pages"] * manifest["layout"]["page_tokens"]
                        * manifest["launch"]["score_columns"] + 4)
    scores = engine.alloc(score_floats * 4)
    cu = engine.cu
    values = dict(ptr)
    values.update(out=out, part_acc=part_acc, part_ml=part_ml, score_range=score_range,
                  scores=scores,
                  max_pages=sample["max_pages"], num_splits=splits,
                  range_splits=range_splits, num_pieces=pieces,
                  piece_permille=permille, num_parts=parts,
                  lse=0,  # NULL: the combine writes no log-sum-exp (an engine merging parts passes one)
                  seq_slots=0,  # NULL: row b reads the sample's sequence slot b
                  q_len=1)  # one query token a sequence
    env = {"num_splits": splits, "range_splits": range_splits, "num_pieces": pieces,
           "kv_heads": h, "batch": batch, "q_heads": q_heads}
    kernels = {k["role"]: k for k in manifest["kernels"]}
    outputs = []
    for launch in range(launches):
        # Poison (before every launch, for this check only): an output or partial the kernels
        # forget to write shows as NaN.
        cu("cuMemsetD16Async", out, 0xFFFF, rows * d, engine.stream)
        for p, n in ((part_acc, rows * parts * d), (part_ml, rows * parts * 2),
                     (score_range, rows * range_splits * 2), (scores, score_floats)):
            cu("cuMemsetD32Async", p, 0x7FC00000, n, engine.stream)
        for role in manifest["launch"]["decode_steps"]:
            if role == "combine" and parts == 1 and launch == 0:
                continue  # the decode kernel wrote `out` (one part, `out` given)
            k = kernels[role]
            engine.launch(functions[k["name"]], k, values, env)
        outputs.append(struct.unpack(f"<{rows * d}H", engine.download(out, rows * d * 2)))
    return outputs


def verify(output, sample, buffers, d):
    """Per-sequence relative error against the reference; (worst, failures)."""
    batch, q_heads = sample["batch"], sample["q_heads"]
    expected = struct.unpack(f"<{batch * q_heads * d}f", buffers["expected"])
    per = q_heads * d
    worst, failures = 0.0, []
    for b in range(batch):
        have = output[b * per:(b + 1) * per]
        want = expected[b * per:(b + 1) * per]
        if not all(math.isfinite(x) for x in have):
            failures.append(f"sequence {b} ({sample['seq_lens'][b]} tokens): non-finite output")
            continue
        err = relative_error(have, want)
        worst = max(worst, err)
        if err > sample["tolerance"]:
            failures.append(f"sequence {b} ({sample['seq_lens'][b]} tokens): relative error "
                            f"{err:.3e} > {sample['tolerance']:.0e}")
    return worst, failures


# --------------------------------------------------------------------------------------------
# A codebook scheme (CommVQ): decode -> combine over the sample's paged cache and codebooks
# --------------------------------------------------------------------------------------------

CODEBOOK_INPUTS = ("k_pool", "v_pool", "page_table", "k_sink", "v_sink", "k_tail", "v_tail",
                   "seq_lens", "q", "k_book", "k_rows", "k_mean", "v_rows", "v_mean")


def check_codebook_sample(manifest, sample, buffers):
    """Every buffer the decode reads is in the sample, sized as sample.json says, the pools as the
    manifest's layout; returns a list of problems."""
    problems = []
    layout = manifest["layout"]
    for f in sample["files"]:
        n = 1
        for x in f["shape"]:
            n *= x
        if max(n, 1) * element_bytes(f["element"]) != f["bytes"]:
            problems.append(f"{f['name']}: shape {f['shape']} of {f['element']} is not {f['bytes']} bytes")
    for side in ("k", "v"):
        pool = next((f for f in sample["files"] if f["name"] == f"{side}_pool"), None)
        if pool is None or pool["shape"][2] != layout[side]["block_bytes"]:
            problems.append(f"{side}_pool blocks are not the manifest's {layout[side]['block_bytes']} bytes")
    for name in CODEBOOK_INPUTS + ("expected",):
        if name not in buffers:
            problems.append(f"the sample has no {name}")
    return problems


def run_codebook(args, manifest, sample, buffers, log):
    problems = check_codebook_sample(manifest, sample, buffers)
    for p in problems:
        log(f"layout mismatch: {p}")
    if problems:
        return 1
    log("sample buffers match the documented layout "
        f"({manifest['layout_version']}, codebooks {manifest['layout']['codebook_file']['format']})")
    if args.check_only:
        decode_image(args.gen_dir, args.arch or "sm_90a", log)
        unit_image(args.gen_dir, "encode.cu", args.arch or "sm_90a", log)
        log("check-only: stopping before the driver")
        return 0
    engine = Engine(args.device, log)
    try:
        encode_image = unit_image(args.gen_dir, "encode.cu", args.arch or engine.arch, log)
        engine.check_entry_points(
            encode_image, [k["name"] for k in manifest["kernels"] if k.get("file") == "encode.cu"])
        image = decode_image(args.gen_dir, args.arch or engine.arch, log)
        kernels = {k["role"]: k for k in manifest["kernels"]}
        functions = engine.load(image, [kernels[r]["name"] for r in ("decode", "combine")])
        device = {name: engine.upload(buffers[name]) for name in CODEBOOK_INPUTS}
        batch, q_heads, d = sample["batch"], sample["q_heads"], manifest["shape"]["head_dim"]
        convert = f16_to_float if manifest["shape"]["dtype"] == "f16" else bf16_to_float
        splits_list = ([int(s) for s in args.splits.split(",") if s.strip()] if args.splits
                       else sorted({sample["num_splits"], 1, 7}))
        failed = False
        for splits in splits_list:
            out = engine.alloc(batch * q_heads * d * 2)
            engine.cu("cuMemsetD16Async", out, 0xFFFF, batch * q_heads * d, engine.stream)
            part_acc = engine.alloc(batch * q_heads * splits * d * 4)
            part_ml = engine.alloc(batch * q_heads * splits * 2 * 4)
            values = dict(device)
            values.update({
                "max_pages": sample["max_pages"], "seq_slots": 0, "q_len": 1,
                "rope_theta": sample["rope_theta"], "part_acc": part_acc, "part_ml": part_ml,
                "out": out if splits == 1 else 0, "lse": 0, "num_parts": splits,
            })
            env = {"num_splits": splits, "kv_heads": sample["kv_heads"], "batch": batch,
                   "q_heads": q_heads}
            engine.launch(functions[kernels["decode"]["name"]], kernels["decode"], values, env)
            if splits > 1:
                values["out"] = out
                engine.launch(functions[kernels["combine"]["name"]], kernels["combine"], values, env)
            engine.cu("cuStreamSynchronize", engine.stream)
            raw = engine.download(out, batch * q_heads * d * 2)
            words = struct.unpack(f"<{batch * q_heads * d}H", raw)
            worst, failures = verify([convert(w) for w in words], sample, buffers, d)
            log(f"decode -> combine with {splits} split(s) on the engine's stream: "
                f"{'FAIL' if failures else 'ok'}, largest relative error {worst:.2e} "
                f"(tolerance {sample['tolerance']:.0e})")
            for f in failures:
                log(f"  {f}")
            failed = failed or bool(failures)
    finally:
        engine.close()
    return 1 if failed else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gen_dir", help="output folder of `kvq gen ... --sample`")
    ap.add_argument("--check-only", action="store_true",
                    help="validate the sample and compile the source; no GPU needed")
    ap.add_argument("--arch", default=None,
                    help="architecture to compile for (default: the GPU's, or sm_90a with --check-only)")
    ap.add_argument("--splits", default=None,
                    help="comma list of split-K counts to run (default: the sample's, 1 and 7)")
    ap.add_argument("--pieces-per-split", type=int, default=2,
                    help="num_pieces = this × splits for the runs with pieces (0: no such runs)")
    ap.add_argument("--permille", type=int, default=300,
                    help="piece_permille of the runs with pieces: thousandths of each (sequence, "
                         "KV head)'s cost they cover, 1..999")
    ap.add_argument("--device", type=int, default=0)
    args = ap.parse_args()
    name = os.path.basename(os.path.normpath(args.gen_dir))

    def log(line):
        print(f"[{name}] {line}", flush=True)

    try:
        manifest, sample, buffers = load_sample(args.gen_dir)
        log(f"scheme {manifest['scheme']['text']}; head_dim {manifest['shape']['head_dim']}, "
            f"gqa {manifest['shape']['gqa']}, {manifest['shape']['dtype']}; batch of "
            f"{sample['batch']} sequences {sample['seq_lens']}, {sample['kv_heads']} KV heads")
        if manifest.get("family") == "codebook":
            return run_codebook(args, manifest, sample, buffers, log)
        problems = check_layout(manifest, sample, buffers)
        if problems:
            for p in problems:
                log(f"layout mismatch: {p}")
            return 1
        log("sample buffers match the documented layout")
        problems = check_launch(manifest)
        if problems:
            for p in problems:
                log(f"launch mismatch: {p}")
            return 1
        decode_kernel = next((k for k in manifest["kernels"] if k["role"] == "decode"), {})
        runs_pieces = bool(decode_kernel.get("runs_pieces", False))
        if not 1 <= args.permille <= 999:
            raise EmbedError(f"--permille {args.permille}: expected 1..999")
        pieces_per_split = max(args.pieces_per_split, 0)
        log("the engine has a value for every parameter and grid of "
            f"{' -> '.join(manifest['launch']['decode_steps'])}; the decode kernel "
            + ("runs pieces" if runs_pieces
               else "runs no pieces (its splits do all the work, its piece CTAs stay empty)"))
        has_cache = os.path.exists(os.path.join(args.gen_dir, "cache.cu"))
        if args.check_only:
            decode_image(args.gen_dir, args.arch or "sm_90a", log)
            if has_cache:
                unit_image(args.gen_dir, "cache.cu", args.arch or "sm_90a", log)
            log("check-only: stopping before the driver")
            return 0
        engine = Engine(args.device, log)
        try:
            if has_cache:
                # The cache unit is not launched here; it compiles and every entry point loads.
                cache_image = unit_image(args.gen_dir, "cache.cu", args.arch or engine.arch, log)
                engine.check_entry_points(
                    cache_image,
                    [k["name"] for k in manifest["kernels"] if k.get("file") == "cache.cu"])
            image = decode_image(args.gen_dir, args.arch or engine.arch, log)
            steps = manifest["launch"]["decode_steps"]
            kernels = {k["role"]: k for k in manifest["kernels"]}
            functions = engine.load(image, [kernels[r]["name"] for r in steps])
            if args.splits:
                split_counts = [int(s) for s in args.splits.split(",") if s.strip()]
            else:
                split_counts = sorted({sample["num_splits"], 1, 7})
            d = manifest["shape"]["head_dim"]
            failed = False
            convert = f16_to_float if manifest["shape"]["dtype"] == "f16" else bf16_to_float
            for splits in split_counts:
                # Without pieces, then with pieces launched twice on the same scratch: which SM
                # ran which piece must not change a bit of the output.
                # One split: the first launch skips the combine, the second runs it; both
                # must give the same bits.
                runs = [(0, 0, 2 if splits == 1 else 1)]
                if pieces_per_split > 0:
                    runs.append((pieces_per_split * splits, args.permille, 2))
                for pieces, permille, launches in runs:
                    outputs = run_decode(engine, functions, manifest, sample, buffers, splits,
                                         pieces, permille, launches)
                    for i, words in enumerate(outputs):
                        worst, failures = verify([convert(w) for w in words], sample, buffers, d)
                        if i > 0 and words != outputs[0]:
                            diff = sum(a != b for a, b in zip(words, outputs[0]))
                            failures.append(f"{diff} output values differ from launch 1's")
                        status = "FAIL" if failures else "ok"
                        how = f"{splits} split(s)"
                        if splits + pieces == 1:
                            how += (", the decode kernel writing the output (no combine)" if i == 0
                                    else ", the combine run anyway")
                        if pieces:
                            how += (f" + {pieces} piece(s) over the last {permille}/1000 of each "
                                    f"sequence's cost"
                                    + ("" if runs_pieces else " (left empty by this kernel)")
                                    + f", launch {i + 1} of {launches} on the same scratch")
                        log(f"{' -> '.join(steps)} with {how} on the engine's stream: {status}, "
                            f"largest relative error {worst:.2e} "
                            f"(tolerance {sample['tolerance']:.0e})")
                        for f in failures:
                            log(f"  {f}")
                        failed = failed or bool(failures)
        finally:
            engine.close()
        return 1 if failed else 0
    except EmbedError as e:
        print(f"[{name}] error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
