"""companion.kernels: the CPU kernels pinned for the vision zoo's training and the measuring stages (issue 31 item 6)."""
import json
import os
import platform
import shlex
import subprocess
import sys

import pytest
import yaml

from companion import kernels
from companion.params import stage_params
from tests import ROOT
from companion.params import load_yaml

X86 = platform.machine() in ("x86_64", "AMD64")
UNPINNED = {k: v for k, v in os.environ.items() if k not in kernels.KERNEL_ENV["avx2"] and k != kernels.REEXEC_FLAG}
PROBE = ("import json, os, torch; from companion import kernels; "
         "print(json.dumps({'capability': torch.backends.cpu.get_cpu_capability(), "
         "'env': {k: os.environ.get(k) for k in kernels.KERNEL_ENV['avx2']}}))")


def _run(argv, env, **kw):
    return subprocess.run(argv, env={**env, "PYTHONPATH": str(ROOT)}, cwd=ROOT, capture_output=True, text=True, **kw)


def test_the_environment_is_the_language_zoos_and_bad_levels_are_refused():
    from companion.experiments import language_zoo as lz

    assert kernels.KERNEL_ENV == lz.KERNEL_ENV      # one pin for every zoo of the project
    assert kernels.validate("AVX2") == "avx2" and kernels.validate(None) is None
    with pytest.raises(ValueError, match="cpu_kernels must be"):
        kernels.validate("avx9")
    assert kernels.stage_env(None) == {} and kernels.stage_env("avx2")["ATEN_CPU_CAPABILITY"] == "avx2"
    assert kernels.pinned("avx2", kernels.KERNEL_ENV["avx2"]) and not kernels.pinned("avx2", {})
    assert kernels.check(None) is None


#: the notebook stages run under `python -m companion.kernels STAGE -- python -m companion.pipeline STAGE`
WRAPPED = ("vision", "geometry_lines", "sam", "ablations", "minilm", "diagonal", "toy")
#: per wrapped stage (beyond vision and geometry_lines, tested above and below): a short run of the code that computes
#: its numbers, with cpu_kernels avx2 and tiny parameters, printing "done" when it finishes (minilm: when, past the
#: check, it reaches the zoo, which does not exist here: training one costs minutes, and the minilm notebook's test
#: runs the stage on a tiny zoo with the processor's own kernels)
CALLS = {
    "sam": ("import sys; from companion.experiments import sam; from tests.companion.notebooks.test_sam import TINY; "
            "sam.run_report('cpu', {**TINY, 'seeds': [0], 'rho_grid': {'sam': [0.1], 'asam': [0.5], "
            "'geodesic_invariant': [0.1], 'geodesic_mixed': [0.1]}, 'cpu_kernels': 'avx2'}, sys.argv[1], progress=False); "
            "print('done')"),
    "ablations": ("import sys; from companion.experiments import ablations as ab; "
                  "from tests.companion.experiments.test_ablations import _settings; "
                  "p = _settings(cpu_kernels='avx2', language=None); "
                  "p['rows'] = {'vision': p['rows']['vision']}; "
                  "ab.run_report('cpu', p, sys.argv[1], progress=False); print('done')"),
    "minilm": ("import sys; from companion.experiments import minilm_report as mr\n"
               "p = dict(zoo_dir=sys.argv[1] + '-no-zoo', device='cpu', threads=1, workers=1, n_points=16, batch_size=4, "
               "data_seed=0, n_iters=1, seed=0, rho={'adaptive': 0.1, 'geodesic_invariant': 0.1, 'geodesic_mixed': 0.1}, "
               "eps=0.0, max_train_error=0.3, n_boot=50, gap_splits=10, power_alpha=0.05, power_n_sim=20, "
               "paired=dict(n_boot=100, seed=24, confidence=0.95, power_n_sim=5, power_n_boot=20, retest_splits=10), "
               "cpu_kernels='avx2')\n"
               "try:\n    mr.run_report('cpu', p, sys.argv[1], progress=False)\n"
               "except FileNotFoundError as exc:\n    assert 'no zoo at' in str(exc), exc\n    print('done')"),
    "diagonal": ("from companion.experiments import diagonal as D; from tests.companion.notebooks.test_diagonal import TINY; "
                 "p = {**TINY['diagonal'], 'rhos': [0.1], 'n_starts': 2, 'n_iters': 5, 'n_boot': 20, 'alpha_sweep': None, "
                 "'orthogonal': None, 'main': {**TINY['diagonal']['main'], 'n_nets': 4, 'horizon': 300}, "
                 "'cpu_kernels': 'avx2'}; D.run(p, progress=False); print('done')"),
    "toy": ("from companion.experiments import toy; from tests.companion.experiments.test_toy import _params; "
            "toy.run(_params(n_grid=20, cpu_kernels='avx2')); print('done')"),
}


