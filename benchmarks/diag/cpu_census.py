"""What a CPU run holds in host memory, phase by phase: a check of the CPU plan (`plan --device cpu`).

Runs one shardlab rank in this process on the CPU with glibc's default heap (an explicit host-RAM budget turns the
trainer's heap reuse off, so freed memory leaves the resident set and the figures are live memory), and around each
phase of the first steps (forward+backward, optimizer step) resets the kernel's resident high-water mark
(/proc/self/clear_refs, "5") to read each phase's own peak (VmHWM). After the set-up and after each step it counts the
tensors the engine holds: the model's parameters (data, ZeRO-3's partition, gradients), the optimizer's state, and
every tensor or list of tensors among the DeepSpeed optimizer's attributes, each storage once.

    python3 benchmarks/diag/cpu_census.py --model gpt2 --strategy zero3 --seq-len 256 --micro-batch 2 [--steps 3]

With MALLOC_MMAP_THRESHOLD_=65536 in the environment every allocation of 64 KiB or more is its own mapping, given back
when freed, so VmRSS and VmHWM follow live memory (the process baseline plus what torch holds) to within small
allocations: the figures the plan predicts, apart from the allocator's retention.

Linux only (procfs). Prints one table per phase; writes nothing.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

GiB = 1024**3


def status(key: str) -> float:
    """A /proc/self/status figure (VmRSS, VmHWM) in GiB."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024 / GiB
    return float("nan")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _storages(obj, depth: int = 0):
    """Tensors in obj (a tensor, or lists/tuples/dicts of them, two levels deep)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif depth < 2 and isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _storages(x, depth + 1)
    elif depth < 2 and isinstance(obj, dict):
        for x in obj.values():
            yield from _storages(x, depth + 1)


def census(strategy) -> list[tuple[str, float]]:  # noqa: C901 - a diagnostic: one walk over every kind of host tensor owner
    """(owner, GiB) of the host tensors the run holds, each storage counted once, under the first owner met."""
    seen: set[int] = set()
    out: dict[str, float] = collections.defaultdict(float)

    def add(owner: str, t: torch.Tensor) -> None:
        if hasattr(t, "to_local"):  # FSDP2's DTensor: this rank's shard
            t = t.to_local()
        if t.device.type != "cpu" or t.numel() == 0:
            return
        try:
            st = t.untyped_storage()
            key = st.data_ptr()
        except RuntimeError:  # a tensor subclass without a plain storage
            return
        if key in seen or key == 0:
            return
        seen.add(key)
        out[owner] += st.nbytes() / GiB

    model = getattr(strategy, "hf_model", None) or strategy.model
    for p in model.parameters():
        add("param.data", p.data)
        if hasattr(p, "ds_tensor"):
            add("param.ds_tensor (ZeRO-3 partition)", p.ds_tensor)
        if p.grad is not None:
            add("param.grad", p.grad)
    opt = getattr(strategy, "engine", None)
    opt = getattr(opt, "optimizer", None) or getattr(strategy, "optimizer", None)
    inner = getattr(opt, "optimizer", opt)
    for state in getattr(inner, "state", {}).values():
        for k, v in state.items():
            if isinstance(v, torch.Tensor):
                add(f"torch optimizer state[{k}]", v)
    for group in getattr(inner, "param_groups", []):
        for p in group["params"]:
            add("torch optimizer's params (the master partition)", p)
            if p.grad is not None:
                add("torch optimizer's params' .grad", p.grad)
    if opt is not None and opt is not inner:
        for name, val in vars(opt).items():
            for t in _storages(val):
                add(f"ds.{name}", t)
    return sorted(out.items(), key=lambda kv: -kv[1])


def show(title: str, rows: list[tuple[str, float]]) -> None:
    total = sum(v for _, v in rows)
    print(f"\n== {title}: {total:.3f} GiB of tensors; VmRSS {status('VmRSS'):.3f}, VmHWM {status('VmHWM'):.3f} GiB", flush=True)
    for name, v in rows:
        if v >= 0.001:
            print(f"   {v:8.3f}  {name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--strategy", default="zero3")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--reuse-heap", action="store_true",
                    help="keep the trainer's heap reuse on (no host-RAM budget): the resident set then keeps freed memory")
    ap.add_argument("--trim-mb", type=int, default=None, help="with --reuse-heap: M_TRIM_THRESHOLD in MiB (an experiment)")
    args = ap.parse_args()
    if args.trim_mb is not None:
        from shardlab.runtime import distributed

        distributed.HEAP_TRIM_BYTES = min(2**31 - 1, args.trim_mb * 2**20)

    from shardlab.config import RunConfig
    from shardlab.loop import trainer as T

    cfg = RunConfig(model=args.model, strategy=args.strategy, device="cpu", gpus=1,
                    seq_len=args.seq_len, micro_batch=args.micro_batch, max_steps=args.steps, precision=args.precision,
                    eval_at_start=False, cpu_memory_budget_gb=None if args.reuse_heap else 1000.0, output_dir=f"/tmp/cpu_census_{os.getpid()}")
    cfg.export = False
    step_no = [0]
    orig_step = T.Trainer._train_step

    def step(self, strategy, batches):
        if step_no[0] == 0:
            show("after set-up (before step 1)", census(strategy))
        step_no[0] += 1
        base_opt = strategy.optimizer_step
        reset_peak()
        r0 = status("VmRSS")

        def timed_opt():
            print(f"-- step {step_no[0]} forward+backward: from {r0:.3f} peak {status('VmHWM'):.3f}, "
                  f"then {status('VmRSS'):.3f} GiB", flush=True)
            reset_peak()
            r1 = status("VmRSS")
            out = base_opt()
            print(f"-- step {step_no[0]} optimizer step: from {r1:.3f} peak {status('VmHWM'):.3f}, "
                  f"then {status('VmRSS'):.3f} GiB", flush=True)
            return out

        strategy.optimizer_step = timed_opt
        try:
            return orig_step(self, strategy, batches)
        finally:
            strategy.optimizer_step = base_opt
            show(f"after step {step_no[0]}", census(strategy))

    T.Trainer._train_step = step
    T.run_worker(cfg)


if __name__ == "__main__":
    sys.exit(main())
