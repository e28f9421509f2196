"""Every command in docs/*.md's bash blocks is checked as written (README's are run: test_readme_commands.py).

The docs' commands are reproductions and benchmarks of minutes to days, so they are not run here (CI's time
would not hold them): each is checked as far as it can be without running it —

- `fedmosaic run` / `compare` get `--check`: the CLI parses the command, validates its config and overrides,
  refuses an --out that exists and says if its data is not found, and runs and writes nothing;
- every other `fedmosaic` command (`report`, `--resume`) reads runs the commands above it make: the CLI's own
  parser checks its options;
- `python benchmarks/X.py ...`: the script exists and its --help offers every option the command passes;
- `bash benchmarks/gpu/X.sh ...`: the script parses (`bash -n`), and the sections and environment variables the
  command names are the script's.

A loop (`for x in a b; do ... done`) is checked with its first value. A command the harness cannot classify fails,
so a new kind of documented command needs a rule here.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from fedmosaic.cli.main import build_parser, main

REPO = Path(__file__).resolve().parents[1]
DOCS = sorted((REPO / "docs").glob("*.md"))
ENV = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def commands(text: str) -> list[list[str]]:
    """The commands of ``text``'s ```bash blocks as argument lists: continuation lines joined, comments, blank lines,
    `wait` and a trailing `&` dropped, environment assignments in front left out, and loop variables replaced by
    their loop's first value."""
    out = []
    for block in re.findall(r"^```bash\n(.*?)^```", text, re.M | re.S):
        loops = dict(re.findall(r"for (\w+) in (\S+)[^;]*; do", block))
        for line in block.replace("\\\n", " ").splitlines():
            for var, first in loops.items():
                line = line.replace(f"${var}", first)
            words = shlex.split(line, comments=True)
            while words and (words[0] in ("for", "do", "done;", "done") or words[0].startswith("done")):
                words = words[words.index("do") + 1:] if words[0] == "for" else words[1:]
            while words and ENV.match(words[0]):
                words = words[1:]
            words = [w for w in words if w not in ("&", "wait", "done;", "done")]
            if words:
                out.append(words)
    return out


CASES = [(doc.name, words) for doc in DOCS for words in commands(doc.read_text())]


def test_the_docs_have_commands():
    assert len(CASES) >= 40 and {d for d, _ in CASES} >= {"results.md", "benchmarks.md", "design.md"}


def _helps(scripts: set[str]) -> dict[str, str]:
    """Each benchmark script's --help, the scripts started at once (each imports torch: seconds apiece)."""
    procs = {s: subprocess.Popen([sys.executable, str(REPO / s), "--help"], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, cwd=REPO) for s in sorted(scripts)}
    out = {}
    for s, proc in procs.items():
        try:
            stdout, stderr = proc.communicate(timeout=180)
        finally:
            proc.kill()
        assert proc.returncode == 0, f"{s} --help: {stderr[-500:]}"
        out[s] = stdout
    return out


@pytest.mark.slow
def test_every_docs_command_is_valid_as_written(tmp_path, monkeypatch, capsys):
    for name in ("configs", "benchmarks", "docs", "src"):  # the commands run from the repository's root ...
        (tmp_path / name).symlink_to(REPO / name)
    monkeypatch.chdir(tmp_path)  # ... but write nothing there, and an --out that exists is refused: none does here
    helps = _helps({w[1] for _, w in CASES if w[0] == "python" and w[1].startswith("benchmarks/")
                    and (REPO / w[1]).is_file()})
    checked = 0
    for doc, words in CASES:
        cmd = f"{doc}: {shlex.join(words)}"
        if words[0] == "fedmosaic":
            argv = words[1:]
            if argv and argv[0] in ("run", "compare") and "--resume" not in argv:
                capsys.readouterr()
                assert main([*argv, "--check"]) == 0, f"{cmd}: {capsys.readouterr().err[-800:]}"
            else:
                build_parser().parse_args(argv)  # exits (fails the test) on an unknown option
        elif words[0] == "python" and words[1].startswith("benchmarks/"):
            assert (REPO / words[1]).is_file(), cmd
            text = helps[words[1]]
            for opt in (w for w in words[2:] if w.startswith("--")):
                assert opt in text, f"{cmd}: {words[1]} has no option {opt}"
        elif words[0] == "bash" and words[1].startswith("benchmarks/gpu/"):
            script = REPO / words[1]
            assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, cmd
            body = script.read_text()
            for section in words[2:]:
                assert f"section_{section}()" in body, f"{cmd}: {words[1]} has no section {section}"
            line = next(ln for ln in (doc_text(doc)).splitlines() if words[1] in ln)
            for var in re.findall(r"\b([A-Z_]+)=", line.split(words[1])[0]):
                if var not in ("FEDMOSAIC_DATA", "OMP_NUM_THREADS", "PYTHONPATH", "OUT"):
                    assert var in body, f"{cmd}: {words[1]} reads no {var}"
        elif words[:3] == ["git", "worktree", "add"]:
            assert subprocess.run(["git", "-C", str(REPO), "cat-file", "-e", f"{words[-1]}^{{commit}}"]).returncode \
                == 0 or not (REPO / ".git").exists(), f"{cmd}: no commit {words[-1]}"
        else:
            pytest.fail(f"{cmd}: no rule checks this kind of command (tests/test_docs_commands.py)")
        checked += 1
    assert checked == len(CASES)


def doc_text(name: str) -> str:
    return (REPO / "docs" / name).read_text()
