cd "$(dirname "$0")/../../../.."
for r in 1 2; do
for m in native gemv; do
PASK_BF16_MATMUL=$m .venv/bin/pask bench serve --policies full,pask,snapkv --budget 0.33 --table tables/qwen2.5-coder-0.5b-bfcl-b0.33.json --concurrency 16 --input-len 8192 --output-len 64 --requests-per-client 1 --threads 2 --prefill-store /root/.cache/pask/serve-store --out benchmarks/results/serving/gemv-ab/c16-$m-r$r
done; done

