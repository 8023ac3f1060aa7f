"""Masked LM head: under a grammar, a decode step computes only the logits the grammar allows.

In grammar-constrained decoding most steps allow very few tokens: replaying the Full KV outputs of
40 BFCL test cases through their grammars, 63 % of steps allow exactly one token (scaffold such as
``{"name": "``), 25 % at most 16, 4 % at most 1024, and only 9 % more (free strings). The LM head
(151936 x 896 for the Qwen2.5 models, 28 % of the 0.5B model's weights) is then mostly wasted work:
at batch 16 on a 2-core CPU it is a quarter of a decode step.

:class:`MaskedHead` wraps a model's output embedding for one decode loop. Before each step the
engine hands it, per batch row, the allowed token ids (``None`` for an unconstrained or wide row);
the head then computes the full product only for the wide rows (one GEMV for all of them), and for
each narrow row the dot products with the gathered rows of the weight, FP32 like the full product;
every other logit is ``-inf``, as the grammar's mask would make it. The greedy token is the same up
to the summation order of the dot products. A forward with more than one position (prefill) or
without a plan runs the original head.
"""

from __future__ import annotations

import os

import torch

NARROW = 1024  # rows allowing at most this many tokens get the gathered product
ENV = "PASK_MASKED_HEAD"  # "0" turns the masked head off
_SHIFTS = torch.arange(32, dtype=torch.int32)


def masked_head_enabled() -> bool:
    """Whether decode loops use the masked head (``PASK_MASKED_HEAD``, default on; ``0`` turns it off)."""
    return os.environ.get(ENV, "1").strip() != "0"


def allowed_tokens(bitmask_row: torch.Tensor, vocab_size: int, limit: int = NARROW) -> torch.Tensor | None:
    """The token ids set in one llguidance bitmask row (int32 words), ascending, or None if more than
    ``limit``. Only the nonzero words are unpacked (a narrow row has a few of the ~4.7k words)."""
    words = bitmask_row[: (vocab_size + 31) // 32]
    nz = words.nonzero().reshape(-1)
    if nz.numel() > limit:  # every nonzero word holds at least one token
        return None
    bits = ((words[nz].reshape(-1, 1) >> _SHIFTS) & 1).bool()
    idx = (nz.reshape(-1, 1) * 32 + _SHIFTS)[bits]
    if idx.numel() and int(idx[-1]) >= vocab_size:  # padding bits past the vocabulary
        idx = idx[idx < vocab_size]
    return idx if idx.numel() <= limit else None


def head_bytes(head: torch.nn.Module) -> int:
    """Bytes of an output embedding's full product: an ``nn.Linear``'s weight (a tied one is the
    embedding table) and bias, or a :class:`~pask.cpu.weights.QuantLinear`'s codes, scales and bias
    (as :func:`pask.cpu.weights.step_weight_bytes` counts them)."""
    parts = [getattr(head, n, None) for n in ("weight", "codes", "sz", "bias")]
    return sum(t.numel() * t.element_size() for t in parts if isinstance(t, torch.Tensor))


class MaskedHead:
    """The output embedding of ``model`` computing only planned logits (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        from pask.cpu.weights import QuantLinear

        head = model.get_output_embeddings()
        if not isinstance(head, torch.nn.Linear | QuantLinear):
            raise TypeError(f"masked head needs an nn.Linear output embedding, got {type(head).__name__}")
        self.head, self.model = head, model
        self._had_own = "forward" in head.__dict__
        self._orig = head.forward
        self.plan: list[torch.Tensor | None] | None = None
        self.narrow_rows = self.full_rows = 0  # counts of rows served each way
        self.full_bytes = head_bytes(head)  # what a full product reads
        self.planned = 0  # forwards served with a plan (decode steps)
        self.bytes_read = 0  # head bytes those forwards read: the full weight once if a row is wide, gathered rows
        head.forward = self._forward
        model._pask_masked_head = self

    def close(self) -> None:
        """Give the head back its own forward."""
        if self._had_own:
            self.head.forward = self._orig
        else:
            del self.head.forward
        if getattr(self.model, "_pask_masked_head", None) is self:
            del self.model._pask_masked_head

    def reset_counts(self) -> None:
        """Zero the counters (rows served each way, planned forwards, bytes read)."""
        self.narrow_rows = self.full_rows = self.planned = self.bytes_read = 0

    def bytes_per_step(self) -> float | None:
        """Mean head bytes a planned forward (a decode step) read since the last :meth:`reset_counts`:
        the whole weight in a step with a wide row, the gathered rows (and their blocks' scales) of
        narrow rows; None before any planned forward."""
        return self.bytes_read / self.planned if self.planned else None

    def select(self, rows: list[int]) -> None:
        """Keep the plan of these batch rows only (a session that left finished rows out of its forward)."""
        if self.plan is not None:
            self.plan = [self.plan[r] for r in rows]

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        plan, self.plan = self.plan, None  # a plan serves one forward
        if plan is None or x.dim() != 3 or x.shape[1] != 1 or len(plan) != x.shape[0]:
            return self._orig(x)
        wide = [i for i, a in enumerate(plan) if a is None]
        self.planned += 1
        if wide:
            self.bytes_read += self.full_bytes
        if len(wide) == len(plan):
            self.full_rows += len(wide)
            return self._orig(x)
        out = torch.full((x.shape[0], 1, self.head.out_features), -torch.inf, dtype=x.dtype)
        if wide:
            out[wide] = self._orig(x[wide])
        bias = self.head.bias
        for i, idx in enumerate(plan):
            if idx is None or idx.numel() == 0:
                continue
            rows, nbytes = self._rows(idx)
            self.bytes_read += nbytes
            logits = rows @ x[i, 0].float()
            if bias is not None:
                b = bias[idx]
                self.bytes_read += b.numel() * b.element_size()
                logits = logits + b.float()
            out[i, 0, idx] = logits.to(out.dtype)
        self.narrow_rows += len(plan) - len(wide)
        self.full_rows += len(wide)
        return out

    def _rows(self, idx: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The fp32 rows ``idx`` of the head's weight (a quantised head: its blocks of 16 outputs that
        hold them gathered and dequantised to bf16 first, as its prefill path does), and the bytes
        read for them: the rows gathered (of the fp32 copy where there is one), or the blocks' codes
        and scales."""
        head = self.head
        if isinstance(head, torch.nn.Linear):
            w32 = head._buffers.get("pask_weight_fp32")
            rows = (w32 if w32 is not None else head.weight)[idx]
            return rows.float(), rows.numel() * rows.element_size()
        from pask.cpu import native_gemv

        blocks = torch.unique(idx // 16)  # the blocks gathered, then dequantised in one call
        codes, sz = head.codes.index_select(0, blocks), head.sz.index_select(0, blocks)
        deq = native_gemv.dequant(codes, sz, 16 * blocks.numel(), head.bits)
        pos = torch.searchsorted(blocks, idx // 16) * 16 + idx % 16
        return deq[pos].float(), codes.numel() * codes.element_size() + sz.numel() * sz.element_size()
