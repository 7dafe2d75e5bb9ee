"""engine.args: each option in one place. The CLI's flags and the tensor-parallel hand-off
are checked against ``EngineArgs``' (and ``SamplingParams``', ``ServeArgs``') fields, and
no engine module names an option's flag or keyword by hand."""

import dataclasses
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import engine
from engine import dist
from engine.__main__ import GENERATE_DEFAULTS, _parser, main
from engine.args import EngineArgs, ServeArgs, cli_fields, flag, is_int, is_number, worker_args
from engine.sampling import SamplingParams

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CLI_ONLY = {"help", "model", "prompts", "chat", "verbose"}  # not options of an object


def _actions(command):
    sub = next(a for a in _parser()._actions if a.dest == "cmd")
    return {a.dest: a for a in sub.choices[command]._actions}


@pytest.mark.parametrize(
    "command, classes",
    [
        ("generate", (EngineArgs, SamplingParams)),
        ("serve", (EngineArgs, ServeArgs)),
        ("warmup", (EngineArgs,)),
    ],
)
def test_cli_flags_are_the_fields(command, classes):
    actions = _actions(command)
    fields = {f.name: f for cls in classes for f in cli_fields(cls)}
    assert set(actions) - CLI_ONLY == set(fields)
    for name, f in fields.items():
        a = actions[name]
        assert a.option_strings == [flag(name)]
        want = GENERATE_DEFAULTS.get(name, f.default) if command == "generate" else f.default
        assert a.default == want and a.help == f.metadata["help"]
    # the engine's own fields without a flag: the bar and the test-only layout
    assert {f.name for f in dataclasses.fields(EngineArgs)} - set(fields) == {
        "model",
        "progress",
        "_layout_isa",
    }


def test_cli_builds_the_objects_from_the_flags(monkeypatch):
    """Every flag reaches its field: the LLM gets an EngineArgs of the parsed values."""
    got = []
    monkeypatch.setattr(engine.__main__, "LLM", lambda args: got.append(args) or 1 / 0)
    argv = ["warmup", "m.gguf", "--max-num-seqs", "3", "--dist-timeout", "7.5", "--isa", "vec"]
    argv += ["--enable-expert-parallel", "--torch-threads", "1", "--quantization", "none"]
    with pytest.raises(ZeroDivisionError):
        main(argv)
    want = dict(max_num_seqs=3, dist_timeout=7.5, isa="vec", enable_expert_parallel=True)
    want = EngineArgs(model="m.gguf", torch_threads=1, quantization="none", **want)
    assert got == [want]


def test_tp_hand_off_ships_every_field(monkeypatch):
    """dist.start ships the EngineArgs itself to the workers: every field as rank 0's,
    the bar off."""
    shipped = []

    def spawn(world, ep, threads, timeout, worker, plans):
        shipped.append((world, ep, threads, timeout, worker))

    monkeypatch.setattr(dist.Runtime, "spawn", staticmethod(spawn))
    args = EngineArgs(model="m", dtype="float32", block_size=32, kv_cache_memory=1 << 20,
                      max_model_len=64, max_num_seqs=2, max_num_batched_tokens=64, isa="vec",
                      quantization="none", torch_threads=1, tensor_parallel_size=2,
                      enable_expert_parallel=True, threads_per_rank=1, numa_bind="on",
                      dist_timeout=9.0, collectives="gloo", _layout_isa="vec")  # fmt: skip
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    dist.start(args, engine.LLM)
    ((world, ep, threads, timeout, (make, sent)),) = shipped
    assert (world, ep, threads, timeout, make) == (2, True, 1, 9.0, engine.LLM)
    assert sent == worker_args(args) == dataclasses.replace(args, progress=False)
    for f in dataclasses.fields(EngineArgs):  # no field left at its default by the copy
        if f.name != "progress":
            assert getattr(sent, f.name) == getattr(args, f.name) != f.default, f.name


def test_no_option_named_by_hand():
    """The CLI's code names no flag of a field (docstrings may): they are generated."""
    read = lambda *p: re.sub(r'"""[\s\S]*?"""', "", Path(ROOT, *p).read_text())  # noqa: E731
    cli = read("engine", "__main__.py")
    for cls in (EngineArgs, SamplingParams, ServeArgs):
        for f in cli_fields(cls):
            assert flag(f.name) not in cli, f.name


def test_checks_name_the_field():
    a = EngineArgs(model="m", max_num_seqs=np.int64(4), tensor_parallel_size=np.int32(1))
    assert type(a.max_num_seqs) is int and type(a.tensor_parallel_size) is int
    assert EngineArgs(model="m", dtype=torch.float16).torch_dtype is torch.float16
    for kw, msg in [
        (dict(max_num_seqs=True), "max_num_seqs: expected an int >= 1, got True"),
        (dict(block_size=0), "block_size: expected an int >= 1, got 0"),
        (dict(max_model_len=1), "max_model_len: expected an int >= 2, got 1"),
        (dict(dtype="int8"), "dtype: expected bfloat16, float16 or float32, got 'int8'"),
        (dict(quantization="q4"), "quantization: expected one of"),
        (dict(enable_expert_parallel=1), "enable_expert_parallel: expected a bool, got 1"),
        (dict(progress="yes"), "progress: expected a bool, got 'yes'"),
        (dict(dist_timeout=float("nan")), "dist_timeout: expected a number of seconds > 0"),
        (dict(threads_per_rank=0), "threads_per_rank: expected None or an int in [1, "),
        (dict(numa_bind="yes"), "numa_bind: expected one of "),
        (dict(collectives="nccl"), "collectives: expected auto, shm or gloo, got 'nccl'"),
    ]:
        with pytest.raises(ValueError, match=f"^{msg}".replace("[", r"\[").replace("(", r"\(")):
            EngineArgs(model="m", **kw)
    with pytest.raises(TypeError, match="max_num_seq"):
        EngineArgs(model="m", max_num_seq=4)
    with pytest.raises(ValueError, match="port: expected an int in"):
        ServeArgs(port=70000)
    with pytest.raises(dataclasses.FrozenInstanceError):
        EngineArgs(model="m").block_size = 16


def test_one_number_check():
    assert all(is_int(v) for v in (0, -3, np.int8(1), np.uint64(7)))
    assert not any(is_int(v) for v in (True, 1.0, "1", None, np.float32(1)))
    assert all(is_number(v) for v in (0, 1.5, np.float32(2), np.int64(3)))
    assert not any(is_number(v) for v in (False, float("inf"), float("nan"), "1"))
