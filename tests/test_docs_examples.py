"""Every code block of the README and the docs runs as written, on a CPU.

The Python blocks are found by pytest-examples (``find_examples``); the bash blocks, which it
does not collect, by markdown-it's CommonMark parser, which also checks that pytest-examples saw
every Python block. What a block's first line says decides how it runs:

- no marker (Python): in this process, through pytest-examples' ``EvalExample.run``, in a
  temporary working directory;
- ``# Run: distamp launch --nproc-per-node N FILE.py`` or ``# Run: python FILE.py``: the block is
  written to ``FILE.py`` in a temporary directory and that command runs it in a subprocess, with
  a timeout;
- ``# GPU only. Run: ...``: the same, where CUDA is available; skipped elsewhere;
- no marker (bash): ``bash -euo pipefail`` in a temporary directory that links the checkout's
  folders (``launch/``, ``benchmarks/``, ...), so outputs land there;
- ``# Not run by the tests: REASON.``: never run, for one of the REASONS below; the set stays
  small (at most MAX_NOT_RUN blocks).

The README's Quick start blocks carry no marker (CI reads them verbatim): ``.ci/run`` runs them
itself, so they are the one listed exception here.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

pytest.importorskip("pytest_examples", reason="the docs tools come with the dev extra")
from markdown_it import MarkdownIt
from pytest_examples import CodeExample, EvalExample, find_examples

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
REASONS = (
    "installs packages",
    "needs Docker",
    "needs a SLURM cluster",
    "needs several machines",
    "it is the test suite (minutes)",
)
MAX_NOT_RUN = 8  # 7 today: keep it small
LANGUAGES = {"python", "bash", "text"}
TIMEOUT_S = 240  # one launched block; a 2-rank block takes 5-20 s on 2 idle cores

_RUN = re.compile(
    r"^# (?:GPU only\. )?Run: (distamp launch --nproc-per-node \d+|python) (\w+\.py)$"
)
_NOT_RUN = re.compile(r"^# Not run by the tests: (.+)\.$")


@dataclass(frozen=True)
class Block:
    """One fenced block: where it is, its language and its text."""

    page: Path
    line: int  # 1-based line of the opening fence
    language: str
    source: str

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def first_line(self) -> str:
        return self.source.split("\n", 1)[0].strip()


def _fences(page: Path) -> Iterator[Block]:
    """Every code block of a page; an indented one has language ``"indented"``, which the
    checks below refuse (it would escape them)."""
    for token in MarkdownIt("commonmark").parse(page.read_text(encoding="utf-8")):
        if token.type in ("fence", "code_block") and token.map is not None:
            language = token.info.split(maxsplit=1)[0] if token.info.strip() else ""
            if token.type == "code_block":
                language = "indented"
            yield Block(page, token.map[0] + 1, language, token.content)


BLOCKS = [block for page in PAGES for block in _fences(page)]


def _quick_start_blocks() -> set[str]:
    """The README Quick start's first two bash blocks, which .ci/run runs verbatim."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Quick start\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"```bash\n(.*?)```", section, re.S)[:2])


CI_BLOCKS = _quick_start_blocks()


def _unique(examples: list[CodeExample]) -> list[CodeExample]:
    """One example per distinct source: the README's examples reappear in the guides."""
    seen: dict[str, CodeExample] = {}
    for example in examples:
        seen.setdefault(example.source, example)
    return list(seen.values())


PYTHON = _unique([ex for page in PAGES for ex in find_examples(page)])
BASH = [b for b in BLOCKS if b.language == "bash" and b.source not in CI_BLOCKS]


