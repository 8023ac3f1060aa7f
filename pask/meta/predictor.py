"""MetaKV's predictors: per candidate, the output length, latency, KV bytes and P(correct) of a request.

Fitted on the dev (and calibration) cells of every candidate, never on test or live
(``pask meta fit``), and saved as one versioned JSON file tied to the model's fingerprint, like a
PASK table. What each predicts, from the request's features (:mod:`pask.meta.features`) and the
candidate (a categorical input):

- ``n_out``, the number of generated tokens: LightGBM, Poisson objective.
- ``p_correct``: LightGBM binary classifier.
- ``kv_mb``, the KV bytes held at the end of the request, from the cost model: Full-KV bytes per
  token x (prompt tokens x the candidate's prompt ratio + predicted output x its decode ratio), the
  ratios being the candidate's mean measured ``B_P`` / ``B_D`` on the fit cells (exact for
  budget-controlled policies, the mix of a PASK table otherwise). MB = 10^6 bytes.
- ``latency_ms`` = prefill + (output tokens - 1) x decode step. Per candidate, prefill is a
  least-squares line on prompt tokens and the step a line on the mean context per batch size,
  interpolated linearly between measured batch sizes (the nearest two beyond them). The lines
  come from a timing profile (:func:`pask.experiments.metakv.measure_timing`: every candidate
  timed in turn on the same prompts, so machine load does not favour one of them), or else from
  the fit cells' own per-case timings at their batch size. Either way the machine is recorded.

LightGBM models are stored as LightGBM's own text format inside the JSON (no pickle).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pask.errors import PaskError
from pask.meta.candidates import Candidate, names
from pask.meta.features import FEATURES

FORMAT = "pask-meta/1"
LGB_PARAMS = {
    "learning_rate": 0.05,
    "feature_fraction": 0.9,
    "bagging_fraction": 0.9,
    "bagging_freq": 1,
    "seed": 0,
    "deterministic": True,
    "num_threads": 1,
    "verbose": -1,
}
# Chosen on the SQL dev split by 5-fold cross-validation grouped by database (docs/metakv.md): the
# classifier smaller and more regularised (held-out AUC 0.72 against 0.70 with the regressor's
# settings), the output-length regressor as it was (MAE 44.8 tokens against 47.8).
CLASSIFIER = {"num_leaves": 7, "min_data_in_leaf": 40, "lambda_l2": 5.0, "rounds": 100}
REGRESSOR = {"num_leaves": 15, "min_data_in_leaf": 20, "lambda_l2": 1.0, "rounds": 200}
MAE_KEYS = ("mae_n_out", "mae_kv_mb", "mae_latency_ms")


def _lgb():
    try:
        import lightgbm
    except ImportError:
        raise PaskError("MetaKV needs LightGBM: pip install lightgbm==4.7.0") from None
    return lightgbm


@dataclass
class Observation:
    """One dev case under one candidate: its features and what was measured."""

    candidate: str
    features: dict[str, float]
    correct: bool
    n_generated: int
    prefill_ms: float
    tpot_ms: float
    b_prompt: float
    b_decode: float
    held_bytes: int
    case_id: str = ""
    group: str = ""  # cross-validation keeps a group in one fold (SQL: the database; "": the case)


@dataclass(frozen=True)
class Prediction:
    """What the predictors expect of one request under one candidate."""

    candidate: str
    p_correct: float
    n_out: float
    latency_ms: float
    kv_mb: float

    def to_json(self) -> dict:
        return {
            "candidate": self.candidate,
            "p_correct": round(self.p_correct, 4),
            "n_out": round(self.n_out, 1),
            "latency_ms": round(self.latency_ms, 1),
            "kv_mb": round(self.kv_mb, 4),
        }


def interpolate(points: dict[int, float], x: float) -> float:
    """Piecewise-linear through ``points`` (x -> y), extended by the nearest two beyond them."""
    xs = sorted(points)
    if len(xs) == 1:
        return points[xs[0]]
    i = min(max(int(np.searchsorted(xs, x)), 1), len(xs) - 1)
    x0, x1 = xs[i - 1], xs[i]
    return points[x0] + (points[x1] - points[x0]) * (x - x0) / (x1 - x0)


def _line(x: np.ndarray, y: np.ndarray) -> list[float]:
    """Least-squares ``y = a + b x`` (``b`` 0 when x does not vary)."""
    if len(x) == 0:
        raise PaskError("no timed cases to fit a latency line on")
    if np.ptp(x) == 0:
        return [float(np.mean(y)), 0.0]
    a = np.stack([np.ones_like(x), x], axis=1)
    coef, *_ = np.linalg.lstsq(a, y, rcond=None)
    return [float(coef[0]), float(coef[1])]


@dataclass
class MetaPredictor:
    """The fitted predictors of one (model, task) over its candidates (see the module docstring)."""

    model_name: str
    fingerprint: str
    task: str
    candidates: list[Candidate]
    bytes_per_token: int
    batch_size: int
    max_new_tokens: int
    latency: dict[str, dict]  # candidate -> {"prefill": [a, b], "step": {batch size: [a, b]}}
    kv_ratios: dict[str, list[float]]  # candidate -> [B_P, B_D]
    boosters: dict[str, str]  # "correct" / "n_out" -> LightGBM model text
    fit: dict[str, Any] = field(default_factory=dict)  # provenance, data sizes, held-out errors
    features: tuple[str, ...] = FEATURES
    _models: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    source: str = field(default="predictor", repr=False, compare=False)  # the file it was loaded from

    @property
    def names(self) -> list[str]:
        return names(self.candidates)

    def check_model(self, fingerprint: str) -> None:
        """:class:`PaskError` unless fitted for the model with this fingerprint."""
        if self.fingerprint != fingerprint:
            raise PaskError(
                f"{self.source} was fitted for model {self.model_name} ({self.fingerprint}), not this model "
                f"({fingerprint}): fit a predictor for it (`pask meta fit`)"
            )

    # -- prediction -------------------------------------------------------------------------------
    def _booster(self, key: str):
        if key not in self._models:
            self._models[key] = _lgb().Booster(model_str=self.boosters[key])
        return self._models[key]

    def matrix(self, features: dict[str, float], only: Sequence[str] | None = None) -> tuple[list[str], np.ndarray]:
        """One row per candidate (``only``: those): the features, then the candidate's index."""
        missing = [f for f in self.features if f not in features]
        if missing:
            raise PaskError(f"request features lack {missing}")
        all_names = self.names
        chosen = list(only) if only is not None else all_names
        index = {n: i for i, n in enumerate(all_names)}
        unknown = [n for n in chosen if n not in index]
        if unknown:
            raise PaskError(f"unknown MetaKV candidates {unknown}; this predictor has {all_names}")
        row = [float(features[f]) for f in self.features]
        return chosen, np.array([[*row, float(index[n])] for n in chosen], dtype=np.float64)

    def predict(
        self, features: dict[str, float], only: Sequence[str] | None = None, batch_size: int | None = None
    ) -> list[Prediction]:
        """Predictions for every candidate (``only``: those) of a request with these features, its
        latency at ``batch_size`` rows decoding together (None: the fit's :attr:`batch_size`)."""
        chosen, x = self.matrix(features, only)
        p = self._booster("correct").predict(x)
        n_out = np.clip(self._booster("n_out").predict(x), 1.0, float(self.max_new_tokens))
        prompt = float(features["prompt_tokens"])
        out = []
        for name, pc, n in zip(chosen, p, n_out, strict=True):
            n = float(n)
            lat = self.latency_ms(name, prompt, n, batch_size)
            out.append(Prediction(name, float(pc), n, lat, self.kv_mb(name, prompt, n)))
        return out

    def latency_ms(self, candidate: str, prompt_tokens: float, n_out: float, batch_size: int | None = None) -> float:
        """Prefill + ``n_out - 1`` decode steps at the mean context and ``batch_size`` rows."""
        lat = self.latency[candidate]
        prefill = lat["prefill"][0] + lat["prefill"][1] * prompt_tokens
        ctx = prompt_tokens + n_out / 2
        steps = {int(b): a + s * ctx for b, (a, s) in lat["step"].items()}
        step = interpolate(steps, self.batch_size if batch_size is None else batch_size)
        return max(prefill, 0.0) + max(n_out - 1, 0.0) * max(step, 0.0)

    def kv_mb(self, candidate: str, prompt_tokens: float, n_out: float) -> float:
        """KV bytes held at the end (MB = 10^6 bytes) from the cost model and the candidate's ratios."""
        bp, bd = self.kv_ratios[candidate]
        return self.bytes_per_token * (prompt_tokens * bp + float(n_out) * bd) / 1e6

    # -- files ------------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "format": FORMAT,
            "model": {"name": self.model_name, "fingerprint": self.fingerprint},
            "task": self.task,
            "candidates": [c.to_json() for c in self.candidates],
            "features": list(self.features),
            "bytes_per_token": self.bytes_per_token,
            "batch_size": self.batch_size,
            "max_new_tokens": self.max_new_tokens,
            "latency": self.latency,
            "kv_ratios": self.kv_ratios,
            "fit": self.fit,
            "boosters": self.boosters,
        }

    def save(self, path: Path | str) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def from_json(cls, data: Any, where: str = "predictor") -> MetaPredictor:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            got = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise PaskError(f"{where} is not a MetaKV predictor file (format {got!r}, expected {FORMAT!r})")
        try:
            cands = [Candidate.from_json(c) for c in data["candidates"]]
            lat = data["latency"]
            pred = cls(
                model_name=str(data["model"]["name"]),
                fingerprint=str(data["model"]["fingerprint"]),
                task=str(data["task"]),
                candidates=cands,
                bytes_per_token=int(data["bytes_per_token"]),
                batch_size=int(data["batch_size"]),
                max_new_tokens=int(data["max_new_tokens"]),
                latency={k: _latency_entry(v) for k, v in lat.items()},
                kv_ratios={k: [float(x) for x in v] for k, v in data["kv_ratios"].items()},
                boosters={"correct": str(data["boosters"]["correct"]), "n_out": str(data["boosters"]["n_out"])},
                fit=dict(data.get("fit") or {}),
                features=tuple(data["features"]),
            )
        except (KeyError, TypeError, ValueError) as e:
            raise PaskError(f"{where}: bad MetaKV predictor file ({type(e).__name__}: {e})") from None
        if pred.features != FEATURES:
            raise PaskError(
                f"{where} uses features {list(pred.features)}; this pask computes {list(FEATURES)}: refit it"
            )
        missing = [n for n in pred.names if n not in pred.latency or n not in pred.kv_ratios]
        if missing:
            raise PaskError(f"{where}: no latency / KV fit for candidates {missing}")
        return pred


