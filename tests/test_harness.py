"""The test harness itself: the shared-runs registry across pytest-xdist workers (conftest.SharedRuns) and the
zygote that forks `python -m shardlab` commands (zygote.py). Both make the suite fast; neither may change what a
test sees."""

from __future__ import annotations

import os
import threading
import time

from conftest import LAUNCHER_ENV, SharedRuns, TrainRun, worker_cores
from zygote import ZYGOTE, Zygote


def _fake_train(calls: list):
    def train(args, out):
        calls.append((tuple(args), out))
        time.sleep(0.3)  # long enough for the other asker to arrive while this one trains
        (out / "summary.json").write_text("{}")
        return TrainRun(out, list(args), 0, f"trained {args}", "")

    return train


def test_each_xdist_worker_gets_its_own_cores_and_its_commands_inherit_them():
    assert worker_cores([0, 1], "gw0", 2) == [0] and worker_cores([0, 1], "gw1", 2) == [1]
    assert worker_cores([0, 1, 2, 3, 4], "gw1", 2) == [2, 3, 4]  # the last worker takes the remainder
    assert worker_cores([4, 5, 6, 7], "gw0", 2) == [4, 5]
    assert worker_cores([0], "gw1", 2) == [] and worker_cores([0, 1], "master", 2) == []  # nothing to split / no xdist
    # the zygote, and so every command a test starts through it, runs on the cores this worker was confined to
    assert ZYGOTE.proc is not None and os.sched_getaffinity(ZYGOTE.proc.pid) == os.sched_getaffinity(0)


def test_two_workers_asking_for_one_configuration_train_it_once(tmp_path):
    """Two registries on one root stand for two xdist workers: the second waits for the first one's run and reads it."""
    calls: list = []
    workers = [SharedRuns(tmp_path, train=_fake_train(calls)) for _ in range(2)]
    got: dict[int, TrainRun] = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, workers[i].get(["--x", "1"], name="run")))
               for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1
    assert got[0].out == got[1].out == tmp_path / "run"
    assert got[0].stdout == got[1].stdout == "trained ['--x', '1']" and got[1].returncode == 0
    # another configuration with the same name gets its own directory; prepare() runs only where it trains
    prepared = []
    other = workers[1].get(["--x", "2"], name="run", prepare=lambda: prepared.append(1))
    assert other.out == tmp_path / "run-1" and len(calls) == 2 and prepared == [1]
    workers[0].get(["--x", "2"], name="run", prepare=lambda: prepared.append(2))
    assert len(calls) == 2 and prepared == [1]


def test_a_failed_run_is_shared_with_its_exit_status(tmp_path):
    def failing(args, out):
        return TrainRun(out, list(args), 3, "", "error: no such model (fix: ...)")

    first = SharedRuns(tmp_path, train=failing).get(["--model", "x"])
    again = SharedRuns(tmp_path, train=_fake_train([])).get(["--model", "x"])
    assert (first.returncode, again.returncode) == (3, 3) and again.stderr == first.stderr


