"""`python -m shardlab ARGS` for the tests, forked from a process that has already imported shardlab, torch and
transformers (a "zygote"), so a test's run does not spend ~8 s of CPU importing them again.

Why: on the 2-core CI machine a tiny `shardlab train` spent about half of its ~19 s wall time in imports
(`startup_s.launch_and_imports` 9.3 s), and the suite starts a few hundred of them. A child forked from the zygote
is still a fresh `shardlab` process in every way a test can see: its own pid, environment, working directory,
stdout/stderr files and exit status, and nothing of DeepSpeed's or torch.distributed's global state, because the
zygote only imports modules and loads DeepSpeed's already-built ops (it never builds a model, initialises a process
group or runs a torch op, so it has no threads and no OpenMP pool to break in a fork). shardlab forks its CPU ranks from its own launcher the same way
(launch/launcher.worker_start_method).

Where the fork would not behave like `python -m shardlab`, `run` starts a real interpreter instead: a request
whose environment differs from the zygote's (libraries read some variables at import), or a zygote that failed to start.

Protocol (one Unix socket per zygote, one connection per command): the client sends one JSON line
{argv, env, cwd, stdout, stderr, plan[, append, check]}; the zygote forks, answers {"pid": N}, and when the child ends
{"returncode": R} (negative: killed by that signal, as subprocess reports it). `plan` is the file a supervised
`shardlab train` writes its plan to (launch/supervise.py). With `check`, the zygote first compares the environment
itself and answers {"fallback": [names]} instead of forking when it differs. A client that disconnects before its
command ended takes the command with it (its process group is killed). Neither side waits on the other for a fixed
time: the client waits for {"pid": N} as long as the zygote lives, and runs the command in a real interpreter if the
zygote is gone; the zygote reads requests as they arrive and survives any one client.

A command forked from here that starts further `shardlab` processes itself (`shardlab bench` starts one per cell)
starts them through the same zygote: `python zygote.py --client SOCKET ARGS...` behaves like
`python -m shardlab ARGS...` (stdout, stderr, working directory, environment, exit status or signal, SIGTERM/SIGINT
passed on), the command forked from the zygote, or exec'd as a real interpreter where the zygote cannot serve.
"""

from __future__ import annotations

import json
import os
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from patience import patience

# What a `python -m shardlab train` imports: the CLI, the launcher's preflight, the trainer with transformers, the
# engines (a dp run that exports imports DeepSpeed too: save_pretrained -> accelerate asks for it), datasets, the
# elastic launcher, the test presets' model classes (the planner imports one: 3.4 s), and DeepSpeed's Muon module,
# which every ZeRO engine imports in its optimizer check (engine._do_optimizer_sanity_check) and which imports
# torch._dynamo and inductor's config: 2.6 s of CPU in every DeepSpeed rank. Inductor's config reads
# TORCHINDUCTOR_COMPILE_THREADS at import, before a run sets it; measure/compile_stats.limit_compile_workers passes the
# value on to an imported config.
PRELOAD = ("shardlab.cli", "shardlab.launch.launcher", "shardlab.loop.trainer", "deepspeed", "datasets",
           "torch.distributed.elastic.multiprocessing", "torch.distributed.launcher.api", "torch.distributed.checkpoint",
           "transformers.models.gpt2.modeling_gpt2", "transformers.models.bloom.modeling_bloom",
           "transformers.models.llama.modeling_llama", "deepspeed.runtime.zero.muon.muon_optimizer")
# Variables that may differ between the zygote and a request: pytest's per-test bookkeeping, and shardlab's own,
# which shardlab reads when it uses them, never at import (a test's SHARDLAB_FAULTS, SHARDLAB_COMPILE_BACKEND).
IGNORED_ENV_PREFIXES = ("PYTEST_", "SHARDLAB_")
# What a launcher (srun, torchrun) gives each process, read when a run sets up its process group or submits a job: no
# PRELOAD module reads SLURM_* or these names at import (checked with a spy on os.environ), so a test's srun-like ranks
# and its `shardlab slurm` (SLURM_CONF) fork like the others.
LAUNCH_ENV_PREFIXES = ("SLURM_",)
LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
UNBUFFERED = "PYTHONUNBUFFERED"
# Variables a library reads when it works, not at import, whose value (not presence) may differ: inductor's cache
# directory, which torch reads on every cache lookup (torch._inductor.runtime.cache_dir_utils.cache_dir). Of the import-
# time readers in torch 2.13 only torch._dynamo.package's DynamoCache keeps a path, and it is used with
# TORCH_CACHING_PRECOMPILE=1 alone. A test giving its runs a cache of their own (test_compile_stats) forks like the others.
# Set in one environment and not in the other still differs: a fresh interpreter without it has it set at import.
RUNTIME_VALUE_ENV = ("TORCHINDUCTOR_CACHE_DIR",)
SUPERVISED_ENV = "SHARDLAB_SUPERVISED"  # shardlab.launch.supervise.SUPERVISED_ENV (not imported: the client stays light)
IMPORTS_SET: dict[str, str] = {}  # in the zygote: what importing PRELOAD set in os.environ
SOCKET = ""  # in the zygote: the path it serves on


