"""The test suite's layout (docs/architecture.md §7): ``tests/`` mirrors the packages, and every
folder of it is a package, so that pytest never puts a test folder itself on ``sys.path`` (where
``tests/hideseek/`` would shadow the library)."""
import subprocess
from pathlib import Path

import pytest
import yaml

import benchmarks
import companion
import hideseek
from tests import ROOT

TESTS = ROOT / "tests"
#: the only test files directly in tests/: checks of the repository as a whole
REPOSITORY_WIDE = {"test_docs.py", "test_dvc_deps.py", "test_dvc_overrides.py", "test_dvc_plots.py",
                   "test_layout.py", "test_packaging.py", "test_dvc_timings.py", "test_site.py",
                   "test_doctests.py", "test_imports.py"}
#: tests/companion/notebooks/ mirrors the notebooks/ folder, which the companion runs
NOT_A_PACKAGE = {("companion", "notebooks"): ROOT / "notebooks"}


def _test_files() -> list[Path]:
    return sorted(TESTS.rglob("test_*.py"))


def test_every_test_folder_is_a_package():
    missing = sorted({str(d.relative_to(ROOT)) for f in _test_files()
                      for d in (f.parent, *f.parent.parents)
                      if d.is_relative_to(TESTS) and not (d / "__init__.py").is_file()})
    assert not missing, ("these test folders lack an __init__.py (pytest would put them on sys.path "
                         "and files of the same name would collide): " + ", ".join(missing))


def test_test_files_sit_in_the_folder_of_the_code_they_check():
    bad = []
    for f in _test_files():
        parts = f.parent.relative_to(TESTS).parts
        if not parts:
            if f.name not in REPOSITORY_WIDE:
                bad.append(f"{f.relative_to(ROOT)}: only repository-wide checks sit directly in tests/; "
                           f"move it to tests/hideseek/…, tests/companion/… or tests/benchmarks/…")
        elif parts in NOT_A_PACKAGE:
            if not NOT_A_PACKAGE[parts].is_dir():
                bad.append(f"{f.relative_to(ROOT)}: {NOT_A_PACKAGE[parts].relative_to(ROOT)}/ does not exist")
        elif not (ROOT.joinpath(*parts) / "__init__.py").is_file():
            bad.append(f"{f.relative_to(ROOT)}: no package {'/'.join(parts)}/ for tests/{'/'.join(parts)}/ "
                       f"to mirror")
    assert not bad, "\n  ".join(["test files outside the mirrored layout:", *bad])


def test_the_packages_are_not_shadowed_by_their_test_folders():
    for module in (hideseek, companion, benchmarks):
        path = Path(module.__file__).resolve()
        assert not path.is_relative_to(TESTS), f"`import {module.__name__}` found {path}, a test folder"


# companion.params.load_yaml (the companion's, the site's and the tests' one YAML reader) parses with libyaml where
# PyYAML has it: it must give yaml.safe_load's objects for every YAML file of the repository (params.yaml, dvc.yaml,
# dvc.lock, ...)
def test_load_yaml_parses_every_yaml_file_as_safe_load():
    from companion.params import load_yaml
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "*.yaml", "*.yml", "*.lock"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split()
    assert {"params.yaml", "dvc.yaml", "dvc.lock"} <= set(files)
    for f in files:
        text = (ROOT / f).read_text()
        try:
            pure = yaml.load(text, Loader=yaml.SafeLoader)
        except yaml.YAMLError:          # not plain YAML (a tagged config): nothing the tests parse with safe_load
            continue
        assert repr(load_yaml(text)) == repr(pure), f


def test_one_yaml_reader():
    """Every YAML read of the companion, the site and the tests goes through companion.params.load_yaml."""
    import re

    files = [*ROOT.glob("companion/**/*.py"), ROOT / "docs" / "gen_site.py", *ROOT.glob("tests/**/*.py"),
             *ROOT.glob("benchmarks/**/*.py")]
    pattern = re.compile(r"yaml\.(safe_load|load|full_load|unsafe_load)\(")
    here = Path(__file__).resolve()
    bad = [str(f.relative_to(ROOT)) for f in files
           if f.resolve() not in (here, ROOT / "companion" / "params.py") and pattern.search(f.read_text())]
    assert not bad, f"read YAML with companion.params.load_yaml, not yaml.*load: {bad}"
