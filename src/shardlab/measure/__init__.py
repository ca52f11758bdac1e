"""What a run measures about itself, and how.

    metrics.py        step timers, throughput, memory, metrics.jsonl
    monitor.py        NVML / psutil samplers run from the launching process
    mfu.py            model FLOPs per token and MFU against known GPU peaks
    profiling.py      `--profile`: torch.profiler over a few steady-state steps
    timesplit.py      where an offload step's time goes (GPU, transfers, CPU optimizer, idle)
    compile_stats.py  torch.compile time and cache hits

The package itself imports nothing.
"""
