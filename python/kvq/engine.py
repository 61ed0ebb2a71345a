"""kvq's step calls on PyTorch CUDA tensors: a paged quantized KV cache an engine drives.

:class:`PagedCache` holds one layer's cache for a :class:`kvq.Plan` as torch tensors on one GPU
(the plan's buffers, a block table and a workspace) and runs kvq's kernels on them on torch's
current stream, without copies:

- :meth:`PagedCache.prefill` stores prompts (packed back to back) into empty sequence slots;
- :meth:`PagedCache.append` adds a step's new tokens' K and V (one a sequence when decoding,
  several when verifying draft tokens) to each listed slot;
- :meth:`PagedCache.attend` runs attention of the step's query tokens (the slot's newest tokens,
  each seeing the tokens up to itself) and returns the output and each row's log-sum-exp (for
  :func:`merge`).

``append`` and ``attend`` are torch custom ops (``torch.ops.kvq.append``, ``torch.ops.kvq.attend``)
with fake implementations, and neither synchronises with the host, so ``torch.cuda.graph`` can
capture them and ``torch.compile`` can trace them. Called eagerly, :class:`PagedCache` goes
straight to the extension (the same launches, without the custom ops' dispatch, which costs more
host time than the kernels take on the GPU). Sequence slots are rows of the per-sequence
buffers and of the block table: the engine gives each running sequence a slot and names the
slots of a step's rows in an int32 CUDA tensor (``-1``: a padding row, skipped, output zeros).

Needs PyTorch with CUDA; ``import kvq`` alone does not.
"""

from typing import List, Optional, Sequence, Tuple

import torch

from . import _kvq
from ._kvq import InvalidArgument, Plan

__all__ = ["PagedCache", "merge", "xquant_projections"]

# Plans by id for the custom ops, which take only tensors and numbers.
_PLANS: dict = {}

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _plan_id(plan: Plan) -> int:
    _PLANS.setdefault(id(plan), plan)
    return id(plan)


try:  # torch's own fast path to a device's current stream handle (what inductor's code calls)
    from torch._C import _cuda_getCurrentRawStream as _raw_stream
except ImportError:  # pragma: no cover - older or CPU-only builds

    def _raw_stream(index: int) -> int:
        return torch.cuda.current_stream(index).cuda_stream


def _ptrs(buffers: Sequence[torch.Tensor]) -> List[int]:
    return [t.data_ptr() for t in buffers]


# The ops are registered straight with torch's dispatcher (define + a CUDA kernel + a fake
# kernel) rather than through torch.library.custom_op, whose Python wrappers for autograd and
# checks cost tens of µs a call; kvq's ops take no gradients.
_LIB = torch.library.Library("kvq", "FRAGMENT")


def _op(name: str, mutates_args: Tuple[str, ...]):
    """Registers the decorated function as the CUDA kernel of ``kvq::name``, its schema inferred
    from its annotations with ``mutates_args`` marked as written."""
    def register(fn):
        _LIB.define(name + torch.library.infer_schema(fn, mutates_args=mutates_args))
        _LIB.impl(name, fn, "CUDA")
        return fn
    return register


@_op("append", mutates_args=("k_pool", "v_pool", "k_sink", "v_sink", "k_tail", "v_tail",
                             "seq_lens", "k_pending", "v_pending", "status"))
def _append(
    plan_id: int,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    k_sink: torch.Tensor,
    v_sink: torch.Tensor,
    k_tail: torch.Tensor,
    v_tail: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    k_pending: torch.Tensor,
    v_pending: torch.Tensor,
    status: torch.Tensor,
    codebooks: torch.Tensor,
    xquant_weights: torch.Tensor,
    xquant_accumulator: torch.Tensor,
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_pre_rope: Optional[torch.Tensor],
) -> None:
    # k, v (and k_pre_rope): [n, q_len, kv_heads, head_dim]
    buffers = [k_pool, v_pool, k_sink, v_sink, k_tail, v_tail, seq_lens, block_table, k_pending,
               v_pending, status, codebooks, xquant_weights, xquant_accumulator]
    _PLANS[plan_id]._steps(_ptrs(buffers), 0).append(
        _raw_stream(k.get_device()), slots.numel(), k.shape[1], slots.data_ptr(), k.data_ptr(),
        v.data_ptr(), 0 if k_pre_rope is None else k_pre_rope.data_ptr(),
    )


