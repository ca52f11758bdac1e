#!/bin/bash
# usage: run.sh SRC_DIR OUT_DIR  -- 10 steps saving every 5, then resume to 14, dp fp32 tiny-gpt2, seq 64
set -e
SRC=$1; OUT=$2; rm -rf $OUT
A="--model tiny-gpt2 --strategy dp --seq-len 64 --micro-batch 2 --grad-accum 2 --lr 1e-3 --dropout 0 --precision fp32 --log-every 1 --no-export"
cd $SRC
PYTHONPATH=$SRC/src HF_HUB_OFFLINE=1 python -m shardlab train $A --max-steps 10 --save-every 5 --output-dir $OUT > $OUT.log1 2>&1
rm -rf $OUT/checkpoints/step-0000010 2>/dev/null || true
PYTHONPATH=$SRC/src HF_HUB_OFFLINE=1 python -m shardlab train $A --max-steps 14 --save-every 5 --resume auto --output-dir $OUT > $OUT.log2 2>&1
