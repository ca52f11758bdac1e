"""`python -m shardlab ARGS` for the tests, forked from a process that has already imported shardlab, torch and
transformers (a "zygote"), so a test's run does not spend ~8 s of CPU importing them again.

Why: on the 2-core CI machine a tiny `shardlab train` spent about half of its ~19 s wall time in imports
(`startup_s.launch_and_imports` 9.3 s), and the suite starts a few hundred of them. A child forked from the zygote
is still a fresh `shardlab` process in every way a test can see: its own pid, environment, working directory,
stdout/stderr files and exit status, and nothing of DeepSpeed's or torch.distributed's global state, because the
zygote only imports modules (it never builds a model, initialises a process group or runs a torch op, so it has no
threads and no OpenMP pool to break in a fork). shardlab forks its CPU ranks from its own launcher the same way
(launch/launcher.worker_start_method).

Where the fork would not behave like `python -m shardlab`, `run` starts a real interpreter instead: a request
whose environment differs from the zygote's (libraries read some variables at import), or a zygote that failed to start.

Protocol (one Unix socket per zygote, one connection per command): the client sends one JSON line
{argv, env, cwd, stdout, stderr}; the zygote forks, answers {"pid": N}, and when the child ends
{"returncode": R} (negative: killed by that signal, as subprocess reports it).
"""

from __future__ import annotations

import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# What a `python -m shardlab train` imports: the CLI, the launcher's preflight, the trainer with transformers, the
# engines (a dp run that exports imports DeepSpeed too: save_pretrained -> accelerate asks for it), datasets, the
# elastic launcher, the test presets' model classes (the planner imports one: 3.4 s). Not torch._inductor, which
# DeepSpeed imports: its config reads TORCHINDUCTOR_COMPILE_THREADS at import, which a run sets first
# (measure/compile_stats.limit_compile_workers).
PRELOAD = ("shardlab.cli", "shardlab.launch.launcher", "shardlab.training.trainer", "deepspeed", "datasets",
           "torch.distributed.elastic.multiprocessing", "torch.distributed.launcher.api", "torch.distributed.checkpoint",
           "transformers.models.gpt2.modeling_gpt2", "transformers.models.bloom.modeling_bloom",
           "transformers.models.llama.modeling_llama")
# Variables that legitimately differ between the zygote and a request: pytest's per-test bookkeeping.
IGNORED_ENV_PREFIXES = ("PYTEST_",)
UNBUFFERED = "PYTHONUNBUFFERED"
SUPERVISED_ENV = "SHARDLAB_SUPERVISED"  # shardlab.launch.supervise.SUPERVISED_ENV (not imported: the client stays light)


# ---------------------------------------------------------------------------------------------- the zygote's side


