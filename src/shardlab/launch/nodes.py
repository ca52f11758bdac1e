"""Which node am I: `--nodes/--node-rank/--master-addr`, a DeepSpeed-style hostfile, or SLURM's variables.

Every node runs the same `shardlab train` command; each starts its own workers (no SSH, unlike
the `deepspeed` launcher), and they meet at node 0's address. A hostfile or SLURM only fill in
the numbers a user would otherwise type.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from ..config import RunConfig
from ..runtime.distributed import NODE_AGENT_ENV, first_slurm_host
from ..errors import UserError


def read_hostfile(path: str | Path) -> list[tuple[str, int]]:
    """DeepSpeed's format: one `hostname slots=N` per line; `#` comments and blank lines ignored."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"hostfile {str(p)!r} not found", "check the path given to --hostfile")
    hosts: list[tuple[str, int]] = []
    for number, raw in enumerate(p.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        slots = [x for x in parts[1:] if x.startswith("slots=")]
        try:
            if len(parts) != 2 or len(slots) != 1 or int(slots[0].split("=", 1)[1]) < 1:
                raise ValueError
            hosts.append((parts[0], int(slots[0].split("=", 1)[1])))
        except ValueError:
            raise UserError(f"hostfile {str(p)!r} line {number} is not 'hostname slots=N': {raw.strip()!r}", "write one 'hostname slots=N' per line") from None
    if not hosts:
        raise UserError(f"hostfile {str(p)!r} lists no hosts", "write one 'hostname slots=N' per line")
    return hosts


def _local_names() -> set[str]:
    names = {"localhost", "127.0.0.1", socket.gethostname(), socket.getfqdn()}
    try:
        names.update(socket.gethostbyname_ex(socket.gethostname())[2])
    except OSError:
        pass
    return names


def apply_hostfile(cfg: RunConfig) -> RunConfig:
    hosts = read_hostfile(cfg.hostfile)  # type: ignore[arg-type]
    slots = {n for _, n in hosts}
    if len(slots) != 1:
        raise UserError(f"hostfile {cfg.hostfile!r} gives hosts different slot counts {sorted(slots)}", "use the same slots=N on every line (one worker per GPU on every node)")
    mine = [i for i, (host, _) in enumerate(hosts) if host in _local_names()]
    node_rank = cfg.node_rank
    if len(mine) == 1:
        node_rank = mine[0]
    elif len(mine) > 1 and node_rank not in mine:
        raise UserError(f"this machine appears {len(mine)} times in hostfile {cfg.hostfile!r}", f"pass --node-rank (one of {mine})")
    elif not mine and node_rank >= len(hosts):
        raise UserError(f"--node-rank {node_rank} but hostfile {cfg.hostfile!r} lists {len(hosts)} host(s)", "pass a node rank below the number of hosts")
    return cfg.model_copy(update={"nodes": len(hosts), "gpus": slots.pop(), "node_rank": node_rank, "master_addr": hosts[0][0]})


def apply_slurm_node_agent(cfg: RunConfig) -> RunConfig:
    """One srun task per node (the script `shardlab slurm` writes): the node's place from SLURM."""
    nodes = int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)
    update: dict = {"nodes": nodes, "node_rank": int(os.environ.get("SLURM_NODEID", "0"))}
    first = first_slurm_host()  # the node list's first host ("gpu[07-09]" -> "gpu07"), without calling scontrol
    if first:
        update["master_addr"] = first
    return cfg.model_copy(update=update)


def resolve_nodes(cfg: RunConfig) -> RunConfig:
    if os.environ.get(NODE_AGENT_ENV) == "slurm" and "SLURM_JOB_ID" in os.environ:
        return apply_slurm_node_agent(cfg)
    if cfg.hostfile:
        return apply_hostfile(cfg)
    return cfg


def single_machine_note(cfg: RunConfig) -> str | None:
    """--nodes N > 1 with node 0's address left at its default (no --master-addr, hostfile or SLURM): every node then
    meets at 127.0.0.1, which only works if every "node" runs on this machine; elsewhere they wait out the rendezvous
    timeout (600 s) without a word. Said at the start, not refused: several nodes on one machine are a real test set-up."""
    default = RunConfig.model_fields["master_addr"].default
    if cfg.nodes < 2 or cfg.hostfile or "master_addr" in cfg.model_fields_set or cfg.master_addr != default:
        return None
    return (f"--nodes {cfg.nodes} without --master-addr: the nodes meet at {default}, this machine, which works only if all "
            f"{cfg.nodes} run here; across machines pass --master-addr <node 0's address> on every node (or --hostfile, or "
            "submit with `shardlab slurm`)")
