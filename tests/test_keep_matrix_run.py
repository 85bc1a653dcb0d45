"""What a rehearsal-matrix call returned becomes a dated fixture in one step (scripts/gpu/keep_matrix_run.py)."""

from __future__ import annotations

import io
import json
import tarfile

from conftest import REPO_ROOT, load_script
from kimi_k3_serve import recorded

keep_matrix_run = load_script("keep_matrix_run", folder="scripts/gpu")

JOB = {"command": ["kimi-k3-serve", "rehearse", "--config", "deploy/config.yaml", "--rank-of", "1", "--json"],
       "role": "validation", "seconds": 301.5}


def _returned(folder, jobs: dict[str, dict[str, bytes]], started: list[str] | None = None):
    """A call's $OUT as matrix.py and run_all.sh leave it; its log says it started ``started`` (every job)."""
    folder.mkdir()
    with tarfile.open(folder / "rehearse-ranks-round17.tar.gz", "w:gz") as tar:
        for job, files in jobs.items():
            for name, data in files.items():
                info = tarfile.TarInfo(f"{job}/{name}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    log = "".join(f"{job}: started on GPU [0] at 0 s\n{job}: exit 0 after 301 s\n"
                  for job in (jobs if started is None else started))
    (folder / "matrix-ranks.log").write_text(log)
    (folder / "host.json").write_text('{"torch": "2.13.0+cu130"}')
    return folder


def test_a_call_is_kept_as_the_replay_reads_it(tmp_path, capsys) -> None:
    log = f"INFO rootdir: {REPO_ROOT}\nINFO GPU KV cache size: 539,354 tokens\n".encode()
    returned = _returned(tmp_path / "out", {"r44-s1-dspark-b8192-s35": {
        "vllm.log": log, "stdout.json": b"{}", "stderr.txt": b"", "job.json": json.dumps(JOB).encode(),
        "spec.json": b"{}", "result.json": b'{"verdict": "fits"}'}})
    into = tmp_path / "2026-12-06-round20"
    assert keep_matrix_run.main([str(returned), str(into), "--call", "2"]) == 0
    run = into / "r44-s1-dspark-b8192-s35"
    assert sorted(p.name for p in run.iterdir()) == \
        ["job.json", "result.json", "spec.json", "stderr.txt.gz", "vllm.log.gz"]  # stdout.json left out
    assert recorded.read_text(run / "vllm.log") == "INFO rootdir: .\nINFO GPU KV cache size: 539,354 tokens\n"
    assert recorded.read_text(into / "matrix-ranks-call2.log").startswith("r44-s1-dspark-b8192-s35: started")
    assert (into / "host.json").read_text() == '{"torch": "2.13.0+cu130"}'
    # The deploy config the run read, as the call carried it: the replay runs the rank with it.
    assert (into / "checkout" / "deploy" / "config.yaml").read_bytes() == \
        (REPO_ROOT / "deploy" / "config.yaml").read_bytes()
    assert "kept 1 run(s)" in capsys.readouterr().out


