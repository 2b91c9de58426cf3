#!/usr/bin/env bash
# (E2E: python -m dpexp.reproduce experiment=li2022_table2 scale=offline replaces this script; it stays for DART.)
# Offline table-to-text records with a small randomly initialised GPT-2 (gpt2_tiny: 4 layers, width 128, BPE
# tokenizer trained on the training texts) -- the CPU stand-in for Li et al. 2022 sec. 5.2 / He et al. 2023
# Table 5, which fine-tune pretrained GPT-2 on the full training sets.
#   e2e:  train on the E2E dev set, evaluate on the test set (200 evenly spaced MRs, all references)
#   dart: train on dev_train, evaluate on dev_eval (a seeded 80/20 split of the DART dev triple sets)
# 3 epochs, B = 64, Adam lr 2e-3 (He et al. Table 9's lr), epsilon 8, delta = 1/(2n).
# Usage: bash scripts/runs/table2text_gpt2tiny.sh TASK CLIP[,CLIP...]    e.g. dart nonprivate,bk,perlayer
# Records go to results/runs/<task>_gpt2tiny_eps8/<clip>/ ; `make tables` turns them into a table.
set -euo pipefail
TASK=$1
CLIPS=$2
PY=${PY:-.venv/bin/python}
EVAL=()
if [[ $TASK == e2e ]]; then EVAL=(task.eval_max_inputs=200); fi
"$PY" -m dpexp.train -m "task=${TASK}" model=gpt2_tiny data.root=../shared/data "clip=${CLIPS}" \
  optim=adam optim.lr=2e-3 privacy.epsilon=8 epochs=3 batch_size=64 physical_batch_size=64 \
  eval_every=null progress=false "${EVAL[@]}" \
  "hydra.sweep.dir=results/runs/${TASK}_gpt2tiny_eps8" 'hydra.sweep.subdir=${hydra:runtime.choices.clip}'
