"""The documentation stays true: README.md is a front page, its links and the manual's in docs/
resolve, the commands shown parse with dcpsim's own parser, and the scenarios shown load.

Pages: README.md, every docs/*.md and benchmarks/README.md.

* README.md has at most 300 lines.
* Every relative link (``[text](path#anchor)``, images too) reaches an existing file or folder,
  and every ``#anchor`` a heading of the target page, by GitHub's rules: the heading's text,
  lowercased, punctuation dropped (letters, digits, ``_``, ``-`` and spaces stay), spaces to
  ``-``, and ``-1``, ``-2`` ... after repeats. A page in ``FORTHCOMING`` (written by another
  change) may be missing; once it exists its links and anchors are checked like any other.
* Every command line of a ```bash block that runs dcpsim (``python -m dcpsim ...``,
  ``.venv/bin/python -m dcpsim ...``, ``torchrun ... -m dcpsim ...``, ``dcpsim ...``), and every
  ``$ python -m dcpsim ...`` line of an output block, parses with ``dcpsim.cli.build_parser()``.
  Lines are split as a shell does (``shlex``: quotes, ``\\`` continuations, ``#`` comments,
  ``&&``, ``||``, ``;`` and ``|`` between commands); redirections (``> file``) are dropped. The
  examples use real values: a word in capitals (``SCENARIO``, ``FILE``) left in a command is a
  placeholder and fails the test, and so does an abbreviated flag (``--inter`` for
  ``--interleave``), which argparse would accept.
* Every ```toml block of the pages under docs/ that is a complete scenario (a top-level ``name``)
  loads with ``load_scenario``; every other block (a fragment: one layer, one table) is valid TOML.
* Every dotted name in inline code that starts with ``dcpsim.`` (``dcpsim.engine.faults``,
  ``dcpsim.options.option``) is a module of the package or a name in one, and every file or folder
  of the repository named in inline code (``dcpsim/harness/``, ``tests/unit/test_docs.py``) exists:
  a rename that forgets a page fails here.

No gloo world starts here; the checks of the checks (a planted bad flag, link, anchor and
scenario) run on small pages written in a temporary folder.
"""

from __future__ import annotations

import functools
import importlib
import io
import re
import shlex
import tomllib
from contextlib import redirect_stderr
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
FORTHCOMING: set[Path] = set()
"""Pages another change writes; links to them are accepted while they do not exist."""
DOTTED = re.compile(r"`(dcpsim(?:\.[A-Za-z_]\w*)+)`")
REPO_PATH = re.compile(r"`((?:dcpsim|tests|benchmarks|docs|examples)/[\w./-]*)`")
MAX_README_LINES = 300