def test_a_recorded_run_is_never_overwritten(tmp_path, capsys) -> None:
    returned = _returned(tmp_path / "out", {"k7-tp1-b3072-s64-dspark": {
        "vllm.log": b"first\n", "job.json": json.dumps(JOB).encode()}})
    into = tmp_path / "round20"
    assert keep_matrix_run.main([str(returned), str(into), "--call", "1"]) == 0
    kept = {p: p.read_bytes() for p in into.rglob("*") if p.is_file()}
    assert keep_matrix_run.main([str(returned), str(into), "--call", "3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "already holds k7-tp1-b3072-s64-dspark" in err
    other = _returned(tmp_path / "out2", {"k8-tp1-b4096-s64-dspark": {"vllm.log": b"second\n"}})
    assert keep_matrix_run.main([str(other), str(into), "--call", "1"]) == 2  # call 1's log is kept, gzipped
    assert "--call: 1:" in capsys.readouterr().err
    assert {p: p.read_bytes() for p in into.rglob("*") if p.is_file()} == kept


def test_a_held_hosts_earlier_call_is_left_as_kept(tmp_path, capsys) -> None:
    # One host held across two calls: the second call's archive packs the first call's job folder again.
    first = {"r44-s1-dspark-b8192-s35": {"vllm.log": b"first call\n", "job.json": json.dumps(JOB).encode()}}
    into = tmp_path / "round20"
    assert keep_matrix_run.main([str(_returned(tmp_path / "out1", first)), str(into), "--call", "1"]) == 0
    kept = recorded.read_text(into / "r44-s1-dspark-b8192-s35" / "vllm.log")
    second = dict(first, **{"k7-tp1-b3072-s64-dspark": {"vllm.log": b"second call\n"}})
    returned = _returned(tmp_path / "out2", second, started=["k7-tp1-b3072-s64-dspark"])
    assert keep_matrix_run.main([str(returned), str(into), "--call", "2"]) == 0
    out = capsys.readouterr().out
    assert "kept 1 run(s) in" in out and out.rstrip().endswith("holds: r44-s1-dspark-b8192-s35")
    assert recorded.read_text(into / "k7-tp1-b3072-s64-dspark" / "vllm.log") == "second call\n"
    assert recorded.read_text(into / "r44-s1-dspark-b8192-s35" / "vllm.log") == kept
    # A job the call's log says it started again is still refused when kept already.
    again = _returned(tmp_path / "out3", second)
    assert keep_matrix_run.main([str(again), str(into), "--call", "3"]) == 2
    assert "already holds k7-tp1-b3072-s64-dspark, r44-s1-dspark-b8192-s35" in capsys.readouterr().err


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys) -> None:
    cases = {
        "missing": ([str(tmp_path / "nowhere"), str(tmp_path / "into"), "--call", "1"], "returned: "),
        "call": ([str(tmp_path), str(tmp_path / "into"), "--call", "0"], "--call: 0"),
        "empty": ([str(tmp_path), str(tmp_path / "into"), "--call", "1"], "expected one rehearse-<set>.tar.gz"),
    }
    for argv, said in cases.values():
        assert keep_matrix_run.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, err
    evil = tmp_path / "evil"
    evil.mkdir()
    with tarfile.open(evil / "rehearse-x.tar.gz", "w:gz") as tar:
        info = tarfile.TarInfo("../../escape.txt")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    (evil / "matrix-ranks.log").write_text("")
    assert keep_matrix_run.main([str(evil), str(tmp_path / "into"), "--call", "1"]) == 2
    assert "expected JOB/FILE" in capsys.readouterr().err
    assert not (tmp_path / "into").exists() and not (tmp_path.parent / "escape.txt").exists()


def test_a_broken_call_leaves_the_fixture_folder_as_it_was(tmp_path, capsys) -> None:
    into = tmp_path / "round20"
    into.mkdir()
    (into / "host.json").write_text("{}")
    outside = dict(JOB, command=["kimi-k3-serve", "rehearse", "--config", "../../../elsewhere.yaml"])
    cut = _returned(tmp_path / "cut", {"k6": {"vllm.log": b"x" * 4096}})
    whole = (cut / "rehearse-ranks-round17.tar.gz").read_bytes()
    (cut / "rehearse-ranks-round17.tar.gz").write_bytes(whole[:len(whole) // 2])
    cases = {
        "outside": (_returned(tmp_path / "outside", {"k7": {"job.json": json.dumps(outside).encode()}}),
                    "a path outside the checkout"),
        "not a list": (_returned(tmp_path / "odd", {"k8": {"job.json": b'{"command": "rehearse"}'}}),
                       "command: expected a list of strings"),
        "cut short": (cut, "not a whole tar.gz archive"),
    }
    for returned, said in cases.values():
        assert keep_matrix_run.main([str(returned), str(into), "--call", "1"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, err
        assert sorted(p.name for p in tmp_path.rglob("*") if p.parent == into) == ["host.json"]
        assert not list(tmp_path.glob(".round20-*"))  # the staging folder is gone too
    assert keep_matrix_run.main([str(cut), str(into / "host.json"), "--call", "1"]) == 2
    assert "not a folder" in capsys.readouterr().err
