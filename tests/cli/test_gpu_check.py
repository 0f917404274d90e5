"""scripts/gpu_check.sh on this machine (no GPU): it runs on the installed torch, installs
nothing, passes its setup check (livemig imports, the bundled etcd answers) and prints SKIP with
the reason for every GPU check, exiting 0; a folder argument that is not one is refused."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.e2e.conftest import REPO

SCRIPT = os.path.join(REPO, "scripts", "gpu_check.sh")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the checks would run, not skip")
def test_without_a_gpu_every_gpu_check_skips_with_its_reason_and_the_script_exits_0(tmp_path):
    p = subprocess.run([SCRIPT, "--quick"], capture_output=True, text=True, timeout=120, cwd=tmp_path,
                       env={**os.environ, "PYTHON": sys.executable})  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    lines = [x for x in p.stdout.splitlines() if x.split(" ")[0] in ("PASS", "FAIL", "SKIP")]
    names = [x.split(" ")[1].rstrip(":") for x in lines]
    assert names == ["setup", "transfer", "plain", "zero1", "fsdp2", "nccl", "warmup", "multi"], p.stdout
    assert lines[0].startswith("PASS setup:"), p.stdout
    assert all(x.startswith("SKIP") and "no CUDA device" in x for x in lines[1:]), p.stdout


def test_a_wheels_argument_that_is_no_folder_is_refused_with_one_line(tmp_path):
    p = subprocess.run([SCRIPT, "--wheels", str(tmp_path / "nope")], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHON": sys.executable})  # fmt: skip
    assert p.returncode == 2 and "is not a folder" in p.stderr, p.stderr
