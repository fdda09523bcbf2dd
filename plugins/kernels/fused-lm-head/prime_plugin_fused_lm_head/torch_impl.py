"""``lm_head:fused`` in plain PyTorch: per-token log-probabilities and entropies straight from
the hidden states, a chunk of tokens (and optionally of vocabulary rows) at a time.

Runs on any device and dtype. The forward pass keeps one log-sum-exp per token, and the
backward pass recomputes each chunk's logits from ``hidden`` and ``weight``; with
``token_chunk = "auto"`` and logits small enough (``chunking.keeps_logits``: 8k tokens of a
150k vocabulary), it keeps the forward's logits in the inputs' dtype instead and the backward
reads them. See ``fused_logprobs``.
"""

from __future__ import annotations

import functools

import torch

from prime_plugin_fused_lm_head.chunking import backward_tiles, chunk_size_for, keeps_logits


def fused_logprobs(hidden, weight, targets, temperature=1.0, *, token_chunk, vocab_chunk=None, with_entropy=True,
                   blocks=None):
    """``log p(targets)`` and the entropy of ``softmax(hidden @ weight.T / temperature)``.

    - ``hidden [N, H]``, ``weight [V, H]`` (the LM head, possibly tied to the embedding), one
      dtype; neither needs to be contiguous. The matmuls run in that dtype.
    - ``targets [N]`` int64, each in ``[0, V)``.
    - ``temperature``: a float, or a tensor of ``N`` per-token temperatures (no gradient
      flows into it).
    - ``token_chunk``: tokens per chunk, or ``"auto"`` (``chunk_size_for`` with its default
      budget); ``vocab_chunk``: vocabulary rows per step inside a chunk (online log-sum-exp
      and entropy), ``None`` for the whole vocabulary at once. ``"auto"`` with the whole
      vocabulary also keeps the ``[N, V]`` logits in the inputs' dtype for the backward pass
      when they fit ``chunking.KEEP_BUDGET_BYTES`` (one matmul less; the same numbers, since
      the recomputation would give the same logits).

    Returns ``(logp [N], entropy [N] or None)`` in float32 (float64 for float64 inputs; the
    softmax math runs in that dtype). Gradients reach ``hidden`` and ``weight`` through
    ``logp`` only; ``entropy`` is marked non-differentiable.

    ``blocks`` does the work of one chunk (``TorchBlocks`` when ``None``; the Triton
    implementation passes its own); this function owns the chunking, the merge across
    vocabulary slices and the gradient accumulation.
    """
    blocks = blocks or TorchBlocks
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"fused_logprobs: hidden must be [N, H] and weight [V, H], got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"fused_logprobs: hidden is {hidden.dtype} but weight is {weight.dtype}")
    n, width = hidden.shape
    vocab = weight.shape[0]
    if targets.shape != (n,) or targets.dtype != torch.int64:
        raise ValueError(f"fused_logprobs: targets must be int64 of shape ({n},), got "
                         f"{targets.dtype} {tuple(targets.shape)}")
    if vocab_chunk is None:
        vocab_chunk = vocab
    # Kept only for a backward pass: without one they would only raise the forward's peak.
    backward = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    keep = (backward and token_chunk == "auto" and isinstance(vocab_chunk, int) and vocab_chunk >= vocab
            and keeps_logits(n, vocab, hidden.dtype))
    if keep and not blocks.softmax_rows:
        # The kernels work on the kept logits in place: nothing per chunk, so one chunk.
        token_chunk = max(1, n)
    elif token_chunk == "auto":
        token_chunk = chunk_size_for(n, min(vocab, vocab_chunk), width, hidden.dtype,
                                     softmax_rows=blocks.softmax_rows)
    if not isinstance(token_chunk, int) or token_chunk < 1 or not isinstance(vocab_chunk, int) or vocab_chunk < 1:
        raise ValueError(f"fused_logprobs: token_chunk ({token_chunk!r}) and vocab_chunk ({vocab_chunk!r}) "
                         "must be positive integers (token_chunk may be 'auto')")
    # An out-of-range target would silently read a clamped column; checked on the device,
    # so a GPU caller is not made to wait for it.
    torch._assert_async(((targets >= 0) & (targets < vocab)).all(),
                        f"fused_logprobs: a target is outside the vocabulary [0, {vocab})")
    logp, entropy = _FusedLogProbs.apply(hidden, weight, targets, _temperature(temperature, n, hidden, blocks),
                                         token_chunk, vocab_chunk, with_entropy, blocks, keep)
    return logp, (entropy if with_entropy else None)


