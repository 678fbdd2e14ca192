"""bench_frontend's accounting: the front end's CPU time includes the processes it started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import bench_frontend as bf

# Burns 0.3 s of its own CPU, says so, then waits (alive, so /proc still counts it).
_BURNER = (
    "import sys, time\n"
    "while time.process_time() < 0.3: pass\n"
    "print('burnt', flush=True)\n"
    "sys.stdin.readline()\n"
)


def test_process_tree_cpu_counts_living_descendants() -> None:
    shell = subprocess.Popen(
        ["/bin/sh", "-c", f'{sys.executable} -c "{_BURNER}"; exit 0'],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert shell.stdout is not None and shell.stdout.readline() == "burnt\n"
        # The shell (which forks: a command follows) burnt nearly nothing; its child did.
        assert bf.process_tree_cpu_s(shell.pid) >= 0.28
        assert bf.process_tree_cpu_s(2**22 + 12345) == 0.0  # no such process: nothing
    finally:
        assert shell.stdin is not None
        shell.stdin.close()
        shell.wait(10)


def test_report_ends_with_the_first_front_ends_requests_per_cpu_second() -> None:
    direct = bf.Run(label="direct", requests=100, wall_s=0.5, latencies_s=(0.01,) * 100, cpu_s=0.1)
    one = bf.Run(label="one", requests=100, wall_s=1.0, latencies_s=(0.02,) * 100, cpu_s=0.25)
    two = bf.Run(label="two", requests=100, wall_s=1.0, latencies_s=(0.03,) * 100, cpu_s=0.5)
    assert one.cpu_ms_per_request == 2.5 and one.req_per_cpu_s == 400
    text = bf.report([direct, one, two])
    assert text.splitlines()[-2:] == [
        "front end CPU per request / bare server's: 2.50",
        "frontend_req_per_cpu_s=400.0",
    ]
    assert direct.req_per_s == 200 and direct.to_json()["cpu_ms_per_request"] == 1.0
    assert (
        bf.Run(label="x", requests=1, wall_s=1, latencies_s=(1,), cpu_s=None).req_per_cpu_s is None
    )
