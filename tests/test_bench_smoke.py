"""The benchmarks run and print their figures (tiny sizes: smoke, not measurement)."""

from __future__ import annotations

import json
import subprocess
import sys


def bench(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "livemig.cli", "bench", *args], capture_output=True, text=True,
                          timeout=timeout)  # fmt: skip


def test_bench_scale(tmp_path):
    r = bench("scale", "--ranks", "4,16", "--json", str(tmp_path / "s.json"))
    assert r.returncode == 0, r.stderr
    rows = json.loads((tmp_path / "s.json").read_text())
    assert [x["ranks"] for x in rows] == [4, 16]
    assert all(0 < x["coordinator_total_s"] < 10 for x in rows)


def test_bench_transfer(tmp_path):
    r = bench("transfer", "--size-mb", "16", "--repeat", "1", "--json", str(tmp_path / "t.json"))
    assert r.returncode == 0, r.stderr
    res = json.loads((tmp_path / "t.json").read_text())
    for k in ("link_gbps", "livemig_gbps", "ratio_to_link", "checksum_gbps", "receiver_peak_extra_mb", "sources"):
        assert k in res
    assert res["livemig_gbps"] > 0 and "ratio_to_link" in r.stdout


def test_bench_downtime_tiny(tmp_path):
    r = bench("downtime", "--repeat", "1", "--steps", "24", "--fail-at", "10", "--ckpt-every", "4",
              "--width", "256", "--layers", "2", "--json", str(tmp_path / "d.json"), timeout=400)  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    res = json.loads((tmp_path / "d.json").read_text())
    s = res["summary"]
    assert s["livemig"]["bit_identical"] == "yes", r.stdout
    assert s["livemig"]["downtime_s"] is not None and s["restart"]["downtime_s"] is not None, r.stdout
    oks = {k: [(x.get("ok"), x.get("steps")) for x in v] for k, v in res["samples"].items()}
    assert all(s[k]["all_ok"] for k in ("fault_free", "plain_ddp", "livemig", "restart")), f"{oks}\n{r.stdout}"