def _softmax_dtype(dtype):
    return torch.promote_types(dtype, torch.float32)


def _temperature(temperature, n, hidden, blocks):
    if isinstance(temperature, torch.Tensor) or blocks.tensor_temperature:
        if not isinstance(temperature, torch.Tensor):
            # Made on the device: a host tensor's copy would wait for the forward queued before it.
            return hidden.new_full((1,), _check_positive(float(temperature)),
                                   dtype=_softmax_dtype(hidden.dtype)).expand(n)
        values = temperature.detach().to(device=hidden.device, dtype=_softmax_dtype(hidden.dtype)).reshape(-1)
        if values.numel() == 1:
            return values.expand(n)
        if values.numel() != n:
            raise ValueError(f"fused_logprobs: temperature has {values.numel()} values for {n} tokens")
        return values
    return _check_positive(float(temperature))


def _check_positive(temperature):
    if not temperature > 0:
        raise ValueError(f"fused_logprobs: temperature must be positive, got {temperature}")
    return temperature


def _spans(total, step):
    for start in range(0, total, step):
        yield start, min(total, start + step)


def _scaled_logits(h, w, temperature, logits=None):
    # The matmul stays in the inputs' dtype (bf16 tensor cores); everything after it is in
    # the softmax dtype, on a fresh tensor that can be modified in place (a copy of kept logits).
    x = (h @ w.T).to(_softmax_dtype(h.dtype)) if logits is None else logits.to(_softmax_dtype(h.dtype), copy=True)
    if isinstance(temperature, torch.Tensor):
        return x.div_(temperature[:, None])
    return x.div_(temperature) if temperature != 1.0 else x


def _target_columns(targets, start, width):
    """Each row's target column inside the vocabulary chunk at ``start`` (clamped, so it can
    be gathered), and whether the target really lies in that chunk."""
    local = targets - start
    inside = (local >= 0) & (local < width)
    return local.clamp(0, width - 1)[:, None], inside


def _merge(state, part):
    """Online log-sum-exp: combine two partial ``(max, sum of exp, sum of exp * (x - max))``
    over disjoint vocabulary chunks. The last term is kept relative to the running max, so
    the entropy never subtracts two logit-sized numbers."""
    if state is None:
        return part
    m1, s1, a1 = state
    m2, s2, a2 = part
    m = torch.maximum(m1, m2)
    w1, w2 = torch.exp(m1 - m), torch.exp(m2 - m)
    a = None if a1 is None else w1 * (a1 + s1 * (m1 - m)) + w2 * (a2 + s2 * (m2 - m))
    return m, s1 * w1 + s2 * w2, a


def _chunk_stats(x, with_entropy):
    m = x.amax(dim=-1)
    x.sub_(m[:, None])
    e = torch.exp(x)
    s = e.sum(dim=-1)
    return m, s, (e.mul_(x).sum(dim=-1) if with_entropy else None)


def _temperature_rows(temperature, start, end):
    return temperature[start:end] if isinstance(temperature, torch.Tensor) else temperature


