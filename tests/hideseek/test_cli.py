"""The command line on a saved HF model and an open_clip fine-tune, offline."""
import json

import pytest
import torch

from hideseek.cli import main

from tests.models import bert_batch, tiny_bert


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
    printed = capsys.readouterr().out
    assert "geodesic_mixed" in printed and "by where it lies: qk " in printed and "free " in printed
    assert main(["symmetries", "--hf", str(tmp_path / "bert")]) == 0
    assert "qk" in capsys.readouterr().out
    out16 = tmp_path / "res_bf16.json"
    assert main(["sharpness", "--hf", str(tmp_path / "bert"), "--data", str(tmp_path / "data.pt"),
                 "--batch-size", "4", "--rho", "0.05", "--n-iters", "2", "--metric", "mixed",
                 "--autocast", "bfloat16", "--out", str(out16)]) == 0
    assert json.loads(out16.read_text())["config"]["autocast"] == "bfloat16"


def test_cli_reports_bad_input_without_traceback(tmp_path, capsys):
    x, y = bert_batch(n=4)
    torch.save({"inputs": x, "labels": y}, tmp_path / "ok.pt")
    rc = main(["sharpness", "--hf", str(tmp_path / "missing"), "--data", str(tmp_path / "ok.pt"), "--rho", "0.1"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "not a saved HuggingFace model directory" in err and "Traceback" not in err
    model = tiny_bert().float()
    model.save_pretrained(tmp_path / "bert")
    torch.save({"x": 1}, tmp_path / "bad.pt")
    rc = main(["sharpness", "--hf", str(tmp_path / "bert"), "--data", str(tmp_path / "bad.pt"), "--rho", "0.1"])
    assert rc == 2 and "'inputs' and 'labels'" in capsys.readouterr().err


# ---------------------------------------------------------------- bad files and arguments
@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    """A saved tiny BERT, written outside the tests' captured output."""
    path = tmp_path_factory.mktemp("cli") / "bert"
    tiny_bert().float().save_pretrained(path)
    return str(path)


def _one_line_error(capsys, *needles):
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.startswith("hideseek: error: ") and "\n" not in err and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def _run(bert_dir, data, *extra):
    return main(["sharpness", "--hf", bert_dir, "--data", str(data), "--rho", "0.05",
                 "--n-iters", "1", "--quiet", *extra])


def test_cli_non_torch_data_file(bert_dir, tmp_path, capsys):
    bad = tmp_path / "data.pt"
    bad.write_text("input_ids,label\n1 2 3,0\n")
    assert _run(bert_dir, bad) == 2
    _one_line_error(capsys, "--data", "torch.save", "--help")


def test_cli_labels_saved_as_list(bert_dir, tmp_path, capsys):
    x, y = bert_batch(n=4)
    torch.save({"inputs": x, "labels": y.tolist()}, tmp_path / "data.pt")
    assert _run(bert_dir, tmp_path / "data.pt") == 2
    _one_line_error(capsys, "'labels'", "tensor", "list")


def test_cli_count_mismatch_refused(bert_dir, tmp_path, capsys):
    x, y = bert_batch(n=8)
    torch.save({"inputs": x, "labels": y[:5]}, tmp_path / "data.pt")
    assert _run(bert_dir, tmp_path / "data.pt") == 2
    _one_line_error(capsys, "8", "5", "labels")
    torch.save({"inputs": x["input_ids"], "labels": y[:5]}, tmp_path / "data2.pt")
    assert _run(bert_dir, tmp_path / "data2.pt") == 2
    _one_line_error(capsys, "8", "5")


def test_cli_cuda_without_gpu(bert_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    x, y = bert_batch(n=4)
    torch.save({"inputs": x, "labels": y}, tmp_path / "data.pt")
    assert _run(bert_dir, tmp_path / "data.pt", "--device", "cuda") == 2
    _one_line_error(capsys, "--device cuda", "GPU")


def test_cli_wrong_open_clip_file(tmp_path, capsys):
    x, y = bert_batch(n=4)
    torch.save({"inputs": x, "labels": y}, tmp_path / "data.pt")
    (tmp_path / "clip.pt").write_bytes(b"not a checkpoint at all")
    rc = main(["sharpness", "--open-clip", str(tmp_path / "clip.pt"), "--data", str(tmp_path / "data.pt"),
               "--rho", "0.05", "--quiet"])
    assert rc == 2
    _one_line_error(capsys, "clip.pt")
    torch.save({"weight": torch.zeros(2, 2)}, tmp_path / "clip2.pt")
    assert main(["symmetries", "--open-clip", str(tmp_path / "clip2.pt")]) == 2
    _one_line_error(capsys, "clip2.pt")


def test_cli_bad_numbers(bert_dir, tmp_path, capsys):
    x, y = bert_batch(n=4)
    torch.save({"inputs": x, "labels": y}, tmp_path / "data.pt")
    for extra, needle in ((["--batch-size", "0"], "--batch-size"), (["--eps", "-1"], "eps"),
                          (["--max-batches", "0"], "--max-batches")):
        assert _run(bert_dir, tmp_path / "data.pt", *extra) == 2
        _one_line_error(capsys, needle)
    assert main(["sharpness", "--hf", bert_dir, "--data", str(tmp_path / "data.pt"),
                 "--rho", "-0.1"]) == 2
    _one_line_error(capsys, "rho")


def test_cli_help_documents_data_format(capsys):
    with pytest.raises(SystemExit) as info:
        main(["sharpness", "--help"])
    assert info.value.code == 0
    out = capsys.readouterr().out
    for needle in ("torch.save", "'inputs'", "'labels'", ".npz", "--quiet"):
        assert needle in out, needle


def test_cli_quiet_prints_only_the_result(bert_dir, tmp_path, capsys):
    x, y = bert_batch(n=4)
    torch.save({"inputs": x, "labels": y}, tmp_path / "data.pt")
    assert _run(bert_dir, tmp_path / "data.pt", "--out", str(tmp_path / "r.json")) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out.strip().count("\n") == 0 and "geodesic_invariant" in captured.out


def test_cli_rotary_classifier_symmetries_and_sharpness(tmp_path, capsys):
    """A saved Llama sequence classifier: the listing names the rotary subgroup, and
    sharpness reports where the maximiser lies, rotary Q/K apart."""
    import transformers
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                   intermediate_size=16, max_position_embeddings=16, num_labels=3,
                                   pad_token_id=0)
    transformers.LlamaForSequenceClassification(cfg).save_pretrained(tmp_path / "llama")
    capsys.readouterr()
    assert main(["symmetries", "--hf", str(tmp_path / "llama")]) == 0
    out = capsys.readouterr().out
    assert "GL(1,C)^4" in out and "GL(8)" in out
    g = torch.Generator().manual_seed(0)
    torch.save({"inputs": {"input_ids": torch.randint(1, 40, (4, 6), generator=g)},
                "labels": torch.randint(0, 3, (4,), generator=g)}, tmp_path / "data.pt")
    res = tmp_path / "res.json"
    assert main(["sharpness", "--hf", str(tmp_path / "llama"), "--data", str(tmp_path / "data.pt"),
                 "--rho", "0.05", "--n-iters", "2", "--quiet", "--out", str(res)]) == 0
    share = json.loads(res.read_text())["norm_share"]
    assert set(share) == {"qk_rotary", "vo", "free"} and abs(sum(share.values()) - 1) < 1e-9


def test_cli_argument_errors_are_one_line(capsys):
    assert main(["sharpness", "--hf", "x", "--data", "d.pt", "--rho", "abc"]) == 2
    _one_line_error(capsys, "--rho", "abc", "--help")
    assert main(["sharpness", "--hf", "x", "--rho", "0.1"]) == 2
    _one_line_error(capsys, "--data")
    assert main(["sharpen"]) == 2
    _one_line_error(capsys, "sharpen")