def _child(req: dict) -> None:
    """In the forked child: become `python -m shardlab ARGV` and never return into the zygote's loop."""
    code = 1
    try:
        os.setsid()  # its own process group: a timeout kills the command and every rank it started
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                                (2, req["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
            new = os.open(path, flags, 0o644)
            os.dup2(new, fd)
            os.close(new)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        # `shardlab train` would run itself again as a watched child (launch/supervise.py), a fresh interpreter that
        # imports everything anew; this child is the watched training process itself instead. The supervisor's own
        # behaviour (reporting a SIGKILLed training) is tested where tests start real processes (test_never_silent).
        os.environ.setdefault(SUPERVISED_ENV, req["plan"])
        import runpy

        sys.argv = ["shardlab", *req["argv"]]
        try:
            runpy.run_module("shardlab", run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exit_:
            c = exit_.code
            code = c if isinstance(c, int) else (0 if c is None else 1)
            if not isinstance(c, int) and c is not None:
                print(c, file=sys.stderr)
        except BaseException:  # what the interpreter would print before exiting 1
            import traceback

            traceback.print_exc()
            code = 1
        # The interpreter's own shutdown, in its order: join non-daemon threads, run exit hooks, flush.
        import threading

        threading._shutdown()
        import atexit

        atexit._run_exitfuncs()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def serve(sock_path: str) -> None:
    for name in PRELOAD:
        __import__(name)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(sock_path)
    server.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(server, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    print("ready", flush=True)
    while True:
        for key, _ in sel.select(timeout=0.05):
            conn, _ = server.accept()
            conn.settimeout(30)
            req = json.loads(conn.makefile("r").readline())
            pid = os.fork()
            if pid == 0:
                for other in (server, conn, *children.values()):
                    other.close()
                _child(req)
            children[pid] = conn
            conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
        while children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = children.pop(pid, None)
            if conn is None:
                continue
            code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
            try:
                conn.sendall((json.dumps({"returncode": code}) + "\n").encode())
            except OSError:
                pass
            conn.close()
        if os.getppid() == 1:  # the pytest process that started us is gone
            return


# ---------------------------------------------------------------------------------------------- the test's side


class Zygote:
    """One zygote per pytest process, started on first use and stopped at the session's end."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] = {}
        self.dir = ""
        self.failed = False
        self.ready = False
        self.served = 0  # commands forked from the zygote (the rest ran in a real interpreter)

    def start(self) -> None:
        """Start the zygote with this process's environment now (it imports in the background)."""
        if self.proc is not None:
            return
        self.dir = tempfile.mkdtemp(prefix="shardlab-zygote-")
        self.env = dict(os.environ, **{UNBUFFERED: "1"})
        self.proc = subprocess.Popen([sys.executable, __file__, os.path.join(self.dir, "sock")], env=self.env,
                                     stdout=subprocess.PIPE, stderr=open(os.path.join(self.dir, "zygote.log"), "w"),
                                     stdin=subprocess.DEVNULL, text=True)

    def _ready(self) -> bool:
        if self.ready:
            return self.proc.poll() is None
        if self.failed:
            return False
        self.start()
        for line in self.proc.stdout:  # what the imports print first (DeepSpeed's accelerator line), then "ready"
            if line.strip() == "ready":
                self.ready = True
                break
        if not self.ready:
            self.failed = True
            self.proc.kill()
        return self.ready

    def compatible(self, env: dict[str, str]) -> bool:
        keys = {k for k in (*env, *self.env) if not k.startswith(IGNORED_ENV_PREFIXES) and k != UNBUFFERED}
        return all(env.get(k) == self.env.get(k) for k in keys)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def run(self, argv: list[str], env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
            timeout: float | None = None) -> subprocess.CompletedProcess:
        """Like `subprocess.run([python, "-m", "shardlab", *argv], capture_output=True, text=True, stdin=DEVNULL)`."""
        env = dict(os.environ if env is None else env)
        cwd = os.fspath(cwd) if cwd is not None else os.getcwd()
        if not (self._ready() and self.compatible(env)):
            return subprocess.run([sys.executable, "-m", "shardlab", *argv], capture_output=True, text=True, env=env,
                                  cwd=cwd, timeout=timeout, stdin=subprocess.DEVNULL)
        with tempfile.TemporaryDirectory(prefix="shardlab-cmd-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect(os.path.join(self.dir, "sock"))
            req = {"argv": [str(a) for a in argv], "env": env, "cwd": cwd, "stdout": str(out), "stderr": str(err),
                   "plan": str(Path(tmp) / "plan.json")}
            conn.sendall((json.dumps(req) + "\n").encode())
            reader = conn.makefile("r")
            conn.settimeout(30)
            pid = json.loads(reader.readline())["pid"]
            deadline = None if timeout is None else time.monotonic() + timeout
            conn.settimeout(timeout)
            try:
                line = reader.readline()
            except (socket.timeout, TimeoutError):
                line = ""
            if not line:  # timed out (or the zygote died): end the command and its ranks, as subprocess.run would
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                conn.close()
                if deadline is not None and time.monotonic() >= deadline:
                    raise subprocess.TimeoutExpired(["shardlab", *argv], timeout, out.read_text(errors="replace"),
                                                    err.read_text(errors="replace"))
                raise RuntimeError(f"the test zygote died while running shardlab {' '.join(map(str, argv))}")
            conn.close()
            self.served += 1
            code = json.loads(line)["returncode"]
            return subprocess.CompletedProcess(["shardlab", *argv], code, out.read_text(errors="replace"),
                                               err.read_text(errors="replace"))


ZYGOTE = Zygote()


def run_shardlab(argv: list[str], env: dict[str, str] | None = None, cwd=None, timeout: float | None = None):
    return ZYGOTE.run(argv, env=env, cwd=cwd, timeout=timeout)


if __name__ == "__main__":
    serve(sys.argv[1])
