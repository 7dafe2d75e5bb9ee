"""The tensor-parallel engine's processes (engine.dist): both launch modes
(``LLM(tensor_parallel_size=2)`` spawning its worker, and ``torchrun --nproc-per-node 2
-m engine generate``) give TP=1's tokens and logits; an idle longer than the collective
timeout is kept alive; Ctrl-C in a call leaves the engine usable; a worker killed
mid-generation stops the run with a DistError naming the rank, within the timeout; a
driver interrupted (Ctrl-C) or killed leaves no worker behind, and none of these leaves a
shared-memory segment in /dev/shm (numkern.collective: unlinked once every rank mapped
it); ``close()`` and the
context manager end the workers and destroy the process group; bad arguments are
ValueErrors naming the argument, before anything starts.

One tiny random Llama in fp32 (tests/hf_models.TINY, with a word-level tokenizer so that
the CLI takes text), saved once; every collective times out after 10 s; every process
started here is checked gone by pid."""

import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numba
import pytest
import torch
import torch.distributed as dist
import transformers

from engine.__main__ import main
from engine.dist import DistError
from engine.llm import LLM, SamplingParams
from numkern import collective

from . import hf_models as hm
from .close import rtol_atol
from .conftest import ROOT

TIMEOUT = 10.0  # every collective's timeout (seconds)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPTS = [hm.prompt(5), hm.prompt(9, 1), hm.prompt(30, 2)]
TEXT = "w5 w7 w9 w11"  # a prompt of the word-level tokenizer


def _gone(pid, within=0.0):
    """Whether process ``pid`` has ended (waiting up to ``within`` seconds)."""
    deadline = time.monotonic() + within
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":  # exited, not yet reaped
                    return True
        except FileNotFoundError:
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


# the ranks' transport on this host: shared memory wherever there is a /dev/shm
TRANSPORT = "gloo" if collective.host_identity() is None else "shm"


def _segments(pid):
    """The /dev/shm entries of segments that process ``pid`` created."""
    return [n for n in os.listdir(collective.SHM_DIR) if n.startswith(f"numkern-{pid}-")]


def _mapped_segments(pid):
    """The (unlinked) segments process ``pid`` has mapped, from /proc/PID/maps."""
    with open(f"/proc/{pid}/maps") as f:
        return {line.split()[-2] for line in f if "/numkern-" in line and "(deleted)" in line}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """TINY (random, fp32) with a tokenizer of one word per id (``w0`` ... ``w255``)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    path = tmp_path_factory.mktemp("tp_launch")
    hm.random_model(transformers.LlamaConfig(**hm.TINY), 15).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(256)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece()  # words joined by spaces
    tok.save(str(path / "tokenizer.json"))
    return str(path)


@pytest.fixture(scope="module")
def tp1(tiny):
    """The reference: TP=1's greedy outputs (with step logits) of PROMPTS and of TEXT."""
    one = hm.engine(tiny)
    one.record_logits = True
    return one.generate(PROMPTS, GREEDY), one.generate(TEXT, GREEDY)[0].text


def _assert_same(outs, ref):
    for o, r in zip(outs, ref, strict=True):
        assert o.token_ids == r.token_ids
        for a, b in zip(o.logits, r.logits, strict=True):
            torch.testing.assert_close(a, b, **rtol_atol("engine_tp"))


