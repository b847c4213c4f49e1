"""The README and docs/ as a reader meets them: measured figures equal their results files, the
first command block is the two commands CI and a newcomer run, every local link lands on a file
and heading that exist, and the text speaks of the project alone."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").rglob("*.md"))]
COMMANDS = ["bash scripts/setup.sh && .venv/bin/rlkit train --config-name grpo_tiny_cpu",
            "bash scripts/setup.sh && .venv/bin/python -m pytest tests -n 2"]
# words of an issue tracker or of how and where the project was developed, and paths outside the
# repository ("session" alone is not here: Ray has session folders)
FORBIDDEN = [r"\bissue ?#?\d+", r"issue1", r"\blent\b", r"device time", r"\.\./shared", r"/work/",
             r"sandbox machine", r"(?<![#\w&/])#\d+\b"]
FENCE = re.compile(r"^(```|~~~)")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def readme_figures():
    spec = importlib.util.spec_from_file_location("readme_figures", ROOT / "scripts" / "readme_figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def prose_lines(path: Path) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line.strip()):
            fenced = not fenced
        elif not fenced:
            lines.append((number, line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen, found = {}, set()
    for _, line in prose_lines(path):
        match = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            found.add(base if count == 0 else f"{base}-{count}")
    return found


def test_marked_figures_equal_the_results_files():
    module = readme_figures()
    values = module.figures(*module.load_results())
    marked = module.marked(README.read_text())
    assert {name for name, _ in marked} == set(values), "every figure the results give is marked, and only those"
    wrong = [f"{name}: README has {text!r}, the results files give {values[name]!r}"
             for name, text in marked if text != values[name]]
    assert not wrong, "run `.venv/bin/python scripts/readme_figures.py write`:\n" + "\n".join(wrong)


def test_summary_line_parsing():
    parse = readme_figures().parse_summary
    assert parse("x\n812 passed, 13 skipped in 1290.5s (0:21:30)\n")["passed"] == 812
    full = parse("==== 3 failed, 800 passed, 13 skipped, 2 warnings, 1 error in 61.02s (0:01:01) ====")
    assert (full["failed"], full["passed"], full["skipped"], full["errors"], full["seconds"]) == (3, 800, 13, 1, 61.02)
    with pytest.raises(ValueError):
        parse("no summary here")


def test_first_command_block_is_the_two_commands():
    lines = README.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("```"))
    assert start < 40, f"the first command block starts on line {start + 1}; it must start within the first 40"
    end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("```"))
    assert end < 40, f"the first command block ends on line {end + 1}; it must end within the first 40"
    commands = [line for line in lines[start + 1:end] if line.strip() and not line.lstrip().startswith("#")]
    assert commands == COMMANDS


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_local_links_resolve(page):
    broken = []
    for number, line in prose_lines(page):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z]+:", target):  # http:, https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}:{number}: {target}: no file {file}")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                broken.append(f"{page.name}:{number}: {target}: no heading #{anchor} in {file.name}")
    assert not broken, "\n".join(broken)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_tracker_or_development_history_words(page):
    hits = [f"{page.name}:{number}: {line.strip()[:120]}"
            for number, line in enumerate(page.read_text().splitlines(), 1)
            for pattern in FORBIDDEN if re.search(pattern, line, re.IGNORECASE)]
    assert not hits, "\n".join(hits)
