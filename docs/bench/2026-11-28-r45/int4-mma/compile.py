"""Compile a CUDA source with NVRTC for sm_90a and write its CUBIN: compile.py SRC OUT.cubin."""
import ctypes, sys, os
nv = ctypes.CDLL("libnvrtc.so.13")
src = open(sys.argv[1], 'rb').read()
prog = ctypes.c_void_p()
assert nv.nvrtcCreateProgram(ctypes.byref(prog), src, b"k.cu", 0, None, None) == 0
opts = [b"--gpu-architecture=sm_90a"]
st = nv.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
n = ctypes.c_size_t(); nv.nvrtcGetProgramLogSize(prog, ctypes.byref(n)); log = ctypes.create_string_buffer(n.value); nv.nvrtcGetProgramLog(prog, log); print(log.value.decode())
assert st == 0
nv.nvrtcGetCUBINSize(prog, ctypes.byref(n)); buf = ctypes.create_string_buffer(n.value); nv.nvrtcGetCUBIN(prog, buf)
open(sys.argv[2], 'wb').write(buf.raw)
