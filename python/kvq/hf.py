"""kvq inside Hugging Face transformers: a ``Cache`` whose decode attention runs on kvq's kernels.

:class:`KvqCache` holds every layer's K and V in a :class:`kvq.engine.PagedCache` (one kvq plan
for all layers) and switches the model to the ``"kvq"`` attention function, so that
``model.generate(...)`` and a forward with ``past_key_values=cache`` of any model whose attention
calls ``past_key_values.update(...)`` and then the registered attention function (Llama, Mistral,
Qwen2, ...) decode over the quantized cache:

- **prefill** (the first forward, longer than ``max_q_len`` tokens, or any first forward with
  ``prefill="model"``): the prompt's K and V go into the cache; its attention runs on the model's
  own SDPA over the unquantized prompt;
- **every later step** (at most ``max_q_len`` tokens a sequence): the new tokens are appended to
  the cache and their attention runs on kvq's fused kernels over the quantized pages and the FP16
  windows, each token over the tokens up to itself.

>>> import torch, transformers, kvq.hf                                  # doctest: +SKIP
>>> model = transformers.AutoModelForCausalLM.from_pretrained(
...     path, dtype=torch.float16).cuda()                               # doctest: +SKIP
>>> cache = kvq.hf.KvqCache(model, "kivi2", max_batch=1, max_seq_len=4096)  # doctest: +SKIP
>>> out = model.generate(ids, past_key_values=cache, max_new_tokens=64)  # doctest: +SKIP

:func:`token_nll` measures a text's per-token loss through the cache as decoding sees it
(teacher forcing, :mod:`kvq.schedule`), on the GPU or on kvq's CPU reference; ``python -m
kvq.eval`` tabulates it per scheme.

Sequences are unpadded: a batch is prompts of one length (a padded attention mask is refused,
since the cache would keep the padding). Beam search and cropping are refused too. A forward
without a :class:`KvqCache` on a model switched to ``"kvq"`` runs transformers' SDPA, as before.
"""

import math
from typing import List, Optional

import torch
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
from transformers.modeling_utils import AttentionInterface

from . import _kvq
from ._kvq import InvalidArgument, Plan, UnsupportedShape
from .engine import PagedCache
from .schedule import step_lengths

__all__ = ["KvqCache", "enable", "token_nll"]

_NAME = "kvq"


def _mask(*args, **kwargs):
    """SDPA's mask, after refusing padding: kvq's cache would keep padded tokens."""
    am = kwargs.get("attention_mask")
    if am is not None and am.dim() == 2 and not bool(am.all()):
        raise InvalidArgument(
            "the attention mask pads some sequences; kvq.hf caches unpadded sequences: give "
            "prompts of one length (or one at a time)"
        )
    return sdpa_mask(*args, **kwargs)


def _attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The ``"kvq"`` attention function: kvq's kernels (or the CPU reference) where the keys came
    from a :class:`KvqCache` step, the model's own SDPA for prefill and cache-less forwards."""
    step = getattr(key, "_kvq_step", None)
    if step is None or step.mode == "model":
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    layer = step.layer
    b, heads, t, d = query.shape
    if not layer.checked:  # what the attention module asks for, once a layer
        if scaling is not None and not math.isclose(scaling, d ** -0.5, rel_tol=1e-6):
            raise UnsupportedShape(
                f"the model scales scores by {scaling}; kvq's kernels scale them by "
                f"1/sqrt(head_dim) = {d ** -0.5}"
            )
        if kwargs.get("sliding_window") or getattr(module, "sliding_window", None):
            raise UnsupportedShape("sliding-window attention layers are not served by kvq")
        layer.checked = True
    q = query.transpose(1, 2)  # [b, t, heads, d], what kvq's steps take
    if step.mode == "reference":
        return layer.reference_attention(q, step.k, step.v), None
    q = q[:, 0].contiguous() if t == 1 else q.contiguous()
    out, _ = layer.paged.attend(layer.owner.slots(b), q)
    return out.view(b, t, heads, d), None


def enable(model) -> None:
    """Registers kvq's attention and mask functions with transformers (once) and switches
    ``model`` to them. :class:`KvqCache` calls it."""
    AttentionInterface.register(_NAME, _attention)
    AttentionMaskInterface.register(_NAME, _mask)
    if model.config._attn_implementation != _NAME:
        model.set_attn_implementation(_NAME)


class _Step:
    """What a layer's ``update`` hands its attention call, riding on the key tensor it returns."""

    __slots__ = ("layer", "mode", "k", "v")

    def __init__(self, layer, mode, k=None, v=None):
        self.layer, self.mode, self.k, self.v = layer, mode, k, v