def test_both_launch_modes_give_tp1_tokens_and_stay_alive_idle(tiny, tp1):
    ref, ref_text = tp1
    with hm.engine(tiny, tensor_parallel_size=2, dist_timeout=TIMEOUT) as two:
        (pid,) = two.runtime.pids
        assert two.runtime.numba_threads == max(1, numba.config.NUMBA_NUM_THREADS // 2)
        assert two.runtime.comm.transport == TRANSPORT
        if TRANSPORT == "shm":  # both ranks map one segment, whose file is already gone
            assert _mapped_segments(pid) == _mapped_segments(os.getpid())
            assert len(_mapped_segments(pid)) == 1 and not _segments(os.getpid())
        two.record_logits = True
        _assert_same(two.generate(PROMPTS, GREEDY), ref)
        assert two.generate(TEXT, GREEDY)[0].text == ref_text
        # Ctrl-C mid-generation: held to the end of the step under way, so the ranks stay
        # in step and the next call gets the same tokens
        ctrl_c = threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT))
        ctrl_c.start()
        with pytest.raises(KeyboardInterrupt):
            two.generate([hm.prompt(5)] * 4, SamplingParams(max_tokens=5000, ignore_eos=True))
        ctrl_c.join()
        assert two.generate(TEXT, GREEDY)[0].text == ref_text
        # torchrun's launch meanwhile: this engine idles past the collective timeout
        idle = time.monotonic()
        args = ["--model", tiny, "--dtype", "float32", "--block-size", "32"]
        args += ["--kv-cache-memory", str(8 << 20), "--max-tokens", "6", "--dist-timeout", "10"]
        proc = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node", "2", "-m", "engine", "generate", "--tensor-parallel-size",
             "2", *args, TEXT],
            capture_output=True, text=True, cwd=ROOT, timeout=300,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert not collective.stale_segments()  # torchrun's ranks left none
        lines = proc.stdout.splitlines()  # rank 0's text and its timing line; rank 1: none
        assert len(lines) == 2 and lines[1].startswith("compile: "), proc.stdout
        assert lines[0] == ref_text
        time.sleep(max(0.0, TIMEOUT + 1 - (time.monotonic() - idle)))
        assert two.runtime.noops >= 3  # one each TIMEOUT / 4 while idle
        _assert_same(two.generate(PROMPTS, GREEDY), ref)  # still in step after the idle
        # the workers run each step at the same Numba count as rank 0's
        seen = []
        execute = two.runner._execute
        two.runner._execute = lambda *a: seen.append(numba.get_num_threads()) or execute(*a)
        two.generate(PROMPTS[0], GREEDY)
        assert set(seen) == {two.runtime.numba_threads}
        assert not _gone(pid)
    assert _gone(pid, within=1.0) and not dist.is_initialized()
    two.close()  # idempotent
    with pytest.raises(RuntimeError, match="LLM: closed"):
        two.generate(PROMPTS[0], GREEDY)


def test_a_killed_rank_is_named_within_the_timeout(tiny):
    two = hm.engine(tiny, tensor_parallel_size=2, dist_timeout=TIMEOUT)
    (pid,) = two.runtime.pids
    long = SamplingParams(temperature=0, max_tokens=2000, ignore_eos=True)
    stream = two.generate_stream([hm.prompt(5)] * 4, long)
    next(stream)
    # killed while rank 0 runs (a step's collective fails, or the next step's check of
    # the workers' exit codes finds it first)
    kill = threading.Timer(0.3, os.kill, (pid, signal.SIGKILL))
    kill.start()
    t0 = time.monotonic()
    died = f"^rank 1 \\(pid {pid}\\) died (during|before) a step: killed by SIGKILL"
    with pytest.raises(DistError, match=died):
        for _ in stream:
            pass
    assert time.monotonic() - t0 < TIMEOUT
    kill.join()
    assert _gone(pid) and not dist.is_initialized()
    assert not _segments(os.getpid()) and not _mapped_segments(os.getpid())
    with pytest.raises(DistError, match="rank 1"):  # the engine stays stopped
        two.generate(PROMPTS[0], GREEDY)
    two.close()


DRIVER = textwrap.dedent("""
    import os, sys
    from engine.llm import LLM, SamplingParams

    if __name__ == "__main__":
        llm = LLM(sys.argv[1], dtype="float32", block_size=32, kv_cache_memory=8 << 20,
                  progress=False, tensor_parallel_size=2, dist_timeout=10.0,
                  numa_bind=sys.argv[2])
        # once a step has run (compiled: from a cold Numba cache a first step can take
        # longer than the test waits for the driver to end)
        llm.generate([[5, 6, 7]] * 4, SamplingParams(max_tokens=2, ignore_eos=True))
        print(*llm.runtime.pids, flush=True)
        print(*sorted(os.sched_getaffinity(0)), flush=True)
        while True:
            llm.generate([[5, 6, 7]] * 4, SamplingParams(max_tokens=50, ignore_eos=True))
""")


