"""The command line on a saved HF model and an open_clip fine-tune, offline."""
import json

import torch

from hideseek.cli import main

from models import bert_batch, tiny_bert


def test_cli_sharpness_on_saved_hf_model(tmp_path, capsys):
    model = tiny_bert().float()
    model.save_pretrained(tmp_path / "bert")
    x, y = bert_batch(n=10)
    torch.save({"inputs": x, "labels": y}, tmp_path / "data.pt")
    out = tmp_path / "res.json"
    rc = main(["sharpness", "--hf", str(tmp_path / "bert"), "--data", str(tmp_path / "data.pt"),
               "--batch-size", "4", "--rho", "0.05", "--n-iters", "2", "--metric", "mixed",
               "--out", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert len(res["per_batch"]) == 3 and res["name"] == "geodesic_mixed"
    assert abs(res["value"] - sum(res["per_batch"]) / 3) < 1e-12
    assert "geodesic_mixed" in capsys.readouterr().out
    assert main(["symmetries", "--hf", str(tmp_path / "bert")]) == 0
    assert "qk" in capsys.readouterr().out
    out16 = tmp_path / "res_bf16.json"
    assert main(["sharpness", "--hf", str(tmp_path / "bert"), "--data", str(tmp_path / "data.pt"),
                 "--batch-size", "4", "--rho", "0.05", "--n-iters", "2", "--metric", "mixed",
                 "--autocast", "bfloat16", "--out", str(out16)]) == 0
    assert json.loads(out16.read_text())["config"]["autocast"] == "bfloat16"


def test_cli_reports_bad_input_without_traceback(tmp_path, capsys):
    rc = main(["sharpness", "--hf", str(tmp_path / "missing"), "--data", "x.pt", "--rho", "0.1"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "not a saved HuggingFace model directory" in err and "Traceback" not in err
    model = tiny_bert().float()
    model.save_pretrained(tmp_path / "bert")
    torch.save({"x": 1}, tmp_path / "bad.pt")
    rc = main(["sharpness", "--hf", str(tmp_path / "bert"), "--data", str(tmp_path / "bad.pt"), "--rho", "0.1"])
    assert rc == 2 and "'inputs' and 'labels'" in capsys.readouterr().err
