"""The layout: the files the README says to copy run one algorithm on their own, and the modules import each other
in one direction (no module imports a script, no circle)."""
import ast
import glob
import os
import re
import shutil
import subprocess
import sys

from conftest import ROOT

SCRIPTS = ["grpo", "gspo", "gspo_token", "dfpo"]


def readme_copy_list() -> list[str]:
    """The files of the README's `cp ... /path/to/project/` line."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    (line,) = re.findall(r"^cp (.+) /path/to/project/$", readme, re.M)
    return line.split()


def project_imports() -> dict[str, set[str]]:
    """module -> the project's modules it imports (at the top or inside a function)."""
    mods = {os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "*.py"))}
    graph = {}
    for m in mods:
        tree = ast.parse(open(os.path.join(ROOT, f"{m}.py")).read())
        names = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        graph[m] = names & mods
    return graph


def test_modules_import_in_one_direction():
    graph = project_imports()
    for m, deps in graph.items():
        if m not in SCRIPTS:
            assert not deps & set(SCRIPTS), f"{m}.py imports a script: {deps & set(SCRIPTS)}"
    done, path = set(), []

    def visit(m):  # depth-first: a module met again on the current path is a circle
        assert m not in path, f"import circle: {' -> '.join(path + [m])}"
        if m in done:
            return
        path.append(m)
        for d in sorted(graph[m]):
            visit(d)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)


def test_copy_list_covers_every_script_import():
    """What each script imports from the project, directly or through a module, is in the README's copy list, so
    copying those files with any one of the scripts in place of gspo.py works."""
    graph = project_imports()
    copied = {f[:-3] for f in readme_copy_list() if f.endswith(".py")}
    for script in SCRIPTS:
        need, todo = set(), [script]
        while todo:
            for d in graph[todo.pop()] - need:
                need.add(d)
                todo.append(d)
        assert need <= copied - {"gspo"}, (script, need - copied)


def test_the_copied_files_run_one_step_alone(tmp_path):
    files = readme_copy_list()
    assert "gspo.py" in files and "requirements.txt" in files
    dest = tmp_path / "project"
    dest.mkdir()
    for f in files:
        shutil.copy(os.path.join(ROOT, f), dest / f)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing from the repository on the path
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    out = subprocess.run([sys.executable, "gspo.py", "--num-steps", "1", "--prompts-per-rank", "4", "--eval-every",
                          "0", "--output-dir", "runs"], cwd=dest, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert glob.glob(str(dest / "runs" / "gspo__1__*" / "step_1" / "model" / "model.safetensors"))
    assert sorted(os.listdir(dest)) == sorted(files + ["runs"])  # nothing else was needed, nothing else written


def markdown_pages() -> list[str]:
    """The README and every page of docs/, as paths relative to the repository."""
    return ["README.md"] + sorted(os.path.join("docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
                                  if f.endswith(".md"))


def anchors(path: str) -> set[str]:
    """The anchors GitHub gives a page's headings: lower case, punctuation dropped, spaces as hyphens."""
    text = open(os.path.join(ROOT, path)).read()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # a '# comment' in a code block is no heading
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_every_relative_link_and_named_file_exists():
    """Every relative link of the README and docs/ reaches a file that exists (and a heading of it, when it names one),
    every file the README's copy line names exists, and every `tests/...`, `benchmarks/...`, `experiments/...`,
    `docs/...` or `tools/...` file a page names in code quotes exists: a page moved or renamed breaks this test, not
    a reader's click."""
    assert all(os.path.isfile(os.path.join(ROOT, f)) for f in readme_copy_list()), readme_copy_list()
    broken = []
    for page in markdown_pages():
        text = open(os.path.join(ROOT, page)).read()
        here = os.path.dirname(page)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):  # https://...
                continue
            path, _, anchor = target.partition("#")
            path = os.path.normpath(os.path.join(here, path)) if path else page
            if not os.path.exists(os.path.join(ROOT, path)):
                broken.append(f"{page}: {target} (no such file)")
            elif anchor and anchor not in anchors(path):
                broken.append(f"{page}: {target} (no such heading in {path})")
        for named in re.findall(r"`((?:tests|benchmarks|experiments|docs|tools)/[\w/.-]+\.(?:py|md|txt))`", text):
            if not os.path.isfile(os.path.join(ROOT, named)):
                broken.append(f"{page}: `{named}` (no such file)")
    assert not broken, "\n".join(broken)
    assert len(markdown_pages()) > 2


def test_every_docs_page_says_what_it_covers_and_the_readme_links_it():
    readme = open(os.path.join(ROOT, "README.md")).read()
    for page in markdown_pages()[1:]:
        lines = open(os.path.join(ROOT, page)).read().split("\n")
        assert lines[0].startswith("# ") and lines[1] == "" and lines[2], f"{page}: a title, then what it covers"
        assert f"]({page})" in readme, f"the README does not link {page}"


def test_no_benchmark_shadows_a_module():
    """benchmarks/gpu.py puts benchmarks/ first on sys.path: a benchmark named like a module of the project (as
    benchmarks/sampling.py once was) would be imported in its place by every later test of the session."""
    import glob

    modules = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "*.py"))}
    benches = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "benchmarks", "*.py"))}
    assert not modules & benches
