"""Recorded fixtures name no path of the machine that recorded them (scripts/normalize_fixture_paths.py)."""

from __future__ import annotations

from conftest import REPO_ROOT, load_script

normalize = load_script("normalize_fixture_paths")


def test_the_checkout_prefix_goes_and_temp_dirs_read_tmpdir() -> None:
    checkout = ("/srv/checkout",)
    assert normalize.normalized("rootdir: /srv/checkout\n", checkout) == "rootdir: .\n"
    assert normalize.normalized('File "/srv/checkout/kimi_k3_serve/app.py"', checkout) == 'File "kimi_k3_serve/app.py"'
    assert normalize.normalized("log /tmp/kk3-bench26/x.log, file:///tmp/vllm_dist_1") == \
        "log $TMPDIR/kk3-bench26/x.log, file://$TMPDIR/vllm_dist_1"
    # The GPU host's work folders are the run's own choice (run_all.sh's KIMI_K3_SERVE_GPU_RUNS): kept.
    assert normalize.normalized("/var/tmp/kk3-runs/r49-s0 /srv/checkoutline", checkout) == \
        "/var/tmp/kk3-runs/r49-s0 /srv/checkoutline"
    # By default the prefix is this checkout's own root.
    assert normalize.normalized(f"rootdir: {REPO_ROOT}\n") == "rootdir: .\n"


def test_no_recorded_fixture_names_a_machine_path() -> None:
    named = [str(path.relative_to(REPO_ROOT)) for path, _ in normalize.rewrites(REPO_ROOT / "tests" / "fixtures")]
    assert not named, f"run scripts/normalize_fixture_paths.py on: {named}"