def _id(example: CodeExample) -> str:
    return f"{example.path.relative_to(ROOT)}:{example.start_line}"


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """A scratch directory that sees the checkout's folders, so that ``launch/train.py``
    resolves while whatever a block writes lands in ``tmp_path``."""
    for entry in ("launch", "benchmarks", "multinode", "docker", "docs"):
        (tmp_path / entry).symlink_to(ROOT / entry)
    return tmp_path


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE"))}
    for key in ("LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "DISTAMP_LAUNCHER"):
        env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def _run(command: list[str], cwd: Path, what: str) -> None:
    try:
        done = subprocess.run(
            command, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=TIMEOUT_S
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{what}: still running after {TIMEOUT_S} s\n{exc.stdout}\n{exc.stderr}")
    assert done.returncode == 0, (
        f"{what}: exit {done.returncode}\n--- stdout\n{done.stdout[-4000:]}\n"
        f"--- stderr\n{done.stderr[-6000:]}"
    )


@pytest.fixture
def restore_process_state() -> Iterator[None]:
    """An in-process example must leave the interpreter as it found it: ``__main__`` (which
    pytest-examples replaces, and which spawned workers re-import), torch's threads and
    default dtype."""
    main, threads = sys.modules["__main__"], torch.get_num_threads()
    dtype = torch.get_default_dtype()
    yield
    sys.modules["__main__"] = main
    torch.set_num_threads(threads)
    torch.set_default_dtype(dtype)


@pytest.mark.parametrize("example", PYTHON, ids=_id)
def test_python_block_runs(
    example: CodeExample,
    eval_example: EvalExample,
    workdir: Path,
    monkeypatch: pytest.MonkeyPatch,
    restore_process_state: None,
) -> None:
    first = example.source.split("\n", 1)[0].strip()
    launched = _RUN.match(first)
    if first.startswith("# GPU only") and not torch.cuda.is_available():
        pytest.skip("a GPU-only example")
    if launched is None:
        assert not first.startswith("# Run"), f"{_id(example)}: unknown run line {first!r}"
        monkeypatch.chdir(workdir)
        eval_example.run(example)
        return
    command, file = launched.groups()
    (workdir / file).write_text(example.source, encoding="utf-8")
    argv = [sys.executable] if command == "python" else [sys.executable, "-m", "distamp.cli"]
    argv += [*command.split()[1:], file]
    _run(argv, workdir, _id(example))


@pytest.mark.parametrize("example", PYTHON, ids=_id)
def test_python_block_is_lint_clean(example: CodeExample, eval_example: EvalExample) -> None:
    """The examples follow the project's ruff rules (pyproject.toml) at its line length; only
    an unread loop counter (B007) and an unread unpacked name (RUF059) are let through, which a
    short example writes for the reader's sake."""
    eval_example.set_config(line_length=100, target_version="py310", ruff_ignore=["B007", "RUF059"])
    eval_example.lint_ruff(example)


@pytest.mark.parametrize(
    "block", [b for b in BASH if _NOT_RUN.match(b.first_line) is None], ids=lambda b: b.name
)
def test_bash_block_runs(block: Block, workdir: Path) -> None:
    """The blocks marked not run (checked below: a known reason, few) are not collected, so the
    suite's skips stay the GPU's alone."""
    _run(["bash", "-euo", "pipefail", "-c", block.source], workdir, block.name)


def test_every_block_is_runnable_or_says_why_not() -> None:
    """Known languages only, Python blocks all seen by pytest-examples, and the blocks that are
    not run are marked, for a known reason, and few."""
    unknown = [b.name for b in BLOCKS if b.language not in LANGUAGES]
    assert not unknown, f"fences need a language among {sorted(LANGUAGES)}: {unknown}"
    found = {(ex.path, ex.start_line) for page in PAGES for ex in find_examples(page)}
    python = {(b.page, b.line) for b in BLOCKS if b.language == "python"}
    assert python == found, f"blocks pytest-examples does not see: {python ^ found}"
    not_run = []
    for block in BLOCKS:
        if block.language == "python" and block.first_line.startswith("# Not run"):
            pytest.fail(f"{block.name}: every Python example runs (or is marked GPU only)")
        reason = _NOT_RUN.match(block.first_line)
        if block.language == "bash" and reason is not None:
            assert reason.group(1) in REASONS, f"{block.name}: reason {reason.group(1)!r}"
            not_run.append(block.name)
    assert len(not_run) <= MAX_NOT_RUN, f"{len(not_run)} blocks not run: {not_run}"
    assert len(CI_BLOCKS) == 2, "the README's Quick start keeps its two bash blocks"


def test_readme_links_resolve() -> None:
    """The README is not part of the site, so mkdocs' strict build does not check its links."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    for target in re.findall(r"\]\(([^)#]+?)(?:#[^)]*)?\)", readme):
        if "://" not in target:
            assert (ROOT / target).exists(), f"README links to a missing file: {target}"


@pytest.mark.parametrize(
    ("page", "heading", "prefix"),
    [
        ("docs/index.md", "## Where things are", "guides/"),
        ("README.md", "## Documentation", "docs/guides/"),
    ],
)
def test_every_guide_is_listed_where_the_guides_are_listed(
    page: str, heading: str, prefix: str
) -> None:
    """A newcomer finds the guides from these lists: a guide missing there is not found."""
    text = (ROOT / page).read_text(encoding="utf-8")
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    missing = [
        guide.name
        for guide in sorted((ROOT / "docs" / "guides").glob("*.md"))
        if f"]({prefix}{guide.name}" not in section
    ]
    assert not missing, f"{page} ({heading}) does not list {missing}"
