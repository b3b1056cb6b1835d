"""The user documentation as the tests read it: README.md and the manual's pages in docs/ (all
but DESIGN.md, the code's map), their ```bash blocks and the stallfree commands in them."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MANUAL = REPO / "docs"
NOT_MANUAL = {"DESIGN.md"}  # the architecture page: no commands to run


def manual_pages() -> list[Path]:
    """The manual's pages, docs/*.md but DESIGN.md."""
    return sorted(p for p in MANUAL.glob("*.md") if p.name not in NOT_MANUAL)


def pages() -> dict[str, str]:
    """README.md and every manual page, by path relative to the repository."""
    return {str(p.relative_to(REPO)): p.read_text() for p in [REPO / "README.md", *manual_pages()]}


def bash_lines(text: str) -> list[list[list[str]]]:
    """Each ```bash block as its lines, continuations joined, each line as its words; `;`, `&&`,
    `|` and `(` are words of their own, comments are dropped."""
    blocks = []
    for body in re.findall(r"^```bash\n(.*?)^```", text, re.MULTILINE | re.DOTALL):
        joined = re.sub(r"\\\n\s*", " ", body)
        lines = []
        for line in joined.splitlines():
            lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
            lexer.whitespace_split = True
            words = list(lexer)
            if words:
                lines.append(words)
        blocks.append(lines)
    return blocks


_CONTROL = {";", "&&", "||", "|", "(", ")", "until", "while", "if", "then", "do", "done", "!"}


def shell_commands(text: str) -> list[list[str]]:
    """Every simple command in the text's bash blocks, its leading VAR=value words dropped."""
    commands = []
    for block in bash_lines(text):
        for words in block:
            current: list[str] = []
            for word in [*words, ";"]:
                if word in _CONTROL:
                    if current:
                        commands.append(current)
                    current = []
                elif current or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", word):
                    current.append(word)
    return commands


def stallfree_argv(command: list[str]) -> list[str] | None:
    """The arguments stallfree gets from a command (`stallfree ...`, `python -m stallfree ...`,
    `torchrun ... -m stallfree ...`), or None when the command does not run stallfree."""
    if Path(command[0]).name == "stallfree":
        return command[1:]
    for i in range(len(command) - 1):
        if command[i : i + 2] == ["-m", "stallfree"]:
            return command[i + 2 :]
    return None


def stallfree_commands(text: str) -> list[list[str]]:
    """The arguments of every stallfree command in the text's bash blocks."""
    return [argv for argv in map(stallfree_argv, shell_commands(text)) if argv is not None]


def python_blocks(text: str) -> list[tuple[str, str]]:
    """Each ```python block with the HTML comment right above it ('' when there is none)."""
    found = re.findall(r"^(?:<!-- (.*?) -->\n)?```python\n(.*?)^```", text, re.MULTILINE | re.DOTALL)
    return [(marker, code) for marker, code in found]