def env_mismatch(env: dict[str, str], base: dict[str, str], imports_set: dict[str, str]) -> list[str]:
    """The variables in which a request's environment differs from the zygote's start environment ``base`` in a way
    the forked command could see: not PYTEST_*/SHARDLAB_* (read at run time), not a launcher's (LAUNCH_ENV: read when
    the process group starts), not PYTHONUNBUFFERED (the child's streams are files it flushes), not another value of a
    RUNTIME_VALUE_ENV variable set in both, and not what the imports themselves set (the child gets those as a fresh
    interpreter would: setdefault)."""
    keys = {k for k in (*env, *base) if not k.startswith(IGNORED_ENV_PREFIXES + LAUNCH_ENV_PREFIXES)
            and k != UNBUFFERED and k not in LAUNCH_ENV
            and not (k in RUNTIME_VALUE_ENV and k in env and k in base)}
    return sorted(k for k in keys if env.get(k) != base.get(k)
                  and not (k in imports_set and env.get(k) in (None, imports_set[k])))


# ---------------------------------------------------------------------------------------------- the zygote's side


def _child(req: dict) -> None:
    """In the forked child: become `python -m shardlab ARGV` and never return into the zygote's loop."""
    code = 1
    try:
        os.setsid()  # its own process group: a timeout kills the command and every rank it started
        _die_with_parent()  # a command outliving the zygote (its test session ended) is killed, never left training
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        # A client's own stdout/stderr (/proc/PID/fd/N) are opened to append: both may be one file (2>&1)
        write = os.O_WRONLY | (os.O_APPEND if req.get("append") else os.O_CREAT | os.O_TRUNC)
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, req["stdout"], write), (2, req["stderr"], write)):
            new = os.open(path, flags, 0o644)
            os.dup2(new, fd)
            os.close(new)
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        for key, value in IMPORTS_SET.items():  # as the imports would have set them in a fresh interpreter
            os.environ.setdefault(key, value)
        # `shardlab train` would run itself again as a watched child (launch/supervise.py), a fresh interpreter that
        # imports everything anew; this child is the watched training process itself instead. The supervisor's own
        # behaviour (reporting a SIGKILLed training) is tested where tests start real processes (test_never_silent).
        os.environ.setdefault(SUPERVISED_ENV, req["plan"])
        from shardlab.bench import runner  # a bench's cells start through this zygote too (module doc)

        runner.SHARDLAB_COMMAND = (sys.executable, os.path.abspath(__file__), "--client", SOCKET)
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


