"""Property-based fuzz of the command line: whatever the arguments and whatever the files they name, every
command answers 0, 1 or 2, bad input is exactly one ``error:`` line, nothing raises past ``cli.main`` (it would
reach the user as a traceback), and no temp file is left. How fast a command answers is benchmarked, not timed
here (docs/benchmarks.md, "Planner speed"): a 2 s deadline per example failed on a busy 2-core machine (2026-12-03,
`check --plot` in 2.4 s).

Deterministic and bounded, so that CI pays a fixed price (about 30 s on 2 cores): ``derandomize=True`` (the same
examples every run), ``max_examples`` per command, no deadline per example. ``rehearse`` always gets
``--dry-run`` (it must never start an engine here) and ``check`` only ``--cluster`` (no network).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from conftest import REPO_ROOT
from kimi_k3_serve import cli

CLI_FUZZ = settings(derandomize=True, max_examples=100, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

GOOD_CONFIG = str(REPO_ROOT / "deploy" / "config.yaml")
GOOD_CLUSTER = str(REPO_ROOT / "tests" / "fixtures" / "check" / "h200-2x8.yaml")


def _hostile_files(root: Path) -> dict[str, str]:
    """Files of every kind a user might point an option at, made once per session."""
    files = {
        "alias-bomb.yaml": "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
            f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]\n" for i in range(9)),
        "self-reference.yaml": "applications: &a\n  - *a\n",
        "deep.yaml": "[" * 20_000 + "]" * 20_000,
        "empty.yaml": "",
        "list.yaml": "- 1\n",
        "huge-int.yaml": "nodes: " + "9" * 5000 + "\n",
        "deep.json": "[" * 20_000 + "]" * 20_000,
        "not-json.json": "{not json",
    }
    paths = {}
    for name, text in files.items():
        (root / name).write_text(text)
        paths[name] = str(root / name)
    (root / "binary.bin").write_bytes(bytes(range(256)) * 8)
    paths["binary"] = str(root / "binary.bin")
    os.mkfifo(root / "fifo")
    paths["fifo"] = str(root / "fifo")
    (root / "folder").mkdir()
    paths["folder"] = str(root / "folder")
    zero_heads = json.loads((REPO_ROOT / "kimi_k3_serve" / "models" / "data" / "kimi-k3.json").read_text())
    zero_heads["text_config"]["linear_attn_config"]["num_heads"] = 0
    (root / "zero-heads").mkdir()
    (root / "zero-heads" / "config.json").write_text(json.dumps(zero_heads))
    paths["zero-heads"] = str(root / "zero-heads")
    paths["missing"] = str(root / "no" / "such" / "file.yaml")
    return paths


HOSTILE_ROOT = Path(tempfile.mkdtemp(prefix="fuzz-cli-inputs-"))
HOSTILE = _hostile_files(HOSTILE_ROOT)
OUTPUTS = HOSTILE_ROOT / "outputs"
OUTPUTS.mkdir()

numbers = st.one_of(
    st.sampled_from([1, 2, 8, 16, 8192, 32768]),  # good values, so that many examples get as far as a plan
    st.integers(min_value=-3, max_value=10),
    st.sampled_from([0, 3, 6, 96, 4096, 4097, 10**9, 10**30, 1_048_576, 1_048_577]),
).map(str) | st.sampled_from(["two", "", "1e9", "-0", "0x10", "1_000", "1,024", "nan", "inf", "0.5", " 8 "])
fractions = st.sampled_from(["0", "0.5", "0.92", "1", "1.5", "-1", "nan", "inf", "x"])
files = st.sampled_from(sorted(HOSTILE)).map(HOSTILE.__getitem__)
config_files = files | st.just(GOOD_CONFIG) | st.just(GOOD_CONFIG)
cluster_files = files | st.just(GOOD_CLUSTER) | st.just(GOOD_CLUSTER)
model_sources = files | st.sampled_from(["kimi-k3", "kimi-k3", "kimi-k3-dspark", "no-such-model", ""])
text_values = st.text(max_size=12) | st.sampled_from(["H200", "H900", "auto", "fp4", "fp8", "dspark", "eagle3", "none"])
json_values = st.sampled_from(['{"method": "dspark", "num_speculative_tokens": 100000000}', '{"method": "dspark"}',
                               "[1]", "{", "null", '{"method": "medusa"}', '{"method": "dspark", "model": "kimi-k3"}'])
plots = st.sampled_from(["fit.png", "fit.xyz", ".", "no-folder/fit.png", ""]).map(lambda name: str(OUTPUTS / name))


def _options(spec: dict[str, st.SearchStrategy]) -> st.SearchStrategy[list[str]]:
    """Some of the options, each with a drawn value (``None``: a flag without one)."""

    @st.composite
    def build(draw):
        argv: list[str] = []
        for flag in draw(st.lists(st.sampled_from(sorted(spec)), max_size=4, unique=True)):
            value = spec[flag]
            argv += [flag] if value is None else [flag, draw(value)]
        return argv

    return build()


PLAN_OPTIONS = {"--gpu": text_values, "--nodes": numbers, "--gpus-per-node": numbers, "--cluster": cluster_files,
                "--max-model-len": numbers, "--max-num-seqs": numbers, "--max-num-batched-tokens": numbers,
                "--gpu-memory-utilization": fractions, "--kv-cache-dtype": text_values, "--tp": numbers,
                "--pp": numbers, "--dp": numbers, "--layer-partition": st.sampled_from(["49,44", "a,b", "0,93", "93"]),
                "--speculative-method": text_values, "--draft": model_sources, "--num-speculative-tokens": numbers,
                "--min": None, "--max-nodes": numbers, "--json": None}
MEMORY_OPTIONS = {"--tp": numbers, "--pp": numbers, "--dp": numbers, "--dcp": numbers, "--max-model-len": numbers,
                  "--max-num-seqs": numbers, "--gpu-memory-utilization": fractions, "--kv-cache-dtype": text_values,
                  "--layer-partition": st.sampled_from(["49,44", "a", "0,93"]), "--speculative-config": json_values,
                  "--json": None}
CHECK_OPTIONS = {"--app": text_values, "--json": None, "--plot": plots}
RENDER_OPTIONS = {"--app": text_values, "--instance-type": text_values, "--cluster-name": text_values,
                  "--output": plots}
REHEARSE_OPTIONS = {"--tp": numbers, "--pp": numbers, "--dp": numbers, "--max-model-len": numbers, "--layers": numbers,
                    "--speculative-config": json_values, "--engine-kwargs": json_values, "--model": model_sources,
                    "--gpu-memory-utilization": fractions, "--json": None}


@st.composite
def plan_argv(draw):
    cluster = draw(st.sampled_from([["--gpu", "H200", "--nodes", "2"], ["--cluster", GOOD_CLUSTER], []]))
    return ["plan", "--model", draw(model_sources), *cluster, *draw(_options(PLAN_OPTIONS))]


@st.composite
def memory_argv(draw):
    gpu = draw(st.sampled_from([["--gpu", "H200"], ["--gpu", "H900"], ["--gpu-bytes", draw(numbers)]]))
    return ["memory", "--model", draw(model_sources), *gpu, *draw(_options(MEMORY_OPTIONS))]


@st.composite
def check_argv(draw):
    return ["check", "--config", draw(config_files), "--cluster", draw(cluster_files), *draw(_options(CHECK_OPTIONS))]


@st.composite
def render_argv(draw):
    return ["render", "--config", draw(config_files), "--format", draw(st.sampled_from(["kuberay", "launcher-aws", "x"])),
            *draw(_options(RENDER_OPTIONS))]


@st.composite
def rehearse_argv(draw):
    return ["rehearse", "--config", draw(config_files), "--dry-run", *draw(_options(REHEARSE_OPTIONS))]


WARM_UP = [["plan", "--model", "kimi-k3", "--gpu", "H200", "--nodes", "2", "--max-model-len", "8192"],
           ["memory", "--gpu", "H200", "--tp", "8", "--pp", "2", "--max-model-len", "8192"],
           ["check", "--config", GOOD_CONFIG, "--cluster", GOOD_CLUSTER],
           ["check", "--config", HOSTILE["list.yaml"], "--cluster", GOOD_CLUSTER],  # imports Ray's schema
           ["render", "--config", GOOD_CONFIG, "--format", "kuberay"],
           ["rehearse", "--config", GOOD_CONFIG, "--dry-run"]]
"""Run once before the fuzz: the first import of the planner, matplotlib or Ray's schema takes seconds on a busy
machine; the examples then measure the commands, not the imports."""


@pytest.fixture(scope="module")
def private_tempdir():
    """mkdtemp/NamedTemporaryFile go here while the fuzz runs, so that a file left behind is seen."""
    folder = Path(tempfile.mkdtemp(prefix="fuzz-cli-tmp-"))
    saved, tempfile.tempdir = tempfile.tempdir, str(folder)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        for argv in WARM_UP:
            assert cli.main(argv) in (0, 2), argv
    try:
        yield folder
    finally:
        tempfile.tempdir = saved


def assert_answers_cleanly(argv: list[str], tempdir: Path) -> None:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exc:  # argparse's own exits (and --help)
            code = exc.code
    text = err.getvalue()
    event(f"exit {code}" + (f" {text.split(':')[1].strip()}" if code == 2 and ":" in text else ""))  # --hypothesis-show-statistics
    assert code in (0, 1, 2), (argv, code, text)
    if code == 2:
        lines = text.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (argv, text)
    assert "Traceback" not in text + out.getvalue(), argv
    assert list(tempdir.iterdir()) == [], (argv, list(tempdir.iterdir()))
    for made in OUTPUTS.iterdir():  # a plot or rendered file the command was asked for: fine, but not kept
        made.unlink()


@CLI_FUZZ
@given(plan_argv())
def test_plan_on_fuzzed_arguments(private_tempdir, argv):
    assert_answers_cleanly(argv, private_tempdir)


@CLI_FUZZ
@given(memory_argv())
def test_memory_on_fuzzed_arguments(private_tempdir, argv):
    assert_answers_cleanly(argv, private_tempdir)


@CLI_FUZZ
@given(check_argv())
def test_check_on_fuzzed_arguments(private_tempdir, argv):
    assert_answers_cleanly(argv, private_tempdir)


@CLI_FUZZ
@given(render_argv())
def test_render_on_fuzzed_arguments(private_tempdir, argv):
    assert_answers_cleanly(argv, private_tempdir)


@CLI_FUZZ
@given(rehearse_argv())
def test_rehearse_dry_run_on_fuzzed_arguments(private_tempdir, argv):
    assert_answers_cleanly(argv, private_tempdir)
