"""The `rlkit train` commands the README and docs/ give a reader, in the order a reader meets them:
each bash block's lines (continuations joined, comments dropped), split as the shell splits them,
with the words after `rlkit train` kept (also after `&&`, or after `ray job submit ... --`); and the
README's custom environment example."""

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
ENV_EXAMPLE = re.compile(r"<!-- env-example -->\n```python\n(.*?)```.*?```bash\n(.*?)```", re.DOTALL)


def env_example() -> tuple[str, str]:
    """The README's custom environment: the code of its my_env.py, and the command that trains with it."""
    code, command = ENV_EXAMPLE.search(README.read_text()).groups()
    return code, command


@dataclass(frozen=True)
class TrainCommand:
    page: str  # relative to the repository
    line: int
    args: tuple[str, ...]  # the words after `rlkit train`

    def option(self, name: str) -> str | None:
        return self.args[self.args.index(name) + 1] if name in self.args else None

    @property
    def recipe(self) -> str:
        return self.option("--config-name")

    @property
    def overrides(self) -> list[str]:
        options = {"--config-name", "--config-dir", "--cfg"}
        return [word for i, word in enumerate(self.args)
                if word not in options and (i == 0 or self.args[i - 1] not in options)]

    def trains_on_cpu(self) -> bool:
        """A shipped CPU recipe that trains: not a printout (--cfg), the reader's own recipes
        (--config-dir) or a GPU recipe."""
        return self.option("--cfg") is None and self.option("--config-dir") is None and self.recipe.endswith("_cpu")

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: rlkit train {shlex.join(self.args)}"


def bash_lines(page: Path) -> list[tuple[int, str]]:
    """(line number, command) of each command line in the page's bash blocks."""
    found, in_block, pending = [], False, None
    for number, line in enumerate(page.read_text().splitlines(), 1):
        text = line.strip()
        if text.startswith("```"):
            in_block = text == "```bash"
            continue
        if not in_block:
            continue
        start, joined = pending if pending else (number, "")
        joined += text
        pending = (start, joined[:-1] + " ") if joined.endswith("\\") else None
        if pending is None and joined:
            found.append((start, joined))
    return found


def train_commands(page: Path) -> list[TrainCommand]:
    commands = []
    for number, line in bash_lines(page):
        words = shlex.split(line, comments=True)
        for i in range(len(words) - 1):
            if Path(words[i]).name == "rlkit" and words[i + 1] == "train":
                rest = words[i + 2:]
                end = rest.index("&&") if "&&" in rest else len(rest)
                commands.append(TrainCommand(str(page.relative_to(ROOT)), number, tuple(rest[:end])))
    return commands
