#!/usr/bin/env bash
# Megatron-DeepSpeed GPT pretraining with a Canzona optimizer from ds_config (CanzonaMuon in the shipped
# config; CanzonaShampoo / CanzonaSOAP with their own optimizer.params, docs/config.md), exact under TP
# (micro-group hosting).
# configs/ds_megatron_tp.json: ZeRO stage 1 -> DP x TP through DeepSpeed ZeRO (stage 2 works the same
# without pipeline parallelism; bf16 allowed); Megatron's --lr schedule drives the matrix lr (AdamW:
# x adam_lr/lr).  PP > 1 runs Megatron-DeepSpeed's pipeline (ZeRO 0 or 1).
# Needs a Megatron-DeepSpeed checkout (not on PyPI).  On GPUs as below; on a CPU machine add
# Megatron's CPU flags (docs/tp.md, "Megatron-DeepSpeed hook"), e.g.
#   EXTRA="--use-cpu-initialization --no-masked-softmax-fusion --no-bias-gelu-fusion --no-bias-dropout-fusion
#          --no-gradient-accumulation-fusion --distributed-backend gloo"
# tests/test_megatron_real.py runs this launch (the deepspeed launcher + the shim) on CPU.
#   MEGATRON_DS=/path/to/Megatron-DeepSpeed DATA=/path/to/data_text_document \
#   VOCAB=gpt2-vocab.json MERGES=gpt2-merges.txt NGPU=8 TP=8 bash launch/megatron_pretrain_gpt.sh
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MEGATRON_DS=${MEGATRON_DS:?set MEGATRON_DS to a Megatron-DeepSpeed checkout}
DATA=${DATA:?set DATA to a Megatron indexed dataset prefix}
NGPU=${NGPU:-8}
TP=${TP:-8}
PP=${PP:-1}
DS_CONFIG=${DS_CONFIG:-$HERE/configs/ds_megatron_tp.json}
LAYERS=${LAYERS:-24}; HIDDEN=${HIDDEN:-2048}; HEADS=${HEADS:-16}; FFN=${FFN:-6144}
SEQ=${SEQ:-2048}; GBS=${GBS:-$NGPU}; ITERS=${ITERS:-100}

deepspeed --num_gpus "$NGPU" "$HERE/launch/megatron_pretrain_gpt.py" "$MEGATRON_DS/pretrain_gpt.py" \
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" $([[ "$PP" == 1 ]] && echo --no-pipeline-parallel) \
  --num-layers "$LAYERS" --hidden-size "$HIDDEN" --num-attention-heads "$HEADS" --ffn-hidden-size "$FFN" \
  --swiglu --normalization rmsnorm --use-rotary-position-embeddings --disable-bias-linear \
  --seq-length "$SEQ" --max-position-embeddings "$SEQ" \
  --micro-batch-size 1 --global-batch-size "$GBS" --train-iters "$ITERS" \
  --lr 0.02 --min-lr 0.002 --lr-decay-style cosine --lr-warmup-iters 10 \
  --data-path "$DATA" --vocab-file "${VOCAB:?}" --merge-file "${MERGES:?}" --split 98,2,0 \
  --log-interval 10 --eval-iters 0 \
  ${EXTRA:-} --deepspeed --deepspeed_config "$DS_CONFIG" "$@"
