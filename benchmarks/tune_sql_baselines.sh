#!/bin/bash
# Tune the eviction baselines for text-to-SQL on the dev split (40 cases), as committed in
# pask/policies/configs_sql.json and benchmarks/results/tuning-sql/:
#   1. at B = 0.4: coordinate search over each Table 8 grid (one knob at a time around the defaults);
#   2. at B = 0.6, 0.5, 0.275: the better of the defaults and the B = 0.4 choice (ties: defaults).
# usage: benchmarks/tune_sql_baselines.sh [PREFILL_STORE] [POLICY ...]
#   (default store ~/.cache/pask/prefill; default policies snapkv h2o criticalkv rocketkv lazyeviction)
# Resumable (each `pask tune` skips finished configurations). One configuration takes 1-3 min of
# one core here; the whole run ~90 min of one core (we ran it as two parallel streams of one
# thread each, writing to separate --configs files merged afterwards). Then:
#   python benchmarks/tuning_table.py runs/tune-sql-* --configs pask/policies/configs_sql.json \
#       --out benchmarks/results/tuning-sql
set -euo pipefail
store=${1:-$HOME/.cache/pask/prefill}; shift || true
policies=${*:-snapkv h2o criticalkv rocketkv lazyeviction}
pask=${PASK:-.venv/bin/pask}
common=(--task sql --limit 40 --batch-size 8 --batching continuous --threads 1 --prefill-store "$store")
for p in $policies; do
  "$pask" tune --policy "$p" --budget 0.4 --search coordinate "${common[@]}" --out "runs/tune-sql-$p-b0.4"
  grid=$(.venv/bin/python - "$p" <<'PY'
import json, sys
from pask.policies.tuning import TABLE8_GRIDS, configs_path_for, policy_defaults, tuned_config
p = sys.argv[1]
keys = list(TABLE8_GRIDS[p])
default, chosen = policy_defaults(p, keys), tuned_config(p, 0.4, configs_path_for("sql"))
print(json.dumps({k: [default[k]] + ([chosen[k]] if chosen.get(k, default[k]) != default[k] else []) for k in keys}))
PY
)
  for b in 0.6 0.5 0.275; do
    "$pask" tune --policy "$p" --budget "$b" --search grid --grid "$grid" "${common[@]}" --out "runs/tune-sql-$p-b$b"
  done
done
