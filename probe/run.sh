#!/bin/bash
# one-off probe: GPU tests, then the default-model shape through serve + bench (chat-like load)
OUT=${OUT:-/tmp/out}; W=/tmp/w; mkdir -p $OUT $W
PY=${PY:-python3}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:src HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
if [ -n "$TESTS" ]; then OUT=$W bash scripts/gpu_tests.sh $TESTS; fi
CS=${CS:-16}; OL=${OL:-160}; IL=${IL:-48}; R=${R:-16}
for CFG in $CFGS; do
  NAME=${CFG%%=*}; ARGS=${CFG#*=}; ARGS=${ARGS//,/ }
  SARGS="--load-format dummy --speculative-algorithm eagle3 --speculative-simulate-acceptance 1.5 $ARGS"
  [ "$NAME" = plain ] && SARGS="--load-format dummy $ARGS"
  T0=$(date +%s)
  $PY -m specserve.cli serve $SARGS --port 8011 > $W/serve_$NAME.log 2>&1 &
  SPID=$!
  for i in $(seq 1 300); do curl -sf http://127.0.0.1:8011/health >/dev/null && break; sleep 1; done
  echo "== $NAME ($SARGS) ready after $(( $(date +%s) - T0 )) s"
  grep -E "captured|mixed" $W/serve_$NAME.log | head -3
  for C in $CS; do
    $PY -m specserve.cli bench serve --base-url http://127.0.0.1:8011 --max-concurrency $C --endpoint chat \
       --num-prompts $((R*C)) --input-len $IL --output-len $OL --ignore-eos --no-progress --save-result $W/srv_${NAME}_$C.json > $W/bench_${NAME}_$C.log 2>&1
    echo "-- $NAME c=$C"; grep -E "output throughput|TPOT mean|TTFT mean|draft-length mix|engine steps" $W/bench_${NAME}_$C.log
    $PY -c "import json,sys; r=json.load(open(sys.argv[1])); print({k:v for k,v in r.get('server',{}).items() if 'ms' in k or 'wait' in k})" $W/srv_${NAME}_$C.json
  done
  kill $SPID; wait $SPID
done
tar czf $OUT/w.tgz -C $W .
