"""Prefill store: a prompt's prefill computed once and reused by every policy that decodes it.

An evaluation sweep decodes the same prompts under many policies, budgets and tuning
configurations, and on a CPU the prefill forward is about half of each run (it is compute bound:
~0.7 GFLOP per prompt token for the 0.5B model). What a prefill produces does not depend on the
policy — the policies act on the cache after it — so a :class:`PrefillStore` keeps, per prompt:

* the keys and values of every layer as the cache received them (``[Hkv, P, D]``, model dtype),
* the logits of the last prompt position,
* the attention statistics any policy may ask for (:mod:`pask.kv.stats`): the window attention for
  every window of :data:`STORED_WINDOWS` (incl. ``ALL``, H2O's column sums) and the value-output
  norms (CriticalKV), computed by the same functions as on the fly, so a hit hands a policy the
  same tensors a fresh prefill would. Prompts longer than :data:`ALL_WINDOW_MAX_PROMPT` record the
  ``ALL`` window only when the request asks for it (:func:`stored_windows`): its column sums score
  every prompt query against every key in FP32, quadratic in the prompt, ~30 minutes a 32k prompt
  on 2 cores against ~2 for the prefill itself. Such an entry serves every other request; one that
  asks for ``ALL`` finds it missing, prefills again and stores the entry with it.

A batch whose prompts are all stored skips the forward; otherwise it runs as usual and stores
every row (the statistics add ~10 % to that forward). The key covers the format, the model
(architecture + weights hash), its dtype, whether its bf16 layers take fp32 products, the torch
and transformers versions and the prompt's token ids; a prefill of a row in another batch differs from it at most
by the GEMM's summation order. Entries are ``torch.save`` files written atomically (tmp +
rename) and read with ``weights_only=True``; an unreadable or mismatching entry counts as a miss.

Enabled by ``PASK_PREFILL_STORE=DIR`` (or ``--prefill-store DIR`` of ``pask eval`` / ``tune`` /
``calibrate`` / ``sweep``); about 12 KB per prompt token and layer-set for the 0.5B model (24 layers, 2 kv heads
of 64) plus 0.3-0.6 MB of logits per prompt. Delete the directory to reclaim it.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from pask.errors import PaskError
from pask.kv.stats import ALL, StatsRequest, covering

FORMAT = 1
ENV = "PASK_PREFILL_STORE"
STORED_WINDOWS: tuple[int, ...] = (8, 16, 32, 64, 128, ALL)
ALL_WINDOW_MAX_PROMPT = 16384  # longer prompts record ALL only when asked (see the module docstring)


def stored_windows(prompt_len: int) -> tuple[int, ...]:
    """The windows a store records for a prefill whose longest prompt has ``prompt_len`` tokens
    (besides those the request asks for): :data:`STORED_WINDOWS`, without ``ALL`` past
    :data:`ALL_WINDOW_MAX_PROMPT`."""
    if prompt_len <= ALL_WINDOW_MAX_PROMPT:
        return STORED_WINDOWS
    return tuple(w for w in STORED_WINDOWS if w != ALL)


@dataclass
class PrefillEntry:
    """One prompt's prefill: per-layer K/V ``[Hkv, P, D]``, last logits ``[V]``, statistics."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    logits: torch.Tensor
    window_attention: dict[int, torch.Tensor]  # window -> [layers, Hkv, P]
    value_norm: torch.Tensor  # [layers, Hkv, P]

    @property
    def prompt_len(self) -> int:
        return int(self.keys[0].shape[1])

    def serves(self, request: StatsRequest) -> bool:
        """Whether this entry holds the prefill statistics ``request`` asks for."""
        return request.prefill_window <= 0 or covering(request.prefill_window, self.prompt_len) in self.window_attention


def model_identity(model: torch.nn.Module) -> str:
    """Architecture + weights hash: the one ``load_model`` recorded, else computed the same way."""
    from pask.runtime.models import _fingerprint

    return str(getattr(model, "_pask_fingerprint", None) or _fingerprint(model, None))


class PrefillStore:
    """A directory of stored prefills for one model (see the module docstring)."""

    def __init__(self, root: str | os.PathLike, model: torch.nn.Module) -> None:
        import transformers

        self.root = Path(root)
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise PaskError(f"prefill store {self.root}: cannot create it ({e.strerror})") from None
        if not os.access(self.root, os.W_OK):
            raise PaskError(f"prefill store {self.root}: not writable")
        dtype = next(model.parameters()).dtype
        self.identity = {
            "format": FORMAT,
            "model": model_identity(model),
            "dtype": str(dtype),
            "fp32_products": bool(getattr(model, "pask_fp32_linears", 0)),  # bf16 weights, fp32 products
            "torch": str(torch.__version__),  # a TorchVersion would not load with weights_only
            "transformers": str(transformers.__version__),
        }
        self._prefix = json.dumps(self.identity, sort_keys=True).encode()
        self.hits = self.misses = 0

    @classmethod
    def from_env(cls, model: torch.nn.Module) -> PrefillStore | None:
        """The store named by ``$PASK_PREFILL_STORE`` (None when unset or empty)."""
        root = os.environ.get(ENV, "").strip()
        return cls(root, model) if root else None

    def path(self, prompt_ids: list[int]) -> Path:
        h = hashlib.sha256(self._prefix)
        h.update(torch.tensor(list(prompt_ids), dtype=torch.int64).numpy().tobytes())
        key = h.hexdigest()
        return self.root / key[:2] / f"{key}.pt"

    def get(self, prompt_ids: list[int], request: StatsRequest) -> PrefillEntry | None:
        """The stored prefill of ``prompt_ids`` if it holds what ``request`` asks for, else None."""
        p = self.path(prompt_ids)
        entry = None
        if p.exists():
            try:
                data = torch.load(p, map_location="cpu", weights_only=True)
                entry = self._entry(data, len(prompt_ids))
            except Exception as e:  # a damaged file is a miss; it is rewritten by the next put
                warnings.warn(f"prefill store: ignoring unreadable entry {p.name} ({type(e).__name__})", stacklevel=2)
        if entry is not None and not entry.serves(request):
            entry = None
        self.hits += entry is not None
        self.misses += entry is None
        return entry

    def _entry(self, data: dict, prompt_len: int) -> PrefillEntry | None:
        if data.get("identity") != self.identity:
            return None
        e = PrefillEntry(
            list(data["keys"]),
            list(data["values"]),
            data["logits"],
            {int(w): t for w, t in data["window_attention"].items()},
            data["value_norm"],
        )
        return e if e.prompt_len == prompt_len and len(e.keys) == len(e.values) else None

    def put(self, prompt_ids: list[int], entry: PrefillEntry) -> None:
        """Store ``entry`` for ``prompt_ids`` (atomically: a reader never sees a partial file)."""
        if entry.prompt_len != len(prompt_ids):
            raise PaskError(f"prefill of {entry.prompt_len} tokens stored for a prompt of {len(prompt_ids)}")
        p = self.path(prompt_ids)
        p.parent.mkdir(parents=True, exist_ok=True)
        data = {
            "identity": self.identity,
            "keys": [k.contiguous().clone() for k in entry.keys],
            "values": [v.contiguous().clone() for v in entry.values],
            "logits": entry.logits.contiguous().clone(),
            "window_attention": {int(w): t.contiguous() for w, t in entry.window_attention.items()},
            "value_norm": entry.value_norm.contiguous(),
        }
        tmp = p.with_name(f".{p.name}.{uuid.uuid4().hex}.tmp")
        torch.save(data, tmp)
        tmp.replace(p)