class TorchBlocks:
    """The per-chunk work in eager PyTorch: float32 logits (two ``[chunk, vocab]`` rows at the
    peak, ``chunking.bytes_per_token``)."""

    softmax_rows = 2
    tensor_temperature = False

    @staticmethod
    def stats(h, w, temperature, targets, start, with_entropy, logits=None):
        """``(max, Σ exp, Σ exp·(x − max))`` per token of ``x = h @ w.T / T`` (the vocabulary
        slice at ``start``; ``logits``: ``h @ w.T`` already made, left unchanged), and each
        token's scaled target logit (0 where the target lies outside the slice)."""
        x = _scaled_logits(h, w, temperature, logits)
        columns, inside = _target_columns(targets, start, w.shape[0])
        target_logit = x.gather(1, columns)[:, 0].masked_fill_(~inside, 0)
        return _chunk_stats(x, with_entropy), target_logit

    @staticmethod
    def grad(h, w, temperature, targets, start, lse, coef, logits=None):
        """``d logp / d logits · upstream = (onehot(target) − exp(x − lse)) · coef`` for the
        slice at ``start`` (``coef = upstream / T``), in the inputs' dtype; from ``logits``
        when the forward kept them."""
        x = _scaled_logits(h, w, temperature, logits)
        x.sub_(lse[:, None]).exp_().mul_(-coef[:, None])
        columns, inside = _target_columns(targets, start, w.shape[0])
        x.scatter_add_(1, columns, coef.masked_fill(~inside, 0)[:, None])
        return x.to(h.dtype)


class _FusedLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, token_chunk, vocab_chunk, with_entropy, blocks, keep):
        n, vocab = hidden.shape[0], weight.shape[0]
        dtype = _softmax_dtype(hidden.dtype)
        logp = torch.empty(n, dtype=dtype, device=hidden.device)
        lse = torch.empty_like(logp)
        entropy = torch.empty_like(logp) if with_entropy else logp.new_empty(0)
        # Under autocast the forward matmul would run in another dtype than the recomputation
        # in backward (which autocast does not cover), and the softmax would not sum to one.
        with torch.autocast(hidden.device.type, enabled=False):
            # One matmul for all tokens; the backward's tiles read it (the whole vocabulary).
            kept = hidden @ weight.T if keep else None
            for t0, t1 in _spans(n, token_chunk):
                h, rows = hidden[t0:t1], targets[t0:t1]
                temp = _temperature_rows(temperature, t0, t1)
                state, target_logit = None, None
                for v0, v1 in _spans(vocab, vocab_chunk):
                    logits = None if kept is None else kept[t0:t1, v0:v1]
                    part, picked = blocks.stats(h, weight[v0:v1], temp, rows, v0, with_entropy, logits)
                    # Exactly one slice holds each target; the others contribute zeros.
                    target_logit = picked if target_logit is None else target_logit.add_(picked)
                    state = _merge(state, part)
                m, s, a = state
                log_s = torch.log(s)
                lse[t0:t1] = m + log_s
                logp[t0:t1] = target_logit - lse[t0:t1]
                if with_entropy:
                    # H = lse - E_p[x] = log s - E_p[x - m]
                    entropy[t0:t1] = log_s - a / s
        tensor_temperature = temperature if isinstance(temperature, torch.Tensor) else None
        ctx.save_for_backward(hidden, weight, targets, lse, tensor_temperature, kept)
        ctx.temperature = None if tensor_temperature is not None else temperature
        ctx.chunks = (token_chunk, vocab_chunk)
        ctx.blocks = blocks
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, _grad_entropy):
        # Kept logits are overwritten by their gradient (Triton) and so serve one backward
        # pass: a second one fails in autograd's check of the saved tensors' versions.
        hidden, weight, targets, lse, temperature, kept = ctx.saved_tensors
        if temperature is None:
            temperature = ctx.temperature
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        none = (None,) * 7
        if not (need_hidden or need_weight):
            return (None, None, *none)
        token_chunk, vocab_chunk = ctx.chunks
        n, vocab = hidden.shape[0], weight.shape[0]
        dtype = _softmax_dtype(hidden.dtype)
        vocab_outer, token_tile, vocab_tile = backward_tiles(n, vocab, token_chunk, vocab_chunk)
        token_spans, vocab_spans = list(_spans(n, token_tile)), list(_spans(vocab, vocab_tile))
        grad_hidden = _Gradient(hidden, need_hidden, dtype, summed=len(vocab_spans) > 1, whole=vocab_outer)
        grad_weight = _Gradient(weight, need_weight, dtype, summed=len(token_spans) > 1, whole=not vocab_outer)
        tiles = ([(t, v) for v in vocab_spans for t in token_spans] if vocab_outer
                 else [(t, v) for t in token_spans for v in vocab_spans])
        with torch.autocast(hidden.device.type, enabled=False):
            for (t0, t1), (v0, v1) in tiles:
                h, w, rows = hidden[t0:t1], weight[v0:v1], targets[t0:t1]
                temp = _temperature_rows(temperature, t0, t1)
                coef = grad_logp[t0:t1].to(dtype) / temp
                g = ctx.blocks.grad(h, w, temp, rows, v0, lse[t0:t1], coef,
                                    None if kept is None else kept[t0:t1, v0:v1])
                grad_hidden.add((t0, t1), g, w, last=v1 == vocab)
                grad_weight.add((v0, v1), g.T, h, last=t1 == n)
                del g
        return grad_hidden.result(), grad_weight.result(), *none


