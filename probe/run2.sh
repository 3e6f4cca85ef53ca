#!/bin/bash
OUT=${OUT:-/tmp/out}; W=/tmp/w; mkdir -p $OUT $W
PY=${PY:-python3}
C=${C:-16}; OL=${OL:-160}; IL=${IL:-48}; DUR=${DUR:-8}; R=${R:-16}
SARGS="--load-format dummy --speculative-algorithm eagle3 --speculative-simulate-acceptance 1.5 $EXTRA"
for P in ${PS:-fixed off}; do
  $PY -m specserve.cli serve $SARGS --port 8011 --speculative-policy $P > $W/serve_$P.log 2>&1 &
  SPID=$!
  for i in $(seq 1 240); do curl -sf http://127.0.0.1:8011/health >/dev/null && break; sleep 1; done
  echo "== $P ready after $i s"
  for N in $C $((R*C)); do
    $PY -m specserve.cli bench serve --base-url http://127.0.0.1:8011 --max-concurrency $C --endpoint chat \
       --num-prompts $N --input-len $IL --output-len $OL --ignore-eos --no-progress --save-result $W/srv_${P}_$N.json > $W/bench_${P}_$N.log 2>&1 &
    BPID=$!
    if [ -n "$SPY" ] && [ $N != $C ]; then
      sleep 2
      EPID=$(pgrep -P $SPID -f spawn_main | head -1)
      ps -o pid,args -p $EPID | cut -c1-150
      timeout 40 py-spy record --nonblocking --format raw -r 300 -d $DUR -o $W/spy_$P.txt -p $EPID > $W/spy_$P.log 2>&1
    fi
    wait $BPID
    echo "-- $P c=$C n=$N"; grep -E "output throughput|TPOT mean|engine steps" $W/bench_${P}_$N.log
    $PY -c "import json,sys; r=json.load(open(sys.argv[1])); print({k:v for k,v in r.get('server',{}).items() if 'ms' in k or 'wait' in k})" $W/srv_${P}_$N.json
  done
  kill $SPID; wait $SPID
done
tar czf $OUT/w.tgz -C $W .
