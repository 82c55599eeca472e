"""The papermill stage runner: parameter resolution and atomic publishing."""
import json
import re
import sys
import time
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
from tests import ROOT

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


@pytest.mark.slow
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


TIMED_BODY = """
import json, sys, time
from pathlib import Path
t0 = time.perf_counter()
print("the report's line")
print("progress 3/3 [00:01<00:00, 1.50s/it]", file=sys.stderr)
(Path(out_dir) / "metrics").mkdir(parents=True)
(Path(out_dir) / "metrics" / "demo.json").write_text(json.dumps({"slope": params["slope"]}))
(Path(out_dir) / "timings").mkdir()
(Path(out_dir) / "timings" / "demo.json").write_text(json.dumps({"total": time.perf_counter() - t0}))
import matplotlib.pyplot as plt
(Path(out_dir) / "figures").mkdir()
plt.plot([0, 1]); plt.savefig(Path(out_dir) / "figures" / "a.pdf")
"""


@pytest.mark.slow
def test_published_notebook_holds_no_wall_clock_and_timings_go_to_git_only(tmp_path, capfd):
    root = make_repo(tmp_path)
    nb = nbformat.read(root / "notebooks" / "demo.ipynb", as_version=4)
    nb.cells[1].source = TIMED_BODY
    nbformat.write(nb, root / "notebooks" / "demo.ipynb")
    res = run_stage("demo", root=root, progress_bar=False)
    text = res.notebook.read_text()
    executed = nbformat.reads(text, as_version=4)
    streams = [(o.name, o.text) for c in executed.cells for o in c.get("outputs", []) if o.output_type == "stream"]
    assert streams == [("stdout", "the report's line\n")]          # stderr (progress, warnings) is the log
    for key in ("start_time", "end_time", "duration", "iopub.", "shell.execute_reply"):
        assert key not in text, f"the published notebook records the clock: {key}"
    assert "progress 3/3" in capfd.readouterr().err                 # echoed to the terminal instead
    timings = root / "reports" / "timings" / "demo.json"            # published beside, not a metrics key
    assert json.loads(timings.read_text())["total"] >= 0 and "total" not in json.loads(res.metrics.read_text())
    assert json.loads(timings.read_text())["stage_wall_s"] >= 0                 # the pipeline adds the stage's wall time
    assert executed.metadata.papermill.parameters["params"] == {"slope": 2, "figname": "a.png"}   # the rest kept
    pdf = (root / "reports" / "figures" / "demo" / "a.pdf").read_bytes()
    assert b"/CreationDate (D:19700101000000Z)" in pdf                # no run date in a figure either


# --------------------------------------------------------------------------- DVC headlines


def test_headline_from_full_metrics(tmp_path):
    from companion.metrics import headline, main as metrics_main, table1_entries, write_headline

    full = {"stage": "s", "profile": "gpu", "big": {"x": list(range(50))},
            "table1": [{"row": "vision", "variant": "held-out", "n_models": 3, "rho": {"adaptive": 0.4},
                        "tau": {"adaptive": 0.5, "geodesic_mixed": -0.25},
                        "ci": {"adaptive": [0.1, 0.9], "geodesic_mixed": [-0.7, 0.2]}},
                       {"row": "vision", "variant": "all", "n_models": 6,
                        "tau": {"adaptive": 0.4, "geodesic_mixed": -0.1}}]}
    h = headline(full)
    # printed scalars: the first entry's tau and model count; the rest only as (unprinted) lists
    assert h["n"] == 3 and h["tau"] == {"adaptive": 0.5, "geodesic_mixed": -0.25}
    assert [e["variant"] for e in h["table1"]] == ["held-out", "all"]
    assert h["table1"][0]["ci"]["geodesic_mixed"] == [-0.7, 0.2] and "ci" not in h["table1"][1]
    assert "big" not in h and "profile" not in h
    assert table1_entries({"table1": full["table1"][0]}) == [full["table1"][0]]  # one entry, not a list
    assert headline({"stage": "toy", "x": 1}) is None
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "s.json").write_text(json.dumps(full))
    (tmp_path / "m" / "toy.json").write_text(json.dumps({"x": 1}))
    assert metrics_main(["headline", "--metrics-dir", str(tmp_path / "m"), "--out-dir", str(tmp_path / "h")]) == 0
    assert json.loads((tmp_path / "h" / "s.json").read_text()) == h
    assert not (tmp_path / "h" / "toy.json").exists()
    (tmp_path / "m" / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="bad.json must hold a JSON object"):
        write_headline(tmp_path / "m" / "bad.json", tmp_path / "h")