def _die_with_parent() -> None:
    """SIGKILL this process when its parent dies (Linux prctl PR_SET_PDEATHSIG)."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)


# DeepSpeed's ops that shardlab's CPU runs load (CPU Adam for offload, FusedAdam's CPU build for the other ZeRO runs,
# async_io for infinity). Loading a built op is ~2.7 s of CPU (its builder's compiler and ninja checks), in every rank
# of every run; the zygote loads each once its build exists (the first run that needs it builds it), and children
# find it in DeepSpeed's own cache of loaded ops (OpBuilder._loaded_ops).
DEEPSPEED_OPS = {"cpu_adam": "CPUAdamBuilder", "fused_adam": "FusedAdamBuilder", "async_io": "AsyncIOBuilder"}


def _load_built_ops(pending: dict[str, str]) -> None:
    """Load the ops of ``pending`` whose build is finished (their .so exists, no build holds the lock); drop them."""
    from torch.utils.cpp_extension import _get_build_directory

    for name, builder in list(pending.items()):
        build = Path(_get_build_directory(name, False))  # where torch's JIT load builds it ($TORCH_EXTENSIONS_DIR too)
        if not (build / f"{name}.so").is_file() or (build / "lock").exists():
            continue
        del pending[name]
        env = dict(os.environ)
        try:
            from deepspeed.accelerator import get_accelerator

            t0 = time.perf_counter()
            get_accelerator().create_op_builder(builder).load(verbose=False)
            print(f"zygote: preloaded DeepSpeed's {name} op ({time.perf_counter() - t0:.1f} s)", file=sys.stderr, flush=True)
        except Exception as e:  # noqa: BLE001 - a child loads (or fails to load) it itself, as without the zygote
            print(f"zygote: not preloading {name}: {e}", file=sys.stderr, flush=True)
        finally:  # a load must not change what children inherit
            os.environ.clear()
            os.environ.update(env)


def serve(sock_path: str) -> None:
    """The zygote's loop: one thread, never blocked on a client and never ended by one.

    Nothing in it waits on a client for a fixed time: a connection is read as its bytes arrive (a client descheduled
    between connect and send on a busy machine delays only itself), and a client that goes away, or sends garbage,
    costs only its own command. DeepSpeed's built ops are loaded while no request waits, not before answering one."""
    _die_with_parent()  # the pytest process that started us is gone
    before = dict(os.environ)
    for name in PRELOAD:
        __import__(name)
    # What the imports set in the environment (DeepSpeed: PYTORCH_NVML_BASED_CUDA_CHECK=1, with setdefault): a fresh
    # `shardlab` process gets them the same way, so every child gets them too (_child), and the client does not count
    # them as a difference.
    global IMPORTS_SET, SOCKET
    IMPORTS_SET = {k: v for k, v in os.environ.items() if before.get(k) != v}
    SOCKET = os.path.abspath(sock_path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(sock_path)
    server.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(server, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    requests: dict[socket.socket, bytes] = {}  # connections whose request line has not fully arrived
    ops_pending = dict(DEEPSPEED_OPS)
    ops_checked = 0.0
    print("ready", json.dumps(IMPORTS_SET), flush=True)
    while True:
        events = sel.select(timeout=0.05)
        for key, _ in events:
            try:
                if key.fileobj is server:
                    conn, _ = server.accept()
                    conn.setblocking(False)
                    requests[conn] = b""
                    sel.register(conn, selectors.EVENT_READ)
                elif key.fileobj in requests:
                    _read_request(key.fileobj, requests, sel, children, before, server)
                else:
                    _watch_client(key.fileobj, key.data, sel)
            except Exception as err:  # noqa: BLE001 - one connection's trouble is never the zygote's end
                print(f"zygote: {type(err).__name__}: {err}", file=sys.stderr, flush=True)
        if not events and not requests and ops_pending and time.monotonic() > ops_checked + 1:  # idle: nobody waits
            _load_built_ops(ops_pending)  # (while an op loads)
            ops_checked = time.monotonic()
        _reap(children, sel)


def _send(conn: socket.socket, message: dict) -> bool:
    """One JSON line to a client; False if it has gone."""
    try:
        conn.setblocking(True)
        conn.sendall((json.dumps(message) + "\n").encode())
        return True
    except OSError:
        return False


def _read_request(conn: socket.socket, requests: dict, sel, children: dict, base_env: dict, server) -> None:
    """What has arrived of a client's request; once its line is whole, answer it (fork, or say to fall back)."""
    try:
        chunk = conn.recv(65536)
    except BlockingIOError:
        return
    except OSError:
        chunk = b""
    buf = requests[conn] + chunk
    if not chunk or b"\n" in buf:
        del requests[conn]
        sel.unregister(conn)
    if not chunk:  # gone before its request was whole
        conn.close()
        return
    if b"\n" not in buf:
        requests[conn] = buf
        return
    try:
        req = json.loads(buf.split(b"\n", 1)[0])
    except ValueError:
        conn.close()
        raise
    if req.get("check"):
        differ = env_mismatch(req["env"], base_env, IMPORTS_SET)
        if differ:
            _send(conn, {"fallback": differ})
            conn.close()
            return
    pid = os.fork()
    if pid == 0:
        for other in (server, conn, *requests, *children.values()):
            other.close()
        _child(req)
    children[pid] = conn
    print(f"forked {pid}: shardlab {' '.join(req['argv'])}", file=sys.stderr, flush=True)  # zygote.log
    if _send(conn, {"pid": pid}):
        conn.setblocking(False)
        sel.register(conn, selectors.EVENT_READ, pid)
    else:  # the client went away meanwhile: so does its command (the reaper collects it)
        _kill_command(pid)


def _kill_command(pid: int) -> None:
    """SIGKILL a forked command and its process group (the child makes its own group first thing; until then, itself)."""
    for kill, target in ((os.killpg, pid), (os.kill, pid)):
        try:
            kill(target, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _watch_client(conn: socket.socket, pid: int, sel) -> None:
    """A running command's client hung up (or wrote): if it is gone, so is its command."""
    try:
        gone = conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        gone = False
    except OSError:
        gone = True
    if gone:
        sel.unregister(conn)
        _kill_command(pid)


def _reap(children: dict, sel) -> None:
    """Tell each finished command's client its exit status."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = children.pop(pid, None)
        if conn is None:
            continue
        try:
            sel.unregister(conn)
        except (KeyError, ValueError):  # unregistered when its client hung up, or never registered
            pass
        _send(conn, {"returncode": -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)})
        conn.close()


# ---------------------------------------------------------------------------------------------- the test's side


class ZygoteGone(Exception):
    """The zygote ended, or dropped a request, before it forked the command."""


class Zygote:
    """One zygote per pytest process, started on first use and stopped at the session's end."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.env: dict[str, str] = {}
        self.dir = ""
        self.failed = False
        self.ready = False
        self.served = 0  # commands forked from the zygote (the rest ran in a real interpreter)
        self.mismatch: list[str] = []
        self.imports_set: dict[str, str] = {}
        self.fallbacks: list[str] = []  # why each command that was not forked ran in a real interpreter

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
            word, _, added = line.strip().partition(" ")
            if word == "ready":
                self.imports_set = json.loads(added)
                self.ready = True
                break
        if not self.ready:
            self.failed = True
            self.proc.kill()
        return self.ready

    def compatible(self, env: dict[str, str]) -> bool:
        self.mismatch = env_mismatch(env, self.env, self.imports_set)
        return not self.mismatch

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def popen(self, argv: list[str], stdout: str | os.PathLike, stderr: str | os.PathLike, env: dict[str, str] | None = None,
              cwd: str | os.PathLike | None = None):
        """Like `subprocess.Popen([python, "-m", "shardlab", *argv], stdout=open(STDOUT, "w"), stderr=open(STDERR, "w"),
        stdin=DEVNULL)`: a `Forked` handle, or a real Popen where the zygote cannot serve (module doc)."""
        env = dict(os.environ if env is None else env)
        cwd = os.fspath(cwd) if cwd is not None else os.getcwd()
        if not (self._ready() and self.compatible(env)):
            why = f"environment differs in {', '.join(self.mismatch)}" if self.ready else "no zygote"
            test = os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0] or "outside a test"
            self.fallbacks.append(f"{test}: shardlab {' '.join(map(str, argv[:1]))}: {why}")
            return subprocess.Popen([sys.executable, "-m", "shardlab", *map(str, argv)], env=env, cwd=cwd,
                                    stdout=open(stdout, "w"), stderr=open(stderr, "w"), stdin=subprocess.DEVNULL)
        plan = tempfile.NamedTemporaryFile(prefix="shardlab-plan-", suffix=".json", delete=False).name
        req = {"argv": [str(a) for a in argv], "env": env, "cwd": cwd, "stdout": os.fspath(stdout),
               "stderr": os.fspath(stderr), "plan": plan}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(os.path.join(self.dir, "sock"))
            conn.sendall((json.dumps(req) + "\n").encode())
            line, rest = self._forked(conn)
        except (OSError, ZygoteGone) as err:  # nothing was started: the command runs in a real interpreter
            conn.close()
            Path(plan).unlink(missing_ok=True)
            self.failed, self.ready = True, False
            print(f"zygote: unusable ({err}); commands run in real interpreters from now on", file=sys.stderr, flush=True)
            return self.popen(argv, stdout, stderr, env=env, cwd=cwd)
        self.served += 1
        return Forked(json.loads(line)["pid"], conn, rest, ["shardlab", *map(str, argv)], plan)

    def _forked(self, conn: socket.socket) -> tuple[bytes, bytes]:
        """The zygote's {"pid": N} line (and what followed it), waited for as long as the zygote lives.

        No wall-clock limit: on a busy machine the zygote may be descheduled, or loading an op, for longer than any
        fixed guess (a fixed 30 s failed runs on a 2-core machine busy with two other jobs); a dead zygote ends the
        wait at once, and a hung one would hang every command anyway."""
        buf = b""
        while b"\n" not in buf:
            if not select.select([conn], [], [], 1.0)[0]:
                if self.proc.poll() is not None:
                    raise ZygoteGone(f"the zygote exited ({self.proc.returncode}) before forking")
                continue
            chunk = conn.recv(4096)
            if not chunk:
                raise ZygoteGone("the zygote closed the connection before forking")
            buf += chunk
        line, rest = buf.split(b"\n", 1)
        return line, rest

    def run(self, argv: list[str], env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
            timeout: float | None = None) -> subprocess.CompletedProcess:
        """Like `subprocess.run([python, "-m", "shardlab", *argv], capture_output=True, text=True, stdin=DEVNULL)`;
        `timeout` is a guard measured on an idle machine, stretched by the machine's load (patience.py)."""
        with tempfile.TemporaryDirectory(prefix="shardlab-cmd-") as tmp:
            out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
            proc = self.popen(argv, out, err, env=env, cwd=cwd)
            timeout = patience(timeout)
            try:
                code = proc.wait(timeout)
            except subprocess.TimeoutExpired:  # end the command and its ranks, as subprocess.run would
                proc.kill()
                proc.wait()
                raise subprocess.TimeoutExpired(["shardlab", *argv], timeout, out.read_text(errors="replace"),
                                                err.read_text(errors="replace")) from None
            return subprocess.CompletedProcess(["shardlab", *argv], code, out.read_text(errors="replace"),
                                               err.read_text(errors="replace"))


class Forked:
    """A command forked from the zygote, with the part of `subprocess.Popen`'s interface tests use."""

    def __init__(self, pid: int, conn: socket.socket, pending: bytes, args: list[str], plan: str):
        self.pid, self.args, self.returncode = pid, args, None
        self._conn, self._buf, self._plan = conn, pending, plan

    def _collect(self, timeout: float | None) -> int | None:
        """The exit status once the zygote has sent it; None if it has not within `timeout` seconds."""
        if self.returncode is not None:
            return self.returncode
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = select.select([self._conn], [], [], left)[0]
            if not ready:
                return None
            chunk = self._conn.recv(4096)
            if not chunk:
                self._conn.close()
                raise RuntimeError(f"the test zygote died while running {' '.join(self.args)}")
            self._buf += chunk
        self._conn.close()
        Path(self._plan).unlink(missing_ok=True)
        self.returncode = json.loads(self._buf.split(b"\n", 1)[0])["returncode"]
        return self.returncode

    def poll(self) -> int | None:
        return self._collect(0.0)

    def wait(self, timeout: float | None = None) -> int:
        code = self._collect(timeout)
        if code is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return code

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to the command and every process it started (its own process group), as a timeout needs."""
        if self.returncode is None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


ZYGOTE = Zygote()


def run_shardlab(argv: list[str], env: dict[str, str] | None = None, cwd=None, timeout: float | None = None):
    return ZYGOTE.run(argv, env=env, cwd=cwd, timeout=timeout)


def popen_shardlab(argv: list[str], stdout, stderr, env: dict[str, str] | None = None, cwd=None):
    return ZYGOTE.popen(argv, stdout, stderr, env=env, cwd=cwd)


def client(sock_path: str, argv: list[str]) -> None:
    """`python zygote.py --client SOCKET ARGS...`: `python -m shardlab ARGS...` forked from the zygote at SOCKET (module
    doc); exits as the command did, or with the signal that killed it."""
    real = [sys.executable, "-m", "shardlab", *argv]
    plan = tempfile.NamedTemporaryFile(prefix="shardlab-plan-", suffix=".json", delete=False).name
    req = {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "stdout": f"/proc/{os.getpid()}/fd/1",
           "stderr": f"/proc/{os.getpid()}/fd/2", "append": True, "plan": plan, "check": True}
    try:
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(sock_path)
        conn.sendall((json.dumps(req) + "\n").encode())
        reader = conn.makefile("rb")
        first = json.loads(reader.readline() or b"{}")
    except OSError:  # the zygote is gone (its session ended)
        first = {}
    if "pid" not in first:
        os.unlink(plan)
        os.execv(sys.executable, real)  # never returns
    pid = first["pid"]

    def pass_on(sig, _frame):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, pass_on)
    line = reader.readline()
    os.unlink(plan)
    if not line:
        sys.exit(f"the test zygote died while running {' '.join(real)}")
    code = json.loads(line)["returncode"]
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    sys.exit(code)


if __name__ == "__main__":
    if sys.argv[1] == "--client":
        client(sys.argv[2], sys.argv[3:])
    else:
        serve(sys.argv[1])
