"""kvq for Python: quantized KV-cache attention for PyTorch engines.

A *plan* is a KV-cache quantization scheme (a built-in's name such as ``"kivi2"``, or scheme
text such as ``"k = int(2, channel), v = int(2, token)"``) and a model shape with limits, checked
once, which say exactly which device buffers an engine allocates for kvq's kernels. Making a plan
needs no GPU. :mod:`kvq.engine` (PyTorch with CUDA) holds a plan's cache as torch tensors and runs
the kernels on it: prefill, append and attend, as torch custom ops that CUDA graphs capture.

>>> import kvq
>>> plan = kvq.Plan("kivi2", head_dim=128, q_heads=32, kv_heads=8,
...                 max_seqs=16, max_seq_len=32768, pool_pages=4096)
>>> plan.page_tokens
128
>>> [b.name for b in plan.buffers]
['k_pool', 'v_pool', 'k_sink', 'v_sink', 'k_tail', 'v_tail', 'seq_lens', 'page_table', 'k_pending', 'v_pending', 'status', 'codebooks', 'xquant_weights', 'xquant_accumulator']

Every error is a :class:`KvqError`; the subclass says what kind (:class:`InvalidScheme`,
:class:`UnsupportedShape`, ...) and the message says what to change.
"""

from ._kvq import (
    Buffer,
    CompileError,
    CudaError,
    InternalError,
    InvalidArgument,
    InvalidScheme,
    KvqError,
    Plan,
    UnsupportedScheme,
    UnsupportedShape,
    __version__,
    builtin_schemes,
)

__all__ = [
    "Buffer",
    "CompileError",
    "CudaError",
    "InternalError",
    "InvalidArgument",
    "InvalidScheme",
    "KvqError",
    "Plan",
    "UnsupportedScheme",
    "UnsupportedShape",
    "__version__",
    "builtin_schemes",
]