def test_the_cpu_profile_pins_training_and_the_measuring_stages():
    assert stage_params("vision_train", "cpu")[1]["cpu_kernels"] == "avx2"
    stages = load_yaml((ROOT / "dvc.yaml").read_text())["stages"]
    for stage in WRAPPED:
        assert "companion/kernels.py" in stages[stage]["deps"], stage
        assert stage_params(stage, "gpu")[1]["cpu_kernels"] is None, stage   # the gpu profile: the processor's own
        assert stage_params(stage, "cpu")[1]["cpu_kernels"] == "avx2"
        cmd = shlex.split(stages[stage]["cmd"])
        assert cmd[:5] == ["python", "-m", "companion.kernels", stage, "--"], cmd
        assert cmd[5:] == ["python", "-m", "companion.pipeline", stage]


def test_unpinned_runs_are_refused_in_the_stages_code(tmp_path):
    if kernels.pinned("avx2"):
        pytest.skip("this test process runs with the pinned environment")
    from companion.experiments import geometry_lines as gl
    from companion.experiments import vision_report as vr
    from tests.companion.experiments.test_geometry_lines import _settings
    from tests.companion.experiments.test_paper_zoos import _vision_params

    with pytest.raises(RuntimeError, match="vision: cpu_kernels='avx2'.*ATEN_CPU_CAPABILITY=avx2"):
        vr.run_report("cpu", _vision_params({"zoo_dir": tmp_path / "none"}, cpu_kernels="avx2"), tmp_path / "o")
    with pytest.raises(RuntimeError, match="geometry_lines: cpu_kernels='avx2'"):
        gl.run_report("cpu", _settings(cpu_kernels="avx2"), tmp_path / "o")
    from companion.experiments import vision_zoo as vz
    from tests.companion.experiments.test_vision_zoo import TINY

    with pytest.raises(RuntimeError, match="vision_train: cpu_kernels='avx2'"):
        vz.train_zoo(tmp_path / "z", vz.load_settings("cpu", TINY + ["cpu_kernels=avx2"]), progress=False)
    assert not (tmp_path / "z" / "init.pt").exists()      # refused before anything is trained


@pytest.mark.skipif(not X86, reason="AVX2 kernels exist on x86-64 only")
def test_wrapper_pins_the_command_and_the_processes_it_starts(tmp_path):
    """`python -m companion.kernels STAGE -- COMMAND`: COMMAND, and a process it starts (as the pipeline starts
    the notebook's kernel), run AVX2 kernels with the environment set; cpu_kernels null leaves them alone."""
    full = load_yaml((ROOT / "params.yaml").read_text())
    pfile = tmp_path / "params.yaml"
    pfile.write_text(yaml.safe_dump({"profile": "cpu", "vision": full["vision"]}))
    grandchild = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {PROBE!r}], check=True)"
    res = _run([sys.executable, "-m", "companion.kernels", "vision", "--params", str(pfile), "--",
                sys.executable, "-c", grandchild], UNPINNED)
    assert res.returncode == 0, res.stderr[-800:]
    seen = json.loads(res.stdout.strip().splitlines()[-1])
    assert seen["capability"] == "AVX2" and seen["env"] == kernels.KERNEL_ENV["avx2"]
    pfile.write_text(yaml.safe_dump({"profile": "cpu", "vision": {**full["vision"], "cpu": {
        **full["vision"]["cpu"], "cpu_kernels": None}}}))
    res = _run([sys.executable, "-m", "companion.kernels", "vision", "--params", str(pfile), "--",
                sys.executable, "-c", PROBE], UNPINNED)
    assert res.returncode == 0, res.stderr[-800:]
    assert json.loads(res.stdout.strip().splitlines()[-1])["env"] == {k: None for k in kernels.KERNEL_ENV["avx2"]}
    res = _run([sys.executable, "-m", "companion.kernels", "vision", "--params", str(pfile)], UNPINNED)
    assert res.returncode == 2 and "STAGE -- COMMAND" in res.stderr