def test_an_interrupted_or_killed_driver_leaves_no_worker(tiny, tmp_path):
    """Ctrl-C (SIGINT) in the driver: its interpreter exits and ends its worker; a driver
    killed outright: its worker's watchdog ends it. Both drivers run side by side, each
    with a segment of its own; the killed one's ranks are pinned (``numa_bind="on"``: one
    node here, each rank its own part of the CPUs) where this process may use 2 CPUs."""
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    allowed = sorted(os.sched_getaffinity(0))
    bind = {signal.SIGINT: "off", signal.SIGKILL: "on" if len(allowed) >= 2 else "off"}
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    drivers = {sig: subprocess.Popen([sys.executable, str(script), tiny, bind[sig]], **pipes)
               for sig in (signal.SIGINT, signal.SIGKILL)}  # fmt: skip
    try:
        workers = {}
        for sig, p in drivers.items():
            line = p.stdout.readline()  # the worker's pid, once the engine has run a step
            assert line, p.communicate()[1][-3000:]
            workers[sig] = int(line)
            cpus = [int(c) for c in p.stdout.readline().split()]  # the driver's (rank 0's)
            worker_cpus = sorted(os.sched_getaffinity(workers[sig]))
            if bind[sig] == "on":  # rank 0 the first half of the CPUs, rank 1 the second
                half = (len(allowed) + 1) // 2
                assert (cpus, worker_cpus) == (allowed[:half], allowed[half:]), sig
            else:
                assert cpus == worker_cpus == allowed, sig
        if TRANSPORT == "shm":  # two engines, two segments
            mapped = [_mapped_segments(w) for w in workers.values()]
            assert len(mapped[0]) == len(mapped[1]) == 1 and not mapped[0] & mapped[1]
        time.sleep(0.5)  # generating
        for sig, p in drivers.items():
            p.send_signal(sig)
        for sig, p in drivers.items():
            _, err = p.communicate(timeout=30)
            # Python ends on an uncaught KeyboardInterrupt by SIGINT, as a shell expects
            assert p.returncode == -sig, err[-2000:]
            assert _gone(workers[sig], within=5.0), sig
            assert not _segments(p.pid), sig
            if sig == signal.SIGINT:  # the worker ended by close(), not by its watchdog
                assert "KeyboardInterrupt" in err and "engine rank" not in err, err[-2000:]
    finally:
        for p in drivers.values():
            p.kill()
            p.communicate()


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(tensor_parallel_size=0), "tensor_parallel_size: expected an int >= 1, got 0"),
        (dict(tensor_parallel_size=2.0), "tensor_parallel_size: expected an int >= 1, got 2.0"),
        (dict(enable_expert_parallel=1), "enable_expert_parallel: expected a bool, got 1"),
        (dict(threads_per_rank=0), "threads_per_rank: expected None or an int in [1, "),
        (dict(dist_timeout=0), "dist_timeout: expected a number of seconds > 0, got 0"),
        (dict(dist_timeout=float("nan")), "dist_timeout: expected a number of seconds > 0"),
    ],
)
def test_bad_parallel_arguments(tmp_path, kw, message):
    """Refused before the checkpoint is read (the path does not exist)."""
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        LLM(str(tmp_path / "nope"), **kw)


def test_tensor_parallel_size_must_match_torchrun(tmp_path, monkeypatch, capsys):
    for k, v in {"WORLD_SIZE": "3", "RANK": "0", "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(k, v)
    nope = str(tmp_path / "nope")
    for tp in (1, 2):
        want = f"tensor_parallel_size: expected WORLD_SIZE=3 (torchrun's process count), got {tp}"
        with pytest.raises(ValueError, match=f"^{re.escape(want)}$"):
            LLM(nope, tensor_parallel_size=tp)
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", nope, "--tensor-parallel-size", "2", "hi"])
    assert e.value.code == 2
    assert capsys.readouterr().err == (
        "python -m engine generate: error: --tensor-parallel-size: expected WORLD_SIZE=3 "
        "(torchrun's process count), got 2\n"
    )
    assert not dist.is_initialized()
