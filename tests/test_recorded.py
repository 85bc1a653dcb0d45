"""Recorded runs' logs are stored gzipped and read under the names the runs wrote (kimi_k3_serve/recorded.py,
scripts/compress_fixtures.py)."""

from __future__ import annotations

import gzip

from conftest import REPO_ROOT, load_script
from kimi_k3_serve import recorded

compress_fixtures = load_script("compress_fixtures")
normalize = load_script("normalize_fixture_paths")

LOG = "INFO  KV cache: 31.78 GiB\r\nprogress 10%\r 20%\n"


def test_a_log_reads_the_same_plain_or_gzipped(tmp_path) -> None:
    plain, stored = tmp_path / "plain" / "vllm.log", tmp_path / "stored" / "vllm.log"
    for path in (plain, stored):
        path.parent.mkdir()
        path.write_bytes(LOG.encode())
    compress_fixtures.compress(stored)
    assert not stored.exists() and (tmp_path / "stored" / "vllm.log.gz").is_file()
    assert recorded.exists(stored) and recorded.stored_as(stored).name == "vllm.log.gz"
    # Progress bars keep their carriage returns when asked to, as normalize_fixture_paths.py reads them.
    assert recorded.read_text(stored, newline="") == recorded.read_text(plain, newline="") == LOG
    assert recorded.read_text(stored) == LOG.replace("\r\n", "\n").replace("\r", "\n")
    assert recorded.glob(tmp_path, "*/vllm.log") == [plain, stored]
    assert not recorded.exists(tmp_path / "stored" / "stderr.txt")
    assert recorded.stored_as(tmp_path / "none.log") == tmp_path / "none.log"  # a miss names the run's own file


def test_the_same_text_is_stored_as_the_same_bytes(tmp_path) -> None:
    """No name and no time in the gzip header: storing a run again changes nothing git sees."""
    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text(LOG)
    b.write_text(LOG)
    stored = compress_fixtures.compress(a).read_bytes()
    assert stored == compress_fixtures.compress(b).read_bytes()
    assert stored[4:8] == bytes(4) and not stored[3] & 0x08  # MTIME zero, no FNAME field
    assert gzip.decompress((tmp_path / "a.log.gz").read_bytes()) == LOG.encode()


def test_compressing_a_run_keeps_its_json_plain_and_its_logs_exact(tmp_path, capsys) -> None:
    run = tmp_path / "round" / "k6"
    (run / "profile").mkdir(parents=True)
    logs = {run / "vllm.log": LOG, run / "stderr.txt": "", run / "profile" / "replica-1.txt": "a;b 3\n",
            run / "metrics.prom": "vllm:x 1\n"}
    for path, text in logs.items():
        path.write_text(text, newline="")
    (run / "result.json").write_text("{}")
    assert compress_fixtures.main([str(tmp_path / "round")]) == 0
    assert "MiB of logs to" in capsys.readouterr().out
    assert sorted(p.name for p in run.rglob("*") if p.is_file()) == \
        ["metrics.prom.gz", "replica-1.txt.gz", "result.json", "stderr.txt.gz", "vllm.log.gz"]
    assert all(recorded.read_text(path, newline="") == text for path, text in logs.items())
    stored = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert compress_fixtures.main([str(tmp_path / "round")]) == 0  # again: nothing left to compress
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == stored


def test_a_folder_that_is_not_there_is_one_line_and_exit_2(tmp_path, capsys) -> None:
    assert compress_fixtures.main([str(tmp_path / "round20")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "round20" in err and "not a folder" in err


def test_machine_paths_are_found_and_rewritten_inside_gzipped_logs(tmp_path) -> None:
    """The fixture check reads the stored logs, not past them: a gzipped log that names the checkout is found,
    and rewritten gzipped."""
    log = tmp_path / "vllm.log"
    log.write_text("rootdir: /srv/checkout\r\n")
    stored = compress_fixtures.compress(log)
    assert [path for path, _ in normalize.rewrites(tmp_path, ("/srv/checkout",))] == [stored]
    assert normalize.main([str(tmp_path), "--checkout", "/srv/checkout"]) == 0
    assert recorded.read_text(log, newline="") == "rootdir: .\r\n"
    assert stored.read_bytes()[:2] == b"\x1f\x8b"  # still gzip


def test_every_recorded_log_is_stored_gzipped_and_whole() -> None:
    """Every call to a GPU host carries the tree: a run copied in is compressed (docs/gpu-runs.md), and every stored
    log reads to its end."""
    fixtures = REPO_ROOT / "tests" / "fixtures"
    plain = [str(p.relative_to(REPO_ROOT)) for p in compress_fixtures.plain_logs(fixtures)]
    assert not plain, f"run scripts/compress_fixtures.py on: {plain[:5]}"
    stored = [p for p in fixtures.rglob("*.gz") if recorded.is_gzipped_log(p)]
    assert len(stored) >= 872
    for path in stored:
        gzip.decompress(path.read_bytes())


def test_a_log_already_stored_with_other_text_is_not_replaced(tmp_path, capsys) -> None:
    log = tmp_path / "vllm.log"
    log.write_text("first\n")
    stored = compress_fixtures.compress(log)
    log.write_text("first\n")  # the same text again: the plain copy goes
    assert compress_fixtures.compress(log) == stored and not log.exists()
    log.write_text("second\n")
    assert compress_fixtures.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "vllm.log.gz is there with other text" in err
    assert recorded.read_text(stored) == "first\n" and log.read_text() == "second\n"


def test_archives_are_neither_read_as_logs_nor_rewritten(tmp_path) -> None:
    """A ``.tar.gz`` is not a gzipped log: the path check passes it by, and a glob names it as it is."""
    archive = tmp_path / "jit-cache.tar.gz"
    archive.write_bytes(recorded.gzipped(b"rootdir: /srv/checkout\n"))  # text inside, as a tar's names are
    assert not recorded.is_gzipped_log(archive) and recorded.is_gzipped_log(tmp_path / "stderr.txt.gz")
    assert list(normalize.rewrites(tmp_path, ("/srv/checkout",))) == []
    assert recorded.glob(tmp_path, "*") == [archive]
