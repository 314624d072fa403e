"""The layout: the scripts and common.py at the root, every subsystem in the grouprl package; the files and the
folder the README says to copy run one algorithm on their own, and the modules import each other in one direction
(no module imports a script, the package never imports common.py, no circle)."""
import ast
import difflib
import glob
import json
import os
import re
import shutil
import subprocess
import sys

from conftest import ROOT, SCRIPTS

PACKAGE = "grouprl"


def readme_copy_list() -> list[str]:
    """The files and folders of the README's `cp -r ... /path/to/project/` line."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    (line,) = re.findall(r"^cp -r (.+) /path/to/project/$", readme, re.M)
    return line.split()


def project_modules() -> dict[str, str]:
    """module name as imported ('gspo', 'common', 'grouprl.cli', 'grouprl.engine.blocks') -> its file."""
    files = glob.glob(os.path.join(ROOT, "*.py")) + glob.glob(os.path.join(ROOT, PACKAGE, "**", "*.py"),
                                                              recursive=True)
    mods = {}
    for f in files:
        rel = os.path.relpath(f, ROOT)[: -len(".py")].replace(os.sep, ".")
        mods[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = f
    return mods


def project_imports() -> dict[str, set[str]]:
    """module -> the project's modules it imports (at the top or inside a function): `from grouprl import x`
    and `from . import x` name grouprl.x, `from .x import f` names grouprl.x, `from ..x import f` one package up."""
    mods = project_modules()
    graph = {}
    for m, f in mods.items():
        here = m if f.endswith("__init__.py") else m.rpartition(".")[0]  # the package a relative import starts at
        names = set()
        for node in ast.walk(ast.parse(open(f).read())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here.split(".")[: len(here.split(".")) - node.level + 1]) if node.level else ""
                base = ".".join(p for p in (base, node.module) if p)
                if node.module or not node.level:  # `from . import x` imports x, not the package
                    names.add(base)
                names |= {f"{base}.{a.name}" for a in node.names}
        graph[m] = (names & set(mods)) - {m}
    return graph


def library_files() -> list[str]:
    """Every file of the package, its folders' included."""
    return sorted(glob.glob(os.path.join(ROOT, PACKAGE, "**", "*.py"), recursive=True))


def test_common_is_the_step_and_no_file_is_too_big_to_hold():
    """common.py holds the step only (~550 lines at most); no file of the package a reader must hold whole is over
    ~600 lines, and the parts of a subsystem split into a folder (checkpoint/, engine/, ...) ~400 (450 at most)."""
    assert len(open(os.path.join(ROOT, "common.py")).read().splitlines()) <= 550
    for path in library_files():
        n = len(open(path).read().splitlines())
        folder = os.path.dirname(path) != os.path.join(ROOT, PACKAGE)
        assert n <= (450 if folder else 600), (os.path.relpath(path, ROOT), n)


def test_no_dict_read_of_a_rollout_and_no_long_parameter_list():
    """The Rollout is a dataclass everywhere (no roll["..."] in the library), and no library function takes more
    than ~8 parameters (9 at most): keywords that travel together go as one object (Sampling, Evaluation, the
    engine's Setup). The loss functions, whose explicit tensors are the point, live in the scripts."""
    for path in [os.path.join(ROOT, "common.py")] + library_files():
        src = open(path).read()
        assert not re.search(r"\broll\[\"", src), path
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                a = node.args
                names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs if x.arg not in ("self", "cls", "ctx")]
                assert len(names) <= 9, (os.path.relpath(path, ROOT), node.name, names)


def test_tests_import_their_helpers_from_one_module():
    """Shared test code lives in tests/helpers.py (and conftest); no test file imports another, and the programs
    the tests start lie in tests/programs/, the stubs in tests/blocked/."""
    for path in glob.glob(os.path.join(ROOT, "tests", "*.py")):
        assert not re.search(r"^\s*(from|import) test_", open(path).read(), re.M), path
    flat = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "tests", "*.py"))}
    assert all(f.startswith("test_") or f in ("conftest.py", "helpers.py") for f in flat), flat