@pytest.mark.skipif(not X86, reason="AVX2 kernels exist on x86-64 only")
def test_vision_train_restarts_pinned_and_its_workers_train_with_avx2(tmp_path):
    """The vision_train command started without the environment restarts itself with it; zoo.json records the
    kernels that the members' worker processes ran (collected inside the training function)."""
    from tests.companion.experiments.test_vision_zoo import TINY

    full = load_yaml((ROOT / "params.yaml").read_text())
    pfile = tmp_path / "params.yaml"
    pfile.write_text(yaml.safe_dump({"profile": "cpu", "vision_train": full["vision_train"]}))
    sets = [a for o in TINY + ["n_models=2", "workers=2", "cpu_kernels=avx2"] for a in ("--set", o)]
    res = _run([sys.executable, "-m", "companion.experiments.vision_zoo", "train", "--out", str(tmp_path / "zoo"),
                "--params", str(pfile), "--timings", str(tmp_path / "t.json"), "--no-progress", *sets], UNPINNED,
               timeout=600)
    assert res.returncode == 0, res.stderr[-800:]
    assert "cpu_kernels=avx2: restarting" in res.stdout
    meta = json.loads((tmp_path / "zoo" / "zoo.json").read_text())
    assert meta["cpu_kernels"] == {"capability": "AVX2", **kernels.KERNEL_ENV["avx2"]}
    assert meta["settings"]["cpu_kernels"] == "avx2" and len(meta["members"]) == 2


@pytest.mark.skipif(not X86, reason="AVX2 kernels exist on x86-64 only")
@pytest.mark.parametrize("stage", sorted(CALLS))
def test_a_pinned_stage_refuses_an_unpinned_run_and_runs_under_its_command(stage, tmp_path, monkeypatch, capsys):
    """The stage's computing code with cpu_kernels avx2: started without the environment it stops with the check's
    one-line refusal before computing anything; started as the stage's dvc.yaml command starts it (the wrapper
    `python -m companion.kernels STAGE --` reading the cpu profile's section, from an unpinned environment) it runs
    to the end. The unpinned run is this (unpinned) test process itself, as in the test above, saving a process
    that imports torch and the stage's code; a test process that runs pinned starts an unpinned one."""
    full = load_yaml((ROOT / "params.yaml").read_text())
    pfile = tmp_path / "params.yaml"
    pfile.write_text(yaml.safe_dump({"profile": "cpu", stage: full[stage]}))
    call = [sys.executable, "-c", CALLS[stage], str(tmp_path / "out")]
    if kernels.pinned("avx2"):
        res = _run(call, UNPINNED, timeout=600)
        assert res.returncode != 0 and "done" not in res.stdout
        refusal = res.stderr
    else:
        with monkeypatch.context() as m, pytest.raises(RuntimeError) as err:
            m.setattr(sys, "argv", ["-c", str(tmp_path / "out")])
            exec(compile(CALLS[stage], f"<CALLS[{stage!r}]>", "exec"), {"__name__": "__main__"})
        assert "done" not in capsys.readouterr().out
        refusal = f"{type(err.value).__name__}: {err.value}"
    assert f"RuntimeError: {stage}: cpu_kernels='avx2' but torch runs" in refusal, refusal[-800:]
    assert not (tmp_path / "out" / "metrics").exists()      # refused before anything is written
    res = _run([sys.executable, "-m", "companion.kernels", stage, "--params", str(pfile), "--", *call], UNPINNED,
               timeout=600)
    assert res.returncode == 0, res.stderr[-800:]
    assert res.stdout.strip().splitlines()[-1] == "done"