def test_committed_headlines_match_committed_full_metrics():
    from companion.metrics import headline, read_metrics

    heads = sorted((ROOT / "reports" / "headline").glob("*.json"))
    assert {p.stem for p in heads} == {"diagonal", "vision", "language", "minilm"}
    for p in heads:
        full = read_metrics(ROOT / "reports" / "metrics" / p.name)
        if full.get("skipped"):   # not run in the committed profile (companion.skipped): the headline says so
            head = json.loads(p.read_text())
            assert head["table1"] == full["table1"] == [] and headline(full) is None, p.name
            assert head["skipped"] == [f"{full['stage']} ({full['profile']}): {full['skipped']}"], p.name
            continue
        assert json.loads(p.read_text()) == json.loads(json.dumps(headline(full))), p.name
        # and the headline's first tau is what Table 1 prints for that stage
        first = full["table1"][0] if isinstance(full["table1"], list) else full["table1"]
        assert json.loads(p.read_text())["tau"] == first["tau"]


@pytest.mark.slow
def test_run_publishes_a_headline_for_a_table1_stage(tmp_path):
    root = make_repo(tmp_path)
    nb = nbformat.read(root / "notebooks" / "demo.ipynb", as_version=4)
    nb.cells[1].source = nb.cells[1].source.replace(
        '{"slope": params["slope"], "seen_profile": profile}',
        '{"slope": params["slope"], "table1": {"row": "vision", "n_models": 2, "tau": {"adaptive": 0.5}}}')
    nbformat.write(nb, root / "notebooks" / "demo.ipynb")
    run_stage("demo", root=root, progress_bar=False)
    head = json.loads((root / "reports" / "headline" / "demo.json").read_text())
    assert head["n"] == 2 and head["tau"] == {"adaptive": 0.5}


def _copy_stage_files(dst: Path, stage: str) -> Path:
    (dst / "notebooks").mkdir(parents=True)
    (dst / "notebooks" / f"{stage}.ipynb").write_bytes((ROOT / "notebooks" / f"{stage}.ipynb").read_bytes())
    (dst / "params.yaml").write_bytes((ROOT / "params.yaml").read_bytes())
    return dst


@pytest.mark.slow
def test_a_stage_run_in_two_folders_publishes_identical_bytes(tmp_path):
    """Issue 24 item 6: no machine path, no random cell id, so the same run elsewhere gives the same files."""
    roots = [_copy_stage_files(tmp_path / "first", "toy"), _copy_stage_files(tmp_path / "elsewhere" / "deeper", "toy")]
    published = []
    for root in roots:
        run_stage("toy", root=root, overrides={"n_grid": 20, "cpu_kernels": None}, progress_bar=False)
        reports = root / "reports"
        files = {p.relative_to(reports): p.read_bytes() for p in reports.rglob("*")
                 if p.is_file() and p.relative_to(reports).parts[0] != "timings"}
        published.append(files)
        for rel, data in files.items():
            assert str(root).encode() not in data and str(tmp_path).encode() not in data, f"{rel} holds a machine path"
    assert sorted(published[0]) == sorted(published[1]) and len(published[0]) >= 4
    for rel in published[0]:
        assert published[0][rel] == published[1][rel], f"{rel} differs between the two folders"
    nb = nbformat.read(roots[0] / "reports" / "notebooks" / "toy.ipynb", as_version=4)
    assert [c.id for c in nb.cells] == [f"toy-{i:02d}" for i in range(len(nb.cells))]
    assert nb.metadata.papermill.parameters.out_dir == "reports/.staging/toy/out"
    assert nb.metadata.papermill.input_path == "notebooks/toy.ipynb"


