"""The kernel contract a context-parallel ring needs: attention of one (query chunk, key chunk) pair of a sharded
sequence, the merge of a query chunk's partial results through their log-sum-exps, and the backward of a pair.

A sequence cut into chunks (one or two per GPU) is attended pair by pair. Every chunk carries its position in the
unsharded sequence (`q_start`, `k_start`: the position of its first token), and the options mean what they mean for
unsharded self-attention: a query at position p sees a key at position t iff p - left <= t <= p + right (`causal`
is right = 0; -1 is unbounded). From the two positions each pair works out what the kernels must run: the diagonal
pair of equal chunks is causal, a key chunk wholly in a query chunk's past is full, one in its future (or outside
its window) is skipped, and a window cut by chunk borders becomes fa2's bottom-right aligned window on the rows and
keys that see each other (`band`).

    parts = [chunk_fwd(q_i, k_j, v_j, q_start=s_i, k_start=s_j, causal=True) for j in ...]   # (out, lse) each
    out_i, lse_i = merge([o for o, _ in parts], [l for _, l in parts], sink=sink)     # fp32; the sink once, here
    out_i = out_i.to(q_i.dtype)
    dq_ij, dk_ij, dv_ij = chunk_bwd(dout_i, q_i, k_j, v_j, out_i, lse_i, q_start=s_i, k_start=s_j, causal=True)
    # dq_i = sum_j dq_ij, dk_j = sum_i dk_ij, dv_j = sum_i dv_ij; dsink = sum_i sink_grad(dout_i, out_i, lse_i, sink)

The sink joins each row's softmax denominator once, so it is a term of the merge (a logit with no value), not of
any pair: a pair's lse is then the log-sum-exp over its keys alone, whichever pairs a schedule skips. The merged lse
includes it, and the backward of every pair takes that merged lse (and the merged out and dO), which is all the
sink's share needs there (P = exp(s - lse) already excludes it, D = rowsum(dO * O) sees the merged O).

Layouts are fa2.fwd's: q (batch, seqlen_q, nheads, head_dim), k and v (batch, seqlen_k, nheads_k, head_dim) with
GQA/MQA heads unrepeated, lse float32 (batch, nheads, seqlen_q), natural log. Softcap and softmax_scale act per
score and pass through. Not here: ALiBi (its distance is counted from each call's own bottom-right diagonal) and
dropout (its mask is drawn per call). docs/context-parallel.md says how PyTorch's ring machinery builds on this.

`attention` runs that ring: fa2.attention of a sequence sharded over a process group, on PyTorch's templated ring
attention (its rotaters move K/V and dK/dV, its merger combines the steps' results) with the pairs above as its op.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import itertools
from typing import NamedTuple, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

from fa2 import interface, ops, reference

__all__ = ["Band", "attention", "band", "chunk_bwd", "chunk_fwd", "merge", "sink_grad"]


class Band(NamedTuple):
    """What the kernels run for a pair: its query rows q_rows and keys k_rows (slices of the chunks: the rows that
    see at least one key of the chunk, the keys that at least one row sees) with fa2's options causal and
    window_size, bottom-right aligned on those rows and keys as fa2.fwd aligns them."""
    q_rows: slice
    k_rows: slice
    causal: bool
    window_size: Tuple[int, int]


def band(q_start: int, seqlen_q: int, k_start: int, seqlen_k: int, *, causal: bool = False,
         window_size=(-1, -1)) -> Optional[Band]:
    """The rows, keys and kernel options of the pair (queries at positions [q_start, q_start + seqlen_q), keys at
    [k_start, k_start + seqlen_k)), or None where no query of the chunk sees a key of the other: a ring skips it.

    Query p sees key t iff t - p lies in [-left, right]. fa2's kernels see t - p in [sk - sq - left', sk - sq +
    right'] on rows and keys counted from the chunks' ends, so left' = left - d and right' = right + d with d the
    difference of the chunks' ends. Trimming the rows and keys that see nothing (rows before k_start - right or from
    k_end + left on, keys before q_start - left or from q_end + right on) moves d into [-right, left], where both
    are non-negative as the kernels need. A bound that cuts no score of the trimmed rectangle becomes -1, so a pair
    with the whole chunk in view runs as full attention and a causal diagonal as causal (the kernels' fast paths)."""
    left, right = reference.check_options(causal=causal, window_size=tuple(window_size), softcap=0.0, dropout_p=0.0)
    q_end, k_end = q_start + seqlen_q, k_start + seqlen_k
    # The rectangle of rows and keys that see each other: the bounds of the band, clipped to the chunks.
    q_lo, k_hi = (q_start, k_end) if right < 0 else (max(q_start, k_start - right), min(k_end, q_end + right))
    q_hi, k_lo = (q_end, k_start) if left < 0 else (min(q_end, k_end + left), max(k_start, q_start - left))
    if q_lo >= q_hi or k_lo >= k_hi:
        return None
    d = q_hi - k_hi
    kernel_left = left - d if left >= 0 and (q_hi - 1) - k_lo > left else -1
    kernel_right = right + d if right >= 0 and (k_hi - 1) - q_lo > right else -1
    rows, keys = slice(q_lo - q_start, q_hi - q_start), slice(k_lo - k_start, k_hi - k_start)
    if kernel_right == 0:
        return Band(rows, keys, True, (kernel_left, -1))
    return Band(rows, keys, False, (kernel_left, kernel_right))


def _pair_band(q: Tensor, k: Tensor, q_start: int, k_start: int, causal: bool, window_size) -> Optional[Band]:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"q and k must be (batch, seqlen, nheads, head_dim) chunks, got shapes {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    for name, start in (("q_start", q_start), ("k_start", k_start)):
        if isinstance(start, (bool, Tensor)) or not hasattr(start, "__index__"):
            raise TypeError(f"{name} must be an int (the chunk's first position in the sequence), got {start!r}")
    return band(int(q_start), q.shape[1], int(k_start), k.shape[1], causal=causal, window_size=window_size)


def chunk_fwd(q: Tensor, k: Tensor, v: Tensor, *, q_start: int, k_start: int, causal: bool = False,
              softmax_scale: Optional[float] = None, window_size=(-1, -1),
              softcap: float = 0.0) -> Tuple[Tensor, Tensor]:
    """Attention of the query chunk q (first position q_start) to the key chunk k, v (first position k_start):
    (out, lse) as fa2.fwd returns them, out like q and lse float32 (batch, nheads, seqlen_q), over this chunk's keys
    only. A row that sees no key of the chunk has out 0 and lse -inf (a merge weighs it 0); a pair that `band` skips
    launches nothing. Chunks may have any lengths; the options are those of the unsharded attention (module doc)."""
    pair = _pair_band(q, k, q_start, k_start, causal, window_size)
    batch, seqlen_q, nheads = q.shape[:3]
    if pair is None:
        return (torch.zeros(q.shape, dtype=q.dtype, device=q.device),
                torch.full((batch, nheads, seqlen_q), float("-inf"), dtype=torch.float32, device=q.device))
    options = dict(softmax_scale=softmax_scale, causal=pair.causal, window_size=pair.window_size, softcap=softcap)
    k, v = k[:, pair.k_rows], v[:, pair.k_rows]
    if pair.q_rows == slice(0, seqlen_q):
        return interface.fwd(q, k, v, **options)
    # Some rows see none of these keys: the kernel writes the others in place, those keep out 0 and lse -inf.
    out = torch.zeros(q.shape, dtype=q.dtype, device=q.device)
    lse_rows = interface.fwd(q[:, pair.q_rows], k, v, out=out[:, pair.q_rows], **options)[1]
    lse = torch.full((batch, nheads, seqlen_q), float("-inf"), dtype=lse_rows.dtype, device=q.device)
    lse[:, :, pair.q_rows] = lse_rows
    return out, lse


def chunk_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, *, q_start: int,
              k_start: int, causal: bool = False, softmax_scale: Optional[float] = None, window_size=(-1, -1),
              softcap: float = 0.0, deterministic: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """The pair's share of the gradients: (dq, dk, dv) shaped like q, k, v, from the query chunk's *merged* out (in
    q's dtype), lse (merge's, sink included) and dout, with chunk_fwd's options. Summed over the key chunks, dq is
    the query chunk's gradient; summed over the query chunks, dk and dv are the key chunk's (sum them in float32).
    Rows and keys the pair does not reach get 0; a skipped pair launches nothing."""
    pair = _pair_band(q, k, q_start, k_start, causal, window_size)
    if pair is None:
        return tuple(torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    options = dict(softmax_scale=softmax_scale, causal=pair.causal, window_size=pair.window_size, softcap=softcap,
                   deterministic=deterministic)
    rows, keys = pair.q_rows, pair.k_rows
    if rows == slice(0, q.shape[1]) and keys == slice(0, k.shape[1]):
        return interface.bwd(dout, q, k, v, out, lse.contiguous(), **options)
    # The kernel writes the gradients of the rows and keys it reaches in place; the others stay 0.
    dq, dk, dv = (torch.zeros(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    interface.bwd(dout[:, rows], q[:, rows], k[:, keys], v[:, keys], out[:, rows], lse[:, :, rows].contiguous(),
                  dq=dq[:, rows], dk=dk[:, keys], dv=dv[:, keys], **options)
    return dq, dk, dv


def merge(outs: Sequence[Tensor], lses: Sequence[Tensor], *,
          sink: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """One query chunk's attention from its partial results over disjoint key sets: out = sum_i exp(lse_i - lse)
    out_i, lse = log(sum_i exp(lse_i) [+ exp(sink_h)]). outs (batch, seqlen, nheads, head_dim) and lses (batch,
    nheads, seqlen) as chunk_fwd returns them (a row with lse -inf must have out 0, as there); a running result and a
    new part merge the same way (merge([out, o], [lse, l])). sink: (nheads,) logits, each row's one term with no
    value; pass it to exactly one merge of each query chunk. Returns out and lse in float32 (float64 for float64
    inputs); a row with no term has out 0 and lse -inf, never NaN."""
    if len(outs) != len(lses) or not outs:
        raise ValueError(f"merge needs one lse per out and at least one of each, got {len(outs)} outs and "
                         f"{len(lses)} lses")
    dtype = torch.float32
    for o in outs:
        dtype = torch.promote_types(dtype, o.dtype)
    terms = [lse.to(dtype) for lse in lses]
    if sink is not None:
        terms.append(sink.to(dtype)[None, :, None].expand_as(terms[0]))
    top = torch.stack(terms).amax(0)
    top = torch.where(torch.isneginf(top), 0.0, top)  # rows no term reaches: every weight below is 0
    weights = [torch.exp(t - top) for t in terms]
    total = sum(weights)
    lse = top + torch.log(total)
    inv_total = torch.where(total > 0, 1.0 / total, 0.0)
    out = sum((w * inv_total).transpose(1, 2)[..., None] * o.to(dtype) for w, o in zip(weights, outs))
    return out, lse


def sink_grad(dout: Tensor, out: Tensor, lse: Tensor, sink: Tensor) -> Tensor:
    """The sink's gradient from one query chunk's merged out, lse and dout (those chunk_bwd takes): float32
    (nheads,). Summed over the query chunks (all-reduced over the ranks) it is the sink's whole gradient; no pair
    contributes to it, as no pair's forward saw the sink."""
    return ops.sink_grad(dout, out, lse, sink.to(lse.dtype))


# ------------------------------------------------------------------------------------------- the ring
def attention(q: Tensor, k: Tensor, v: Tensor, *, group, causal: bool = False, softmax_scale: Optional[float] = None,
              window_size=(-1, -1), softcap: float = 0.0, sink: Optional[Tensor] = None,
              load_balance: Optional[bool] = None, deterministic: bool = False) -> Tensor:
    """fa2.attention (self-attention) of one sequence sharded over the ranks of `group` (a ProcessGroup or a 1-D
    DeviceMesh), on PyTorch's ring: torch's _templated_ring_attention and its backward move K/V (and dK/dV) between
    the ranks and merge the steps' results, and every (query chunk, key chunk) pair runs on fa2's kernels.

    q (batch, seqlen, nheads, head_dim), k and v (batch, seqlen, nheads_k, head_dim) are this rank's shard, seqlen
    the same on every rank; GQA/MQA K/V stay unrepeated and travel so. The shards are laid out as PyTorch's context
    parallelism lays out its buffers (sequence dim 1 here):
      load_balance=True: the sequence in 2n equal chunks, rank r holding chunks r and 2n-1-r one after the other
        (`_HeadTailLoadBalancer`, what `context_parallel` does when the length divides by 2n). Causal only: PyTorch's
        ring drops the pairs that causality hides before calling the op.
      load_balance=False: rank r holds the r-th of n equal contiguous pieces (`Shard(1)`, no load balancer).
      None: PyTorch's `_cp_options.enable_load_balance`, which its sharding entry points set to match their layout.

    The options mean what they mean for fa2.attention on the unsharded sequence: causal, window_size (query p sees
    key t iff p - left <= t <= p + right), softcap, softmax_scale, and sink (nheads,) logits. Pairs a window never
    sees launch nothing (their K/V still travel). Returns this rank's out, like q; differentiable in q, k, v and
    sink. The sink's gradient is this rank's queries' share, as the model weights' gradients are on a context-
    parallel rank: the data-parallel wrapper that reduces those over the CP ranks (FSDP over dp x cp) sums it, and
    without one, all-reduce it over `group` (dist.all_reduce(sink.grad, group=group)). Eager only; no ALiBi, dropout
    or packed (varlen) sequences."""
    group, load_balance = _check_ring(q, k, v, group, causal, window_size, softcap, sink, load_balance)
    options = dict(causal=causal, softmax_scale=softmax_scale, window_size=tuple(window_size), softcap=softcap)
    ring = _Ring(group, q.shape[1], load_balance, options, deterministic)
    return _RingAttention.apply(q, k, v, sink, ring)


_ENGINE_NAMES = ("_templated_ring_attention", "_templated_ring_attention_backward", "_cp_options")


def _engine():
    """The module of PyTorch's ring: torch >= 2.9 keeps it in experimental._context_parallel._attention (the older
    path experimental._attention re-exports the forward but not the backward), earlier releases in
    experimental._attention itself."""
    for name in ("torch.distributed.tensor.experimental._context_parallel._attention",
                 "torch.distributed.tensor.experimental._attention"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        if all(hasattr(module, attr) for attr in _ENGINE_NAMES):
            if next(iter(inspect.signature(module._templated_ring_attention).parameters)) != "group":
                break  # the releases before 2.9 took a DeviceMesh, with other arguments
            return module
    raise RuntimeError(f"fa2.context_parallel.attention needs PyTorch's templated ring attention "
                       f"({', '.join(_ENGINE_NAMES)} in torch.distributed.tensor.experimental, taking a process group "
                       f"first); torch {torch.__version__} has no such one: use torch >= 2.10")


def _check_ring(q, k, v, group, causal, window_size, softcap, sink, load_balance):
    """Validates the call; returns the process group and the layout (load_balance resolved)."""
    reference.check_options(causal=causal, window_size=tuple(window_size), softcap=softcap, dropout_p=0.0)
    if q.dim() != 4 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"q must be (batch, seqlen, nheads, head_dim) and k, v (batch, seqlen, nheads_k, head_dim) "
                         f"alike, got shapes {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if k.shape[:2] != q.shape[:2] or q.shape[2] % k.shape[2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"the ring runs self-attention: k and v must hold the same tokens as q (batch and seqlen "
                         f"{tuple(q.shape[:2])}) with nheads_k dividing nheads, got q {tuple(q.shape)}, k "
                         f"{tuple(k.shape)}")
    if sink is not None and sink.shape != (q.shape[2],):
        raise ValueError(f"sink must be (nheads,) = ({q.shape[2]},), got {tuple(sink.shape)}")
    if load_balance is None:
        load_balance = _engine()._cp_options.enable_load_balance
    if load_balance and not causal:
        raise ValueError("load_balance=True (PyTorch's head-tail sharding) needs causal=True: without causal, shard "
                         "the sequence in contiguous pieces and pass load_balance=False")
    if load_balance and q.shape[1] % 2:
        raise ValueError(f"load_balance=True: a rank's shard is two equal chunks, so its seqlen must be even, got "
                         f"{q.shape[1]}")
    if not isinstance(group, dist.ProcessGroup):
        if not hasattr(group, "get_group") or getattr(group, "ndim", None) != 1:
            raise TypeError(f"group must be a ProcessGroup or a 1-D DeviceMesh, got {group!r}")
        group = group.get_group()
    return group, bool(load_balance)


class _Ring:
    """One call's ring: where the chunks PyTorch's ring hands its op lie in the sequence, and the op it calls.

    The engine calls the op once per ring step, in order, leaving out only trailing steps (causal without load
    balancing); at step i the K/V came from rank (rank - i) % n. It passes heads-first tensors (batch, nheads,
    seqlen, head_dim), the transpose of fa2's layout, as views: seq_dim 2 is hard-coded there."""

    def __init__(self, group, seqlen, load_balance, options, deterministic):
        self.engine = _engine()
        self.group, self.rank, self.size = group, dist.get_rank(group), dist.get_world_size(group)
        self.seqlen, self.load_balance = seqlen, load_balance
        self.options, self.deterministic = options, deterministic
        # Without a window the engine's own flag is exact for every call it makes (causal over a load-balanced
        # shard's two chunks at step 0, full or skipped after): one launch per call, as its SDPA path runs. A window
        # needs the positions, pair by pair.
        self.windowless = options["window_size"] == (-1, -1)

    def chunks(self, rank):
        """(rows within the shard, first position in the sequence) of each chunk `rank` holds."""
        if not self.load_balance:
            return [(slice(0, self.seqlen), rank * self.seqlen)]
        half = self.seqlen // 2
        return [(slice(0, half), rank * half), (slice(half, self.seqlen), (2 * self.size - 1 - rank) * half)]

    def pairs(self, step, q_len, k_len):
        """The query chunks and key chunks in the tensors passed at `step`: the whole shards, or, after step 0 under
        load balancing, the engine's halves: the first key chunk (from an earlier rank) or the second query chunk
        (from a later one; the engine merges it into that half alone)."""
        q_chunks, k_chunks = self.chunks(self.rank), self.chunks((self.rank - step) % self.size)
        if q_len != self.seqlen:
            q_chunks = [(slice(0, q_len), q_chunks[1][1])]
        if k_len != self.seqlen:
            k_chunks = k_chunks[:1]
        return q_chunks, k_chunks

    @contextlib.contextmanager
    def engine_options(self):
        """The engine reads the layout from its global options: set it to this call's for the call's duration."""
        options = self.engine._cp_options
        saved, options.enable_load_balance = options.enable_load_balance, self.load_balance
        try:
            yield
        finally:
            options.enable_load_balance = saved

    def forward(self, q, k, v):
        """(out, lse) of this rank's queries over the whole sequence, out float32 (float64 for float64 inputs)."""
        steps = itertools.count()

        def op(query, key, value, *, is_causal, **_):
            step = next(steps)
            query, key, value = (t.transpose(1, 2) for t in (query, key, value))
            if self.windowless:
                out, lse = interface.fwd(query, key, value, causal=is_causal, softmax_scale=self.options[
                    "softmax_scale"], softcap=self.options["softcap"])
                return out.to(torch.promote_types(torch.float32, out.dtype)).transpose(1, 2), lse
            q_chunks, k_chunks = self.pairs(step, query.shape[1], key.shape[1])
            outs, lses = [], []
            for q_rows, q_start in q_chunks:
                parts = [chunk_fwd(query[:, q_rows], key[:, k_rows], value[:, k_rows], q_start=q_start,
                                   k_start=k_start, **self.options) for k_rows, k_start in k_chunks]
                out, lse = merge([o for o, _ in parts], [lse for _, lse in parts])
                outs.append(out)
                lses.append(lse)
            # Unrounded out (float32 either way): the engine merges in float32 and returns the last step's dtype.
            return torch.cat(outs, 1).transpose(1, 2), torch.cat(lses, 2)

        with self.engine_options():
            out, lse = self.engine._templated_ring_attention(
                self.group, 2, op, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                is_causal=self.options["causal"])[:2]
        return out.transpose(1, 2), lse

    def backward(self, dout, q, k, v, out, lse):
        """(dq, dk, dv) of this rank's shard from its merged out and lse (the sink's term included) and dout."""
        steps = itertools.count()

        def op(*, query, key, value, out, logsumexp, dout, is_causal):
            step = next(steps)
            query, key, value, out, dout = (t.transpose(1, 2) for t in (query, key, value, out, dout))
            if self.windowless:
                grads = interface.bwd(dout, query, key, value, out, logsumexp.contiguous(), causal=is_causal,
                                      softmax_scale=self.options["softmax_scale"], softcap=self.options["softcap"],
                                      deterministic=self.deterministic)
                return tuple(g.transpose(1, 2) for g in grads)
            q_chunks, k_chunks = self.pairs(step, query.shape[1], key.shape[1])
            acc = torch.promote_types(torch.float32, query.dtype)
            dq, dk, dv = (torch.zeros(t.shape, dtype=acc, device=t.device) for t in (query, key, value))
            for (q_rows, q_start), (k_rows, k_start) in itertools.product(q_chunks, k_chunks):
                grads = chunk_bwd(dout[:, q_rows], query[:, q_rows], key[:, k_rows], value[:, k_rows],
                                  out[:, q_rows], logsumexp[:, :, q_rows], q_start=q_start, k_start=k_start,
                                  deterministic=self.deterministic, **self.options)
                dq[:, q_rows] += grads[0]
                dk[:, k_rows] += grads[1]
                dv[:, k_rows] += grads[2]
            return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)

        with self.engine_options():
            grads = self.engine._templated_ring_attention_backward(
                self.group, 2, op, dout.transpose(1, 2), "dout", q.transpose(1, 2), k.transpose(1, 2),
                v.transpose(1, 2), out.transpose(1, 2), lse, is_causal=self.options["causal"])[:3]
        return tuple(g.transpose(1, 2) for g in grads)


class _RingAttention(torch.autograd.Function):
    """The ring forward and backward; the sink joins once, after the ring's merge (module doc)."""

    @staticmethod
    def forward(ctx, q, k, v, sink, ring):
        out, lse = ring.forward(q, k, v)
        if sink is not None:
            out, lse = merge([out], [lse], sink=sink)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse, sink)
        ctx.ring = ring
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, sink = ctx.saved_tensors
        dq, dk, dv = ctx.ring.backward(dout, q, k, v, out, lse)
        dsink = None if sink is None else sink_grad(dout, out, lse, sink).to(sink.dtype)
        return dq, dk, dv, dsink, None