@torch.library.register_fake("kvq::append")
def _(plan_id, k_pool, v_pool, k_sink, v_sink, k_tail, v_tail, seq_lens, block_table, k_pending,
      v_pending, status, codebooks, xquant_weights, xquant_accumulator, slots, k, v, k_pre_rope):
    return None


@_op("attend", mutates_args=("workspace",))
def _attend(
    plan_id: int,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    k_sink: torch.Tensor,
    v_sink: torch.Tensor,
    k_tail: torch.Tensor,
    v_tail: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    k_pending: torch.Tensor,
    v_pending: torch.Tensor,
    status: torch.Tensor,
    codebooks: torch.Tensor,
    xquant_weights: torch.Tensor,
    xquant_accumulator: torch.Tensor,
    slots: torch.Tensor,
    q: torch.Tensor,
    workspace: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    # q: [n, q_len, q_heads, head_dim]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    buffers = [k_pool, v_pool, k_sink, v_sink, k_tail, v_tail, seq_lens, block_table, k_pending,
               v_pending, status, codebooks, xquant_weights, xquant_accumulator]
    _PLANS[plan_id]._steps(_ptrs(buffers), workspace.data_ptr()).attend(
        _raw_stream(q.get_device()), slots.numel(), q.shape[1], slots.data_ptr(), q.data_ptr(),
        out.data_ptr(), lse.data_ptr(),
    )
    return out, lse


@torch.library.register_fake("kvq::attend")
def _(plan_id, k_pool, v_pool, k_sink, v_sink, k_tail, v_tail, seq_lens, block_table, k_pending,
      v_pending, status, codebooks, xquant_weights, xquant_accumulator, slots, q, workspace):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@_op("xquant_append", mutates_args=("k_pool", "v_pool", "k_sink", "v_sink", "k_tail", "v_tail",
                                    "seq_lens", "workspace"))
def _xquant_append(
    plan_id: int,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    k_sink: torch.Tensor,
    v_sink: torch.Tensor,
    k_tail: torch.Tensor,
    v_tail: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    k_pending: torch.Tensor,
    v_pending: torch.Tensor,
    status: torch.Tensor,
    codebooks: torch.Tensor,
    xquant_weights: torch.Tensor,
    xquant_accumulator: torch.Tensor,
    slots: torch.Tensor,
    x: torch.Tensor,
    workspace: torch.Tensor,
) -> None:
    # x: [n, d_model]
    buffers = [k_pool, v_pool, k_sink, v_sink, k_tail, v_tail, seq_lens, block_table, k_pending,
               v_pending, status, codebooks, xquant_weights, xquant_accumulator]
    _PLANS[plan_id]._steps(_ptrs(buffers), workspace.data_ptr()).xquant_append(
        _raw_stream(x.get_device()), slots.numel(), slots.data_ptr(), x.data_ptr(),
    )


@torch.library.register_fake("kvq::xquant_append")
def _(plan_id, k_pool, v_pool, k_sink, v_sink, k_tail, v_tail, seq_lens, block_table, k_pending,
      v_pending, status, codebooks, xquant_weights, xquant_accumulator, slots, x, workspace):
    return None


@_op("xquant_append_cross_layer",
     mutates_args=("k_pool", "v_pool", "k_sink", "v_sink", "k_tail", "v_tail", "seq_lens",
                   "xquant_accumulator", "x_hat", "workspace"))
