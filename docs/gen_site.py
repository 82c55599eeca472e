"""The documentation site's source tree, laid out at build time (a mkdocs hook: mkdocs.yml ``hooks``).

``make docs`` runs ``mkdocs build``; before mkdocs reads its pages, :func:`on_config` calls
:func:`generate`, which writes ``build/site_src/`` (``docs_dir`` in mkdocs.yml) from committed
files only, running no pipeline stage and writing nothing outside ``build/``:

* the library's pages: ``docs/**/*.md`` and ``docs/assets/`` as they are;
* the companion: the answer first (``companion/index.md``: the paired Δτ figure and Table 1), every
  executed notebook of ``reports/notebooks/``, every figure of ``reports/figures/`` with its
  provenance under it (the DVC stage whose ``outs`` hold it, the parameters it ran with from
  ``dvc.lock``, the notebook and the cell that saved it, the commit that last wrote it and the
  library commit it was made with — each a link into the site), the pre-registrations, the pilots,
  the budget (``reports/repro_times.md``) and two pages the links point at: the pipeline (each
  stage's command, outputs and locked parameters) and the commits.

The companion's part of the navigation is built here too (it follows the files present).
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from companion.params import load_yaml

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "build" / "site_src"
#: the companion's first page shows this figure and Table 1 before anything else
ANSWER_FIGURE = "reports/figures/paired/paired_delta_tau.png"
TABLE1 = "reports/table1.md"
BUDGET = "reports/repro_times.md"


@dataclass
class Provenance:
    """Where one figure of ``reports/figures/`` comes from."""
    figure: str                       # repository path of the PNG
    stage: str                        # the dvc.yaml stage whose outs hold it
    cmd: str
    params: dict                      # the stage's parameters as locked in dvc.lock
    notebook: str | None              # repository path of the executed notebook (stage outs)
    cell: int | None                  # index of the code cell that saves it, among the code cells
    cell_source: str | None
    commit: str | None                # the last commit that changed the figure
    library_commit: str | None        # the last commit at or before it that changed hideseek/
    commits: dict = field(default_factory=dict)


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


def _outs(stage: dict) -> list[str]:
    return [next(iter(o)) if isinstance(o, dict) else o for o in stage.get("outs", [])]


def _stage_of(path: str, stages: dict) -> str:
    for name, stage in stages.items():
        for out in _outs(stage):
            if path == out or path.startswith(out.rstrip("/") + "/"):
                return name
    raise SystemExit(f"docs: {path} is in no dvc.yaml stage's outs")


def saving_cell(notebook: dict, stem: str) -> tuple[int, str] | tuple[None, None]:
    """The code cell that saves the figure ``stem``: the first code cell whose source names it
    and calls ``savefig``, else the first code cell that names it in quotes. Returns its index
    among the notebook's code cells and its source."""
    code = [("".join(c.get("source", ""))) for c in notebook.get("cells", []) if c.get("cell_type") == "code"]
    quoted = re.compile(rf"""["']{re.escape(stem)}(\.png|\.\{{ext\}}|\.pdf)?["']|f["']{re.escape(stem)}\.""")
    for pick in (lambda s: stem in s and "savefig" in s, lambda s: bool(quoted.search(s))):
        for i, src in enumerate(code):
            if pick(src):
                return i, src
    return None, None


def _pipeline(root: Path) -> tuple[dict, dict]:
    """``dvc.yaml``'s stages and ``dvc.lock``'s stages, parsed."""
    stages = load_yaml((root / "dvc.yaml").read_text())["stages"]
    lock = load_yaml((root / "dvc.lock").read_text()).get("stages", {})
    return stages, lock


def provenance(root: Path, figure: str, pipeline: tuple[dict, dict] | None = None) -> Provenance:
    """``pipeline``: :func:`_pipeline` of ``root`` when the caller parsed it already."""
    stages, lock = pipeline if pipeline is not None else _pipeline(root)
    stage = _stage_of(figure, stages)
    params = lock.get(stage, {}).get("params", {}).get("params.yaml", {})
    notebooks = [o for o in _outs(stages[stage]) if o.endswith(".ipynb")]
    nb = notebooks[0] if notebooks and (root / notebooks[0]).is_file() else None
    cell = src = None
    if nb:
        cell, src = saving_cell(json.loads((root / nb).read_text(encoding="utf-8")), Path(figure).stem)
    commit = _git(root, "log", "-1", "--format=%H", "--", figure)
    library = _git(root, "log", "-1", "--format=%H", commit, "--", "hideseek") if commit else None
    return Provenance(figure, stage, stages[stage]["cmd"], params, nb, cell, src, commit, library)