def _latency_entry(v: dict) -> dict:
    steps = {str(int(b)): [float(x) for x in line] for b, line in v["step"].items()}
    return {"prefill": [float(x) for x in v["prefill"]], "step": steps}


def load(path: Path | str, fingerprint: str | None = None, task: str | None = None) -> MetaPredictor:
    """A predictor file, checked against the loaded model's fingerprint and the task (None: not checked)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise PaskError(f"MetaKV predictor file {path} does not exist (make one with `pask meta fit`)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PaskError(f"{path} is not a MetaKV predictor file: {e}") from None
    pred = MetaPredictor.from_json(data, str(path))
    pred.source = str(path)
    if fingerprint is not None:
        pred.check_model(fingerprint)
    if task is not None and pred.task != task:
        raise PaskError(f"{path} was fitted for task '{pred.task}', not '{task}'")
    return pred


# -- fitting --------------------------------------------------------------------------------------
def _design(obs: Sequence[Observation], order: list[str]) -> np.ndarray:
    index = {n: i for i, n in enumerate(order)}
    return np.array([[*(o.features[f] for f in FEATURES), float(index[o.candidate])] for o in obs], dtype=np.float64)


def _train(obs: Sequence[Observation], order: list[str]) -> tuple[str, str]:
    """(classifier, output-length model) as LightGBM model text."""
    lgb = _lgb()
    x = _design(obs, order)
    cat = [len(FEATURES)]
    y = np.array([float(o.correct) for o in obs])
    if len(set(y)) < 2:
        raise PaskError("P(correct) needs both correct and wrong cases in the fit data")
    c, r = dict(CLASSIFIER), dict(REGRESSOR)
    c_rounds, r_rounds = c.pop("rounds"), r.pop("rounds")
    clf = lgb.train({**LGB_PARAMS, **c, "objective": "binary"}, lgb.Dataset(x, y, categorical_feature=cat), c_rounds)
    n = np.array([float(max(o.n_generated, 1)) for o in obs])
    reg = lgb.train({**LGB_PARAMS, **r, "objective": "poisson"}, lgb.Dataset(x, n, categorical_feature=cat), r_rounds)
    return clf.model_to_string(), reg.model_to_string()


def _cell_samples(obs: Sequence[Observation], batch_size: int) -> list[dict]:
    """The fit cells' own per-case timings as timing-profile samples (one batch size: the cells')."""
    out = []
    for o in obs:
        prompt = o.features["prompt_tokens"]
        out.append({"candidate": o.candidate, "kind": "prefill", "batch": 1, "context": prompt, "ms": o.prefill_ms})
        if o.n_generated > 1 and o.tpot_ms > 0:
            out.append({"candidate": o.candidate, "kind": "step", "batch": batch_size,
                        "context": prompt + o.n_generated / 2, "ms": o.tpot_ms})  # fmt: skip
    return out


def timing_lines(samples: Sequence[dict], order: list[str]) -> dict[str, dict]:
    """Latency lines from a timing profile's samples: ``{"candidate", "kind": "prefill" | "step",
    "batch", "context", "ms"}`` (prefill: context = prompt tokens; step: the batch's mean context)."""
    out = {}
    for name in order:
        pre = [x for x in samples if x["candidate"] == name and x["kind"] == "prefill"]
        steps = [x for x in samples if x["candidate"] == name and x["kind"] == "step"]
        if not pre or not steps:
            raise PaskError(f"the timing profile has no prefill or step samples of candidate {name}")
        line = _line(np.array([x["context"] for x in pre], dtype=float), np.array([x["ms"] for x in pre], dtype=float))
        by_batch: dict[str, list[float]] = {}
        for b in sorted({int(x["batch"]) for x in steps}):
            mine = [x for x in steps if int(x["batch"]) == b]
            ctx = np.array([x["context"] for x in mine], dtype=float)
            by_batch[str(b)] = _line(ctx, np.array([x["ms"] for x in mine], dtype=float))
        out[name] = {"prefill": line, "step": by_batch}
    return out


def _kv_fits(obs: Sequence[Observation], order: list[str]) -> dict[str, list[float]]:
    return {
        n: [
            float(np.mean([o.b_prompt for o in obs if o.candidate == n])),
            float(np.mean([o.b_decode for o in obs if o.candidate == n])),
        ]
        for n in order
    }


def auc(y: Sequence[bool], p: Sequence[float]) -> float:
    """Area under the ROC curve (ties count one half); NaN with one class only."""
    y_arr, p_arr = np.asarray(y, dtype=bool), np.asarray(p, dtype=np.float64)
    pos, neg = p_arr[y_arr], p_arr[~y_arr]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan")
    greater = (pos[:, None] > neg[None, :]).sum() + 0.5 * (pos[:, None] == neg[None, :]).sum()
    return float(greater / (len(pos) * len(neg)))


def calibration(y: Sequence[bool], p: Sequence[float], bins: int = 5) -> dict:
    """Brier score and the reliability table (mean predicted vs observed rate per probability bin)."""
    y_arr, p_arr = np.asarray(y, dtype=np.float64), np.asarray(p, dtype=np.float64)
    table = []
    edges = np.linspace(0, 1, bins + 1)
    for lo, hi in itertools.pairwise(edges):
        sel = (p_arr >= lo) & ((p_arr < hi) if hi < 1 else (p_arr <= hi))
        if sel.any():
            predicted, observed = round(float(p_arr[sel].mean()), 3), round(float(y_arr[sel].mean()), 3)
            n = int(sel.sum())
            table.append({"bin": f"{lo:.1f}-{hi:.1f}", "n": n, "predicted": predicted, "observed": observed})
    return {"brier": round(float(np.mean((p_arr - y_arr) ** 2)), 4), "reliability": table}


def errors(pred: MetaPredictor, obs: Sequence[Observation], actual_latency=None) -> dict:
    """Held-out errors of ``pred`` on ``obs``: AUC / calibration of P(correct), MAE of output length,
    KV MB and latency (``actual_latency(o)``: the measured latency of an observation; default prefill
    + (n - 1) x step of its row)."""
    if not obs:
        return {}
    ps, ns, kv_err, lat_err = [], [], [], []
    by_case: dict[str, list[Observation]] = {}
    for o in obs:
        by_case.setdefault(o.case_id or str(id(o)), []).append(o)
    for group in by_case.values():
        preds = {p.candidate: p for p in pred.predict(group[0].features, [o.candidate for o in group])}
        for o in group:
            p = preds[o.candidate]
            ps.append(p.p_correct)
            ns.append(abs(p.n_out - o.n_generated))
            kv_err.append(abs(p.kv_mb - o.held_bytes / 1e6))
            actual = actual_latency(o) if actual_latency else o.prefill_ms + max(o.n_generated - 1, 0) * o.tpot_ms
            lat_err.append(abs(p.latency_ms - actual))
    y = [o.correct for group in by_case.values() for o in group]
    return {
        "n": len(obs),
        "auc": round(auc(y, ps), 4),
        "calibration": calibration(y, ps),
        "mae_n_out": round(float(np.mean(ns)), 2),
        "mae_kv_mb": round(float(np.mean(kv_err)), 4),
        "mae_latency_ms": round(float(np.mean(lat_err)), 1),
    }


def fit(
    obs: Sequence[Observation],
    candidates: Sequence[Candidate],
    *,
    model_name: str,
    fingerprint: str,
    task: str,
    bytes_per_token: int,
    batch_size: int,
    max_new_tokens: int,
    folds: int = 5,
    meta: dict | None = None,
    timing: Sequence[dict] | None = None,
) -> MetaPredictor:
    """Fit every predictor on ``obs`` (dev / calibration cases of every candidate); ``folds``-fold
    cross-validation by case gives the held-out errors recorded in ``fit["cv"]``. ``timing``: a
    timing profile's samples (:func:`timing_lines`) for the latency lines; None: the cells' timings."""
    order = names(candidates)
    present = {o.candidate for o in obs}
    absent = [n for n in order if n not in present]
    if absent:
        raise PaskError(f"no fit data for candidates {absent}")
    obs = [o for o in obs if o.candidate in set(order)]

    def one(data: Sequence[Observation]) -> MetaPredictor:
        clf, reg = _train(data, order)
        lines = timing_lines(timing if timing is not None else _cell_samples(data, batch_size), order)
        return MetaPredictor(
            model_name, fingerprint, task, list(candidates), bytes_per_token, batch_size, max_new_tokens,
            lines, _kv_fits(data, order), {"correct": clf, "n_out": reg},
        )  # fmt: skip

    cv: dict[str, Any] = {}
    if folds > 1:
        keys = sorted({o.group or o.case_id for o in obs})
        if len(keys) < folds:
            raise PaskError(f"{folds} folds need at least {folds} groups of cases, got {len(keys)}")
        rng = np.random.default_rng(0)
        fold_of = {c: int(f) for c, f in zip(keys, rng.permutation(len(keys)) % folds, strict=True)}
        held: list[Observation] = []
        preds: list[tuple[MetaPredictor, list[Observation]]] = []
        for k in range(folds):
            train = [o for o in obs if fold_of[o.group or o.case_id] != k]
            test = [o for o in obs if fold_of[o.group or o.case_id] == k]
            preds.append((one(train), test))
            held.extend(test)
        parts = [errors(p, t, actual_latency(p) if timing is not None else None) for p, t in preds]
        total = sum(p["n"] for p in parts)
        cv = {
            "folds": folds,
            "grouped_by": "database" if any(o.group for o in obs) else "case",
            "n": total,
            "auc_mean": round(float(np.mean([p["auc"] for p in parts if not math.isnan(p["auc"])])), 4),
            "brier": round(sum(p["calibration"]["brier"] * p["n"] for p in parts) / total, 4),
            **{k: round(sum(p[k] * p["n"] for p in parts) / total, 4) for k in MAE_KEYS},
        }
    pred = one(obs)
    pred.fit = {**(meta or {}), "n_rows": len(obs), "n_cases": len({o.case_id for o in obs}), "cv": cv}
    if timing is not None:
        pred.fit["timing_residuals"] = timing_residuals(pred, timing)
    return pred


def actual_latency(pred: MetaPredictor) -> Callable[[Observation], float]:
    """A case's latency from the fitted lines at its actual output length (with a timing profile the
    cells' own timings are not the profile's machine state: only the output length is compared; the
    CSR evaluation's latency of a case that ran)."""
    return lambda o: pred.latency_ms(o.candidate, o.features["prompt_tokens"], float(o.n_generated))


def timing_residuals(pred: MetaPredictor, samples: Sequence[dict]) -> dict:
    """Mean absolute error of the latency lines on the timing profile's own samples (ms)."""
    pre, step = [], []
    for x in samples:
        lat = pred.latency.get(x["candidate"])
        if lat is None:
            continue
        if x["kind"] == "prefill":
            pre.append(abs(lat["prefill"][0] + lat["prefill"][1] * x["context"] - x["ms"]))
        elif str(int(x["batch"])) in lat["step"]:
            a, b = lat["step"][str(int(x["batch"]))]
            step.append(abs(a + b * x["context"] - x["ms"]))
    return {"prefill_mae_ms": round(float(np.mean(pre)), 2) if pre else None,
            "step_mae_ms": round(float(np.mean(step)), 2) if step else None}  # fmt: skip