def test_the_root_holds_the_scripts_and_common_only():
    assert sorted(glob.glob("*.py", root_dir=ROOT)) == sorted([f"{s}.py" for s in SCRIPTS] + ["common.py"])
    assert os.path.isfile(os.path.join(ROOT, PACKAGE, "__init__.py"))


def test_modules_import_in_one_direction():
    graph = project_imports()
    assert graph["gspo"] >= {"common", f"{PACKAGE}.cli", f"{PACKAGE}.checkpoint"}, graph["gspo"]  # the reader sees it
    assert graph[f"{PACKAGE}.grader.loading"] >= {f"{PACKAGE}.reward_worker", f"{PACKAGE}.distributed"}, graph[
        "grouprl.grader.loading"]
    for m, deps in graph.items():
        if m not in SCRIPTS:
            assert not deps & set(SCRIPTS), f"{m} imports a script: {deps & set(SCRIPTS)}"
        if m.startswith(PACKAGE):
            assert "common" not in deps, f"{m} imports common.py: the package sits below the scripts' map"
    assert graph[f"{PACKAGE}.reward_worker"] == set(), "the worker is started by file path: it imports nothing of ours"
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
    copied = readme_copy_list()
    assert copied == ["gspo.py", "common.py", PACKAGE, "requirements.txt"], copied
    for script in SCRIPTS:
        need, todo = set(), [script]
        while todo:
            for d in graph[todo.pop()] - need:
                need.add(d)
                todo.append(d)
        assert all(d == "common" or d.split(".")[0] == PACKAGE for d in need), (script, need)


def test_the_copied_files_run_two_steps_alone(tmp_path):
    """The README's copy line into an empty folder, then two steps there with nothing of the repository on the path
    (and a reward worker started from the copied package: --reward runs through it)."""
    files = readme_copy_list()
    dest = tmp_path / "project"
    dest.mkdir()
    for f in files:
        src = os.path.join(ROOT, f)
        if os.path.isdir(src):
            shutil.copytree(src, dest / f, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(src, dest / f)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # nothing from the repository on the path
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    out = subprocess.run([sys.executable, "gspo.py", "--num-steps", "2", "--prompts-per-rank", "4", "--eval-every",
                          "0", "--reward", "common:math_reward", "--output-dir", "runs"], cwd=dest, env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    (run,) = glob.glob(str(dest / "runs" / "gspo__1__*"))
    assert [json.loads(line)["step"] for line in open(os.path.join(run, "metrics.jsonl"))] == [1, 2]
    assert os.path.isfile(os.path.join(run, "step_2", "model", "model.safetensors"))
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
    assert all(os.path.exists(os.path.join(ROOT, f)) for f in readme_copy_list()), readme_copy_list()
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
        for named in re.findall(r"`((?:tests|benchmarks|experiments|docs|tools|grouprl)/[\w/.-]+\.(?:py|md|txt))`", text):
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
    """benchmarks/gpu.py puts benchmarks/ first on sys.path: a benchmark named like a root module or the package (as
    benchmarks/sampling.py once was) would be imported in its place by every later test of the session."""
    modules = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "*.py"))} | {f"{PACKAGE}.py"}
    benches = {os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "benchmarks", "*"))}
    assert not modules & benches and PACKAGE not in benches


def main_and_loop(script: str) -> tuple[list[str], list[str]]:
    """A script's main() (from `def main():` to the `if __name__` guard) and its step loop (`for step in bar:`
    to the first line back at main's own indent)."""
    lines = open(os.path.join(ROOT, f"{script}.py")).read().split("\n")
    start, end = lines.index("def main():"), lines.index('if __name__ == "__main__":')
    main = [line for line in lines[start:end]]
    while main and not main[-1].strip():
        main.pop()
    first = main.index("    for step in bar:")
    last = next(i for i in range(first + 1, len(main)) if main[i].strip() and not main[i].startswith("     "))
    return main, main[first:last]