def cli_help() -> str:
    """``hideseek --help`` and each command's ``--help``, as fenced blocks."""
    import argparse

    from hideseek import cli

    parser = cli._parser()
    blocks = [("hideseek --help", parser.format_help())]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            blocks += [(f"hideseek {name} --help", sub.format_help()) for name, sub in action.choices.items()]
    return "\n".join(f"```text\n$ {cmd}\n{text.rstrip()}\n```\n" for cmd, text in blocks)


# --- page writers ------------------------------------------------------------------------------

def _title(md: Path) -> str:
    for line in md.read_text(encoding="utf-8").splitlines():
        if line.startswith("# "):
            return line[2:].strip()
    return md.stem


def _nb_title(nb: Path) -> str:
    for cell in json.loads(nb.read_text(encoding="utf-8")).get("cells", []):
        if cell.get("cell_type") == "markdown":
            for line in "".join(cell["source"]).splitlines():
                if line.startswith("# "):
                    return line[2:].replace("`", "").strip()
    return nb.stem


def _site_figure(figure: str) -> str:
    """Site path (under companion/) of a figure of reports/figures/."""
    return "figures/" + figure.removeprefix("reports/figures/")


def _commit_link(sha: str | None, up: str) -> str:
    if not sha:
        return "unknown (no git history in this checkout)"
    return f"[`{sha[:10]}`]({up}commits.md#commit-{sha[:10]})"


def provenance_block(p: Provenance, up: str) -> str:
    """Markdown under a figure; ``up`` leads from the page to companion/ (``""`` or ``"../"``)."""
    nb_page = f"{up}notebooks/{Path(p.notebook).name}" if p.notebook else None
    if nb_page and p.cell is not None:
        cell = f"[{Path(p.notebook).stem}, code cell {p.cell + 1}]({nb_page}#cell-{p.cell + 1})"
    elif nb_page:
        cell = f"[{Path(p.notebook).stem}]({nb_page}) (no cell names the file; written by code it calls)"
    else:
        cell = "none: the stage runs no notebook"
    lines = [
        f'<div class="provenance" markdown>',
        f"**Provenance** of `{p.figure}` — "
        f"stage [`{p.stage}`]({up}pipeline.md#stage-{p.stage}) (`{p.cmd}`) · "
        f"notebook {cell} · written in commit {_commit_link(p.commit, up)} · "
        f"library (`hideseek/`) at commit {_commit_link(p.library_commit, up)} · "
        f"parameters below and in [the locked stage]({up}pipeline.md#stage-{p.stage}).",
        "",
        f'??? info "parameters of `{p.stage}` (dvc.lock)"',
        "    ```yaml",
        *["    " + ln for ln in (yaml.safe_dump(p.params, sort_keys=True, allow_unicode=True).rstrip()
                                or "{}").splitlines()],
        "    ```",
        "</div>",
        "",
    ]
    return "\n".join(lines)


def _plain(text: str) -> str:
    """``text`` shown as it is: HTML escaped, Markdown's and arithmatex's special characters too."""
    return re.sub(r"([\\`*_{}\[\]()#+!|$<>&-])", lambda m: "&#%d;" % ord(m.group(1)), text)


def _demote(md: str) -> str:
    """Drop the first H1 and move every other heading one level down."""
    out, dropped = [], False
    for line in md.splitlines():
        if line.startswith("# ") and not dropped:
            dropped = True
            continue
        out.append("#" + line if re.match(r"#{1,5} ", line) else line)
    return "\n".join(out)