def _xquant_append_cross_layer(
    plan_id: int,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    k_sink: torch.Tensor,
    v_sink: torch.Tensor,
    k_tail: torch.Tensor,
    v_tail: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    k_pending: torch.Tensor,
    v_pending: torch.Tensor,
    status: torch.Tensor,
    codebooks: torch.Tensor,
    xquant_weights: torch.Tensor,
    xquant_accumulator: torch.Tensor,
    slots: torch.Tensor,
    x: torch.Tensor,
    x_hat: torch.Tensor,
    workspace: torch.Tensor,
) -> None:
    # x, x_hat: [n, d_model]; x_hat is replaced with the layer's accumulator.
    buffers = [k_pool, v_pool, k_sink, v_sink, k_tail, v_tail, seq_lens, block_table, k_pending,
               v_pending, status, codebooks, xquant_weights, xquant_accumulator]
    _PLANS[plan_id]._steps(_ptrs(buffers), workspace.data_ptr()).xquant_append_cross_layer(
        _raw_stream(x.get_device()), slots.numel(), slots.data_ptr(),
        x.data_ptr(), x_hat.data_ptr(),
    )


@torch.library.register_fake("kvq::xquant_append_cross_layer")
def _(plan_id, k_pool, v_pool, k_sink, v_sink, k_tail, v_tail, seq_lens, block_table, k_pending,
      v_pending, status, codebooks, xquant_weights, xquant_accumulator, slots, x, x_hat,
      workspace):
    return None


def xquant_projections(scheme: str, w_k: torch.Tensor, w_v: torch.Tensor, *, kv_heads: int,
                       head_dim: int) -> bytes:
    """A layer's XQuant projections (a ``kvq-projections-1`` file's bytes) for ``scheme`` from
    the model's key and value weights as ``x @ w`` multiplies them, ``[d_model, kv_heads ·
    head_dim]`` (a Hugging Face ``k_proj.weight`` is the transpose: pass ``k_proj.weight.T``).
    The SVD runs on the CPU in float64 (8.7 s a 4096 × 1024 weight on two cores); save the
    bytes once per model and hand them to :meth:`PagedCache.load_projections`."""
    out = kv_heads * head_dim
    if w_k.dim() != 2 or w_k.shape[1] != out or w_v.shape != w_k.shape:
        raise InvalidArgument(
            f"w_k {tuple(w_k.shape)} and w_v {tuple(w_v.shape)}: expected both [d_model, "
            f"{out}] (kv_heads {kv_heads} × head_dim {head_dim})"
        )

    def host(w: torch.Tensor) -> bytes:
        return w.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()

    return _kvq.xquant_projections(scheme, host(w_k), host(w_v), d_model=w_k.shape[0],
                                   kv_heads=kv_heads, head_dim=head_dim)