def test_the_loop_reads_in_one_sitting():
    """main() in at most ~170 lines, its step loop in at most 100, and each script's loop differs from gspo.py's in at
    most 30 lines: the objective, its flags and its stats, the rest folded into named calls (common.Updates,
    rollout_log, policy_log_probs ...)."""
    _, gspo_loop = main_and_loop("gspo")
    for script in SCRIPTS:
        main, loop = main_and_loop(script)
        assert len(main) <= 170 and len(loop) <= 100, (script, len(main), len(loop))
        changed = [d for d in difflib.ndiff(gspo_loop, loop) if d[:2] in ("+ ", "- ")]
        assert len(changed) <= 30, (script, len(changed), changed)


def test_the_readme_is_a_front_door_and_the_library_holds_no_dated_measurement():
    """The README in at most 200 lines (the measurements' narrative is docs/results.md); common.py and the package
    carry no dated measurement in a comment or docstring (those go to benchmarks/ and docs/)."""
    assert len(open(os.path.join(ROOT, "README.md")).read().split("\n")) <= 200
    for path in [os.path.join(ROOT, "common.py")] + library_files():
        dated = re.findall(r".*\b20\d\d-\d\d-\d\d.*", open(path).read())
        assert not dated, (path, dated)


LOSS_COPIES = {  # the README's one-function copy: each loss with the helpers it names
    "gspo": ["gspo_loss"],
    "grpo": ["grpo_loss", "aggregate"],
    "gspo_token": ["gspo_token_loss", "aggregate"],
    "cispo": ["cispo_loss", "aggregate"],
    "sapo": ["sapo_loss", "aggregate"],
    "gmpo": ["gmpo_loss"],
    "vespo": ["vespo_loss", "aggregate"],
    "dfpo": ["dfpo_loss", "sequence_weights", "group_weights", "in_group_transform", "orth_proj_qp"],
}


def test_each_loss_function_copies_alone(tmp_path):
    """Each loss function, with the helpers the README names beside it, copied out of its script into a file that
    imports torch and nothing else, runs and back-propagates: the one-function copy the README promises."""
    import importlib.util

    import torch

    assert set(LOSS_COPIES) == set(SCRIPTS)
    g = torch.Generator().manual_seed(0)
    B, T = 8, 5
    for script, names in LOSS_COPIES.items():
        src = open(os.path.join(ROOT, f"{script}.py")).read()
        funcs = {n.name: n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef)}
        path = tmp_path / f"copied_{script}.py"
        path.write_text("import torch\n\n\n" + "\n\n\n".join(
            "".join(f"@{ast.get_source_segment(src, d)}\n" for d in funcs[n].decorator_list)
            + ast.get_source_segment(src, funcs[n]) for n in names) + "\n")
        spec = importlib.util.spec_from_file_location(f"copied_{script}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        logp = (-torch.rand(B, T, generator=g) * 2).requires_grad_(True)
        old = logp.detach() + 0.1 * torch.randn(B, T, generator=g)
        mask = (torch.arange(T)[None] < torch.randint(1, T + 1, (B,), generator=g)[:, None]).float()
        adv = torch.randn(B, T, generator=g) * mask if script == "gspo_token" else torch.randn(B, generator=g)
        kw = {"sapo": dict(tau_pos=1.0, tau_neg=1.05),
              "vespo": dict(k_pos=2.0, lambda_pos=3.0, k_neg=3.0, lambda_neg=2.0)}.get(
            script, dict(clip_low=0.2, clip_high=0.28))
        if script == "dfpo":
            kw["group_size"] = 4
        loss, terms, stats = getattr(mod, names[0])(logp, old, adv, mask, **kw)
        loss.backward()
        assert torch.isfinite(loss) and logp.grad.abs().sum() > 0, script
        assert terms.shape == (B,) and all(k.startswith("losses/") for k in stats), script
