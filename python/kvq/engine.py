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

from ._kvq import InvalidArgument, Plan

__all__ = ["PagedCache", "merge"]

# Plans by id for the custom ops, which take only tensors and numbers.
_PLANS: dict = {}

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _plan_id(plan: Plan) -> int:
    _PLANS.setdefault(id(plan), plan)
    return id(plan)


def _stream(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream


def _ptrs(buffers: Sequence[torch.Tensor]) -> List[int]:
    return [t.data_ptr() for t in buffers]


@torch.library.custom_op(
    "kvq::append",
    mutates_args=("k_pool", "v_pool", "k_sink", "v_sink", "k_tail", "v_tail", "seq_lens"),
)
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
    slots: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    # k, v: [n, q_len, kv_heads, head_dim]
    buffers = [k_pool, v_pool, k_sink, v_sink, k_tail, v_tail, seq_lens, block_table]
    _PLANS[plan_id]._append(
        _ptrs(buffers), _stream(k.device), slots.numel(), k.shape[1], slots.data_ptr(),
        k.data_ptr(), v.data_ptr(),
    )


@_append.register_fake
def _(plan_id, k_pool, v_pool, k_sink, v_sink, k_tail, v_tail, seq_lens, block_table, slots, k, v):
    return None


@torch.library.custom_op("kvq::attend", mutates_args=("workspace",))
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
    slots: torch.Tensor,
    q: torch.Tensor,
    workspace: torch.Tensor,
) -> Tuple[torch.Tensor, torch.Tensor]:
    # q: [n, q_len, q_heads, head_dim]
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    buffers = [k_pool, v_pool, k_sink, v_sink, k_tail, v_tail, seq_lens, block_table]
    _PLANS[plan_id]._attend(
        _ptrs(buffers), _stream(q.device), slots.numel(), q.shape[1], slots.data_ptr(),
        q.data_ptr(), out.data_ptr(), lse.data_ptr(), workspace.data_ptr(),
    )
    return out, lse


