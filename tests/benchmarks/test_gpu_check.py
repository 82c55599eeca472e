"""``make gpu-check``'s script (issue 25, item 6) on the CPU paths: without CUDA it skips in
one line with exit status 0; ``--device cpu --small`` runs every part (gloo instead of NCCL,
tiny sizes) and each part passes its own check."""
import json
import subprocess
import sys

import pytest
import torch

from benchmarks import gpu_check
from tests import ROOT


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the skip on a machine without CUDA")
def test_skips_in_one_line_without_cuda():
    out = subprocess.run([sys.executable, "-m", "benchmarks.gpu_check"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0
    assert out.stdout.strip().splitlines() == ["gpu-check: skipped, no CUDA device visible to torch (nothing "
                                               "to check on this machine)"]


@pytest.mark.slow
def test_every_part_runs_on_the_cpu(tmp_path, capsys):
    path = tmp_path / "gpu_check.json"
    rc = gpu_check.main(["--device", "cpu", "--small", "--json", str(path)])
    printed = capsys.readouterr().out
    res = json.loads(path.read_text())["parts"]
    assert rc == 0, printed
    assert res["nccl"]["backend"] == "gloo" and res["nccl"]["max_rel_diff"] <= 1e-10
    assert res["nccl"]["geodesic_mixed"]["fsdp_parallel"] == "sharded"
    assert res["bf16_lora"]["ok"] and "is at its initialisation (B = 0" in res["bf16_lora"]["fresh_adapter_message"]
    assert set(res["minilm_cost"]["x_floor"]) == {"adaptive", "geodesic_invariant", "geodesic_mixed"}
    assert len(printed.strip().splitlines()) == 3