def generate(root: Path = ROOT, out: Path = SRC) -> list:
    """Write the site's source tree under ``out``; return the companion's navigation."""
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    docs = root / "docs"
    for f in sorted(docs.rglob("*")):
        rel = f.relative_to(docs)
        if f.is_file() and rel.parts[0] not in ("screenshots",) and f.suffix != ".py":
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, out / rel)

    cli = out / "reference" / "cli.md"
    if cli.is_file():
        cli.write_text(cli.read_text(encoding="utf-8").replace("<!-- cli-help -->", cli_help()), encoding="utf-8")

    comp = out / "companion"
    figures = sorted(p.relative_to(root).as_posix() for p in (root / "reports" / "figures").rglob("*.png"))
    pipeline = _pipeline(root)   # parsed once for every figure and the pipeline page
    provs = {f: provenance(root, f, pipeline) for f in figures}
    for f in figures:
        dst = comp / _site_figure(f)
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / f, dst)

    nav: list = [{"The answer first": "companion/index.md"}]
    # notebooks
    nb_nav = []
    (comp / "notebooks").mkdir(parents=True, exist_ok=True)
    for nb in sorted((root / "reports" / "notebooks").glob("*.ipynb")):
        shutil.copy2(nb, comp / "notebooks" / nb.name)
        nb_nav.append({f"{nb.stem}: {_nb_title(nb)}": f"companion/notebooks/{nb.name}"})
    nav.append({"Notebooks": nb_nav})

    # figures with provenance, one page per stage
    by_stage: dict[str, list[Provenance]] = {}
    for p in provs.values():
        by_stage.setdefault(p.stage, []).append(p)
    fig_nav = ["companion/figures/index.md"]
    index = ["# Figures and their provenance", "",
             "Every figure of `reports/figures/`, by the pipeline stage that writes it. Under each: the "
             "stage, the parameters it ran with (`dvc.lock`), the notebook and the cell that saved it, "
             "the commit that last wrote it and the library commit it was made with.", ""]
    for stage, ps in sorted(by_stage.items()):
        page = [f"# Figures of the stage `{stage}`", ""]
        for p in ps:
            name = Path(p.figure).name
            page += [f"## {Path(p.figure).stem}", "", f"![{p.figure}]({stage}/{name})", "",
                     provenance_block(p, "../")]
        (comp / "figures" / f"{stage}.md").write_text("\n".join(page), encoding="utf-8")
        fig_nav.append({stage: f"companion/figures/{stage}.md"})
        index.append(f"* [`{stage}`]({stage}.md): " + ", ".join(f"`{Path(p.figure).name}`" for p in ps))
    (comp / "figures" / "index.md").write_text("\n".join(index) + "\n", encoding="utf-8")
    nav.append({"Figures and provenance": fig_nav})

    # pre-registrations, pilots
    for kind, title, blurb in (
            ("preregistration", "Pre-registrations",
             "Rules, radii, criteria and primary tests, each committed before any value it governs was computed."),
            ("pilots", "Pilots",
             "Pilot runs on members outside the zoos, which fixed radii, protocols and member counts.")):
        sub = [f"companion/{kind}/index.md"]
        lines = [f"# {title}", "", blurb, ""]
        for md in sorted((root / "reports" / kind).glob("*.md")):
            (comp / kind).mkdir(parents=True, exist_ok=True)
            shutil.copy2(md, comp / kind / md.name)
            sub.append({md.stem: f"companion/{kind}/{md.name}"})
            lines.append(f"* [{_title(md)}]({md.name})")
        (comp / kind / "index.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
        nav.append({title: sub})

    shutil.copy2(root / BUDGET, comp / "budget.md")
    nav.append({"Budget": "companion/budget.md"})
    nav.append({"Profiles and parameters": "profiles.md"})
    _pipeline_page(pipeline, comp / "pipeline.md")
    nav.append({"Pipeline": "companion/pipeline.md"})
    _commits_page(root, provs.values(), comp / "commits.md")
    nav.append({"Commits": "companion/commits.md"})
    _index_page(root, provs, nb_nav, comp / "index.md")
    return nav


def _index_page(root: Path, provs: dict, nb_nav: list, path: Path) -> None:
    answer = provs[ANSWER_FIGURE]
    table1 = _demote((root / TABLE1).read_text(encoding="utf-8"))
    lines = [
        "# The paper companion: the answer first", "",
        "The paper's claim, tested on this repository's zoos: does geodesic sharpness track "
        "generalisation more strongly than adaptive sharpness? The paired difference Δτ per "
        "transformer row (pre-registered primary test: [delta_tau](preregistration/delta_tau.md)), "
        "then Table 1. Everything below is read from committed results; nothing on this site is computed "
        "when it is built.", "",
        f"![the paired Δτ per transformer row]({_site_figure(ANSWER_FIGURE)}){{ #answer-figure }}", "",
        provenance_block(answer, ""),
        '<div id="table1" markdown>', "", "## Table 1", "", table1, "", "</div>", "",
        "## Read further", "",
        "* The executed notebooks: " + ", ".join(
            f"[{Path(next(iter(e.values()))).stem}](notebooks/{Path(next(iter(e.values()))).name})" for e in nb_nav),
        "* [Every figure with its provenance](figures/index.md)",
        "* [Pre-registrations](preregistration/index.md) and [pilots](pilots/index.md)",
        "* [The budget: a timed fresh-clone `make repro`](budget.md)",
        "* [The pipeline: each stage's command and locked parameters](pipeline.md)",
        "* [Profiles, changing a parameter, and notes on each row of Table 1](../profiles.md)", "",
    ]
    path.write_text("\n".join(lines), encoding="utf-8")


def _pipeline_page(pipeline: tuple[dict, dict], path: Path) -> None:
    stages, lock = pipeline
    lines = ["# The pipeline", "",
             "Each stage of `dvc.yaml`: its command, what it writes and the parameters `dvc.lock` "
             "records for its last run (`make repro` runs them all; `dvc repro <stage>` one).", ""]
    for name, stage in stages.items():
        params = lock.get(name, {}).get("params", {}).get("params.yaml")
        lines += [f"## `{name}` {{ #stage-{name} }}", "", f"Command: `{stage['cmd']}`", "",
                  "Writes: " + ", ".join(f"`{o}`" for o in _outs(stage)) if _outs(stage) else "Writes: nothing", ""]
        if params is None:
            lines += ["Not in `dvc.lock`: not run yet.", ""]
        else:
            lines += ["Locked parameters:", "", "```yaml",
                      yaml.safe_dump(params, sort_keys=True, allow_unicode=True).rstrip(), "```", ""]
    path.write_text("\n".join(lines), encoding="utf-8")


def _commits_page(root: Path, provs, path: Path) -> None:
    shas = sorted({s for p in provs for s in (p.commit, p.library_commit) if s})
    lines = ["# Commits", "", "The commits the figures' provenance names: the one that last wrote each "
             "figure, and the last one before it that changed the library (`hideseek/`).", ""]
    for sha in shas:
        info = _git(root, "show", "-s", "--format=%cI%n%s", sha) or "\n"
        date, _, subject = info.partition("\n")
        lines += [f"## `{sha[:10]}` {{ #commit-{sha[:10]} }}", "", f"`{sha}` · {date}", "", _plain(subject), ""]
    path.write_text("\n".join(lines), encoding="utf-8")


# --- mkdocs hook ---------------------------------------------------------------------------------

def on_config(config, **kwargs):
    """mkdocs hook: lay out the source tree, then append the companion's navigation."""
    nav = generate(ROOT, Path(config["docs_dir"]))
    config["nav"] = [e for e in (config["nav"] or []) if "Companion" not in e] + [{"Companion": nav}]
    return config


_MERMAID = re.compile(r'<script type="module">(?:(?!</script>).)*?mermaid(?:(?!</script>).)*</script>', re.S)


_HEADING_ID = re.compile(r'<h[1-6][^>]*\bid="([^"]+)"')


def on_page_content(html: str, page, config, files, **kwargs) -> str:
    """mkdocs hook: mkdocs-jupyter slugs a notebook's table of contents from its headings with
    inline code dropped (`` Stage `language`: not run `` -> ``stage-not-run``) while the page's
    headings keep it (``stage-language-not-run``); point each entry at its heading, in order."""
    if page.file.src_uri.endswith(".ipynb"):
        ids, at = _HEADING_ID.findall(html), 0
        stack = list(page.toc)[::-1]
        while stack and at < len(ids):
            item = stack.pop()
            if item.id in ids[at:]:
                at = ids.index(item.id, at) + 1
            else:
                item.id, at = ids[at], at + 1
            stack.extend(list(item.children)[::-1])
    return html


def on_post_page(output: str, page, config, **kwargs) -> str:
    """mkdocs hook: nbconvert's page template imports Mermaid from a CDN when a notebook has a
    Mermaid diagram; none of ours has one, so the script goes, and the site names no remote
    resource at all."""
    if page.file.src_uri.endswith(".ipynb") and 'class="mermaid"' not in output:
        output = _MERMAID.sub("", output)
    return output


if __name__ == "__main__":
    generate()