def test_the_zygote_runs_a_command_as_a_fresh_process_would(tmp_path):
    """Exit status, stdout/stderr and working directory are the command's own: a bad flag is the CLI's one line and
    exit 2; a relative --config resolves in the requested directory."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    served = ZYGOTE.served
    proc = ZYGOTE.run(["train", "--model", "tiny-gpt2", "--no-such-flag"], env=env, cwd=tmp_path, timeout=120)
    assert ZYGOTE.served == served + 1, f"the zygote did not start, or fell back (variables that differ: {ZYGOTE.mismatch})"
    assert proc.returncode == 2 and "--no-such-flag" in proc.stderr and "Traceback" not in proc.stderr
    (tmp_path / "c.yaml").write_text("model: tiny-bloom\nseq_len: 48\n")
    proc = ZYGOTE.run(["train", "--config", "c.yaml", "--dry-run"], env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "tiny-bloom" in proc.stdout and "48" in proc.stdout
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing


def test_the_zygote_falls_back_to_a_real_interpreter_for_another_environment(tmp_path, monkeypatch):
    z = Zygote()
    z.env = {"A": "1"}
    assert z.compatible({"A": "1", "PYTEST_CURRENT_TEST": "x", "PYTHONUNBUFFERED": "1"})
    assert not z.compatible({"A": "2"}) and not z.compatible({"A": "1", "B": "1"}) and not z.compatible({})
    assert z.compatible({"A": "1", "SLURM_PROCID": "1", "MASTER_PORT": "29500"})  # a launcher's: read at run time
    z.env = {"A": "1", "TORCHINDUCTOR_CACHE_DIR": "/session"}  # read on each cache lookup: another value forks
    assert z.compatible({"A": "1", "TORCHINDUCTOR_CACHE_DIR": "/mine"}) and not z.compatible({"A": "1"})
    z.env = {"A": "1"}
    z.failed = True  # a zygote that could not start: every command runs in a real interpreter
    proc = z.run(["train", "--help"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 0 and "usage" in proc.stdout.lower()


def test_a_timed_out_command_is_killed_with_its_process_group(tmp_path, monkeypatch):
    """Killed, not waited for: the command ends by SIGKILL before its 1000 steps (this asserted a wall-clock bound, which
    a loaded machine can break; a run left to finish ends with status 0 and a summary instead)."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    started = []
    popen = ZYGOTE.popen
    monkeypatch.setattr(ZYGOTE, "popen", lambda *a, **k: started.append(popen(*a, **k)) or started[-1])
    try:  # a training that cannot finish in 0.5 s
        ZYGOTE.run(["train", "--model", "tiny-gpt2", "--dataset", "synthetic", "--max-steps", "1000",
                    "--output-dir", str(tmp_path / "run")], env=env, cwd=tmp_path, timeout=0.5)
    except Exception as err:  # noqa: BLE001
        assert type(err).__name__ == "TimeoutExpired", err
    else:
        raise AssertionError("no TimeoutExpired")
    [proc] = started
    assert proc.returncode == -9 and not (tmp_path / "run" / "summary.json").exists()


def test_a_forked_command_behaves_like_popen(tmp_path):
    """What tests/test_cluster.py's background runs use: pid, poll, wait, signals, output in the given files."""
    from zygote import popen_shardlab

    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    served = ZYGOTE.served
    out, err = tmp_path / "o", tmp_path / "e"
    proc = popen_shardlab(["train", "--model", "tiny-gpt2", "--dataset", "synthetic", "--max-steps", "100000",
                           "--output-dir", str(tmp_path / "run")], out, err, env=env)
    try:
        assert ZYGOTE.served == served + 1, f"fell back (variables that differ: {ZYGOTE.mismatch})"
        assert proc.poll() is None
        try:
            proc.wait(timeout=0.2)
        except Exception as exc:  # noqa: BLE001
            assert type(exc).__name__ == "TimeoutExpired"
        proc.send_signal(9)
        assert proc.wait(timeout=60) == -9 and proc.poll() == -9
    finally:
        proc.kill()
    help_ = popen_shardlab(["train", "--help"], out, err, env=env)
    assert help_.wait(timeout=60) == 0 and "usage" in out.read_text()