@_attend.register_fake
def _(plan_id, k_pool, v_pool, k_sink, v_sink, k_tail, v_tail, seq_lens, block_table, slots, q,
      workspace):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


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
    """

    def __init__(self, plan: Plan, device="cuda"):
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
        pages = plan.max_pages_per_seq
        self.block_table = torch.full(
            (self.max_seqs, pages), -1, dtype=torch.int32, device=self.device
        )
        if self.pool_pages >= self.max_seqs * pages:
            self.block_table.copy_(
                torch.arange(self.max_seqs * pages, dtype=torch.int32).view(self.max_seqs, pages)
            )
        self.workspace = zeros(plan.workspace_bytes(self.device.index))
        self._id = _plan_id(plan)

    def _buffers(self) -> List[torch.Tensor]:
        return [self.k_pool, self.v_pool, self.k_sink, self.v_sink, self.k_tail, self.v_tail,
                self.seq_lens, self.block_table]

    def _check(self, name: str, t: torch.Tensor, rows, heads: int, dtype=None) -> None:
        want = tuple(rows if isinstance(rows, tuple) else (rows,)) + (heads, self.head_dim)
        dtype = dtype or self.dtype
        if t.device != self.device or t.dtype != dtype or tuple(t.shape) != want:
            raise InvalidArgument(
                f"{name} is {tuple(t.shape)} {t.dtype} on {t.device}; expected {want} {dtype} "
                f"on {self.device}"
            )
        if not t.is_contiguous():
            raise InvalidArgument(f"{name} is not contiguous")

    def _check_slots(self, slots: torch.Tensor) -> None:
        if slots.device != self.device or slots.dtype != torch.int32 or slots.dim() != 1:
            raise InvalidArgument(
                f"slots is {tuple(slots.shape)} {slots.dtype} on {slots.device}; expected a 1-D "
                f"int32 tensor on {self.device}"
            )
        if not slots.is_contiguous():
            raise InvalidArgument("slots is not contiguous")
        if slots.numel() > self.max_seqs:
            raise InvalidArgument(
                f"{slots.numel()} rows, more than the plan's max_seqs ({self.max_seqs})"
            )

    def prefill(self, slots: Sequence[int], tokens: Sequence[int], k: torch.Tensor,
                v: torch.Tensor) -> None:
        """Stores prompts packed back to back (``k``, ``v``: ``[Σ tokens, kv_heads, head_dim]``,
        prompt ``i`` of ``tokens[i]`` tokens after prompts ``< i``) into the empty slots
        ``slots`` (host lists). A prompt of 0 tokens empties its slot."""
        total = sum(int(t) for t in tokens)
        self._check("k", k, total, self.kv_heads)
        self._check("v", v, total, self.kv_heads)
        self.plan._prefill(
            _ptrs(self._buffers()), _stream(self.device), [int(s) for s in slots],
            [int(t) for t in tokens], k.data_ptr(), v.data_ptr(), self.workspace.data_ptr(),
        )

    def _q_len(self, name: str, t: torch.Tensor) -> int:
        """A step's query tokens a sequence: 1 for ``[n, heads, head_dim]``, ``t.shape[1]`` for
        ``[n, q_len, heads, head_dim]``."""
        q_len = t.shape[1] if t.dim() == 4 else 1
        if not 1 <= q_len <= self.max_q_len:
            raise InvalidArgument(
                f"{name} holds {q_len} tokens a sequence; the plan's max_q_len is {self.max_q_len}"
            )
        return q_len

    def append(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Adds the step's new tokens to each slot of ``slots``: ``k``, ``v`` are
        ``[n, kv_heads, head_dim]`` (one token a sequence) or ``[n, q_len, kv_heads, head_dim]``."""
        self._check_slots(slots)
        q_len = self._q_len("k", k)
        n = slots.numel()
        self._check("k", k, (n, q_len) if k.dim() == 4 else n, self.kv_heads)
        self._check("v", v, (n, q_len) if k.dim() == 4 else n, self.kv_heads)
        shape = (n, q_len, self.kv_heads, self.head_dim)
        if torch.compiler.is_compiling():
            torch.ops.kvq.append(self._id, *self._buffers(), slots, k.view(shape), v.view(shape))
        else:
            self.plan._append(_ptrs(self._buffers()), _stream(self.device), n, q_len,
                              slots.data_ptr(), k.data_ptr(), v.data_ptr())

    def attend(self, slots: torch.Tensor, q: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Attention of the step's query tokens over each slot's cache: ``q`` is
        ``[n, q_heads, head_dim]`` (decode) or ``[n, q_len, q_heads, head_dim]`` (the slot's last
        ``q_len`` tokens, token ``j`` seeing the tokens up to itself), sequence ``i`` for slot
        ``slots[i]``. Returns the output (``q``'s shape and dtype) and the log-sum-exp of each
        row's scores (``q``'s shape without ``head_dim``, float32, natural log)."""
        self._check_slots(slots)
        q_len = self._q_len("q", q)
        n = slots.numel()
        self._check("q", q, (n, q_len) if q.dim() == 4 else n, self.q_heads)
        shape = (n, q_len, self.q_heads, self.head_dim)
        if torch.compiler.is_compiling():
            out, lse = torch.ops.kvq.attend(self._id, *self._buffers(), slots, q.view(shape),
                                            self.workspace)
            return out.view(q.shape), lse.view(q.shape[:-1])
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        self.plan._attend(_ptrs(self._buffers()), _stream(self.device), n, q_len,
                          slots.data_ptr(), q.data_ptr(), out.data_ptr(), lse.data_ptr(),
                          self.workspace.data_ptr())
        return out, lse


def merge(plan: Plan, outs: torch.Tensor, lses: torch.Tensor,
          out: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
    """Merges attention states of disjoint parts of each row's tokens (``outs``:
    ``[parts, rows..., head_dim]``, ``lses``: ``[parts, rows...]`` float32, e.g. gathered from the
    GPUs of a context-parallel group) into the state over all of them: ``(out, lse)``."""
    parts = outs.shape[0]
    rows = lses[0].numel()
    if lses.dtype != torch.float32 or lses.shape[0] != parts or not outs.is_contiguous():
        raise InvalidArgument(
            f"outs {tuple(outs.shape)} and lses {tuple(lses.shape)} {lses.dtype}: expected "
            "contiguous [parts, rows..., head_dim] and [parts, rows...] float32"
        )
    if out is None:
        out = torch.empty_like(outs[0])
    lse = torch.empty(lses.shape[1:], dtype=torch.float32, device=lses.device)
    plan._merge(_stream(outs.device), outs.data_ptr(), lses.contiguous().data_ptr(), parts, rows,
                out.data_ptr(), lse.data_ptr())
    return out, lse
