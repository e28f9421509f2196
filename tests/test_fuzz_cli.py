"""Hostile input at the real CLI entry point, in-process: mutated and garbage configs and ``--set`` lines.

Every case must end as either a run that completes (exit 0) or a non-zero exit with one line on stderr
(warnings aside) and no traceback — never an internal error, never a hang, never a file outside the runs
directory. No case's speed is asserted: a run the CLI accepted is stopped after a budget and counted as
accepted, and only a case with no answer at all after a limit no busy machine reaches is a hang. Cases are
generated from the seed corpus in ``tests/fuzz/corpus`` by a seeded generator, so CI sees the same cases every
time; set ``FEDMOSAIC_FUZZ_SEED`` / ``FEDMOSAIC_FUZZ_CASES`` to explore more.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import shutil
import signal
import time
from pathlib import Path

import pytest
import torch
import yaml
from fedtest import HANG_S, TimeLimit

from fedmosaic.cli.main import main

CORPUS = Path(__file__).parent / "fuzz" / "corpus"
SEED = int(os.environ.get("FEDMOSAIC_FUZZ_SEED", "0"))
CASES = int(os.environ.get("FEDMOSAIC_FUZZ_CASES", "400"))
# how long an accepted run (its run directory written) trains before the case moves on; nothing asserts on it
RUN_BUDGET_S = 10
MAX_FAILURES = int(os.environ.get("FEDMOSAIC_FUZZ_MAX_FAILURES", "15"))

# Values of every kind a hostile (or tired) user types: wrong types, out-of-range, non-finite, paths, huge.
WEIRD = [
    0, 1, 2, 3, 4, 7, -1, 10**9, -(10**9), 2**63, 2**100, 0.0, 0.5, -0.5, 0.9, 0.999, 1.0, 1.5, 1e-9, 1e-300,
    1e308, 100.0, float("inf"), float("-inf"), float("nan"), True, False, None, "", " ", "abc", "1", "0.1", "true",
    "../../escape", "/tmp/fedmosaic-fuzz-escape", "a/b", "nul\x00byte", "x" * 300, "é", "cpu", "meta", "mps",
    "cuda:7", "sgd", "adam", "fedavg", "fedprox", "mlp", "cnn4", "iid", "dirichlet", "shards", [], [1], [0, 1],
    [[]], [0.9, 1.0], {}, {"a": 1}, {"scheme": "iid"}, {"name": "fedavg"},
]
KEYS = ["rounds", "clients", "name", "lr", "alpha", "hidden", "scheme", "optimizer", "seed", "device", "x", "",
        "batch_size", "partition", "options", "augment", "classes", "heterogeneous", "compare", "every", "mu"]
GARBAGE_FILES = [
    b"", b"# only a comment\n", b"\n\n   \n", b"\xff\xfe\x00garbage", b"\x00\x01\x02", b"- 1\n- 2\n", b"42\n",
    b"just text\n", b"train: [1, 2\n", b"a: b: c\n", b"train:\n\trounds: 1\n", b"!!python/object:os.system {}\n",
    b"train: !!binary aGVsbG8=\n", b"name: 2020-01-01\n", b"{" * 5000, b"[" * 100_000, b"train: &a {rounds: *a}\n",
    b"a: &a [1,1,1,1,1,1,1,1,1,1]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
    b"d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d,*d]\nf: [*e,*e,*e,*e,*e,*e,*e,*e]\n",
    b"name: \"\\ud800\"\n", b"x: 1\n" * 300_000, b"train: {rounds: " + b"9" * 5000 + b"}\n",
]


def _leaves(node, path=()):
    if isinstance(node, dict):
        for k, v in node.items():
            yield path + (k,), v
            yield from _leaves(v, path + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield path + (i,), v
            yield from _leaves(v, path + (i,))


def _typo(key: str, rnd: random.Random) -> str:
    if not key:
        return "x"
    i = rnd.randrange(len(key))
    return rnd.choice([key[:i] + key[i + 1:], key[:i] + key[i] * 2 + key[i + 1:], key[:i] + "z" + key[i:]]) or "y"


def _mutate(cfg: dict, rnd: random.Random) -> dict:
    paths = [p for p, _ in _leaves(cfg)]
    path = rnd.choice(paths) if paths else ("x",)
    parent = cfg
    for p in path[:-1]:
        parent = parent[p]
    last = path[-1]
    op = rnd.randrange(6)
    if op <= 1:  # set to a weird value (most common)
        parent[last] = rnd.choice(WEIRD)
    elif op == 2 and isinstance(parent, dict):
        del parent[last]
    elif op == 3 and isinstance(parent, dict):
        parent[_typo(str(last), rnd)] = parent.pop(last)
    elif op == 4 and isinstance(parent, dict):
        parent[rnd.choice(KEYS)] = rnd.choice(WEIRD)
    else:  # a structure where a scalar belongs, or the other way round
        parent[last] = rnd.choice([{"x": 1}, [1, 2], {"rounds": 1}, 3, "section"])
    return cfg


def _set_line(rnd: random.Random, known: list[str]) -> str:
    if rnd.random() < 0.5:
        return rnd.choice(known)
    key = ".".join(rnd.choice(KEYS + ["train", "data", "model", "engine", "eval", "algorithm"])
                   for _ in range(rnd.randint(1, 3)))
    value = rnd.choice(["1", "0", "-1", "true", "1.5", ".inf", ".nan", "[]", "{}", "[1, 2", "abc", "", "null",
                        "{scheme: iid}", "x" * 200, "../x", "1e3", "0x10", "~", "'quoted'", "[" * 2000, "9" * 5000])
    return rnd.choice([f"{key}={value}", key, f"={value}", f"{key}=={value}"])


def generate(n: int, seed: int):
    """``n`` cases: (description, config file bytes or None, extra argv)."""
    rnd = random.Random(seed)
    seeds = {p.name: yaml.safe_load(p.read_text()) for p in sorted(CORPUS.glob("*.yaml"))}
    known = [ln for ln in (CORPUS / "sets.txt").read_text().splitlines() if ln and not ln.startswith("#")]
    cases = [(f"garbage file #{i}", data, []) for i, data in enumerate(GARBAGE_FILES)]
    cases += [(f"corpus {name}", yaml.safe_dump(cfg).encode(), []) for name, cfg in seeds.items()]
    cases += [(f"--set {line}", yaml.safe_dump(seeds["base.yaml"]).encode(), ["--set", line]) for line in known]
    while len(cases) < n:
        name = rnd.choice(sorted(seeds))
        cfg = yaml.safe_load(yaml.safe_dump(seeds[name]))  # a deep copy
        for _ in range(rnd.choice([0, 1, 1, 1, 2, 3])):
            cfg = _mutate(cfg, rnd)
        argv = []
        for _ in range(rnd.choice([0, 0, 1, 2])):
            argv += ["--set", _set_line(rnd, known)]
        try:
            data = yaml.safe_dump(cfg, allow_unicode=True).encode("utf-8", "surrogatepass")
        except yaml.YAMLError:
            continue
        cases.append((f"{name} mutated #{len(cases)}", data, argv))
    return cases[:n]


def _listing(root: Path) -> set[Path]:
    return {p for p in root.rglob("*")}


def _started(runs: Path) -> bool:
    """The CLI accepted the config and began the run (or a comparison's first variant)."""
    return any(runs.glob("*/meta.json")) or any(runs.glob("*/*/meta.json"))


@contextlib.contextmanager
def _case_guard(runs: Path):
    """Stop a case once it is an accepted run and RUN_BUDGET_S have passed, or, not accepted, after HANG_S
    (a hang). Checked every second from RUN_BUDGET_S on by an alarm; TimeLimit (a BaseException) escapes the
    CLI."""
    t0 = time.monotonic()

    def check(signum, frame):
        if _started(runs) or time.monotonic() - t0 >= HANG_S:
            # one asynchronous stop per case (a second, a second later, could land in the handling of the first);
            # should code that cannot raise (a finalizer) swallow it, the next comes HANG_S later
            signal.setitimer(signal.ITIMER_REAL, HANG_S)
            raise TimeLimit("case stopped")

    previous = signal.signal(signal.SIGALRM, check)
    signal.setitimer(signal.ITIMER_REAL, RUN_BUDGET_S, 1.0)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.slow
def test_hostile_configs_and_set_lines(tmp_path, monkeypatch):
    cases = generate(CASES, SEED)
    assert len(cases) == CASES
    sandbox = tmp_path / "sandbox"
    cwd = sandbox / "a" / "b" / "cwd"
    runs = cwd / "runs"
    cwd.mkdir(parents=True)
    monkeypatch.chdir(cwd)
    def escaped() -> set[Path]:  # what names like /tmp/fedmosaic-fuzz-escape or ../../escape would create
        return {*Path("/tmp").glob("fedmosaic-fuzz-escape*"), *Path("/").glob("escape*")}

    escaped_before = escaped()
    before = _listing(sandbox)
    threads = torch.get_num_threads()
    outcomes = {"completed": 0, "refused": 0, "long run": 0}
    failures = []
    t_start = time.perf_counter()
    for i, (what, data, argv) in enumerate(cases):
        cfg_file = cwd / "case.yaml"
        cfg_file.write_bytes(data)
        err, out = io.StringIO(), io.StringIO()
        started = False
        try:
            with _case_guard(runs), contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
                rc = main(["run", str(cfg_file), "--no-progress", "--runs-dir", str(runs), *argv])
        except TimeLimit:
            # accepted and training (a valid but long run, e.g. rounds: 1000000000) is not a hang
            started = _started(runs)
            rc = None
        except Exception as e:  # escaped the CLI: the user would have seen a traceback
            failures.append(f"{what}: TRACEBACK {type(e).__name__}: {str(e)[:200]} argv={argv}")
            rc = "raised"
        finally:
            torch.set_num_threads(threads)
        lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
        problems = [ln for ln in lines if not ln.startswith("fedmosaic: warning: ")]
        if rc == "raised":
            pass
        elif rc is None:
            if started:
                outcomes["long run"] += 1
            else:
                failures.append(f"{what}: HANG (no answer in {HANG_S}s) argv={argv}")
        elif rc == 0:
            outcomes["completed"] += 1
            if not any(runs.rglob("summary.json")):
                failures.append(f"{what}: exit 0 without a finished run; argv={argv}")
        else:
            outcomes["refused"] += 1
            if len(problems) != 1 or not problems[0].startswith("fedmosaic: error: ") or "Traceback" in err.getvalue():
                failures.append(f"{what}: exit {rc} with stderr {err.getvalue()[-600:]!r} argv={argv}")
        new = {p for p in _listing(sandbox) - before if runs not in p.parents and p != runs and p != cfg_file}
        new |= escaped() - escaped_before
        if new:
            failures.append(f"{what}: wrote outside the runs directory: {sorted(map(str, new))[:3]}")
            for p in new:
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        shutil.rmtree(runs, ignore_errors=True)
        if len(failures) >= MAX_FAILURES:
            break
    elapsed = time.perf_counter() - t_start
    print(f"{len(cases)} cases in {elapsed:.1f}s: {outcomes}")
    assert not failures, "\n".join(failures)
    # the generator must exercise both sides: configs that are accepted and inputs that are refused (how many
    # accepted runs finish within the budget depends on the machine, so the two kinds are counted together)
    assert outcomes["completed"] + outcomes["long run"] >= CASES // 10 and outcomes["refused"] >= CASES * 5 // 8, \
        outcomes  # (the default 400 cases: 56 and 344)