class PagedCache:
    """One layer's paged quantized KV cache for ``plan`` on a CUDA device, as torch tensors.

    The block table (``block_table``, ``[max_seqs, max_pages_per_seq]`` int32) names the pool
    page of each slot's logical pages, as an engine's block table does; the engine writes it
    before a call fills a page. By default, when the pool holds every slot's whole table, slot
    ``s``'s page ``j`` is pool page ``s · max_pages_per_seq + j``.

    >>> import kvq, torch                                      # doctest: +SKIP
    >>> plan = kvq.Plan("kivi2", head_dim=128, q_heads=32, kv_heads=8, max_seqs=4,
    ...                 max_seq_len=4096, pool_pages=128)      # doctest: +SKIP
    >>> cache = kvq.engine.PagedCache(plan, "cuda")            # doctest: +SKIP

    A codebook plan (CommVQ) takes its layer's codebooks first and, where it codes keys before
    RoPE, the keys before RoPE beside those after it:

    >>> plan = kvq.Plan("commvq1", head_dim=128, q_heads=32, kv_heads=8, max_seqs=4,
    ...                 max_seq_len=4096, pool_pages=128, rope_theta=500000.0)  # doctest: +SKIP
    >>> cache = kvq.engine.PagedCache(plan, "cuda")            # doctest: +SKIP
    >>> cache.load_codebooks("layer0.safetensors")             # doctest: +SKIP
    >>> cache.prefill([0], [n], k, v, k_pre_rope=k_before_rope)  # doctest: +SKIP

    An XQuant plan (``xquant2``: ``plan.takes_layer_input``) caches the layer input's latents:
    it takes its layer's projections first, then the layer input X (the normalised hidden
    states the model multiplies by W_k and W_v) instead of K and V; ``attend`` is the same:

    >>> plan = kvq.Plan("xquant2", head_dim=128, q_heads=32, kv_heads=8, max_seqs=4,
    ...                 max_seq_len=4096, pool_pages=128, rope_theta=500000.0,
    ...                 d_model=4096)                          # doctest: +SKIP
    >>> cache = kvq.engine.PagedCache(plan, "cuda")            # doctest: +SKIP
    >>> cache.load_projections(kvq.engine.xquant_projections(
    ...     "xquant2", k_proj.weight.T, v_proj.weight.T, kv_heads=8, head_dim=128))  # doctest: +SKIP
    >>> cache.prefill_x([0], [n], x_prompt)                    # doctest: +SKIP
    >>> cache.append_x(slots, x_step)                          # doctest: +SKIP

    An XQuant-CL plan (``xquant-cl2``: ``plan.takes_accumulator``) stores each layer's delta
    against the accumulator X̂ the model carries through its layers: every write also takes
    ``x_hat`` (X's shape, zeros before the first layer) and replaces it with the layer's, for the
    next layer's write:

    >>> x_hat = torch.zeros_like(x_step)                       # doctest: +SKIP
    >>> for cache, x in zip(layer_caches, layer_inputs):       # doctest: +SKIP
    ...     cache.append_x(slots, x, x_hat=x_hat)              # doctest: +SKIP

    ``workspace`` (a uint8 CUDA tensor of at least ``plan.workspace_bytes(device)`` bytes) lets
    caches whose calls run one after another on one stream share their scratch memory, e.g. a
    model's layers; by default each cache allocates its own.
    """

    def __init__(self, plan: Plan, device="cuda", workspace: Optional[torch.Tensor] = None):
        if not torch.cuda.is_available():
            raise InvalidArgument("kvq.engine.PagedCache needs a CUDA device (torch sees none)")
        self.plan = plan
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise InvalidArgument(f"device {self.device} (expected a CUDA device)")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = _DTYPES[plan.dtype]
        self.head_dim = plan.head_dim
        self.q_heads = plan.q_heads
        self.kv_heads = plan.kv_heads
        self.max_seqs = plan.max_seqs
        self.max_seq_len = plan.max_seq_len
        self.pool_pages = plan.pool_pages
        self.max_q_len = plan.max_q_len
        plan.load(self.device.index)

        def zeros(n, dt=torch.uint8):
            return torch.zeros(n, dtype=dt, device=self.device)

        sizes = {b.name: b.nbytes for b in plan.buffers}
        self.k_pool = zeros(sizes["k_pool"])
        self.v_pool = zeros(sizes["v_pool"])
        self.k_sink = zeros(sizes["k_sink"])
        self.v_sink = zeros(sizes["v_sink"])
        self.k_tail = zeros(sizes["k_tail"])
        self.v_tail = zeros(sizes["v_tail"])
        self.seq_lens = zeros(self.max_seqs, torch.int32)
        # Codebook schemes' own buffers (0 bytes, one byte allocated, for the others): pending
        # rings, per-slot encoder status (zero is clean), the layer's codebooks.
        self.k_pending = zeros(max(sizes["k_pending"], 1))
        self.v_pending = zeros(max(sizes["v_pending"], 1))
        self.status = zeros(max(sizes["status"], 1))
        self.codebooks = zeros(max(sizes["codebooks"], 1))
        # XQuant schemes' projections, XQuant-CL's accumulator latents (one byte for the others).
        self.xquant_weights = zeros(max(sizes["xquant_weights"], 1))
        self.xquant_accumulator = zeros(max(sizes["xquant_accumulator"], 1))
        self.takes_pre_rope_keys = plan.takes_pre_rope_keys
        self.takes_layer_input = plan.takes_layer_input
        self.takes_accumulator = plan.takes_accumulator
        self.d_model = plan.d_model
        pages = plan.max_pages_per_seq
        self.block_table = torch.full(
            (self.max_seqs, pages), -1, dtype=torch.int32, device=self.device
        )
        if self.pool_pages >= self.max_seqs * pages:
            self.block_table.copy_(
                torch.arange(self.max_seqs * pages, dtype=torch.int32).view(self.max_seqs, pages)
            )
        need = plan.workspace_bytes(self.device.index)
        if workspace is None:
            workspace = zeros(need)
        elif (workspace.dtype is not torch.uint8 or workspace.get_device() != self.device.index
              or not workspace.is_contiguous() or workspace.numel() < need):
            raise InvalidArgument(
                f"workspace is {tuple(workspace.shape)} {workspace.dtype} on {workspace.device}; "
                f"expected a contiguous uint8 tensor of at least {need} bytes on {self.device}"
            )
        self.workspace = workspace
        self._id = _plan_id(plan)
        # The buffers' addresses, taken once: eager calls pass them without touching the tensors
        # (the buffers are updated in place, never replaced).
        self._index = self.device.index
        self._addrs = _ptrs(self._buffers())
        self._workspace_addr = self.workspace.data_ptr()
        self._steps = plan._steps(self._addrs, self._workspace_addr)

    def _buffers(self) -> List[torch.Tensor]:
        return [self.k_pool, self.v_pool, self.k_sink, self.v_sink, self.k_tail, self.v_tail,
                self.seq_lens, self.block_table, self.k_pending, self.v_pending, self.status,
                self.codebooks, self.xquant_weights, self.xquant_accumulator]

    def load_codebooks(self, codebooks) -> None:
        """Writes a codebook plan's layer codebooks into the cache: ``codebooks`` is a
        ``kvq-codebooks-1`` file's path or bytes (trained for the plan's scheme and shape; anything
        else raises :class:`InvalidArgument` naming the difference). Call it before the first
        prefill."""
        if not isinstance(codebooks, (bytes, bytearray, memoryview)):
            with open(codebooks, "rb") as f:
                codebooks = f.read()
        self._steps.codebooks_load(_raw_stream(self._index), bytes(codebooks))

    def load_projections(self, projections) -> None:
        """Writes an XQuant plan's layer projections into the cache: ``projections`` is a
        ``kvq-projections-1`` file's path or bytes (:func:`xquant_projections`; made for the plan's
        d_model, KV heads and head size, else :class:`InvalidArgument` names the difference).
        Call it before the first prefill."""
        if not isinstance(projections, (bytes, bytearray, memoryview)):
            with open(projections, "rb") as f:
                projections = f.read()
        self._steps.xquant_weights_load(_raw_stream(self._index), bytes(projections))

    def prefill_x(self, slots: Sequence[int], tokens: Sequence[int], x: torch.Tensor,
                  x_hat: Optional[torch.Tensor] = None) -> None:
        """An XQuant plan's prefill: prompts' layer input packed back to back (``x``:
        ``[Σ tokens, d_model]``, prompt ``i`` of ``tokens[i]`` tokens after prompts ``< i``) into
        the empty slots ``slots`` (host lists), projected to latents and stored. An XQuant-CL plan
        also takes the accumulator ``x_hat`` of the same rows and replaces it with the layer's."""
        want = (sum(int(t) for t in tokens), self.d_model)
        self._check("x", x, want, self.dtype)
        slots, tokens = [int(s) for s in slots], [int(t) for t in tokens]
        stream = _raw_stream(self._index)
        if self._x_hat(x_hat, want):
            self._steps.xquant_prefill_cross_layer(stream, slots, tokens, x.data_ptr(),
                                                   x_hat.data_ptr())
        else:
            self._steps.xquant_prefill(stream, slots, tokens, x.data_ptr())

    def append_x(self, slots: torch.Tensor, x: torch.Tensor,
                 x_hat: Optional[torch.Tensor] = None) -> None:
        """An XQuant plan's append: one token's layer input for each slot of ``slots`` (``x``:
        ``[n, d_model]``), projected to latents and stored. An XQuant-CL plan also takes the
        accumulator ``x_hat`` (``[n, d_model]``) and replaces it with the layer's."""
        n = self._check_slots(slots)
        self._check("x", x, (n, self.d_model), self.dtype)
        cross_layer = self._x_hat(x_hat, (n, self.d_model))
        if torch.compiler.is_compiling():
            if cross_layer:
                torch.ops.kvq.xquant_append_cross_layer(self._id, *self._buffers(), slots, x,
                                                        x_hat, self.workspace)
            else:
                torch.ops.kvq.xquant_append(self._id, *self._buffers(), slots, x, self.workspace)
        elif cross_layer:
            self._steps.xquant_append_cross_layer(_raw_stream(self._index), n, slots.data_ptr(),
                                                  x.data_ptr(), x_hat.data_ptr())
        else:
            self._steps.xquant_append(_raw_stream(self._index), n, slots.data_ptr(), x.data_ptr())

    def _x_hat(self, x_hat: Optional[torch.Tensor], want: tuple) -> bool:
        """Whether the write takes the accumulator, after checking ``x_hat`` against the plan."""
        if not self.takes_accumulator:
            if x_hat is not None:
                raise InvalidArgument(
                    f"`{self.plan.scheme}` caches the layer input's latents: it takes no x_hat"
                )
            return False
        if x_hat is None:
            raise InvalidArgument(
                f"`{self.plan.scheme}` stores deltas against the accumulator: pass x_hat (X's "
                "shape; zeros before the first layer), which the write replaces with the layer's"
            )
        self._check("x_hat", x_hat, want, self.dtype)
        return True

    def check(self) -> None:
        """Waits for the device and raises :class:`InvalidArgument` for what a codebook plan's
        encoders refused since the last check (a NaN, infinite or out-of-range key or value, a
        scale past f16): such a token was not appended, and its slot took no later token until
        this call, which clears the flag. Does nothing for other plans."""
        self._steps.check(_raw_stream(self._index))

    def _pre_rope(self, k_pre_rope: Optional[torch.Tensor], want: tuple) -> int:
        """The address of ``k_pre_rope`` after checking it against the plan's need for it."""
        if not self.takes_pre_rope_keys:
            return 0
        if k_pre_rope is None:
            raise InvalidArgument(
                f"`{self.plan.scheme}` codes keys before RoPE: pass k_pre_rope (the keys before "
                "RoPE, k's shape) beside k"
            )
        self._check("k_pre_rope", k_pre_rope, want, self.dtype)
        return k_pre_rope.data_ptr()

    def _check(self, name: str, t: torch.Tensor, want: tuple, dtype) -> None:
        """Refuses ``t`` unless it is a contiguous ``want``-shaped ``dtype`` tensor on the cache's
        device: one cheap test on the hot path, the message only on failure."""
        if (t.shape != want or t.dtype is not dtype or t.get_device() != self._index
                or not t.is_contiguous()):
            if t.dtype is dtype and t.get_device() == self._index and t.shape == want:
                raise InvalidArgument(f"{name} is not contiguous")
            raise InvalidArgument(
                f"{name} is {tuple(t.shape)} {t.dtype} on {t.device}; expected {tuple(want)} "
                f"{dtype} on {self.device}"
            )

    def _check_slots(self, slots: torch.Tensor) -> int:
        """The step's sequence count, after checking ``slots``."""
        if (slots.dtype is not torch.int32 or slots.dim() != 1
                or slots.get_device() != self._index or not slots.is_contiguous()):
            if (slots.dtype is torch.int32 and slots.dim() == 1
                    and slots.get_device() == self._index):
                raise InvalidArgument("slots is not contiguous")
            raise InvalidArgument(
                f"slots is {tuple(slots.shape)} {slots.dtype} on {slots.device}; expected a 1-D "
                f"int32 tensor on {self.device}"
            )
        n = slots.shape[0]
        if n > self.max_seqs:
            raise InvalidArgument(
                f"{n} rows, more than the plan's max_seqs ({self.max_seqs})"
            )
        return n

    def _step_rows(self, name: str, t: torch.Tensor, n: int, heads: int) -> Tuple[int, tuple]:
        """``(q_len, shape)`` of a step's ``[n, heads, head_dim]`` (one token a sequence) or
        ``[n, q_len, heads, head_dim]`` tensor, after checking it."""
        shape = t.shape
        if len(shape) == 4:
            q_len, want = shape[1], (n, shape[1], heads, self.head_dim)
        else:
            q_len, want = 1, (n, heads, self.head_dim)
        self._check(name, t, want, self.dtype)
        if not 1 <= q_len <= self.max_q_len:
            raise InvalidArgument(
                f"{name} holds {q_len} tokens a sequence; the plan's max_q_len is {self.max_q_len}"
            )
        return q_len, want

    def prefill(self, slots: Sequence[int], tokens: Sequence[int], k: torch.Tensor,
                v: torch.Tensor, k_pre_rope: Optional[torch.Tensor] = None) -> None:
        """Stores prompts packed back to back (``k``, ``v``: ``[Σ tokens, kv_heads, head_dim]``,
        prompt ``i`` of ``tokens[i]`` tokens after prompts ``< i``) into the empty slots
        ``slots`` (host lists). A prompt of 0 tokens empties its slot. ``k_pre_rope`` (``k``'s
        shape): the same keys before RoPE, which plans coding keys before RoPE
        (``plan.takes_pre_rope_keys``: CommVQ) need."""
        if self.takes_layer_input:
            raise InvalidArgument(
                f"`{self.plan.scheme}` caches the layer input's latents: call prefill_x with X"
            )
        want = (sum(int(t) for t in tokens), self.kv_heads, self.head_dim)
        self._check("k", k, want, self.dtype)
        self._check("v", v, want, self.dtype)
        pre = self._pre_rope(k_pre_rope, want)
        self._steps.prefill(_raw_stream(self._index), [int(s) for s in slots],
                            [int(t) for t in tokens], k.data_ptr(), v.data_ptr(), pre)

    def append(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               k_pre_rope: Optional[torch.Tensor] = None) -> None:
        """Adds the step's new tokens to each slot of ``slots``: ``k``, ``v`` are
        ``[n, kv_heads, head_dim]`` (one token a sequence) or ``[n, q_len, kv_heads, head_dim]``;
        ``k_pre_rope`` as for :meth:`prefill`."""
        if self.takes_layer_input:
            raise InvalidArgument(
                f"`{self.plan.scheme}` caches the layer input's latents: call append_x with X"
            )
        n = self._check_slots(slots)
        q_len, want = self._step_rows("k", k, n, self.kv_heads)
        self._check("v", v, want, self.dtype)
        pre = self._pre_rope(k_pre_rope, want)
        if torch.compiler.is_compiling():
            shape = (n, q_len, self.kv_heads, self.head_dim)
            k_pre = None if pre == 0 else k_pre_rope.view(shape)
            torch.ops.kvq.append(self._id, *self._buffers(), slots, k.view(shape), v.view(shape),
                                 k_pre)
        else:
            self._steps.append(_raw_stream(self._index), n, q_len, slots.data_ptr(),
                               k.data_ptr(), v.data_ptr(), pre)

    def attend(self, slots: torch.Tensor, q: torch.Tensor, out: Optional[torch.Tensor] = None,
               lse: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        """Attention of the step's query tokens over each slot's cache: ``q`` is
        ``[n, q_heads, head_dim]`` (decode) or ``[n, q_len, q_heads, head_dim]`` (the slot's last
        ``q_len`` tokens, token ``j`` seeing the tokens up to itself), sequence ``i`` for slot
        ``slots[i]``. Returns the output (``q``'s shape and dtype) and the log-sum-exp of each
        row's scores (``q``'s shape without ``head_dim``, float32, natural log), written into
        ``out`` and ``lse`` when given (an engine's own buffers: no allocation)."""
        n = self._check_slots(slots)
        q_len, want = self._step_rows("q", q, n, self.q_heads)
        if torch.compiler.is_compiling():
            shape = (n, q_len, self.q_heads, self.head_dim)
            o, s = torch.ops.kvq.attend(self._id, *self._buffers(), slots, q.view(shape),
                                        self.workspace)
            o, s = o.view(q.shape), s.view(q.shape[:-1])
            if out is not None:
                out.copy_(o)
                o = out
            if lse is not None:
                lse.copy_(s)
                s = lse
            return o, s
        if out is None:
            out = torch.empty_like(q)
        else:
            self._check("out", out, want, self.dtype)
        if lse is None:
            lse = q.new_empty(want[:-1], dtype=torch.float32)
        else:
            self._check("lse", lse, want[:-1], torch.float32)
        self._steps.attend(_raw_stream(self._index), n, q_len, slots.data_ptr(), q.data_ptr(),
                           out.data_ptr(), lse.data_ptr())
        return out, lse


def merge(plan: Plan, outs: torch.Tensor, lses: torch.Tensor,
          out: Optional[torch.Tensor] = None,
          lse: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merges attention states of disjoint parts of each row's tokens (``outs``:
    ``[parts, rows..., head_dim]``, ``lses``: ``[parts, rows...]`` float32, e.g. gathered from the
    GPUs of a context-parallel group) into the state over all of them: ``(out, lse)``, written
    into ``out`` and ``lse`` when given."""
    parts = outs.shape[0]
    if (lses.dtype is not torch.float32 or lses.shape != outs.shape[:-1] or not outs.is_contiguous()
            or not lses.is_contiguous() or lses.get_device() != outs.get_device()
            or outs.shape[-1] != plan.head_dim or outs.dtype is not _DTYPES[plan.dtype]):
        raise InvalidArgument(
            f"outs {tuple(outs.shape)} {outs.dtype} and lses {tuple(lses.shape)} {lses.dtype}: "
            f"expected contiguous [parts, rows..., {plan.head_dim}] {_DTYPES[plan.dtype]} and "
            "[parts, rows...] float32 on one device"
        )
    if out is None:
        out = torch.empty_like(outs[0])
    elif (out.shape != outs.shape[1:] or out.dtype is not outs.dtype or not out.is_contiguous()
          or out.get_device() != outs.get_device()):
        raise InvalidArgument(
            f"out is {tuple(out.shape)} {out.dtype}; expected a contiguous {tuple(outs.shape[1:])} "
            f"{outs.dtype} tensor on {outs.device}"
        )
    if lse is None:
        lse = lses.new_empty(lses.shape[1:])
    elif (lse.shape != lses.shape[1:] or lse.dtype is not torch.float32
          or not lse.is_contiguous() or lse.get_device() != outs.get_device()):
        raise InvalidArgument(
            f"lse is {tuple(lse.shape)} {lse.dtype}; expected a contiguous "
            f"{tuple(lses.shape[1:])} float32 tensor on {outs.device}"
        )
    plan._merge(_raw_stream(outs.get_device()), outs.data_ptr(), lses.data_ptr(), parts,
                lse.numel(), out.data_ptr(), lse.data_ptr())
    return out, lse
