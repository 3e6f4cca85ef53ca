#!/usr/bin/env bash
# Reassemble a head that scripts/gpu_train_head.sh brought back in parts, into a head folder:
#   bash scripts/unpack_head.sh FETCHED_DIR [DEST]   (DEST: the shipped head's folder)
# Joins model.safetensors.part-* in name order, copies config.json and heldout_prompts.jsonl,
# and checks that the head loads for the default model.
set -euo pipefail
SRC=${1:?give the folder the GPU run's files were fetched to}
REPO=$(cd "$(dirname "$0")/.." && pwd)
DEST=${2:-$REPO/src/specserve/data/eagle3-smollm2-135m}
mkdir -p "$DEST"
cat "$SRC"/model.safetensors.part-* > "$DEST/model.safetensors"
cp "$SRC/config.json" "$SRC/heldout_prompts.jsonl" "$DEST/"
sha256sum "$DEST/model.safetensors"
PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}" python - "$DEST" <<'PY'
import sys
import torch
from specserve.model.eagle3 import load_eagle3_head
from specserve.model.loader import load_config, resolve_model
head = load_eagle3_head(sys.argv[1], load_config(resolve_model(None)), torch.bfloat16, "cpu")
print("loads: draft vocabulary", head.config.draft_vocab_size, "aux layers", head.aux_layer_ids)
PY