FENCE = re.compile(r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?(?P<target>[^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
INLINE_CODE = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
HEADING = re.compile(r"^#{1,6}[ \t]+(?P<title>.+?)[ \t#]*$", re.M)
OPERATORS = {"&&", "||", ";", "|", "&"}
REDIRECTS = {">", ">>", "<", ">&", "&>"}
PLACEHOLDER = re.compile(r"^[A-Z][A-Z0-9_]*(?:[./:][A-Z0-9_]+)*(?:\.\.\.)?$")


def rel(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def fences(text: str):
    """``(lang, body, line)`` of every fenced block, the body unindented by the fence's indent."""
    for m in FENCE.finditer(text):
        indent = len(m["indent"])
        body = "\n".join(line[indent:] if line[:indent].strip() == "" else line for line in m["body"].split("\n"))
        yield m["lang"].lower(), body, text.count("\n", 0, m.start()) + 2


def prose(text: str) -> str:
    """The text without fenced blocks and inline code (whose brackets are not links); line
    breaks are kept so that positions still count lines."""
    blank = lambda m: re.sub(r"[^\n]", " ", m.group(0))
    return INLINE_CODE.sub(blank, FENCE.sub(blank, text))


def slug(title: str) -> str:
    """GitHub's anchor of a heading's text."""
    title = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link's text
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


@functools.cache
def anchors(path: Path) -> frozenset[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in HEADING.finditer(prose_keep_headings(path.read_text())):
        base = slug(m["title"])
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def prose_keep_headings(text: str) -> str:
    """The text without fenced blocks (a ``#`` comment in a block is no heading)."""
    return FENCE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


def link_problems(page: Path) -> list[str]:
    text = page.read_text()
    problems = []
    for m in LINK.finditer(prose(text)):
        target = m["target"]
        where = f"{rel(page)}:{text.count(chr(10), 0, m.start()) + 1}: ({target})"
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            if dest not in FORTHCOMING:
                problems.append(f"{where}: no such file {rel(dest)}")
            continue
        if anchor:
            if dest.suffix != ".md" or dest.is_dir():
                problems.append(f"{where}: an anchor into {rel(dest)}, which is not a page")
            elif anchor not in anchors(dest):
                problems.append(f"{where}: {rel(dest)} has no heading #{anchor}")
    return problems


def command_lines(page: Path):
    """``(where, line)`` of every shell line of the page that may run dcpsim."""
    for lang, body, first in fences(page.read_text()):
        lines = body.replace("\\\n", " ").split("\n") if lang in ("bash", "sh", "shell") else []
        if lang not in ("bash", "sh", "shell"):  # an output block: only its $ prompts
            lines = [line[2:] if line.startswith("$ ") else "" for line in body.split("\n")]
        for k, line in enumerate(lines):
            if line.strip() and not line.lstrip().startswith("#"):
                yield f"{rel(page)}:{first + k}", line


def dcpsim_argvs(line: str) -> list[list[str]]:
    """The argument lists of every dcpsim invocation on one shell line."""
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    commands, words = [], []
    for token in lexer:
        if token in OPERATORS:
            commands.append(words)
            words = []
        else:
            words.append(token)
    commands.append(words)
    argvs = []
    for words in commands:
        kept, skip = [], False
        for w in words:
            if skip:
                skip = False
            elif w in REDIRECTS:
                skip = True
            else:
                kept.append(w)
        while kept and re.match(r"^\w+=", kept[0]):  # VAR=value before the command
            kept.pop(0)
        if kept and Path(kept[0]).name == "dcpsim":
            argvs.append(kept[1:])
            continue
        for i in range(len(kept) - 1):
            if kept[i] == "-m" and kept[i + 1] == "dcpsim":
                argvs.append(kept[i + 2 :])
                break
    return argvs


@functools.cache
def parser():
    """dcpsim's parser, taking whole flag names only: argparse would accept ``--inter`` for
    ``--interleave``, and a page should show the flag itself."""
    import argparse

    from dcpsim.cli import build_parser

    top = build_parser()
    todo = [top]
    while todo:
        p = todo.pop()
        p.allow_abbrev = False
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                todo.extend(action.choices.values())
    return top


def parse_problem(argv: list[str]) -> str:
    """Why dcpsim's parser refuses ``argv``, or ''."""
    placeholders = [w for w in argv if PLACEHOLDER.match(w) and len(w) > 1]
    if placeholders:
        return f"placeholder {placeholders} in dcpsim {shlex.join(argv)}: write a real value"
    err = io.StringIO()
    try:
        with redirect_stderr(err):
            parser().parse_args(argv)
    except SystemExit as exc:
        return f"dcpsim {shlex.join(argv)}: exit {exc.code}: {err.getvalue().strip().splitlines()[-1:]}"
    return ""


def commands_of(pages) -> list[tuple[str, list[str]]]:
    return [(where, argv) for page in pages for where, line in command_lines(page) for argv in dcpsim_argvs(line)]


def toml_blocks(page: Path):
    for lang, body, first in fences(page.read_text()):
        if lang == "toml":
            yield f"{rel(page)}:{first}", body


def toml_problem(where: str, body: str, tmp_path: Path) -> str:
    from dcpsim.errors import DcpsimError
    from dcpsim.scenarios.load import load_scenario

    try:
        data = tomllib.loads(body)
    except tomllib.TOMLDecodeError as exc:
        return f"{where}: not TOML: {exc}"
    if "name" not in data:
        return ""  # a fragment
    path = tmp_path / f"{data['name']}.toml"
    path.write_text(body)
    try:
        load_scenario(str(path))
    except DcpsimError as exc:
        return f"{where}: the scenario does not load: {exc}"
    return ""


# --- the pages -------------------------------------------------------------------------


def test_readme_is_a_front_page():
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; at most {MAX_README_LINES} (move text into docs/)"


def test_readme_links_every_page_of_the_manual():
    linked = {(README.parent / m["target"].partition("#")[0]).resolve() for m in LINK.finditer(prose(README.read_text()))}
    missing = [rel(p) for p in sorted((ROOT / "docs").glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"README.md links none of {missing}"


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_relative_link_and_anchor_resolves(page):
    problems = link_problems(page)
    assert not problems, "\n".join(problems)


def test_the_pages_show_commands_and_scenarios():
    """The checks below have something to check (a page that lost its fences would pass them)."""
    assert len(commands_of(PAGES)) >= 50
    assert sum(1 for p in PAGES if "docs" in p.parts for _ in toml_blocks(p)) >= 3


@pytest.mark.parametrize("where,argv", commands_of(PAGES), ids=[w for w, _ in commands_of(PAGES)])
def test_every_command_shown_parses(where, argv):
    problem = parse_problem(argv)
    assert not problem, f"{where}: {problem}"


def test_every_scenario_shown_in_docs_loads(tmp_path):
    blocks = [b for page in PAGES if "docs" in page.relative_to(ROOT).parts for b in toml_blocks(page)]
    complete = [w for w, body in blocks if "name" in tomllib.loads(body)]
    assert complete, "no complete scenario in docs/"
    problems = [p for where, body in blocks if (p := toml_problem(where, body, tmp_path))]
    assert not problems, "\n".join(problems)


def name_problem(dotted: str) -> str:
    """Why ``dotted`` (``dcpsim.x.y``, maybe ``dcpsim.x.Class.attr``) names nothing ("": it does)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return f"{dotted}: {'.'.join(parts[:cut])} has no {attr!r}"
            obj = getattr(obj, attr)
        return ""
    return f"{dotted}: no such module"


def named_problems(page: Path) -> list[str]:
    """Names and repository paths in ``page``'s inline code that do not exist."""
    text = page.read_text()
    problems = [f"{rel(page)}: {p}" for name in sorted(set(DOTTED.findall(text))) if (p := name_problem(name))]
    for path in sorted(set(REPO_PATH.findall(text))):
        target = ROOT / path.rstrip("/")
        if not target.exists() and not any(ch in path for ch in "*{"):
            problems.append(f"{rel(page)}: `{path}`: no such file or folder")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=rel)
def test_every_module_and_file_named_exists(page):
    problems = named_problems(page)
    assert not problems, "\n".join(problems)


# --- the checks catch what they are for -------------------------------------------------


def test_a_renamed_module_or_file_fails(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "`dcpsim.engine.faults` `dcpsim.options.option` `dcpsim.harness.job.Job.from_options` `tests/unit/`\n"
        "`dcpsim.campaigns.faults` `dcpsim.harness.job.Job.no_such` `dcpsim/harness/batch.py`\n"
    )
    problems = named_problems(page)
    assert len(problems) == 3, problems
    assert "dcpsim.campaigns.faults" in problems[0] and "no 'no_such'" in problems[1] and "batch.py" in problems[2]


def test_anchor_rules_are_githubs():
    assert slug("Disaggregated prefill/decode (P/D)") == "disaggregated-prefilldecode-pd"
    assert slug("Timelines (`--trace`)") == "timelines---trace"
    assert slug("Fault injection and `selftest`") == "fault-injection-and-selftest"
    assert slug("bench_matrix.py") == "bench_matrixpy"
    assert slug("8. Known bug classes (vLLM and forks), for fault injection") == "8-known-bug-classes-vllm-and-forks-for-fault-injection"


def test_a_flag_that_does_not_exist_fails(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(
        "```bash\n"
        "python -m dcpsim run dsv3 --dcp 4 --interleave 16   # fine\n"
        "python3 -m venv .venv && .venv/bin/python -m dcpsim run dsv3 --no-such-flag 3 > r.json\n"
        "torchrun --standalone --nproc-per-node 4 -m dcpsim worker dsv3 \\\n    --verify sometimes\n"
        "dcpsim matrix --shard 2/4 --junit out.xml\n"
        "python -m dcpsim run SCENARIO\n"
        "python -m dcpsim run dsv3 --inter 4\n"
        "```\n"
    )
    found = commands_of([page])
    assert [argv for _, argv in found] == [
        ["run", "dsv3", "--dcp", "4", "--interleave", "16"],
        ["run", "dsv3", "--no-such-flag", "3"],
        ["worker", "dsv3", "--verify", "sometimes"],
        ["matrix", "--shard", "2/4", "--junit", "out.xml"],
        ["run", "SCENARIO"],
        ["run", "dsv3", "--inter", "4"],
    ]
    verdicts = [parse_problem(argv) for _, argv in found]
    assert verdicts[0] == "" and verdicts[3] == ""
    assert "unrecognized arguments: --no-such-flag" in verdicts[1]
    assert "invalid choice: 'sometimes'" in verdicts[2]
    assert "placeholder ['SCENARIO']" in verdicts[4]
    assert "unrecognized arguments: --inter 4" in verdicts[5]


def test_a_broken_link_or_anchor_fails(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## Exit codes\n\n```bash\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[fine](other.md#exit-codes) [fine too](#a-heading) [web](https://example.com/x#y) `[code](nowhere.md)`\n"
        "[gone](missing.md) [no such heading](other.md#exit-code) [comment](other.md#not-a-heading)\n\n"
        "## A heading\n"
    )
    problems = link_problems(page)
    assert len(problems) == 3, problems
    assert "no such file" in problems[0] and "missing.md" in problems[0]
    assert "has no heading #exit-code" in problems[1] and "#not-a-heading" in problems[2]


def test_a_scenario_that_does_not_load_fails(tmp_path):
    (where, example), *_ = toml_blocks(ROOT / "docs" / "scenarios.md")
    assert "name" in tomllib.loads(example)
    assert toml_problem(where, example, tmp_path) == ""
    broken = example.replace("sliding_window = 64", "sliding_windw = 64")
    assert "sliding_windw: unknown field" in toml_problem(where, broken, tmp_path)
    assert "not TOML" in toml_problem(where, "[[layers]\nname = 1\n", tmp_path)
    assert toml_problem(where, '[[layers]]\nname = "x"\nkind = "mamba"\n', tmp_path) == ""  # a fragment


# --- the README's fault table -------------------------------------------------------------


def fault_rows(text: str) -> dict[str, list[str]]:
    """Fault name -> the report links of its row, for every table row whose first cell is a
    fault name in backquotes."""
    rows = {}
    for line in text.splitlines():
        m = re.match(r"\| `([\w-]+)` \| ([^|]*)\|", line)
        if m:
            rows[m.group(1)] = re.findall(r"\]\((https?://[^)]+)\)", m.group(2))
    return rows


def readme_fault_table(text: str) -> str:
    return text.partition("## Known DCP bugs the fault catalogue injects")[2].partition("\n## ")[0]


def fault_table_problems(readme_text: str, catalogue_text: str) -> str:
    """What is wrong with the README's fault table against the registry and docs/faults.md."""
    from dcpsim.engine.faults.registry import FAULTS, PD_FAULTS

    readme, catalogue = fault_rows(readme_fault_table(readme_text)), fault_rows(catalogue_text)
    names = {n for n in [*FAULTS, *PD_FAULTS] if n != "none"}
    if set(readme) != names:
        return f"README's fault table: missing {sorted(names - set(readme))}, unknown {sorted(set(readme) - names)}"
    differ = [n for n in sorted(names) if readme[n] != catalogue.get(n)]
    return f"README's reports differ from docs/faults.md for {differ}" if differ else ""


def test_readme_lists_every_fault_with_the_catalogues_reports():
    assert not fault_table_problems(README.read_text(), (ROOT / "docs" / "faults.md").read_text())


def test_a_fault_missing_from_the_readme_table_or_a_wrong_report_fails():
    readme, catalogue = README.read_text(), (ROOT / "docs" / "faults.md").read_text()
    dropped = "\n".join(line for line in readme.splitlines() if not line.startswith("| `topk-tie-order` |"))
    assert "missing ['topk-tie-order']" in fault_table_problems(dropped, catalogue)
    wrong = readme.replace("vllm-project/vllm/issues/46145", "vllm-project/vllm/issues/46146")
    assert "differ from docs/faults.md for ['topk-tie-order']" in fault_table_problems(wrong, catalogue)
