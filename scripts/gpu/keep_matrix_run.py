"""Keep what a rehearsal-matrix call returned from the GPU host as a dated fixture.

    python scripts/gpu/keep_matrix_run.py RETURNED tests/fixtures/gpu/2026-12-06-round20 --call 1

RETURNED is the folder the call's ``$OUT`` came back to: ``rehearse-<set>.tar.gz`` (matrix.py's archive of every
job's folder), ``matrix-<phase>.log`` and ``host.json``. Into the fixture folder go:
- each job's folder but its ``stdout.json`` (the rehearsal's ``--json`` print, which ``result.json`` keeps);
- the call's log, as ``matrix-<phase>-call<N>.log``;
- ``host.json``, unless the folder has one already (one host a folder);
- each file a run read through a relative ``--config`` or ``--model`` path, under ``checkout/``, as this working
  tree has it (what the call carried, so keep a run before editing a config): the replay reads the config a run ran
  with, not a later one (scripts/memory_accuracy.py).
Then the checkout's paths are taken out of the logs (normalize_fixture_paths.py), and the logs are gzipped
(compress_fixtures.py). A job folder that is already there is refused, so nothing recorded is overwritten, unless
this call's log does not say it started the job: a host held across calls packs every call's job folders again, and an
earlier call's job, kept already, is left as it was.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
import tarfile
import tempfile
import zlib
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import compress_fixtures  # noqa: E402
import normalize_fixture_paths  # noqa: E402
from kimi_k3_serve import recorded  # noqa: E402

LEFT_OUT = {"stdout.json"}
READ_FLAGS = ("--config", "--model")
STARTED = re.compile(r"^(\S+): started on GPU", re.MULTILINE)
"""matrix.py's line for each job a call starts."""


class KeepError(Exception):
    """Input that cannot be kept: one line, naming what and why."""


def _jobs(archive: Path) -> dict[str, dict[str, bytes]]:
    """Each job's files (name -> bytes) in matrix.py's archive, which holds ``JOB/FILE`` and nothing else."""
    jobs: dict[str, dict[str, bytes]] = {}
    try:
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                parts = PurePosixPath(member.name).parts
                if not member.isfile() or len(parts) != 2 or ".." in parts or member.name.startswith("/"):
                    raise KeepError(f"{archive.name}: member {member.name!r}: expected JOB/FILE, as matrix.py packs")
                if parts[1] not in LEFT_OUT:
                    jobs.setdefault(parts[0], {})[parts[1]] = tar.extractfile(member).read()
    except (tarfile.TarError, EOFError, OSError, zlib.error) as error:
        first_line = (str(error).splitlines() or [type(error).__name__])[0]
        raise KeepError(f"{archive.name}: not a whole tar.gz archive ({first_line})") from None
    return jobs


def _files_read(job: str, job_json: bytes) -> list[str]:
    """The paths inside the checkout that a run's command named after ``--config`` or ``--model``."""
    try:
        command = json.loads(job_json).get("command") or []
    except (ValueError, AttributeError):
        raise KeepError(f"{job}/job.json: not the JSON object matrix.py writes (with its \"command\")") from None
    if not isinstance(command, list) or not all(isinstance(word, str) for word in command):
        raise KeepError(f"{job}/job.json: command: expected a list of strings, as matrix.py writes it")
    named = [command[i + 1] for i, flag in enumerate(command[:-1]) if flag in READ_FLAGS]
    outside = [path for path in named if ".." in PurePosixPath(path).parts]
    if outside:
        raise KeepError(f"{job}/job.json: {outside[0]!r}: a path outside the checkout; a run reads the checkout's")
    return [path for path in named if not Path(path).is_absolute()]


def _stage(returned: Path, stage: Path, jobs: dict[str, dict[str, bytes]], log: Path, log_name: str,
           host_wanted: bool) -> None:
    """Everything to keep, in ``stage``, normalized and compressed as the fixtures are stored."""
    for name, files in jobs.items():
        (stage / name).mkdir()
        for file_name, data in files.items():
            (stage / name / file_name).write_bytes(data)
        for read in _files_read(name, files.get("job.json", b"{}")):
            source, kept = ROOT / read, stage / "checkout" / read
            if source.is_file() and not kept.exists():
                kept.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(source, kept)
    shutil.copyfile(log, stage / log_name)
    if host_wanted and (returned / "host.json").is_file():
        shutil.copyfile(returned / "host.json", stage / "host.json")
    normalize_fixture_paths.main([str(stage)])
    compress_fixtures.main([str(stage)])


def keep(returned: Path, into: Path, call: int) -> tuple[list[str], list[str]]:
    """Copy one call's results into ``into``; the jobs kept and the earlier calls' jobs left, by name. Nothing lands
    in ``into`` until all of it is ready beside it: a failure leaves ``into`` as it was."""
    if into.exists() and not into.is_dir():
        raise KeepError(f"into: {into}: not a folder; name the date's fixture folder")
    archives = sorted(returned.glob("rehearse-*.tar.gz"))
    logs = sorted(returned.glob("matrix-*.log"))
    if len(archives) != 1 or len(logs) != 1:
        raise KeepError(f"{returned}: expected one rehearse-<set>.tar.gz and one matrix-<phase>.log, found "
                        f"{[p.name for p in archives + logs] or 'neither'}")
    jobs = _jobs(archives[0])
    started = set(STARTED.findall(logs[0].read_text(errors="replace")))
    earlier = sorted(name for name in jobs if name not in started and (into / name).exists())
    jobs = {name: files for name, files in jobs.items() if name not in earlier}
    present = sorted(name for name in jobs if (into / name).exists())
    if present:
        raise KeepError(f"{into}: already holds {', '.join(present)}; a recorded run is never overwritten")
    log_name = f"{logs[0].stem}-call{call}.log"
    if recorded.exists(into / log_name):
        raise KeepError(f"--call: {call}: {into / log_name} is kept already; name the call's own number")
    into.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{into.name}-", dir=into.parent))
    try:
        _stage(returned, stage, jobs, logs[0], log_name, host_wanted=not (into / "host.json").exists())
        into.mkdir(exist_ok=True)
        for path in sorted(p for p in stage.rglob("*") if p.is_file()):
            target = into / path.relative_to(stage)
            if not target.exists():  # checkout/ files a run of an earlier call kept stay as they were
                target.parent.mkdir(parents=True, exist_ok=True)
                path.replace(target)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return sorted(jobs), earlier


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("returned", type=Path, help="the folder the call's $OUT came back to")
    parser.add_argument("into", type=Path, help="the date's fixture folder, tests/fixtures/gpu/<date>-roundN")
    parser.add_argument("--call", type=int, required=True, help="the call's number in the session (1, 2, ...)")
    args = parser.parse_args(argv)
    try:
        if not args.returned.is_dir():
            raise KeepError(f"returned: {args.returned}: not a folder; name the folder the call's $OUT came back to")
        if args.call < 1:
            raise KeepError(f"--call: {args.call}: the call's number in the session, 1 or more")
        kept, earlier = keep(args.returned, args.into, args.call)
    except KeepError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"kept {len(kept)} run(s) in {args.into}: {', '.join(kept)}")
    if earlier:
        print(f"left {len(earlier)} run(s) an earlier call started and {args.into} holds: {', '.join(earlier)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
