# bash host_parts.sh C STEPS ROUNDS ACC MODES: host parts of this tree and (OLD=1) of an older
# one in OLD_TREE (git archive REV src | tar -x -C OLD_TREE), WHEELS on the path for both
for tree in src ${OLD:+$OLD_TREE/src}; do
  PYTHONPATH=$WHEELS:$PWD/$tree timeout ${T:-280} python3 benchmarks/probes/host_parts.py "$@" 2>&1 \
    | grep -v "^INFO\|it/s\]\|Warn\|warn\|SIMULATED" | sed "s#^#$tree #" | tail -40
done
