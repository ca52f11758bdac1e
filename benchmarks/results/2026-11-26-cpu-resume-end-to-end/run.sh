set -x
A="--model tiny-gpt2 --strategy dp --device cpu --dataset offline --seq-len 16 --micro-batch 1 --grad-accum 1 --precision fp32 --lr 1e-4 --lr-schedule constant --set eval_at_start=false --set dataset.eval_samples=1 --no-export --log-every 1000"
T0=$(date +%s); shardlab train $A --max-steps 8170 --save-every 8170 --output-dir /tmp/rs/long > long.log 2>&1; echo "long rc=$? $(( $(date +%s)-T0 )) s"
for i in 1 2 3; do
  rm -rf /tmp/rs/resumed$i; cp -r /tmp/rs/long /tmp/rs/resumed$i
  shardlab train $A --max-steps 8171 --resume auto --output-dir /tmp/rs/resumed$i > resumed$i.log 2>&1; echo "resumed$i rc=$?"
  shardlab train $A --max-steps 1 --output-dir /tmp/rs/fresh$i --overwrite > fresh$i.log 2>&1; echo "fresh$i rc=$?"
done
