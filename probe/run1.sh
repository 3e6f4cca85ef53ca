#!/bin/bash
# one-off probe: default-model shape, chat-like load, off vs fixed K3 vs goodput; server + offline; py-spy
OUT=${OUT:-/tmp/out}; mkdir -p $OUT
PY=${PY:-python3}
CS=${CS:-"16 64"}; OL=${OL:-160}; IL=${IL:-48}; DUR=${DUR:-6}; R=${R:-16}
SARGS="--load-format dummy --speculative-algorithm eagle3 --speculative-simulate-acceptance 1.5"
for P in off fixed goodput; do
  $PY -m specserve.cli serve $SARGS --port 8011 --speculative-policy $P > $OUT/serve_$P.log 2>&1 &
  SPID=$!
  for i in $(seq 1 240); do curl -sf http://127.0.0.1:8011/health >/dev/null && break; sleep 1; done
  echo "== $P ready after $i s"
  for C in $CS; do
    curl -s http://127.0.0.1:8011/metrics | grep -E "^specserve_(engine_step_(duration|gap)_seconds_(sum|count)|engine_loop_waits_by_reason|spec_step_k_steps|engine_steps)" > $OUT/m0
    $PY -m specserve.cli bench serve --base-url http://127.0.0.1:8011 --max-concurrency $C --endpoint chat \
       --num-prompts $((R*C)) --input-len $IL --output-len $OL --ignore-eos --no-progress --save-result $OUT/srv_${P}_$C.json > $OUT/bench_${P}_$C.log 2>&1 &
    BPID=$!
    if [ -n "$SPY" ] && [ $C = 16 ]; then
      sleep 2
      EPID=$(pgrep -P $SPID | tail -1)
      timeout 30 py-spy record --nonblocking --format raw -r 200 -d $DUR -o $OUT/spy_$P.txt -p $EPID > $OUT/spy_$P.log 2>&1
    fi
    wait $BPID
    echo "-- $P c=$C"; grep -E "output throughput|TPOT mean|draft-length mix|engine steps|acceptance length" $OUT/bench_${P}_$C.log
    curl -s http://127.0.0.1:8011/metrics | grep -E "^specserve_(engine_step_(duration|gap)_seconds_(sum|count)|engine_loop_waits_by_reason|spec_step_k_steps|engine_steps)" > $OUT/m1
    awk 'NR==FNR{a[$1]=$2;next}{printf "%s %.4f\n",$1,$2-a[$1]}' $OUT/m0 $OUT/m1
  done
  kill $SPID; wait $SPID
done
if [ -n "$OFFLINE" ]; then
for P in off fixed; do for C in $CS; do
  echo "-- offline $P n=$C"
  $PY -m specserve.cli bench throughput $SARGS --speculative-policy $P --num-prompts $C --input-len $IL --output-len $OL --no-progress 2>&1 | grep -E "output tokens/s|engine: steps|by draft len|elapsed"
done; done
fi