class _Gradient:
    """The gradient of ``hidden`` or ``weight``, built from the tiles' products ``a @ b``, each
    covering some of its rows.

    Rows that one tile gives whole are written straight into the result (in the inputs'
    dtype: one rounding, as a single matmul would do). Rows summed over several tiles are
    accumulated in the softmax dtype (float32 at least) and rounded once: in a buffer for the
    whole tensor when ``whole`` (its rows are revisited after the other loop moves on), else
    in one for the rows of the current span, copied out when its ``last`` tile is added."""

    def __init__(self, source, needed, dtype, *, summed, whole):
        self.needed, self.dtype, self.summed, self.whole = needed, dtype, summed, whole
        if not needed:
            return
        self.out = torch.empty(source.shape, dtype=source.dtype, device=source.device)
        self.touched = False  # no tokens: no tiles, a zero gradient
        self.buffer = (torch.zeros(source.shape, dtype=dtype, device=source.device)
                       if summed and whole else None)

    def add(self, span, a, b, *, last):
        if not self.needed:
            return
        start, end = span
        self.touched = True
        if not self.summed:
            torch.mm(a, b, out=self.out[start:end])
            return
        if self.buffer is None:
            self.buffer = torch.zeros(end - start, b.shape[1], dtype=self.dtype, device=b.device)
            self.offset = start
        rows = self.buffer[start - self.offset:end - self.offset] if not self.whole else self.buffer[start:end]
        _add_product(rows, a, b)
        if last and not self.whole:
            self.out[start:end] = self.buffer
            self.buffer = None

    def result(self):
        if not self.needed:
            return None
        if not self.touched:
            return self.out.zero_()
        if self.whole and self.buffer is not None:
            self.out.copy_(self.buffer)
            self.buffer = None
        return self.out


def _add_product(acc, a, b):
    """``acc += a @ b`` with ``acc`` in float32 (or float64) and ``a``, ``b`` in the inputs'
    dtype. On a GPU, half-precision products are accumulated by the matmul itself into the
    float32 buffer (``addmm``'s ``out_dtype``), without a rounded temporary."""
    if acc.dtype == a.dtype:
        acc.addmm_(a, b)
    elif acc.is_cuda and _mixed_addmm(acc.device.index):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc.add_(a @ b)


@functools.cache
def _mixed_addmm(device_index) -> bool:
    """Whether ``addmm(..., out_dtype=float32)`` runs on this GPU (torch >= 2.8; tried once)."""
    try:
        acc = torch.zeros(2, 2, device=f"cuda:{device_index or 0}")
        ones = torch.ones(2, 2, device=acc.device, dtype=torch.bfloat16)
        torch.addmm(acc, ones, ones, out_dtype=torch.float32, out=acc)
        return bool((acc == 2).all())
    except (RuntimeError, TypeError):
        return False
