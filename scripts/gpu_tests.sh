#!/usr/bin/env bash
# The GPU-marked tests on the lent H200, most telling first, each file under its own time
# limit (a killed file still leaves the others' results), one log per file and a summary in
# $OUT/gpu_tests/summary.txt. A device call may run 600 s, so the files come in two groups
# of about 550 s of limits each: one call per group. The device has no openai/uvicorn (the
# server tests are not GPU tests). Usage on the device (repository root):
#   PYTHONPATH=src bash scripts/gpu_tests.sh 1          # group 1 (then: ... gpu_tests.sh 2)
#   PYTHONPATH=src bash scripts/gpu_tests.sh test_fusion.py test_pdl_gpu.py   # 150 s each
set -u
out="${OUT:-/tmp}/gpu_tests"
mkdir -p "$out"
export HF_HUB_OFFLINE=1
# file:seconds; test_gemv compiles every candidate of every shape in two dtypes (slowest)
group1=(test_pdl_gpu.py:120 test_triton_ops.py:90 test_triton_attention.py:120
        test_cuda_graphs.py:120 test_spec_host_paths.py:90)
group2=(test_drafter_graphs.py:110 test_feature_graphs.py:110 test_overlap_gpu.py:130
        test_gemv.py:200)
case "${1:-}" in
  1) files=("${group1[@]}") ;;
  2) files=("${group2[@]}") ;;
  "") echo "usage: gpu_tests.sh 1|2|FILE..." >&2; exit 2 ;;
  *) files=(); for f in "$@"; do files+=("$f:150"); done ;;
esac
: > "$out/summary.txt"
for entry in "${files[@]}"; do
  f="${entry%%:*}"; limit="${entry##*:}"
  start=$(date +%s)
  timeout "$limit" python3 -m pytest -v -m gpu "tests/$f" -p no:cacheprovider --tb=short \
    > "$out/${f%.py}.log" 2>&1
  rc=$?
  last=$(grep -E "passed|failed|error|skipped" "$out/${f%.py}.log" | tail -1)
  [ $rc -eq 124 ] && last="TIMED OUT after ${limit} s ($(grep -c PASSED "$out/${f%.py}.log") passed lines)"
  echo "$f rc=$rc $(( $(date +%s) - start ))s: $last" | tee -a "$out/summary.txt"
done