def test_a_forked_command_starts_its_own_shardlab_commands_through_the_zygote(tmp_path):
    """`shardlab bench` (a zygote child) starts each cell with bench.runner.SHARDLAB_COMMAND, which the zygote sets to
    its client: the cell is forked too, with the client's stdout/stderr (one pipe for both here) and exit status; a
    client killed with SIGKILL takes its command with it."""
    import re
    import signal
    import subprocess
    import sys

    import zygote

    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    assert ZYGOTE._ready(), "the zygote did not start"
    sock, log = os.path.join(ZYGOTE.dir, "sock"), os.path.join(ZYGOTE.dir, "zygote.log")
    client = [sys.executable, zygote.__file__, "--client", sock]
    proc = subprocess.run([*client, "train", "--model", "tiny-gpt2", "--no-such-flag"], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "--no-such-flag" in proc.stdout and "Traceback" not in proc.stdout
    assert "shardlab train --model tiny-gpt2 --no-such-flag" in open(log).read(), "the client fell back to a real interpreter"
    long = ["train", "--model", "tiny-gpt2", "--dataset", "synthetic", "--max-steps", "100000", "--output-dir", str(tmp_path / "run")]
    bg = subprocess.Popen([*client, *long], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=tmp_path)
    deadline = time.monotonic() + 60
    while not (pids := re.findall(rf"forked (\d+): shardlab {re.escape(' '.join(long))}", open(log).read())):
        assert time.monotonic() < deadline and bg.poll() is None, "the long command was never forked"
        time.sleep(0.1)
    pid = int(pids[-1])
    bg.send_signal(signal.SIGKILL)
    bg.wait(timeout=30)
    while True:  # the zygote saw its client hang up and killed the command's process group
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline + 30, "the command outlived its killed client"
        time.sleep(0.1)


def test_a_client_that_hangs_up_or_sends_garbage_costs_the_zygote_nothing(tmp_path):
    """One client's trouble (gone before or after its request, a request that is not JSON) never ends the zygote: its
    other commands live on and the next command is forked as usual."""
    import socket

    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    assert ZYGOTE._ready(), "the zygote did not start"
    sock = os.path.join(ZYGOTE.dir, "sock")
    for payload in (b"", b"not json\n", b'{"argv": ["train", "--he'):  # hung up at once, garbage, gone mid-request
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(sock)
        c.sendall(payload)
        c.close()
    served = ZYGOTE.served
    proc = ZYGOTE.run(["train", "--help"], env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0 and "usage" in proc.stdout.lower()
    assert ZYGOTE.served == served + 1 and ZYGOTE.proc.poll() is None, "the zygote died, or the command fell back"


def test_a_descheduled_zygote_is_waited_for_not_timed_out(tmp_path):
    """The client waits for the fork's answer as long as the zygote lives (a busy machine deschedules it for longer than
    any fixed guess): here the zygote is stopped while the command is asked for, and the command is forked once it goes
    on."""
    import signal

    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
    assert ZYGOTE._ready(), "the zygote did not start"
    served = ZYGOTE.served
    ZYGOTE.proc.send_signal(signal.SIGSTOP)
    timer = threading.Timer(3.0, ZYGOTE.proc.send_signal, (signal.SIGCONT,))
    timer.start()
    try:
        proc = ZYGOTE.run(["train", "--help"], env=env, cwd=tmp_path, timeout=300)
    finally:
        timer.join()
        ZYGOTE.proc.send_signal(signal.SIGCONT)
    assert proc.returncode == 0 and ZYGOTE.served == served + 1


def test_a_zygote_that_is_gone_sends_the_command_to_a_real_interpreter(tmp_path):
    """Refused (its socket has no listener), or exited with a request unanswered: the command runs in a real
    interpreter, and so do the later ones."""
    import socket
    import subprocess
    import sys

    for listening in (False, True):
        z = Zygote()
        z.dir = str(tmp_path / f"z{int(listening)}")
        os.makedirs(z.dir)
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(os.path.join(z.dir, "sock"))
        if listening:
            server.listen(1)  # accepts the connection, never answers: then the zygote exits
        z.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2)"])  # alive when asked, then gone
        z.ready = True
        z.env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}
        proc = z.popen(["train", "--help"], tmp_path / "out", tmp_path / "err", env=z.env, cwd=tmp_path)
        assert proc.wait(timeout=300) == 0 and "usage" in (tmp_path / "out").read_text().lower()
        assert z.failed and z.served == 0
        server.close()
