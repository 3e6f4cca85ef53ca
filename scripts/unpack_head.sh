#!/usr/bin/env bash
# Bring a head trained by scripts/gpu_train_head.sh into the repository, from the files the GPU
# call brought back:
#   bash scripts/unpack_head.sh FETCHED_DIR [DEST]   (DEST: the shipped head's folder)
# Joins model.safetensors.part-* in name order into DEST/model.safetensors, copies
# config.json and heldout_prompts.jsonl beside it, checks that the head loads for the default
# model, copies the raw results to docs/benchmarks/eagle3_smollm2_* (only into the repository's
# own docs, and only when DEST is the shipped head's folder), and prints the numbers for
# docs/eagle3_training.md (scripts/summarize_head_run.py).
set -euo pipefail
SRC=${1:?give the folder that the files of the GPU run were fetched to}
REPO=$(cd "$(dirname "$0")/.." && pwd)
SHIPPED=$REPO/src/specserve/data/eagle3-smollm2-135m
DEST=${2:-$SHIPPED}
mkdir -p "$DEST"
cat "$SRC"/model.safetensors.part-* > "$DEST/model.safetensors"
cp "$SRC/config.json" "$SRC/heldout_prompts.jsonl" "$DEST/"
sha256sum "$DEST/model.safetensors"
PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}" ${PYTHON:-python3} - "$DEST" <<'PY'
import sys
import torch
from specserve.model.eagle3 import load_eagle3_head
from specserve.model.loader import load_config, resolve_model
head = load_eagle3_head(sys.argv[1], load_config(resolve_model(None)), torch.bfloat16, "cpu")
print("loads: draft vocabulary", head.config.draft_vocab_size, "aux layers", head.aux_layer_ids)
PY
if [ "$DEST" = "$SHIPPED" ]; then
  BENCH=$REPO/docs/benchmarks
  cp "$SRC/log.jsonl" "$BENCH/eagle3_smollm2_train_log.jsonl"
  # the code recipe's evaluations, or the chat recipe's (the new head's, the replaced one's)
  for f in heldout unlike chat; do
    if [ -f "$SRC/eval_$f.json" ]; then cp "$SRC/eval_$f.json" "$BENCH/eagle3_smollm2_eval_$f.json"; fi
  done
  if [ -f "$SRC/shipped_eval_chat.json" ]; then
    cp "$SRC/shipped_eval_chat.json" "$BENCH/eagle3_smollm2_eval_chat_previous_head.json"
  fi
  # The GPU machine's absolute paths do not belong in the repository: the run folder becomes
  # RUN, the chat recipe's work folder WORK, repository files become repository-relative.
  sed -E -i 's#"/[^"]*/docs/benchmarks/#"docs/benchmarks/#g; s#"/[^"]*/run(/|")#"RUN\1#g;
      s#"/[^"]*/(src/specserve/data/)#"\1#g; s#"/[^"]*/chat-[a-z]*/#"WORK/#g' \
    "$BENCH"/eagle3_smollm2_train_log.jsonl "$BENCH"/eagle3_smollm2_eval_*.json
fi
${PYTHON:-python3} "$REPO/scripts/summarize_head_run.py" "$SRC"
