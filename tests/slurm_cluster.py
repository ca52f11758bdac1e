"""A real one-node SLURM cluster on localhost for the tests: munged, slurmctld and slurmd from Debian's
packages, each in the foreground as a child process, with every file (keys, state, logs, sockets) in a
temporary directory and free ports, so nothing of the machine's own configuration is touched.

`make setup` installs the packages when it runs as root; without them (or without root, which
slurmd needs to start job steps) the tests that use it skip and say why.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

from patience import patience

from shardlab.runtime.distributed import free_port

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scontrol", "scancel", "srun")


def missing_reason() -> str | None:
    if os.geteuid() != 0:
        return "the local SLURM cluster needs root (slurmd starts job steps as any user)"
    missing = [b for b in DAEMONS + CLIENTS if shutil.which(b) is None]
    if missing:
        return f"SLURM/munge not installed ({', '.join(missing)} missing): `make setup` as root installs slurmctld slurmd munge (apt-get)"
    return None


CONF = """ClusterName=shardlabtest
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job waits this long before it may start again (default 120 s)
AuthInfo=socket={root}/munge/munge.socket,cred_expire=5
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1,sched_min_interval=100000
MpiDefault=none
ReturnToService=2
JobRequeue=1
KillWait=60
NodeName=localhost NodeHostname={hostname} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=2000 State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
"""


class LocalSlurm:
    def __init__(self, root: Path):
        self.root = root
        self.conf = root / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    def start(self) -> "LocalSlurm":
        r = self.root
        for d in ("munge", "state", "spool", "log"):
            (r / d).mkdir(parents=True, exist_ok=True)
        r.chmod(0o755)
        (r / "munge").chmod(0o700)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        cpus = int(subprocess.run(["slurmd", "-C"], capture_output=True, text=True).stdout.split("CPUs=")[1].split()[0])
        self.conf.write_text(CONF.format(root=r, ctld_port=free_port(), d_port=free_port(), hostname=socket.gethostname(), cpus=cpus))
        log = open(r / "log" / "daemons.out", "ab")  # noqa: SIM115 - kept open for the daemons' lifetime
        munge = ["munged", "-F", "--force", f"--socket={r}/munge/munge.socket", f"--key-file={key}", f"--pid-file={r}/munge/munged.pid",
                 f"--log-file={r}/log/munged.log", f"--seed-file={r}/munge/seed"]  # fmt: skip
        for cmd in (munge, ["slurmctld", "-D", "-f", str(self.conf)], ["slurmd", "-D", "-f", str(self.conf)]):
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=log, env=self.env, start_new_session=True))
            time.sleep(0.5)
        deadline = time.time() + patience(60)
        while time.time() < deadline:
            out = self.run("sinfo", "-h", "-o", "%t", check=False).stdout.strip()
            if out in ("idle", "mix", "alloc"):
                return self
            time.sleep(0.5)
        raise RuntimeError(f"local SLURM did not come up (sinfo: {out!r}); logs in {r / 'log'}")

    def run(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, capture_output=True, text=True, env=self.env, check=check, timeout=patience(60))

    def state(self, job: str) -> str:
        out = self.run("scontrol", "show", "job", job, check=False).stdout
        return out.split("JobState=")[1].split()[0] if "JobState=" in out else "UNKNOWN"

    def restarts(self, job: str) -> int:
        out = self.run("scontrol", "show", "job", job, check=False).stdout
        return int(out.split("Restarts=")[1].split()[0]) if "Restarts=" in out else -1

    def wait_state(self, job: str, states: set[str], timeout: float) -> str:
        deadline = time.time() + patience(timeout)
        state = ""
        while time.time() < deadline:
            state = self.state(job)
            if state in states:
                return state
            time.sleep(0.3)
        raise TimeoutError(f"job {job} stayed {state} (wanted {states}) for {timeout} s")

    def stop(self) -> None:
        self.run("scancel", "--user=root", check=False)
        for p in reversed(self.procs):  # slurmd, slurmctld, munged
            p.terminate()
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
