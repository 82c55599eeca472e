"""The papermill stage runner: parameter resolution and atomic publishing."""
import json
from pathlib import Path

import nbformat
import pytest
import yaml

from companion.pipeline import (
    PipelineError,
    apply_overrides,
    main,
    parse_overrides,
    resolve_stage_params,
    run_stage,
)

NB_BODY = """
import json, os
from pathlib import Path
import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
out = Path(out_dir)
(out / "figures").mkdir(parents=True, exist_ok=True)
fig, ax = plt.subplots()
ax.plot([0, 1], [0, params["slope"]])
fig.savefig(out / "figures" / params["figname"])
if params.get("fail"):
    raise RuntimeError("deliberate failure")
if not params.get("skip_metrics"):
    (out / "metrics").mkdir(exist_ok=True)
    json.dump({"slope": params["slope"], "seen_profile": profile},
              open(out / "metrics" / "demo.json", "w"))
"""


def make_repo(tmp_path: Path) -> Path:
    nb = nbformat.v4.new_notebook()
    p = nbformat.v4.new_code_cell('profile = "cpu"\nparams = {"slope": 1, "figname": "a.png"}\nout_dir = "out"')
    p.metadata["tags"] = ["parameters"]
    nb.cells = [p, nbformat.v4.new_code_cell(NB_BODY)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    (tmp_path / "notebooks").mkdir()
    nbformat.write(nb, tmp_path / "notebooks" / "demo.ipynb")
    params = {"profile": "cpu", "demo": {"cpu": {"slope": 2, "figname": "a.png"},
                                         "gpu": {"slope": 3, "figname": "a.png"}}}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    return tmp_path


def test_resolve_and_overrides():
    params = {"profile": "gpu", "s": {"cpu": {"a": 1}, "gpu": {"a": 2, "b": {"c": 3}}}}
    assert resolve_stage_params(params, "s") == ("gpu", {"a": 2, "b": {"c": 3}})
    assert resolve_stage_params(params, "s", "cpu") == ("cpu", {"a": 1})
    assert resolve_stage_params(params, "nosection", "cpu") == ("cpu", {})
    with pytest.raises(PipelineError, match="no profile 'paper'"):
        resolve_stage_params(params, "s", "paper")
    with pytest.raises(PipelineError, match="unknown profile"):
        resolve_stage_params(params, "s", "tpu")
    ov = parse_overrides(["a=5", "b.c=[1, 2]", "flag=true", "name=x=y"])
    assert ov == {"a": 5, "b.c": [1, 2], "flag": True, "name": "x=y"}
    new = apply_overrides(params["s"]["gpu"], ov)
    assert new == {"a": 5, "b": {"c": [1, 2]}, "flag": True, "name": "x=y"}
    assert params["s"]["gpu"]["b"] == {"c": 3}  # input not mutated
    with pytest.raises(PipelineError, match="key=value"):
        parse_overrides(["novalue"])


def test_run_publishes_then_failure_leaves_reports_untouched(tmp_path):
    root = make_repo(tmp_path)
    reports = root / "reports"
    res = run_stage("demo", root=root, progress_bar=False)
    assert res.profile == "cpu" and res.params == {"slope": 2, "figname": "a.png"}
    metrics = json.loads((reports / "metrics" / "demo.json").read_text())
    assert metrics["slope"] == 2 and metrics["seen_profile"] == "cpu"
    assert metrics["profile"] == "cpu" and metrics["stage"] == "demo"
    assert (reports / "figures" / "demo" / "a.png").is_file()
    executed = nbformat.read(reports / "notebooks" / "demo.ipynb", as_version=4)
    assert any("injected-parameters" in c.metadata.get("tags", []) for c in executed.cells)
    assert not (reports / ".staging").exists()

    # a rerun with another figure name replaces the stage's figure folder (no stale files)
    assert main(["demo", "--root", str(root), "--set", "figname=b.png", "--profile", "gpu"]) == 0
    assert sorted(p.name for p in (reports / "figures" / "demo").iterdir()) == ["b.png"]
    assert json.loads((reports / "metrics" / "demo.json").read_text())["slope"] == 3
    before = {p: p.read_bytes() for p in reports.rglob("*") if p.is_file()}

    # a failing run and a run that writes no metrics publish nothing
    with pytest.raises(PipelineError, match="failed") as exc:
        run_stage("demo", root=root, overrides={"fail": True, "figname": "c.png"}, progress_bar=False)
    staged = Path(str(exc.value).rsplit(": ", 1)[1])
    assert staged.is_file() and ".staging" in str(staged)
    with pytest.raises(PipelineError, match="wrote no out/metrics"):
        run_stage("demo", root=root, overrides={"skip_metrics": True, "figname": "d.png"},
                  progress_bar=False)
    after = {p: p.read_bytes() for p in reports.rglob("*") if p.is_file() and ".staging" not in str(p)}
    assert after == before
    assert main(["nostage", "--root", str(root)]) == 1