def test_published_notebooks_are_normalised_and_scrubbing_is_idempotent(tmp_path):
    """Every committed notebook already has the bytes the scrub gives (so re-publishing changes nothing but
    what the run computes), and holds no absolute path."""
    from companion.pipeline import scrub_notebook

    for nb_path in sorted((ROOT / "reports" / "notebooks").glob("*.ipynb")):
        copy = tmp_path / nb_path.name
        copy.write_bytes(nb_path.read_bytes())
        scrub_notebook(copy, nb_path.stem)
        assert copy.read_bytes() == nb_path.read_bytes(), f"{nb_path.name} is not normalised: " \
            f"python -m companion.pipeline --normalise reports/notebooks/{nb_path.name}"
        text = nb_path.read_text()
        for prefix in ("/work/", "/tmp/", "/home/"):
            assert prefix not in text, f"{nb_path.name} holds {prefix!r}"
        # papermill's staging folders are mkdtemp names, <stage>-<8 random characters>/
        assert not re.search(r"\.staging/\w+-\w{8}/", text), f"{nb_path.name} holds a random staging folder"


LIVE_BODY = """
import json, sys, time
from pathlib import Path
print("members 1/2 geodesic_mixed [00:01<00:01]", file=sys.stderr, flush=True)
print("the report's line")
time.sleep(1.0)                                  # the kernel's stderr is flushed by now
Path(params["clock"]).write_text(repr(time.time()))   # when the run went on after the progress line
(Path(out_dir) / "metrics").mkdir(parents=True)
(Path(out_dir) / "metrics" / "demo.json").write_text(json.dumps({"slope": params["slope"]}))
"""


class _Terminal:
    """A stand-in for the terminal: what was written, and when."""

    def __init__(self):
        self.writes = []

    def write(self, text):
        self.writes.append((time.time(), text))
        return len(text)

    def flush(self):
        pass

    def first(self, needle):
        return next((t for t, text in self.writes if needle in text), None)


@pytest.mark.slow
def test_stage_progress_reaches_the_terminal_while_the_stage_runs(tmp_path, monkeypatch):
    """Issue 32 item 5: the kernel's stderr (the stage's progress bars) is written to the terminal
    as it comes — before the notebook's next line runs — and still kept out of the published
    notebook, whose bytes do not change; HIDESEEK_PROGRESS=0 switches the live stream off (the
    log is then echoed once, after the run, as before)."""
    root = make_repo(tmp_path)
    nb = nbformat.read(root / "notebooks" / "demo.ipynb", as_version=4)
    nb.cells[1].source = LIVE_BODY
    nbformat.write(nb, root / "notebooks" / "demo.ipynb")
    clock = tmp_path / "clock.txt"
    published = {}
    for live in ("1", "0"):
        monkeypatch.setenv("HIDESEEK_PROGRESS", live)
        terminal = _Terminal()
        with monkeypatch.context() as m:
            m.setattr(sys, "stderr", terminal)
            res = run_stage("demo", root=root, progress_bar=False, overrides={"clock": str(clock)})
        shown, later = terminal.first("members 1/2 geodesic_mixed"), float(clock.read_text())
        assert shown is not None, "the progress line never reached the terminal"
        if live == "1":
            assert shown < later, "the progress line reached the terminal only after the stage ran on"
        else:
            assert shown > later, "HIDESEEK_PROGRESS=0 still streamed the kernel's stderr"
        assert sum("members 1/2" in text for _, text in terminal.writes) == 1      # once, not twice
        published[live] = res.notebook.read_bytes()
        streams = [(o.name, o.text) for c in nbformat.reads(published[live].decode(), as_version=4).cells
                   for o in c.get("outputs", []) if o.output_type == "stream"]
        assert streams == [("stdout", "the report's line\n")]      # the progress line is not in the report
    assert published["1"] == published["0"]
