"""The example scripts refuse bad arguments with a usage error (exit status 2, the argument named),
not a traceback, a hang or a silent default (an adversarial pass found ``--workers 0`` hanging,
``--lk 0`` running the full 1M-key default, ``--layers 0`` an IndexError, ``--repeats 0`` an
UnboundLocalError, and ``--quick`` overriding what was given)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from _helpers import run_python

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def _run(script, *args, timeout=120):
    # run_python: a hang (dask_long_context.py --workers 0 hung) fails the test, its cluster killed
    argv = [sys.executable, os.path.join(EXAMPLES, script), *args]
    return subprocess.CompletedProcess(argv, *run_python(None, argv=argv, timeout=timeout))


CASES = [
    ("generate.py", ["--layers", "0"], "--layers"),
    ("generate.py", ["--new-tokens", "0"], "--new-tokens"),
    ("generate.py", ["--paged", "0"], "--paged"),
    ("generate.py", ["--seed", "-1"], "--seed"),
    ("generate.py", ["--prompt-lens", ""], "--prompt-lens"),
    ("generate.py", ["--prompt-lens", "3,x"], "--prompt-lens"),
    ("generate.py", ["--prompt-lens", ","], "prompt lengths"),
    ("generate.py", ["--prompt-lens", "3,0"], "prompt lengths"),
    ("dask_long_context.py", ["--quick", "--workers", "0"], "--workers"),
    ("dask_long_context.py", ["--quick", "--lk", "0"], "--lk"),
    ("dask_long_context.py", ["--quick", "--chunk", "-5"], "--chunk"),
    ("dask_long_context.py", ["--quick", "--split-every", "1"], "--split-every"),
]


@pytest.mark.parametrize("script,args,named", CASES, ids=[f"{s}{' '.join(a)}" for s, a, _ in CASES])
def test_bad_arguments_are_usage_errors(script, args, named):
    res = _run(script, *args)
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    assert named in res.stderr and "error:" in res.stderr, res.stderr


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None,
    reason="hf_generate.py needs torch and transformers",
)
@pytest.mark.parametrize(
    "args,named",
    [
        (["--quick", "--repeats", "0"], "--repeats"),
        (["--prompt-lens", ""], "--prompt-lens"),
        (["--quick", "--heads", "6"], "--heads"),  # --quick's hidden 128 is no multiple of 6: given values count
    ],
)
def test_hf_generate_bad_arguments_are_usage_errors(args, named):
    res = _run("hf_generate.py", *args, timeout=300)
    assert res.returncode == 2, (res.returncode, res.stderr[-2000:])
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    assert named in res.stderr and "error:" in res.stderr, res.stderr


@pytest.mark.parametrize("script", ["generate.py", "dask_long_context.py"])
def test_a_non_integer_is_an_invalid_int(script):
    res = _run(script, "--quick", "--lq", "x") if script.startswith("dask") else _run(script, "--layers", "x")
    assert res.returncode == 2 and "invalid int value: 'x'" in res.stderr, res.stderr


@pytest.mark.skipif(
    importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None,
    reason="hf_generate.py needs torch and transformers",
)
def test_hf_generate_gpt2_takes_any_head_count():
    """GPT-2 has no grouped heads: --kv-heads does not apply to it, so 3 heads pass (a check of
    --heads against the default --kv-heads 2 refused them); a trailing comma in --prompt-lens and
    a negative seed (torch takes it) are fine too."""
    res = _run(
        "hf_generate.py",
        *"--model gpt2 --heads 3 --hidden 96 --layers 1 --new-tokens 2".split(),
        *"--prompt-lens 3,4, --repeats 1 --seed -1".split(),
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    assert "pyattn vs eager: identical tokens" in res.stdout, res.stdout[-2000:]