class KvqLayer(CacheLayerMixin):
    """One layer's cache: a :class:`kvq.engine.PagedCache` (``backend="gpu"``), or nothing but
    the step's K and V for the CPU reference (``backend="reference"``)."""

    is_compileable = False
    is_croppable = False
    is_sliding = False

    def __init__(self, owner: "KvqCache"):
        super().__init__()
        self.owner = owner
        self.length = 0
        self.batch = 0
        self.paged = (PagedCache(owner.plan, owner.device, owner.workspace)
                      if owner.backend == "gpu" else None)
        self.checked = False

    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        owner = self.owner
        b, _, t, _ = key_states.shape
        if self.length == 0:
            if b > owner.max_batch:
                raise InvalidArgument(f"a batch of {b}; the cache holds {owner.max_batch}")
            self.batch = b
        elif b != self.batch:
            raise InvalidArgument(f"a step of {b} sequences on a cache of {self.batch}")
        if self.length + t > owner.max_seq_len:
            raise InvalidArgument(
                f"{self.length + t} tokens; the cache holds {owner.max_seq_len} a sequence "
                "(max_seq_len)"
            )
        k = key_states.transpose(1, 2)  # [b, t, kv_heads, d]
        v = value_states.transpose(1, 2)
        if owner.backend == "reference":
            if self.length != 0:
                raise InvalidArgument(
                    "the reference backend takes one forward of whole sequences from an empty "
                    "cache"
                )
            step = _Step(self, "reference", k, v)
        elif self.length == 0 and (owner.prefill == "model" or t > owner.max_q_len):
            shape = (b * t, owner.plan.kv_heads, owner.plan.head_dim)
            self.paged.prefill(range(b), [t] * b, k.reshape(shape).contiguous(),
                               v.reshape(shape).contiguous())
            step = _Step(self, "model")
        else:
            if t > owner.max_q_len:
                raise InvalidArgument(
                    f"a step of {t} tokens; the cache's plan takes at most {owner.max_q_len} "
                    "after the prompt (KvqCache(max_q_len=...))"
                )
            slots = owner.slots(b)
            if t == 1:
                self.paged.append(slots, k[:, 0].contiguous(), v[:, 0].contiguous())
            else:
                self.paged.append(slots, k.contiguous(), v.contiguous())
            step = _Step(self, "kvq")
        self.length += t
        key_states._kvq_step = step
        return key_states, value_states

    def reference_attention(self, q, k, v) -> torch.Tensor:
        """Every token's attention over the tokens up to itself as the cache holds them, on the
        CPU reference (``q`` ``[b, t, heads, d]``, ``k``/``v`` ``[b, t, kv_heads, d]``)."""
        plan = self.owner.plan
        outs = []
        for i in range(q.shape[0]):
            def host(x):
                return x[i].detach().to("cpu", torch.float32).contiguous().numpy().tobytes()

            t = q.shape[1]
            out, _ = _kvq._reference_every_token(plan, t, host(q), host(k), host(v))
            outs.append(torch.frombuffer(bytearray(out), dtype=torch.float32).view(
                t, plan.q_heads, plan.head_dim))
        return torch.stack(outs).to(q.device, q.dtype)

    def get_mask_sizes(self, query_length: int):
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.owner.max_seq_len

    def reset(self) -> None:
        if self.paged is not None:
            self.paged.seq_lens.zero_()
        self.length = 0

    def reorder_cache(self, beam_idx) -> None:
        raise InvalidArgument("kvq.hf's cache does not reorder sequences (no beam search)")

    def crop(self, tokens_to_remove: int) -> None:
        raise InvalidArgument("kvq.hf's cache cannot drop tokens (no crop, no assisted decoding)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise InvalidArgument("kvq.hf's cache cannot repeat sequences (num_return_sequences=1)")

    def batch_select_indices(self, indices) -> None:
        raise InvalidArgument("kvq.hf's cache cannot select sequences")


class KvqCache(Cache):
    """Every layer of ``model`` on a kvq cache of ``scheme`` (a built-in's name or scheme text)
    for up to ``max_batch`` sequences of ``max_seq_len`` tokens, steps after the prompt of up to
    ``max_q_len`` tokens. Switches ``model`` to kvq's attention function (:func:`enable`).

    ``prefill="model"`` stores the first forward's tokens and runs their attention on the model's
    SDPA; ``"kvq"`` sends every step of at most ``max_q_len`` tokens, the first too, through
    kvq's kernels (teacher forcing). ``backend="reference"`` computes attention on kvq's CPU
    reference instead of the GPU (one forward of whole sequences, for checking).

    ``kv_bytes`` is the device memory the cache's buffers take (every layer)."""

    def __init__(self, model, scheme: str, *, max_batch: int, max_seq_len: int,
                 max_q_len: int = 1, prefill: str = "model", backend: str = "gpu",
                 device: Optional[torch.device] = None):
        if prefill not in ("model", "kvq"):
            raise InvalidArgument(f"prefill={prefill!r} (expected 'model' or 'kvq')")
        if backend not in ("gpu", "reference"):
            raise InvalidArgument(f"backend={backend!r} (expected 'gpu' or 'reference')")
        c = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        q_heads = c.num_attention_heads
        kv_heads = getattr(c, "num_key_value_heads", None) or q_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // q_heads
        dtype = {torch.float16: "float16", torch.bfloat16: "bfloat16"}.get(model.dtype)
        if dtype is None:
            raise InvalidArgument(
                f"the model runs in {model.dtype}; kvq's kernels take float16 or bfloat16 "
                "(load it with dtype=torch.float16)"
            )
        limits = dict(head_dim=head_dim, q_heads=q_heads, kv_heads=kv_heads, max_seqs=max_batch,
                      max_seq_len=max_seq_len, dtype=dtype, max_q_len=max_q_len)
        pages = Plan(scheme, pool_pages=1, **limits).max_pages_per_seq
        self.plan = Plan(scheme, pool_pages=max_batch * pages, **limits)
        self.device = torch.device(device) if device is not None else model.device
        self.max_batch, self.max_seq_len, self.max_q_len = max_batch, max_seq_len, max_q_len
        self.prefill, self.backend = prefill, backend
        layers = c.num_hidden_layers
        self.kv_bytes = self.plan.total_bytes * layers if backend == "gpu" else 0
        # The layers run one after another on one stream: one workspace serves them all.
        self.workspace = None
        if backend == "gpu":
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            self.device = torch.device("cuda", index)
            self.workspace = torch.zeros(self.plan.workspace_bytes(index), dtype=torch.uint8,
                                         device=self.device)
        self._slots = {}
        enable(model)
        super().__init__(layers=[KvqLayer(self) for _ in range(layers)])

    def slots(self, n: int) -> torch.Tensor:
        """Slots 0..n-1 as the int32 tensor the kernels take (made once per batch size)."""
        s = self._slots.get(n)
        if s is None:
            s = self._slots[n] = torch.arange(n, dtype=torch.int32, device=self.device)
        return s

    def step_lengths(self, tokens: int, chunk: int) -> List[int]:
        """Steps from an empty cache to ``tokens`` tokens that show every token the cache as
        one-token decoding does (:func:`kvq.schedule.step_lengths`)."""
        return step_lengths(tokens, self.plan.page_fill_lengths(tokens), chunk)


def _nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(
        logits.float().transpose(1, 2), targets, reduction="none")


@torch.no_grad()
def token_nll(model, ids: torch.Tensor, scheme: Optional[str] = None, *, chunk: int = 32,
              backend: str = "gpu") -> torch.Tensor:
    """Negative log-likelihood (nats) of tokens ``1..n`` of each row of ``ids`` (``[b, n]``)
    given the tokens before it: ``[b, n − 1]`` float32.

    ``scheme=None``: one forward with the model's own attention over the unquantized sequence.
    Otherwise every token attends as decoding over a kvq cache of ``scheme`` shows it: steps of at
    most ``chunk`` tokens through kvq's kernels (``backend="gpu"``), or one forward whose attention
    the CPU reference computes (``backend="reference"``)."""
    b, n = ids.shape
    if scheme is None:
        return _nll(model(ids, use_cache=False).logits[:, :-1], ids[:, 1:])
    if backend == "reference":
        cache = KvqCache(model, scheme, max_batch=b, max_seq_len=n, max_q_len=n, prefill="kvq",
                         backend="reference")
        logits = model(ids, past_key_values=cache, use_cache=True).logits
        return _nll(logits[:, :-1], ids[:, 1:])
    cache = KvqCache(model, scheme, max_batch=b, max_seq_len=n, max_q_len=chunk, prefill="kvq")
    parts, at = [], 0
    for t in cache.step_lengths(n, chunk):
        logits = model(ids[:, at:at + t], past_key_values=cache, use_cache=True).logits
        end = min(at + t, n - 1)
        if end > at:
            parts.append(_nll(logits[:, :end - at], ids[:, at + 1:end + 1]))
        at += t
    return torch.cat(parts, dim=1)
