#!/usr/bin/env bash
# The GPU-marked tests on the lent H200, most telling first, each file under its own time
# limit (a killed file still leaves the others' results), one log per file and a summary in
# $OUT/gpu_tests/summary.txt. A device call may run 600 s, so the files come in four groups
# of at most 520 s of limits each: one call per group (group 3, test_gemv, compiles every
# GEMV candidate: run it when the GEMV kernel or its candidates change; group 4 holds the
# attention, argmax and small fused kernels, the verify tiles' search and the shift kernel).
# The device has no openai/uvicorn (the server tests are not GPU tests). Usage on the device
# (repository root):
#   PYTHONPATH=src bash scripts/gpu_tests.sh 1          # group 1 (then: ... gpu_tests.sh 2)
#   PYTHONPATH=src bash scripts/gpu_tests.sh runtime/test_cuda_graphs.py kernels/test_pdl_gpu.py  # 150 s each
#   PYTHONPATH=src bash scripts/gpu_tests.sh kernels/test_pdl_gpu.py:330 tuning/test_plan_tuning.py:80
set -u
out="${OUT:-/tmp}/gpu_tests"
mkdir -p "$out"
export HF_HUB_OFFLINE=1
# file:seconds (session 6 on the H200: pdl_gpu ~160 s, triton_ops 18, triton_attention 58,
# cuda_graphs 9, spec_host_paths 7, drafter_graphs 36, feature_graphs 65, overlap_gpu 58;
# session 9 added ~50 s of gate/up epilogue tests to pdl_gpu; plan_tuning ~40 s; session 10
# added the rope epilogue cases to pdl_gpu; session 11 on the H200: pdl_gpu 227 s,
# plan_tuning 35, gemv_stream_k 12-43, cuda_graphs 9, spec_host_paths 7, drafter_graphs 32,
# feature_graphs 65, overlap_gpu 70; session 13: verify_tiles 56, triton_attention 62;
# session 14: pdl_gpu over 300 (17 of its 18 tests), overlap_gpu 114, triton_attention 91;
# session 16: packing_shift 4 s; session 38: counter_noise)
group1=(kernels/test_pdl_gpu.py:380 kernels/test_gemv_stream_k.py:90 runtime/test_cuda_graphs.py:40)
group2=(tuning/test_plan_tuning.py:80 speculative/test_drafter_graphs.py:100
        runtime/test_feature_graphs.py:130 engine/test_overlap_gpu.py:150
        speculative/test_spec_host_paths.py:40)
group3=(kernels/test_gemv.py:520)
group4=(kernels/test_triton_attention.py:100 kernels/test_argmax.py:90 layers/test_triton_ops.py:60
        tuning/test_verify_tiles.py:120 runtime/test_packing_shift.py:60 kernels/test_counter_noise.py:60
        runtime/test_graph_staging.py:60)
case "${1:-}" in
  1) files=("${group1[@]}") ;;
  2) files=("${group2[@]}") ;;
  3) files=("${group3[@]}") ;;
  4) files=("${group4[@]}") ;;
  "") echo "usage: gpu_tests.sh 1|2|3|4|FILE..." >&2; exit 2 ;;
  *) files=(); for f in "$@"; do [[ "$f" == *:* ]] && files+=("$f") || files+=("$f:150"); done ;;
esac
: > "$out/summary.txt"
for entry in "${files[@]}"; do
  f="${entry%%:*}"; limit="${entry##*:}"; log="$out/$(basename "${f%.py}").log"
  start=$(date +%s)
  timeout "$limit" python3 -m pytest -v -m gpu "tests/$f" -p no:cacheprovider --tb=short \
    > "$log" 2>&1
  rc=$?
  last=$(grep -E "passed|failed|error|skipped" "$log" | tail -1)
  [ $rc -eq 124 ] && last="TIMED OUT after ${limit} s ($(grep -c PASSED "$log") passed lines)"
  echo "$f rc=$rc $(( $(date +%s) - start ))s: $last" | tee -a "$out/summary.txt"
done
