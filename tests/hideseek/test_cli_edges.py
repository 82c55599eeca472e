"""The CLI keeps its promise: every error one line with exit 2 (model-time errors included),
--out checked before computing, symmetries on causal LMs and on models with nothing to
report, --dtype for half-precision checkpoints, --rho auto, plain help with defaults."""
import json

import pytest
import torch

import hideseek.cli as cli
from hideseek.cli import main

from tests.models import bert_batch, tiny_bert

tr = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def bert_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("cli_edges") / "bert"
    tiny_bert().float().save_pretrained(path)
    return str(path)


def one_line(capsys, *needles):
    err = capsys.readouterr().err.strip()
    assert err.startswith("hideseek: error: ") and "\n" not in err and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


def save(tmp_path, x, y, name="data.pt"):
    torch.save({"inputs": x, "labels": y}, tmp_path / name)
    return str(tmp_path / name)


def run(model_dir, data, *extra):
    return main(["sharpness", "--hf", model_dir, "--data", data, "--rho", "0.05", "--n-iters", "1",
                 "--quiet", *extra])


def test_labels_out_of_range_and_float_ids_are_one_line(bert_dir, tmp_path, capsys):
    x, y = bert_batch(n=4)
    assert run(bert_dir, save(tmp_path, x, y + 3)) == 2
    err = one_line(capsys, "labels of batch 0 range over 3 … ", "num_labels=3: 0 … 2")
    assert f"over 3 … {int(y.max()) + 3} " in err
    assert run(bert_dir, save(tmp_path, dict(x, input_ids=x["input_ids"].float()), y)) == 2
    one_line(capsys, "input_ids are float32", "must be integers")


def test_errors_raised_inside_the_model_are_one_line(bert_dir, tmp_path, capsys):
    x, y = bert_batch(n=4)
    assert run(bert_dir, save(tmp_path, x, torch.zeros(4, 5, dtype=torch.long))) == 2
    one_line(capsys, "the model (or loss_fn) raised ValueError on batch 0", "check the shapes of inputs and labels")


def test_unexpected_errors_are_one_line_too(bert_dir, tmp_path, capsys, monkeypatch):
    x, y = bert_batch(n=4)

    def boom(*a, **k):
        raise KeyError("something deep")
    monkeypatch.setattr(cli, "sharpness", boom)
    assert run(bert_dir, save(tmp_path, x, y)) == 2
    one_line(capsys, "KeyError", "something deep")


def test_out_is_checked_before_computing(bert_dir, tmp_path, capsys, monkeypatch):
    x, y = bert_batch(n=4)
    data = save(tmp_path, x, y)

    def never(*a, **k):
        raise AssertionError("computed before --out was checked")
    monkeypatch.setattr(cli, "sharpness", never)
    monkeypatch.setattr(cli, "load_model", never)
    assert run(bert_dir, data, "--out", str(tmp_path)) == 2
    one_line(capsys, "--out", "is a directory")
    (tmp_path / "file").write_text("")
    assert run(bert_dir, data, "--out", str(tmp_path / "file" / "res.json")) == 2
    one_line(capsys, "--out", "cannot create its folder")


def test_symmetries_on_a_causal_lm_and_on_a_model_without_attention(tmp_path, capsys):
    torch.manual_seed(0)
    cfg = tr.LlamaConfig(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                         intermediate_size=16, max_position_embeddings=16)
    tr.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "lm")
    rn = tr.ResNetConfig(embedding_size=8, hidden_sizes=[8, 8], depths=[1, 1], num_labels=3, num_channels=1)
    tr.ResNetForImageClassification(rn).save_pretrained(tmp_path / "resnet")
    capsys.readouterr()
    assert main(["symmetries", "--hf", str(tmp_path / "lm")]) == 0
    out = capsys.readouterr().out
    assert "self_attn" in out and "GL(1,C)^4" in out
    assert main(["symmetries", "--hf", str(tmp_path / "resnet")]) == 0
    assert "no symmetry pairs found in ResNetForImageClassification" in capsys.readouterr().out
    ids = torch.randint(0, 40, (4, 6), generator=torch.Generator().manual_seed(0))
    res = tmp_path / "lm.json"
    assert main(["sharpness", "--hf", str(tmp_path / "lm"), "--data", save(tmp_path, {"input_ids": ids}, ids),
                 "--rho", "0.05", "--n-iters", "2", "--quiet", "--out", str(res)]) == 0
    assert json.loads(res.read_text())["value"] > 0


def test_half_precision_checkpoint_is_upcast_by_dtype(tmp_path, capsys):
    tiny_bert().to(torch.bfloat16).save_pretrained(tmp_path / "bf16")
    capsys.readouterr()
    x, y = bert_batch(n=4)
    data = save(tmp_path, x, y)
    out = tmp_path / "r.json"
    assert run(str(tmp_path / "bf16"), data, "--out", str(out)) == 0        # default --dtype float32
    assert json.loads(out.read_text())["value"] > 0
    assert run(str(tmp_path / "bf16"), data, "--dtype", "auto") == 2
    one_line(capsys, "bfloat16", "--dtype float32")


def test_rho_auto(bert_dir, tmp_path, capsys):
    x, y = bert_batch(n=4)
    out = tmp_path / "auto.json"
    assert main(["sharpness", "--hf", bert_dir, "--data", save(tmp_path, x, y), "--rho", "auto",
                 "--n-iters", "2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "chosen by suggest_rho (rule loss)" in printed
    assert json.loads(out.read_text())["config"]["rho"] > 0
    assert main(["sharpness", "--hf", bert_dir, "--data", "d.pt", "--rho", "big"]) == 2
    one_line(capsys, "--rho", "a positive number or 'auto'")


def test_help_is_plain_and_every_flag_has_help():
    ap = cli._parser()
    subs = ap._subparsers._group_actions[0].choices
    for parser in (ap, *subs.values()):
        text = parser.format_help()
        for markup in ("``", ":data:", ":func:", ":class:", ":mod:"):
            assert markup not in text, (parser.prog, markup)
        for action in parser._actions:
            if action.option_strings and action.dest != "help":
                assert action.help, (parser.prog, action.dest)
    text = " ".join(subs["sharpness"].format_help().split())
    for needle in ("(default: cpu)", "(default: float32)", "(default: 128)", "(default: 20)", "(default: 0)",
                   "(default: all)", "choosing rho"):
        assert needle in text, needle
