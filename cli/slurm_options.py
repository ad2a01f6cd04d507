"""The options at the head of a SLURM command's arguments, before its command or script, as srun
(cli/srun.py) and sbatch (cli/sbatch.py, and a script's ``#SBATCH`` lines, cli/sbatch_lines.py)
take them: ``--name=value``, ``--name value``, ``-Xvalue``, ``-X value``, flags; ``--`` ends them.
Each command knows its own options: the short letters and which take a value."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping


class Unreadable(ValueError):
    """An option this command does not have, or (``needs_value``) one without its value."""

    def __init__(self, shown: str, needs_value: bool = False) -> None:
        super().__init__(shown)
        self.shown = shown[:60]
        self.needs_value = needs_value


def option(word: str, short: Mapping[str, str]) -> tuple[str | None, str | None, str]:
    """The long name of the option ``word`` gives (None: not an option), its value where the word
    holds it (``--time=10``, ``-t10``), and the option as written, without its value."""
    if word.startswith("--") and len(word) > 2:
        name, eq, value = word[2:].partition("=")
        return name, value if eq else None, "--" + name
    if word.startswith("-") and len(word) > 1 and word[1] != "-":
        return short.get(word[1], word[1]), word[2:] or None, word[:2]
    return None, None, word


class Leading:
    """The options at the head of ``argv``, read as they are iterated, each as (long name, value or
    None, as written), so that a caller acting on each meets its errors in the order of the words;
    then ``rest``, the words after them, and ``dashes``, whether ``--`` ended them.
    ``takes_value(name)``: whether that option takes a value; None for one the command does not
    have (Unreadable, as for one without its value)."""

    def __init__(self, argv: list[str], short: Mapping[str, str], takes_value: Callable[[str], bool | None]) -> None:
        self.argv, self.short, self.takes_value = argv, short, takes_value
        self.rest: list[str] = []
        self.dashes = False

    def __iter__(self) -> Iterator[tuple[str, str | None, str]]:
        argv, at = self.argv, 0
        while at < len(argv) and argv[at].startswith("-") and argv[at] != "-":
            word = argv[at]
            at += 1
            if word == "--":
                self.dashes = True
                break
            name, value, shown = option(word, self.short)
            wants = None if name is None else self.takes_value(name)
            if name is None or wants is None:
                raise Unreadable(shown)
            if wants and value is None:
                if at == len(argv):
                    raise Unreadable(shown, needs_value=True)
                value, at = argv[at], at + 1
            yield name, value, shown
        self.rest = argv[at:]
